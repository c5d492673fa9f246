//! `events` mode: the index is what the engines' KV events say they hold, fed by `events::EventFeeds`,
//! plus this picker's recent decisions as guesses until the events arrive. The engines' blocks are
//! matched, so a prompt's tokens are the engine's (the rendered chat tokenized whole) and its chain
//! hangs off the pool's model, salted only by the body's `cache_salt`: the engines' events name no
//! model, and no header changes what an engine hashes.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use super::{ChainStart, Chat, Feeds, Placement, PoolIndex, Tokens};
use crate::config::{PoolConfig, WorkerConfig};
use crate::load::PeerGuesses;
use crate::prefix::{EventIndex, IndexStats, OwnerIndex, OwnerMatch, SourcedMatch, prefix_seed};
use crate::tokenize::{PoolTokenizer, Stop};
use crate::worker::WorkerId;

pub(super) struct Events(Arc<EventIndex>);

/// The other replicas' guesses (`replica_sync`), into an `events` pool's index.
pub(crate) struct PeerGuessesInto(pub(crate) Arc<EventIndex>);

impl std::fmt::Debug for PeerGuessesInto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerGuessesInto(EventIndex)")
    }
}

impl PeerGuesses for PeerGuessesInto {
    fn guess(&self, worker: WorkerId, checkpoints: &[u64], now: Instant) {
        self.0.peer_guess(worker, checkpoints, now);
    }
}

impl Events {
    pub(super) fn new(pool: &PoolConfig, capacities: &[usize]) -> Self {
        Events(Arc::new(EventIndex::for_pool(pool, capacities)))
    }
}

impl PoolIndex for Events {
    fn chat_tokens(&self, tokenizer: &PoolTokenizer, chat: Chat<'_>, stop: &Stop) -> Tokens {
        // The engine's block hashes are of its own tokens, so these must be too.
        tokenizer.engine_tokens(chat, stop)
    }

    fn seed(&self, start: &ChainStart<'_>) -> u64 {
        // The engines isolate tenants by vLLM's `cache_salt`, which the body carries (see
        // `events::apply` for the same seed on the events' side).
        prefix_seed(start.pool, start.body_salt)
    }

    fn matches(&self, hashes: &[u64], _block_size: NonZeroU32, now: Instant) -> Vec<OwnerMatch> {
        self.0.matches(hashes, now)
    }

    fn commit(&self, placed: &Placement<'_>) {
        // The engines' capacities bound what their events can make the index hold; every worker's,
        // not only the selected one's: the other replicas' decisions fill the others through events.
        let Placement {
            worker,
            chain,
            snapshot,
            pool,
            now,
            ..
        } = *placed;
        if self.0.capacity_outdated(snapshot.version) {
            for worker in snapshot.workers() {
                let capacity = super::capacity_blocks(pool, worker.capacity.max_total_tokens);
                self.0.set_capacity(worker.id, capacity);
            }
        }
        // The engine's events will say what it really cached; until then, a guess.
        self.0.speculate(worker, chain, now);
    }

    fn retract(&self, _worker: WorkerId, _added: &[u64]) {}

    fn confirm(&self, _worker: WorkerId, _chain: &[u64], _block_size: NonZeroU32) {}

    fn stats(&self) -> IndexStats {
        self.0.stats().index
    }

    fn events(&self) -> Option<&Arc<EventIndex>> {
        Some(&self.0)
    }

    fn depth_sources(&self, hashes: &[u64], now: Instant) -> Option<Vec<SourcedMatch>> {
        Some(self.0.sourced(hashes, now))
    }

    fn joined(&self, id: WorkerId, worker: &WorkerConfig, capacity: usize, feeds: &Feeds<'_>) {
        self.0.reset_worker(id, capacity);
        feeds.feeds.join(feeds.pool, id, worker);
    }

    fn left(&self, id: WorkerId, feeds: &Feeds<'_>) {
        feeds.feeds.leave(feeds.pool, id);
        self.0.reset_worker(id, 0);
    }

    fn restarted(&self, id: WorkerId, pool: &PoolConfig) {
        // The stream sees the restart too (its sequence starts over) and resets the same slots.
        for rank in 0..EventIndex::ranks_per_worker(pool) {
            if let Some(slot) = self.0.slot(id, rank) {
                self.0.clear(slot);
            }
        }
    }

    fn shareable(&self) -> Option<&OwnerIndex> {
        // A starting replica's events index is rebuilt from each engine's replay, not a sibling's.
        None
    }
}

//! `approximate` mode: the index is this picker's own decisions. Its chains are hashed from
//! cachepick's tokens (a chat tokenized segment by segment, so a conversation's turns share their
//! cached segments), seeded by the model the request names and salted by the tenant header as well
//! as the body's `cache_salt`; a report of the response can retract or confirm a credit.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use super::{ChainStart, Chat, Feeds, Placement, PoolIndex, Tokens};
use crate::config::{PoolConfig, WorkerConfig};
use crate::prefix::{EventIndex, IndexStats, OwnerIndex, OwnerMatch, SourcedMatch, prefix_seed};
use crate::tokenize::{PoolTokenizer, Stop};
use crate::worker::WorkerId;

pub(super) struct Approximate(OwnerIndex);

impl Approximate {
    pub(super) fn new(capacities: &[usize]) -> Self {
        Approximate(OwnerIndex::new(capacities))
    }
}

impl PoolIndex for Approximate {
    fn chat_tokens(&self, tokenizer: &PoolTokenizer, chat: Chat<'_>, stop: &Stop) -> Tokens {
        tokenizer.tokens_for_chat_within(chat, stop)
    }

    fn seed(&self, start: &ChainStart<'_>) -> u64 {
        let salt = match (start.tenant, start.body_salt) {
            // Length-prefixed, so no pair of tenant and body salt reads as another pair.
            (Some(tenant), Some(body)) => {
                Some(Cow::Owned(format!("{}:{tenant}\0{body}", tenant.len())))
            }
            (Some(tenant), None) => Some(Cow::Owned(format!("{}:{tenant}", tenant.len()))),
            (None, body) => body.map(Cow::Borrowed),
        };
        prefix_seed(start.model.unwrap_or(start.pool), salt.as_deref())
    }

    fn matches(&self, hashes: &[u64], block_size: NonZeroU32, _now: Instant) -> Vec<OwnerMatch> {
        self.0.matches(hashes, block_size)
    }

    fn commit(&self, placed: &Placement<'_>) {
        self.0.set_capacity(placed.worker, placed.capacity);
        self.0.insert(placed.worker, placed.chain);
    }

    fn retract(&self, worker: WorkerId, added: &[u64]) {
        // Last first, so that what remains is still a prefix of the chain.
        for &hash in added.iter().rev() {
            self.0.remove(worker, hash);
        }
    }

    fn confirm(&self, worker: WorkerId, chain: &[u64], block_size: NonZeroU32) {
        let depth = self
            .0
            .matches(chain, block_size)
            .into_iter()
            .find(|owner| owner.worker == worker)
            .map_or(0, |owner| owner.matched_tokens);
        let full = u64::from(block_size.get()).saturating_mul(chain.len() as u64);
        if depth < full {
            self.0.insert(worker, chain);
        }
    }

    fn stats(&self) -> IndexStats {
        self.0.stats()
    }

    fn events(&self) -> Option<&Arc<EventIndex>> {
        None
    }

    fn depth_sources(&self, _hashes: &[u64], _now: Instant) -> Option<Vec<SourcedMatch>> {
        None
    }

    fn joined(&self, id: WorkerId, _worker: &WorkerConfig, capacity: usize, _feeds: &Feeds<'_>) {
        // Whatever the slot's previous worker left behind (or a commit that raced its leaving) is not
        // this worker's.
        self.0.remove_worker(id);
        self.0.set_capacity(id, capacity);
    }

    fn left(&self, id: WorkerId, _feeds: &Feeds<'_>) {
        self.0.remove_worker(id);
    }

    fn restarted(&self, id: WorkerId, _pool: &PoolConfig) {
        self.0.clear_worker(id);
    }

    fn shareable(&self) -> Option<&OwnerIndex> {
        Some(&self.0)
    }
}

//! Where a pool learns who holds which prefix (`PoolConfig::index`), as one type: every step of the
//! request path that depends on the index mode asks the pool's [`PoolIndex`], so the picker has no
//! branch on the mode and a third mode is one more file here and one arm in [`for_pool`].
//!
//! - [`approximate`]: the index is this picker's own decisions, hashed from cachepick's tokens.
//! - [`events`]: the index is what the engines' KV events say, keyed by the engines' tokens, plus this
//!   picker's recent decisions as guesses until the events arrive.

mod approximate;
mod events;

pub(super) use events::PeerGuessesInto;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use crate::config::{IndexMode, PoolConfig, WorkerConfig};
use crate::events::EventFeeds;
use crate::load::PoolSnapshot;
use crate::prefix::{EventIndex, IndexStats, OwnerIndex, OwnerMatch, SourcedMatch};
use crate::tokenize::{Chat, PoolTokenizer, Stop, TokenizeError};
use crate::worker::WorkerId;

/// One pool's owner index, whatever feeds it.
pub(super) trait PoolIndex: Send + Sync {
    /// The tokens a chat prompt is matched by.
    fn chat_tokens(&self, tokenizer: &PoolTokenizer, chat: Chat<'_>, stop: &Stop) -> Tokens;

    /// The seed a prompt's block chain starts from.
    fn seed(&self, start: &ChainStart<'_>) -> u64;

    /// Every worker holding the prompt's first block, with how many leading tokens it holds, deepest
    /// first.
    fn matches(&self, hashes: &[u64], block_size: NonZeroU32, now: Instant) -> Vec<OwnerMatch>;

    /// Records that a worker was just sent a prompt.
    fn commit(&self, placed: &Placement<'_>);

    /// Takes back what a commit to `worker` added (`added`, in chain order), where the index holds
    /// only what this picker recorded; an index the engines feed corrects itself.
    fn retract(&self, worker: WorkerId, added: &[u64]);

    /// Records `chain` on `worker` again if something took part of it away since its commit, where
    /// the index holds only what this picker recorded.
    fn confirm(&self, worker: WorkerId, chain: &[u64], block_size: NonZeroU32);

    /// What the index holds. An `events` pool's are its engines'.
    fn stats(&self) -> IndexStats;

    /// The event-fed index, for the feeds and for explain; `None` in a mode without one.
    fn events(&self) -> Option<&Arc<EventIndex>>;

    /// Where each owner's depth of the prompt `hashes` comes from; `None` in a mode with one source.
    fn depth_sources(&self, hashes: &[u64], now: Instant) -> Option<Vec<SourcedMatch>>;

    /// Slot `id` has a new worker with `capacity` blocks: nothing the slot held before is its.
    fn joined(&self, id: WorkerId, worker: &WorkerConfig, capacity: usize, feeds: &Feeds<'_>);

    /// The worker of slot `id` left the roster.
    fn left(&self, id: WorkerId, feeds: &Feeds<'_>);

    /// The worker of slot `id` restarted: its cache is empty.
    fn restarted(&self, id: WorkerId, pool: &PoolConfig);

    /// What a starting sibling replica may adopt of this index (`route::warm`): the index of its own
    /// decisions, which no engine can replay; `None` where the engines' events rebuild it.
    fn shareable(&self) -> Option<&OwnerIndex>;
}

/// A prompt's tokens, or why it has none.
pub(super) type Tokens = Result<Vec<u32>, TokenizeError>;

/// What a prompt's block chain may start from: the model the request names, the pool's label, the
/// body's `cache_salt` and the salt header's value (`cache_salt_header`).
pub(super) struct ChainStart<'a> {
    pub model: Option<&'a str>,
    pub pool: &'a str,
    pub body_salt: Option<&'a str>,
    pub tenant: Option<&'a str>,
}

/// One request's prompt placed on a worker: `chain`, the blocks it may record, on `worker`, whose
/// capacity is `capacity` blocks, decided on `snapshot` of pool `pool` at `now`.
pub(super) struct Placement<'a> {
    pub worker: WorkerId,
    pub chain: &'a [u64],
    pub capacity: usize,
    pub snapshot: &'a PoolSnapshot,
    pub pool: &'a PoolConfig,
    pub now: Instant,
}

/// The pool's KV event streams, as a roster change reaches them.
pub(super) struct Feeds<'f> {
    pub feeds: &'f EventFeeds,
    pub pool: &'f str,
}

/// The index `pool` configures, its slots bounded by `capacities` (blocks).
pub(super) fn for_pool(pool: &PoolConfig, capacities: &[usize]) -> Arc<dyn PoolIndex> {
    match pool.index.mode {
        IndexMode::Approximate => Arc::new(approximate::Approximate::new(capacities)),
        IndexMode::Events => Arc::new(events::Events::new(pool, capacities)),
    }
}

/// The leading blocks of `hashes` one request may record: at most `index.commit_share` of the
/// worker's `capacity`, at least one block. Ownership is prefix-closed, so the leading blocks are the
/// ones a later request can match.
pub(super) fn credited_chain<'h>(
    pool: &PoolConfig,
    hashes: &'h [u64],
    capacity: usize,
) -> &'h [u64] {
    let share = pool.index.commit_share.get();
    // `as` saturates; capacities are far below f64's exact integers.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let most = ((capacity as f64) * share).floor() as usize;
    hashes.get(..most.max(1)).unwrap_or(hashes)
}

/// A worker's capacity in our blocks: the engine's KV tokens divided by our block size, at most
/// [`PoolConfig::MAX_REPORTED_CACHE_BLOCKS`] (a scrape is plaintext and may be garbled), else the pool's
/// configured default.
pub(super) fn capacity_blocks(pool: &PoolConfig, max_total_tokens: Option<u64>) -> usize {
    let block: u64 = NonZeroU32::get(pool.block_size).into();
    max_total_tokens
        .map(|tokens| {
            usize::try_from(tokens / block)
                .unwrap_or(usize::MAX)
                .clamp(1, PoolConfig::MAX_REPORTED_CACHE_BLOCKS)
        })
        .unwrap_or(pool.default_cache_blocks.get())
}

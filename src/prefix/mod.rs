//! Prompt prefixes: token blocks, their chained hashes, and which workers hold them.
//!
//! [`block_hashes`] turns a prompt's tokens into one hash per full block, each naming the whole prefix
//! up to its block; the [`OwnerIndex`] answers, per worker, how many leading blocks of a prompt it is
//! believed to hold, from cachepick's own routing decisions. Hashing is a compatibility contract
//! between replicas and releases (`hash.rs`, `README.md`); the index lives in memory, one per pool,
//! shared by every request task.
// Decisions are reproducible: no clock reads here (clippy.toml); `now` is an argument.
#![deny(clippy::disallowed_methods)]

mod checkpoint;
mod events;
mod hash;
mod index;
mod keyed;
mod lru;

#[cfg(test)]
mod tests;

pub use checkpoint::{MAX_CHECKPOINTS, checkpoint_depths, checkpoints, is_checkpoint};
pub use events::{DepthSource, EventIndex, EventIndexStats, Slot, SourcedMatch, Stored};
pub use hash::{block_hashes, block_hashes_into, prefix_seed};
pub use index::{IndexStats, OwnerIndex, OwnerMatch};

//! The engines' own account of their KV caches: vLLM and SGLang KV cache events, decoded, subscribed
//! to over ZeroMQ, and applied to a pool's owner index.
//!
//! - [`decode`]: one msgpack `EventBatch` payload → [`EventBatch`], in every encoding the engines
//!   publish (positional arrays, `type`-tagged maps, vLLM's and SGLang's field layouts). Pure and
//!   panic-free; it has a fuzz target.
//! - [`apply`]: a batch → the pool's [`EventIndex`](crate::prefix::EventIndex), for one stream's slot.
//! - [`subscriber`]: one engine rank's stream over ZeroMQ: sequence tracking, replay, resets,
//!   reconnection.
//! - [`stream`]: each stream's state and counters, read by metrics and the debug endpoints.
//! - [`zmtp`]: the ZeroMQ wire protocol, client side, with a byte limit on every frame.
//! - [`locate`]: where an engine says it publishes (vLLM's `/kv_event_sources`, SGLang's
//!   `/server_info`), taken only on the worker's own IP.
//! - [`EventFeeds`]: every stream of every `events` pool, started by `app`.
//!
//! The types here are the engines' vocabulary with the engines' hashes; nothing in them is keyed by
//! cachepick's own block hashes yet. The owner index re-keys blocks by their tokens (see `prefix`).
// Bad input is data here: the engines' bytes cross a network.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

pub mod apply;
pub mod decode;
mod feeds;
pub mod locate;
pub mod stream;
pub mod subscriber;
pub mod zmtp;

pub use feeds::{EventFeeds, PoolFeed};

/// Where an engine holds a block. Only [`Medium::Gpu`] blocks skip prefill; the others are offload
/// tiers, which a request still has to load back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// `"GPU"`, and an absent medium (engines that predate the field store on the GPU only).
    Gpu,
    /// `"CPU"` (vLLM offloading) and `"CPU_PINNED"` (SGLang's host tier).
    Cpu,
    /// `"DISK"`.
    Disk,
    /// `"EXTERNAL"`, or any name this release does not know.
    Other,
}

impl Medium {
    pub const ALL: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Disk, Medium::Other];

    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Disk => "disk",
            Medium::Other => "other",
        }
    }
}

/// One published batch: the `EventBatch` of vLLM and SGLang.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock time of the batch, in seconds since the epoch.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`; `None` when absent or nil.
    pub rank: Option<u32>,
    /// Events whose tag this release does not know; they are skipped and counted, not an error.
    pub unknown_events: u32,
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    /// The engine freed these blocks (by its own hashes) from `medium`.
    BlockRemoved {
        hashes: Vec<u64>,
        medium: Medium,
    },
    /// The engine dropped its whole cache (`/reset_prefix_cache`, a sleep).
    AllBlocksCleared,
}

/// Blocks the engine now holds: `hashes[i]` covers `tokens[i * block_size ..][..block_size]`, and the
/// last block may be shorter (an SGLang partial page).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockStored {
    /// The engine's own hashes, one per block, as 64-bit values (vLLM: the digest's last 8 bytes;
    /// SGLang: its first 8, as the signed value reinterpreted).
    pub hashes: Vec<u64>,
    /// The engine hash of the block before the first one; `None` for a prompt's first block.
    pub parent: Option<u64>,
    /// Every block's tokens, concatenated.
    pub tokens: Vec<u32>,
    /// Tokens per block as the engine reports it.
    pub block_size: u32,
    pub medium: Medium,
    /// The LoRA adapter the blocks belong to, when the engine names it.
    pub lora_name: Option<String>,
    /// The tenant's `cache_salt`, when the first block carries one (SGLang's trailing map; vLLM's
    /// `extra_keys` of a first block).
    pub cache_salt: Option<String>,
    /// The blocks carry keys other than a salt or the adapter (multimodal hashes): no text prompt
    /// can match them, so they never make an owner.
    pub opaque_extra_keys: bool,
}

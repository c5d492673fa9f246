//! The KV cache events a simulated worker publishes, byte for byte in the layout of the engine release
//! it imitates ([`KvEventsFormat`]), and the ZeroMQ sockets it publishes them on.
//!
//! # Wire
//! Every data-parallel rank has its own PUB socket. Each message is three frames:
//! `[topic, seq (u64 big-endian), payload]`, where `seq` counts the rank's batches from 0 since the
//! worker (re)started and `payload` is one msgpack `EventBatch`, `[ts (f64), [event, ...], rank]`
//! (vLLM's third field is `data_parallel_rank`, SGLang's `attn_dp_rank`). The events, by format:
//!
//! - `vllm_array` (vLLM ≤ 0.23), positional arrays with every field of the modern layout:
//!   `["BlockStored", [hash u64, ...], parent u64 | nil, [token, ...], block_size, nil (lora_id),
//!   "GPU", nil (lora_name), nil (extra_keys), 0 (group_idx), "full_attention", nil (sliding window)]`,
//!   `["BlockRemoved", [hash u64, ...], "GPU", 0 (group_idx)]`, `["AllBlocksCleared"]`.
//! - `vllm_map` (vLLM ≥ 0.24), msgspec `tag=True, omit_defaults=True` maps, tag first, fields in
//!   declaration order, fields at their default left out (those without a default are always there):
//!   `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
//!   "lora_id": nil, "medium": "GPU", "lora_name": nil, "group_idx": 0, "kv_cache_spec_kind":
//!   "full_attention"}`, `{"type": "BlockRemoved", "block_hashes", "medium": "GPU", "group_idx": 0}`,
//!   `{"type": "AllBlocksCleared"}`.
//! - `sglang`, positional arrays, one `BlockStored` per page, hashes as signed 64-bit integers (the
//!   simulator's hash reinterpreted): `["BlockStored", [hash i64], parent i64 | nil, [page tokens],
//!   block_size, nil (lora_id), "GPU"]`, `["BlockRemoved", [hash i64, ...], "GPU"]`,
//!   `["AllBlocksCleared"]`.
//!
//! The hashes are the simulator's own chained FNV-1a block hashes ([`crate::cache::block_hashes`]):
//! an engine's hashes are opaque to a subscriber too, which must key blocks by their tokens.
//!
//! # Replay
//! With replay on, every rank also has a ROUTER socket. A client (DEALER or REQ) sends
//! `["", start_seq (u64 big-endian)]`; the ROUTER sees `[identity, "", start_seq]` (anything but three
//! frames is ignored, as the engines do) and answers, for every batch still in the ring from
//! `start_seq` on, `[identity, "", topic, seq, payload]` (`vllm_map`, as vLLM 0.26) or
//! `[identity, "", seq, payload]` (`vllm_array` and `sglang`), then the end marker
//! `[identity, "", "", ff×8, ""]` or `[identity, "", ff×8, ""]` (seq −1, empty payload). The socket
//! strips the identity, so a DEALER receives the frames from the empty delimiter on. The ring keeps the
//! last `ring_batches` batches; older ones cannot be replayed, and the reply then starts later than
//! asked.
//!
//! # Faults
//! `POST /admin/kv-events` makes the next N batches skip the live socket while still taking their seq
//! (a subscriber sees a gap that replay heals), optionally also skipping the ring (a gap nothing
//! heals). A crash closes both sockets and loses the ring; the restarted worker counts from seq 0 again
//! and publishes nothing about the cache it lost, as a restarted engine does.

pub(crate) mod encode;
pub(crate) mod publisher;

use std::net::SocketAddr;

pub use crate::config::{KvEventsConfig, KvEventsFormat};
pub use encode::encode_batch;

/// Where one rank of a worker publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEventEndpoints {
    pub rank: u32,
    /// The PUB socket.
    pub live: SocketAddr,
    /// The ROUTER socket, when replay is on.
    pub replay: Option<SocketAddr>,
}

/// Where and how a worker publishes its KV cache events; fixed for its life (a restart binds the same
/// ports again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventEndpoints {
    pub format: KvEventsFormat,
    pub topic: String,
    /// Rank `r` at index `r`; ports are contiguous: `ranks[r].live.port() == ranks[0].live.port() + r`,
    /// and the same for `replay`.
    pub ranks: Vec<RankEventEndpoints>,
}

impl KvEventEndpoints {
    /// Rank 0's PUB endpoint as a ZeroMQ address, `tcp://ip:port`.
    pub fn live_endpoint(&self) -> Option<String> {
        self.ranks
            .first()
            .map(|rank| format!("tcp://{}", rank.live))
    }

    /// Rank 0's ROUTER endpoint as a ZeroMQ address, when replay is on.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.ranks
            .first()
            .and_then(|rank| rank.replay)
            .map(|addr| format!("tcp://{addr}"))
    }
}

/// The seq of the end-of-replay marker: −1 as eight big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xFF; 8];

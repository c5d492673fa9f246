//! The fleet simulator behind `cachepick sim`: GPU-free stand-ins for vLLM and SGLang workers that look
//! like the real engines from the network and whose KV cache and queue behave enough like one that
//! routing quality can be measured.
//!
//! # Layout
//! - [`config`], [`decode`]: the simulator's own file (`cachepick sim --config`) and `/admin/config`
//!   changes, decoded with the shared walker (`cachepick-decode`).
//! - [`cache`]: one data-parallel rank's KV block cache, the same under both timing models (chained
//!   block hashes, LRU of unreferenced blocks, pinned and anonymous blocks of running requests), and
//!   the cache events an engine would publish for it. Pure and synchronous: no clock, no I/O.
//! - [`model`]: the slots model's rank: the cache with at most `max_running` running and a FIFO queue.
//! - [`step`]: the step model, the default timing: per rank one engine loop whose steps share one
//!   token budget (vLLM V1's and SGLang's schedulers), each step priced by a calibrated GPU profile,
//!   KV blocks allocated per chunk with preemption, and the oracle's TTFT prediction. Pure.
//! - [`timing`]: the slots model (`timing: slots`), kept to reproduce earlier figures: how long each
//!   admitted request's own prefill and output tokens take, from the parameters and the running count.
//!   Pure.
//! - [`wire`]: the OpenAI and SGLang request bodies the workers accept and the JSON and SSE they answer.
//! - [`expo`]: the engine's `/metrics` exposition (vLLM or SGLang names), SGLang's `/v1/loads`, and the
//!   discovery documents (`/v1/models`, `/version`, `/server_info`, `/model_info`).
//! - [`kv_events`]: the KV cache events the ranks publish over ZeroMQ (PUB live, ROUTER replay), in
//!   the layout of vLLM ≤ 0.23, vLLM ≥ 0.24 or SGLang, from the events the model records.
//! - [`server`]: one worker's HTTP server: request lifecycle, vLLM's render endpoints (a prompt's token
//!   ids), admin controls, crash and restart.
//! - [`offline`]: one worker in virtual time (the step model's ranks, the API loop, the histograms and
//!   the exposition, every time passed in), for `cachepick replay --clock virtual`.
//! - [`fleet`]: N workers on loopback, the cachepick config that fronts them, and the fleet control.
//!
//! This crate does not depend on cachepick (Cargo enforces it): it parses bodies, hashes blocks and
//! keeps its cache with code of its own, so it cannot agree with the picker by construction. It shares
//! only the model's tokenizer and chat template (`cachepick-tokenizer`), as a real engine shares the
//! model's tokenizer with the router in front of it, and the YAML walker its configuration is decoded
//! with (`cachepick-decode`); and it tokenizes the whole rendered prompt at once, as engines do, not
//! segment by segment as the picker does.

pub mod cache;
pub mod config;
pub mod decode;
pub mod expo;
pub mod fleet;
pub mod kv_events;
pub mod model;
mod net;
pub mod offline;
pub mod server;
pub mod stats;
pub mod step;
pub mod timing;
pub mod wire;

pub use config::{Engine, KvEventsConfig, KvEventsFormat, SimConfig, SimParams, Timing};
pub use decode::SimOverrides;

//! Validated configuration of the fleet simulator (`cachepick sim`). Decoded by [`crate::decode`] with
//! the same rules as cachepick's own file: every problem listed, unknown keys rejected.

use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

pub use cachepick_tokenizer::{TiktokenEncoding, TokenizerConfig};

/// The engine a simulated worker imitates: its metric names, endpoints and wire formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    pub const ALL: [Engine; 2] = [Engine::Vllm, Engine::Sglang];

    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

/// A simulated fleet: N identical workers of one engine kind on loopback.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub engine: Engine,
    /// The model name the workers serve and report in `/v1/models`.
    pub model: String,
    pub workers: NonZeroU32,
    /// Loopback address the workers bind; a non-loopback address is refused.
    pub host: IpAddr,
    /// Worker `i` listens on `base_port + i`; `None` takes ephemeral ports.
    pub base_port: Option<u16>,
    /// Seeds every worker's random draws (jitter, failures, output text); worker `i` uses `seed + i`.
    pub seed: u64,
    /// The engine's own KV block (page) size in tokens.
    pub block_size: NonZeroU32,
    pub tokenizer: TokenizerConfig,
    pub chat_template: Option<PathBuf>,
    /// Data-parallel ranks per worker, each with its own KV cache and queue.
    pub dp_size: NonZeroU32,
    /// The model parameters that can also be changed at run time through `/admin/config`.
    pub params: SimParams,
    /// KV cache events published over ZeroMQ as the engine does; `None` publishes nothing.
    pub kv_events: Option<KvEventsConfig>,
}

impl SimConfig {
    pub const DEFAULT_MODEL: &'static str = "sim-model";
    pub const DEFAULT_HOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    pub const DEFAULT_BLOCK_SIZE: u32 = 16;
    pub const DEFAULT_SEED: u64 = 0;
    /// Workers one process runs; each holds a KV map and a listener, so thousands are a typo.
    pub const MAX_WORKERS: u32 = 256;

    /// A fleet of `workers` engines of kind `engine` with every other setting at its default.
    pub fn new(engine: Engine, workers: NonZeroU32) -> SimConfig {
        SimConfig {
            engine,
            model: Self::DEFAULT_MODEL.to_owned(),
            workers,
            host: Self::DEFAULT_HOST,
            base_port: None,
            seed: Self::DEFAULT_SEED,
            block_size: NonZeroU32::new(Self::DEFAULT_BLOCK_SIZE).unwrap_or(NonZeroU32::MIN),
            tokenizer: TokenizerConfig::default(),
            chat_template: None,
            dp_size: NonZeroU32::MIN,
            params: SimParams::default(),
            kv_events: None,
        }
    }
}

/// The wire encoding of the KV cache events a simulated worker publishes: one engine release's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvEventsFormat {
    /// vLLM up to 0.23: every event a positional array tagged by its first element; replies to a
    /// replay request without the topic frame.
    VllmArray,
    /// vLLM from 0.24 on: every event a `type`-tagged map without its default-valued fields; replay
    /// replies carry the topic frame (vLLM 0.26).
    VllmMap,
    /// SGLang: positional arrays, one `BlockStored` per page, hashes as signed 64-bit integers.
    Sglang,
}

impl KvEventsFormat {
    pub const ALL: [KvEventsFormat; 3] = [
        KvEventsFormat::VllmArray,
        KvEventsFormat::VllmMap,
        KvEventsFormat::Sglang,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KvEventsFormat::VllmArray => "vllm_array",
            KvEventsFormat::VllmMap => "vllm_map",
            KvEventsFormat::Sglang => "sglang",
        }
    }

    /// The engine that publishes this format.
    pub fn engine(self) -> Engine {
        match self {
            KvEventsFormat::VllmArray | KvEventsFormat::VllmMap => Engine::Vllm,
            KvEventsFormat::Sglang => Engine::Sglang,
        }
    }

    /// The format an engine's current release publishes.
    pub fn default_for(engine: Engine) -> KvEventsFormat {
        match engine {
            Engine::Vllm => KvEventsFormat::VllmMap,
            Engine::Sglang => KvEventsFormat::Sglang,
        }
    }
}

/// How a simulated worker publishes its KV cache events (`kv_events:` in the simulator's file).
///
/// Every rank of every worker has a ZeroMQ PUB socket (the live stream) and, with `replay`, a ROUTER
/// socket that answers replay requests from a ring of recent batches. A worker's ranks have contiguous
/// ports, as engines bind `port + rank`: rank `r` publishes on `live + r` and replays on `replay + r`.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    pub format: KvEventsFormat,
    /// Serve replay requests (a ROUTER socket per rank).
    pub replay: bool,
    /// Batches the replay ring keeps per rank (vLLM's `buffer_steps`).
    pub ring_batches: NonZeroU32,
    /// The first frame of every live message (and of vLLM-map replay replies); engines default to
    /// the empty topic.
    pub topic: String,
    /// Worker `i`'s rank 0 publishes on `base_port + i * stride` and replays on that plus `dp_size`,
    /// where `stride` is `dp_size`, doubled with replay; `None` takes free ports.
    pub base_port: Option<u16>,
}

impl KvEventsConfig {
    pub const DEFAULT_RING_BATCHES: u32 = 10_000;
    /// The replay ring holds encoded batches; a million of them is already gigabytes.
    pub const MAX_RING_BATCHES: u32 = 1_000_000;

    /// Events in `format` with replay on, the default ring, the empty topic and free ports.
    pub fn new(format: KvEventsFormat) -> KvEventsConfig {
        KvEventsConfig {
            format,
            replay: true,
            ring_batches: NonZeroU32::new(Self::DEFAULT_RING_BATCHES).unwrap_or(NonZeroU32::MIN),
            topic: String::new(),
            base_port: None,
        }
    }
}

/// One worker's model parameters (per data-parallel rank where it matters). Defaults resemble an 8B
/// model on one data-center GPU; every value is a knob, not a claim about a specific engine.
#[derive(Clone, Debug, PartialEq)]
pub struct SimParams {
    /// KV blocks per rank.
    pub kv_blocks: NonZeroU32,
    /// Requests a rank runs at once (continuous batching); the rest wait in FIFO order.
    pub max_running: NonZeroU32,
    /// Waiting requests a rank accepts before answering 503; `None` is unbounded.
    pub max_queue: Option<u32>,
    /// Prompt plus output tokens one request may hold; beyond it the request is a 400.
    pub max_model_len: NonZeroU32,
    /// Output tokens when the request sets no `max_tokens`.
    pub default_max_tokens: NonZeroU32,
    /// Fixed cost of a prefill step.
    pub prefill_overhead: Duration,
    /// Prefill cost per uncached prompt token: cache hits shorten time to first token through this.
    pub prefill_per_token: Duration,
    /// Time between two output tokens.
    pub inter_token_latency: Duration,
    /// Slow-down factor of every step when the rank runs `max_running` requests; it grows linearly from
    /// 1 with one request running. 1 disables it.
    pub load_slowdown: f64,
    /// Relative standard deviation of every duration, in [0, 0.5]; 0 is exact.
    pub jitter: f64,
    /// Multiplies every modelled duration: 0.01 runs the model a hundred times faster than real time.
    pub time_scale: f64,
    /// Share of requests failed with a 500 before they are queued, in [0, 1].
    pub failure_rate: f64,
}

impl Default for SimParams {
    fn default() -> Self {
        let nz = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        SimParams {
            kv_blocks: nz(8192),
            max_running: nz(64),
            max_queue: None,
            max_model_len: nz(131_072),
            default_max_tokens: nz(64),
            prefill_overhead: Duration::from_millis(10),
            prefill_per_token: Duration::from_micros(100),
            inter_token_latency: Duration::from_millis(20),
            load_slowdown: 2.0,
            jitter: 0.0,
            time_scale: 1.0,
            failure_rate: 0.0,
        }
    }
}

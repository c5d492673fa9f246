//! Validated configuration of the fleet simulator (`cachepick sim`). Decoded by [`crate::decode`] with
//! the same rules as cachepick's own file: every problem listed, unknown keys rejected.

use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

pub use cachepick_tokenizer::{TiktokenEncoding, TokenizerConfig};

pub use crate::step::{Profile, SchedulePolicy};

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

/// How a simulated rank's time is modelled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Timing {
    /// One GPU running one step at a time over one token budget ([`crate::step`]): the default.
    #[default]
    Step,
    /// The earlier model, kept so its figures can be reproduced: every admitted request its own
    /// prefill and token gaps, slowed by the running count ([`crate::timing`], [`crate::model`]).
    Slots,
}

impl Timing {
    pub const ALL: [Timing; 2] = [Timing::Step, Timing::Slots];

    pub fn as_str(self) -> &'static str {
        match self {
            Timing::Step => "step",
            Timing::Slots => "slots",
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
    /// The timing model; fixed for the fleet's life.
    pub timing: Timing,
    /// The model parameters that can also be changed at run time through `/admin/config`.
    pub params: SimParams,
    /// KV cache events published over ZeroMQ as the engine does; `None` publishes nothing.
    pub kv_events: Option<KvEventsConfig>,
    /// SGLang only: the first N workers run `disaggregation_mode: prefill` and the rest `decode`;
    /// `None` runs every worker aggregated. (vLLM's workers serve either leg of a disaggregated
    /// request without a mode.)
    pub prefill_workers: Option<u32>,
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
            timing: Timing::Step,
            params: SimParams::step(engine, &Profile::default()),
            kv_events: None,
            prefill_workers: None,
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
    /// How long each rank waits before answering a replay request (and publishes nothing meanwhile):
    /// a test's stand-in for a long ring on a slow link. Not in the file; zero unless a test sets it.
    pub replay_delay: std::time::Duration,
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
            replay_delay: std::time::Duration::ZERO,
        }
    }
}

/// One worker's model parameters (per data-parallel rank where it matters). Under the step model the
/// defaults are a named profile's (Llama-3.1-8B on one H100 unless another is chosen) and the engine's
/// own defaults for that GPU; under the slots model they are the earlier knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct SimParams {
    /// KV blocks per rank.
    pub kv_blocks: NonZeroU32,
    /// Requests a rank runs at once (vLLM's `max_num_seqs`, SGLang's `max_running_requests`; under the
    /// slots model its running slots); the rest wait in FIFO order.
    pub max_running: NonZeroU32,
    /// Waiting requests a rank accepts before answering 503; `None` is unbounded.
    pub max_queue: Option<u32>,
    /// Prompt plus output tokens one request may hold; beyond it the request is a 400.
    pub max_model_len: NonZeroU32,
    /// Output tokens when the request sets no `max_tokens`.
    pub default_max_tokens: NonZeroU32,
    /// Step model: the GPU's coefficients.
    pub profile: Profile,
    /// Step model: tokens one step computes (vLLM's `max_num_batched_tokens`, SGLang's
    /// `chunked_prefill_size`).
    pub batch_tokens: NonZeroU32,
    /// Step model, SGLang: new input tokens per prefill batch (`max_prefill_tokens`).
    pub max_prefill_tokens: NonZeroU32,
    /// Step model, SGLang: the waiting queue's order (`schedule_policy`).
    pub schedule_policy: SchedulePolicy,
    /// Slots model: fixed cost of a prefill step.
    pub prefill_overhead: Duration,
    /// Slots model: prefill cost per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Slots model: time between two output tokens.
    pub inter_token_latency: Duration,
    /// Slots model: slow-down factor of every step when the rank runs `max_running` requests; it grows
    /// linearly from 1 with one request running. 1 disables it.
    pub load_slowdown: f64,
    /// Relative standard deviation of every duration, in [0, 0.5]; 0 is exact.
    pub jitter: f64,
    /// Multiplies every modelled duration: 0.01 runs the model a hundred times faster than real time.
    pub time_scale: f64,
    /// Share of requests failed with a 500 before they are queued, in [0, 1].
    pub failure_rate: f64,
    /// How a vLLM worker behaves as either leg of a disaggregated request.
    pub pd: PdParams,
}

/// vLLM's NixlConnector as the simulator models it (`kv_role: kv_both`: any vLLM worker serves either
/// leg, the router decides). A prefill leg (`kv_transfer_params.do_remote_decode`) that ends on its
/// output cap answers the parameters a decode worker pulls with, and leases its prompt's KV for
/// `lease`; a decode leg (`do_remote_prefill`) claims the lease from the prefill worker, waits while
/// the KV it lacks crosses its link, then runs with those tokens held. Not modelled: the prefill
/// worker's blocks stay evictable during the lease (vLLM pins them), and only the decode side's link
/// is shared.
#[derive(Clone, Debug, PartialEq)]
pub struct PdParams {
    /// The decode worker's link, bytes per second, shared first come first served by its transfers.
    /// 50 GB/s is one 400 Gb/s RDMA NIC per GPU.
    pub link_bytes_per_second: f64,
    /// How long (model time) a prefill worker keeps a finished prefill's KV for its decode worker
    /// (vLLM's `kv_lease_duration`, 30 s).
    pub lease: Duration,
    /// What a decode worker does when the KV cannot be pulled (vLLM's `kv_load_failure_policy`).
    pub load_failure: LoadFailure,
}

/// vLLM's `kv_load_failure_policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFailure {
    /// The request fails (vLLM's default).
    Fail,
    /// The decode worker prefills the prompt itself.
    Recompute,
}

impl Default for PdParams {
    fn default() -> Self {
        PdParams {
            link_bytes_per_second: 50e9,
            lease: Duration::from_secs(30),
            load_failure: LoadFailure::Fail,
        }
    }
}

impl SimParams {
    /// The step model's defaults for `engine` on `profile`'s GPU: its KV pool, and the engine's own
    /// batch defaults there (vLLM's `get_batch_defaults`, SGLang's `chunked_prefill_size` and
    /// `max_running_requests` rules).
    pub fn step(engine: Engine, profile: &Profile) -> SimParams {
        let nz = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        let slots = SimParams::slots();
        let (batch_tokens, max_running) = match engine {
            Engine::Vllm => (profile.vllm_batch_tokens, profile.vllm_max_seqs),
            Engine::Sglang => (
                profile.sglang_chunk,
                sglang_max_running(profile.kv_blocks, slots.max_model_len.get()),
            ),
        };
        SimParams {
            kv_blocks: nz(profile.kv_blocks),
            max_running: nz(max_running),
            profile: profile.clone(),
            batch_tokens: nz(batch_tokens),
            max_prefill_tokens: nz(profile.sglang_max_prefill),
            ..slots
        }
    }

    /// The slots model's defaults: knobs that resemble an 8B model on one data-center GPU, not a claim
    /// about a specific engine.
    pub fn slots() -> SimParams {
        let nz = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        let profile = Profile::default();
        SimParams {
            kv_blocks: nz(8192),
            max_running: nz(64),
            max_queue: None,
            max_model_len: nz(131_072),
            default_max_tokens: nz(64),
            batch_tokens: nz(profile.vllm_batch_tokens),
            max_prefill_tokens: nz(profile.sglang_max_prefill),
            schedule_policy: SchedulePolicy::Fcfs,
            profile,
            prefill_overhead: Duration::from_millis(10),
            prefill_per_token: Duration::from_micros(100),
            inter_token_latency: Duration::from_millis(20),
            load_slowdown: 2.0,
            jitter: 0.0,
            time_scale: 1.0,
            failure_rate: 0.0,
            pd: PdParams::default(),
        }
    }

    /// The defaults of `timing` for `engine`.
    pub fn defaults(timing: Timing, engine: Engine) -> SimParams {
        match timing {
            Timing::Step => SimParams::step(engine, &Profile::default()),
            Timing::Slots => SimParams::slots(),
        }
    }
}

/// SGLang's default `max_running_requests`: `min(max(kv_tokens / context_len × 512, 2048), 4096)`
/// (`model_runner.py`), with 16-token blocks.
pub fn sglang_max_running(kv_blocks: u32, context_len: u32) -> u32 {
    let tokens = f64::from(kv_blocks) * 16.0;
    let by_memory = (tokens / f64::from(context_len.max(1)) * 512.0) as u32;
    by_memory.clamp(2048, 4096)
}

impl Default for SimParams {
    /// The step model's defaults for vLLM on the default profile.
    fn default() -> Self {
        SimParams::step(Engine::Vllm, &Profile::default())
    }
}

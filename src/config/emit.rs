//! The effective configuration rendered back into the file's own format.
//!
//! Every key is written, defaults and derived values included (e.g. each worker's `metrics_url`), so the
//! output shows what is actually in force and parses back to an equal [`Config`]. Optional values that
//! are not set (the queue gate, capacity overrides, a `loads_url` for a worker reading metrics, a chat
//! template) are left out, since writing them would set them.
//!
//! The top-level `policy` is written whole: its mode and every key that mode reads. A pool's `policy` is
//! written as what differs from it — the keys whose value differs, or, when the pool runs another mode,
//! that mode with every key it reads — so that the output, like the file, keeps the top level as the
//! pools' default and a flag given with it still reaches the pools that do not set the key themselves.
//! (A file cannot take an inherited gate away from a pool, so a pool without the queue gate or floor
//! that the top level has can only come from code, and is written without it.) Every struct below with
//! an optional key is `skip_serializing_none`: `None` is left out, `Some(None)` is written `null`.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;

use serde::Serialize;

use cachepick_decode::{duration, size};

use super::{
    Config, Discovery, GateUnit, Gating, Handshake, IndexConfig, IndexMode, IndexSockets,
    KvEventsFrom, Mode, ModelMatch, PdConfig, PodSelection, PolicyConfig, PoolConfig,
    TokenizerConfig, UnknownSubset, WorkerConfig,
};
use crate::worker::{Engine, Role};

impl Config {
    /// The effective configuration (file, flags and defaults merged) as YAML with the file's keys.
    pub fn to_yaml(&self) -> String {
        // Everything below is strings, numbers and plain structs, which serde_yaml always renders.
        serde_yaml::to_string(&File::from(self))
            .unwrap_or_else(|error| format!("# cannot render the configuration: {error}\n"))
    }
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct File<'c> {
    listen: SocketAddr,
    metrics_listen: SocketAddr,
    max_body_bytes: Size,
    /// Absent: on only where the listener is bound to loopback.
    debug_endpoints: Option<bool>,
    debug_token_file: Option<&'c Path>,
    tls: Option<ListenerTls<'c>>,
    metrics_http: MetricsHttp,
    cache_salt_header: Option<&'c str>,
    unknown_subset: UnknownSubset,
    policy: Policy,
    load: Load<'c>,
    overload: Overload,
    feedback: Feedback,
    replica_sync: Option<ReplicaSync<'c>>,
    tracing: Tracing<'c>,
    pools: Vec<Pool<'c>>,
}

/// `tracing`: the endpoint only when set (absent: off).
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Tracing<'c> {
    otlp_endpoint: Option<&'c str>,
    sample_ratio: f64,
    service_name: &'c str,
}

/// `replica_sync`, every key written (`key_file` when set).
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct ReplicaSync<'c> {
    listen: SocketAddr,
    peers: Vec<String>,
    key_file: Option<&'c Path>,
    max_datagrams_per_second: u32,
    resolve_interval: String,
}

/// `feedback`, every key written.
#[derive(Serialize)]
struct Feedback {
    enabled: bool,
    wait: String,
}

/// `tls` (the ext_proc listener).
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct ListenerTls<'c> {
    cert_file: &'c Path,
    key_file: &'c Path,
    client_ca_file: Option<&'c Path>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    allowed_client_identities: &'c [String],
    reload_interval: String,
}

/// `load.tls`.
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct ScrapeTls<'c> {
    ca_file: &'c Path,
    cert_file: Option<&'c Path>,
    key_file: Option<&'c Path>,
    server_name: Option<&'c str>,
}

/// `metrics_http`.
#[derive(Serialize)]
struct MetricsHttp {
    max_connections: usize,
    header_read_timeout: String,
    request_timeout: String,
    connection_lifetime: String,
}

/// The `overload` section, every key written.
#[derive(Serialize)]
struct Overload {
    message_timeout: String,
    decision_deadline: String,
    max_queued_decisions: usize,
    max_buffered_bytes: Size,
    max_concurrent_streams: u32,
    max_connections: usize,
    idle_timeout: String,
    first_stream_timeout: String,
    stream_deadline: String,
    explain_rate: u32,
    shutdown_grace: String,
}

impl From<&crate::config::OverloadConfig> for Overload {
    fn from(overload: &crate::config::OverloadConfig) -> Self {
        Overload {
            message_timeout: duration::format(overload.message_timeout),
            decision_deadline: duration::format(overload.decision_deadline),
            max_queued_decisions: overload.max_queued_decisions.get(),
            max_buffered_bytes: overload.max_buffered_bytes.get().into(),
            max_concurrent_streams: overload.max_concurrent_streams.get(),
            max_connections: overload.max_connections.get(),
            idle_timeout: duration::format(overload.idle_timeout),
            first_stream_timeout: duration::format(overload.first_stream_timeout),
            stream_deadline: duration::format(overload.stream_deadline),
            explain_rate: overload.explain_rate.get(),
            shutdown_grace: duration::format(overload.shutdown_grace),
        }
    }
}

/// A `policy` section; a key is written when it is `Some`.
#[serde_with::skip_serializing_none]
#[derive(Clone, Default, PartialEq, Serialize)]
struct Policy {
    mode: Option<&'static str>,
    /// `Some(None)` is written `null`: the gate (or its floor) turned off.
    worker_queue_limit: Option<Option<u64>>,
    saturation_queue_floor: Option<Option<u64>>,
    min_load_choices: Option<usize>,
    min_match_tokens: Option<u64>,
    min_match_share: Option<f64>,
    pin_depth_ratio: Option<f64>,
    /// Written at the top level under `cache_aware`, and in a pool where its unit differs from the top
    /// level's: the file then reads the same whatever the default unit is.
    gate_unit: Option<&'static str>,
    divert_margin: Option<String>,
    saturation_wait_floor: Option<Option<String>>,
    prefill_tokens_per_second: Option<u64>,
    balance_abs_threshold: Option<u64>,
    balance_rel_threshold: Option<f64>,
    cache_threshold: Option<f64>,
    max_fallbacks: Option<usize>,
}

impl Policy {
    /// Every key `policy` sets: its mode, the keys that mode reads, and the shared ones.
    fn whole(policy: &PolicyConfig) -> Policy {
        let mut section = Policy {
            mode: Some(policy.mode.kind().as_str()),
            max_fallbacks: Some(policy.max_fallbacks),
            ..Policy::default()
        };
        match &policy.mode {
            Mode::CacheAware(knobs) => {
                section.gate_unit = Some(knobs.gating.unit().as_str());
                match knobs.gating {
                    Gating::Requests(gate) => {
                        section.worker_queue_limit = Some(gate.map(|gate| gate.limit()));
                        section.saturation_queue_floor = Some(gate.and_then(|gate| gate.floor()));
                    }
                    Gating::PrefillTime(wait) => {
                        section.divert_margin = Some(duration::format(wait.divert_margin));
                        section.saturation_wait_floor = Some(wait.floor.map(duration::format));
                        section.prefill_tokens_per_second = wait.fallback_rate.map(NonZeroU64::get);
                    }
                }
                section.min_load_choices = Some(knobs.min_load_choices.get());
                section.min_match_tokens = Some(knobs.min_match_tokens);
                section.min_match_share = Some(knobs.min_match_share.get());
                section.pin_depth_ratio = Some(knobs.pin_depth_ratio.get());
            }
            Mode::RoundRobin | Mode::LeastLoad => {}
            Mode::BalanceThreshold(knobs) => {
                section.balance_abs_threshold = Some(knobs.abs_threshold);
                section.balance_rel_threshold = Some(knobs.rel_threshold.get());
                section.cache_threshold = Some(knobs.cache_threshold.get());
            }
        }
        section
    }

    /// What a pool's section must say for the pool to run `pool` under the top-level `base`: under
    /// the same mode, the keys whose value differs; under another, that mode and every key it reads
    /// (nothing of another mode is inherited). The shared keys are written when they differ.
    fn over(pool: &PolicyConfig, base: &PolicyConfig) -> Policy {
        let mine = Policy::whole(pool);
        let theirs = Policy::whole(base);
        let fallbacks = differs(mine.max_fallbacks, theirs.max_fallbacks);
        if pool.mode.kind() != base.mode.kind() {
            return Policy {
                max_fallbacks: fallbacks,
                ..mine
            };
        }
        // A pool whose unit differs says so, even when it is the default one.
        let unit_of = |policy: &PolicyConfig| {
            policy
                .cache_aware()
                .map_or(GateUnit::default(), |knobs| knobs.gating.unit())
        };
        let gate_unit = (unit_of(pool) != unit_of(base)).then(|| unit_of(pool).as_str());
        Policy {
            mode: None,
            gate_unit,
            divert_margin: differs(mine.divert_margin, theirs.divert_margin),
            saturation_wait_floor: differs(
                mine.saturation_wait_floor,
                theirs.saturation_wait_floor,
            ),
            prefill_tokens_per_second: differs(
                mine.prefill_tokens_per_second,
                theirs.prefill_tokens_per_second,
            ),
            worker_queue_limit: differs(mine.worker_queue_limit, theirs.worker_queue_limit),
            saturation_queue_floor: differs(
                mine.saturation_queue_floor,
                theirs.saturation_queue_floor,
            ),
            min_load_choices: differs(mine.min_load_choices, theirs.min_load_choices),
            min_match_tokens: differs(mine.min_match_tokens, theirs.min_match_tokens),
            min_match_share: differs(mine.min_match_share, theirs.min_match_share),
            pin_depth_ratio: differs(mine.pin_depth_ratio, theirs.pin_depth_ratio),
            balance_abs_threshold: differs(
                mine.balance_abs_threshold,
                theirs.balance_abs_threshold,
            ),
            balance_rel_threshold: differs(
                mine.balance_rel_threshold,
                theirs.balance_rel_threshold,
            ),
            cache_threshold: differs(mine.cache_threshold, theirs.cache_threshold),
            max_fallbacks: fallbacks,
        }
    }

    fn is_empty(&self) -> bool {
        *self == Policy::default()
    }
}

/// `mine` when it says something `theirs` does not.
fn differs<T: PartialEq>(mine: Option<T>, theirs: Option<T>) -> Option<T> {
    if mine == theirs { None } else { mine }
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Load<'c> {
    scrape_interval: String,
    scrape_timeout: String,
    freshness: String,
    max_body_bytes: Size,
    max_concurrent_scrapes: usize,
    unreachable_after: u32,
    silent_after: String,
    drain_timeout: String,
    tls: Option<ScrapeTls<'c>>,
    prefill_rate_half_life: String,
    prefill_rate_warmup: String,
}

/// A byte size: `4MiB` when a binary unit holds it exactly, else a bare number of bytes.
#[derive(Serialize)]
#[serde(untagged)]
enum Size {
    Bytes(usize),
    WithUnit(String),
}

impl From<usize> for Size {
    fn from(bytes: usize) -> Self {
        match size::in_binary_unit(bytes) {
            Some(_) => Size::WithUnit(size::format(bytes)),
            None => Size::Bytes(bytes),
        }
    }
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Pool<'c> {
    model: &'c str,
    engine: Engine,
    block_size: u32,
    engine_block_size: Option<u32>,
    tokenizer: Tokenizer<'c>,
    chat_template: Option<Cow<'c, str>>,
    segment_cache_entries: usize,
    default_cache_blocks: usize,
    max_model_len: u64,
    #[serde(skip_serializing_if = "Policy::is_empty")]
    policy: Policy,
    index: Option<Index<'c>>,
    max_workers: usize,
    pd: Option<Pd>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    workers: Vec<Worker<'c>>,
    dns: Option<Dns<'c>>,
    kubernetes: Option<Kubernetes<'c>>,
    template: Option<Template>,
}

/// `pools[].pd`, every key written.
#[derive(Serialize)]
struct Pd {
    handshake: crate::config::Handshake,
    prefill_timeout: String,
    max_inflight_prefills: usize,
    decode_choices: usize,
    max_prefill_response_bytes: Size,
    /// Only read with the bootstrap handshake.
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_port: Option<u16>,
    /// Not read with the bootstrap handshake.
    #[serde(skip_serializing_if = "Option::is_none")]
    local_prefill_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    local_prefill_share: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    local_prefill_when_queued: Option<bool>,
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Dns<'c> {
    name: &'c str,
    port: u16,
    interval: String,
    server: Option<SocketAddr>,
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Kubernetes<'c> {
    namespace: Option<&'c str>,
    selector: Option<&'c str>,
    inference_pool: Option<&'c str>,
    #[serde(skip_serializing_if = "<[u16]>::is_empty")]
    ports: &'c [u16],
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Template {
    load_source: &'static str,
    #[serde(flatten)]
    engine: EngineKeys,
    scrape_scheme: Option<&'static str>,
}

/// The keys a file worker and a pool's `template` share: what the worker's engine is.
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct EngineKeys {
    role: Role,
    dp_size: u32,
    max_running_requests: Option<u64>,
    max_total_tokens: Option<u64>,
}

impl EngineKeys {
    fn of(
        role: Role,
        dp_size: NonZeroU32,
        max_running_requests: Option<NonZeroU64>,
        max_total_tokens: Option<NonZeroU64>,
    ) -> EngineKeys {
        EngineKeys {
            role,
            dp_size: dp_size.get(),
            max_running_requests: max_running_requests.map(NonZeroU64::get),
            max_total_tokens: max_total_tokens.map(NonZeroU64::get),
        }
    }
}

/// `index:`, written only when it differs from the default. The ports are what workers' sockets are
/// resolved with when their own `kv_events:` does not name them (written with each such worker).
#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Index<'c> {
    mode: IndexMode,
    speculative_ttl: String,
    stream_grace: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    topic: &'c str,
    sockets: IndexSockets,
    port: u16,
    replay_port: Option<u16>,
    commit_share: f64,
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct KvEvents {
    endpoint: String,
    replay_endpoint: Option<String>,
}

#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Tokenizer<'c> {
    Tiktoken { encoding: &'static str },
    HuggingFace { path: Cow<'c, str> },
    Bytes,
}

#[serde_with::skip_serializing_none]
#[derive(Serialize)]
struct Worker<'c> {
    endpoint: SocketAddr,
    metrics_url: &'c str,
    load_source: &'static str,
    loads_url: Option<&'c str>,
    #[serde(flatten)]
    engine: EngineKeys,
    kv_events: Option<KvEvents>,
    bootstrap_port: Option<u16>,
}

impl<'c> From<&'c Config> for File<'c> {
    fn from(config: &'c Config) -> Self {
        File {
            listen: config.listen,
            metrics_listen: config.metrics_listen,
            max_body_bytes: config.max_body_bytes.get().into(),
            debug_endpoints: config.debug_endpoints,
            cache_salt_header: config.cache_salt_header.as_deref(),
            unknown_subset: config.unknown_subset,
            debug_token_file: config.debug_token_file.as_deref(),
            tls: config.tls.as_ref().map(|tls| ListenerTls {
                cert_file: &tls.cert_file,
                key_file: &tls.key_file,
                client_ca_file: tls.client_ca_file.as_deref(),
                allowed_client_identities: &tls.allowed_client_identities,
                reload_interval: duration::format(tls.reload_interval),
            }),
            metrics_http: MetricsHttp {
                max_connections: config.metrics_http.max_connections.get(),
                header_read_timeout: duration::format(config.metrics_http.header_read_timeout),
                request_timeout: duration::format(config.metrics_http.request_timeout),
                connection_lifetime: duration::format(config.metrics_http.connection_lifetime),
            },
            policy: Policy::whole(&config.policy),
            load: Load {
                scrape_interval: duration::format(config.load.scrape_interval),
                scrape_timeout: duration::format(config.load.scrape_timeout),
                freshness: duration::format(config.load.freshness),
                max_body_bytes: config.load.max_body_bytes.get().into(),
                max_concurrent_scrapes: config.load.max_concurrent_scrapes.get(),
                unreachable_after: config.load.unreachable_after.get(),
                silent_after: duration::format(config.load.silent_after),
                drain_timeout: duration::format(config.load.drain_timeout),
                tls: config.load.tls.as_ref().map(|tls| ScrapeTls {
                    ca_file: &tls.files.ca_file,
                    cert_file: tls.files.identity.as_ref().map(|(cert, _)| cert.as_path()),
                    key_file: tls.files.identity.as_ref().map(|(_, key)| key.as_path()),
                    server_name: tls.server_name.as_deref(),
                }),
                prefill_rate_half_life: duration::format(config.load.rate.half_life),
                prefill_rate_warmup: duration::format(config.load.rate.warmup),
            },
            overload: Overload::from(&config.overload),
            feedback: Feedback {
                enabled: config.feedback.enabled,
                wait: duration::format(config.feedback.wait),
            },
            tracing: Tracing {
                otlp_endpoint: config.tracing.otlp_endpoint.as_deref(),
                sample_ratio: config.tracing.sample_ratio,
                service_name: &config.tracing.service_name,
            },
            replica_sync: config.replica_sync.as_ref().map(|sync| ReplicaSync {
                listen: sync.listen,
                peers: sync.peers.iter().map(ToString::to_string).collect(),
                key_file: sync.key_file.as_deref(),
                max_datagrams_per_second: sync.max_datagrams_per_second.get(),
                resolve_interval: duration::format(sync.resolve_interval),
            }),
            pools: config
                .pools
                .iter()
                .map(|pool| Pool::new(pool, &config.policy))
                .collect(),
        }
    }
}

impl<'c> Pool<'c> {
    /// `policy` is the top-level section, which the pool's own is written against.
    fn new(pool: &'c PoolConfig, policy: &PolicyConfig) -> Self {
        Pool {
            model: match &pool.model {
                ModelMatch::Exact(name) => name,
                ModelMatch::Any => "*",
            },
            engine: pool.engine,
            block_size: pool.block_size.get(),
            engine_block_size: pool.engine_block_size.map(NonZeroU32::get),
            tokenizer: match &pool.tokenizer {
                TokenizerConfig::Tiktoken { encoding } => Tokenizer::Tiktoken {
                    encoding: encoding.as_str(),
                },
                // The path came from the file as UTF-8, so nothing is lost.
                TokenizerConfig::HuggingFace { path } => Tokenizer::HuggingFace {
                    path: path.to_string_lossy(),
                },
                TokenizerConfig::Bytes => Tokenizer::Bytes,
            },
            // Also from the file as UTF-8.
            chat_template: pool.chat_template.as_deref().map(Path::to_string_lossy),
            segment_cache_entries: pool.segment_cache_entries.get(),
            default_cache_blocks: pool.default_cache_blocks.get(),
            max_model_len: pool.max_model_len.get(),
            policy: Policy::over(&pool.policy, policy),
            index: Index::of(pool),
            max_workers: pool.max_workers.get(),
            pd: pool.pd.as_ref().map(Pd::of),
            dns: match &pool.discovery {
                Discovery::Dns(dns) => Some(Dns {
                    name: &dns.name,
                    port: dns.port,
                    interval: duration::format(dns.interval),
                    server: dns.server,
                }),
                _ => None,
            },
            kubernetes: match &pool.discovery {
                Discovery::Kubernetes(kube) => Some(Kubernetes {
                    namespace: kube.namespace.as_deref(),
                    selector: match &kube.pods {
                        PodSelection::Selector(selector) => Some(selector),
                        PodSelection::InferencePool(_) => None,
                    },
                    inference_pool: match &kube.pods {
                        PodSelection::InferencePool(name) => Some(name),
                        PodSelection::Selector(_) => None,
                    },
                    ports: &kube.ports,
                }),
                _ => None,
            },
            template: (pool.discovery != Discovery::Static).then(|| Template {
                load_source: pool.template.load_source.as_str(),
                engine: EngineKeys::of(
                    pool.template.role,
                    pool.template.dp_size,
                    pool.template.max_running_requests,
                    pool.template.max_total_tokens,
                ),
                scrape_scheme: pool.template.scrape_https.then_some("https"),
            }),
            workers: pool
                .workers
                .iter()
                .map(|worker| Worker {
                    endpoint: worker.endpoint,
                    metrics_url: &worker.metrics_url,
                    load_source: worker.load_source.as_str(),
                    loads_url: worker.loads_url.as_deref(),
                    engine: EngineKeys::of(
                        worker.role,
                        worker.dp_size,
                        worker.max_running_requests,
                        worker.max_total_tokens,
                    ),
                    kv_events: kv_events(worker),
                    bootstrap_port: worker.bootstrap_port,
                })
                .collect(),
        }
    }
}

impl<'c> Index<'c> {
    /// A pool's index section, written only when it or its ports differ from the defaults.
    fn of(pool: &'c PoolConfig) -> Option<Self> {
        (pool.index != IndexConfig::default()
            || pool.template.kv_events_port != IndexConfig::DEFAULT_LIVE_PORT
            || pool.template.kv_replay_port.is_some())
        .then(|| Index {
            mode: pool.index.mode,
            speculative_ttl: duration::format(pool.index.speculative_ttl),
            stream_grace: duration::format(pool.index.stream_grace),
            topic: &pool.index.topic,
            sockets: pool.index.sockets,
            port: pool.template.kv_events_port,
            replay_port: pool.template.kv_replay_port,
            commit_share: pool.index.commit_share.get(),
        })
    }
}

impl Pd {
    /// The keys a bootstrap handshake does not read are left out.
    fn of(pd: &PdConfig) -> Self {
        let bootstrap = pd.handshake == Handshake::Bootstrap;
        Pd {
            handshake: pd.handshake,
            prefill_timeout: duration::format(pd.prefill_timeout),
            max_inflight_prefills: pd.max_inflight_prefills.get(),
            decode_choices: pd.decode_choices.get(),
            max_prefill_response_bytes: pd.max_prefill_response_bytes.get().into(),
            bootstrap_port: bootstrap.then_some(pd.bootstrap_port),
            local_prefill_tokens: (!bootstrap).then_some(pd.local_prefill_tokens),
            local_prefill_share: (!bootstrap).then_some(pd.local_prefill_share.get()),
            local_prefill_when_queued: (!bootstrap).then_some(pd.local_prefill_when_queued),
        }
    }
}

/// A worker's KV event sockets when its own `kv_events:` named them; the pool's `index:` gives the
/// others (and with `sockets: advertised`, the engine).
fn kv_events(worker: &WorkerConfig) -> Option<KvEvents> {
    let sockets = worker.kv_events;
    (worker.kv_events_from == KvEventsFrom::Worker).then(|| KvEvents {
        endpoint: format!("tcp://{}", sockets.live),
        replay_endpoint: sockets.replay.map(|replay| format!("tcp://{replay}")),
    })
}

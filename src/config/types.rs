//! Validated configuration. Every value here has passed the checks in `validate`; the types hold the
//! invariants that can be held in a type, so no consumer re-checks them.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

pub use cachepick_tokenizer::{TiktokenEncoding, TokenizerConfig};

use super::types_policy::{DepthRatio, PolicyConfig};
use super::types_security::{HttpLimits, ScrapeTls, ServerFiles};
use crate::worker::{Engine, Role};

/// The whole validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// ext_proc gRPC listener.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` and the debug endpoints; loopback by default.
    pub metrics_listen: SocketAddr,
    pub policy: PolicyConfig,
    pub load: LoadConfig,
    /// At least one pool; models are unique and at most one pool is the default (`*`).
    pub pools: Vec<PoolConfig>,
    /// A request body larger than this is refused (413) before it is parsed.
    pub max_body_bytes: NonZeroUsize,
    /// Serve `/debug/*` on `metrics_listen` and the gRPC admin API (and reflection) on `listen`. They
    /// describe the fleet and explain routing to whoever can connect. `None` (the key absent): each
    /// listener serves them only when it is bound to loopback (see `Config::debug_on_listen`);
    /// `Some` forces them on or off on both.
    pub debug_endpoints: Option<bool>,
    /// When set, `/debug/*` and the admin gRPC API require `authorization: Bearer <token>`, the token
    /// being this file's content (read at start-up).
    pub debug_token_file: Option<PathBuf>,
    /// TLS on `listen` (ext_proc, EDS, health, admin); `client_ca_file` makes client certificates
    /// mandatory. `None`: plain text.
    pub tls: Option<ServerFiles>,
    /// The bounds of the HTTP listener on `metrics_listen`.
    pub metrics_http: HttpLimits,
    /// The request header whose value salts every prefix hash of an `approximate` pool, lower-case: one
    /// tenant's prompts never match another's in the owner index (see `route`).
    pub cache_salt_header: Option<String>,
    /// `overload:`: admission, deadlines, stream and memory bounds, and the shutdown grace.
    pub overload: super::OverloadConfig,
    /// What a request gets when the proxy's subset hint names no worker cachepick knows.
    pub unknown_subset: UnknownSubset,
    /// `feedback:`: learning from what Envoy reports was served.
    pub feedback: FeedbackConfig,
    /// `tracing:`: OpenTelemetry spans over OTLP.
    pub tracing: super::TracingConfig,
    /// `replica_sync:`: dispatches shared with the other picker replicas; `None`: each replica prices
    /// only its own between readings.
    pub replica_sync: Option<super::ReplicaSyncConfig>,
}

/// `unknown_subset`: the answer to a request whose proxy subset hint names only endpoints the pool does
/// not know (a gateway whose discovery is ahead of cachepick's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownSubset {
    /// 503 `no_workers`, as the Endpoint Picker Protocol requires when no endpoint of the hint is
    /// eligible: the gateway, not the picker, decides what happens next.
    #[default]
    Refuse,
    /// Routed within the hint, to a random endpoint (the rest as fallbacks), as a `cache_miss`: for a
    /// gateway known to list pods before cachepick's discovery does, where a 503 would fail requests a
    /// worker can serve (Envoy's fail-open does not rescue a refusal).
    RouteWithin,
}

impl UnknownSubset {
    pub const ALL: [UnknownSubset; 2] = [UnknownSubset::Refuse, UnknownSubset::RouteWithin];

    pub fn as_str(self) -> &'static str {
        match self {
            UnknownSubset::Refuse => "refuse",
            UnknownSubset::RouteWithin => "route_within",
        }
    }
}

/// `feedback:`: whether a routed request's credit in the owner index waits for Envoy's report of the
/// response (its status and the upstream host that served it), and how long (see `route::credit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedbackConfig {
    /// The stream of a routed request stays open for the response phase, and `cachepick envoy-config`
    /// asks Envoy for it (`response_header_mode: SEND` with `upstream.address`).
    pub enabled: bool,
    /// The longest a stream waits for the report; without one the credit stays as committed.
    pub wait: Duration,
}

impl FeedbackConfig {
    /// Response headers come once the engine starts answering: after the whole generation for a
    /// request that does not stream. Ten minutes covers long generations; a slower one keeps its
    /// credit, as without feedback.
    pub const DEFAULT_WAIT: Duration = Duration::from_secs(600);
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig {
            enabled: true,
            wait: Self::DEFAULT_WAIT,
        }
    }
}

impl Config {
    /// Every policy in the configuration, for code that edits one: the top level's, then each pool's
    /// (a pool's is the one in force for it; the top level's is what the file's pools inherit from, and
    /// what `to_yaml` writes theirs against).
    pub fn policies_mut(&mut self) -> impl Iterator<Item = &mut PolicyConfig> {
        std::iter::once(&mut self.policy).chain(self.pools.iter_mut().map(|pool| &mut pool.policy))
    }

    /// The most fallbacks any answer lists: the largest `max_fallbacks` in force, over the top level and
    /// every pool (a pool may set its own). What a proxy's retry budget should cover.
    pub fn most_fallbacks(&self) -> usize {
        self.pools
            .iter()
            .map(|pool| pool.policy.max_fallbacks)
            .fold(self.policy.max_fallbacks, usize::max)
    }

    /// Long conversations with tools reach a few hundred KB; 8 MiB leaves room for pasted documents.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
    pub const DEFAULT_LISTEN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9002));
    /// Loopback: the debug endpoints are not for the network at large.
    pub const DEFAULT_METRICS_LISTEN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090));
}

/// How load is scraped and when a reading stops counting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadConfig {
    pub scrape_interval: Duration,
    /// How long one scrape may take; shorter than `freshness` (a later answer is stale on arrival).
    /// It may outlast `scrape_interval`: a worker is never asked again while a scrape of it is out.
    pub scrape_timeout: Duration,
    /// Longer than `scrape_interval`, so a healthy worker's reading never lapses between two scrapes.
    pub freshness: Duration,
    /// A scrape response larger than this is abandoned and counted as an error: a worker that answers
    /// with megabytes must not cost the picker memory or CPU.
    pub max_body_bytes: NonZeroUsize,
    /// Scrape requests in flight at once per pool.
    pub max_concurrent_scrapes: NonZeroUsize,
    /// Consecutive scrapes that cannot connect, or time out with no sign of the worker's life within
    /// `silent_after`, before it is `unreachable`.
    pub unreachable_after: NonZeroU32,
    /// How long a worker whose scrapes time out stays `late` (an owner, its gate open) without any
    /// sign of life: an answer to a scrape, a KV event batch, a response it served. Longer than
    /// `scrape_timeout`.
    pub silent_after: Duration,
    /// How long a worker removed from discovery may keep serving what it was sent before it leaves,
    /// if it neither goes idle nor stops answering first.
    pub drain_timeout: Duration,
    /// `load.tls`: how `https://` scrape URLs are verified; `None` allows `http://` URLs only.
    pub tls: Option<ScrapeTls>,
    /// How the prefill rate and tokens per request are learned from the engines' counters.
    pub rate: RateWindow,
}

/// The time constants of the prefill-rate estimate (`load/rate.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateWindow {
    /// Half of an estimate's weight is older than this (`load.prefill_rate_half_life`).
    pub half_life: Duration,
    /// Queued time behind a rate before it is given (`load.prefill_rate_warmup`).
    pub warmup: Duration,
}

impl Default for RateWindow {
    /// A change of traffic mix is followed within a minute; a few long prefills complete in the warm-up.
    fn default() -> Self {
        RateWindow {
            half_life: Duration::from_secs(30),
            warmup: Duration::from_secs(5),
        }
    }
}

impl LoadConfig {
    /// Real expositions are 50–200 KB; sixteen times that is still small and leaves room to grow.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
    pub const DEFAULT_MAX_CONCURRENT_SCRAPES: usize = 64;
    /// One failure can be a dropped packet; two in a row, a scrape interval apart, is a worker gone.
    pub const DEFAULT_UNREACHABLE_AFTER: u32 = 2;
    /// Longer than most generations take; a request still running then is cut by the engine's exit.
    pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
    /// A busy vLLM answered `/metrics` in up to 4.1–8.3 s under a burst (issue 45): longer than that,
    /// and short enough that a hung worker stops taking its owners' traffic within seconds.
    pub const DEFAULT_SILENT_AFTER: Duration = Duration::from_secs(10);
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            scrape_interval: Duration::from_secs(1),
            // A busy vLLM answers `/metrics` from the loop that tokenizes its requests: p90 0.46–0.61 s,
            // max 4–8 s under a burst of 1.6k-token prompts (issue 45). Two seconds keeps most of
            // those answers and leaves them a second of freshness.
            scrape_timeout: Duration::from_secs(2),
            freshness: Duration::from_secs(3),
            max_body_bytes: NonZeroUsize::new(Self::DEFAULT_MAX_BODY_BYTES)
                .unwrap_or(NonZeroUsize::MIN),
            max_concurrent_scrapes: NonZeroUsize::new(Self::DEFAULT_MAX_CONCURRENT_SCRAPES)
                .unwrap_or(NonZeroUsize::MIN),
            unreachable_after: NonZeroU32::new(Self::DEFAULT_UNREACHABLE_AFTER)
                .unwrap_or(NonZeroU32::MIN),
            silent_after: Self::DEFAULT_SILENT_AFTER,
            drain_timeout: Self::DEFAULT_DRAIN_TIMEOUT,
            tls: None,
            rate: RateWindow::default(),
        }
    }
}

/// Where a worker's load is read from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LoadSource {
    /// The engine's Prometheus `/metrics`.
    #[default]
    Metrics,
    /// SGLang's `/v1/loads` JSON, which also carries the uncached-token queue depth.
    Loads,
}

impl LoadSource {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSource::Metrics => "metrics",
            LoadSource::Loads => "loads",
        }
    }
}

/// Which requests a pool serves, matched against the body's `model`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ModelMatch {
    Exact(String),
    /// `*`: requests whose model names no other pool (and requests without a model).
    Any,
}

/// A set of workers serving one model.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    pub model: ModelMatch,
    pub engine: Engine,
    /// Tokens per prefix block.
    pub block_size: NonZeroU32,
    /// The engine's own KV block, when the operator states it (vLLM's `--block-size`, 16 on GPUs and
    /// 128 in the CPU build; SGLang's `--page-size`): `block_size` divides it. The engine reuses a
    /// cached prefix in whole blocks of it; what a worker reports itself (`cache_config_info`) wins.
    pub engine_block_size: Option<NonZeroU32>,
    pub tokenizer: TokenizerConfig,
    /// A Jinja chat template (a template file, or an HF `tokenizer_config.json` holding
    /// `chat_template`), rendered the way the engine renders it; without one, chats are rendered by
    /// cachepick's documented fixed format.
    pub chat_template: Option<PathBuf>,
    /// Tokenized message segments kept per pool, so a growing conversation re-tokenizes only its new turn.
    pub segment_cache_entries: NonZeroUsize,
    /// Prefix blocks the owner index keeps per worker when the engine does not report its KV capacity.
    pub default_cache_blocks: NonZeroUsize,
    /// The engine's context length in tokens (vLLM's `--max-model-len`): a longer prompt is refused by
    /// the engine, so it is routed but never committed to the owner index.
    pub max_model_len: NonZeroU64,
    /// The file's workers (`Discovery::Static`): non-empty, unique endpoints, at least one of them
    /// serving prefill. Empty for a discovered pool; the live roster is the load snapshot's.
    pub workers: Vec<WorkerConfig>,
    /// The policy this pool runs with: its own `pools[].policy` keys, the others from the top-level
    /// `policy`.
    pub policy: PolicyConfig,
    /// Where the owner index learns which worker holds which prefix.
    pub index: IndexConfig,
    /// Where the workers come from; `workers` is the file's list for `Static` and empty otherwise.
    pub discovery: Discovery,
    /// What a discovered worker is beyond its address.
    pub template: WorkerTemplate,
    /// Workers the pool can hold at once: per-worker state is allocated for this many.
    pub max_workers: NonZeroUsize,
    /// `pd:`: prefill on the `prefill` workers, decode on the `decode` workers, and the handshake
    /// between them; `None`: an aggregated pool, whose `decode` workers take no requests.
    pub pd: Option<super::PdConfig>,
}

impl PoolConfig {
    pub const DEFAULT_BLOCK_SIZE: u32 = 64;
    pub const DEFAULT_SEGMENT_CACHE_ENTRIES: usize = 16_384;
    /// About 1M tokens at 64 tokens per block: a mid-size GPU's KV cache.
    pub const DEFAULT_CACHE_BLOCKS: usize = 16_384;
    /// The context most served models have; set the engine's own.
    pub const DEFAULT_MAX_MODEL_LEN: u64 = 131_072;
    /// The most blocks an engine-reported KV capacity can give a worker in the owner index: 2 Mi
    /// blocks (128 Mi tokens at the default block size) is beyond any engine's cache today, and bounds
    /// what one garbled or lying scrape can make the index hold.
    pub const MAX_REPORTED_CACHE_BLOCKS: usize = 1 << 21;
    /// Far more engines than one model's pool runs today, and a few hundred kilobytes of slots.
    pub const DEFAULT_MAX_WORKERS: usize = 256;
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// `ip:port` Envoy sends the request to; unique across all pools.
    pub endpoint: SocketAddr,
    /// The engine's Prometheus endpoint (plain `http://`); derived from the endpoint when not given.
    pub metrics_url: String,
    /// Which endpoint load is read from; `Loads` only for SGLang.
    pub load_source: LoadSource,
    /// SGLang's `/v1/loads` (plain `http://`); `Some` exactly when `load_source` is `Loads`, derived
    /// from the endpoint when not given.
    pub loads_url: Option<String>,
    pub role: Role,
    /// Data-parallel ranks; a reading is complete only when all of them reported.
    pub dp_size: NonZeroU32,
    /// Overrides the engine-reported `max_running_requests` (summed over ranks).
    pub max_running_requests: Option<NonZeroU64>,
    /// Overrides the engine-reported KV-cache capacity in tokens (summed over ranks).
    pub max_total_tokens: Option<NonZeroU64>,
    /// Where the engine publishes its KV cache events (rank 0; rank `r` is at port + `r`). Resolved
    /// from `kv_events` or the pool's `index.kv_events` ports on the endpoint's IP; read only in
    /// `events` mode.
    pub kv_events: KvEventEndpoints,
    /// Who named `kv_events`; with [`KvEventsFrom::Engine`] they are the pool's ports, used until the
    /// engine says where it publishes.
    pub kv_events_from: KvEventsFrom,
    /// SGLang's bootstrap server of a prefill worker in a `pd: {handshake: bootstrap}` pool; `None`
    /// takes the pool's `pd.bootstrap_port` on the endpoint's IP.
    pub bootstrap_port: Option<u16>,
}

/// An engine's KV event sockets, for its data-parallel rank 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvEventEndpoints {
    /// The ZeroMQ PUB socket the engine publishes batches on.
    pub live: SocketAddr,
    /// The ROUTER socket that replays recent batches; `None` when the engine runs without one.
    pub replay: Option<SocketAddr>,
}

impl KvEventEndpoints {
    /// The endpoints of data-parallel rank `rank`: each rank publishes on its own port, rank 0's plus
    /// `rank` (validation guarantees every rank's port exists).
    pub fn for_rank(self, rank: u32) -> KvEventEndpoints {
        let shift = |mut addr: SocketAddr| {
            let port = u32::from(addr.port()).saturating_add(rank);
            addr.set_port(u16::try_from(port).unwrap_or(u16::MAX));
            addr
        };
        KvEventEndpoints {
            live: shift(self.live),
            replay: self.replay.map(shift),
        }
    }
}

/// Where a pool's owner index comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMode {
    /// Learned from cachepick's own decisions: blind to evictions, restarts, retries and the other
    /// replicas' decisions.
    #[default]
    Approximate,
    /// The engines' KV cache events: what each worker really holds, the same on every replica.
    Events,
}

impl IndexMode {
    pub const ALL: [IndexMode; 2] = [IndexMode::Approximate, IndexMode::Events];

    pub fn as_str(self) -> &'static str {
        match self {
            IndexMode::Approximate => "approximate",
            IndexMode::Events => "events",
        }
    }
}

/// `index.sockets`: where the picker learns each worker's KV event sockets when the worker's own
/// `kv_events:` does not name them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexSockets {
    /// Asked of the engine (vLLM's `/kv_event_sources`, SGLang's `/server_info`), the pool's ports
    /// until it answers and whenever it does not say.
    #[default]
    Advertised,
    /// The pool's `port` and `replay_port` on the worker's IP; the engine is not asked.
    Ports,
}

impl IndexSockets {
    pub const ALL: [IndexSockets; 2] = [IndexSockets::Advertised, IndexSockets::Ports];

    pub fn as_str(self) -> &'static str {
        match self {
            IndexSockets::Advertised => "advertised",
            IndexSockets::Ports => "ports",
        }
    }
}

/// Who named a worker's KV event sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventsFrom {
    /// The worker's own `kv_events:`: the override, never asked of the engine.
    Worker,
    /// The pool's `index.port` and `index.replay_port` on the worker's IP.
    Pool,
    /// The engine, asked where it publishes (`index.sockets: advertised`).
    Engine,
}

impl KvEventsFrom {
    pub const ALL: [KvEventsFrom; 3] = [
        KvEventsFrom::Worker,
        KvEventsFrom::Pool,
        KvEventsFrom::Engine,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KvEventsFrom::Worker => "worker",
            KvEventsFrom::Pool => "pool",
            KvEventsFrom::Engine => "engine",
        }
    }
}

impl std::fmt::Display for IndexMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for IndexMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        IndexMode::ALL
            .into_iter()
            .find(|mode| mode.as_str() == text)
            .ok_or_else(|| format!("expected approximate or events, got `{text}`"))
    }
}

/// `pools[].index`.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexConfig {
    pub mode: IndexMode,
    /// `events` mode: how long a decision's own placement counts before the engine's events confirm
    /// it, so a burst of identical prompts follows the first one.
    pub speculative_ttl: Duration,
    /// `events` mode: the subscription's topic prefix (empty: every topic).
    pub topic: String,
    /// `events` mode: a worker whose stream has been down this long no longer counts as an owner.
    pub stream_grace: Duration,
    /// Whether a worker's sockets, when its `kv_events:` does not name them, are asked of its engine.
    pub sockets: IndexSockets,
    /// The most of a worker's capacity one request's commit may record, in `(0, 1]`: its leading blocks
    /// up to this share, so that one huge prompt cannot flush every other prefix a worker holds.
    pub commit_share: DepthRatio,
}

impl IndexConfig {
    /// Who names a worker's sockets when its own `kv_events:` does not.
    pub fn kv_events_from(&self) -> KvEventsFrom {
        match self.sockets {
            IndexSockets::Advertised => KvEventsFrom::Engine,
            IndexSockets::Ports => KvEventsFrom::Pool,
        }
    }

    /// llm-d's speculative entries live 2 s: longer than an engine takes to prefill and publish.
    pub const DEFAULT_SPECULATIVE_TTL: Duration = Duration::from_secs(2);
    pub const DEFAULT_STREAM_GRACE: Duration = Duration::from_secs(10);
    /// vLLM's and SGLang's documented ports.
    pub const DEFAULT_LIVE_PORT: u16 = 5557;
    /// A quarter: a prompt of the whole context on a worker that holds about four contexts, while three
    /// quarters of what it held survive it.
    pub const DEFAULT_COMMIT_SHARE: f64 = 0.25;
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            mode: IndexMode::default(),
            speculative_ttl: Self::DEFAULT_SPECULATIVE_TTL,
            topic: String::new(),
            stream_grace: Self::DEFAULT_STREAM_GRACE,
            sockets: IndexSockets::default(),
            commit_share: DepthRatio::new(Self::DEFAULT_COMMIT_SHARE).unwrap_or(DepthRatio::ZERO),
        }
    }
}

impl WorkerConfig {
    pub const DEFAULT_ROLE: Role = Role::Both;
    pub const DEFAULT_DP_SIZE: u32 = 1;
    /// Far above any real data-parallel degree; a typo such as 10000000 is caught instead of allocated.
    pub const MAX_DP_SIZE: u32 = 1024;

    /// The URL the scraper reads, by load source.
    pub fn scrape_url(&self) -> &str {
        match (&self.load_source, &self.loads_url) {
            (LoadSource::Loads, Some(url)) => url,
            _ => &self.metrics_url,
        }
    }
}

/// Where a pool's workers come from (`pools[].workers`, `dns` or `kubernetes`, exactly one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The `workers:` list of the file, re-read when the file changes or on SIGHUP.
    Static,
    /// A/AAAA records of a name (a headless Service), re-resolved every `interval`.
    Dns(DnsDiscovery),
    /// Pods watched through the Kubernetes API.
    Kubernetes(KubernetesDiscovery),
}

impl Discovery {
    /// The source's name in metrics, logs and the snapshot.
    pub fn kind(&self) -> &'static str {
        match self {
            Discovery::Static => "file",
            Discovery::Dns(_) => "dns",
            Discovery::Kubernetes(_) => "kubernetes",
        }
    }
}

/// `pools[].dns`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsDiscovery {
    /// The name resolved, usually a headless Service's (`vllm.llm.svc.cluster.local`).
    pub name: String,
    /// The engines' port: every resolved address is one worker at this port.
    pub port: u16,
    /// How often the name is resolved again.
    pub interval: Duration,
    /// The DNS server asked; `None` is the system's resolver configuration (`/etc/resolv.conf`).
    pub server: Option<SocketAddr>,
}

impl DnsDiscovery {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
}

/// `pools[].kubernetes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesDiscovery {
    /// The namespace watched; `None` is the picker's own (the service account's namespace).
    pub namespace: Option<String>,
    pub pods: PodSelection,
    /// The engine ports of each pod: every (ready pod, port) is one worker. Empty only with an
    /// InferencePool, whose `targetPorts` are then used.
    pub ports: Vec<u16>,
}

/// Which pods a `kubernetes` pool watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodSelection {
    /// A label selector, as `kubectl get pods -l` takes it (`app=vllm,tier in (gpu)`).
    Selector(String),
    /// The named InferencePool (Gateway API Inference Extension): its `selector` and `targetPorts`.
    InferencePool(String),
}

/// `pools[].template`: what a discovered worker is, beyond its address. The file's workers carry the
/// same keys each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerTemplate {
    pub load_source: LoadSource,
    pub role: Role,
    pub dp_size: NonZeroU32,
    pub max_running_requests: Option<NonZeroU64>,
    pub max_total_tokens: Option<NonZeroU64>,
    /// `index.port`: each worker's KV event socket on its own IP.
    pub kv_events_port: u16,
    /// `index.replay_port`.
    pub kv_replay_port: Option<u16>,
    /// `index.sockets`: [`KvEventsFrom::Engine`] (asked) or [`KvEventsFrom::Pool`].
    pub kv_events_from: KvEventsFrom,
    /// `scrape_scheme: https`: discovered workers' metrics and loads are scraped over TLS (`load.tls`).
    pub scrape_https: bool,
}

impl WorkerTemplate {
    /// The worker a discovery source found at `endpoint`: metrics and loads on its API port, as both
    /// engines serve them, and KV events on the pool's ports of its IP.
    pub fn worker(&self, endpoint: SocketAddr) -> WorkerConfig {
        let scheme = if self.scrape_https { "https" } else { "http" };
        WorkerConfig {
            endpoint,
            metrics_url: format!("{scheme}://{endpoint}/metrics"),
            load_source: self.load_source,
            loads_url: match self.load_source {
                LoadSource::Loads => Some(format!("{scheme}://{endpoint}/v1/loads")),
                LoadSource::Metrics => None,
            },
            role: self.role,
            dp_size: self.dp_size,
            max_running_requests: self.max_running_requests,
            max_total_tokens: self.max_total_tokens,
            kv_events: KvEventEndpoints {
                live: SocketAddr::new(endpoint.ip(), self.kv_events_port),
                replay: self
                    .kv_replay_port
                    .map(|port| SocketAddr::new(endpoint.ip(), port)),
            },
            kv_events_from: self.kv_events_from,
            bootstrap_port: None,
        }
    }
}

impl Default for WorkerTemplate {
    /// The defaults of a file worker's keys, and the engines' documented KV event port.
    fn default() -> Self {
        WorkerTemplate {
            load_source: LoadSource::default(),
            role: WorkerConfig::DEFAULT_ROLE,
            dp_size: NonZeroU32::MIN,
            max_running_requests: None,
            max_total_tokens: None,
            kv_events_port: IndexConfig::DEFAULT_LIVE_PORT,
            kv_replay_port: None,
            kv_events_from: KvEventsFrom::Engine,
            scrape_https: false,
        }
    }
}

/// How a reload ended; the `outcome` label of `cachepick_config_reloads_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    Applied,
    Invalid,
    NeedsRestart,
}

impl ReloadOutcome {
    pub const ALL: [ReloadOutcome; 3] = [
        ReloadOutcome::Applied,
        ReloadOutcome::Invalid,
        ReloadOutcome::NeedsRestart,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReloadOutcome::Applied => "applied",
            ReloadOutcome::Invalid => "invalid",
            ReloadOutcome::NeedsRestart => "needs_restart",
        }
    }
}

//! cachepick's own Prometheus metrics, defined and registered in one place.
//!
//! Components receive a shared [`Metrics`] and update it through its methods or the handles they own;
//! label values come from enums (`ScrapeOutcome::as_str`, `Reason::as_str`, [`StreamEnd::as_str`]) or
//! stable snake_case kinds so the label sets stay bounded. Gauges that describe the current load
//! snapshots and the owner indexes are computed when `/metrics` is read, so they stay true even if a
//! scraper stalls.

use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

mod discovery;
mod families;
mod gie;
mod kv_events;
mod load;
mod overload;
mod pd;
mod replica_sync;
mod security;
mod workers;

use discovery::{DiscoveryCollector, DiscoveryGauges};
pub use kv_events::StreamSource;
use kv_events::{KvEventCollector, KvEventGauges};
use load::{LoadGauges, SharedCollector};
pub use overload::{OverloadMetrics, RefusedCommit};
pub use pd::PdMetrics;
use replica_sync::{ReplicaSyncCollector, ReplicaSyncCounters};
use security::SecurityMetrics;
pub use security::{DebugListener, HttpRefusal};
use workers::WorkerDecisions;

use crate::config::ReloadOutcome;
use crate::discovery::SourceStatus;
use crate::load::{PoolLoad, ScrapeObserver, ScrapeOutcome};
use crate::policy::Reason;
use crate::prefix::IndexStats;
use crate::protocol::RefusalReason;

/// How an ext_proc stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// cachepick answered the request (routed it or refused it with an immediate response).
    Answered,
    /// The proxy closed or reset the stream before an answer was sent.
    Reset,
    /// The stream failed: a protocol violation or a transport error.
    Error,
    /// cachepick gave the request up with a gRPC error (`cachepick_shed_total` says why), so the
    /// proxy routes it by its own load balancing.
    Shed,
}

impl StreamEnd {
    pub const ALL: [StreamEnd; 4] = [
        StreamEnd::Answered,
        StreamEnd::Reset,
        StreamEnd::Error,
        StreamEnd::Shed,
    ];

    /// The `outcome` label of `cachepick_extproc_streams_closed_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamEnd::Answered => "answered",
            StreamEnd::Reset => "reset",
            StreamEnd::Error => "error",
            StreamEnd::Shed => "shed",
        }
    }
}

/// Owner-index statistics per pool label, read when `/metrics` is collected.
pub type IndexSource = Arc<dyn Fn() -> Vec<(String, IndexStats)> + Send + Sync>;
/// Each pool's segment cache size in bytes, by pool label, read when `/metrics` is.
pub type SegmentSource = Arc<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// Buckets of `cachepick_prefix_match_ratio`: 0 is a complete miss, 1 a complete hit.
const MATCH_RATIO_BUCKETS: [f64; 11] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// Every metric cachepick exports.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// `cachepick_scrapes_total{pool,worker,outcome}`.
    pub scrapes: IntCounterVec,
    /// `cachepick_decisions_total{pool,reason}`.
    decisions: IntCounterVec,
    /// `cachepick_worker_decisions_total{pool,worker,reason}`.
    worker_decisions: WorkerDecisions,
    /// `cachepick_refusals_total{pool,reason}`.
    refusals: IntCounterVec,
    /// `cachepick_passthrough_total{pool}`.
    passthrough: IntCounterVec,
    /// `cachepick_unknown_subset_total{pool}`.
    unknown_subset: IntCounterVec,
    /// `cachepick_feedback_total{pool,outcome}`.
    feedback: IntCounterVec,
    /// `cachepick_compressed_bodies_total{encoding,outcome}`.
    compressed_bodies: IntCounterVec,
    /// `cachepick_prefix_match_ratio{pool}`.
    match_ratio: HistogramVec,
    /// `cachepick_diverted_prefix_blocks{pool}`.
    diverted_blocks: HistogramVec,
    /// `cachepick_decision_seconds{pool}`.
    decision_seconds: HistogramVec,
    /// `cachepick_extproc_streams_opened_total`.
    streams_opened: IntCounter,
    /// `cachepick_extproc_streams_active`.
    streams_active: IntGauge,
    /// `cachepick_extproc_streams_closed_total{outcome}`.
    streams_closed: IntCounterVec,
    load: Arc<LoadGauges>,
    index: Arc<IndexGauges>,
    kv_events: Arc<KvEventGauges>,
    replica_sync: Arc<ReplicaSyncCounters>,
    discovery: Arc<DiscoveryGauges>,
    /// `cachepick_config_reloads_total{outcome}`.
    config_reloads: IntCounterVec,
    /// `cachepick_config_keys_changed_total`.
    config_keys_changed: IntCounter,
    /// The HTTP listener's bounds, refused debug calls, TLS (`security.rs`).
    security: SecurityMetrics,
    /// Shedding, admission and the answer-time histogram (`overload.rs`).
    pub overload: OverloadMetrics,
    /// Prefill/decode pools' decode picks and prefill legs (`pd.rs`).
    pub pd: PdMetrics,
}

/// Gauges read off the owner indexes at collection time.
struct IndexGauges {
    /// `cachepick_index_blocks{pool}` / `cachepick_index_entries{pool}`.
    blocks: IntGaugeVec,
    entries: IntGaugeVec,
    sources: Mutex<Vec<IndexSource>>,
    /// `cachepick_segment_cache_bytes{pool}`: the tokenizer's cache, the other memory a pool grows
    /// into under traffic.
    segment_bytes: IntGaugeVec,
    segment_sources: Mutex<Vec<SegmentSource>>,
}

impl IndexGauges {
    fn new() -> Result<Self, prometheus::Error> {
        Ok(IndexGauges {
            blocks: IntGaugeVec::new(
                Opts::new(
                    "cachepick_index_blocks",
                    "Distinct prompt blocks the pool's owner index credits to at least one worker: how much \
                 prefix cachepick can route on.",
                ),
                &["pool"],
            )?,
            entries: IntGaugeVec::new(
                Opts::new(
                    "cachepick_index_entries",
                    "(block, worker) pairs in the pool's owner index; above cachepick_index_blocks when \
                 prefixes are held by several workers.",
                ),
                &["pool"],
            )?,
            sources: Mutex::new(Vec::new()),
            segment_bytes: IntGaugeVec::new(
                Opts::new(
                    "cachepick_segment_cache_bytes",
                    "Bytes of tokens and text the pool's segment cache holds; it fills to its budget \
                 (segment_cache_entries x 512 tokens x 4 bytes) under steady traffic and stays there.",
                ),
                &["pool"],
            )?,
            segment_sources: Mutex::new(Vec::new()),
        })
    }
}

impl std::fmt::Debug for IndexGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sources = self.sources.lock().map_or(0, |sources| sources.len());
        f.debug_struct("IndexGauges")
            .field("blocks", &self.blocks)
            .field("entries", &self.entries)
            .field("sources", &sources)
            .finish()
    }
}

impl Metrics {
    /// Declares the top-level families. Over 100 lines because each family is declared here once with
    /// its help text (the operator's documentation of it); a subsystem's families live in its module.
    pub fn new() -> Result<Self, prometheus::Error> {
        let load = Arc::new(LoadGauges::new()?);
        let index = Arc::new(IndexGauges::new()?);
        let build_info = IntGaugeVec::new(
            Opts::new(
                "cachepick_build_info",
                "Always 1; the version label says which cachepick release is running.",
            ),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let streams_closed = IntCounterVec::new(
            Opts::new(
                "cachepick_extproc_streams_closed_total",
                "ext_proc streams ended, by outcome: answered (cachepick sent its answer), reset (the proxy \
                 went away first), error (protocol or transport failure), shed (given up with a gRPC \
                 error so the proxy routes by itself).",
            ),
            &["outcome"],
        )?;
        for end in StreamEnd::ALL {
            streams_closed.with_label_values(&[end.as_str()]);
        }
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "cachepick_config_reloads_total",
                "Reloads of the configuration file (on change or SIGHUP), by outcome: applied, invalid \
                 (nothing changed; the log lists every problem), needs_restart (it changes what only a \
                 restart can; nothing changed).",
            ),
            &["outcome"],
        )?;
        for outcome in ReloadOutcome::ALL {
            config_reloads.with_label_values(&[outcome.as_str()]);
        }
        let metrics = Metrics {
            registry: Registry::new(),
            scrapes: IntCounterVec::new(
                Opts::new(
                    "cachepick_scrapes_total",
                    "Load scrapes of each worker, by outcome (ok, timeout, http_error, parse_error, connect_error).",
                ),
                &["pool", "worker", "outcome"],
            )?,
            decisions: IntCounterVec::new(
                Opts::new(
                    "cachepick_decisions_total",
                    "Routed requests by decision reason: the cache_aware rung that decided (cache_hit, \
                     saturation_pin, all_queued, cache_worker_queued, capacity_fallback, cache_miss), or the \
                     pool's other mode (round_robin, least_load; balance_threshold: balanced_owner, \
                     balanced_miss, imbalanced). Under cache_aware the share of cache_hit is how often a \
                     request reached its prefix owner.",
                ),
                &["pool", "reason"],
            )?,
            worker_decisions: WorkerDecisions::new()?,
            refusals: IntCounterVec::new(
                Opts::new(
                    "cachepick_refusals_total",
                    "Requests cachepick refused, by reason (no_workers, the body errors invalid_json, \
                     unknown_model, too_large...); pool is \"none\" when the request named no pool.",
                ),
                &["pool", "reason"],
            )?,
            passthrough: IntCounterVec::new(
                Opts::new(
                    "cachepick_passthrough_total",
                    "Requests without a prompt (GET /v1/models, POST /v1/embeddings...) routed by load alone: \
                     not decisions, not in the owner index.",
                ),
                &["pool"],
            )?,
            feedback: IntCounterVec::new(
                Opts::new(
                    "cachepick_feedback_total",
                    "Routed requests whose credit in the owner index Envoy's response report settled, by \
                     outcome: confirmed (served by the selected worker), moved (Envoy retried it on another \
                     worker, which is credited instead), retracted (a non-2xx status: nobody is credited) \
                     or unreported (no report within feedback.wait: the credit stays).",
                ),
                &["pool", "outcome"],
            )?,
            compressed_bodies: IntCounterVec::new(
                Opts::new(
                    "cachepick_compressed_bodies_total",
                    "Request bodies sent with a content-encoding, by encoding (gzip, deflate, br, zstd, \
                     other) and outcome: decoded, or routed by load as a passthrough because the body is \
                     unsupported, corrupt or decodes beyond max_body_bytes.",
                ),
                &["encoding", "outcome"],
            )?,
            unknown_subset: IntCounterVec::new(
                Opts::new(
                    "cachepick_unknown_subset_total",
                    "Requests whose proxy subset hint named only endpoints the pool does not know (a gateway \
                     ahead of cachepick's discovery): refused with 503 no_workers, or, under \
                     unknown_subset: route_within, routed within the subset blind as a cache_miss.",
                ),
                &["pool"],
            )?,
            match_ratio: HistogramVec::new(
                HistogramOpts::new(
                    "cachepick_prefix_match_ratio",
                    "Share of each routed prompt's tokens the selected worker already holds per the owner \
                     index (0 = none, 1 = all): the prefill cachepick saves.",
                )
                .buckets(MATCH_RATIO_BUCKETS.to_vec()),
                &["pool"],
            )?,
            diverted_blocks: HistogramVec::new(
                HistogramOpts::new(
                    "cachepick_diverted_prefix_blocks",
                    "Prefix blocks held by the queued owner a request was diverted away from: the cached \
                     prefill each cache_worker_queued diversion gave up.",
                )
                .buckets(prometheus::exponential_buckets(1.0, 2.0, 15)?),
                &["pool"],
            )?,
            decision_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "cachepick_decision_seconds",
                    "Time from the request body's arrival to cachepick's answer: the latency cachepick adds \
                     to each request.",
                )
                .buckets(prometheus::exponential_buckets(25e-6, 2.0, 16)?),
                &["pool"],
            )?,
            streams_opened: IntCounter::new(
                "cachepick_extproc_streams_opened_total",
                "ext_proc streams the proxy opened (one per request it sent to cachepick).",
            )?,
            streams_active: IntGauge::new(
                "cachepick_extproc_streams_active",
                "ext_proc streams open now: requests the proxy is waiting on cachepick for.",
            )?,
            streams_closed,
            load,
            index,
            kv_events: Arc::new(KvEventGauges::new()?),
            replica_sync: Arc::new(ReplicaSyncCounters::new()?),
            discovery: Arc::new(DiscoveryGauges::new()?),
            config_reloads,
            config_keys_changed: IntCounter::new(
                "cachepick_config_keys_changed_total",
                "Configuration keys changed by applied reloads (each reload's log line lists them, old → new).",
            )?,
            security: SecurityMetrics::new()?,
            overload: OverloadMetrics::new()?,
            pd: PdMetrics::new()?,
        };
        metrics.register(build_info)?;
        Ok(metrics)
    }

    /// Every family `new` declares, in one registry: what `/metrics` writes.
    fn register(&self, build_info: IntGaugeVec) -> Result<(), prometheus::Error> {
        let registry = &self.registry;
        registry.register(Box::new(self.scrapes.clone()))?;
        registry.register(Box::new(self.decisions.clone()))?;
        self.worker_decisions.register(registry)?;
        workers::register_process(registry)?;
        registry.register(Box::new(self.refusals.clone()))?;
        registry.register(Box::new(self.passthrough.clone()))?;
        registry.register(Box::new(self.unknown_subset.clone()))?;
        registry.register(Box::new(self.feedback.clone()))?;
        registry.register(Box::new(self.compressed_bodies.clone()))?;
        registry.register(Box::new(self.match_ratio.clone()))?;
        registry.register(Box::new(self.diverted_blocks.clone()))?;
        registry.register(Box::new(self.decision_seconds.clone()))?;
        registry.register(Box::new(self.streams_opened.clone()))?;
        registry.register(Box::new(self.streams_active.clone()))?;
        registry.register(Box::new(self.streams_closed.clone()))?;
        registry.register(Box::new(build_info))?;
        registry.register(Box::new(SharedCollector(Arc::clone(&self.load))))?;
        registry.register(Box::new(IndexCollector(Arc::clone(&self.index))))?;
        registry.register(Box::new(KvEventCollector(Arc::clone(&self.kv_events))))?;
        registry.register(Box::new(ReplicaSyncCollector(Arc::clone(
            &self.replica_sync,
        ))))?;
        registry.register(Box::new(DiscoveryCollector(Arc::clone(&self.discovery))))?;
        registry.register(Box::new(self.config_reloads.clone()))?;
        registry.register(Box::new(self.config_keys_changed.clone()))?;
        self.security.register(registry)?;
        self.overload.register(registry)?;
        self.pd.register(registry)?;
        Ok(())
    }

    /// Reports `pool`'s freshness gauges from now on.
    pub fn watch_pool(&self, pool: Arc<PoolLoad>) {
        if let Ok(mut pools) = self.load.pools.lock() {
            pools.push(pool);
        }
    }

    /// Reports `cachepick_index_blocks{pool}` and `cachepick_index_entries{pool}` from now on, computed
    /// from `source` each time `/metrics` is read.
    pub fn watch_index(&self, source: IndexSource) {
        if let Ok(mut sources) = self.index.sources.lock() {
            sources.push(source);
        }
    }

    /// Reports `cachepick_segment_cache_bytes{pool}` from now on, computed from `source` each time
    /// `/metrics` is read.
    pub fn watch_segment_cache(&self, source: SegmentSource) {
        if let Ok(mut sources) = self.index.segment_sources.lock() {
            sources.push(source);
        }
    }

    /// Reports `cachepick_discovery_*` for pool `pool`'s source of workers, from now on.
    pub fn watch_source(&self, pool: &str, status: Arc<SourceStatus>) {
        self.discovery.watch(pool, status);
    }

    /// Counts one reload of the configuration file.
    pub fn record_reload(&self, outcome: ReloadOutcome) {
        self.config_reloads
            .with_label_values(&[outcome.as_str()])
            .inc();
    }

    /// An applied reload changed `keys` keys: `cachepick_config_keys_changed_total` += keys.
    pub fn record_reload_changes(&self, keys: usize) {
        self.config_keys_changed.inc_by(keys as u64);
    }

    /// Reports `cachepick_replica_sync_*` from `stats`, from now on.
    pub fn watch_replica_sync(&self, stats: Arc<crate::load::SyncStats>) {
        self.replica_sync.watch(stats);
    }

    /// Reports `cachepick_kv_events_*` for the streams `source` lists, from now on.
    pub fn watch_kv_events(&self, source: StreamSource) {
        self.kv_events.watch(source);
    }

    /// Pre-creates the per-pool series (every `Reason::ALL` label at 0 for decisions_total) so
    /// dashboards see zeros rather than no data.
    pub fn init_pool(&self, pool: &str) {
        for reason in Reason::ALL {
            self.decisions.with_label_values(&[pool, reason.as_str()]);
        }
        self.refusals
            .with_label_values(&[pool, RefusalReason::NoWorkers.as_str()]);
        self.passthrough.with_label_values(&[pool]);
        self.match_ratio.with_label_values(&[pool]);
        self.diverted_blocks.with_label_values(&[pool]);
        self.decision_seconds.with_label_values(&[pool]);
    }

    /// A request without a prompt routed by load alone: `cachepick_passthrough_total{pool}` += 1.
    pub fn record_passthrough(&self, pool: &str) {
        self.passthrough.with_label_values(&[pool]).inc();
    }

    /// A routed request's credit settled by the response's report: `outcome` is `confirmed`, `moved`,
    /// `retracted` or `unreported`.
    pub fn record_feedback(&self, pool: &str, outcome: &str) {
        self.feedback.with_label_values(&[pool, outcome]).inc();
    }

    /// One compressed body: `outcome` is `decoded` or why it was routed by load instead.
    pub fn record_compressed_body(&self, encoding: &str, outcome: &str) {
        self.compressed_bodies
            .with_label_values(&[encoding, outcome])
            .inc();
    }

    /// One request whose proxy subset named no worker the pool knows.
    pub fn record_unknown_subset(&self, pool: &str) {
        self.unknown_subset.with_label_values(&[pool]).inc();
    }

    /// One routed request to `worker`: `cachepick_decisions_total{pool,reason}` and
    /// `cachepick_worker_decisions_total{pool,worker,reason}` += 1; `cachepick_prefix_match_ratio`
    /// observes `matched / prompt` (0 for an empty prompt, clamped to [0, 1]);
    /// `cachepick_diverted_prefix_blocks` observes `diverted_blocks` only when `Some` (a real diversion
    /// off an owner).
    pub fn record_decision(
        &self,
        pool: &str,
        worker: &str,
        reason: Reason,
        prompt_tokens: u64,
        matched_tokens: u64,
        diverted_blocks: Option<u64>,
    ) {
        self.decisions
            .with_label_values(&[pool, reason.as_str()])
            .inc();
        self.worker_decisions.inc(pool, worker, reason);
        let ratio = if prompt_tokens == 0 {
            0.0
        } else {
            (matched_tokens as f64 / prompt_tokens as f64).clamp(0.0, 1.0)
        };
        self.match_ratio.with_label_values(&[pool]).observe(ratio);
        if let Some(blocks) = diverted_blocks {
            self.diverted_blocks
                .with_label_values(&[pool])
                .observe(blocks as f64);
        }
    }

    /// One refused request: `cachepick_refusals_total{pool,reason}` += 1, labelled
    /// [`RefusalReason::as_str`] (`no_workers`, `invalid_json`, `unknown_model`, `too_large`...); `pool`
    /// is `"none"` when no pool was selected.
    pub fn record_refusal(&self, pool: &str, reason: RefusalReason) {
        self.refusals
            .with_label_values(&[pool, reason.as_str()])
            .inc();
    }

    /// `cachepick_decision_seconds{pool}`: body received → answer sent. Negative durations count as 0;
    /// NaN is dropped.
    pub fn observe_decision_seconds(&self, pool: &str, seconds: f64) {
        if seconds.is_nan() {
            return;
        }
        self.decision_seconds
            .with_label_values(&[pool])
            .observe(seconds.max(0.0));
    }

    /// An ext_proc stream opened: `cachepick_extproc_streams_opened_total` and
    /// `cachepick_extproc_streams_active` += 1.
    pub fn stream_opened(&self) {
        self.streams_opened.inc();
        self.streams_active.inc();
    }

    /// An ext_proc stream ended: `cachepick_extproc_streams_closed_total{outcome}` += 1 and
    /// `cachepick_extproc_streams_active` -= 1.
    pub fn stream_closed(&self, end: StreamEnd) {
        self.streams_closed.with_label_values(&[end.as_str()]).inc();
        self.streams_active.dec();
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        // Encoding into a Vec fails only for malformed families, which `new` cannot build.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }
}

/// The scrapers count into `cachepick_scrapes_total` and report their pools' freshness here.
impl ScrapeObserver for Metrics {
    fn scrape_counter(&self, pool: &str, worker: &str, outcome: ScrapeOutcome) -> IntCounter {
        self.scrapes
            .with_label_values(&[pool, worker, outcome.as_str()])
    }

    fn watch_pool(&self, pool: Arc<PoolLoad>) {
        Metrics::watch_pool(self, pool);
    }

    fn worker_left(&self, pool: &str, worker: &str) {
        self.worker_decisions.forget(pool, worker);
        for outcome in ScrapeOutcome::ALL {
            let _ = self
                .scrapes
                .remove_label_values(&[pool, worker, outcome.as_str()]);
        }
    }
}

impl IndexGauges {
    /// Sets the gauges from every source and collects them, under the sources' lock (see
    /// [`LoadGauges::collect_at`]).
    fn collect_now(&self) -> Vec<MetricFamily> {
        let Ok(sources) = self.sources.lock() else {
            return Vec::new();
        };
        self.blocks.reset();
        self.entries.reset();
        for source in sources.iter() {
            for (pool, stats) in source() {
                let blocks = i64::try_from(stats.blocks).unwrap_or(i64::MAX);
                let entries = i64::try_from(stats.entries).unwrap_or(i64::MAX);
                self.blocks.with_label_values(&[pool.as_str()]).set(blocks);
                self.entries
                    .with_label_values(&[pool.as_str()])
                    .set(entries);
            }
        }
        self.segment_bytes.reset();
        if let Ok(segment_sources) = self.segment_sources.lock() {
            for source in segment_sources.iter() {
                for (pool, bytes) in source() {
                    self.segment_bytes
                        .with_label_values(&[pool.as_str()])
                        .set(i64::try_from(bytes).unwrap_or(i64::MAX));
                }
            }
        }
        let mut families = self.blocks.collect();
        families.extend(self.entries.collect());
        families.extend(self.segment_bytes.collect());
        families
    }
}

/// Registers the index gauges with the registry while `Metrics` keeps its handle to add sources.
#[derive(Debug)]
struct IndexCollector(Arc<IndexGauges>);

impl Collector for IndexCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs = self.0.blocks.desc();
        descs.extend(self.0.entries.desc());
        descs.extend(self.0.segment_bytes.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect_now()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Fails with the whole exposition unless `text` has exactly the line `expected`.
    #[track_caller]
    fn assert_line(text: &str, expected: &str) {
        assert!(
            text.lines().any(|line| line == expected),
            "missing line {expected:?} in\n{text}"
        );
    }

    #[track_caller]
    fn assert_no_series(text: &str, name: &str) {
        assert!(
            !text.lines().any(|line| line.starts_with(name)),
            "unexpected {name} in\n{text}"
        );
    }

    #[test]
    fn every_metric_registers_and_renders() {
        let metrics = Metrics::new().unwrap();
        metrics
            .scrapes
            .with_label_values(&["m", "127.0.0.1:1", "ok"])
            .inc();
        let text = metrics.render();
        assert!(text.contains(
            "cachepick_scrapes_total{outcome=\"ok\",pool=\"m\",worker=\"127.0.0.1:1\"} 1"
        ));
        assert_line(
            &text,
            &format!(
                "cachepick_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
        );
        for end in StreamEnd::ALL {
            assert_line(
                &text,
                &format!(
                    "cachepick_extproc_streams_closed_total{{outcome=\"{}\"}} 0",
                    end.as_str()
                ),
            );
        }
        // Every family has a HELP line an operator can read.
        for line in text.lines().filter(|line| line.starts_with("# HELP")) {
            assert!(line.split_whitespace().count() > 4, "{line}");
        }
    }

    #[test]
    fn init_pool_pre_creates_every_reason_at_zero() {
        let metrics = Metrics::new().unwrap();
        assert_no_series(&metrics.render(), "cachepick_decisions_total{");
        metrics.init_pool("p");
        let text = metrics.render();
        for reason in Reason::ALL {
            assert_line(
                &text,
                &format!(
                    "cachepick_decisions_total{{pool=\"p\",reason=\"{}\"}} 0",
                    reason.as_str()
                ),
            );
        }
        let decisions = text
            .lines()
            .filter(|line| line.starts_with("cachepick_decisions_total{"))
            .count();
        assert_eq!(decisions, Reason::ALL.len());
        assert_line(
            &text,
            "cachepick_refusals_total{pool=\"p\",reason=\"no_workers\"} 0",
        );
        assert_line(&text, "cachepick_prefix_match_ratio_count{pool=\"p\"} 0");
        assert_line(
            &text,
            "cachepick_diverted_prefix_blocks_count{pool=\"p\"} 0",
        );
        assert_line(&text, "cachepick_decision_seconds_count{pool=\"p\"} 0");
    }

    #[test]
    fn decisions_count_reasons_and_observe_match_and_diversion() {
        let metrics = Metrics::new().unwrap();
        metrics.record_decision("p", "127.0.0.1:1", Reason::CacheHit, 100, 50, None);
        metrics.record_decision(
            "p",
            "127.0.0.1:1",
            Reason::CacheWorkerQueued,
            100,
            0,
            Some(3),
        );
        // An empty prompt matches nothing; a match beyond the prompt is clamped to 1.
        metrics.record_decision("p", "127.0.0.1:1", Reason::CacheMiss, 0, 0, None);
        metrics.record_decision("p", "127.0.0.1:1", Reason::CacheHit, 10, 20, None);
        let text = metrics.render();

        assert_line(
            &text,
            "cachepick_decisions_total{pool=\"p\",reason=\"cache_hit\"} 2",
        );
        assert_line(
            &text,
            "cachepick_decisions_total{pool=\"p\",reason=\"cache_worker_queued\"} 1",
        );
        assert_line(
            &text,
            "cachepick_decisions_total{pool=\"p\",reason=\"cache_miss\"} 1",
        );
        assert_line(
            &text,
            "cachepick_worker_decisions_total{pool=\"p\",reason=\"cache_hit\",worker=\"127.0.0.1:1\"} 2",
        );
        // A worker that leaves takes its series with it: the label set stays bounded by the fleet.
        ScrapeObserver::worker_left(&metrics, "p", "127.0.0.1:1");
        assert_no_series(&metrics.render(), "cachepick_worker_decisions_total{");
        #[cfg(target_os = "linux")]
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(
                text.lines()
                    .any(|line| line.starts_with(&format!("{name} "))),
                "{name} is missing"
            );
        }

        for (le, count) in [
            ("0", 2),
            ("0.1", 2),
            ("0.4", 2),
            ("0.5", 3),
            ("0.9", 3),
            ("1", 4),
            ("+Inf", 4),
        ] {
            assert_line(
                &text,
                &format!("cachepick_prefix_match_ratio_bucket{{pool=\"p\",le=\"{le}\"}} {count}"),
            );
        }
        assert_line(&text, "cachepick_prefix_match_ratio_sum{pool=\"p\"} 1.5");
        assert_line(&text, "cachepick_prefix_match_ratio_count{pool=\"p\"} 4");

        // Only the one real diversion is observed.
        for (le, count) in [("1", 0), ("2", 0), ("4", 1), ("16384", 1), ("+Inf", 1)] {
            assert_line(
                &text,
                &format!(
                    "cachepick_diverted_prefix_blocks_bucket{{pool=\"p\",le=\"{le}\"}} {count}"
                ),
            );
        }
        assert_line(&text, "cachepick_diverted_prefix_blocks_sum{pool=\"p\"} 3");
        assert_line(
            &text,
            "cachepick_diverted_prefix_blocks_count{pool=\"p\"} 1",
        );
    }

    #[test]
    fn refusals_count_by_pool_and_reason() {
        let metrics = Metrics::new().unwrap();
        metrics.record_refusal("none", RefusalReason::InvalidJson);
        metrics.record_refusal("none", RefusalReason::InvalidJson);
        metrics.record_refusal("p", RefusalReason::NoWorkers);
        let text = metrics.render();
        assert_line(
            &text,
            "cachepick_refusals_total{pool=\"none\",reason=\"invalid_json\"} 2",
        );
        assert_line(
            &text,
            "cachepick_refusals_total{pool=\"p\",reason=\"no_workers\"} 1",
        );
    }

    #[test]
    fn decision_seconds_span_microseconds_to_a_second() {
        let metrics = Metrics::new().unwrap();
        metrics.observe_decision_seconds("p", 0.0001);
        metrics.observe_decision_seconds("p", 0.3);
        metrics.observe_decision_seconds("p", -1.0);
        metrics.observe_decision_seconds("p", f64::NAN);
        let text = metrics.render();
        for (le, count) in [
            ("0.000025", 1),
            ("0.00005", 1),
            ("0.0001", 2),
            ("0.2048", 2),
            ("0.4096", 3),
            ("0.8192", 3),
            ("+Inf", 3),
        ] {
            assert_line(
                &text,
                &format!("cachepick_decision_seconds_bucket{{pool=\"p\",le=\"{le}\"}} {count}"),
            );
        }
        assert_line(&text, "cachepick_decision_seconds_count{pool=\"p\"} 3");
    }

    #[test]
    fn active_streams_go_up_and_down() {
        let metrics = Metrics::new().unwrap();
        assert_line(&metrics.render(), "cachepick_extproc_streams_active 0");
        metrics.stream_opened();
        metrics.stream_opened();
        metrics.stream_opened();
        assert_line(&metrics.render(), "cachepick_extproc_streams_active 3");
        metrics.stream_closed(StreamEnd::Answered);
        metrics.stream_closed(StreamEnd::Reset);
        let text = metrics.render();
        assert_line(&text, "cachepick_extproc_streams_active 1");
        assert_line(&text, "cachepick_extproc_streams_opened_total 3");
        assert_line(
            &text,
            "cachepick_extproc_streams_closed_total{outcome=\"answered\"} 1",
        );
        assert_line(
            &text,
            "cachepick_extproc_streams_closed_total{outcome=\"reset\"} 1",
        );
        assert_line(
            &text,
            "cachepick_extproc_streams_closed_total{outcome=\"error\"} 0",
        );
        metrics.stream_closed(StreamEnd::Error);
        let text = metrics.render();
        assert_line(&text, "cachepick_extproc_streams_active 0");
        assert_line(
            &text,
            "cachepick_extproc_streams_closed_total{outcome=\"error\"} 1",
        );
    }

    #[test]
    fn index_gauges_are_computed_from_the_source_at_collection() {
        let metrics = Metrics::new().unwrap();
        assert_no_series(&metrics.render(), "cachepick_index_blocks{");
        let grown = Arc::new(AtomicUsize::new(5));
        let source_grown = Arc::clone(&grown);
        metrics.watch_index(Arc::new(move || {
            let blocks = source_grown.load(Ordering::Relaxed);
            vec![
                (
                    "a".to_owned(),
                    IndexStats {
                        blocks,
                        entries: blocks + 2,
                        held: vec![blocks, 2],
                    },
                ),
                (
                    "b".to_owned(),
                    IndexStats {
                        blocks: 0,
                        entries: 0,
                        held: vec![0],
                    },
                ),
            ]
        }));
        let text = metrics.render();
        assert_line(&text, "cachepick_index_blocks{pool=\"a\"} 5");
        assert_line(&text, "cachepick_index_entries{pool=\"a\"} 7");
        assert_line(&text, "cachepick_index_blocks{pool=\"b\"} 0");
        assert_line(&text, "cachepick_index_entries{pool=\"b\"} 0");

        grown.store(40, Ordering::Relaxed);
        let text = metrics.render();
        assert_line(&text, "cachepick_index_blocks{pool=\"a\"} 40");
        assert_line(&text, "cachepick_index_entries{pool=\"a\"} 42");
    }
}

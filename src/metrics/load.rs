//! The gauges read off every watched pool's current snapshot at collection time: readings' ages, what
//! each worker's counters taught (prefill and drain rates, tokens per request, the engine's queue wait),
//! workers fresh, stale and by lifecycle state, and the Gateway API Inference Extension's pool gauges.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, IntGaugeVec, Opts};

use super::gie::GiePoolGauges;
use crate::load::{Lifecycle, PoolLoad};

/// Gauges read off the current snapshots of every watched pool at collection time.
#[derive(Debug)]
pub(super) struct LoadGauges {
    /// `cachepick_worker_reading_age_seconds{pool,worker}`: age of the reading's oldest DP rank; absent
    /// until a worker's first reading.
    reading_age: GaugeVec,
    /// `cachepick_worker_prefill_tokens_per_second{pool,worker}`,
    /// `cachepick_worker_queue_drain_tokens_per_second{pool,worker}`,
    /// `cachepick_worker_uncached_tokens_per_request{pool,worker}` and
    /// `cachepick_worker_engine_queue_wait_seconds{pool,worker}`: what the worker's engine taught
    /// (`load::rate`); absent until learned.
    prefill_rate: IntGaugeVec,
    drain_rate: IntGaugeVec,
    uncached_per_request: IntGaugeVec,
    queue_wait: GaugeVec,
    /// `cachepick_worker_waiting_routed_tokens{pool,worker}`: the waiting requests' own uncached
    /// tokens as routed (`load::DispatchTable::queued`), what weighs the engine's tokens per request
    /// into the price of a queue it reports as a count; absent until a routed request is remembered.
    waiting_routed: IntGaugeVec,
    /// `cachepick_pool_dispatch_share{pool}`: requests reaching the pool per request this replica sends
    /// it (`load::share`), the factor on the time unit's window of own dispatches.
    dispatch_share: GaugeVec,
    /// `cachepick_workers_fresh{pool}` / `cachepick_workers_stale{pool}`.
    workers_fresh: IntGaugeVec,
    workers_stale: IntGaugeVec,
    /// `cachepick_workers{pool,state}`: workers in each lifecycle state.
    workers: IntGaugeVec,
    /// `cachepick_worker_info{pool,worker,role}` = 1: the role to join onto any per-worker series.
    info: IntGaugeVec,
    /// The Gateway API Inference Extension's `inference_pool_*{name}` gauges (`gie.rs`).
    gie: GiePoolGauges,
    pub(super) pools: Mutex<Vec<Arc<PoolLoad>>>,
}

impl LoadGauges {
    pub(super) fn new() -> Result<Self, prometheus::Error> {
        Ok(LoadGauges {
            reading_age: GaugeVec::new(
                Opts::new(
                    "cachepick_worker_reading_age_seconds",
                    "Age of each worker's current load reading (its oldest DP rank).",
                ),
                &["pool", "worker"],
            )?,
            prefill_rate: IntGaugeVec::new(
                Opts::new(
                    "cachepick_worker_prefill_tokens_per_second",
                    "Uncached prompt tokens one prefill computes per second on each worker, from its \
                 engine's per-request prefill histograms (vLLM); what the prefill-time gate prices a \
                 request's own prefill at. Absent until learned, and for engines without them.",
                ),
                &["pool", "worker"],
            )?,
            drain_rate: IntGaugeVec::new(
                Opts::new(
                    "cachepick_worker_queue_drain_tokens_per_second",
                    "Uncached prompt tokens each worker completes per second while requests wait, learned \
                 from its engine's counters: how fast its queue drains (slots and decoding included); \
                 what the prefill-time gate prices the queue ahead at. Absent until learned.",
                ),
                &["pool", "worker"],
            )?,
            queue_wait: GaugeVec::new(
                Opts::new(
                    "cachepick_worker_engine_queue_wait_seconds",
                    "The mean time recent requests waited in each worker's queue, by its engine's own \
                 histogram (vLLM's request_queue_time_seconds), weighted over the rate half-life.",
                ),
                &["pool", "worker"],
            )?,
            uncached_per_request: IntGaugeVec::new(
                Opts::new(
                    "cachepick_worker_uncached_tokens_per_request",
                    "Uncached prompt tokens a request brings to each worker on average, learned from its \
                 engine's counters: the price of one waiting request where the engine reports a count.",
                ),
                &["pool", "worker"],
            )?,
            waiting_routed: IntGaugeVec::new(
                Opts::new(
                    "cachepick_worker_waiting_routed_tokens",
                    "Uncached prompt tokens of the requests waiting on each worker at its latest \
                 reading, by their own sizes as predicted when they were routed there: what weighs the \
                 engine's tokens per request into the price of a queue it reports as a count.",
                ),
                &["pool", "worker"],
            )?,
            dispatch_share: GaugeVec::new(
                Opts::new(
                    "cachepick_pool_dispatch_share",
                    "Requests reaching the pool's workers (from their engines' counters) per request this \
                 replica sends them: about 1 alone, about N among N replicas; the prefill-time gate \
                 scales this replica's dispatches since each reading by it.",
                ),
                &["pool"],
            )?,
            workers_fresh: IntGaugeVec::new(
                Opts::new(
                    "cachepick_workers_fresh",
                    "Workers of the pool whose reading is complete and younger than load.freshness.",
                ),
                &["pool"],
            )?,
            workers_stale: IntGaugeVec::new(
                Opts::new(
                    "cachepick_workers_stale",
                    "Workers of the pool without a fresh reading: the queue gate admits them blind.",
                ),
                &["pool"],
            )?,
            workers: IntGaugeVec::new(
                Opts::new(
                    "cachepick_workers",
                    "Workers of the pool by lifecycle state: new (joined, not yet answered a scrape), healthy, \
                 unreachable (scrapes cannot connect: never an owner, used only when nothing else is \
                 left), draining (left discovery: no new requests), restarted (engine restarted with an \
                 empty cache).",
                ),
                &["pool", "state"],
            )?,
            info: IntGaugeVec::new(
                Opts::new(
                    "cachepick_worker_info",
                    "1 for each worker of each pool, with its role (prefill, decode or both): join it onto \
                 a per-worker series, e.g. `* on(pool, worker) group_left(role) cachepick_worker_info`.",
                ),
                &["pool", "worker", "role"],
            )?,
            gie: GiePoolGauges::new()?,
            pools: Mutex::new(Vec::new()),
        })
    }

    /// Sets the gauges from the watched pools' current snapshots and collects them, holding the pool
    /// list's lock throughout so that concurrent collections cannot interleave a reset with a read.
    fn collect_at(&self, now: Instant) -> Vec<MetricFamily> {
        let Ok(pools) = self.pools.lock() else {
            return Vec::new();
        };
        self.reading_age.reset();
        self.prefill_rate.reset();
        self.drain_rate.reset();
        self.uncached_per_request.reset();
        self.waiting_routed.reset();
        self.queue_wait.reset();
        self.info.reset();
        self.gie.reset();
        for pool in pools.iter() {
            let snapshot = pool.snapshot();
            self.gie.set(pool.label(), &snapshot, now);
            let mut fresh = 0_i64;
            for worker in snapshot.workers() {
                let endpoint = worker.endpoint.to_string();
                let labels = [pool.label(), endpoint.as_str()];
                self.info
                    .with_label_values(&[pool.label(), endpoint.as_str(), worker.role.as_str()])
                    .set(1);
                for (gauge, value) in [
                    (&self.prefill_rate, worker.prefill.prefill_tokens_per_second),
                    (&self.drain_rate, worker.prefill.drain_tokens_per_second),
                    (
                        &self.uncached_per_request,
                        worker.prefill.uncached_per_request,
                    ),
                    (&self.waiting_routed, worker.prefill.waiting_routed_tokens),
                ] {
                    if let Some(value) = value {
                        gauge
                            .with_label_values(&labels)
                            .set(i64::try_from(value).unwrap_or(i64::MAX));
                    }
                }
                if let Some(us) = worker.prefill.queue_wait_us {
                    self.queue_wait
                        .with_label_values(&labels)
                        .set(us as f64 / 1e6);
                }
                let Some(reading) = &worker.reading else {
                    continue;
                };
                let age = now.saturating_duration_since(reading.captured_at);
                self.reading_age
                    .with_label_values(&[pool.label(), endpoint.as_str()])
                    .set(age.as_secs_f64());
                if snapshot.is_fresh(reading, now) {
                    fresh += 1;
                }
            }
            self.dispatch_share
                .with_label_values(&[pool.label()])
                .set(pool.dispatches().share());
            let total = i64::try_from(snapshot.workers().len()).unwrap_or(i64::MAX);
            self.workers_fresh
                .with_label_values(&[pool.label()])
                .set(fresh);
            self.workers_stale
                .with_label_values(&[pool.label()])
                .set(total.saturating_sub(fresh));
            for state in Lifecycle::ALL {
                let count = snapshot
                    .workers()
                    .iter()
                    .filter(|worker| worker.lifecycle == state)
                    .count();
                self.workers
                    .with_label_values(&[pool.label(), state.as_str()])
                    .set(i64::try_from(count).unwrap_or(i64::MAX));
            }
        }
        let mut families = self.reading_age.collect();
        families.extend(self.prefill_rate.collect());
        families.extend(self.drain_rate.collect());
        families.extend(self.uncached_per_request.collect());
        families.extend(self.waiting_routed.collect());
        families.extend(self.queue_wait.collect());
        families.extend(self.dispatch_share.collect());
        families.extend(self.workers_fresh.collect());
        families.extend(self.workers_stale.collect());
        families.extend(self.workers.collect());
        families.extend(self.info.collect());
        families.extend(self.gie.collect());
        families
    }
}

/// Registers the shared load gauges with the registry while `Metrics` keeps its handle to watch pools.
#[derive(Debug)]
pub(super) struct SharedCollector(pub(super) Arc<LoadGauges>);

impl Collector for SharedCollector {
    fn desc(&self) -> Vec<&Desc> {
        let gauges = &self.0;
        let mut descs = gauges.reading_age.desc();
        descs.extend(gauges.prefill_rate.desc());
        descs.extend(gauges.drain_rate.desc());
        descs.extend(gauges.uncached_per_request.desc());
        descs.extend(gauges.waiting_routed.desc());
        descs.extend(gauges.queue_wait.desc());
        descs.extend(gauges.dispatch_share.desc());
        descs.extend(gauges.workers_fresh.desc());
        descs.extend(gauges.workers_stale.desc());
        descs.extend(gauges.workers.desc());
        descs.extend(gauges.gie.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect_at(Instant::now())
    }
}

//! cachepick's own Prometheus metrics, defined and registered in one place.
//!
//! Components receive a shared [`Metrics`] and update the handles they own; label values come from
//! enums (`ScrapeOutcome::as_str`, `Reason::as_str`) so the label sets stay bounded. Gauges that describe
//! the current load snapshots are computed when `/metrics` is read, so they stay true even if a scraper
//! stalls.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Encoder, GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::load::PoolLoad;

/// Every metric cachepick exports.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// `cachepick_scrapes_total{pool,worker,outcome}`.
    pub scrapes: IntCounterVec,
    load: Arc<LoadGauges>,
}

/// Gauges read off the current snapshots of every watched pool at collection time.
#[derive(Debug)]
struct LoadGauges {
    /// `cachepick_worker_reading_age_seconds{pool,worker}`: age of the reading's oldest DP rank; absent
    /// until a worker's first reading.
    reading_age: GaugeVec,
    /// `cachepick_workers_fresh{pool}` / `cachepick_workers_stale{pool}`.
    workers_fresh: IntGaugeVec,
    workers_stale: IntGaugeVec,
    pools: Mutex<Vec<Arc<PoolLoad>>>,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let load = Arc::new(LoadGauges {
            reading_age: GaugeVec::new(
                Opts::new(
                    "cachepick_worker_reading_age_seconds",
                    "Age of each worker's current load reading (its oldest DP rank).",
                ),
                &["pool", "worker"],
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
            pools: Mutex::new(Vec::new()),
        });
        let metrics = Metrics {
            registry: Registry::new(),
            scrapes: IntCounterVec::new(
                Opts::new(
                    "cachepick_scrapes_total",
                    "Load scrapes of each worker, by outcome (ok, timeout, http_error, parse_error, connect_error).",
                ),
                &["pool", "worker", "outcome"],
            )?,
            load,
        };
        metrics
            .registry
            .register(Box::new(metrics.scrapes.clone()))?;
        metrics
            .registry
            .register(Box::new(SharedCollector(Arc::clone(&metrics.load))))?;
        Ok(metrics)
    }

    /// Reports `pool`'s freshness gauges from now on.
    pub fn watch_pool(&self, pool: Arc<PoolLoad>) {
        if let Ok(mut pools) = self.load.pools.lock() {
            pools.push(pool);
        }
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

impl LoadGauges {
    fn refresh(&self, now: Instant) {
        let Ok(pools) = self.pools.lock() else {
            return;
        };
        self.reading_age.reset();
        for pool in pools.iter() {
            let snapshot = pool.snapshot();
            let mut fresh = 0_i64;
            for worker in snapshot.workers() {
                let Some(reading) = &worker.reading else {
                    continue;
                };
                let age = now.saturating_duration_since(reading.captured_at);
                let endpoint = worker.endpoint.to_string();
                self.reading_age
                    .with_label_values(&[pool.label(), endpoint.as_str()])
                    .set(age.as_secs_f64());
                if snapshot.is_fresh(reading, now) {
                    fresh += 1;
                }
            }
            let total = i64::try_from(snapshot.workers().len()).unwrap_or(i64::MAX);
            self.workers_fresh
                .with_label_values(&[pool.label()])
                .set(fresh);
            self.workers_stale
                .with_label_values(&[pool.label()])
                .set(total.saturating_sub(fresh));
        }
    }
}

/// Registers the shared gauges with the registry while `Metrics` keeps its handle to watch pools.
#[derive(Debug)]
struct SharedCollector(Arc<LoadGauges>);

impl Collector for SharedCollector {
    fn desc(&self) -> Vec<&Desc> {
        let gauges = &self.0;
        let mut descs = gauges.reading_age.desc();
        descs.extend(gauges.workers_fresh.desc());
        descs.extend(gauges.workers_stale.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let gauges = &self.0;
        gauges.refresh(Instant::now());
        let mut families = gauges.reading_age.collect();
        families.extend(gauges.workers_fresh.collect());
        families.extend(gauges.workers_stale.collect());
        families
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}

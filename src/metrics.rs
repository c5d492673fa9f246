//! cachepick's own Prometheus metrics, defined and registered in one place.
//!
//! Components receive a shared [`Metrics`] and update the handles they own; label values come from
//! enums (`ScrapeOutcome::as_str`, `Reason::as_str`) so the label sets stay bounded.

use prometheus::{Encoder, GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

/// Every metric cachepick exports.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// `cachepick_scrapes_total{pool,worker,outcome}`.
    pub scrapes: IntCounterVec,
    /// `cachepick_worker_reading_age_seconds{pool,worker}`: age of the oldest rank of the current reading,
    /// as of the end of the last scrape round; absent until a worker's first reading.
    pub reading_age: GaugeVec,
    /// `cachepick_workers_fresh{pool}` / `cachepick_workers_stale{pool}`.
    pub workers_fresh: IntGaugeVec,
    pub workers_stale: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let metrics = Metrics {
            registry: Registry::new(),
            scrapes: IntCounterVec::new(
                Opts::new(
                    "cachepick_scrapes_total",
                    "Load scrapes of each worker, by outcome (ok, timeout, http_error, parse_error, connect_error).",
                ),
                &["pool", "worker", "outcome"],
            )?,
            reading_age: GaugeVec::new(
                Opts::new(
                    "cachepick_worker_reading_age_seconds",
                    "Age of each worker's current load reading (its oldest DP rank), at the end of the last scrape round.",
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
        };
        metrics
            .registry
            .register(Box::new(metrics.scrapes.clone()))?;
        metrics
            .registry
            .register(Box::new(metrics.reading_age.clone()))?;
        metrics
            .registry
            .register(Box::new(metrics.workers_fresh.clone()))?;
        metrics
            .registry
            .register(Box::new(metrics.workers_stale.clone()))?;
        Ok(metrics)
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
        metrics.workers_fresh.with_label_values(&["m"]).set(1);
        let text = metrics.render();
        assert!(text.contains(
            "cachepick_scrapes_total{outcome=\"ok\",pool=\"m\",worker=\"127.0.0.1:1\"} 1"
        ));
        assert!(text.contains("cachepick_workers_fresh{pool=\"m\"} 1"));
    }
}

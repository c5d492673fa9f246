//! `cachepick_discovery_*`: what each pool's source of workers says about itself, read off its
//! [`SourceStatus`] at collection time.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, IntGaugeVec, Opts};

use super::families::{descs, samples};
use crate::discovery::SourceStatus;

/// The families, built afresh for each collection from the watched sources.
struct Families {
    updates: IntCounterVec,
    errors: IntCounterVec,
    members: IntGaugeVec,
}

impl Families {
    fn new() -> prometheus::Result<Self> {
        let labels = &["pool", "source"];
        Ok(Families {
            updates: IntCounterVec::new(
                Opts::new(
                    "cachepick_discovery_updates_total",
                    "Answers each pool's source of workers gave (a DNS resolution, a Kubernetes list or \
                     watch event, a reloaded file), whether or not the workers changed.",
                ),
                labels,
            )?,
            errors: IntCounterVec::new(
                Opts::new(
                    "cachepick_discovery_errors_total",
                    "Failed attempts of each pool's source (DNS errors, watch errors, invalid reloaded \
                     files); the last workers it published stay.",
                ),
                labels,
            )?,
            members: IntGaugeVec::new(
                Opts::new(
                    "cachepick_discovery_members",
                    "Workers the pool's source lists now.",
                ),
                labels,
            )?,
        })
    }

    fn collectors(&self) -> [&dyn Collector; 3] {
        [&self.updates, &self.errors, &self.members]
    }
}

/// The watched sources, by pool.
pub(super) struct DiscoveryGauges {
    sources: Mutex<Vec<(String, Arc<SourceStatus>)>>,
    template: Families,
}

impl DiscoveryGauges {
    pub(super) fn new() -> prometheus::Result<Self> {
        Ok(DiscoveryGauges {
            sources: Mutex::new(Vec::new()),
            template: Families::new()?,
        })
    }

    pub(super) fn watch(&self, pool: &str, status: Arc<SourceStatus>) {
        self.sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((pool.to_owned(), status));
    }

    fn collect_now(&self) -> Vec<MetricFamily> {
        let sources = self
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if sources.is_empty() {
            return Vec::new();
        }
        let Ok(families) = Families::new() else {
            return Vec::new();
        };
        for (pool, status) in &sources {
            let state = status.state();
            let labels = [pool.as_str(), status.kind];
            for (family, count) in [
                (&families.updates, state.updates),
                (&families.errors, state.errors),
            ] {
                family.with_label_values(&labels).inc_by(count);
            }
            families
                .members
                .with_label_values(&labels)
                .set(i64::try_from(state.members).unwrap_or(i64::MAX));
        }
        samples(&families.collectors())
    }
}

pub(super) struct DiscoveryCollector(pub(super) Arc<DiscoveryGauges>);

impl Collector for DiscoveryCollector {
    fn desc(&self) -> Vec<&Desc> {
        descs(&self.0.template.collectors())
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect_now()
    }
}

impl std::fmt::Debug for DiscoveryGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiscoveryGauges").finish_non_exhaustive()
    }
}

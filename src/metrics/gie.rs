//! The Gateway API Inference Extension's pool gauges, `inference_pool_*{name}`, beside cachepick's own,
//! so dashboards and autoscalers built for that ecosystem read cachepick as they read its endpoint
//! picker (EPP).
//!
//! They follow the EPP's definitions: the label `name` is the pool, and the averages run over the
//! pool's *ready* workers — those with a fresh reading (the EPP's "pods with fresh metrics"), here a
//! complete reading younger than `load.freshness`, of a worker that has not left discovery. Where they
//! differ, on purpose:
//! - `inference_pool_average_queue_size` is the true mean; the EPP divides integers and truncates
//!   (1 waiting over 2 pods reads 0 there, 0.5 here).
//! - `inference_pool_average_kv_cache_utilization` averages the ready workers whose KV use is known
//!   (`used_tokens / max_total_tokens`); a worker whose engine does not say counts as unknown, not as 0.
//! - With no ready worker the averages are absent, not the last values the EPP would keep showing:
//!   `inference_pool_ready_pods` says 0, and a mean over nothing is no reading at all.
//! - `inference_pool_per_pod_queue_size{name, model_server_pod}` names each ready worker by its
//!   endpoint (`host:port`), which is what cachepick knows it by; the EPP names the pod.
//!
//! Computed at collection time from the published snapshots, like every load gauge, so a scrape never
//! waits on a scraper.

use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, Opts};

use crate::load::{Lifecycle, PoolSnapshot, WorkerState};

/// The label the EPP names its pool with.
const POOL_LABEL: &str = "name";
/// The label the EPP names a pool member with in its per-pod series.
const POD_LABEL: &str = "model_server_pod";

/// One pool's gauges at one instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct PoolAverages {
    /// Workers with a fresh reading that have not left discovery.
    pub ready: usize,
    /// Mean engine queue (`waiting`) over the ready workers; `None` when none is ready.
    pub queue: Option<f64>,
    /// Mean running batch over the ready workers; `None` when none is ready.
    pub running: Option<f64>,
    /// Mean KV-cache use (0 to 1) over the ready workers that report it; `None` when none does.
    pub kv_cache: Option<f64>,
}

impl PoolAverages {
    /// The averages of `snapshot` at `now`.
    pub(super) fn of(snapshot: &PoolSnapshot, now: Instant) -> Self {
        let mut ready = 0_usize;
        let (mut waiting, mut running) = (0_u64, 0_u64);
        let (mut kv_sum, mut kv_known) = (0.0_f64, 0_usize);
        for worker in ready_workers(snapshot, now) {
            let Some(reading) = worker.reading.as_ref() else {
                continue;
            };
            ready += 1;
            waiting = waiting.saturating_add(reading.load.waiting);
            running = running.saturating_add(reading.load.running);
            let usage = reading
                .load
                .used_tokens
                .zip(worker.capacity.max_total_tokens)
                .filter(|(_, max)| *max > 0)
                .map(|(used, max)| (used as f64 / max as f64).clamp(0.0, 1.0));
            if let Some(usage) = usage {
                kv_sum += usage;
                kv_known += 1;
            }
        }
        let mean = |sum: f64, count: usize| (count > 0).then(|| sum / count as f64);
        PoolAverages {
            ready,
            queue: mean(waiting as f64, ready),
            running: mean(running as f64, ready),
            kv_cache: mean(kv_sum, kv_known),
        }
    }
}

/// The pool's ready workers at `now`: a fresh reading, and still in the pool (a draining worker has
/// left it; the EPP's pod list no longer holds it either).
fn ready_workers(snapshot: &PoolSnapshot, now: Instant) -> impl Iterator<Item = &WorkerState> {
    snapshot.workers().iter().filter(move |worker| {
        worker.lifecycle != Lifecycle::Draining
            && worker
                .reading
                .as_ref()
                .is_some_and(|reading| snapshot.is_fresh(reading, now))
    })
}

/// `inference_pool_{average_queue_size, average_running_requests, average_kv_cache_utilization,
/// ready_pods}{name}` and `inference_pool_per_pod_queue_size{name, model_server_pod}`, reset and set
/// for every collection.
#[derive(Debug)]
pub(super) struct GiePoolGauges {
    queue: GaugeVec,
    running: GaugeVec,
    kv_cache: GaugeVec,
    ready: GaugeVec,
    per_pod_queue: GaugeVec,
}

impl GiePoolGauges {
    pub(super) fn new() -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| GaugeVec::new(Opts::new(name, help), &[POOL_LABEL]);
        Ok(GiePoolGauges {
            queue: gauge(
                "inference_pool_average_queue_size",
                "Gateway API Inference Extension pool gauge: mean engine queue (requests waiting) over \
                 the pool's ready workers (fresh reading). Label name is the pool.",
            )?,
            running: gauge(
                "inference_pool_average_running_requests",
                "Gateway API Inference Extension pool gauge: mean running batch over the pool's ready \
                 workers (fresh reading). Label name is the pool.",
            )?,
            kv_cache: gauge(
                "inference_pool_average_kv_cache_utilization",
                "Gateway API Inference Extension pool gauge: mean KV-cache use (0 to 1) over the pool's \
                 ready workers that report it. Label name is the pool.",
            )?,
            ready: gauge(
                "inference_pool_ready_pods",
                "Gateway API Inference Extension pool gauge: workers of the pool with a fresh reading \
                 (complete, younger than load.freshness, not draining). Label name is the pool.",
            )?,
            per_pod_queue: GaugeVec::new(
                Opts::new(
                    "inference_pool_per_pod_queue_size",
                    "Gateway API Inference Extension pool gauge: engine queue (requests waiting) of each \
                     ready worker. Label name is the pool, model_server_pod the worker's endpoint.",
                ),
                &[POOL_LABEL, POD_LABEL],
            )?,
        })
    }

    /// Clears every series before a collection sets them again, so a pool or an average that is gone
    /// leaves no stale value behind.
    pub(super) fn reset(&self) {
        for gauge in self.gauges() {
            gauge.reset();
        }
    }

    /// Sets `pool`'s series from `snapshot` at `now`.
    pub(super) fn set(&self, pool: &str, snapshot: &PoolSnapshot, now: Instant) {
        for worker in ready_workers(snapshot, now) {
            if let Some(reading) = &worker.reading {
                let endpoint = worker.endpoint.to_string();
                self.per_pod_queue
                    .with_label_values(&[pool, endpoint.as_str()])
                    .set(reading.load.waiting as f64);
            }
        }
        let averages = PoolAverages::of(snapshot, now);
        self.ready
            .with_label_values(&[pool])
            .set(averages.ready as f64);
        for (gauge, value) in [
            (&self.queue, averages.queue),
            (&self.running, averages.running),
            (&self.kv_cache, averages.kv_cache),
        ] {
            if let Some(value) = value {
                gauge.with_label_values(&[pool]).set(value);
            }
        }
    }

    pub(super) fn desc(&self) -> Vec<&Desc> {
        self.gauges()
            .into_iter()
            .flat_map(|gauge| gauge.desc())
            .collect()
    }

    pub(super) fn collect(&self) -> Vec<MetricFamily> {
        self.gauges()
            .into_iter()
            .flat_map(|gauge| gauge.collect())
            .collect()
    }

    fn gauges(&self) -> [&GaugeVec; 5] {
        [
            &self.queue,
            &self.running,
            &self.kv_cache,
            &self.ready,
            &self.per_pod_queue,
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::load::{EngineLoad, Reading};
    use crate::worker::{Role, WorkerId};

    const FRESHNESS: Duration = Duration::from_secs(1);

    /// A worker whose reading was taken `age` before `now`, with `used` of 1000 KV tokens.
    fn worker(
        id: u32,
        now: Instant,
        age: Duration,
        waiting: u64,
        running: u64,
        used: Option<u64>,
    ) -> WorkerState {
        let mut worker = WorkerState::new(
            WorkerId(id),
            format!("127.0.0.1:{}", 9000 + id).parse().unwrap(),
            Role::Both,
        );
        worker.lifecycle = Lifecycle::Healthy;
        worker.capacity.max_total_tokens = Some(1000);
        worker.reading = Some(Reading {
            captured_at: now.checked_sub(age).unwrap(),
            complete: true,
            load: EngineLoad {
                waiting,
                running,
                waiting_uncached_tokens: None,
                used_tokens: used,
            },
        });
        worker
    }

    #[test]
    fn averages_run_over_fresh_workers_only_and_are_true_means() {
        let now = Instant::now();
        let fresh = Duration::from_millis(100);
        let mut draining = worker(3, now, fresh, 100, 100, Some(1000));
        draining.lifecycle = Lifecycle::Draining;
        let mut unknown_kv = worker(4, now, fresh, 0, 1, None);
        unknown_kv.capacity.max_total_tokens = None;
        let snapshot = PoolSnapshot::new(
            1,
            FRESHNESS,
            vec![
                worker(0, now, fresh, 1, 4, Some(500)),
                worker(1, now, fresh, 0, 2, Some(100)),
                // Stale: not ready, not averaged.
                worker(2, now, Duration::from_secs(5), 50, 50, Some(1000)),
                draining,
                unknown_kv,
            ],
        );
        let averages = PoolAverages::of(&snapshot, now);
        assert_eq!(averages.ready, 3);
        // 1 waiting over 3 ready workers: a third, where the EPP's integer division says 0.
        assert_eq!(averages.queue, Some(1.0 / 3.0));
        assert_eq!(averages.running, Some(7.0 / 3.0));
        // Only the two workers that know their KV use: (0.5 + 0.1) / 2.
        assert!((averages.kv_cache.unwrap() - 0.3).abs() < 1e-12);

        // Per pod: the ready workers only, by endpoint.
        let gauges = GiePoolGauges::new().unwrap();
        gauges.set("p", &snapshot, now);
        let mut per_pod: Vec<(String, f64)> = gauges
            .per_pod_queue
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .map(|metric| {
                let pod = metric
                    .get_label()
                    .iter()
                    .find(|label| label.name() == POD_LABEL)
                    .map(|label| label.value().to_owned())
                    .unwrap();
                (pod, metric.get_gauge().get_value())
            })
            .collect();
        per_pod.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            per_pod,
            [
                ("127.0.0.1:9000".to_owned(), 1.0),
                ("127.0.0.1:9001".to_owned(), 0.0),
                ("127.0.0.1:9004".to_owned(), 0.0),
            ]
        );
    }

    #[test]
    fn a_pool_without_a_fresh_reading_has_no_averages() {
        let now = Instant::now();
        let mut never = worker(1, now, Duration::ZERO, 0, 0, None);
        never.reading = None;
        let mut partial = worker(2, now, Duration::ZERO, 3, 3, Some(10));
        if let Some(reading) = partial.reading.as_mut() {
            reading.complete = false;
        }
        let snapshot = PoolSnapshot::new(
            1,
            FRESHNESS,
            vec![
                worker(0, now, Duration::from_secs(2), 1, 1, None),
                never,
                partial,
            ],
        );
        let averages = PoolAverages::of(&snapshot, now);
        assert_eq!(
            averages,
            PoolAverages {
                ready: 0,
                queue: None,
                running: None,
                kv_cache: None
            }
        );

        let gauges = GiePoolGauges::new().unwrap();
        gauges.set("p", &snapshot, now);
        let families = gauges.collect();
        let names: Vec<&str> = families
            .iter()
            .filter(|family| !family.get_metric().is_empty())
            .map(|family| family.name())
            .collect();
        assert_eq!(names, ["inference_pool_ready_pods"]);
    }
}

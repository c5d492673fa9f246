//! What operators look for first beside the decisions: requests per worker and reason, and the
//! process's own CPU, memory and file descriptors.

use prometheus::{IntCounterVec, Opts, Registry};

use crate::policy::Reason;

/// `cachepick_worker_decisions_total{pool,worker,reason}`: one series per worker and reason, removed
/// when the worker leaves the pool, so the label set stays bounded by the fleet.
#[derive(Clone, Debug)]
pub(super) struct WorkerDecisions(IntCounterVec);

impl WorkerDecisions {
    pub(super) fn new() -> Result<Self, prometheus::Error> {
        Ok(WorkerDecisions(IntCounterVec::new(
            Opts::new(
                "cachepick_worker_decisions_total",
                "Routed requests by the worker cachepick selected and the decision reason (the worker \
                 Envoy actually reached can differ after a retry: cachepick_feedback_total{outcome=\"moved\"}). \
                 A worker's series go when it leaves the pool.",
            ),
            &["pool", "worker", "reason"],
        )?))
    }

    pub(super) fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.0.clone()))
    }

    pub(super) fn inc(&self, pool: &str, worker: &str, reason: Reason) {
        self.0
            .with_label_values(&[pool, worker, reason.as_str()])
            .inc();
    }

    pub(super) fn forget(&self, pool: &str, worker: &str) {
        for reason in Reason::ALL {
            let _ = self.0.remove_label_values(&[pool, worker, reason.as_str()]);
        }
    }
}

/// The standard `process_*` series (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_open_fds`, `process_max_fds`, `process_virtual_memory_bytes`, `process_start_time_seconds`,
/// `process_threads`), read from `/proc` when `/metrics` is; Linux only, as `/proc` is.
pub(super) fn register_process(registry: &Registry) -> Result<(), prometheus::Error> {
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    #[cfg(not(target_os = "linux"))]
    let _ = registry;
    Ok(())
}

//! Whether the picker is ready, shared between the gRPC health service on `listen` (which decides it)
//! and the HTTP probes on `metrics_listen` (which report it), so a kubelet probe asks over HTTP what
//! Envoy's health check asks over gRPC.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Readiness as `extproc` last set it: false until the first scrape round, and from the drain on.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

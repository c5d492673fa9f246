//! Router-local dispatch counts: requests sent to each worker since its last complete reading.

use std::sync::atomic::{AtomicU64, Ordering};

use super::snapshot::DispatchCounts;
use crate::worker::WorkerId;

/// One counter per worker of a pool. The request path increments it after each decision; the scraper
/// clears it when a newer complete reading arrives, since the engine's own numbers then include what was
/// sent. Relaxed ordering suffices: each counter is an independent estimate, never a synchronisation
/// point.
#[derive(Debug)]
pub struct DispatchTable {
    counts: Vec<AtomicU64>,
}

impl DispatchTable {
    pub fn new(workers: usize) -> Self {
        DispatchTable {
            counts: (0..workers).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Counts one request sent to `id`.
    pub fn record(&self, id: WorkerId) {
        if let Some(count) = self.counts.get(id.index()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets what was sent to `id`: a newer reading covers it.
    pub fn reset(&self, id: WorkerId) {
        if let Some(count) = self.counts.get(id.index()) {
            count.store(0, Ordering::Relaxed);
        }
    }
}

impl DispatchCounts for DispatchTable {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.counts
            .get(id.index())
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }
}

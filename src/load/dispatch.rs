//! Router-local dispatch counts: requests sent to each worker since its last complete reading, and
//! their uncached prompt tokens as predicted at the decision.

use std::sync::atomic::{AtomicU64, Ordering};

use super::snapshot::DispatchCounts;
use crate::worker::WorkerId;

/// One counter per worker of a pool. The request path increments it after each decision; the scraper
/// subtracts what had been sent when a newer complete reading was requested, since the engine's numbers
/// then include those requests. Relaxed ordering suffices: each counter is an independent estimate, never a synchronisation
/// point.
#[derive(Debug)]
pub struct DispatchTable {
    counts: Vec<AtomicU64>,
    tokens: Vec<AtomicU64>,
    /// The pool's arrivals per own dispatch (`share.rs`), as `f64` bits: how much of what reaches the
    /// workers between readings this replica cannot see; the window's uncached tokens are scaled by it.
    share: AtomicU64,
}

impl DispatchTable {
    pub fn new(workers: usize) -> Self {
        DispatchTable {
            counts: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            tokens: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            share: AtomicU64::new(1.0_f64.to_bits()),
        }
    }

    /// Slots the table counts for.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Requests reaching the pool per request this replica sends it (at least 1).
    pub fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
    }

    pub(super) fn set_share(&self, share: f64) {
        self.share
            .store(share.max(1.0).to_bits(), Ordering::Relaxed);
    }

    /// Forgets every request counted for `id`: its worker left, restarted, or the slot has a new one.
    pub fn reset(&self, id: WorkerId) {
        for table in [&self.counts, &self.tokens] {
            if let Some(slot) = table.get(id.index()) {
                slot.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Counts one request sent to `id`, bringing `uncached_tokens` the worker is predicted to compute.
    pub fn record(&self, id: WorkerId, uncached_tokens: u64) {
        if let Some(count) = self.counts.get(id.index()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(tokens) = self.tokens.get(id.index()) {
            tokens.fetch_add(uncached_tokens, Ordering::Relaxed);
        }
    }

    /// Forgets `count` requests and `tokens` uncached tokens sent to `id`: a newer reading covers
    /// them. What was sent since that reading was requested stays counted.
    pub fn forget(&self, id: WorkerId, count: u64, tokens: u64) {
        for (table, amount) in [(&self.counts, count), (&self.tokens, tokens)] {
            if let Some(slot) = table.get(id.index()) {
                let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
                    Some(current.saturating_sub(amount))
                });
            }
        }
    }
}

impl DispatchCounts for DispatchTable {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.counts
            .get(id.index())
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    /// This replica's own uncached tokens since the reading, times the pool's share: the request-count
    /// rules see the own count alone ([`DispatchCounts::since_reading`]), as the seed defines them.
    fn uncached_since_reading(&self, id: WorkerId) -> u64 {
        let own = self
            .tokens
            .get(id.index())
            .map_or(0, |tokens| tokens.load(Ordering::Relaxed));
        (own as f64 * self.share()).round() as u64
    }
}

//! The routing policy: a pure, synchronous decision over an immutable load snapshot.
//!
//! [`decide`] takes everything it depends on as arguments — the request's facts, the prefix owners the
//! index found, the load snapshot with the router-local dispatch counts and the current instant, the
//! policy configuration and a random source — and returns an [`Outcome`] whose reason is an enum. It
//! performs no I/O, reads no clock, records no metrics and never awaits; the caller turns the reason into
//! labels and headers. That keeps every routing rule testable as a table of plain data.
//!
//! The ladder, first rung that yields a worker wins:
//! 1. **Owners** passing the queue gate and hard admission: deepest match, then least pressure, then id
//!    → [`Reason::CacheHit`].
//! 2. **Saturation pin** (with `saturation_queue_floor`): some owner was turned away by the gate, and no
//!    fleet worker has a fresh reading below the floor → among the queued owners that pass hard admission
//!    and match at least `pin_depth_ratio` of the deepest of them, the least pressured →
//!    [`Reason::SaturationPin`].
//! 3. **All queued** (no floor): every fleet worker has a fresh reading at or above the limit → the
//!    queued owners are re-admitted, hard admission applies, the deepest wins → [`Reason::AllQueued`].
//! 4. **Off-owner**: sample `min_load_choices` fleet workers passing the gate and hard admission (else
//!    hard admission only), least load wins; if nobody passes hard admission, the least-pressured fleet
//!    worker → [`Reason::CacheWorkerQueued`], [`Reason::CapacityFallback`] or [`Reason::CacheMiss`].
//! 5. An empty fleet → [`RejectReason::NoWorkers`].
//!
//! The gate fails open (a worker without a fresh reading passes it) while the saturation check fails
//! closed (a worker without a fresh reading is no evidence of idleness): missing signal keeps the request
//! with its prefix owner either way.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    clippy::disallowed_methods
)]

mod ladder;
mod outcome;
mod rank;
mod trace;

#[cfg(test)]
mod tests;

use std::time::Instant;

pub use ladder::decide;
pub use outcome::{Decision, Outcome, Reason, Reject, RejectReason};
pub use trace::{Admission, Gate, OwnerVerdict, PressureSource, Rung, Sampled, Saturation, Trace};

use crate::load::{DispatchCounts, PoolSnapshot};
use crate::worker::WorkerId;

/// What the policy needs to know about the request itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestFacts<'a> {
    /// Prompt tokens, checked against each worker's free KV cache.
    pub prompt_tokens: u64,
    /// The endpoints the proxy allows for this request (its subset hint), as worker ids; `None` allows
    /// the whole pool.
    pub allowed: Option<&'a [WorkerId]>,
}

/// One worker's match in the owner index: how many leading prompt tokens it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OwnerMatch {
    pub worker: WorkerId,
    pub matched_tokens: u64,
}

/// The load side of a decision: one snapshot, the dispatches since its readings, and the instant that
/// decides which readings are fresh.
#[derive(Clone, Copy)]
pub struct LoadView<'a> {
    pub snapshot: &'a PoolSnapshot,
    pub dispatches: &'a dyn DispatchCounts,
    pub now: Instant,
}

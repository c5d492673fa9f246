//! The log lines of a routed decision: one at debug level for every decision, and, sampled, one at
//! info level for the decisions operators look for (a pin, an owner taken with its gate blind).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use super::prepared::Prepared;
use crate::policy::{Decision, Gate, Reason};

/// Info-level events (pins, blind gates) are logged for one request in this many, so a saturated
/// fleet cannot flood the log; the metrics count every one.
pub(super) const LOG_SAMPLE: u64 = 64;

/// Logs the routed `decision` of `prepared`, sent to `endpoints` (the selected worker first);
/// `sampled` counts the info-level events of the service.
pub(super) fn routed(
    sampled: &AtomicU64,
    prepared: &Prepared,
    decision: &Decision,
    endpoints: &[SocketAddr],
) {
    let selected = endpoints
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    let trace = &decision.trace;
    tracing::debug!(
        pool = %prepared.pool_label,
        reason = decision.reason.as_str(),
        selected = %selected,
        matched_tokens = decision.matched_tokens,
        prompt_tokens = prepared.prompt_tokens,
        owners = trace.owners.len(),
        fleet = trace.fleet,
        fresh = trace.fresh,
        snapshot = trace.snapshot_version,
        "routed"
    );
    // Blind: the selected owner passed the gate only because its queue (or its rate) was unknown.
    let blind = trace
        .owners
        .iter()
        .find(|owner| owner.worker == decision.selected)
        .map(|owner| owner.gate)
        .filter(|gate| matches!(gate, Gate::Unread | Gate::Unpriced));
    let notable = decision.reason == Reason::SaturationPin || blind.is_some();
    if notable
        && sampled
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(LOG_SAMPLE)
    {
        tracing::info!(
            pool = %prepared.pool_label,
            reason = decision.reason.as_str(),
            selected = %selected,
            blind_gate = blind.is_some(),
            fleet = trace.fleet,
            fresh = trace.fresh,
            sample = LOG_SAMPLE,
            "{}",
            match blind {
                Some(Gate::Unread) => {
                    "routed to an owner whose queue is unknown (no fresh reading: none yet, or its scrape is late)"
                }
                Some(_) => {
                    "routed to an owner whose wait is not priced yet (a fresh reading, but no prefill \
                     rate: none learned from the engines yet, and no prefill_tokens_per_second)"
                }
                None => "fleet saturated: pinned to the least-pressured owner instead of diverting",
            }
        );
    }
}

//! The routing policy: a pure, synchronous decision over an immutable load snapshot.
//!
//! [`decide`] takes everything it depends on as arguments — the request's facts (including, for round
//! robin, its place in the pool's sequence), the prefix owners the index found, the load snapshot with
//! the router-local dispatch counts and the current instant, the pool's policy configuration and a
//! random source — and returns an [`Outcome`] whose reason is an enum. It performs no I/O, reads no
//! clock, keeps no state, records no metrics and never awaits; the caller turns the reason into labels
//! and headers. That keeps every routing rule testable as a table of plain data.
//!
//! Every mode chooses from the same **fleet**: the pool's routable workers with role `prefill` or
//! `both`, within the proxy's subset hint; an empty fleet is [`RefuseReason::NoWorkers`]. **Load** is
//! waiting + running from a fresh reading, plus the requests dispatched since it; a worker without a
//! fresh reading counts only its dispatches. The mode ([`Mode`]) then decides:
//!
//! - `round_robin`: the fleet in worker order, the request's `sequence` modulo the fleet size; the next
//!   workers in turn are the fallbacks → [`Reason::RoundRobin`].
//! - `least_load`: the least-loaded worker (a tie drawn at random); the next least loaded are the
//!   fallbacks → [`Reason::LeastLoad`].
//! - `balance_threshold`, the SGLang router's classic rule: the fleet is *imbalanced* when
//!   `max − min > balance_abs_threshold` and `max > balance_rel_threshold × min` (load, over the fleet)
//!   → least-loaded worker, [`Reason::Imbalanced`]. Otherwise the deepest owner takes the request when
//!   it holds more than `cache_threshold` of the prompt's tokens → [`Reason::BalancedOwner`], else the
//!   least-loaded worker → [`Reason::BalancedMiss`]. No gate, no hard admission, as upstream.
//! - `cache_aware`, the ladder below.
//!
//! An owner holds at least `min_match_tokens` leading tokens of the prompt and at least
//! `min_match_share` of it (`CacheAwareKnobs::owner_depth`); a shallower match counts for nothing.
//!
//! The ladder, first rung that yields a worker wins:
//! 1. **Owners** passing the queue gate and hard admission: deepest match, then least pressure, then the
//!    least recent off-owner placement and the id (`rank::Member::tie`, which ends every ordering)
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
//! 5. An empty fleet → [`RefuseReason::NoWorkers`].
//!
//! The gate fails open (a worker without a fresh reading passes it) while the saturation check fails
//! closed (a worker without a fresh reading is no evidence of idleness): missing signal keeps the request
//! with its prefix owner either way.
//!
//! **The prefill-time unit** (`gate_unit: prefill_time`, see `wait.rs`) keeps the ladder's shape and
//! changes what the gate and the floor measure. Each fleet worker gets a prediction for this request:
//! the uncached tokens ahead of it over the worker's prefill rate (queue), and its own uncached prompt
//! there — the worker's cached prefix counted, whatever its depth — over the same rate (prefill).
//! 1. An owner passes the gate unless its queue + prefill exceeds the best admitted worker's by more
//!    than `divert_margin` ([`Gate::Later`]): a diversion happens only where it is predicted to pay.
//! 2. The pin fires when some owner was turned away and no fleet worker is predicted to start the
//!    prefill within `saturation_wait_floor` ([`Saturation::NoneStartsSoon`]); among the turned-away
//!    owners that pass hard admission and match `pin_depth_ratio` of the deepest, the least queue wins.
//! 3. There is no all-queued rung: a fleet queued alike keeps every owner within the margin.
//! 4. A diversion goes to the worker predicted soonest; a request without an owner samples
//!    `min_load_choices` workers passing the gate and takes the one predicted soonest.
//! 5. There is no hard admission (`Admission::Unchecked`): an engine with no free running slot or KV
//!    room queues the request, a reading shows that queue a scrape later, and the prediction prices
//!    it. Turned away, an overloaded fleet's owners sent their requests cold to workers as full as
//!    they were, which then computed and held the whole prompt.
//!
//! 6. A worker whose counters taught no rate yet is priced at the median per-rank rate the other
//!    fleet workers learned, before the configured one: a worker that never queued is the one a
//!    diversion should find, and leaving it unpriced sends every diversion to whoever queued first.
//!
//! A worker without a fresh reading or any rate has no prediction: it passes the gate and is no
//! evidence for the floor, as in the request unit. Off-owner picks then order the unpriced workers
//! by the tokens they must compute before and for the first token, not by request counts.
// Decisions are reproducible: no clock reads here (clippy.toml); `now` is an argument.
#![deny(clippy::disallowed_methods)]

mod decode;
mod fleet;
mod ladder;
mod modes;
mod outcome;
mod rank;
mod trace;
mod wait;

#[cfg(test)]
mod tests;

use std::time::Instant;

use rand::Rng;

pub use decode::{DecodePick, DecodeReason, LocalPrefill, LocalRule, decide_decode, local_prefill};
pub use outcome::{Decision, Outcome, Reason, RefuseReason, Refused};
pub use trace::{
    Admission, Balance, Gate, OwnerVerdict, Predicted, Prediction, PressureSource, RateSource,
    Rung, Sampled, Saturation, Trace,
};

use crate::config::{CacheAwareKnobs, Mode, PolicyConfig};
use crate::load::{DispatchCounts, PoolSnapshot};
/// The owner index's answer, which the policy reads; defined beside the index that produces it.
pub use crate::prefix::OwnerMatch;
use crate::worker::WorkerId;

/// Picks the worker for one request under the pool's policy. Pure: same arguments (and random draws),
/// same outcome.
pub fn decide<R: Rng + ?Sized>(
    request: &RequestFacts<'_>,
    owners: &[OwnerMatch],
    load: &LoadView<'_>,
    config: &PolicyConfig,
    rng: &mut R,
) -> Outcome {
    let wait = config.cache_aware().and_then(CacheAwareKnobs::wait);
    let fleet = fleet::Fleet::new(
        request,
        owners,
        load,
        config.gate().map(|gate| gate.limit()),
        wait,
    );
    let trace = Trace {
        snapshot_version: load.snapshot.version,
        mode: config.mode.kind(),
        fleet: fleet.members.len(),
        fresh: fleet
            .members
            .iter()
            .filter(|member| member.fresh.is_some())
            .count(),
        predictions: fleet.predictions(),
        ..Trace::default()
    };
    if fleet.members.is_empty() {
        return Outcome::Refuse(Refused {
            reason: RefuseReason::NoWorkers,
            trace,
        });
    }
    // The selected worker and its fallbacks.
    let ranks = config
        .max_fallbacks
        .min(PolicyConfig::MAX_FALLBACKS_LIMIT)
        .saturating_add(1);
    match &config.mode {
        Mode::CacheAware(knobs) => ladder::cache_aware(&fleet, knobs, ranks, trace, rng),
        Mode::RoundRobin => modes::round_robin(&fleet, request.sequence, ranks, trace),
        Mode::LeastLoad => modes::least_load(&fleet, ranks, trace, rng),
        Mode::BalanceThreshold(knobs) => {
            modes::balance_threshold(&fleet, request.prompt_tokens, knobs, ranks, trace, rng)
        }
    }
}

/// What the policy needs to know about the request itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestFacts<'a> {
    /// Prompt tokens, checked against each worker's free KV cache.
    pub prompt_tokens: u64,
    /// The endpoints the proxy allows for this request (its subset hint), as worker ids; `None` allows
    /// the whole pool.
    pub allowed: Option<&'a [WorkerId]>,
    /// The request's number in its pool's sequence of decisions, for `round_robin` (the policy keeps no
    /// state: the caller counts). Other modes ignore it.
    pub sequence: u64,
}

/// The load side of a decision: one snapshot, the dispatches since its readings, and the instant that
/// decides which readings are fresh.
#[derive(Clone, Copy)]
pub struct LoadView<'a> {
    pub snapshot: &'a PoolSnapshot,
    pub dispatches: &'a dyn DispatchCounts,
    pub now: Instant,
}

//! What the policy returns: a routing decision or a refusal, each with its reason and trace.

use serde::Serialize;

use super::trace::Trace;
use crate::worker::WorkerId;

/// Why a request went where it went. The label values are part of the public interface: they appear
/// in `x-cachepick-decision`, Envoy's virtual-cluster stats and Prometheus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The deepest prefix owner that passes the queue gate and hard admission.
    CacheHit,
    /// The fleet is saturated (no fresh reading below the floor): diverting buys nothing, so the request
    /// waits at the least-pressured queued owner and prefills from its cache.
    SaturationPin,
    /// No floor is set and every fleet worker is queueing at the limit: the owners are re-admitted and
    /// the deepest takes the request.
    AllQueued,
    /// The owners are queueing at the limit while some worker is not: the request is diverted off-owner.
    CacheWorkerQueued,
    /// Owners exist but none can take the request (KV cache or running slots full), and queueing is not
    /// what stopped them.
    CapacityFallback,
    /// No worker holds enough of the prompt's prefix.
    CacheMiss,
    /// `round_robin`: the fleet worker whose turn it was.
    RoundRobin,
    /// `least_load`: the fleet worker with the fewest waiting + running + dispatched requests.
    LeastLoad,
    /// `balance_threshold`, fleet balanced: the deepest owner, holding more than `cache_threshold` of the
    /// prompt.
    BalancedOwner,
    /// `balance_threshold`, fleet balanced, no owner holding more than `cache_threshold` of the prompt:
    /// the least-loaded worker.
    BalancedMiss,
    /// `balance_threshold`, fleet imbalanced: the least-loaded worker, whoever holds the prefix.
    Imbalanced,
}

impl Reason {
    pub const ALL: [Reason; 11] = [
        Reason::CacheHit,
        Reason::SaturationPin,
        Reason::AllQueued,
        Reason::CacheWorkerQueued,
        Reason::CapacityFallback,
        Reason::CacheMiss,
        Reason::RoundRobin,
        Reason::LeastLoad,
        Reason::BalancedOwner,
        Reason::BalancedMiss,
        Reason::Imbalanced,
    ];

    /// Whether the request went to a worker that does not hold its prefix (the ladder's off-owner
    /// rung): a new prefix placed, which the next such placement's tie-break remembers.
    pub fn is_off_owner(self) -> bool {
        matches!(
            self,
            Reason::CacheMiss | Reason::CacheWorkerQueued | Reason::CapacityFallback
        )
    }

    /// The metric label and header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheHit => "cache_hit",
            Reason::SaturationPin => "saturation_pin",
            Reason::AllQueued => "all_queued",
            Reason::CacheWorkerQueued => "cache_worker_queued",
            Reason::CapacityFallback => "capacity_fallback",
            Reason::CacheMiss => "cache_miss",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoad => "least_load",
            Reason::BalancedOwner => "balanced_owner",
            Reason::BalancedMiss => "balanced_miss",
            Reason::Imbalanced => "imbalanced",
        }
    }
}

/// Why no worker was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefuseReason {
    /// The fleet is empty: no routable prefill worker in the pool (and in the proxy's subset, if any).
    NoWorkers,
}

impl RefuseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RefuseReason::NoWorkers => "no_workers",
        }
    }
}

/// A routed request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub selected: WorkerId,
    /// Next best workers of the same rung, best first, for the proxy to retry on; never contains
    /// `selected` nor a worker twice.
    pub fallbacks: Vec<WorkerId>,
    pub reason: Reason,
    /// Leading prompt tokens the owner index credits to `selected` (0 when it holds none).
    pub matched_tokens: u64,
    pub trace: Trace,
}

impl Decision {
    /// Depth of the deepest queued owner the request was diverted away from; `None` unless the request
    /// really left an owner because of the queue gate.
    pub fn diverted_tokens(&self) -> Option<u64> {
        match self.reason {
            Reason::CacheWorkerQueued => self.trace.deepest_queued_owner_tokens(),
            _ => None,
        }
    }
}

/// A request no worker can take.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Refused {
    pub reason: RefuseReason,
    pub trace: Trace,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    Route(Decision),
    Refuse(Refused),
}

impl Outcome {
    pub fn trace(&self) -> &Trace {
        match self {
            Outcome::Route(decision) => &decision.trace,
            Outcome::Refuse(refused) => &refused.trace,
        }
    }

    pub fn decision(&self) -> Option<&Decision> {
        match self {
            Outcome::Route(decision) => Some(decision),
            Outcome::Refuse(_) => None,
        }
    }
}

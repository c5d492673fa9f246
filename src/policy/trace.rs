//! What each rung of the ladder saw, for logs and the explain endpoint.

use serde::Serialize;

use crate::config::ModeKind;
use crate::worker::WorkerId;

/// The record of one decision. Enough to answer "why did this request go there?" without re-running it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Trace {
    /// Version of the load snapshot decided from.
    pub snapshot_version: u64,
    /// The policy mode that decided.
    pub mode: ModeKind,
    /// Routable prefill workers of the pool, within the proxy's subset.
    pub fleet: usize,
    /// Fleet workers with a fresh reading.
    pub fresh: usize,
    /// Every owner that counted, deepest first: in the fleet and holding at least `owner_depth` of the
    /// prompt (`cache_aware`: `min_match_tokens` and `min_match_share`), or at least one token (`balance_threshold`); none for the modes that ignore
    /// prefixes. Hard admission is shown for each, but only `cache_aware` enforces it.
    pub owners: Vec<OwnerVerdict>,
    /// Index matches that did not count: too shallow, or outside the fleet.
    pub ignored_matches: usize,
    /// The fleet-wide saturation check, when some owner was queued.
    pub saturation: Saturation,
    /// The rung that chose, and what it compared.
    pub rung: Rung,
    /// How the chosen rung ordered workers of equal depth or load.
    pub pressure: Option<PressureSource>,
    /// Workers drawn for an off-owner pick, with their load, in draw order.
    pub sampled: Vec<Sampled>,
    /// Prefill-time unit: every fleet worker's prediction for this request, in worker order (a worker
    /// without a fresh reading or a rate has none and is absent).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub predictions: Vec<Predicted>,
    /// `round_robin`: the request's number in the pool's sequence (its turn is this modulo the fleet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// `balance_threshold`: the fleet's load spread and the deepest owner's share of the prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub balance: Option<Balance>,
}

impl Trace {
    /// The deepest owner the queue gate turned away.
    pub fn deepest_queued_owner_tokens(&self) -> Option<u64> {
        self.owners
            .iter()
            .filter(|owner| owner.gate.turns_away())
            .map(|owner| owner.matched_tokens)
            .max()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OwnerVerdict {
    pub worker: WorkerId,
    pub matched_tokens: u64,
    pub gate: Gate,
    pub admission: Admission,
}

/// The queue gate's verdict on one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Gate {
    /// No `worker_queue_limit` is set.
    Off,
    /// No fresh reading (none yet, or the worker's scrape is late): the gate fails open, an unknown
    /// queue never blocks affinity.
    Unread,
    /// Prefill-time unit: a fresh reading, but no rate to price it (none learned by any worker, none
    /// configured): the gate fails open, as for an unknown queue.
    Unpriced,
    /// Fresh reading below the limit.
    Open { waiting: u64 },
    /// Fresh reading at or above the limit.
    Queued { waiting: u64 },
    /// Prefill-time unit: predicted TTFT within `divert_margin` of the best admitted worker's.
    Within { ttft_us: u64, best_us: u64 },
    /// Prefill-time unit: predicted TTFT later than the best admitted worker's by more than the margin.
    Later { ttft_us: u64, best_us: u64 },
}

impl Gate {
    pub fn passes(self) -> bool {
        !self.turns_away()
    }

    /// The gate turned the worker away: queued at the limit, or predicted later than the margin allows.
    pub fn turns_away(self) -> bool {
        matches!(self, Gate::Queued { .. } | Gate::Later { .. })
    }
}

/// Hard admission: whether the engine could take the request at all, where its limits are known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Admission {
    Admitted,
    /// The prefill-time unit checks no engine limit: an engine with no free running slot or KV room
    /// queues the request until it has, its next reading shows that queue, and the prediction prices
    /// it. Turning the owner away instead sends the request to a worker that must compute and hold
    /// the whole prompt.
    Unchecked,
    /// `running + 1 > max_running_requests`.
    RunningFull {
        running: u64,
        max_running: u64,
    },
    /// `used_tokens + request_tokens > max_total_tokens`.
    KvFull {
        used_tokens: u64,
        request_tokens: u64,
        max_total_tokens: u64,
    },
}

impl Admission {
    pub fn admits(self) -> bool {
        matches!(self, Admission::Admitted | Admission::Unchecked)
    }
}

/// Whether the whole fleet is queueing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Saturation {
    /// Not evaluated: no owner was queued, or no gate is configured.
    #[default]
    NotChecked,
    /// This fleet worker proves a diversion can pay off: its fresh queue is below the threshold.
    Relieved {
        witness: WorkerId,
        waiting: u64,
        threshold: u64,
    },
    /// (All-queued check only) this fleet worker has no fresh reading, so the fleet cannot be shown to
    /// be queueing everywhere.
    Unread { witness: WorkerId, threshold: u64 },
    /// No fleet worker has a fresh reading below the threshold (the floor, or the limit without one),
    /// per data-parallel rank; the witnesses above carry their own worker's threshold.
    Saturated { threshold: u64 },
    /// Prefill-time unit: this fleet worker is predicted to start the request's prefill within the floor.
    StartsSoon {
        witness: WorkerId,
        queue_us: u64,
        floor_us: u64,
    },
    /// Prefill-time unit: no fleet worker is predicted to start the request's prefill within the floor.
    NoneStartsSoon { floor_us: u64 },
}

impl Saturation {
    pub fn is_saturated(self) -> bool {
        matches!(
            self,
            Saturation::Saturated { .. } | Saturation::NoneStartsSoon { .. }
        )
    }
}

/// The rung of the ladder that produced the outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// Empty fleet.
    #[default]
    None,
    /// Owners passing the gate and hard admission.
    Owners,
    /// Queued owners under a saturated fleet, with the floor.
    SaturationPin,
    /// Re-admitted owners when every fleet worker is at the limit and no floor is set.
    AllQueued,
    /// Sampled among fleet workers passing the gate and hard admission.
    OffOwnerGateAndAdmission,
    /// Sampled among fleet workers passing hard admission (none passed the gate).
    OffOwnerAdmission,
    /// Nobody passes hard admission: the least-pressured fleet worker.
    LeastPressured,
    /// `round_robin`: the fleet worker whose turn it is.
    RoundRobin,
    /// `least_load`, and `balance_threshold` without a deep enough owner or with an imbalanced fleet: the
    /// least-loaded fleet worker.
    LeastLoad,
    /// `balance_threshold`: the deepest owner, the fleet being balanced.
    DeepestOwner,
}

/// What `balance_threshold` saw: load is waiting + running + dispatched since the last fresh reading.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Balance {
    pub min_load: u64,
    pub max_load: u64,
    /// `max_load − min_load > balance_abs_threshold` and `max_load > balance_rel_threshold × min_load`.
    pub imbalanced: bool,
    /// The deepest fleet owner's matched tokens ÷ the prompt's tokens, in `[0, 1]` (0 without an owner).
    pub match_ratio: f64,
}

/// Which numbers ordered workers by pressure. A measure is used only when every compared worker has it,
/// so a worker is never compared on a number another worker lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PressureSource {
    /// Engine-reported prompt tokens waiting that miss the cache, then (waiting, running).
    UncachedTokens,
    /// Engine-reported (waiting, running).
    Queue,
    /// Some compared worker has no fresh reading: requests this picker dispatched since the last reading.
    RouterLocal,
    /// Prefill-time unit: predicted queue wait, then predicted TTFT.
    PredictedWait,
}

/// One worker's prediction, as the trace shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Predicted {
    pub worker: WorkerId,
    /// Leading prompt tokens the index credits to the worker (counted in its prefill whatever their depth).
    pub cached_tokens: u64,
    #[serde(flatten)]
    pub prediction: Prediction,
    /// queue + prefill.
    pub ttft_us: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sampled {
    pub worker: WorkerId,
    /// waiting + running + dispatched since the last fresh reading.
    pub load: u64,
}

/// Where a prediction's rate came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RateSource {
    /// The worker's engine measured it: its per-request prefill histograms (time from scheduling to
    /// first token, tokens computed).
    Measured,
    /// The rate the worker's queue drained while requests waited, learned from its counters.
    Drain,
    /// The median per-rank measured rate of the fleet's other workers, the worker's own having taught
    /// nothing yet.
    Pool,
    /// The median per-rank drain rate of the fleet's other workers.
    PoolDrain,
    /// `prefill_tokens_per_second`, no worker's counters having taught anything yet.
    Configured,
}

impl RateSource {
    pub fn as_str(self) -> &'static str {
        match self {
            RateSource::Measured => "measured",
            RateSource::Drain => "drain",
            RateSource::Pool => "pool",
            RateSource::PoolDrain => "pool_drain",
            RateSource::Configured => "configured",
        }
    }
}

/// One worker's prediction for one request: the numbers the time-unit ladder compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Prediction {
    /// Uncached tokens ahead of the request.
    pub ahead_tokens: u64,
    /// Of them, sent by this picker since the reading.
    pub dispatched_tokens: u64,
    /// Tokens per second the work ahead is done at, the whole worker: the queue's drain while
    /// requests wait, else the prefill rate.
    pub queue_rate: u64,
    pub queue_rate_source: RateSource,
    /// Prefill tokens per second, the whole worker: what the request's own prefill is priced at.
    pub rate: u64,
    pub rate_source: RateSource,
    /// ahead ÷ queue rate.
    pub queue_us: u64,
    /// The request's own uncached prompt ÷ rate.
    pub prefill_us: u64,
}

impl Prediction {
    /// Predicted time to first token: the queue, then the request's own prefill.
    pub fn ttft_us(&self) -> u64 {
        self.queue_us.saturating_add(self.prefill_us)
    }
}

/// What a worker has to compute before and for this request's first token, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Work {
    pub ahead_tokens: u64,
    pub own_tokens: u64,
}

impl Work {
    /// Ahead plus own: on workers of one rate, the order of their predicted TTFTs.
    pub fn total(&self) -> u64 {
        self.ahead_tokens.saturating_add(self.own_tokens)
    }
}

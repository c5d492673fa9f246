//! Validated policy configuration: the mode, its knobs and the gates, as the policy reads them. Kept
//! apart from the rest of the validated types because the policy's knobs grow with every rung.

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

/// Knobs of the routing policy (see `policy`): the mode, carrying only the knobs it reads, and what every
/// mode shares. `Config::policy` is the top-level section; each pool's `PoolConfig::policy` is what that
/// pool runs with (its own keys, the rest inherited from the top level).
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Which rule picks the worker.
    pub mode: Mode,
    /// How many fallback endpoints follow the selected one in the answer, for Envoy to retry on.
    pub max_fallbacks: usize,
}

impl PolicyConfig {
    pub const DEFAULT_MAX_FALLBACKS: usize = 2;
    /// Envoy tries at most a handful of hosts; a longer list only costs header bytes.
    pub const MAX_FALLBACKS_LIMIT: usize = 8;

    /// The cache-aware knobs, when that is the mode.
    pub fn cache_aware(&self) -> Option<&CacheAwareKnobs> {
        match &self.mode {
            Mode::CacheAware(knobs) => Some(knobs),
            _ => None,
        }
    }

    /// The cache-aware knobs, when that is the mode, for changing them.
    pub fn cache_aware_mut(&mut self) -> Option<&mut CacheAwareKnobs> {
        match &mut self.mode {
            Mode::CacheAware(knobs) => Some(knobs),
            _ => None,
        }
    }

    /// The queue gate; `None` without one, and under every mode but `cache_aware`.
    pub fn gate(&self) -> Option<QueueGate> {
        self.cache_aware().and_then(CacheAwareKnobs::queue_gate)
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            mode: Mode::default(),
            max_fallbacks: Self::DEFAULT_MAX_FALLBACKS,
        }
    }
}

/// The name of a policy mode, as `policy.mode` spells it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeKind {
    #[default]
    CacheAware,
    RoundRobin,
    LeastLoad,
    BalanceThreshold,
}

impl ModeKind {
    pub const ALL: [ModeKind; 4] = [
        ModeKind::CacheAware,
        ModeKind::RoundRobin,
        ModeKind::LeastLoad,
        ModeKind::BalanceThreshold,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ModeKind::CacheAware => "cache_aware",
            ModeKind::RoundRobin => "round_robin",
            ModeKind::LeastLoad => "least_load",
            ModeKind::BalanceThreshold => "balance_threshold",
        }
    }
}

/// A policy mode with its own knobs: a knob the mode does not read cannot be expressed.
#[derive(Clone, Debug, PartialEq)]
pub enum Mode {
    /// The ladder: prefix owners first, with the queue gate, the saturation floor and power-of-k
    /// sampling off-owner. Without a limit it is pure prefix affinity.
    CacheAware(CacheAwareKnobs),
    /// The fleet in turn, ignoring load and prefixes.
    RoundRobin,
    /// The worker with the fewest waiting + running + dispatched requests, ignoring prefixes.
    LeastLoad,
    /// The classic SGLang router rule: prefix affinity while the fleet's load is balanced, shortest queue
    /// when it is not.
    BalanceThreshold(BalanceKnobs),
}

impl Mode {
    pub fn kind(&self) -> ModeKind {
        match self {
            Mode::CacheAware(_) => ModeKind::CacheAware,
            Mode::RoundRobin => ModeKind::RoundRobin,
            Mode::LeastLoad => ModeKind::LeastLoad,
            Mode::BalanceThreshold(_) => ModeKind::BalanceThreshold,
        }
    }
}

impl Default for Mode {
    fn default() -> Self {
        Mode::CacheAware(CacheAwareKnobs::default())
    }
}

/// The knobs of `cache_aware`.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheAwareKnobs {
    /// What the queue gate and its saturation floor measure, with their thresholds.
    pub gating: Gating,
    /// Power-of-k sampling for off-owner picks.
    pub min_load_choices: NonZeroUsize,
    /// An owner must hold at least this many leading prompt tokens to count as one.
    pub min_match_tokens: u64,
    /// ... and at least this share of the prompt's tokens ([`Self::owner_depth`]).
    pub min_match_share: DepthRatio,
    /// The saturation pin only weighs owners matching at least this share of the deepest pinnable match.
    pub pin_depth_ratio: DepthRatio,
}

impl CacheAwareKnobs {
    /// Off-owner picks under the request unit sample two workers: a count of waiting requests says
    /// too little to trust its exact minimum, and several replicas taking it would all land together.
    pub const DEFAULT_MIN_LOAD_CHOICES: usize = 2;
    /// Off-owner picks under the prefill-time unit weigh the whole fleet (any k at least the fleet's
    /// size is its exact minimum): a prediction in seconds tells a worker starting a long prefill from
    /// an idle one, which a sample of two misses (BENCHMARKS.md, the held-out seeds).
    pub const DEFAULT_MIN_LOAD_CHOICES_PREFILL_TIME: usize = 64;
    pub const DEFAULT_MIN_MATCH_TOKENS: u64 = 1024;
    /// The request unit counts every match of `min_match_tokens` as an owner, as the seed does.
    pub const DEFAULT_MIN_MATCH_SHARE: f64 = 0.0;
    /// The prefill-time unit makes an owner only of a worker holding half the prompt or more. Rung 1
    /// takes any owner its gate passes, deepest first, before it weighs a non-owner: an owner that
    /// holds a shared system prompt and nothing of this conversation saves little of its prefill, yet
    /// taking it there makes it the conversation's home, so every new conversation piles onto the
    /// first worker that served the system prompt (BENCHMARKS.md, "Where the chat loss comes from").
    /// Half is the pin's own `pin_depth_ratio`, not a value fitted to a workload.
    pub const DEFAULT_MIN_MATCH_SHARE_PREFILL_TIME: f64 = 0.5;
    pub const DEFAULT_PIN_DEPTH_RATIO: f64 = 0.5;

    /// `min_load_choices` when the configuration does not set it, by the unit in force.
    pub fn default_min_load_choices(unit: GateUnit) -> NonZeroUsize {
        let k = match unit {
            GateUnit::Requests => Self::DEFAULT_MIN_LOAD_CHOICES,
            GateUnit::PrefillTime => Self::DEFAULT_MIN_LOAD_CHOICES_PREFILL_TIME,
        };
        NonZeroUsize::new(k).unwrap_or(NonZeroUsize::MIN)
    }

    /// `min_match_share` when the configuration does not set it, by the unit in force.
    pub fn default_min_match_share(unit: GateUnit) -> DepthRatio {
        let share = match unit {
            GateUnit::Requests => Self::DEFAULT_MIN_MATCH_SHARE,
            GateUnit::PrefillTime => Self::DEFAULT_MIN_MATCH_SHARE_PREFILL_TIME,
        };
        DepthRatio::new(share).unwrap_or(DepthRatio::ZERO)
    }

    /// The leading tokens a worker must hold of a `prompt_tokens`-token prompt to be its owner: at
    /// least one, at least `min_match_tokens`, and at least `min_match_share` of the prompt.
    pub fn owner_depth(&self, prompt_tokens: u64) -> u64 {
        let share = (self.min_match_share.get() * prompt_tokens as f64).ceil() as u64;
        self.min_match_tokens.max(share).max(1)
    }

    /// These knobs with `gating` in place of theirs, and `min_load_choices` and `min_match_share`
    /// that unit's defaults.
    pub fn with_gating(gating: Gating) -> Self {
        CacheAwareKnobs {
            min_load_choices: Self::default_min_load_choices(gating.unit()),
            min_match_share: Self::default_min_match_share(gating.unit()),
            gating,
            ..CacheAwareKnobs::default()
        }
    }

    /// The request-unit queue gate; `None` under the prefill-time unit or without a gate.
    pub fn queue_gate(&self) -> Option<QueueGate> {
        match self.gating {
            Gating::Requests(gate) => gate,
            Gating::PrefillTime(_) => None,
        }
    }

    /// The prefill-time gate; `None` under the request unit.
    pub fn wait(&self) -> Option<&WaitGate> {
        match &self.gating {
            Gating::Requests(_) => None,
            Gating::PrefillTime(wait) => Some(wait),
        }
    }
}

impl Default for CacheAwareKnobs {
    fn default() -> Self {
        let gating = Gating::default();
        CacheAwareKnobs {
            min_load_choices: Self::default_min_load_choices(gating.unit()),
            min_match_share: Self::default_min_match_share(gating.unit()),
            gating,
            min_match_tokens: Self::DEFAULT_MIN_MATCH_TOKENS,
            pin_depth_ratio: DepthRatio::new(Self::DEFAULT_PIN_DEPTH_RATIO)
                .unwrap_or(DepthRatio::ZERO),
        }
    }
}

/// The queue gate and its saturation floor, in one unit or the other; one value, so a policy never
/// holds both.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gating {
    /// Requests waiting per rank (`gate_unit: requests`): the seed's `worker_queue_limit` and
    /// `saturation_queue_floor`; `None` is pure prefix affinity (no gate, no floor).
    Requests(Option<QueueGate>),
    /// Predicted prefill time (`gate_unit: prefill_time`).
    PrefillTime(WaitGate),
}

impl Gating {
    pub fn unit(&self) -> GateUnit {
        match self {
            Gating::Requests(_) => GateUnit::Requests,
            Gating::PrefillTime(_) => GateUnit::PrefillTime,
        }
    }
}

impl Default for Gating {
    fn default() -> Self {
        match GateUnit::default() {
            GateUnit::Requests => Gating::Requests(Some(QueueGate::default_gate())),
            GateUnit::PrefillTime => Gating::PrefillTime(WaitGate::default()),
        }
    }
}

/// The knobs of `balance_threshold` (the SGLang router's defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BalanceKnobs {
    /// The fleet is imbalanced when `max - min` load exceeds this...
    pub abs_threshold: u64,
    /// ...and `max` exceeds this many times `min`.
    pub rel_threshold: RelThreshold,
    /// While balanced, the deepest owner takes the request only if it holds more than this share of the
    /// prompt.
    pub cache_threshold: DepthRatio,
}

impl BalanceKnobs {
    pub const DEFAULT_ABS_THRESHOLD: u64 = 64;
    pub const DEFAULT_REL_THRESHOLD: f64 = 1.5;
    pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.3;
}

impl Default for BalanceKnobs {
    fn default() -> Self {
        BalanceKnobs {
            abs_threshold: Self::DEFAULT_ABS_THRESHOLD,
            rel_threshold: RelThreshold::new(Self::DEFAULT_REL_THRESHOLD)
                .unwrap_or(RelThreshold::MIN_ABOVE_ONE),
            cache_threshold: DepthRatio::new(Self::DEFAULT_CACHE_THRESHOLD)
                .unwrap_or(DepthRatio::ZERO),
        }
    }
}

/// A finite factor greater than 1.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct RelThreshold(f64);

impl RelThreshold {
    /// The smallest factor above 1 that an `f64` holds.
    const MIN_ABOVE_ONE: RelThreshold = RelThreshold(1.0 + f64::EPSILON);

    pub fn new(value: f64) -> Option<Self> {
        (value.is_finite() && value > 1.0).then_some(RelThreshold(value))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

/// `worker_queue_limit` with its optional `saturation_queue_floor`.
///
/// Guarantees: the floor exists only with a limit (without the gate there is no diversion for the floor
/// to cancel), and `1 <= floor <= limit` (a floor above the limit would declare the fleet saturated while
/// the gate still admits some workers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueGate {
    limit: NonZeroU64,
    floor: Option<NonZeroU64>,
}

impl QueueGate {
    /// Requests waiting per data-parallel rank at which an owner is passed over, by default.
    pub const DEFAULT_LIMIT: u64 = 4;
    /// Requests waiting per rank below which some worker must be for a diversion to pay off.
    pub const DEFAULT_FLOOR: u64 = 2;

    /// The gate the configuration runs when it does not say otherwise.
    pub fn default_gate() -> QueueGate {
        QueueGate {
            limit: NonZeroU64::new(Self::DEFAULT_LIMIT).unwrap_or(NonZeroU64::MIN),
            floor: NonZeroU64::new(Self::DEFAULT_FLOOR),
        }
    }

    /// `None` if the floor exceeds the limit.
    pub fn new(limit: NonZeroU64, floor: Option<NonZeroU64>) -> Option<Self> {
        match floor {
            Some(floor) if floor > limit => None,
            _ => Some(QueueGate { limit, floor }),
        }
    }

    /// An owner with this many or more waiting requests per data-parallel rank is passed over.
    pub fn limit(self) -> u64 {
        self.limit.get()
    }

    /// The fleet is saturated when no worker has a fresh reading below this, per rank.
    pub fn floor(self) -> Option<u64> {
        self.floor.map(NonZeroU64::get)
    }
}

/// How the gate and the saturation floor measure a worker's queue.
///
/// The default is the prefill time, chosen by measurement (BENCHMARKS.md, the held-out seeds): a
/// count of waiting requests weighs a 100k-token agent turn like a 200-token chat. A scope that gives
/// `worker_queue_limit` or `saturation_queue_floor` (file or flag) without `gate_unit` runs the request
/// unit, so the seed's configurations and flags keep their meaning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GateUnit {
    /// Requests waiting, per data-parallel rank: `worker_queue_limit`, `saturation_queue_floor`.
    Requests,
    /// Predicted prefill time: `divert_margin`, `saturation_wait_floor`, `prefill_tokens_per_second`.
    #[default]
    PrefillTime,
}

impl GateUnit {
    pub const ALL: [GateUnit; 2] = [GateUnit::Requests, GateUnit::PrefillTime];

    pub fn as_str(self) -> &'static str {
        match self {
            GateUnit::Requests => "requests",
            GateUnit::PrefillTime => "prefill_time",
        }
    }
}

/// The gate and floor in predicted prefill time (see `policy`).
///
/// An owner keeps the request unless its predicted time to first token — the uncached tokens ahead of
/// the request and its own uncached prompt, over the worker's prefill rate — exceeds the best
/// alternative's by more than `divert_margin`. The fleet is saturated when no worker is predicted to
/// start the request's prefill within `floor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitGate {
    /// How much sooner an alternative must be predicted to deliver the first token for a diversion.
    pub divert_margin: Duration,
    /// `saturation_wait_floor`; `None` turns the saturation pin off.
    pub floor: Option<Duration>,
    /// `prefill_tokens_per_second` per data-parallel rank, used where the rate is not learned yet;
    /// `None` leaves such a worker's prediction unknown (its gate fails open).
    pub fallback_rate: Option<NonZeroU64>,
}

impl WaitGate {
    /// A diversion must be predicted to save at least this much: a cold prefill elsewhere costs the
    /// fleet more than the one request's wait.
    pub const DEFAULT_DIVERT_MARGIN: Duration = Duration::from_millis(500);
    /// No worker able to start within this is a saturated fleet.
    pub const DEFAULT_FLOOR: Duration = Duration::from_secs(1);
}

impl Default for WaitGate {
    fn default() -> Self {
        WaitGate {
            divert_margin: Self::DEFAULT_DIVERT_MARGIN,
            floor: Some(Self::DEFAULT_FLOOR),
            fallback_rate: None,
        }
    }
}

/// A share in `[0, 1]`, finite.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct DepthRatio(f64);

impl DepthRatio {
    pub const ZERO: DepthRatio = DepthRatio(0.0);

    pub fn new(value: f64) -> Option<Self> {
        (value.is_finite() && (0.0..=1.0).contains(&value)).then_some(DepthRatio(value))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

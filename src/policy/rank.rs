//! Per-worker verdicts and orderings used by the ladder.
//!
//! Orderings are linear minimum scans over integer keys. The pressure key is chosen per compared set
//! (see [`PressureSource`]), so two workers are never ordered on numbers only one of them has; sorting
//! with a pairwise comparator that mixes sources would not be a total order.

use rand::Rng;

use super::trace::{Admission, Gate, Prediction, PressureSource, Work};
use crate::load::{EngineLoad, WorkerState};
use crate::worker::WorkerId;

/// A fleet worker with everything the ladder asks about it, computed once per decision.
#[derive(Clone, Copy, Debug)]
pub(super) struct Member<'a> {
    pub state: &'a WorkerState,
    pub fresh: Option<&'a EngineLoad>,
    pub matched_tokens: u64,
    pub gate: Gate,
    pub admission: Admission,
    pub dispatched: u64,
    /// The pool's number of the last off-owner placement that went to it (0 for none).
    pub cold: u64,
    /// Under the prefill-time unit, the tokens it must compute before and for this request's first
    /// token (known with a fresh reading, rate or not).
    pub work: Option<Work>,
    /// Under the prefill-time unit, what the worker is predicted to take for this request.
    pub prediction: Option<Prediction>,
}

impl Member<'_> {
    pub fn id(&self) -> WorkerId {
        self.state.id
    }

    /// The last key of every ordering: among workers otherwise equal, the one that took a new prefix
    /// least recently, then the lowest id. An idle fleet spreads new prefixes rather than pile them
    /// on worker 0, and the order stays total and deterministic.
    pub fn tie(&self) -> (u64, WorkerId) {
        (self.cold, self.state.id)
    }

    /// waiting + running + requests dispatched since the last fresh reading. A worker without a fresh
    /// reading counts only what this picker sent it.
    pub fn load(&self) -> u64 {
        let engine = self
            .fresh
            .map_or(0, |load| load.waiting.saturating_add(load.running));
        engine.saturating_add(self.dispatched)
    }

    fn pressure_key(&self, source: PressureSource) -> [u64; 3] {
        match (source, self.fresh) {
            (PressureSource::PredictedWait, _) => self
                .prediction
                .map_or([u64::MAX; 3], |p| [p.queue_us, p.ttft_us(), 0]),
            (PressureSource::UncachedTokens, Some(load)) => [
                load.waiting_uncached_tokens.unwrap_or(u64::MAX),
                load.waiting,
                load.running,
            ],
            (PressureSource::Queue, Some(load)) => [load.waiting, load.running, 0],
            _ => [self.dispatched, 0, 0],
        }
    }
}

/// The queue gate: passes when no limit is set, when the worker has no fresh reading (fail-open), or when
/// fewer than `limit` requests are waiting.
pub(super) fn gate(limit: Option<u64>, fresh: Option<&EngineLoad>) -> Gate {
    match (limit, fresh) {
        (None, _) => Gate::Off,
        (Some(_), None) => Gate::Unread,
        (Some(limit), Some(load)) if load.waiting < limit => Gate::Open {
            waiting: load.waiting,
        },
        (Some(_), Some(load)) => Gate::Queued {
            waiting: load.waiting,
        },
    }
}

/// Hard admission: a free running slot and room in the KV cache for the prompt, each checked only where
/// both the reading and the capacity are known.
pub(super) fn admission(
    state: &WorkerState,
    fresh: Option<&EngineLoad>,
    request_tokens: u64,
) -> Admission {
    let Some(load) = fresh else {
        return Admission::Admitted;
    };
    if let Some(max_running) = state.capacity.max_running
        && load.running.saturating_add(1) > max_running
    {
        return Admission::RunningFull {
            running: load.running,
            max_running,
        };
    }
    if let (Some(used_tokens), Some(max_total_tokens)) =
        (load.used_tokens, state.capacity.max_total_tokens)
        && used_tokens.saturating_add(request_tokens) > max_total_tokens
    {
        return Admission::KvFull {
            used_tokens,
            request_tokens,
            max_total_tokens,
        };
    }
    Admission::Admitted
}

/// The richest pressure measure every worker in the set has.
pub(super) fn pressure_source<'a, 'm: 'a>(
    set: impl Iterator<Item = &'a Member<'m>>,
) -> PressureSource {
    let set: Vec<&Member<'m>> = set.collect();
    if !set.is_empty() && set.iter().all(|member| member.prediction.is_some()) {
        return PressureSource::PredictedWait;
    }
    let mut source = PressureSource::UncachedTokens;
    for member in set {
        match member.fresh {
            None => return PressureSource::RouterLocal,
            Some(load) if load.waiting_uncached_tokens.is_none() => source = PressureSource::Queue,
            Some(_) => {}
        }
    }
    source
}

/// Index of the least-pressured member (ties by [`Member::tie`]), with the source that ordered them.
pub(super) fn least_pressured(set: &[Member<'_>]) -> Option<Pick> {
    least_pressured_where(set, |_| true)
}

/// Index of the deepest member; among equally deep ones the least pressured, then [`Member::tie`].
pub(super) fn deepest(set: &[Member<'_>]) -> Option<Pick> {
    let depth = set.iter().map(|member| member.matched_tokens).max()?;
    least_pressured_where(set, |member| member.matched_tokens == depth)
}

/// The least-pressured member among those `include` accepts, compared on the richest measure they
/// all have.
fn least_pressured_where(
    set: &[Member<'_>],
    include: impl Fn(&Member<'_>) -> bool,
) -> Option<Pick> {
    let source = pressure_source(set.iter().filter(|member| include(member)));
    let index = set
        .iter()
        .enumerate()
        .filter(|(_, member)| include(member))
        .min_by_key(|(_, member)| (member.pressure_key(source), member.tie()))
        .map(|(index, _)| index)?;
    Some(Pick {
        index,
        source: Some(source),
    })
}

/// Index of the least-loaded member, ties by [`Member::tie`].
pub(super) fn least_loaded(set: &[Member<'_>]) -> Option<Pick> {
    let index = set
        .iter()
        .enumerate()
        .min_by_key(|(_, member)| (member.load(), member.tie()))
        .map(|(index, _)| index)?;
    Some(Pick {
        index,
        source: None,
    })
}

/// Index of the member predicted to deliver the first token soonest (members without a prediction
/// last); then the fewest tokens to compute before and for the first token, which orders the
/// unpriced ones as their TTFTs would on one rate — before any worker's counters have taught a rate,
/// the request count alone cannot tell a worker starting a 30k-token prefill from an idle one; then
/// the least loaded, then [`Member::tie`].
pub(super) fn soonest(set: &[Member<'_>]) -> Option<Pick> {
    let index = set
        .iter()
        .enumerate()
        .min_by_key(|(_, member)| {
            (
                member.prediction.map_or(u64::MAX, |p| p.ttft_us()),
                member.work.map_or(u64::MAX, |w| w.total()),
                member.load(),
                member.tie(),
            )
        })
        .map(|(index, _)| index)?;
    Some(Pick {
        index,
        source: Some(PressureSource::PredictedWait),
    })
}

/// Index of the deepest member; among equally deep ones the least loaded, then [`Member::tie`].
pub(super) fn deepest_least_loaded(set: &[Member<'_>]) -> Option<Pick> {
    let index = set
        .iter()
        .enumerate()
        .min_by_key(|(_, member)| {
            (
                std::cmp::Reverse(member.matched_tokens),
                member.load(),
                member.tie(),
            )
        })
        .map(|(index, _)| index)?;
    Some(Pick {
        index,
        source: None,
    })
}

/// One choice of a ranking: the member's index in the set, and the pressure measure that decided it
/// (`None` when pressure played no part).
#[derive(Clone, Copy, Debug)]
pub(super) struct Pick {
    pub index: usize,
    pub source: Option<PressureSource>,
}

/// Takes up to `n` members, best first, by repeatedly applying `pick` to what is left. Returns the
/// pressure source of the first pick.
pub(super) fn take_ranked<'m>(
    mut set: Vec<Member<'m>>,
    n: usize,
    pick: fn(&[Member<'m>]) -> Option<Pick>,
) -> (Vec<Member<'m>>, Option<PressureSource>) {
    let mut ranked = Vec::with_capacity(n.min(set.len()));
    let mut first_source = None;
    while ranked.len() < n {
        let Some(Pick { index, source }) = pick(&set) else {
            break;
        };
        if index >= set.len() {
            break;
        }
        if ranked.is_empty() {
            first_source = source;
        }
        ranked.push(set.swap_remove(index));
    }
    (ranked, first_source)
}

/// Keeps `k` members drawn uniformly without replacement (partial Fisher–Yates); keeps all of them, in
/// order and without touching `rng`, when `k` covers the set.
pub(super) fn sample<R: Rng + ?Sized>(set: &mut Vec<Member<'_>>, k: usize, rng: &mut R) {
    let n = set.len();
    if k >= n {
        return;
    }
    for i in 0..k {
        let j = rng.random_range(i..n);
        set.swap(i, j);
    }
    set.truncate(k);
}

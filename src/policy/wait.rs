//! The prefill-time unit: each fleet worker's predicted wait and prefill for this request, and the
//! gate verdicts that compare them.
//!
//! For worker *m* and a request of *P* prompt tokens, *c* of them cached on *m*:
//!
//! - **ahead** = uncached tokens queued on *m*: SGLang's `num_waiting_uncached_tokens` where the
//!   engine reports it (its chunked prefill's remainder included); else waiting × the uncached tokens a
//!   request brings there on average (learned from the engine's counters), weighed by the waiting
//!   requests' own uncached tokens as predicted when they were routed against the mean of that
//!   prediction over the requests routed before them (the engine queues first come, first served, so
//!   the waiting ones are the last routed there before the reading: `load::DispatchTable::queued`;
//!   without the engine's mean, their routed sizes; without either, this request's own uncached part
//!   each); plus half the uncached tokens of the prefills under way at the reading (vLLM's lookups
//!   less its completed prompts, times the share the cache missed: a long prefill is on average half
//!   done); plus the uncached tokens this picker sent since the reading (its router-local window,
//!   exact for its own), times the pool's dispatch share (`load::share`: requests reaching the pool
//!   per request this replica sends, from the engines' counters), so a replica prices the volume the
//!   others send unseen.
//! - **prefill rate** = the rate *m*'s engine measured for its prefills (its per-request prefill
//!   histograms, `load::rate`); else the median per-rank measured rate of the fleet, × *m*'s ranks (a
//!   worker that has never run a request has taught nothing, yet it runs the pool's hardware —
//!   pricing it as unknown would send every diversion to the one worker that ran one first); else,
//!   for an engine without prefill histograms, *m*'s queue drain rate, then the fleet's median drain
//!   rate; else `prefill_tokens_per_second` × ranks.
//! - **queue rate** = while *m*'s reading shows requests waiting, the rate its queue drains (learned
//!   while it was queued: slots and decoding included, which on a decode-bound engine is far below
//!   its prefill rate), else the fleet's median drain rate; otherwise, and when no drain is known,
//!   the prefill rate: with nothing waiting, the work ahead is prefills under way and dispatches into
//!   free slots.
//! - **queue** = ahead ÷ queue rate; **prefill** = (*P* − *c*) ÷ prefill rate; predicted TTFT =
//!   queue + prefill.
//!
//! A worker without a fresh reading, or without a rate, has no prediction: its gate fails open
//! (`Gate::Unread`, as in the request unit, or `Gate::Unpriced` when only the rate is missing) and it
//! is no evidence for the floor (fail-closed). Arithmetic is
//! in integer microseconds, so orderings stay total.

use super::rank::Member;
use super::trace::{Gate, Prediction, RateSource, Work};
use crate::config::WaitGate;
use crate::load::{PrefillEstimate, WorkerState};

/// The fleet's median per-rank rates, each over the workers that learned one.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PoolRates {
    pub prefill: Option<u64>,
    pub drain: Option<u64>,
}

impl PoolRates {
    pub(crate) fn of<'a>(states: impl Iterator<Item = &'a WorkerState> + Clone) -> PoolRates {
        PoolRates {
            prefill: median_per_rank(states.clone(), |state| {
                state.prefill.prefill_tokens_per_second
            }),
            drain: median_per_rank(states, |state| state.prefill.drain_tokens_per_second),
        }
    }
}

/// The rate that prices the request's own prefill on `state`, and where it came from.
fn prefill_rate(
    state: &WorkerState,
    pool: PoolRates,
    wait: &WaitGate,
) -> Option<(u64, RateSource)> {
    let ranks = u64::from(state.ranks.max(1));
    let learned = |rate: Option<u64>| rate.filter(|rate| *rate > 0);
    if let Some(rate) = learned(state.prefill.prefill_tokens_per_second) {
        return Some((rate, RateSource::Measured));
    }
    if let Some(per_rank) = pool.prefill {
        return Some((per_rank.saturating_mul(ranks), RateSource::Pool));
    }
    if let Some(rate) = learned(state.prefill.drain_tokens_per_second) {
        return Some((rate, RateSource::Drain));
    }
    if let Some(per_rank) = pool.drain {
        return Some((per_rank.saturating_mul(ranks), RateSource::PoolDrain));
    }
    let per_rank = wait.fallback_rate?;
    Some((per_rank.get().saturating_mul(ranks), RateSource::Configured))
}

/// The rate that prices the queue ahead on `member`, given its prefill rate.
fn queue_rate(
    member: &Member<'_>,
    pool: PoolRates,
    prefill: (u64, RateSource),
) -> (u64, RateSource) {
    let waiting = member.fresh.is_some_and(|load| load.waiting > 0);
    if !waiting {
        return prefill;
    }
    let state = member.state;
    if let Some(rate) = state
        .prefill
        .drain_tokens_per_second
        .filter(|rate| *rate > 0)
    {
        return (rate, RateSource::Drain);
    }
    match pool.drain {
        Some(per_rank) => (
            per_rank.saturating_mul(u64::from(state.ranks.max(1))),
            RateSource::PoolDrain,
        ),
        None => prefill,
    }
}

/// The median per-rank `rate` of the workers that learned one (the lower middle of an even count, so
/// one fast outlier never sets it); `None` when none has.
fn median_per_rank<'a>(
    states: impl Iterator<Item = &'a WorkerState>,
    rate: impl Fn(&WorkerState) -> Option<u64>,
) -> Option<u64> {
    let mut per_rank: Vec<u64> = states
        .filter_map(|state| {
            let rate = rate(state).filter(|rate| *rate > 0)?;
            Some((rate / u64::from(state.ranks.max(1))).max(1))
        })
        .collect();
    per_rank.sort_unstable();
    per_rank.get(per_rank.len().saturating_sub(1) / 2).copied()
}

/// Microseconds to compute `tokens` at `rate` tokens a second.
fn micros(tokens: u64, rate: u64) -> u64 {
    let us = u128::from(tokens) * 1_000_000 / u128::from(rate.max(1));
    u64::try_from(us).unwrap_or(u64::MAX)
}

/// The uncached tokens ahead of the request on `member` and its own uncached part there, with
/// `dispatched_tokens` sent since the reading; `None` without a fresh reading. Needs no rate.
pub(super) fn work(
    member: &Member<'_>,
    prompt_tokens: u64,
    dispatched_tokens: u64,
) -> Option<Work> {
    let load = member.fresh?;
    let own = prompt_tokens.saturating_sub(member.matched_tokens);
    let prefill = &member.state.prefill;
    let queued = match load.waiting_uncached_tokens {
        Some(tokens) => tokens,
        None => counted_queue(prefill, load.waiting, own),
    };
    // A prefill under way is, on average, half done when a request arrives behind it.
    let prefilling = prefill.prefilling_tokens.unwrap_or(0) / 2;
    Some(Work {
        ahead_tokens: queued
            .saturating_add(prefilling)
            .saturating_add(dispatched_tokens),
        own_tokens: own,
    })
}

/// The uncached tokens of `waiting` requests on an engine that reports a count only: the engine's own
/// mean per request, weighed by how the waiting ones compare, as routed, with the requests routed there
/// before them — a queue of one long prompt among short ones is long, and a picker whose predictions
/// run short (the engine evicted what the index still credits) is corrected by the engine's counters.
/// Without the engine's mean, the routed sizes as they are; without either, `own` per request.
fn counted_queue(prefill: &PrefillEstimate, waiting: u64, own: u64) -> u64 {
    let (engine, routed) = (prefill.uncached_per_request, prefill.waiting_routed_tokens);
    match (engine, routed, prefill.routed_per_request) {
        (Some(engine), Some(routed), Some(mean)) if mean > 0 => {
            let scaled = u128::from(routed) * u128::from(engine) / u128::from(mean);
            u64::try_from(scaled).unwrap_or(u64::MAX)
        }
        (Some(engine), _, _) => waiting.saturating_mul(engine),
        (None, Some(routed), _) => routed,
        (None, None, _) => waiting.saturating_mul(own),
    }
}

/// `member`'s prediction from its `work` (see [`work`]); `pool` is the fleet's [`PoolRates`].
pub(super) fn predict(
    member: &Member<'_>,
    work: Option<Work>,
    dispatched_tokens: u64,
    pool: PoolRates,
    wait: &WaitGate,
) -> Option<Prediction> {
    let work = work?;
    let prefill = prefill_rate(member.state, pool, wait)?;
    let (queue_rate, queue_rate_source) = queue_rate(member, pool, prefill);
    let (rate, rate_source) = prefill;
    Some(Prediction {
        ahead_tokens: work.ahead_tokens,
        dispatched_tokens,
        queue_rate,
        queue_rate_source,
        rate,
        rate_source,
        queue_us: micros(work.ahead_tokens, queue_rate),
        prefill_us: micros(work.own_tokens, rate),
    })
}

/// The least predicted TTFT among members that pass hard admission; `None` when none is predicted.
pub(super) fn best_ttft(members: &[Member<'_>]) -> Option<u64> {
    members
        .iter()
        .filter(|member| member.admission.admits())
        .filter_map(|member| member.prediction.map(|p| p.ttft_us()))
        .min()
}

/// The time gate's verdict on `member`: it keeps the request unless its predicted TTFT exceeds the
/// best admitted worker's by more than the margin.
pub(super) fn gate(member: &Member<'_>, best_us: Option<u64>, wait: &WaitGate) -> Gate {
    let (Some(prediction), Some(best_us)) = (member.prediction, best_us) else {
        // Unknown fails open. Read but not priced (no rate learned or configured) is told apart:
        // the reading is there, the rate is what is missing.
        return match member.fresh {
            Some(_) => Gate::Unpriced,
            None => Gate::Unread,
        };
    };
    let ttft_us = prediction.ttft_us();
    let margin = u64::try_from(wait.divert_margin.as_micros()).unwrap_or(u64::MAX);
    if ttft_us <= best_us.saturating_add(margin) {
        Gate::Within { ttft_us, best_us }
    } else {
        Gate::Later { ttft_us, best_us }
    }
}

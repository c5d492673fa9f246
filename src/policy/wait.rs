//! The prefill-time unit: each fleet worker's predicted wait and prefill for this request, and the
//! gate verdicts that compare them.
//!
//! For worker *m* and a request of *P* prompt tokens, *c* of them cached on *m*:
//!
//! - **ahead** = uncached tokens queued on *m*: SGLang's `num_waiting_uncached_tokens` where the
//!   engine reports it (its chunked prefill's remainder included), else waiting × the uncached tokens a
//!   request brings there on average (learned from the engine's counters; this request's own uncached
//!   part until it is learned) plus half the uncached tokens of the prefills under way at the reading
//!   (vLLM's lookups less its completed prompts, times the share the cache missed: a long prefill is
//!   on average half done); plus the uncached tokens this picker sent since the reading (its router-local window,
//!   exact for its own), times the pool's dispatch share (`load::share`: requests reaching the pool per
//!   request this replica sends, from the engines' counters), so a replica prices the volume the
//!   others send unseen.
//! - **rate** = the prefill rate learned from *m*'s counters; else the median per-rank rate the other
//!   fleet workers learned, × *m*'s ranks (a worker that has never queued has taught nothing, yet it
//!   runs the pool's hardware — pricing it as unknown would send every diversion to the one worker
//!   that queued first); else `prefill_tokens_per_second` × ranks.
//! - **queue** = ahead ÷ rate; **prefill** = (*P* − *c*) ÷ rate; predicted TTFT = queue + prefill.
//!
//! A worker without a fresh reading, or without a rate, has no prediction: its gate fails open (as
//! `Gate::Unread` in the request unit) and it is no evidence for the floor (fail-closed). Arithmetic is
//! in integer microseconds, so orderings stay total.

use super::rank::Member;
use super::trace::{Gate, Prediction, RateSource, Work};
use crate::config::WaitGate;
use crate::load::WorkerState;

/// The worker's prefill rate and where it came from; `None` when none is known. `pool_per_rank` is
/// [`pool_rate`] of the fleet.
fn rate(
    state: &WorkerState,
    pool_per_rank: Option<u64>,
    wait: &WaitGate,
) -> Option<(u64, RateSource)> {
    let ranks = u64::from(state.ranks.max(1));
    match (
        state.prefill.tokens_per_second,
        pool_per_rank,
        wait.fallback_rate,
    ) {
        (Some(rate), _, _) if rate > 0 => Some((rate, RateSource::Learned)),
        (_, Some(per_rank), _) => Some((per_rank.saturating_mul(ranks), RateSource::Pool)),
        (_, _, Some(per_rank)) => {
            Some((per_rank.get().saturating_mul(ranks), RateSource::Configured))
        }
        _ => None,
    }
}

/// The median per-rank rate of the workers that learned one (the lower middle of an even count, so
/// one fast outlier never sets it); `None` when none has.
pub(super) fn pool_rate<'a>(states: impl Iterator<Item = &'a WorkerState>) -> Option<u64> {
    let mut per_rank: Vec<u64> = states
        .filter_map(|state| {
            let rate = state.prefill.tokens_per_second.filter(|rate| *rate > 0)?;
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
    let queued = match load.waiting_uncached_tokens {
        Some(tokens) => tokens,
        None => {
            let per_request = member.state.prefill.uncached_per_request.unwrap_or(own);
            load.waiting.saturating_mul(per_request)
        }
    };
    // A prefill under way is, on average, half done when a request arrives behind it.
    let prefilling = member.state.prefill.prefilling_tokens.unwrap_or(0) / 2;
    Some(Work {
        ahead_tokens: queued
            .saturating_add(prefilling)
            .saturating_add(dispatched_tokens),
        own_tokens: own,
    })
}

/// `member`'s prediction from its `work` (see [`work`]); `pool_per_rank` is [`pool_rate`] of the
/// fleet.
pub(super) fn predict(
    member: &Member<'_>,
    work: Option<Work>,
    dispatched_tokens: u64,
    pool_per_rank: Option<u64>,
    wait: &WaitGate,
) -> Option<Prediction> {
    let work = work?;
    let (rate, rate_source) = rate(member.state, pool_per_rank, wait)?;
    Some(Prediction {
        ahead_tokens: work.ahead_tokens,
        dispatched_tokens,
        rate,
        rate_source,
        queue_us: micros(work.ahead_tokens, rate),
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
        return Gate::Unread;
    };
    let ttft_us = prediction.ttft_us();
    let margin = u64::try_from(wait.divert_margin.as_micros()).unwrap_or(u64::MAX);
    if ttft_us <= best_us.saturating_add(margin) {
        Gate::Within { ttft_us, best_us }
    } else {
        Gate::Later { ttft_us, best_us }
    }
}

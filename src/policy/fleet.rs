//! The fleet a decision chooses from, shared by every mode: the pool's routable prefill workers within
//! the proxy's subset, each with its reading, match depth and verdicts computed once.

use super::rank::{self, Member};
use super::trace::{Admission, OwnerVerdict, Predicted};
use super::wait;
use super::{LoadView, RequestFacts};
use crate::config::WaitGate;
use crate::load::{EngineLoad, Lifecycle, Tier, WorkerState};
use crate::prefix::OwnerMatch;

/// The fleet, and what the owner index said about workers outside it.
pub(super) struct Fleet<'a> {
    /// Routable workers with role `prefill` or `both`, within the subset hint, in worker order.
    pub members: Vec<Member<'a>>,
    /// Workers (of the whole snapshot) holding at least one leading prompt token.
    pub matching_workers: usize,
    /// Matches naming a worker the snapshot does not have.
    pub unknown_workers: usize,
    /// The request's prompt, in tokens: how deep a match must be to make an owner depends on it.
    pub prompt_tokens: u64,
}

impl<'a> Fleet<'a> {
    /// `limit` is the queue gate's, `None` when the mode has no gate (every gate verdict is then `Off`);
    /// `wait` is the prefill-time gate's, which predicts each member and judges it against the best.
    pub fn new(
        request: &RequestFacts<'_>,
        owners: &[OwnerMatch],
        load: &LoadView<'a>,
        limit: Option<u64>,
        wait: Option<&WaitGate>,
    ) -> Fleet<'a> {
        let snapshot = load.snapshot;
        // Leading tokens each worker holds, by worker index; duplicates keep the deepest match.
        let mut matched = vec![0_u64; snapshot.slots()];
        let mut unknown_workers = 0;
        for owner in owners.iter().filter(|owner| owner.matched_tokens > 0) {
            match matched.get_mut(owner.worker.index()) {
                Some(depth) => *depth = (*depth).max(owner.matched_tokens),
                None => unknown_workers += 1,
            }
        }
        // Hard admission is the request unit's, as the seed's: a worker without a free running slot or
        // room in its KV cache for the whole prompt is passed over. The prefill-time unit vetoes
        // nobody (`Admission::Unchecked` says why): on an overloaded fleet the veto sent owners'
        // requests cold to other full workers, and the engine's own queue is what the prediction prices.
        let admission = |state: &WorkerState, fresh: Option<&EngineLoad>| match wait {
            Some(_) => Admission::Unchecked,
            None => rank::admission(state, fresh, request.prompt_tokens),
        };
        let member = |state: &'a WorkerState| {
            let fresh = state
                .reading
                .as_ref()
                .filter(|reading| snapshot.is_fresh(reading, load.now))
                .map(|reading| &reading.load);
            // An unreachable worker's cache is out of reach with it; what a reachable one holds counts
            // as much as its engine will reuse.
            let matched_tokens = match state.lifecycle {
                Lifecycle::Unreachable => 0,
                _ => reusable(
                    matched.get(state.id.index()).copied().unwrap_or(0),
                    request.prompt_tokens,
                    state.capacity.engine_block,
                ),
            };
            Member {
                state,
                fresh,
                matched_tokens,
                gate: rank::gate(limit.map(|limit| per_worker(limit, state)), fresh),
                admission: admission(state, fresh),
                dispatched: load.dispatches.since_reading(state.id),
                cold: load.dispatches.last_cold(state.id),
                work: None,
                prediction: None,
            }
        };
        // New and unreachable workers serve only when no answering one is left: fail-open survives
        // an outage of the scrapes, and a worker that just joined waits for its first answer. One pass;
        // the last resorts are kept aside (usually none) in case nothing answers.
        let mut members = Vec::with_capacity(snapshot.workers().len());
        let mut last_resort = Vec::new();
        for state in snapshot.workers().iter().filter(|state| {
            state.role.serves_prefill()
                && request
                    .allowed
                    .is_none_or(|allowed| allowed.contains(&state.id))
        }) {
            match state.tier() {
                Tier::Preferred => members.push(member(state)),
                Tier::LastResort => last_resort.push(state),
                Tier::Excluded => {}
            }
        }
        if members.is_empty() {
            members = last_resort.into_iter().map(member).collect();
        }
        if let Some(wait) = wait {
            let pool = wait::PoolRates::of(members.iter().map(|member| member.state));
            for member in &mut members {
                let dispatched = load.dispatches.uncached_since_reading(member.id());
                member.work = wait::work(member, request.prompt_tokens, dispatched);
                member.prediction = wait::predict(member, member.work, dispatched, pool, wait);
            }
            let best = wait::best_ttft(&members);
            for member in &mut members {
                member.gate = wait::gate(member, best, wait);
            }
        }
        Fleet {
            members,
            matching_workers: matched.iter().filter(|depth| **depth > 0).count(),
            unknown_workers,
            prompt_tokens: request.prompt_tokens,
        }
    }

    /// Every member's prediction, for the trace (empty outside the prefill-time unit).
    pub fn predictions(&self) -> Vec<Predicted> {
        self.members
            .iter()
            .filter_map(|member| {
                member.prediction.map(|prediction| Predicted {
                    worker: member.id(),
                    cached_tokens: member.matched_tokens,
                    prediction,
                    ttft_us: prediction.ttft_us(),
                })
            })
            .collect()
    }

    /// Index matches that did not count when `counted` of them did.
    pub fn ignored_matches(&self, counted: usize) -> usize {
        self.unknown_workers + self.matching_workers.saturating_sub(counted)
    }
}

/// Of `matched` leading tokens the index credits a worker with, what its engine reuses for a prompt of
/// `prompt_tokens`, where its KV block is known: whole blocks only, and never the prompt's last token
/// (an engine computes at least one to produce the first; vLLM's `get_computed_blocks` caps the hit
/// at `num_tokens − 1`). A pool block finer than the engine's would otherwise credit the worker with
/// the part of a block the engine recomputes.
pub(super) fn reusable(matched: u64, prompt_tokens: u64, engine_block: Option<u64>) -> u64 {
    match engine_block.filter(|block| *block > 1) {
        Some(block) => matched.min(prompt_tokens.saturating_sub(1)) / block * block,
        None => matched,
    }
}

/// The owners as the trace shows them: deepest first, then by id.
pub(super) fn owner_verdicts(owners: &[Member<'_>]) -> Vec<OwnerVerdict> {
    let mut verdicts: Vec<OwnerVerdict> = owners
        .iter()
        .map(|owner| OwnerVerdict {
            worker: owner.id(),
            matched_tokens: owner.matched_tokens,
            gate: owner.gate,
            admission: owner.admission,
        })
        .collect();
    // Integer keys: a total order, safe to sort.
    verdicts.sort_unstable_by_key(|verdict| {
        (std::cmp::Reverse(verdict.matched_tokens), verdict.worker)
    });
    verdicts
}

/// A per-rank queue threshold (the gate's limit or floor) for one worker: the reading sums its
/// data-parallel ranks' queues, so the threshold is scaled by their number.
pub(super) fn per_worker(threshold: u64, state: &WorkerState) -> u64 {
    threshold.saturating_mul(u64::from(state.ranks.max(1)))
}

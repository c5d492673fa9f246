//! The fleet a decision chooses from, shared by every mode: the pool's routable prefill workers within
//! the proxy's subset, each with its reading, match depth and verdicts computed once.

use super::rank::{self, Member};
use super::trace::OwnerVerdict;
use super::{LoadView, RequestFacts};
use crate::load::{Lifecycle, Tier, WorkerState};
use crate::prefix::OwnerMatch;

/// The fleet, and what the owner index said about workers outside it.
pub(super) struct Fleet<'a> {
    /// Routable workers with role `prefill` or `both`, within the subset hint, in worker order.
    pub members: Vec<Member<'a>>,
    /// Workers (of the whole snapshot) holding at least one leading prompt token.
    pub matching_workers: usize,
    /// Matches naming a worker the snapshot does not have.
    pub unknown_workers: usize,
}

impl<'a> Fleet<'a> {
    /// `limit` is the queue gate's, `None` when the mode has no gate (every gate verdict is then `Off`).
    pub fn new(
        request: &RequestFacts<'_>,
        owners: &[OwnerMatch],
        load: &LoadView<'a>,
        limit: Option<u64>,
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
        let candidates = || {
            snapshot
                .workers()
                .iter()
                .filter(|state| state.role.serves_prefill())
                .filter(|state| {
                    request
                        .allowed
                        .is_none_or(|allowed| allowed.contains(&state.id))
                })
        };
        // New and unreachable workers serve only when no answering one is left: fail-open survives
        // an outage of the scrapes, and a worker that just joined waits for its first answer.
        let floor = candidates()
            .map(WorkerState::tier)
            .min()
            .unwrap_or(Tier::Excluded);
        let members = candidates()
            .filter(|state| state.tier() != Tier::Excluded && state.tier() <= floor)
            .map(|state| {
                let fresh = snapshot.fresh_load(state.id, load.now);
                // An unreachable worker's cache is out of reach with it.
                let matched_tokens = match state.lifecycle {
                    Lifecycle::Unreachable => 0,
                    _ => matched.get(state.id.index()).copied().unwrap_or(0),
                };
                Member {
                    state,
                    fresh,
                    matched_tokens,
                    gate: rank::gate(limit, fresh),
                    admission: rank::admission(state, fresh, request.prompt_tokens),
                    dispatched: load.dispatches.since_reading(state.id),
                }
            })
            .collect();
        Fleet {
            members,
            matching_workers: matched.iter().filter(|depth| **depth > 0).count(),
            unknown_workers,
        }
    }

    /// Index matches that did not count when `counted` of them did.
    pub fn ignored_matches(&self, counted: usize) -> usize {
        self.unknown_workers + self.matching_workers.saturating_sub(counted)
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

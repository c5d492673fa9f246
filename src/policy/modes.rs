//! The modes beside the ladder: `round_robin`, `least_load` and `balance_threshold`. Each takes a
//! non-empty fleet and returns the selected worker with up to `ranks - 1` fallbacks; none of them uses
//! the queue gate or hard admission.

use rand::Rng;

use super::fleet::{Fleet, owner_verdicts};
use super::outcome::{Decision, Outcome, Reason, RefuseReason, Refused};
use super::rank::{self, Member};
use super::trace::{Balance, Rung, Trace};
use crate::config::BalanceKnobs;

/// The fleet in worker order, starting at the request's turn: `sequence` modulo the fleet size. The
/// fallbacks are the workers whose turns come next.
pub(super) fn round_robin(
    fleet: &Fleet<'_>,
    sequence: u64,
    ranks: usize,
    mut trace: Trace,
) -> Outcome {
    let members = &fleet.members;
    trace.ignored_matches = fleet.ignored_matches(0);
    trace.sequence = Some(sequence);
    trace.rung = Rung::RoundRobin;
    let size = members.len().max(1);
    // The remainder is below the fleet size, so it fits a usize.
    let turn = usize::try_from(sequence % size as u64).unwrap_or(0);
    let ranked: Vec<Member<'_>> = members
        .iter()
        .cycle()
        .skip(turn)
        .take(ranks.min(members.len()))
        .copied()
        .collect();
    route(&ranked, Reason::RoundRobin, trace)
}

/// The least-loaded fleet worker; the fallbacks are the next least loaded.
pub(super) fn least_load<R: Rng + ?Sized>(
    fleet: &Fleet<'_>,
    ranks: usize,
    mut trace: Trace,
    rng: &mut R,
) -> Outcome {
    trace.ignored_matches = fleet.ignored_matches(0);
    trace.rung = Rung::LeastLoad;
    let ranked = least_loaded(&fleet.members, ranks, rng);
    route(&ranked, Reason::LeastLoad, trace)
}

/// The SGLang router's classic rule (see the module documentation of `policy`).
pub(super) fn balance_threshold<R: Rng + ?Sized>(
    fleet: &Fleet<'_>,
    prompt_tokens: u64,
    knobs: &BalanceKnobs,
    ranks: usize,
    mut trace: Trace,
    rng: &mut R,
) -> Outcome {
    let members = &fleet.members;
    let owners: Vec<Member<'_>> = members
        .iter()
        .filter(|member| member.matched_tokens > 0)
        .copied()
        .collect();
    trace.ignored_matches = fleet.ignored_matches(owners.len());
    trace.owners = owner_verdicts(&owners);

    let min_load = members.iter().map(Member::load).min().unwrap_or(0);
    let max_load = members.iter().map(Member::load).max().unwrap_or(0);
    let imbalanced = max_load.saturating_sub(min_load) > knobs.abs_threshold
        && max_load as f64 > knobs.rel_threshold.get() * min_load as f64;
    let share = |member: &Member<'_>| {
        if prompt_tokens == 0 {
            0.0
        } else {
            (member.matched_tokens as f64 / prompt_tokens as f64).min(1.0)
        }
    };
    let deepest = owners.iter().map(|owner| owner.matched_tokens).max();
    let match_ratio = owners
        .iter()
        .find(|owner| Some(owner.matched_tokens) == deepest)
        .map_or(0.0, share);
    trace.balance = Some(Balance {
        min_load,
        max_load,
        imbalanced,
        match_ratio,
    });
    let threshold = knobs.cache_threshold.get();
    if !imbalanced && match_ratio > threshold {
        // The deepest owner (least loaded among equals), then the other owners above the threshold, then
        // the rest of the fleet by load.
        let deep: Vec<Member<'_>> = owners
            .into_iter()
            .filter(|owner| share(owner) > threshold)
            .collect();
        let (mut ranked, _) = rank::take_ranked(deep, ranks, rank::deepest_least_loaded);
        let rest: Vec<Member<'_>> = members
            .iter()
            .filter(|member| !ranked.iter().any(|chosen| chosen.id() == member.id()))
            .copied()
            .collect();
        let room = ranks.saturating_sub(ranked.len());
        ranked.extend(rank::take_ranked(rest, room, rank::least_loaded).0);
        trace.rung = Rung::DeepestOwner;
        return route(&ranked, Reason::BalancedOwner, trace);
    }
    trace.rung = Rung::LeastLoad;
    let reason = if imbalanced {
        Reason::Imbalanced
    } else {
        Reason::BalancedMiss
    };
    let ranked = least_loaded(members, ranks, rng);
    route(&ranked, reason, trace)
}

/// Up to `n` members, least loaded first. The first is drawn uniformly among those tied at the minimum
/// load, so that pickers starting from the same readings do not all send their next request to the
/// lowest id; the rest follow by load, then id. `rng` is drawn from only on a tie.
fn least_loaded<'m, R: Rng + ?Sized>(
    members: &[Member<'m>],
    n: usize,
    rng: &mut R,
) -> Vec<Member<'m>> {
    let Some(min) = members.iter().map(Member::load).min() else {
        return Vec::new();
    };
    let tied = members.iter().filter(|member| member.load() == min).count();
    let draw = if tied > 1 {
        rng.random_range(0..tied)
    } else {
        0
    };
    let Some(first) = members
        .iter()
        .filter(|member| member.load() == min)
        .nth(draw)
        .copied()
    else {
        return Vec::new();
    };
    let rest: Vec<Member<'m>> = members
        .iter()
        .filter(|member| member.id() != first.id())
        .copied()
        .collect();
    let mut ranked = vec![first];
    ranked.extend(rank::take_ranked(rest, n.saturating_sub(1), rank::least_loaded).0);
    ranked
}

/// Routes to the first of `ranked` with the rest as fallbacks; an empty ranking (which a non-empty
/// fleet never gives) is a refusal rather than a panic.
fn route(ranked: &[Member<'_>], reason: Reason, trace: Trace) -> Outcome {
    match ranked.split_first() {
        Some((first, rest)) => Outcome::Route(Decision {
            selected: first.id(),
            fallbacks: rest.iter().map(Member::id).collect(),
            reason,
            matched_tokens: first.matched_tokens,
            trace,
        }),
        None => Outcome::Refuse(Refused {
            reason: RefuseReason::NoWorkers,
            trace,
        }),
    }
}

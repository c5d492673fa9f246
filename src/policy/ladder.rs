//! The decision ladder itself; see the module documentation of `policy` for the rules.

use rand::Rng;

use super::fleet::{Fleet, owner_verdicts, per_worker};
use super::outcome::{Decision, Outcome, Reason, RefuseReason, Refused};
use super::rank::{self, Member};
use super::trace::{Gate, Rung, Sampled, Saturation, Trace};
use crate::config::CacheAwareKnobs;
use crate::worker::WorkerId;

/// The `cache_aware` ladder over a non-empty `fleet`; `ranks` is the selected worker plus the fallbacks.
pub(super) fn cache_aware<R: Rng + ?Sized>(
    fleet: &Fleet<'_>,
    config: &CacheAwareKnobs,
    ranks: usize,
    mut trace: Trace,
    rng: &mut R,
) -> Outcome {
    let ignored = |counted: usize| fleet.ignored_matches(counted);
    // A match counts only if it is real (at least one token) and deep enough to be worth a detour.
    let min_match = config.owner_depth(fleet.prompt_tokens);
    let fleet: &[Member<'_>] = &fleet.members;

    let owners: Vec<Member<'_>> = fleet
        .iter()
        .filter(|member| member.matched_tokens >= min_match)
        .copied()
        .collect();
    trace.ignored_matches = ignored(owners.len());
    trace.owners = owner_verdicts(&owners);

    // Rung 1: owners passing the gate and hard admission, deepest first.
    let admitted: Vec<Member<'_>> = owners
        .iter()
        .filter(|owner| owner.gate.passes() && owner.admission.admits())
        .copied()
        .collect();
    if !admitted.is_empty() {
        let (ranked, source) = rank::take_ranked(admitted, ranks, rank::deepest);
        trace.pressure = source;
        trace.rung = Rung::Owners;
        if let Some(outcome) = route(&ranked, Reason::CacheHit, &mut trace, fleet, ranks) {
            return outcome;
        }
    }

    // Owners the gate turned away; the saturation rungs may take them back.
    let queued: Vec<Member<'_>> = owners
        .iter()
        .filter(|owner| owner.gate.turns_away())
        .copied()
        .collect();
    let mut gate_voided = false;
    // Rung 2 in the prefill-time unit: the pin when no worker can start the prefill within the floor.
    if let (Some(floor), false) = (config.wait().and_then(|wait| wait.floor), queued.is_empty()) {
        trace.saturation = starts_within(fleet, floor);
        if trace.saturation.is_saturated() {
            gate_voided = true;
            if let Some(outcome) = pin(&queued, config, ranks, &mut trace, fleet) {
                return outcome;
            }
        }
    }
    if let (Some(gate), false) = (config.queue_gate(), queued.is_empty()) {
        match gate.floor() {
            // Rung 2: the saturation pin.
            Some(floor) => {
                trace.saturation = saturation_below(fleet, floor, false);
                if matches!(trace.saturation, Saturation::Saturated { .. }) {
                    gate_voided = true;
                    if let Some(outcome) = pin(&queued, config, ranks, &mut trace, fleet) {
                        return outcome;
                    }
                }
            }
            // Rung 3: every fleet worker at the limit, no floor: the owners come back.
            None => {
                trace.saturation = saturation_below(fleet, gate.limit(), true);
                if matches!(trace.saturation, Saturation::Saturated { .. }) {
                    gate_voided = true;
                    let admitted = queued.iter().filter(|owner| owner.admission.admits());
                    let (ranked, source) =
                        rank::take_ranked(admitted.copied().collect(), ranks, rank::deepest);
                    trace.pressure = source;
                    trace.rung = Rung::AllQueued;
                    if let Some(outcome) =
                        route(&ranked, Reason::AllQueued, &mut trace, fleet, ranks)
                    {
                        return outcome;
                    }
                }
            }
        }
    }

    let kept = Kept {
        had_owners: !owners.is_empty(),
        turned_away: !queued.is_empty(),
        gate_voided,
        min_match,
    };
    off_owner(fleet, config, ranks, trace, rng, &kept)
}

/// What kept a request from its owners, as rung 4 names it: whether it had owners, whether the gate
/// turned any away, whether the saturation rungs voided the gate, and the depth that makes an owner.
struct Kept {
    had_owners: bool,
    turned_away: bool,
    gate_voided: bool,
    min_match: u64,
}

impl Kept {
    /// Their queue when a diversion can pay off, saturation when it cannot (the gate was voided, yet
    /// no queued owner had room), capacity when the queue was not the cause. A pick that lands on an
    /// owner after all is no diversion.
    fn reason(&self, selected: &Member<'_>) -> Reason {
        if !self.had_owners {
            Reason::CacheMiss
        } else if selected.matched_tokens >= self.min_match {
            match selected.gate {
                Gate::Queued { .. } | Gate::Later { .. } => Reason::AllQueued,
                _ => Reason::CapacityFallback,
            }
        } else if self.gate_voided {
            Reason::AllQueued
        } else if self.turned_away {
            Reason::CacheWorkerQueued
        } else {
            Reason::CapacityFallback
        }
    }
}

/// Rung 2, the saturation pin: the least pressured of the `queued` owners that admit the request and
/// hold at least `pin_depth_ratio` of the deepest one's match.
fn pin(
    queued: &[Member<'_>],
    config: &CacheAwareKnobs,
    ranks: usize,
    trace: &mut Trace,
    fleet: &[Member<'_>],
) -> Option<Outcome> {
    let pinnable = || queued.iter().filter(|owner| owner.admission.admits());
    let deepest = pinnable()
        .map(|owner| owner.matched_tokens)
        .max()
        .unwrap_or(0);
    let cutoff = config.pin_depth_ratio.get() * deepest as f64;
    let eligible: Vec<Member<'_>> = pinnable()
        .filter(|owner| owner.matched_tokens as f64 >= cutoff)
        .copied()
        .collect();
    let (ranked, source) = rank::take_ranked(eligible, ranks, rank::least_pressured);
    trace.pressure = source;
    trace.rung = Rung::SaturationPin;
    route(&ranked, Reason::SaturationPin, trace, fleet, ranks)
}

/// Rung 4, off-owner: the workers that pass the gate and admission, else admission alone, else the
/// least pressured of all; in the prefill-time unit a diversion goes to the soonest, otherwise the
/// pick samples `min_load_choices` and takes the least loaded.
fn off_owner<R: Rng + ?Sized>(
    fleet: &[Member<'_>],
    config: &CacheAwareKnobs,
    ranks: usize,
    mut trace: Trace,
    rng: &mut R,
    kept: &Kept,
) -> Outcome {
    trace.pressure = None;
    let open: Vec<Member<'_>> = fleet
        .iter()
        .filter(|member| member.gate.passes() && member.admission.admits())
        .copied()
        .collect();
    let (mut pool, rung) = if open.is_empty() {
        let admitted: Vec<Member<'_>> = fleet
            .iter()
            .filter(|member| member.admission.admits())
            .copied()
            .collect();
        (admitted, Rung::OffOwnerAdmission)
    } else {
        (open, Rung::OffOwnerGateAndAdmission)
    };
    // In the prefill-time unit a diversion goes where the gate predicted it pays: the soonest worker.
    let diverting = config.wait().is_some() && kept.turned_away && !kept.gate_voided;
    let pick = if config.wait().is_some() {
        rank::soonest
    } else {
        rank::least_loaded
    };
    let ranked = if pool.is_empty() {
        // Nobody can take the request by its engine's own limits: send it where the wait is shortest
        // rather than refuse it, since the limits are estimates and the engine queues.
        let (ranked, source) = rank::take_ranked(fleet.to_vec(), ranks, rank::least_pressured);
        trace.pressure = source;
        trace.rung = Rung::LeastPressured;
        ranked
    } else if diverting {
        trace.rung = rung;
        rank::take_ranked(pool, ranks, rank::soonest).0
    } else {
        rank::sample(&mut pool, config.min_load_choices.get(), rng);
        trace.sampled = pool
            .iter()
            .map(|member| Sampled {
                worker: member.id(),
                load: member.load(),
            })
            .collect();
        trace.rung = rung;
        rank::take_ranked(pool, ranks, pick).0
    };
    let reason = ranked
        .first()
        .map_or(Reason::CacheMiss, |selected| kept.reason(selected));
    match route(&ranked, reason, &mut trace, fleet, ranks) {
        Some(outcome) => outcome,
        None => Outcome::Refuse(Refused {
            reason: RefuseReason::NoWorkers,
            trace,
        }),
    }
}

/// Routes to the first of `ranked`; `None` (trace untouched) if it is empty. The fallbacks are the rest
/// of `ranked`, then — so that Envoy always has somewhere to retry — the other fleet workers in off-owner
/// order (passing the gate and admission, then admission, then the rest; least load, then id), up to
/// `ranks - 1` in all.
fn route(
    ranked: &[Member<'_>],
    reason: Reason,
    trace: &mut Trace,
    fleet: &[Member<'_>],
    ranks: usize,
) -> Option<Outcome> {
    let first = ranked.first()?;
    let mut chosen: Vec<WorkerId> = ranked.iter().map(Member::id).take(ranks).collect();
    while chosen.len() < ranks {
        let next = fleet
            .iter()
            .filter(|member| !chosen.contains(&member.id()))
            .min_by_key(|member| (off_owner_tier(member), member.load(), member.tie()));
        match next {
            Some(member) => chosen.push(member.id()),
            None => break,
        }
    }
    Some(Outcome::Route(Decision {
        selected: first.id(),
        fallbacks: chosen.into_iter().skip(1).collect(),
        reason,
        matched_tokens: first.matched_tokens,
        trace: std::mem::take(trace),
    }))
}

/// How suitable a worker is for an off-owner pick: 0 passes the gate and admission, 1 admission only.
fn off_owner_tier(member: &Member<'_>) -> u8 {
    match (member.gate.passes(), member.admission.admits()) {
        (true, true) => 0,
        (false, true) => 1,
        _ => 2,
    }
}

/// Looks for a fleet worker predicted to start the request's prefill within `floor`: the evidence that
/// diverting can pay off. A worker without a prediction is no such evidence (fail-closed).
fn starts_within(fleet: &[Member<'_>], floor: std::time::Duration) -> Saturation {
    let floor_us = u64::try_from(floor.as_micros()).unwrap_or(u64::MAX);
    for member in fleet {
        if let Some(prediction) = member.prediction
            && prediction.queue_us < floor_us
        {
            return Saturation::StartsSoon {
                witness: member.id(),
                queue_us: prediction.queue_us,
                floor_us,
            };
        }
    }
    Saturation::NoneStartsSoon { floor_us }
}

/// Looks for a fleet worker whose fresh queue is below `per_rank` times its ranks: the evidence that
/// diverting can pay off. A worker without a fresh reading is no such evidence for the floor (fail-closed); for the
/// all-queued check (`require_fresh`) it is the opposite, since "every worker is at the limit" cannot
/// be shown for a worker nobody has read.
fn saturation_below(fleet: &[Member<'_>], per_rank: u64, require_fresh: bool) -> Saturation {
    for member in fleet {
        let threshold = per_worker(per_rank, member.state);
        match member.fresh {
            Some(load) if load.waiting < threshold => {
                return Saturation::Relieved {
                    witness: member.id(),
                    waiting: load.waiting,
                    threshold,
                };
            }
            None if require_fresh => {
                return Saturation::Unread {
                    witness: member.id(),
                    threshold,
                };
            }
            _ => {}
        }
    }
    Saturation::Saturated {
        threshold: per_rank,
    }
}

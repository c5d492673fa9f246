//! The decode pick of a prefill/decode (PD) pool: the second choice a request gets, after the ladder
//! chose its prefill worker.
//!
//! The **decode fleet** is the pool's routable `decode` workers within the proxy's subset (new and
//! unreachable ones only when no answering one is left, as for the prefill fleet). What the decode
//! worker costs a request is not prefill but time in its running batch and room in its KV cache, so
//! the pick reads decode pressure:
//!
//! - **Pressure** is waiting + running from a fresh reading plus the requests dispatched since it. vLLM
//!   counts a request waiting for its remote KV (`WAITING_FOR_REMOTE_KVS`) as waiting, so transfer
//!   waits are in it. Ties go to the lower KV usage (used tokens, which include blocks allocated for
//!   transfers in flight), then to the lower id.
//! - **Admission**: a worker whose reading shows no free running slot, or too little free KV for the
//!   prompt it does not hold, is taken only when no worker has room.
//! - **Power of k**: `decode_choices` admitted workers are sampled and the least pressured wins
//!   ([`DecodeReason::DecodePressure`]).
//! - **Affinity**: a vLLM decode worker keeps the prompt blocks it pulled in its own prefix cache and
//!   pulls only the blocks it lacks, so the deepest admitted decode owner (at least `min_match_tokens`)
//!   wins when its pressure is no higher than the sampled winner's ([`DecodeReason::DecodeHit`]):
//!   affinity is taken only where it costs the running batch nothing.
//!
//! Prefill owners, gates and the saturation floor are the ladder's and never read a decode worker; the
//! decode pick never reads a prefill worker. An idle decode worker therefore cannot veto the pin.

use rand::Rng;
use serde::Serialize;

use super::rank::admission;
use super::trace::Admission;
use super::{LoadView, RequestFacts};
use crate::load::{EngineLoad, Tier, WorkerState};
use crate::prefix::OwnerMatch;
use crate::worker::{Role, WorkerId};

/// Why a request's decode leg went where it went. Label values are public, as [`super::Reason`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeReason {
    /// The deepest decode worker holding the prompt's prefix, no more pressured than the sampled best.
    DecodeHit,
    /// The least pressured of the sampled decode workers.
    DecodePressure,
    /// No decode worker has room by its reading: the least pressured of them all.
    DecodeCapacityFallback,
}

impl DecodeReason {
    pub const ALL: [DecodeReason; 3] = [
        DecodeReason::DecodeHit,
        DecodeReason::DecodePressure,
        DecodeReason::DecodeCapacityFallback,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecodeReason::DecodeHit => "decode_hit",
            DecodeReason::DecodePressure => "decode_pressure",
            DecodeReason::DecodeCapacityFallback => "decode_capacity_fallback",
        }
    }
}

/// A request's decode worker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodePick {
    pub selected: WorkerId,
    /// The next decode workers by pressure, for the proxy to retry on.
    pub fallbacks: Vec<WorkerId>,
    pub reason: DecodeReason,
    /// Leading prompt tokens the selected decode worker holds: they are not transferred.
    pub matched_tokens: u64,
    /// The selected worker's pressure (waiting + running + dispatched).
    pub pressure: u64,
    /// The selected worker's waiting requests (transfer waits included) plus those dispatched since
    /// its reading; `None` without a fresh reading.
    pub waiting: Option<u64>,
    /// Decode workers the pick chose from.
    pub fleet: usize,
}

/// Picks the decode worker for a request of a PD pool; `None` when the pool has no routable decode
/// worker within the subset. Pure, as [`super::decide`].
pub fn decide_decode<R: Rng + ?Sized>(
    request: &RequestFacts<'_>,
    owners: &[OwnerMatch],
    load: &LoadView<'_>,
    choices: usize,
    min_match_tokens: u64,
    fallbacks: usize,
    rng: &mut R,
) -> Option<DecodePick> {
    let snapshot = load.snapshot;
    let in_fleet = |state: &&WorkerState| {
        state.role == Role::Decode
            && request
                .allowed
                .is_none_or(|allowed| allowed.contains(&state.id))
    };
    let mut members: Vec<Candidate<'_>> = Vec::new();
    let mut last_resort: Vec<&WorkerState> = Vec::new();
    for state in snapshot.workers().iter().filter(in_fleet) {
        match state.tier() {
            Tier::Preferred => members.push(Candidate::new(state, request, owners, load)),
            Tier::LastResort => last_resort.push(state),
            Tier::Excluded => {}
        }
    }
    if members.is_empty() {
        members = last_resort
            .into_iter()
            .map(|state| Candidate::new(state, request, owners, load))
            .collect();
    }
    if members.is_empty() {
        return None;
    }
    let fleet = members.len();
    let admitted: Vec<Candidate<'_>> = members
        .iter()
        .filter(|member| member.admission.admits())
        .copied()
        .collect();
    let (selected, reason) = if admitted.is_empty() {
        let best = members.iter().min_by_key(|member| member.key())?;
        (*best, DecodeReason::DecodeCapacityFallback)
    } else {
        let mut sampled = admitted.clone();
        let k = choices.max(1).min(sampled.len());
        // A partial Fisher-Yates shuffle: the first `k` are a uniform sample without replacement.
        for i in 0..k {
            let j = rng.random_range(i..sampled.len());
            sampled.swap(i, j);
        }
        let best = *sampled.get(..k)?.iter().min_by_key(|member| member.key())?;
        let owner = admitted
            .iter()
            .filter(|member| member.matched_tokens >= min_match_tokens.max(1))
            .min_by_key(|member| {
                (
                    std::cmp::Reverse(member.matched_tokens),
                    member.pressure(),
                    member.state.id,
                )
            });
        match owner {
            Some(owner) if owner.pressure() <= best.pressure() => (*owner, DecodeReason::DecodeHit),
            _ => (best, DecodeReason::DecodePressure),
        }
    };
    let mut rest: Vec<&Candidate<'_>> = members
        .iter()
        .filter(|member| member.state.id != selected.state.id)
        .collect();
    rest.sort_unstable_by_key(|member| (!member.admission.admits(), member.key()));
    Some(DecodePick {
        selected: selected.state.id,
        fallbacks: rest
            .into_iter()
            .take(fallbacks)
            .map(|member| member.state.id)
            .collect(),
        reason,
        matched_tokens: selected.matched_tokens,
        pressure: selected.pressure(),
        waiting: selected
            .fresh
            .map(|load| load.waiting.saturating_add(selected.dispatched)),
        fleet,
    })
}

/// A decode fleet worker with what the pick asks about it.
#[derive(Clone, Copy)]
struct Candidate<'a> {
    state: &'a WorkerState,
    fresh: Option<&'a EngineLoad>,
    matched_tokens: u64,
    dispatched: u64,
    admission: Admission,
}

impl<'a> Candidate<'a> {
    fn new(
        state: &'a WorkerState,
        request: &RequestFacts<'_>,
        owners: &[OwnerMatch],
        load: &LoadView<'a>,
    ) -> Candidate<'a> {
        let fresh = state
            .reading
            .as_ref()
            .filter(|reading| load.snapshot.is_fresh(reading, load.now))
            .map(|reading| &reading.load);
        let matched_tokens = owners
            .iter()
            .filter(|owner| owner.worker == state.id)
            .map(|owner| owner.matched_tokens)
            .max()
            .unwrap_or(0);
        Candidate {
            state,
            fresh,
            matched_tokens,
            dispatched: load.dispatches.since_reading(state.id),
            // The decode worker allocates the blocks it does not hold before the transfer lands.
            admission: admission(
                state,
                fresh,
                request.prompt_tokens.saturating_sub(matched_tokens),
            ),
        }
    }

    fn pressure(&self) -> u64 {
        self.fresh
            .map_or(0, |load| load.waiting.saturating_add(load.running))
            .saturating_add(self.dispatched)
    }

    /// Pressure, then KV used (unknown last), then id: a total order.
    fn key(&self) -> (u64, u64, WorkerId) {
        let used = self
            .fresh
            .and_then(|load| load.used_tokens)
            .unwrap_or(u64::MAX);
        (self.pressure(), used, self.state.id)
    }
}

/// Why a request of a PD pool skips its remote prefill and is prefilled by its decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalPrefill {
    /// What the decode worker lacks of the prompt is short, in tokens and as a share of the prompt,
    /// and the decode worker has room: a transfer and a second queue would cost more than computing it.
    ShortSuffix,
    /// The prompt's prefill owner was passed over as queued (`cache_worker_queued`) and the decode
    /// worker holds the prefix: it prefills warm what a diverted prefill worker would prefill cold.
    OwnerQueued,
}

/// When a decode worker prefills a request itself (`pd.local_prefill_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalRule {
    /// The longest uncached suffix the decode worker prefills itself; 0 turns the rule off.
    pub max_suffix_tokens: u64,
    /// ... and the suffix's largest share of the prompt, in `[0, 1]`.
    pub max_suffix_share: f64,
    /// Whether [`LocalPrefill::OwnerQueued`] applies.
    pub when_owner_queued: bool,
}

/// Whether the decode worker `pick` prefills the request itself, given the prefill pick's reason. Pure.
///
/// A busy decode worker never does (Dynamo's decode veto): one without room by its reading
/// (`decode_capacity_fallback`), one with a request waiting or dispatched since its reading, or one
/// without a fresh reading. A local prefill shares the decode worker's step with every running
/// decode, so it pays only where nothing queues behind it; measured without this veto, decode workers
/// that took every short suffix became the prefill bottleneck (BENCHMARKS.md).
pub fn local_prefill(
    prompt_tokens: u64,
    pick: &DecodePick,
    prefill_reason: super::Reason,
    rule: &LocalRule,
) -> Option<LocalPrefill> {
    let busy = pick.reason == DecodeReason::DecodeCapacityFallback || pick.waiting != Some(0);
    if busy || prompt_tokens == 0 {
        return None;
    }
    if rule.when_owner_queued
        && prefill_reason == super::Reason::CacheWorkerQueued
        && pick.reason == DecodeReason::DecodeHit
    {
        return Some(LocalPrefill::OwnerQueued);
    }
    let suffix = prompt_tokens.saturating_sub(pick.matched_tokens);
    let share = suffix as f64 / prompt_tokens as f64;
    (rule.max_suffix_tokens > 0
        && suffix <= rule.max_suffix_tokens
        && share <= rule.max_suffix_share)
        .then_some(LocalPrefill::ShortSuffix)
}

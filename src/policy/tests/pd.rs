//! Prefill/decode pools: the decode pick, and the ladder's fleet that decode workers never join.

use super::*;

impl Case {
    /// Adds a decode worker with `waiting` and `running` from a fresh reading.
    fn decode(self, waiting: u64, running: u64) -> Self {
        self.worker(Some(waiting))
            .with(|w| w.role = Role::Decode)
            .running(running)
    }

    /// Adds a prefill worker with `waiting` queued requests.
    fn prefill(self, waiting: u64) -> Self {
        self.worker(Some(waiting)).with(|w| w.role = Role::Prefill)
    }

    fn decode_pick(&self, choices: usize) -> Option<DecodePick> {
        let mut rng = SmallRng::seed_from_u64(self.seed);
        let snapshot = PoolSnapshot::new(42, FRESHNESS, self.workers.clone());
        let dispatches = TokenDispatches(&self.dispatches);
        let load = LoadView {
            snapshot: &snapshot,
            dispatches: &dispatches,
            now: self.now,
        };
        let request = RequestFacts {
            prompt_tokens: self.prompt_tokens,
            allowed: self.allowed.as_deref(),
            sequence: 0,
        };
        decide_decode(&request, &self.owners, &load, choices, 1024, 2, &mut rng)
    }

    fn decode_of(&self, choices: usize) -> (u32, DecodeReason) {
        let pick = self.decode_pick(choices).expect("a decode worker");
        (pick.selected.0, pick.reason)
    }
}

#[test]
fn the_decode_pick_reads_only_decode_workers_and_takes_the_least_pressured() {
    // An idle prefill worker and an idle aggregated one are not decode workers.
    let case = Case::gated()
        .prefill(0)
        .worker(Some(0))
        .decode(3, 10)
        .decode(1, 4)
        .decode(0, 30);
    // Sampling every decode worker: 1 + 4 is the least pressure.
    assert_eq!(case.decode_of(8), (3, DecodeReason::DecodePressure));
    let pick = case.decode_pick(8).unwrap();
    assert_eq!(pick.fleet, 3);
    assert_eq!(pick.pressure, 5);
    assert_eq!(pick.fallbacks, vec![WorkerId(2), WorkerId(4)]);
}

#[test]
fn dispatches_since_the_reading_count_as_decode_pressure() {
    let case = Case::gated().decode(0, 2).dispatched(5).decode(0, 4);
    assert_eq!(case.decode_of(2), (1, DecodeReason::DecodePressure));
}

#[test]
fn power_of_k_samples_k_decode_workers() {
    // With one choice the pick is a uniform draw: over seeds every worker is picked, the idle one
    // not always.
    let mut picked = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let mut case = Case::gated().decode(0, 9).decode(0, 0).decode(0, 9);
        case.seed = seed;
        picked.insert(case.decode_of(1).0);
    }
    assert_eq!(picked.len(), 3, "{picked:?}");
    // With every worker sampled the idle one always wins.
    for seed in 0..16 {
        let mut case = Case::gated().decode(0, 9).decode(0, 0).decode(0, 9);
        case.seed = seed;
        assert_eq!(case.decode_of(3).0, 1);
    }
}

#[test]
fn a_decode_owner_wins_only_when_it_is_no_more_pressured() {
    // The owner (32 blocks) is as pressured as the idlest: affinity costs nothing, it wins.
    let tie = Case::gated().decode(0, 2).owns(32).decode(0, 2);
    assert_eq!(tie.decode_of(2), (0, DecodeReason::DecodeHit));
    assert_eq!(tie.decode_pick(2).unwrap().matched_tokens, 32 * BLOCK);
    // More pressured than the sampled best: pressure wins over the transfer it would save.
    let busy = Case::gated().decode(1, 2).owns(32).decode(0, 2);
    assert_eq!(busy.decode_of(2), (1, DecodeReason::DecodePressure));
    // A match below min_match_tokens (1024) is no affinity.
    let shallow = Case::gated().decode(0, 2).decode(0, 2).owns(8);
    assert_eq!(shallow.decode_of(2), (0, DecodeReason::DecodePressure));
}

#[test]
fn a_full_decode_worker_is_taken_only_when_none_has_room() {
    let case = Case::gated().decode(0, 0).kv_full().decode(2, 2);
    assert_eq!(case.decode_of(2), (1, DecodeReason::DecodePressure));
    let all_full = Case::gated().decode(0, 0).kv_full().decode(2, 2).kv_full();
    assert_eq!(
        all_full.decode_of(2),
        (0, DecodeReason::DecodeCapacityFallback)
    );
}

#[test]
fn a_pool_without_a_routable_decode_worker_has_no_decode_pick() {
    assert!(Case::gated().prefill(0).decode_pick(2).is_none());
    let draining = Case::gated()
        .prefill(0)
        .decode(0, 0)
        .with(|w| w.lifecycle = Lifecycle::Draining);
    assert!(draining.decode_pick(2).is_none());
    let mut outside = Case::gated().decode(0, 0).decode(0, 0);
    outside.allowed = Some(vec![WorkerId(1)]);
    assert_eq!(outside.decode_of(2).0, 1);
}

#[test]
fn idle_decode_workers_never_block_the_pin_in_either_unit() {
    // The seed's scenario on a PD pool: both prefill owners queue past the floor, and the idle decode
    // workers are no evidence that a diversion pays.
    let requests = Case::gated()
        .owner(9, 32)
        .with(|w| w.role = Role::Prefill)
        .owner(7, 20)
        .with(|w| w.role = Role::Prefill)
        .decode(0, 0)
        .decode(0, 0);
    assert_eq!(requests.pick(), (1, Reason::SaturationPin));
    assert_eq!(requests.routed().trace.fleet, 2);
    // The prefill-time unit, as `a_saturated_fleet_pins_to_the_owner`: the owner 4 s from starting, a
    // cold prefill worker 2 s, past the 1 s floor; idle decode workers are not predicted at all.
    let timed = Case::timed()
        .owner(1, 32)
        .with(|w| w.role = Role::Prefill)
        .uncached(40_000)
        .queued(20_000)
        .with(|w| w.role = Role::Prefill)
        .decode(0, 0)
        .decode(0, 0);
    let decision = timed.routed();
    assert_eq!(pick_of(&decision), (0, Reason::SaturationPin));
    assert_eq!(decision.trace.predictions.len(), 2);
    // And the decode pick of the same request goes to a decode worker.
    assert!(timed.decode_of(2).0 >= 1);
}

fn pick(reason: DecodeReason, matched_tokens: u64) -> DecodePick {
    DecodePick {
        selected: WorkerId(0),
        fallbacks: Vec::new(),
        reason,
        matched_tokens,
        pressure: 0,
        waiting: Some(0),
        fleet: 2,
    }
}

const DYNAMO: LocalRule = LocalRule {
    max_suffix_tokens: 2048,
    max_suffix_share: 0.7,
    when_owner_queued: true,
};

#[test]
fn a_short_uncached_suffix_is_prefilled_by_the_decode_worker_that_has_room() {
    let local = |prompt, matched, reason, rule: &LocalRule| {
        local_prefill(prompt, &pick(reason, matched), Reason::CacheMiss, rule)
    };
    // 1,000 of 8,000 tokens missing: short in tokens and in share.
    assert_eq!(
        local(8000, 7000, DecodeReason::DecodeHit, &DYNAMO),
        Some(LocalPrefill::ShortSuffix)
    );
    // A short cold prompt is all suffix (share 1 > 0.7): it still goes to a prefill worker.
    assert_eq!(local(1500, 0, DecodeReason::DecodePressure, &DYNAMO), None);
    // Long in tokens though small in share.
    assert_eq!(
        local(100_000, 90_000, DecodeReason::DecodeHit, &DYNAMO),
        None
    );
    // A decode worker without room never prefills.
    assert_eq!(
        local(8000, 7000, DecodeReason::DecodeCapacityFallback, &DYNAMO),
        None
    );
    // A busy decode worker never prefills: a request waiting or dispatched since its reading, or no
    // fresh reading to say it is idle.
    for waiting in [Some(1), None] {
        let busy = DecodePick {
            waiting,
            ..pick(DecodeReason::DecodeHit, 7000)
        };
        assert_eq!(local_prefill(8000, &busy, Reason::CacheMiss, &DYNAMO), None);
        let queued = DecodePick {
            waiting,
            ..pick(DecodeReason::DecodeHit, 8192)
        };
        assert_eq!(
            local_prefill(40_000, &queued, Reason::CacheWorkerQueued, &DYNAMO),
            None
        );
    }
    // 0 tokens turns the rule off.
    let off = LocalRule {
        max_suffix_tokens: 0,
        ..DYNAMO
    };
    assert_eq!(local(8000, 7000, DecodeReason::DecodeHit, &off), None);
}

#[test]
fn a_queued_owner_with_the_prefix_on_the_decode_worker_keeps_the_request_there() {
    let queued = |reason, rule: &LocalRule| {
        local_prefill(40_000, &pick(reason, 8192), Reason::CacheWorkerQueued, rule)
    };
    assert_eq!(
        queued(DecodeReason::DecodeHit, &DYNAMO),
        Some(LocalPrefill::OwnerQueued)
    );
    // Without the prefix on the decode worker, the diverted prefill worker prefills it.
    assert_eq!(queued(DecodeReason::DecodePressure, &DYNAMO), None);
    let never = LocalRule {
        when_owner_queued: false,
        ..DYNAMO
    };
    assert_eq!(queued(DecodeReason::DecodeHit, &never), None);
    // Any other prefill reason keeps the remote prefill.
    assert_eq!(
        local_prefill(
            40_000,
            &pick(DecodeReason::DecodeHit, 8192),
            Reason::CacheHit,
            &DYNAMO
        ),
        None
    );
}

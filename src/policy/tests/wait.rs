//! The ladder in the prefill-time unit. Unless a test says otherwise: a configured rate of 10,000
//! tokens a second per rank, a divert margin of 500 ms, a floor of 1 s, a 2,048-token prompt and
//! 64-token blocks — so 10,000 uncached tokens ahead are 1 s of queue, and a cold prompt 204.8 ms.

use super::*;

const RATE: u64 = 10_000;

fn timed(margin_ms: u64, floor_ms: Option<u64>, rate: Option<u64>) -> PolicyConfig {
    PolicyConfig {
        mode: Mode::CacheAware(CacheAwareKnobs {
            // These tables were written for sampling two off-owner workers; the whole-fleet default
            // has tests of its own.
            min_load_choices: NonZeroUsize::new(2).unwrap(),
            ..CacheAwareKnobs::with_gating(Gating::PrefillTime(WaitGate {
                divert_margin: Duration::from_millis(margin_ms),
                floor: floor_ms.map(Duration::from_millis),
                fallback_rate: rate.and_then(NonZeroU64::new),
            }))
        }),
        ..PolicyConfig::default()
    }
}

impl Case {
    pub(super) fn timed() -> Self {
        Case::new(timed(500, Some(1000), Some(RATE)))
    }

    /// Adds a worker with `tokens` uncached tokens queued (as SGLang reports them).
    pub(super) fn queued(self, tokens: u64) -> Self {
        self.worker(Some(u64::from(tokens > 0))).uncached(tokens)
    }
}

fn prediction_of(decision: &Decision, worker: u32) -> Predicted {
    *decision
        .trace
        .predictions
        .iter()
        .find(|p| p.worker == WorkerId(worker))
        .unwrap_or_else(|| panic!("no prediction for worker {worker}: {:?}", decision.trace))
}

#[test]
fn an_owner_with_a_short_queue_in_tokens_keeps_the_request_however_many_requests_wait() {
    // Ten short chats waiting: the request-count gate (limit 4) diverts, the time gate does not.
    let tokens = |case: Case| case.owner(10, 32).uncached(500).worker(Some(0));
    assert_eq!(tokens(Case::gated()).pick(), (1, Reason::CacheWorkerQueued));
    let decision = tokens(Case::timed()).routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    let owner = prediction_of(&decision, 0);
    assert_eq!(
        (
            owner.prediction.queue_us,
            owner.prediction.prefill_us,
            owner.cached_tokens
        ),
        (50_000, 0, 2048)
    );
    assert_eq!(prediction_of(&decision, 1).ttft_us, 204_800);
}

#[test]
fn an_owner_whose_queue_costs_more_than_a_cold_prefill_elsewhere_plus_the_margin_is_passed_over() {
    // 40k tokens ahead: 4 s, against 204.8 ms cold on the idle worker.
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .worker(Some(0))
        .routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheWorkerQueued));
    assert_eq!(
        decision.trace.owners[0].gate,
        Gate::Later {
            ttft_us: 4_000_000,
            best_us: 204_800
        }
    );
    assert!(matches!(
        decision.trace.saturation,
        Saturation::StartsSoon {
            witness: WorkerId(1),
            queue_us: 0,
            floor_us: 1_000_000
        }
    ));
    assert_eq!(decision.diverted_tokens(), Some(32 * BLOCK));
}

#[test]
fn the_margin_is_the_boundary_of_a_divert() {
    // Owner: 7,048 tokens ahead = 704.8 ms. Idle cold worker: 204.8 ms. Difference: exactly 500 ms.
    let at = Case::timed().owner(1, 32).uncached(7_048).worker(Some(0));
    assert_eq!(at.pick(), (0, Reason::CacheHit));
    let above = Case::timed().owner(1, 32).uncached(7_049).worker(Some(0));
    assert_eq!(above.pick(), (1, Reason::CacheWorkerQueued));
}

#[test]
fn the_alternative_s_own_cached_prefix_counts() {
    // A shallower owner (16 of 32 blocks) with an empty queue is predicted sooner than a cold worker.
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .worker(Some(0))
        .owner(0, 16)
        .routed();
    assert_eq!(pick_of(&decision), (2, Reason::CacheHit));
    assert_eq!(prediction_of(&decision, 2).prediction.prefill_us, 102_400);
}

#[test]
fn a_worker_holding_less_than_half_the_prompt_is_no_owner_in_the_prefill_time_unit() {
    // An 8,192-token prompt; worker 0 holds its first 1,024 (a shared system prompt) behind 2,000
    // uncached tokens: 200 ms + 716.8 ms, within the margin of the idle cold worker's 819.2 ms.
    let shallow = |case: Case| {
        let mut case = case.owner(1, 16).uncached(2_000).worker(Some(0));
        case.prompt_tokens = 8_192;
        case
    };
    // Half the prompt makes an owner: nobody holds it, so the miss goes to the soonest worker.
    let decision = shallow(Case::timed()).routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheMiss));
    assert!(decision.trace.owners.is_empty(), "{:?}", decision.trace);
    assert_eq!(decision.trace.ignored_matches, 1);
    // With the share at 0 the system prompt's holder is an owner, and rung 1 takes it.
    let zero = |case: Case| case.knobs(|knobs| knobs.min_match_share = DepthRatio::ZERO);
    assert_eq!(zero(shallow(Case::timed())).pick(), (0, Reason::CacheHit));
    // The request unit's default is the seed's: every match of min_match_tokens is an owner.
    assert_eq!(shallow(Case::gated()).pick(), (0, Reason::CacheHit));
    // Half exactly is enough.
    let mut half = Case::timed().owner(1, 64).uncached(2_000).worker(Some(0));
    half.prompt_tokens = 8_192;
    assert_eq!(half.pick(), (0, Reason::CacheHit));
}

#[test]
fn a_saturated_fleet_pins_to_the_owner() {
    // Nobody can start within 1 s: the owner (4 s) keeps the request though a cold worker at 2 s is
    // predicted sooner.
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .queued(20_000)
        .routed();
    assert_eq!(pick_of(&decision), (0, Reason::SaturationPin));
    assert_eq!(
        decision.trace.saturation,
        Saturation::NoneStartsSoon {
            floor_us: 1_000_000
        }
    );
    assert_eq!(decision.trace.pressure, Some(PressureSource::PredictedWait));
}

#[test]
fn one_worker_able_to_start_within_the_floor_blocks_the_pin() {
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .queued(20_000)
        .queued(5_000)
        .routed();
    // The diversion goes to the soonest worker: 0.5 s queue + 0.2 s prefill.
    assert_eq!(pick_of(&decision), (2, Reason::CacheWorkerQueued));
    assert!(matches!(
        decision.trace.saturation,
        Saturation::StartsSoon {
            witness: WorkerId(2),
            queue_us: 500_000,
            ..
        }
    ));
}

#[test]
fn the_pin_takes_the_least_waiting_of_the_deep_enough_owners() {
    // Two queued owners; the shallower one (16 ≥ 0.5 × 32 blocks) waits less.
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .owner(1, 16)
        .uncached(38_000)
        .queued(20_000)
        .routed();
    assert_eq!(pick_of(&decision), (1, Reason::SaturationPin));
}

#[test]
fn the_floor_boundary_is_strict() {
    // A worker exactly 1 s from starting does not relieve the fleet.
    let case = Case::timed().owner(1, 32).uncached(40_000).queued(10_000);
    assert_eq!(case.pick(), (0, Reason::SaturationPin));
    let case = Case::timed().owner(1, 32).uncached(40_000).queued(9_999);
    assert_eq!(case.pick(), (1, Reason::CacheWorkerQueued));
}

#[test]
fn without_a_floor_a_queued_owner_is_diverted_from_whatever_the_fleet() {
    let case = Case::new(timed(500, None, Some(RATE)))
        .owner(1, 32)
        .uncached(40_000)
        .queued(20_000);
    assert_eq!(case.pick(), (1, Reason::CacheWorkerQueued));
}

#[test]
fn unknown_readings_and_rates_fail_open() {
    // The owner has no fresh reading: its gate is unread and it keeps the request.
    let unread = Case::timed().worker(None).owns(32).worker(Some(0));
    let decision = unread.routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    assert_eq!(decision.trace.owners[0].gate, Gate::Unread);
    // No rate learned and none configured: nothing is predicted, affinity holds.
    let blind = Case::new(timed(500, Some(1000), None))
        .owner(1, 32)
        .uncached(40_000)
        .worker(Some(0));
    let decision = blind.routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    assert!(decision.trace.predictions.is_empty());
}

#[test]
fn a_fleet_worker_without_a_reading_is_no_evidence_against_the_pin() {
    let case = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .queued(20_000)
        .worker(None);
    assert_eq!(case.pick(), (0, Reason::SaturationPin));
}

#[test]
fn a_learned_rate_wins_over_the_configured_one_and_scales_the_prediction() {
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .with(|w| w.prefill.drain_tokens_per_second = Some(80_000))
        .worker(Some(0))
        .routed();
    // 40k tokens at 80k/s: 0.5 s, within the margin of the idle worker's 204.8 ms.
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    let owner = prediction_of(&decision, 0).prediction;
    assert_eq!(
        (owner.rate, owner.rate_source, owner.queue_us),
        (80_000, RateSource::Drain, 500_000)
    );
    // The idle worker has learned nothing itself: it borrows the fleet's learned rate before the
    // configured one.
    let idle = prediction_of(&decision, 1).prediction;
    assert_eq!(
        (idle.rate, idle.rate_source),
        (80_000, RateSource::PoolDrain)
    );
}

#[test]
fn a_worker_that_never_queued_borrows_the_fleet_s_learned_rate_so_misses_do_not_herd() {
    // No configured rate. Worker 0 queued long enough to learn 10k tokens a second and has 40k
    // tokens waiting; worker 1 (two ranks) never queued, so its counters taught nothing. Pricing it
    // as unknown would send the miss to the one worker with a prediction: the busy one.
    let decision = Case::new(timed(500, Some(1000), None))
        .queued(40_000)
        .with(|w| w.prefill.drain_tokens_per_second = Some(10_000))
        .worker(Some(0))
        .with(|w| w.ranks = 2)
        .choices(64)
        .routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheMiss));
    let idle = prediction_of(&decision, 1).prediction;
    assert_eq!(
        (idle.rate, idle.rate_source, idle.prefill_us),
        (20_000, RateSource::PoolDrain, 102_400)
    );
    // Nobody has learned anything and nothing is configured: no predictions at all.
    let blind = Case::new(timed(500, Some(1000), None))
        .queued(40_000)
        .worker(Some(0))
        .routed();
    assert!(blind.trace.predictions.is_empty(), "{:?}", blind.trace);
}

#[test]
fn the_fleet_s_rate_is_the_median_per_rank_so_one_fast_outlier_does_not_set_it() {
    let learned = |rates: &[(Option<u64>, u32)]| {
        let states: Vec<WorkerState> = rates
            .iter()
            .enumerate()
            .map(|(i, (rate, ranks))| {
                let endpoint = SocketAddr::from(([127, 0, 0, 1], 18000 + i as u16));
                let mut state = WorkerState::new(WorkerId(i as u32), endpoint, Role::Both);
                state.prefill.drain_tokens_per_second = *rate;
                state.ranks = *ranks;
                state
            })
            .collect();
        crate::policy::wait::PoolRates::of(states.iter()).drain
    };
    assert_eq!(learned(&[(None, 1), (None, 4)]), None);
    assert_eq!(learned(&[(Some(9_000), 1), (None, 1)]), Some(9_000));
    // Per rank: 40k over four ranks is 10k; the outlier's 100k is not the answer, nor the mean.
    assert_eq!(
        learned(&[
            (Some(40_000), 4),
            (Some(100_000), 1),
            (Some(8_000), 1),
            (None, 1)
        ]),
        Some(10_000)
    );
    // An even count takes the lower middle.
    assert_eq!(learned(&[(Some(8_000), 1), (Some(12_000), 1)]), Some(8_000));
}

#[test]
fn a_configured_rate_is_per_rank() {
    let decision = Case::timed()
        .owner(1, 32)
        .uncached(40_000)
        .with(|w| w.ranks = 4)
        .worker(Some(0))
        .routed();
    // Four ranks: 40k tokens at 40k/s = 1 s.
    assert_eq!(prediction_of(&decision, 0).prediction.queue_us, 1_000_000);
}

#[test]
fn a_queue_reported_as_a_count_is_priced_at_the_learned_tokens_per_request() {
    // vLLM: 4 waiting, 10k uncached tokens each on average = 4 s.
    let learned = Case::timed()
        .owner(4, 32)
        .with(|w| w.prefill.uncached_per_request = Some(10_000))
        .worker(Some(0));
    let decision = learned.routed();
    assert_eq!(prediction_of(&decision, 0).prediction.ahead_tokens, 40_000);
    assert_eq!(pick_of(&decision), (1, Reason::CacheWorkerQueued));
    // Nothing learned yet: each waiting request stands in as this one's own uncached part on the
    // worker (a full hit here: nothing), so the owner keeps it.
    let unlearned = Case::timed().owner(4, 32).worker(Some(0));
    assert_eq!(unlearned.pick(), (0, Reason::CacheHit));
}

#[test]
fn a_queue_of_requests_routed_here_is_priced_by_their_own_sizes_against_the_engines_mean() {
    let ahead = |waiting: u64, engine: Option<u64>, routed: u64, mean: u64| {
        let decision = Case::timed()
            .owner(waiting, 32)
            .with(|w| {
                w.prefill.uncached_per_request = engine;
                w.prefill.waiting_routed_tokens = Some(routed);
                w.prefill.routed_per_request = Some(mean);
            })
            .worker(Some(0))
            .routed();
        (
            prediction_of(&decision, 0).prediction.ahead_tokens,
            pick_of(&decision),
        )
    };
    // 4 waiting at the engine's 10k mean would be 40k and divert; the four were routed as 1k each
    // where requests run 10k as routed, so they are 4k and the owner keeps the request.
    assert_eq!(
        ahead(4, Some(10_000), 4_000, 10_000),
        (4_000, (0, Reason::CacheHit))
    );
    // One long prompt behind a count of one: priced at its size, not the mean, and diverted.
    assert_eq!(
        ahead(1, Some(1_000), 60_000, 1_000),
        (60_000, (1, Reason::CacheWorkerQueued))
    );
    // The engine computes twice what the picker predicted (it evicted what the index credits):
    // the routed sizes count double.
    assert_eq!(ahead(4, Some(20_000), 40_000, 10_000).0, 80_000);
    // Nothing learned from the engine: the routed sizes as they are.
    assert_eq!(ahead(4, None, 4_000, 1_000).0, 4_000);
    // Every routed request predicted a full hit: the engine's mean per waiting request.
    assert_eq!(ahead(2, Some(3_000), 0, 0).0, 6_000);
}

#[test]
fn this_picker_s_dispatches_since_the_reading_join_the_queue() {
    let decision = Case::timed()
        .owner(0, 32)
        .dispatched(3)
        .dispatched_tokens(30_000)
        .worker(Some(0))
        .routed();
    let owner = prediction_of(&decision, 0).prediction;
    assert_eq!(
        (owner.ahead_tokens, owner.dispatched_tokens),
        (30_000, 30_000)
    );
    assert_eq!(pick_of(&decision), (1, Reason::CacheWorkerQueued));
}

#[test]
fn a_cache_miss_goes_to_the_sampled_worker_predicted_soonest() {
    // No owner: both workers are sampled (k = 2), the one with fewer tokens ahead wins even though
    // more requests wait there.
    let decision = Case::timed()
        .worker(Some(1))
        .uncached(30_000)
        .worker(Some(6))
        .uncached(600)
        .routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheMiss));
}

#[test]
fn the_request_unit_is_untouched_by_learned_rates() {
    // The same fleet under limit 4: learned numbers change nothing, and nothing is predicted.
    let decision = Case::gated()
        .owner(3, 32)
        .uncached(90_000)
        .with(|w| w.prefill.drain_tokens_per_second = Some(1_000))
        .worker(Some(0))
        .routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    assert!(decision.trace.predictions.is_empty());
}

impl Case {
    /// The last added worker holds `used` of `total` KV tokens in running requests.
    fn kv(self, used: u64, total: u64) -> Self {
        self.with(|w| {
            w.capacity.max_total_tokens = Some(total);
            w.reading.as_mut().unwrap().load.used_tokens = Some(used);
        })
    }
}

#[test]
fn hard_admission_is_the_request_unit_s_alone() {
    // The owner's KV cache is 9,000 of 10,000 tokens full; the cold worker's 8,500.
    let fleet = |case: Case| {
        case.owner(0, 24)
            .kv(9_000, 10_000)
            .worker(Some(0))
            .kv(8_500, 10_000)
    };
    let decision = fleet(Case::timed()).routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    assert_eq!(decision.trace.owners[0].admission, Admission::Unchecked);
    // The request unit charges the whole prompt, as the seed does: the owner is KV-full there.
    let seed = fleet(Case::gated()).routed();
    assert_eq!(
        seed.trace.owners[0].admission,
        Admission::KvFull {
            used_tokens: 9_000,
            request_tokens: 2_048,
            max_total_tokens: 10_000
        }
    );
    assert_ne!(seed.reason, Reason::CacheHit);
}

#[test]
fn a_fleet_out_of_kv_keeps_the_request_on_the_owner_rather_than_a_cold_worker() {
    // Every worker near full of KV and queued past the floor: nobody starts soon, so the pin keeps the
    // request where 24 of its 32 blocks are, not on a worker that must compute and hold all of them.
    let decision = Case::timed()
        .owner(1, 24)
        .uncached(40_000)
        .kv(9_400, 10_000)
        .queued(20_000)
        .kv(9_000, 10_000)
        .queued(30_000)
        .kv(9_000, 10_000)
        .routed();
    assert_eq!(pick_of(&decision), (0, Reason::SaturationPin));
    assert_eq!(decision.trace.owners[0].admission, Admission::Unchecked);
}

#[test]
fn an_owner_without_room_or_a_free_slot_keeps_its_request_for_its_engine_to_queue() {
    // Short of KV room even for the part of the prompt it lacks: no veto, the engine queues it.
    let short_of_room = Case::timed()
        .owner(0, 24)
        .kv(9_600, 10_000)
        .worker(Some(0))
        .routed();
    assert_eq!(pick_of(&short_of_room), (0, Reason::CacheHit));
    assert_eq!(
        short_of_room.trace.owners[0].admission,
        Admission::Unchecked
    );
    // Every running slot taken: the same. The request unit still turns this owner away
    // (`a_full_running_batch_fails_hard_admission`).
    let slots_full = Case::timed()
        .owner(0, 24)
        .running(8)
        .with(|w| w.capacity.max_running = Some(8))
        .worker(Some(0))
        .routed();
    assert_eq!(pick_of(&slots_full), (0, Reason::CacheHit));
    // A queued owner is still judged by its predicted wait: the gate diverts what waits too long.
    let queued = Case::timed()
        .owner(1, 24)
        .uncached(100_000)
        .kv(9_600, 10_000)
        .worker(Some(0))
        .routed();
    assert_eq!(pick_of(&queued), (1, Reason::CacheWorkerQueued));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_time_pin_never_fires_while_a_fleet_worker_can_start_within_the_floor(case in arbitrary_case()) {
        let Some(floor) = case.config.cache_aware().and_then(|k| k.wait().copied()).and_then(|w| w.floor) else {
            return Ok(());
        };
        let floor_us = floor.as_micros() as u64;
        if let Outcome::Route(decision) = case.decide() {
            let soon = decision.trace.predictions.iter().any(|p| p.prediction.queue_us < floor_us);
            if soon {
                prop_assert_ne!(decision.reason, Reason::SaturationPin);
            }
            if decision.reason == Reason::SaturationPin {
                let owner = decision.trace.owners.iter().find(|o| o.worker == decision.selected);
                prop_assert!(owner.is_some_and(|o| o.gate.turns_away() && o.admission.admits()));
            }
            if decision.reason == Reason::CacheWorkerQueued {
                // A diversion happens only where it is predicted to pay by more than the margin.
                let margin = case.config.cache_aware().and_then(|k| k.wait().copied()).unwrap().divert_margin;
                let chosen = decision.trace.predictions.iter().find(|p| p.worker == decision.selected);
                for owner in &decision.trace.owners {
                    if let (Gate::Later { ttft_us, .. }, Some(chosen)) = (owner.gate, chosen) {
                        prop_assert!(chosen.ttft_us + (margin.as_micros() as u64) < ttft_us);
                    }
                }
            }
        }
    }
}

#[test]
fn before_any_rate_is_learned_a_miss_goes_to_the_least_work_not_the_fewest_requests() {
    // No rate anywhere. Worker 0 runs one request, a 30k-token prefill under way (vLLM's counters);
    // worker 1 runs three decodes. By requests worker 0 is the lighter; by the tokens to compute
    // before this request's first token (15k on average ahead of it against none) worker 1 is.
    let case = Case::new(timed(500, Some(1000), None))
        .worker(Some(0))
        .running(1)
        .with(|w| w.prefill.prefilling_tokens = Some(30_000))
        .worker(Some(0))
        .running(3)
        .choices(64);
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheMiss));
    assert!(decision.trace.predictions.is_empty(), "nothing is priced");
    // The request unit, on the same readings, takes the fewest requests.
    let mut counted = case;
    counted.config = Case::gated().config;
    assert_eq!(counted.choices(64).pick(), (0, Reason::CacheMiss));
}

#[test]
fn the_own_prefill_is_priced_at_the_measured_rate_and_a_queue_at_its_drain() {
    // Worker 0 owns the prompt and has 8,000 uncached tokens waiting: its engine times a prefill at
    // 50k tokens/s, but its queue drains at 4k tokens/s (its sequence slots busy decoding). Worker 1 is
    // idle and has measured nothing yet; it borrows the fleet's measured rate.
    let decision = Case::timed()
        .owner(2, 32)
        .uncached(8_000)
        .with(|w| {
            w.prefill.prefill_tokens_per_second = Some(50_000);
            w.prefill.drain_tokens_per_second = Some(4_000);
        })
        .worker(Some(0))
        .routed();
    let owner = prediction_of(&decision, 0).prediction;
    assert_eq!(
        (owner.queue_rate, owner.queue_rate_source, owner.queue_us),
        (4_000, RateSource::Drain, 2_000_000)
    );
    assert_eq!(
        (owner.rate, owner.rate_source, owner.prefill_us),
        (50_000, RateSource::Measured, 0)
    );
    let idle = prediction_of(&decision, 1).prediction;
    assert_eq!(
        (idle.rate, idle.rate_source, idle.queue_rate_source),
        (50_000, RateSource::Pool, RateSource::Pool)
    );
    // 2 s of queue against 41 ms cold: worth the diversion.
    assert_eq!(pick_of(&decision), (1, Reason::CacheWorkerQueued));
    // With nothing waiting, the work ahead is prefill: priced at the measured rate.
    let calm = Case::timed()
        .owner(0, 32)
        .with(|w| {
            w.prefill.prefill_tokens_per_second = Some(50_000);
            w.prefill.drain_tokens_per_second = Some(4_000);
        })
        .dispatched_tokens(8_000)
        .routed();
    let owner = prediction_of(&calm, 0).prediction;
    assert_eq!(
        (owner.queue_rate_source, owner.queue_us),
        (RateSource::Measured, 160_000)
    );
}

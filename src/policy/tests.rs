//! The ladder as tables of plain data. Unless a test says otherwise the gate has limit 4 and floor 2,
//! `min_match_tokens` is 1024 and blocks are 64 tokens.
#![allow(clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::*;
use crate::config::{
    BalanceKnobs, CacheAwareKnobs, DepthRatio, Gating, Mode, PolicyConfig, QueueGate, RelThreshold,
    WaitGate,
};
use crate::load::{
    Capacity, DispatchCounts, EngineLoad, Lifecycle, PoolSnapshot, Reading, TokenDispatches,
    WorkerState,
};
use crate::worker::{Role, WorkerId};

mod pd;
mod wait;

const BLOCK: u64 = 64;
const FRESHNESS: Duration = Duration::from_secs(3);

fn gate(limit: u64, floor: Option<u64>) -> Option<QueueGate> {
    QueueGate::new(
        NonZeroU64::new(limit).unwrap(),
        floor.map(|f| NonZeroU64::new(f).unwrap()),
    )
}

fn config(limit: Option<u64>, floor: Option<u64>) -> PolicyConfig {
    PolicyConfig {
        mode: Mode::CacheAware(CacheAwareKnobs::with_gating(Gating::Requests(
            limit.and_then(|limit| gate(limit, floor)),
        ))),
        ..PolicyConfig::default()
    }
}

/// One scenario: a pool of workers, what the owner index says, and the knobs.
#[derive(Debug)]
struct Case {
    workers: Vec<WorkerState>,
    owners: Vec<OwnerMatch>,
    /// Requests and their uncached tokens sent to each worker since its reading.
    dispatches: Vec<(u64, u64)>,
    /// The pool's number of the last off-owner placement each worker took (0 for none).
    cold: Vec<u64>,
    config: PolicyConfig,
    prompt_tokens: u64,
    allowed: Option<Vec<WorkerId>>,
    now: Instant,
    seed: u64,
    /// The request's number in the pool's sequence (round robin).
    sequence: u64,
}

impl Case {
    fn new(config: PolicyConfig) -> Self {
        Case {
            workers: Vec::new(),
            owners: Vec::new(),
            dispatches: Vec::new(),
            cold: Vec::new(),
            config,
            prompt_tokens: 2048,
            allowed: None,
            now: Instant::now() + Duration::from_secs(60),
            seed: 7,
            sequence: 0,
        }
    }

    /// The default knobs: limit 4, floor 2.
    fn gated() -> Self {
        Case::new(config(Some(4), Some(2)))
    }

    /// Adds a prefill+decode worker with a fresh reading of `waiting` queued requests, or none.
    fn worker(mut self, waiting: Option<u64>) -> Self {
        let id = WorkerId(self.workers.len() as u32);
        let endpoint = SocketAddr::from(([127, 0, 0, 1], 18000 + id.0 as u16));
        let mut state = WorkerState::new(id, endpoint, Role::Both);
        state.reading = waiting.map(|waiting| Reading {
            captured_at: self.now - Duration::from_millis(500),
            complete: true,
            load: EngineLoad {
                waiting,
                ..EngineLoad::default()
            },
        });
        self.workers.push(state);
        self.dispatches.push((0, 0));
        self.cold.push(0);
        self
    }

    /// The last added worker took the pool's `number`th off-owner placement last.
    fn cold(mut self, number: u64) -> Self {
        *self.cold.last_mut().unwrap() = number;
        self
    }

    /// Changes the last added worker.
    fn with(mut self, change: impl FnOnce(&mut WorkerState)) -> Self {
        change(self.workers.last_mut().unwrap());
        self
    }

    /// Changes the last added worker's reading.
    fn reading(self, change: impl FnOnce(&mut Reading)) -> Self {
        self.with(|w| change(w.reading.as_mut().unwrap()))
    }

    fn running(self, running: u64) -> Self {
        self.reading(|r| r.load.running = running)
    }

    fn uncached(self, tokens: u64) -> Self {
        self.reading(|r| r.load.waiting_uncached_tokens = Some(tokens))
    }

    /// The last added worker's reading is older than the freshness window.
    fn stale(self) -> Self {
        self.reading(|r| r.captured_at -= FRESHNESS)
    }

    fn kv_full(self) -> Self {
        self.with(|w| {
            w.capacity.max_total_tokens = Some(10_000);
            w.reading.as_mut().unwrap().load.used_tokens = Some(9_999);
        })
    }

    /// The last added worker holds `blocks` leading blocks of the prompt.
    fn owns(mut self, blocks: u64) -> Self {
        let worker = self.workers.last().unwrap().id;
        self.owners.push(OwnerMatch {
            worker,
            matched_tokens: blocks * BLOCK,
        });
        self
    }

    /// Adds a worker with `waiting` queued requests that holds `blocks` leading blocks of the prompt.
    fn owner(self, waiting: u64, blocks: u64) -> Self {
        self.worker(Some(waiting)).owns(blocks)
    }

    /// Changes the cache-aware knobs.
    fn knobs(mut self, change: impl FnOnce(&mut CacheAwareKnobs)) -> Self {
        change(self.config.cache_aware_mut().unwrap());
        self
    }

    /// Samples `k` workers off-owner.
    fn choices(self, k: usize) -> Self {
        self.knobs(|knobs| knobs.min_load_choices = NonZeroUsize::new(k).unwrap())
    }

    fn dispatched(mut self, count: u64) -> Self {
        self.dispatches.last_mut().unwrap().0 = count;
        self
    }

    /// The last added worker was sent `tokens` uncached tokens since its reading.
    fn dispatched_tokens(mut self, tokens: u64) -> Self {
        self.dispatches.last_mut().unwrap().1 = tokens;
        self
    }

    fn decide(&self) -> Outcome {
        let mut rng = SmallRng::seed_from_u64(self.seed);
        self.decide_with(&mut rng)
    }

    fn decide_with(&self, rng: &mut SmallRng) -> Outcome {
        let snapshot = PoolSnapshot::new(42, FRESHNESS, self.workers.clone());
        let dispatches = Counts {
            dispatches: TokenDispatches(&self.dispatches),
            cold: &self.cold,
        };
        let load = LoadView {
            snapshot: &snapshot,
            dispatches: &dispatches,
            now: self.now,
        };
        let request = RequestFacts {
            prompt_tokens: self.prompt_tokens,
            allowed: self.allowed.as_deref(),
            sequence: self.sequence,
        };
        decide(&request, &self.owners, &load, &self.config, rng)
    }

    fn routed(&self) -> Decision {
        match self.decide() {
            Outcome::Route(decision) => decision,
            Outcome::Refuse(refused) => panic!("expected a route, got {refused:?}"),
        }
    }

    /// (selected worker index, reason)
    fn pick(&self) -> (u32, Reason) {
        pick_of(&self.routed())
    }
}

/// A case's dispatches, with the last off-owner placement of each worker.
struct Counts<'a> {
    dispatches: TokenDispatches<'a>,
    cold: &'a [u64],
}

impl DispatchCounts for Counts<'_> {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.dispatches.since_reading(id)
    }

    fn uncached_since_reading(&self, id: WorkerId) -> u64 {
        self.dispatches.uncached_since_reading(id)
    }

    fn last_cold(&self, id: WorkerId) -> u64 {
        self.cold.get(id.index()).copied().unwrap_or(0)
    }
}

/// (selected worker index, reason)
fn pick_of(decision: &Decision) -> (u32, Reason) {
    (decision.selected.0, decision.reason)
}

fn no_workers(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Refuse(Refused {
            reason: RefuseReason::NoWorkers,
            ..
        })
    )
}

// === the queue gate ===

#[test]
fn an_owner_at_the_limit_is_passed_over_for_an_idle_worker() {
    let case = Case::gated().owner(4, 32).worker(Some(0));
    assert_eq!(case.pick(), (1, Reason::CacheWorkerQueued));
    assert_eq!(case.routed().diverted_tokens(), Some(32 * BLOCK));
}

#[test]
fn an_owner_one_below_the_limit_keeps_the_request() {
    let case = Case::gated().owner(3, 32).worker(Some(0));
    assert_eq!(case.pick(), (0, Reason::CacheHit));
}

#[test]
fn without_a_limit_the_deepest_owner_wins_even_at_waiting_40() {
    let case = Case::new(config(None, None))
        .owner(40, 32)
        .owner(0, 20)
        .worker(Some(0));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheHit));
    assert_eq!(decision.trace.owners[0].gate, Gate::Off);
}

#[test]
fn an_owner_without_a_fresh_reading_passes_the_gate() {
    let unread = Case::gated().worker(None).owns(32).worker(Some(0));
    assert_eq!(unread.pick(), (0, Reason::CacheHit));

    let stale = Case::gated().owner(9, 32).stale().worker(Some(0));
    assert_eq!(stale.pick(), (0, Reason::CacheHit));

    let missing_rank = Case::gated()
        .owner(9, 32)
        .reading(|r| r.complete = false)
        .worker(Some(0));
    assert_eq!(missing_rank.pick(), (0, Reason::CacheHit));
    assert_eq!(missing_rank.routed().trace.owners[0].gate, Gate::Unread);
}

#[test]
fn a_reading_exactly_as_old_as_the_freshness_window_is_stale() {
    let case = Case::gated()
        .owner(9, 32)
        .reading(|r| r.captured_at -= FRESHNESS - Duration::from_millis(500))
        .worker(Some(0));
    assert_eq!(case.pick(), (0, Reason::CacheHit));
}

#[test]
fn the_deepest_admitted_owner_wins_and_shallower_owners_follow_as_fallbacks() {
    let case = Case::gated()
        .owner(1, 20)
        .owner(4, 40)
        .owner(3, 30)
        .worker(Some(0));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (2, Reason::CacheHit));
    assert_eq!(
        decision.fallbacks,
        vec![WorkerId(0), WorkerId(3)],
        "then the idle worker"
    );
    assert_eq!(decision.matched_tokens, 30 * BLOCK);
}

#[test]
fn equally_deep_owners_are_ordered_by_pressure_then_id() {
    let case = Case::gated().owner(2, 32).owner(1, 32).owner(1, 32);
    let decision = case.routed();
    assert_eq!(decision.selected, WorkerId(1));
    assert_eq!(decision.fallbacks, vec![WorkerId(2), WorkerId(0)]);
    assert_eq!(decision.trace.pressure, Some(PressureSource::Queue));
}

#[test]
fn uncached_tokens_order_owners_when_every_compared_owner_reports_them() {
    let both = Case::gated()
        .worker(Some(1))
        .uncached(100)
        .owns(32)
        .worker(Some(3))
        .uncached(10)
        .owns(32);
    assert_eq!(both.pick(), (1, Reason::CacheHit));
    assert_eq!(
        both.routed().trace.pressure,
        Some(PressureSource::UncachedTokens)
    );

    // One owner lacks the measure: the set falls back to the queue both have.
    let one = Case::gated()
        .owner(1, 32)
        .worker(Some(3))
        .uncached(10)
        .owns(32);
    assert_eq!(one.pick(), (0, Reason::CacheHit));
    assert_eq!(one.routed().trace.pressure, Some(PressureSource::Queue));
}

#[test]
fn owners_without_readings_are_compared_on_router_local_dispatches() {
    let case = Case::gated()
        .worker(None)
        .owns(32)
        .dispatched(5)
        .owner(0, 32)
        .dispatched(1);
    let decision = case.routed();
    assert_eq!(decision.selected, WorkerId(1));
    assert_eq!(decision.trace.pressure, Some(PressureSource::RouterLocal));
}

#[test]
fn a_worker_holding_fewer_than_min_match_tokens_is_not_an_owner() {
    // 15 blocks = 960 tokens < 1024.
    let case = Case::gated().owner(0, 15).worker(Some(0)).dispatched(0);
    let decision = case.routed();
    assert_eq!(decision.reason, Reason::CacheMiss);
    assert!(decision.trace.owners.is_empty());
    assert_eq!(decision.trace.ignored_matches, 1);

    // 16 blocks = 1024 tokens counts.
    let case = Case::gated().owner(1, 16).worker(Some(0));
    assert_eq!(case.pick(), (0, Reason::CacheHit));
}

#[test]
fn dispatches_since_the_last_reading_add_to_load_but_never_to_the_queue() {
    // The owner's queue stays below the limit however much was dispatched to it.
    let owner = Case::gated().owner(3, 32).dispatched(100).worker(Some(0));
    assert_eq!(owner.pick(), (0, Reason::CacheHit));

    // Off-owner, the dispatch count steers away from the worker that just received a burst.
    let off = Case::gated()
        .choices(8)
        .owner(4, 32)
        .worker(Some(0))
        .dispatched(3)
        .worker(Some(1));
    let decision = off.routed();
    assert_eq!(pick_of(&decision), (2, Reason::CacheWorkerQueued));
    assert_eq!(decision.fallbacks, vec![WorkerId(1), WorkerId(0)]);
}

// === the saturation pin ===

#[test]
fn queued_owners_pin_to_the_calmer_one_when_no_worker_is_below_the_floor() {
    let case = Case::gated().owner(9, 32).owner(5, 32).worker(Some(3));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::SaturationPin));
    assert_eq!(decision.fallbacks, vec![WorkerId(0), WorkerId(2)]);
    assert_eq!(
        decision.trace.saturation,
        Saturation::Saturated { threshold: 2 }
    );
    assert_eq!(decision.diverted_tokens(), None);
}

#[test]
fn the_gate_and_the_floor_are_per_data_parallel_rank() {
    // Nine waiting on a worker of four ranks is about two a rank: under the limit of 4 a rank, so it
    // is still an owner worth its queue, where one rank with nine waiting is passed over.
    let wide = Case::gated()
        .owner(9, 32)
        .with(|w| w.ranks = 4)
        .owner(9, 32);
    assert_eq!(pick_of(&wide.routed()), (0, Reason::CacheHit));
    let narrow = Case::gated().owner(9, 32).owner(5, 32).worker(Some(3));
    assert_eq!(pick_of(&narrow.routed()), (1, Reason::SaturationPin));
    // The floor scales alike: seven waiting on four ranks is below 2 × 4, so the fleet is not saturated
    // and the request is diverted there, not pinned.
    let relieved = Case::gated()
        .owner(9, 32)
        .owner(5, 32)
        .worker(Some(7))
        .with(|w| w.ranks = 4);
    let decision = relieved.routed();
    assert_eq!(pick_of(&decision), (2, Reason::CacheWorkerQueued));
    assert_eq!(
        decision.trace.saturation,
        Saturation::Relieved {
            witness: WorkerId(2),
            waiting: 7,
            threshold: 8
        }
    );
}

#[test]
fn an_idle_worker_below_the_floor_cancels_the_pin() {
    let case = Case::gated().owner(9, 32).owner(5, 32).worker(Some(0));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (2, Reason::CacheWorkerQueued));
    assert_eq!(
        decision.trace.saturation,
        Saturation::Relieved {
            witness: WorkerId(2),
            waiting: 0,
            threshold: 2
        }
    );
}

#[test]
fn the_floor_boundary_is_strict() {
    // A worker at exactly the floor is not evidence of idleness.
    let at_floor = Case::gated().owner(6, 32).worker(Some(2));
    assert_eq!(at_floor.pick(), (0, Reason::SaturationPin));
    let below = Case::gated().owner(6, 32).worker(Some(1));
    assert_eq!(below.pick(), (1, Reason::CacheWorkerQueued));
}

#[test]
fn the_depth_ratio_keeps_the_pin_on_the_deep_owner() {
    // Depths of 100, 20 and 10 blocks; the shallower, the less pressured.
    let case = |ratio: f64| {
        Case::gated()
            .knobs(|k| {
                k.pin_depth_ratio = DepthRatio::new(ratio).unwrap();
                k.min_match_tokens = BLOCK;
            })
            .owner(9, 100)
            .owner(5, 20)
            .owner(4, 10)
            .worker(Some(3))
    };
    assert_eq!(case(0.5).pick(), (0, Reason::SaturationPin));
    assert_eq!(case(0.0).pick(), (2, Reason::SaturationPin));
    // 0.2 admits the 20-block owner (20 >= 0.2 * 100) but not the 10-block one.
    assert_eq!(case(0.2).pick(), (1, Reason::SaturationPin));
}

#[test]
fn a_fleet_worker_without_a_fresh_reading_does_not_block_the_pin() {
    let unread = Case::gated().owner(9, 32).worker(None);
    assert_eq!(unread.pick(), (0, Reason::SaturationPin));

    let stale = Case::gated().owner(9, 32).worker(Some(0)).stale();
    assert_eq!(stale.pick(), (0, Reason::SaturationPin));
}

#[test]
fn workers_outside_the_fleet_do_not_block_the_pin() {
    let decode_only = Case::gated()
        .owner(9, 32)
        .worker(Some(0))
        .with(|w| w.role = Role::Decode);
    assert_eq!(decode_only.pick(), (0, Reason::SaturationPin));

    let removed = Case::gated()
        .owner(9, 32)
        .worker(Some(0))
        .with(|w| w.lifecycle = Lifecycle::Draining);
    assert_eq!(removed.pick(), (0, Reason::SaturationPin));

    let mut outside_subset = Case::gated().owner(9, 32).worker(Some(6)).worker(Some(0));
    outside_subset.allowed = Some(vec![WorkerId(0), WorkerId(1)]);
    assert_eq!(outside_subset.pick(), (0, Reason::SaturationPin));

    // Another pool's idle worker cannot veto either: a decision reads only its own pool's snapshot, so
    // there is no way to pass it one (`decide` takes a single `PoolSnapshot`).
}

#[test]
fn the_pin_skips_an_owner_whose_kv_cache_is_full() {
    let case = Case::gated()
        .owner(5, 32)
        .kv_full()
        .owner(9, 32)
        .worker(Some(3));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::SaturationPin));
    assert_eq!(
        decision.fallbacks,
        vec![WorkerId(2), WorkerId(0)],
        "the KV-full owner comes last"
    );
    assert!(matches!(
        decision.trace.owners[0].admission,
        Admission::KvFull { .. }
    ));
    assert_eq!(decision.trace.owners[0].gate, Gate::Queued { waiting: 5 });
}

#[test]
fn a_saturated_fleet_whose_owners_are_all_kv_full_still_routes_and_says_why() {
    let case = Case::gated()
        .owner(5, 32)
        .kv_full()
        .owner(9, 32)
        .kv_full()
        .worker(Some(3))
        .worker(Some(6));
    let decision = case.routed();
    // The floor voided the gate and the owners had no room: the saturation signal survives the detour.
    assert_eq!(decision.reason, Reason::AllQueued);
    assert_eq!(
        decision.trace.saturation,
        Saturation::Saturated { threshold: 2 }
    );
    assert_eq!(decision.trace.rung, Rung::OffOwnerGateAndAdmission);
    assert_eq!(
        decision.selected,
        WorkerId(2),
        "the only worker below the limit"
    );
    assert_eq!(decision.diverted_tokens(), None);
}

#[test]
fn when_nobody_passes_hard_admission_the_least_pressured_worker_takes_the_request() {
    let fleet = |owner_waiting: u64| {
        Case::gated()
            .owner(owner_waiting, 32)
            .kv_full()
            .worker(Some(1))
            .kv_full()
            .worker(Some(2))
            .kv_full()
    };
    // The owner is queued and a worker is below the floor: a queue diversion, whatever capacity says.
    let queued = fleet(5).routed();
    assert_eq!(pick_of(&queued), (1, Reason::CacheWorkerQueued));
    assert_eq!(queued.trace.rung, Rung::LeastPressured);
    assert_eq!(queued.fallbacks, vec![WorkerId(2), WorkerId(0)]);

    // The owner's queue is short; only its KV cache kept the request away.
    let full = fleet(0).routed();
    assert_eq!(pick_of(&full), (0, Reason::CapacityFallback));
    assert_eq!(full.trace.rung, Rung::LeastPressured);
}

#[test]
fn a_full_running_batch_fails_hard_admission() {
    let case = Case::gated()
        .owner(0, 32)
        .running(8)
        .with(|w| w.capacity.max_running = Some(8))
        .worker(Some(0));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::CapacityFallback));
    assert_eq!(
        decision.trace.owners[0].admission,
        Admission::RunningFull {
            running: 8,
            max_running: 8
        }
    );
}

#[test]
fn the_floor_replaces_the_all_queued_rung_when_every_worker_is_at_the_limit() {
    // Deep owner busier than the shallow one: the pin (pressure, ratio 0) and all_queued (deepest)
    // disagree; with a floor set the pin decides.
    let case = Case::gated()
        .knobs(|k| k.pin_depth_ratio = DepthRatio::ZERO)
        .owner(9, 40)
        .owner(5, 20)
        .worker(Some(4));
    assert_eq!(case.pick(), (1, Reason::SaturationPin));
}

#[test]
fn an_off_owner_pick_that_lands_on_a_queued_owner_is_not_a_diversion() {
    // No worker passes both the gate and admission: the idle one is KV-full. Among those with room the
    // queued owner is the least loaded, so the request stays with it.
    let case = Case::gated()
        .owner(5, 32)
        .worker(Some(0))
        .kv_full()
        .worker(Some(9));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (0, Reason::AllQueued));
    assert_eq!(decision.trace.rung, Rung::OffOwnerAdmission);
    assert_eq!(decision.diverted_tokens(), None);
}

#[test]
fn load_counts_running_requests_as_well_as_waiting_ones() {
    let case = Case::gated()
        .choices(8)
        .worker(Some(1))
        .running(9)
        .worker(Some(2))
        .running(1);
    assert_eq!(case.pick(), (1, Reason::CacheMiss));
}

#[test]
fn pressure_counts_running_requests_when_queues_tie() {
    let case = Case::gated()
        .worker(Some(2))
        .running(7)
        .owns(32)
        .worker(Some(2))
        .running(3)
        .owns(32);
    assert_eq!(case.pick(), (1, Reason::CacheHit));
}

#[test]
fn extreme_readings_and_counts_never_overflow() {
    let mut case = Case::gated();
    for i in 0..64_u64 {
        case = case
            .worker(Some(u64::MAX - i))
            .running(u64::MAX)
            .uncached(u64::MAX)
            .dispatched(u64::MAX)
            .with(|w| {
                w.capacity = Capacity {
                    engine_block: None,
                    max_running: Some(u64::MAX),
                    max_total_tokens: Some(u64::MAX),
                };
                w.reading.as_mut().unwrap().load.used_tokens = Some(u64::MAX);
            })
            .owns(u64::MAX / BLOCK);
    }
    case.prompt_tokens = u64::MAX;
    case.config.max_fallbacks = usize::MAX;
    let decision = case.routed();
    assert_eq!(decision.fallbacks.len(), PolicyConfig::MAX_FALLBACKS_LIMIT);
}

// === all queued, no floor ===

#[test]
fn without_a_floor_a_fleet_queued_everywhere_readmits_the_deepest_owner() {
    let case = Case::new(config(Some(4), None))
        .owner(9, 40)
        .owner(5, 20)
        .worker(Some(4));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (0, Reason::AllQueued));
    assert_eq!(decision.fallbacks, vec![WorkerId(1), WorkerId(2)]);
}

#[test]
fn without_a_floor_one_unread_worker_means_the_fleet_is_not_all_queued() {
    let case = Case::new(config(Some(4), None)).owner(9, 40).worker(None);
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::CacheWorkerQueued));
    assert_eq!(
        decision.trace.saturation,
        Saturation::Unread {
            witness: WorkerId(1),
            threshold: 4
        }
    );
}

#[test]
fn without_a_floor_a_worker_below_the_limit_takes_the_diverted_request() {
    let case = Case::new(config(Some(4), None))
        .owner(9, 40)
        .worker(Some(3));
    assert_eq!(case.pick(), (1, Reason::CacheWorkerQueued));
}

// === off-owner sampling ===

fn off_owner_case(k: usize, seed: u64) -> Case {
    let mut case = Case::gated().choices(k);
    for waiting in [3, 1, 0, 2, 3, 1] {
        case = case.worker(Some(waiting));
    }
    case.seed = seed;
    case
}

#[test]
fn k_at_least_the_fleet_size_picks_the_exact_minimum() {
    for seed in 0..20 {
        let decision = off_owner_case(6, seed).routed();
        assert_eq!(pick_of(&decision), (2, Reason::CacheMiss));
        assert_eq!(decision.fallbacks, vec![WorkerId(1), WorkerId(5)]);
        assert_eq!(decision.trace.sampled.len(), 6);
    }
    assert_eq!(off_owner_case(64, 3).pick(), (2, Reason::CacheMiss));
}

#[test]
fn k_of_one_draws_uniformly_and_sometimes_misses_the_minimum() {
    let case = off_owner_case(1, 0);
    let mut rng = SmallRng::seed_from_u64(11);
    let mut seen = [0_u32; 6];
    for _ in 0..600 {
        let decision = match case.decide_with(&mut rng) {
            Outcome::Route(decision) => decision,
            Outcome::Refuse(refused) => panic!("{refused:?}"),
        };
        assert_eq!(
            decision.fallbacks.len(),
            2,
            "retries go to the next best workers"
        );
        assert!(!decision.fallbacks.contains(&decision.selected));
        seen[decision.selected.index()] += 1;
    }
    assert!(
        seen.iter().all(|count| *count > 50),
        "every worker drawn: {seen:?}"
    );
}

#[test]
fn the_same_seed_gives_the_same_decision() {
    let a = off_owner_case(2, 99).routed();
    let b = off_owner_case(2, 99).routed();
    assert_eq!(a, b);
}

#[test]
fn when_no_worker_passes_the_gate_the_sample_comes_from_those_passing_admission() {
    let case = Case::new(config(Some(4), None))
        .worker(Some(7))
        .worker(Some(5))
        .kv_full()
        .worker(Some(6));
    let decision = case.routed();
    assert_eq!(decision.trace.rung, Rung::OffOwnerAdmission);
    assert_eq!(pick_of(&decision), (2, Reason::CacheMiss));
}

// === refusal ===

#[test]
fn an_empty_fleet_is_refused_with_a_reason() {
    let nobody = Case::gated();
    assert!(no_workers(&nobody.decide()));

    let decode_only = Case::gated()
        .worker(Some(0))
        .with(|w| w.role = Role::Decode);
    assert!(no_workers(&decode_only.decide()));

    let mut outside = Case::gated().owner(0, 32);
    outside.allowed = Some(vec![WorkerId(5)]);
    let outcome = outside.decide();
    assert!(no_workers(&outcome));
    assert_eq!(outcome.trace().fleet, 0);
}

#[test]
fn matches_for_unknown_workers_are_ignored() {
    let mut case = Case::gated().worker(Some(0));
    case.owners.push(OwnerMatch {
        worker: WorkerId(9),
        matched_tokens: 4096,
    });
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (0, Reason::CacheMiss));
    assert_eq!(decision.trace.ignored_matches, 1);
}

// === round_robin ===

fn mode(mode: Mode) -> PolicyConfig {
    PolicyConfig {
        mode,
        ..PolicyConfig::default()
    }
}

fn balance(abs: u64, rel: f64, cache: f64) -> PolicyConfig {
    mode(Mode::BalanceThreshold(BalanceKnobs {
        abs_threshold: abs,
        rel_threshold: RelThreshold::new(rel).unwrap(),
        cache_threshold: DepthRatio::new(cache).unwrap(),
    }))
}

impl Case {
    /// (selected, fallbacks) for each request number in `sequences`.
    fn turns(&mut self, sequences: std::ops::Range<u64>) -> Vec<(u32, Vec<u32>)> {
        sequences
            .map(|sequence| {
                self.sequence = sequence;
                let decision = self.routed();
                assert_eq!(decision.reason, Reason::RoundRobin);
                assert_eq!(decision.trace.rung, Rung::RoundRobin);
                assert_eq!(decision.trace.sequence, Some(sequence));
                let fallbacks = decision.fallbacks.iter().map(|id| id.0).collect();
                (decision.selected.0, fallbacks)
            })
            .collect()
    }
}

#[test]
fn round_robin_cycles_through_the_fleet_in_order_whatever_the_load_and_owners() {
    let mut case = Case::new(mode(Mode::RoundRobin))
        .owner(40, 64)
        .worker(Some(0))
        .worker(None)
        .dispatched(9);
    assert_eq!(
        case.turns(0..6),
        [
            (0, vec![1, 2]),
            (1, vec![2, 0]),
            (2, vec![0, 1]),
            (0, vec![1, 2]),
            (1, vec![2, 0]),
            (2, vec![0, 1]),
        ]
    );
    // The turn is the sequence modulo the fleet, however large the sequence.
    assert_eq!(case.turns(u64::MAX..u64::MAX).len(), 0);
    case.sequence = u64::MAX;
    assert_eq!(case.routed().selected, WorkerId((u64::MAX % 3) as u32));
    let decision = case.routed();
    assert!(decision.trace.owners.is_empty());
    assert_eq!(decision.trace.ignored_matches, 1, "owners do not count");
}

#[test]
fn round_robin_skips_workers_outside_the_fleet() {
    let mut case = Case::new(mode(Mode::RoundRobin))
        .worker(Some(0))
        .with(|w| w.role = Role::Decode)
        .worker(Some(0))
        .worker(Some(0))
        .with(|w| w.lifecycle = Lifecycle::Draining)
        .worker(Some(0))
        .with(|w| w.role = Role::Prefill)
        .worker(Some(0))
        .worker(Some(0));
    // Not in the proxy's subset: 4.
    case.allowed = Some(vec![
        WorkerId(0),
        WorkerId(1),
        WorkerId(2),
        WorkerId(3),
        WorkerId(5),
    ]);
    let selected: Vec<u32> = case.turns(0..6).into_iter().map(|(id, _)| id).collect();
    assert_eq!(selected, [1, 3, 5, 1, 3, 5]);
    // Two fallbacks wanted, but a fleet of one has none.
    case.allowed = Some(vec![WorkerId(3)]);
    assert_eq!(case.turns(7..9), [(3, vec![]), (3, vec![])]);
}

// === least_load ===

#[test]
fn least_load_picks_the_fewest_waiting_running_and_dispatched() {
    let case = Case::new(mode(Mode::LeastLoad))
        .worker(Some(2))
        .running(1) // 3
        .worker(Some(0))
        .dispatched(4) // 4
        .worker(Some(1))
        .running(1) // 2
        .owner(9, 64); // 9, the only owner
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (2, Reason::LeastLoad));
    assert_eq!(decision.fallbacks, vec![WorkerId(0), WorkerId(1)]);
    assert_eq!(decision.trace.rung, Rung::LeastLoad);
    assert_eq!(decision.matched_tokens, 0);
    assert!(decision.trace.owners.is_empty());
}

#[test]
fn least_load_counts_dispatches_and_an_unread_worker_by_its_dispatches_alone() {
    // The idle reading is stale by three dispatches.
    let dispatched = Case::new(mode(Mode::LeastLoad))
        .worker(Some(0))
        .dispatched(3)
        .worker(Some(2));
    assert_eq!(dispatched.pick(), (1, Reason::LeastLoad));

    // Nobody has read the second worker: only what this picker sent it counts.
    let unread = Case::new(mode(Mode::LeastLoad))
        .worker(Some(1))
        .running(1)
        .worker(None)
        .dispatched(1);
    assert_eq!(unread.pick(), (1, Reason::LeastLoad));
}

#[test]
fn least_load_draws_among_workers_tied_at_the_minimum() {
    let case = Case::new(mode(Mode::LeastLoad))
        .worker(Some(1))
        .worker(Some(3))
        .worker(Some(1))
        .worker(Some(1))
        .dispatched(1);
    let mut rng = SmallRng::seed_from_u64(5);
    let mut seen = [0_u32; 4];
    for _ in 0..200 {
        let Outcome::Route(decision) = case.decide_with(&mut rng) else {
            panic!("refused")
        };
        seen[decision.selected.index()] += 1;
        // The fallbacks are the next least loaded, by id among equals.
        let expected: Vec<WorkerId> = [0, 2, 3]
            .into_iter()
            .map(WorkerId)
            .filter(|id| *id != decision.selected)
            .collect();
        assert_eq!(decision.fallbacks, expected);
    }
    assert!(seen[0] > 50 && seen[2] > 50, "{seen:?}");
    assert_eq!((seen[1], seen[3]), (0, 0));
}

// === balance_threshold ===

/// Prompts of 2048 tokens: 32 blocks. The default knobs: 64, 1.5, 0.3.
fn balanced() -> Case {
    Case::new(balance(64, 1.5, 0.3))
}

#[test]
fn a_balanced_fleet_goes_to_the_owner_above_the_cache_threshold() {
    // 10 blocks = 640 of 2048 tokens, 0.31.
    let case = balanced().worker(Some(10)).owner(12, 10).worker(Some(11));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::BalancedOwner));
    assert_eq!(decision.trace.rung, Rung::DeepestOwner);
    assert_eq!(decision.fallbacks, vec![WorkerId(0), WorkerId(2)]);
    assert_eq!(decision.matched_tokens, 10 * BLOCK);
    let balance = decision.trace.balance.unwrap();
    assert_eq!(
        (balance.min_load, balance.max_load, balance.imbalanced),
        (10, 12, false)
    );
    assert_eq!(balance.match_ratio, 640.0 / 2048.0);
}

#[test]
fn a_balanced_fleet_goes_to_the_least_loaded_worker_at_or_below_the_threshold() {
    // 9 blocks = 576 of 2048 tokens, 0.28.
    let below = balanced().owner(10, 9).worker(Some(12)).worker(Some(11));
    let decision = below.routed();
    assert_eq!(pick_of(&decision), (0, Reason::BalancedMiss));
    let below = balanced().owner(12, 9).worker(Some(10)).worker(Some(11));
    let decision = below.routed();
    assert_eq!(pick_of(&decision), (1, Reason::BalancedMiss));
    assert_eq!(decision.trace.rung, Rung::LeastLoad);
    assert_eq!(decision.fallbacks, vec![WorkerId(2), WorkerId(0)]);

    // Exactly the threshold is not above it: 30 blocks of 6400 tokens is 0.3.
    let mut at = balanced().owner(5, 30).worker(Some(4));
    at.prompt_tokens = 6400;
    assert_eq!(at.pick(), (1, Reason::BalancedMiss));
    at.owners[0].matched_tokens += 1;
    assert_eq!(at.pick(), (0, Reason::BalancedOwner));

    // No owner at all.
    let none = balanced().worker(Some(3)).worker(Some(2));
    assert_eq!(none.pick(), (1, Reason::BalancedMiss));
    assert_eq!(none.routed().trace.balance.unwrap().match_ratio, 0.0);
}

#[test]
fn an_imbalanced_fleet_goes_to_the_shortest_queue_even_with_an_owner() {
    // max − min = 90 > 64 and 100 > 1.5 × 10.
    let case = balanced().owner(100, 32).worker(Some(10)).worker(Some(50));
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::Imbalanced));
    assert_eq!(decision.fallbacks, vec![WorkerId(2), WorkerId(0)]);
    assert!(decision.trace.balance.unwrap().imbalanced);
    assert_eq!(decision.trace.balance.unwrap().match_ratio, 1.0);

    // Both conditions are needed, and both are strict.
    let spread = |owner: u64, other: u64| balanced().owner(owner, 32).worker(Some(other)).pick();
    assert_eq!(spread(74, 10), (0, Reason::BalancedOwner), "74 − 10 = 64");
    assert_eq!(spread(75, 10), (1, Reason::Imbalanced), "75 − 10 = 65");
    assert_eq!(
        spread(200, 135),
        (0, Reason::BalancedOwner),
        "200 < 1.5 × 135"
    );
    assert_eq!(
        spread(300, 200),
        (0, Reason::BalancedOwner),
        "300 = 1.5 × 200"
    );
    assert_eq!(spread(301, 200), (1, Reason::Imbalanced), "301 > 1.5 × 200");
    assert_eq!(
        spread(65, 0),
        (1, Reason::Imbalanced),
        "anything exceeds 1.5 × 0"
    );
}

#[test]
fn the_balance_thresholds_are_configurable() {
    let case = |config: PolicyConfig| Case::new(config).owner(10, 8).worker(Some(5)).pick();
    // 10 vs 5: balanced by default; 8 blocks are 0.25 of the prompt.
    assert_eq!(case(balance(64, 1.5, 0.3)), (1, Reason::BalancedMiss));
    assert_eq!(case(balance(64, 1.5, 0.2)), (0, Reason::BalancedOwner));
    assert_eq!(case(balance(4, 1.5, 0.2)), (1, Reason::Imbalanced));
    assert_eq!(case(balance(4, 2.0, 0.2)), (0, Reason::BalancedOwner));
}

#[test]
fn load_for_the_balance_counts_dispatches_and_running_requests() {
    // Readings say 0 and 4 + 6 running; eighty requests were just sent to the first: 80 vs 10.
    let case = balanced()
        .owner(0, 32)
        .dispatched(80)
        .worker(Some(4))
        .running(6);
    assert_eq!(case.pick(), (1, Reason::Imbalanced));
    // Seventy would be within the absolute threshold (70 − 10 = 60).
    let mut case = case;
    case.dispatches[0].0 = 70;
    assert_eq!(case.pick(), (0, Reason::BalancedOwner));
}

#[test]
fn equally_deep_owners_are_ordered_by_load_and_other_owners_above_the_threshold_follow() {
    let case = balanced()
        .owner(8, 20)
        .owner(3, 20)
        .owner(1, 12)
        .owner(0, 4);
    let decision = case.routed();
    assert_eq!(pick_of(&decision), (1, Reason::BalancedOwner));
    // Then the other 20-block owner, then the 12-block one (0.375); the 4-block one is below.
    assert_eq!(decision.fallbacks, vec![WorkerId(0), WorkerId(2)]);
    assert_eq!(decision.trace.owners.len(), 4);
}

#[test]
fn balance_threshold_only_sees_owners_and_load_within_the_fleet() {
    // The owner is decode-only, and the idle worker is outside the subset.
    let mut case = balanced()
        .owner(5, 32)
        .with(|w| w.role = Role::Decode)
        .worker(Some(200))
        .worker(Some(0))
        .worker(Some(190));
    case.allowed = Some(vec![WorkerId(0), WorkerId(1), WorkerId(3)]);
    let decision = case.routed();
    assert_eq!(
        pick_of(&decision),
        (3, Reason::BalancedMiss),
        "200 vs 190 is balanced; the owner and the idle worker are not in the fleet"
    );
    assert_eq!(decision.trace.ignored_matches, 1);
    assert_eq!(decision.fallbacks, vec![WorkerId(1)]);
}

#[test]
fn every_mode_refuses_an_empty_fleet() {
    for config in [
        mode(Mode::RoundRobin),
        mode(Mode::LeastLoad),
        balance(64, 1.5, 0.3),
        config(None, None),
    ] {
        let case = Case::new(config)
            .worker(Some(0))
            .with(|w| w.role = Role::Decode);
        let outcome = case.decide();
        assert!(no_workers(&outcome), "{outcome:?}");
    }
}

// === robustness ===

/// A pool of `n` workers with arbitrary readings, capacities, roles and matches.
fn arbitrary_case() -> impl Strategy<Value = Case> {
    let worker = (
        prop::option::of((0_u64..12, 0_u64..12, prop::option::of(0_u64..50_000))),
        prop::option::of(0_u64..20_000),
        prop::option::of(1_u64..16),
        prop::option::of(1_u64..20_000),
        0_u8..8,
        0_u64..200,
        0_u64..8,
    );
    (
        prop::collection::vec(worker, 0..64),
        prop::option::of((1_u64..8, prop::option::of(1_u64..8))),
        1_usize..8,
        0_u64..2048,
        0.0_f64..=1.0,
        0_u64..30_000,
        any::<u64>(),
        prop::option::of(prop::collection::vec(0_u32..70, 0..8)),
        (
            0_u8..5,
            0_u64..20,
            1.01_f64..3.0,
            0.0_f64..=1.0,
            any::<u64>(),
        ),
    )
        .prop_map(
            |(workers, knobs, k, min_match, ratio, prompt, seed, allowed, mode)| {
                let gate =
                    knobs.and_then(|(limit, floor)| gate(limit, floor.filter(|f| *f <= limit)));
                let (mode, abs, rel, cache, sequence) = mode;
                let mode = match mode {
                    0 => Mode::CacheAware(CacheAwareKnobs {
                        gating: Gating::Requests(gate),
                        min_load_choices: NonZeroUsize::new(k).unwrap(),
                        min_match_tokens: min_match,
                        min_match_share: DepthRatio::ZERO,
                        pin_depth_ratio: DepthRatio::new(ratio).unwrap(),
                    }),
                    // The prefill-time unit, its knobs drawn from the same numbers.
                    4 => Mode::CacheAware(CacheAwareKnobs {
                        gating: Gating::PrefillTime(WaitGate {
                            divert_margin: Duration::from_millis(100 * knobs.map_or(0, |k| k.0)),
                            floor: knobs
                                .and_then(|k| k.1)
                                .map(|floor| Duration::from_millis(250 * floor)),
                            fallback_rate: NonZeroU64::new(abs * 1000),
                        }),
                        min_load_choices: NonZeroUsize::new(k).unwrap(),
                        min_match_tokens: min_match,
                        min_match_share: DepthRatio::new(cache).unwrap(),
                        pin_depth_ratio: DepthRatio::new(ratio).unwrap(),
                    }),
                    1 => Mode::RoundRobin,
                    2 => Mode::LeastLoad,
                    _ => Mode::BalanceThreshold(BalanceKnobs {
                        abs_threshold: abs,
                        rel_threshold: RelThreshold::new(rel).unwrap(),
                        cache_threshold: DepthRatio::new(cache).unwrap(),
                    }),
                };
                let mut case = Case::new(PolicyConfig {
                    mode,
                    max_fallbacks: 3,
                });
                case.sequence = sequence;
                case.prompt_tokens = prompt;
                case.seed = seed;
                case.allowed = allowed.map(|ids| ids.into_iter().map(WorkerId).collect());
                for (reading, used, max_running, max_tokens, shape, blocks, dispatched) in workers {
                    case = case
                        .worker(reading.map(|(waiting, _, _)| waiting))
                        .dispatched(dispatched)
                        .dispatched_tokens(dispatched * 700)
                        .with(|w| {
                            // Half the workers have learned a rate, some a mean request.
                            if dispatched % 2 == 0 {
                                w.prefill.drain_tokens_per_second = Some(3_000 * (dispatched + 1));
                            }
                            if blocks % 3 == 0 {
                                w.prefill.uncached_per_request = Some(blocks * 40);
                            }
                            if let (Some(r), Some((_, running, uncached))) =
                                (w.reading.as_mut(), reading)
                            {
                                r.load.running = running;
                                r.load.waiting_uncached_tokens = uncached;
                                r.load.used_tokens = used;
                                r.complete = shape != 1;
                                if shape == 2 {
                                    r.captured_at -= FRESHNESS;
                                }
                            }
                            w.capacity = Capacity {
                                engine_block: None,
                                max_running,
                                max_total_tokens: max_tokens,
                            };
                            w.role = match shape {
                                3 => Role::Decode,
                                4 => Role::Prefill,
                                _ => Role::Both,
                            };
                            if shape == 5 {
                                w.lifecycle = Lifecycle::Draining;
                            }
                        });
                    if blocks > 0 {
                        case = case.owns(blocks);
                    }
                }
                case
            },
        )
}

fn in_fleet(case: &Case, id: WorkerId) -> bool {
    case.workers.get(id.index()).is_some_and(|w| {
        w.routable()
            && w.role.serves_prefill()
            && case
                .allowed
                .as_ref()
                .is_none_or(|allowed| allowed.contains(&id))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_selected_worker_is_always_in_the_fleet(case in arbitrary_case()) {
        let fleet_size = case.workers.iter().enumerate().filter(|(i, _)| in_fleet(&case, WorkerId(*i as u32))).count();
        match case.decide() {
            Outcome::Route(decision) => {
                prop_assert!(in_fleet(&case, decision.selected));
                let mut seen = vec![decision.selected];
                for fallback in &decision.fallbacks {
                    prop_assert!(in_fleet(&case, *fallback));
                    prop_assert!(!seen.contains(fallback), "duplicate fallback");
                    seen.push(*fallback);
                }
                prop_assert_eq!(decision.fallbacks.len(), fleet_size.saturating_sub(1).min(3));
            }
            Outcome::Refuse(refused) => {
                prop_assert_eq!(refused.reason, RefuseReason::NoWorkers);
                prop_assert_eq!(fleet_size, 0);
            }
        }
    }

    #[test]
    fn the_pin_never_fires_while_a_fleet_worker_is_fresh_below_the_floor(case in arbitrary_case()) {
        let Some(floor) = case.config.gate().and_then(|gate| gate.floor()) else { return Ok(()) };
        let snapshot = PoolSnapshot::new(0, FRESHNESS, case.workers.clone());
        let relieved = snapshot.workers().iter().any(|w| {
            in_fleet(&case, w.id) && snapshot.fresh_load(w.id, case.now).is_some_and(|load| load.waiting < floor)
        });
        if let Outcome::Route(decision) = case.decide() {
            if relieved {
                prop_assert_ne!(decision.reason, Reason::SaturationPin);
            }
            if decision.reason == Reason::SaturationPin {
                let owner = decision.trace.owners.iter().find(|o| o.worker == decision.selected);
                let queued_and_admitted =
                    owner.is_some_and(|o| !o.gate.passes() && o.admission.admits());
                prop_assert!(queued_and_admitted);
            }
        }
    }
}

/// waiting + running from a fresh reading, plus the dispatches since.
fn load_of(case: &Case, id: WorkerId) -> u64 {
    let snapshot = PoolSnapshot::new(0, FRESHNESS, case.workers.clone());
    let engine = snapshot
        .fresh_load(id, case.now)
        .map_or(0, |load| load.waiting.saturating_add(load.running));
    engine.saturating_add(case.dispatches[id.index()].0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn each_mode_follows_its_own_rule(case in arbitrary_case()) {
        let fleet: Vec<WorkerId> = (0..case.workers.len() as u32)
            .map(WorkerId)
            .filter(|id| in_fleet(&case, *id))
            .collect();
        let Outcome::Route(decision) = case.decide() else { return Ok(()) };
        let min_load = fleet.iter().map(|id| load_of(&case, *id)).min().unwrap();
        match &case.config.mode {
            Mode::RoundRobin => {
                let turn = (case.sequence % fleet.len() as u64) as usize;
                prop_assert_eq!(decision.selected, fleet[turn]);
                prop_assert_eq!(decision.reason, Reason::RoundRobin);
                for (i, fallback) in decision.fallbacks.iter().enumerate() {
                    prop_assert_eq!(*fallback, fleet[(turn + i + 1) % fleet.len()]);
                }
            }
            Mode::LeastLoad => {
                prop_assert_eq!(load_of(&case, decision.selected), min_load);
                prop_assert_eq!(decision.reason, Reason::LeastLoad);
            }
            Mode::BalanceThreshold(knobs) => {
                let max_load = fleet.iter().map(|id| load_of(&case, *id)).max().unwrap();
                let imbalanced = max_load - min_load > knobs.abs_threshold
                    && max_load as f64 > knobs.rel_threshold.get() * min_load as f64;
                let balance = decision.trace.balance.unwrap();
                prop_assert_eq!((balance.min_load, balance.max_load, balance.imbalanced), (min_load, max_load, imbalanced));
                match decision.reason {
                    Reason::BalancedOwner => {
                        prop_assert!(!imbalanced);
                        prop_assert!(balance.match_ratio > knobs.cache_threshold.get());
                        let deepest = decision.trace.owners.first().unwrap().matched_tokens;
                        prop_assert_eq!(decision.matched_tokens, deepest);
                    }
                    Reason::BalancedMiss | Reason::Imbalanced => {
                        prop_assert_eq!(decision.reason == Reason::Imbalanced, imbalanced);
                        prop_assert!(imbalanced || balance.match_ratio <= knobs.cache_threshold.get());
                        prop_assert_eq!(load_of(&case, decision.selected), min_load);
                    }
                    other => prop_assert!(false, "{:?} under balance_threshold", other),
                }
            }
            Mode::CacheAware(_) => {
                prop_assert!(!matches!(
                    decision.reason,
                    Reason::RoundRobin | Reason::LeastLoad | Reason::BalancedOwner
                        | Reason::BalancedMiss | Reason::Imbalanced
                ));
            }
        }
    }
}

#[test]
fn a_64_worker_pool_of_mixed_data_never_panics() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = arbitrary_case();
    for _ in 0..500 {
        let case = strategy.new_tree(&mut runner).unwrap().current();
        let _ = case.decide();
    }
}

#[test]
fn among_equal_workers_the_one_that_took_a_new_prefix_least_recently_takes_the_next() {
    // An idle fleet of four, no owner, every worker sampled: without the tie-break every cold miss
    // went to worker 0 and the fleet's cache piled up there.
    let fleet = |cold: [u64; 4]| {
        let mut case = Case::gated().choices(4);
        for number in cold {
            case = case.worker(Some(0)).cold(number);
        }
        case
    };
    assert_eq!(fleet([0, 0, 0, 0]).pick(), (0, Reason::CacheMiss));
    assert_eq!(fleet([1, 0, 0, 0]).pick(), (1, Reason::CacheMiss));
    assert_eq!(fleet([3, 4, 2, 1]).pick(), (3, Reason::CacheMiss));
    // Placements cycle through the fleet: each takes the next number.
    let mut cold = [0_u64; 4];
    let mut seen = Vec::new();
    for number in 1..=8 {
        let (picked, _) = fleet(cold).pick();
        cold[picked as usize] = number;
        seen.push(picked);
    }
    assert_eq!(seen, [0, 1, 2, 3, 0, 1, 2, 3]);
    // Load still comes first: the tie-break only orders workers otherwise equal.
    let busier = Case::gated()
        .choices(4)
        .worker(Some(1))
        .worker(Some(0))
        .cold(9);
    assert_eq!(busier.pick(), (1, Reason::CacheMiss));
}

#[test]
fn a_match_counts_in_whole_engine_blocks_and_never_the_prompt_s_last_token() {
    // The engine reuses whole 128-token blocks (vLLM's CPU build) and computes at least the prompt's
    // last token: of 2,512 credited tokens of a 2,520-token prompt it reuses 19 blocks, 2,432.
    let owner = |prompt: u64, matched: u64, block: Option<u64>| {
        let mut case = Case::gated()
            .worker(Some(0))
            .with(|w| w.capacity.engine_block = block);
        case.prompt_tokens = prompt;
        case.owners.push(OwnerMatch {
            worker: WorkerId(0),
            matched_tokens: matched,
        });
        case.routed().matched_tokens
    };
    assert_eq!(owner(2_520, 2_512, Some(128)), 2_432);
    // A whole-block prompt held whole: its last block is computed again.
    assert_eq!(owner(2_560, 2_560, Some(128)), 2_432);
    assert_eq!(owner(2_561, 2_560, Some(128)), 2_560);
    // An engine that has not said: the index's own blocks stand.
    assert_eq!(owner(2_520, 2_512, None), 2_512);
}

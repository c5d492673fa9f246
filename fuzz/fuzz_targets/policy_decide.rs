//! Fuzzes `policy::decide` with arbitrary fleets, readings, capacities, matches and knobs, and checks
//! the invariants that must hold for any input: no panic, the selected worker and every fallback are
//! fleet members without duplicates, and the saturation pin never fires while a fleet worker has a fresh
//! reading below the floor.
#![no_main]

use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use cachepick::config::{
    BalanceKnobs, CacheAwareKnobs, DepthRatio, Mode, PolicyConfig, QueueGate, RelThreshold,
};
use cachepick::load::{
    Capacity, Dispatches, EngineLoad, Lifecycle, PoolSnapshot, Reading, WorkerState,
};
use cachepick::policy::{LoadView, Outcome, OwnerMatch, Reason, RequestFacts, decide};
use cachepick::worker::{Role, WorkerId};

#[derive(Arbitrary, Debug)]
struct Worker {
    role: u8,
    routable: bool,
    reading: Option<(u16, u16, Option<u32>, Option<u32>, bool, u16)>,
    max_running: Option<u16>,
    max_total_tokens: Option<u32>,
    dispatched: u16,
    matched_tokens: u32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    workers: Vec<Worker>,
    limit: Option<u8>,
    floor: Option<u8>,
    k: u8,
    min_match_tokens: u16,
    ratio: u8,
    max_fallbacks: u8,
    prompt_tokens: u32,
    allowed: Option<Vec<u8>>,
    stray_owner: Option<(u32, u32)>,
    seed: u64,
    /// 0 (and anything above 3) cache_aware, 1 round_robin, 2 least_load, 3 balance_threshold.
    mode: u8,
    balance: (u16, u8, u8),
    sequence: u64,
}

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(|| Instant::now() + Duration::from_secs(3600))
}

fuzz_target!(|input: Input| {
    let now = base();
    let freshness = Duration::from_secs(3);
    let workers: Vec<WorkerState> = input
        .workers
        .iter()
        .take(300)
        .enumerate()
        .map(|(i, w)| {
            let endpoint = SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16));
            let role = [Role::Prefill, Role::Decode, Role::Both][usize::from(w.role % 3)];
            let mut state = WorkerState::new(WorkerId(i as u32), endpoint, role);
            if !w.routable {
                state.lifecycle = Lifecycle::Draining;
            }
            state.capacity = Capacity {
                max_running: w.max_running.map(u64::from),
                max_total_tokens: w.max_total_tokens.map(u64::from),
            };
            state.reading = w.reading.map(
                |(waiting, running, uncached, used, complete, age_ms)| Reading {
                    captured_at: now - Duration::from_millis(u64::from(age_ms)),
                    complete,
                    load: EngineLoad {
                        waiting: u64::from(waiting),
                        running: u64::from(running),
                        waiting_uncached_tokens: uncached.map(u64::from),
                        used_tokens: used.map(u64::from),
                    },
                },
            );
            state
        })
        .collect();
    let snapshot = PoolSnapshot::new(1, freshness, workers);
    let dispatched: Vec<u64> = input
        .workers
        .iter()
        .map(|w| u64::from(w.dispatched))
        .collect();
    let mut owners: Vec<OwnerMatch> = input
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| OwnerMatch {
            worker: WorkerId(i as u32),
            matched_tokens: u64::from(w.matched_tokens),
        })
        .collect();
    if let Some((worker, matched_tokens)) = input.stray_owner {
        owners.push(OwnerMatch {
            worker: WorkerId(worker),
            matched_tokens: u64::from(matched_tokens),
        });
    }

    let gate = input
        .limit
        .map(u64::from)
        .and_then(NonZeroU64::new)
        .and_then(|limit| {
            let floor = input
                .floor
                .map(u64::from)
                .and_then(NonZeroU64::new)
                .filter(|f| *f <= limit);
            QueueGate::new(limit, floor)
        });
    let (abs, rel, cache) = input.balance;
    let mode = match input.mode {
        1 => Mode::RoundRobin,
        2 => Mode::LeastLoad,
        3 => Mode::BalanceThreshold(BalanceKnobs {
            abs_threshold: u64::from(abs),
            rel_threshold: RelThreshold::new(1.0 + (f64::from(rel) + 1.0) / 64.0).unwrap(),
            cache_threshold: DepthRatio::new(f64::from(cache) / 255.0).unwrap(),
        }),
        _ => Mode::CacheAware(CacheAwareKnobs {
            gate,
            min_load_choices: NonZeroUsize::new(usize::from(input.k).max(1)).unwrap(),
            min_match_tokens: u64::from(input.min_match_tokens),
            pin_depth_ratio: DepthRatio::new(f64::from(input.ratio) / 255.0).unwrap(),
        }),
    };
    let config = PolicyConfig {
        mode,
        max_fallbacks: usize::from(input.max_fallbacks % 9),
    };
    let allowed: Option<Vec<WorkerId>> = input
        .allowed
        .as_ref()
        .map(|ids| ids.iter().map(|id| WorkerId(u32::from(*id))).collect());
    let request = RequestFacts {
        prompt_tokens: u64::from(input.prompt_tokens),
        allowed: allowed.as_deref(),
        sequence: input.sequence,
    };
    let dispatches = Dispatches(&dispatched);
    let load = LoadView {
        snapshot: &snapshot,
        dispatches: &dispatches,
        now,
    };
    let mut rng = SmallRng::seed_from_u64(input.seed);
    let outcome = decide(&request, &owners, &load, &config, &mut rng);

    let in_fleet = |id: WorkerId| {
        snapshot.worker(id).is_some_and(|w| {
            w.routable()
                && w.role.serves_prefill()
                && allowed.as_ref().is_none_or(|a| a.contains(&id))
        })
    };
    if let Outcome::Route(decision) = outcome {
        assert!(in_fleet(decision.selected));
        let mut seen = vec![decision.selected];
        for fallback in &decision.fallbacks {
            assert!(in_fleet(*fallback) && !seen.contains(fallback));
            seen.push(*fallback);
        }
        assert!(decision.fallbacks.len() <= config.max_fallbacks);
        if let Some(floor) = config.gate().and_then(|g| g.floor()) {
            let relieved = snapshot.workers().iter().any(|w| {
                in_fleet(w.id)
                    && snapshot
                        .fresh_load(w.id, now)
                        .is_some_and(|l| l.waiting < floor)
            });
            assert!(!(relieved && decision.reason == Reason::SaturationPin));
        }
    } else {
        assert!(!snapshot.workers().iter().any(|w| in_fleet(w.id)));
    }
});

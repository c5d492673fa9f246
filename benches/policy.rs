//! Cost of one routing decision, `policy::decide`, on realistic fleets.
//!
//! Run: `cargo bench --bench policy`. Figures go to BENCHMARKS.md with the machine they came from.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use rand::SeedableRng;
use rand::rngs::SmallRng;

use cachepick::config::{CacheAwareKnobs, Gating, Mode, PolicyConfig, QueueGate};
use cachepick::load::{Capacity, Dispatches, EngineLoad, PoolSnapshot, Reading, WorkerState};
use cachepick::policy::{LoadView, OwnerMatch, RequestFacts, decide};
use cachepick::worker::{Role, WorkerId};

/// A fleet of `n` fresh workers whose queues cycle through 0..=7, with eight owners of varying depth.
fn fleet(n: usize, now: Instant, saturated: bool) -> (PoolSnapshot, Vec<OwnerMatch>) {
    let workers = (0..n)
        .map(|i| {
            let endpoint = SocketAddr::from(([127, 0, 0, 1], 20_000 + i as u16));
            let mut state = WorkerState::new(WorkerId(i as u32), endpoint, Role::Both);
            let waiting = if saturated {
                4 + (i % 5) as u64
            } else {
                (i % 8) as u64
            };
            state.capacity = Capacity {
                max_running: Some(256),
                max_total_tokens: Some(1 << 20),
                engine_block: Some(16),
            };
            state.reading = Some(Reading {
                captured_at: now - Duration::from_millis(300),
                complete: true,
                load: EngineLoad {
                    waiting,
                    running: 16 + (i % 4) as u64,
                    waiting_uncached_tokens: None,
                    used_tokens: Some(400_000),
                },
            });
            state
        })
        .collect();
    let owners = (0..8)
        .map(|i| OwnerMatch {
            worker: WorkerId((i * 7 % n) as u32),
            matched_tokens: 2048 + 512 * i as u64,
        })
        .collect();
    (
        PoolSnapshot::new(1, Duration::from_secs(3), workers),
        owners,
    )
}

fn bench_decide(c: &mut Criterion) {
    let config = PolicyConfig {
        mode: Mode::CacheAware(CacheAwareKnobs {
            min_load_choices: NonZeroUsize::new(2).unwrap(),
            ..CacheAwareKnobs::with_gating(Gating::Requests(QueueGate::new(
                NonZeroU64::new(4).unwrap(),
                NonZeroU64::new(2),
            )))
        }),
        ..PolicyConfig::default()
    };
    let now = Instant::now();
    let mut group = c.benchmark_group("decide");
    for (label, saturated) in [("mixed", false), ("saturated", true)] {
        for n in [64, 256] {
            let (snapshot, owners) = fleet(n, now, saturated);
            let counts = vec![1_u64; n];
            let dispatches = Dispatches(&counts);
            let load = LoadView {
                snapshot: &snapshot,
                dispatches: &dispatches,
                now,
            };
            let request = RequestFacts {
                prompt_tokens: 8192,
                allowed: None,
                sequence: 0,
            };
            let mut rng = SmallRng::seed_from_u64(1);
            group.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter(|| {
                    decide(
                        black_box(&request),
                        black_box(&owners),
                        &load,
                        &config,
                        &mut rng,
                    )
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_decide);
criterion_main!(benches);

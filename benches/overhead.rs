//! Per-request latency through Envoy + a no-op ext_proc server (arm c), Envoy + the no-op server that
//! answers with a routing decision made in advance (arm c′) and Envoy + cachepick (arm d), at 4 KB and
//! 200 KB, in each body mode (buffered, duplex, streamed): the medians of `cachepick overhead`'s
//! ext_proc arms, on the same harness (`cachepick_rig::overhead::Rig`: one worker, one picker, the
//! no-op servers, a real Envoy per arm and mode, all on loopback). `cachepick overhead` gives the p99 and the other arms.
//!
//! Run: `cargo bench --bench overhead` (Envoy from `CACHEPICK_ENVOY`, `target/envoy-1.40.0/bin/envoy`
//! or `PATH`; `scripts/provision-envoy` installs it). Each request is a new chat turn on a shared
//! prefix, sequential, timed from sending to the answer's last byte; a body's construction is outside
//! the timing. The difference d − c between the medians of a size and mode is cachepick's own work
//! (targets in `BENCHMARKS.md`: ≤ 0.1 ms at 4 KB, ≤ 1 ms at 200 KB); d − c′ is its computing alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod sampling;
}

use std::hint::black_box;
use std::time::Duration;

use cachepick::envoy_config::BodyMode;
use cachepick_rig::overhead::{Arm, Bodies, Cell, MODEL, Rig, Variant};
use criterion::{Criterion, criterion_group, criterion_main};
use tokio::runtime::Runtime;

const SIZES: [(usize, &str); 2] = [(4 * 1_024, "4KB"), (200 * 1_024, "200KB")];

fn bench_overhead(c: &mut Criterion) {
    let envoy = cachepick_rig::find_envoy(None).unwrap_or_else(|| {
        panic!("Envoy is not installed: run scripts/provision-envoy or set CACHEPICK_ENVOY")
    });
    let runtime = Runtime::new().unwrap();
    let modes = [BodyMode::Buffered, BodyMode::Duplex, BodyMode::Streamed];
    let rig = runtime
        .block_on(Rig::start(&envoy, &modes, Variant::Generated))
        .expect("the overhead rig starts");
    let mut sent: u64 = 0;
    for (size, name) in SIZES {
        let bodies = Bodies::new(MODEL, size, 1);
        let mut group = c.benchmark_group(format!("overhead/{name}"));
        for mode in modes {
            for arm in [Arm::Noop, Arm::Routing, Arm::Cachepick] {
                let cell = Cell {
                    arm,
                    mode: Some(mode),
                };
                let label = match arm {
                    Arm::Noop => "c_noop_ext_proc",
                    Arm::Routing => "c2_noop_that_routes",
                    _ => "d_cachepick",
                };
                group.bench_function(format!("{label}/{mode}"), |b| {
                    b.iter_custom(|iters| {
                        let mut elapsed = Duration::ZERO;
                        for _ in 0..iters {
                            sent += 1;
                            let body = bodies.body(sent);
                            let sample = runtime.block_on(rig.send(cell, body)).unwrap();
                            assert_eq!(sample.status, 200, "{}", cell.name());
                            assert_eq!(
                                sample.decision.is_some(),
                                arm != Arm::Noop,
                                "{}",
                                cell.name()
                            );
                            elapsed += black_box(sample.latency);
                        }
                        elapsed
                    })
                });
            }
        }
        group.finish();
    }
    runtime.block_on(rig.stop()).unwrap();
}

criterion_group! {
    name = benches;
    config = support::sampling::fifty_samples();
    targets = bench_overhead
}
criterion_main!(benches);

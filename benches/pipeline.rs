//! The request path on realistic bodies: body → pool → tokens → block hashes → owners (→ decision).
//!
//! Run: `cargo bench --bench pipeline`. Cold means a fresh picker (empty segment cache); warm means the
//! same conversation was routed before, so its segments are cached and its blocks are in the index.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::hint::black_box;
use std::time::Instant;

use cachepick::config::{self, Overrides};
use cachepick::load::PoolLoad;
use cachepick::policy::Outcome;
use cachepick::route::Picker;
use criterion::{BatchSize, Bencher, Criterion, Throughput, criterion_group, criterion_main};
use rand::SeedableRng;
use rand::rngs::SmallRng;

mod support {
    pub mod bodies;
}

use support::bodies;

fn picker() -> Picker {
    picker_with("")
}

/// 16 workers of one pool with `pool` (indented as the pool's keys) added to its section.
fn picker_with(pool: &str) -> Picker {
    let mut yaml =
        format!("pools:\n  - model: m\n    engine: vllm\n    block_size: 64\n{pool}    workers:\n");
    for port in 1..=16 {
        yaml.push_str(&format!("      - endpoint: 127.0.0.1:{port}\n"));
    }
    let config = config::parse(&yaml, "bench.yaml", &Overrides::default()).unwrap();
    let loads = PoolLoad::for_pools(&config);
    Picker::new(&config, &loads).unwrap()
}

/// The owner index from the engines' KV events, under each gate unit.
const EVENTS_REQUESTS: &str = "    index:\n      mode: events\n";
const EVENTS_PREFILL_TIME: &str =
    "    index:\n      mode: events\n    policy:\n      gate_unit: prefill_time\n";

const CHAT: &str = "/v1/chat/completions";

/// Times `run` on a fresh picker (an empty segment cache and index) each iteration; building the picker
/// is not timed, and neither is dropping what `run` returns.
fn on_fresh_picker<O>(b: &mut Bencher<'_>, run: impl FnMut(Picker) -> O) {
    b.iter_batched(picker, run, BatchSize::PerIteration)
}

/// The prompt's size in tokens, as a fresh picker counts it.
fn prompt_tokens(body: &[u8]) -> u64 {
    picker()
        .prepare(CHAT, body, Instant::now())
        .unwrap()
        .prompt_tokens
}

fn route(picker: &Picker, body: &[u8], rng: &mut SmallRng) {
    let prepared = picker.prepare(CHAT, body, Instant::now()).unwrap();
    let pinned = picker.pin(&prepared, Instant::now()).unwrap();
    if let Outcome::Route(decision) = pinned.decide(None, rng) {
        pinned.commit(&decision);
    }
}

fn bench_pipeline(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(5);
    // (a) About 8k tokens over 10 turns.
    let body = bodies::chat("m", 10, 380);
    let tokens = prompt_tokens(&body);
    let mut group = c.benchmark_group("prepare_8k_10_turns");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("cold", |b| {
        on_fresh_picker(b, |picker| {
            black_box(picker.prepare(CHAT, &body, Instant::now()).unwrap())
        })
    });
    let warm = picker();
    route(&warm, &body, &mut rng);
    group.bench_function("warm", |b| {
        b.iter(|| {
            black_box(
                warm.prepare(CHAT, black_box(&body), Instant::now())
                    .unwrap(),
            )
        })
    });
    group.finish();
    println!("prepare_8k_10_turns: {} bytes, {tokens} tokens", body.len());

    // (d) A 220 KB body end to end: prepare, decide, commit.
    let big = bodies::chat("m", 40, 560);
    let tokens = prompt_tokens(&big);
    let mut group = c.benchmark_group("route_220kb");
    group.throughput(Throughput::Bytes(big.len() as u64));
    group.bench_function("cold", |b| {
        on_fresh_picker(b, |picker| {
            let mut rng = SmallRng::seed_from_u64(1);
            route(&picker, &big, &mut rng);
            // Returned, so that its drop is not timed.
            picker
        })
    });
    let warm = picker();
    route(&warm, &big, &mut rng);
    group.bench_function("warm", |b| {
        b.iter(|| route(&warm, black_box(&big), &mut rng))
    });
    group.finish();
    println!("route_220kb: {} bytes, {tokens} tokens", big.len());

    // (e) An agent turn of about 100k tokens, cold (a fresh picker: nothing tokenized or cached), on
    // the events index, under each gate unit: the decisions a core makes per second on the prompts
    // llm-d's operations guide sizes its routers for (100k/1k agentic prompts).
    let agent = bodies::chat("m", 5, 9_000);
    let tokens = prompt_tokens(&agent);
    let mut group = c.benchmark_group("route_agent_100k_events_cold");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    for (name, pool) in [
        ("requests", EVENTS_REQUESTS),
        ("prefill_time", EVENTS_PREFILL_TIME),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || picker_with(pool),
                |picker| {
                    let mut rng = SmallRng::seed_from_u64(1);
                    route(&picker, &agent, &mut rng);
                    picker
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
    println!(
        "route_agent_100k_events_cold: {} bytes, {tokens} tokens",
        agent.len()
    );
}

criterion_group!(benches, bench_pipeline);
criterion_main!(benches);

//! The `events` index: how fast engine KV events are ingested, what an entry costs, and what a match
//! costs next to the approximate index's.
//!
//! - Ingest: vLLM ≥ 0.24 batches (maps tagged by `type`), each storing one 16-block chain of 16 tokens
//!   (a prefill's new blocks) and removing the 16 blocks stored 64 batches earlier, as a steady engine
//!   does; measured decoded and applied, and applied only. Throughput is in stored blocks.
//! - Memory: 64 workers filled through `EventIndex::store` with conversations over 32 shared system
//!   prompts, blocks of 64 tokens from engine blocks of 64, until each is full and has evicted as much
//!   again, at three fill sizes; live bytes requested, the engine-hash tags included, per (block,
//!   owner) entry.
//! - Match: a 512-block probe of which one worker holds 480, on the events index (truth and
//!   guesses) and on the approximate `OwnerIndex` filled the same way; and the commit after a decision
//!   on each (a guess and a refresh, against an insert).
//!
//! Run: `cargo bench --bench kv_events`. Figures go to BENCHMARKS.md with the machine they came from.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]
// Measuring memory needs the counting allocator of `support/counting.rs`, unsafe to implement (as
// `benches/prefix.rs` says).
#![allow(unsafe_code)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rmpv::Value;

use cachepick::events::apply::Applier;
use cachepick::events::decode::decode_batch;
use cachepick::events::stream::Stream;
use cachepick::prefix::{EventIndex, OwnerIndex, block_hashes, prefix_seed};
use cachepick::worker::WorkerId;

mod support {
    pub mod counting;
}

use counting::LIVE;
use support::counting;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const TTL: Duration = Duration::from_secs(2);

fn random_tokens(rng: &mut SmallRng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(0..200_000)).collect()
}

fn s(text: &str) -> Value {
    Value::from(text)
}

/// One vLLM ≥ 0.24 batch: a stored chain and, when given, a removal.
fn batch(stored: &[u64], tokens: &[u32], removed: Option<&[u64]>) -> Vec<u8> {
    let mut events = vec![Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(stored.iter().map(|&h| Value::from(h)).collect()),
        ),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        (s("block_size"), Value::from(16)),
        (s("medium"), s("GPU")),
    ])];
    if let Some(removed) = removed {
        events.push(Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (
                s("block_hashes"),
                Value::Array(removed.iter().map(|&h| Value::from(h)).collect()),
            ),
            (s("medium"), s("GPU")),
        ]));
    }
    let batch = Value::Array(vec![
        Value::F64(1.7e9),
        Value::Array(events),
        Value::from(0),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    bytes
}

fn bench_ingest(c: &mut Criterion) {
    const BATCHES: usize = 4096;
    const CHAIN: usize = 16;
    let mut rng = SmallRng::seed_from_u64(1);
    let hashes: Vec<Vec<u64>> = (0..BATCHES)
        .map(|_| (0..CHAIN).map(|_| rng.random()).collect())
        .collect();
    let payloads: Vec<Vec<u8>> = (0..BATCHES)
        .map(|i| {
            let tokens = random_tokens(&mut rng, CHAIN * 16);
            let removed = (i >= 64).then(|| hashes[i - 64].as_slice());
            batch(&hashes[i], &tokens, removed)
        })
        .collect();
    let decoded: Vec<_> = payloads.iter().map(|p| decode_batch(p).unwrap()).collect();
    let applier = || {
        let index = Arc::new(EventIndex::new(
            &[1],
            &[1 << 20],
            NonZeroU32::new(16).unwrap(),
            TTL,
        ));
        let slot = index.slot(WorkerId(0), 0).unwrap();
        let stream = Arc::new(Stream::new(
            WorkerId(0),
            0,
            "127.0.0.1:5557".parse().unwrap(),
            None,
        ));
        Applier::new(index, slot, MODEL.to_owned(), stream)
    };
    let mut group = c.benchmark_group("kv_events_ingest");
    group.throughput(Throughput::Elements((BATCHES * CHAIN) as u64));
    let apply = applier();
    group.bench_function("apply 4096 batches of 16 blocks", |b| {
        b.iter(|| {
            for batch in &decoded {
                apply.apply(black_box(batch));
            }
        })
    });
    let apply = applier();
    group.bench_function("decode and apply 4096 batches of 16 blocks", |b| {
        b.iter(|| {
            for payload in &payloads {
                apply.apply(&decode_batch(black_box(payload)).unwrap());
            }
        })
    });
    group.finish();
}

const WORKERS: usize = 64;
const BLOCK: usize = 64;

/// An events index whose 64 workers hold `capacity` blocks each, stored as engine blocks of 64.
fn fill_events(capacity: usize, rng: &mut SmallRng) -> EventIndex {
    let index = EventIndex::new(
        &[1; WORKERS],
        &[capacity; WORKERS],
        NonZeroU32::new(BLOCK as u32).unwrap(),
        TTL,
    );
    let seed = prefix_seed(MODEL, None);
    let systems: Vec<Vec<u32>> = (0..32)
        .map(|_| {
            let len = rng.random_range(8..64) * BLOCK;
            random_tokens(rng, len)
        })
        .collect();
    for worker in 0..WORKERS {
        let slot = index.slot(WorkerId(worker as u32), 0).unwrap();
        // Full, and as much again evicted: the steady state of a busy worker.
        let mut held = 0;
        while held < 2 * capacity {
            let x: f64 = rng.random();
            let mut tokens = systems[((x * x * x) * 32.0) as usize].clone();
            let turn = rng.random_range(4..64) * BLOCK;
            tokens.extend(random_tokens(rng, turn));
            let blocks: Vec<(u64, &[u32])> = tokens
                .chunks_exact(BLOCK)
                .map(|chunk| (rng.random(), chunk))
                .collect();
            held += blocks.len();
            index.store(slot, seed, None, blocks);
        }
    }
    index
}

fn report_memory(_: &mut Criterion) {
    println!("events index memory (live bytes requested, engine-hash tags included):");
    for capacity in [12_288, 16_384, 20_480] {
        let mut rng = SmallRng::seed_from_u64(7);
        let before = LIVE.load(Ordering::Relaxed);
        let index = fill_events(capacity, &mut rng);
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        let stats = index.stats();
        let tags: usize = stats.engine_keys.iter().sum();
        println!(
            "  {WORKERS} workers x {capacity} blocks: {} entries over {} blocks, {tags} engine hashes, {:.1} MiB, {:.1} bytes per entry",
            stats.index.entries,
            stats.index.blocks,
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / stats.index.entries as f64,
        );
    }
}

fn bench_match(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(3);
    let index = fill_events(16_384, &mut rng);
    let seed = prefix_seed(MODEL, None);
    let mut tokens = random_tokens(&mut rng, 480 * BLOCK);
    let slot = index.slot(WorkerId(5), 0).unwrap();
    let blocks: Vec<(u64, &[u32])> = tokens
        .chunks_exact(BLOCK)
        .map(|chunk| (rng.random(), chunk))
        .collect();
    index.store(slot, seed, None, blocks);
    let approximate = OwnerIndex::new(&[16_384; WORKERS]);
    approximate.insert(
        WorkerId(5),
        &block_hashes(seed, &tokens, NonZeroU32::new(BLOCK as u32).unwrap()),
    );
    tokens.extend(random_tokens(&mut rng, 32 * BLOCK + 17));
    let probe = block_hashes(seed, &tokens, NonZeroU32::new(BLOCK as u32).unwrap());
    let now = Instant::now();
    let block = NonZeroU32::new(BLOCK as u32).unwrap();
    assert_eq!(
        index.matches(&probe, now)[0].matched_tokens,
        480 * BLOCK as u64
    );
    let mut group = c.benchmark_group("kv_events_match");
    group.bench_function("events index, 512-block probe, 480 held", |b| {
        b.iter(|| index.matches(black_box(&probe), now))
    });
    group.bench_function("approximate index, 512-block probe, 480 held", |b| {
        b.iter(|| approximate.matches(black_box(&probe), block))
    });
    group.finish();
    // The commit after a decision: the approximate index inserts the prompt for the worker; the
    // events index refreshes what the worker holds and records a guess.
    let mut group = c.benchmark_group("kv_events_commit");
    group.bench_function("events index: speculate 512 blocks, 480 held", |b| {
        b.iter(|| index.speculate(WorkerId(5), black_box(&probe), now))
    });
    group.bench_function("approximate index: insert 512 blocks, 480 held", |b| {
        b.iter(|| approximate.insert(WorkerId(5), black_box(&probe)))
    });
    group.finish();
}

criterion_group!(benches, report_memory, bench_ingest, bench_match);
criterion_main!(benches);

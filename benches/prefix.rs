//! Prefix hashing and the owner index at fleet scale: 64 workers holding 16,384 blocks of 64 tokens
//! each (about a million tokens of KV per worker), 1,048,576 (block, owner) entries in all.
//!
//! The fill is made of conversations: each starts from one of 32 shared system prompts (popular ones
//! more often), runs a few turns, and is inserted on one worker after every turn, as the picker does
//! after each decision, until every worker is full and has evicted as much again. The probes are
//! 512-block prompts (32,768 tokens) whose first 480 blocks the index holds on one worker.
//!
//! Before the timings it prints the index's memory per (block, owner) entry at three fill sizes,
//! counted by a global allocator that tracks live bytes (the sizes the index asked for, so the
//! allocator's own per-chunk overhead is not included).
//!
//! Run: `cargo bench --bench prefix`. Figures go to BENCHMARKS.md with the machine they came from.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]
// Measuring memory needs a global allocator (`support/counting.rs`), which is unsafe to implement: this file
// and `kv_events.rs` are the workspace's exceptions to its `unsafe_code` denial.
#![allow(unsafe_code)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::Ordering;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use cachepick::prefix::{OwnerIndex, block_hashes, block_hashes_into, prefix_seed};
use cachepick::worker::WorkerId;

const WORKERS: usize = 64;
const CAPACITY: usize = 16_384;
const BLOCK: NonZeroU32 = NonZeroU32::new(64).unwrap();
const BLOCK_TOKENS: usize = 64;
const PROBE_BLOCKS: usize = 512;
const HELD_BLOCKS: usize = 480;
/// Distinct probes for the cache-cold match: 123k entries, spread over every worker.
const PROBES: usize = 256;

mod support {
    pub mod counting;
}

use counting::LIVE;
use support::counting;

fn random_tokens(rng: &mut SmallRng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(0..200_000)).collect()
}

/// An index whose workers are full, plus the probe prompts: tokens of the first, hashes of all.
struct Fleet {
    index: OwnerIndex,
    seed: u64,
    probe_tokens: Vec<u32>,
    probes: Vec<Vec<u64>>,
}

impl Fleet {
    /// Hashes the first probe's tokens into `hashes`, as the picker does for each request.
    fn hash_probe(&self, hashes: &mut Vec<u64>) {
        block_hashes_into(self.seed, black_box(&self.probe_tokens), BLOCK, hashes);
    }
}

fn fill(capacity: usize, rng: &mut SmallRng) -> Fleet {
    let seed = prefix_seed("meta-llama/Llama-3.1-8B-Instruct", None);
    let index = OwnerIndex::new(&[capacity; WORKERS]);
    // The most popular system prompt is exactly 32 blocks; the others 500..4,000 tokens.
    let systems: Vec<Vec<u32>> = (0..32)
        .map(|i| {
            let len = if i == 0 {
                32 * BLOCK_TOKENS
            } else {
                rng.random_range(500..4_000)
            };
            random_tokens(rng, len)
        })
        .collect();
    let popular = |rng: &mut SmallRng| {
        let x: f64 = rng.random();
        ((x * x * x) * systems.len() as f64) as usize
    };
    let mut hashes = Vec::new();
    let mut new_blocks = 0;
    while new_blocks < 2 * capacity * WORKERS {
        let worker = WorkerId(rng.random_range(0..WORKERS as u32));
        let mut tokens = systems[popular(rng)].clone();
        let mut held = 0;
        for _ in 0..rng.random_range(1..=8) {
            let turn = rng.random_range(200..3_000);
            tokens.extend(random_tokens(rng, turn));
            block_hashes_into(seed, &tokens, BLOCK, &mut hashes);
            index.insert(worker, &hashes);
            new_blocks += hashes.len() - held;
            held = hashes.len();
        }
    }
    // The probes' conversations, inserted last so they are the most recent on their workers.
    let mut probe_tokens = Vec::new();
    let probes = (0..PROBES)
        .map(|i| {
            let system = if i == 0 { 0 } else { popular(rng) };
            let mut tokens = systems[system].clone();
            let history = HELD_BLOCKS * BLOCK_TOKENS - tokens.len();
            tokens.extend(random_tokens(rng, history));
            index.insert(
                WorkerId((i % WORKERS) as u32),
                &block_hashes(seed, &tokens, BLOCK),
            );
            // The new turn: 32 more blocks and a partial one.
            tokens.extend(random_tokens(
                rng,
                (PROBE_BLOCKS - HELD_BLOCKS) * BLOCK_TOKENS + 17,
            ));
            let hashes = block_hashes(seed, &tokens, BLOCK);
            if i == 0 {
                probe_tokens = tokens;
            }
            hashes
        })
        .collect();
    Fleet {
        index,
        seed,
        probe_tokens,
        probes,
    }
}

/// Bytes per (block, owner) entry at three fill sizes; a table's load factor depends on where its
/// size falls between two powers of two, so one size alone would be luck.
fn report_memory(_: &mut Criterion) {
    println!("owner index memory (live bytes requested, index only):");
    for capacity in [12_288, CAPACITY, 20_480] {
        let mut rng = SmallRng::seed_from_u64(7);
        let before = LIVE.load(Ordering::Relaxed);
        let fleet = fill(capacity, &mut rng);
        // The probe prompts are the benchmark's, not the index's.
        let probes: usize = fleet.probes.iter().map(|p| p.capacity() * 8).sum::<usize>()
            + fleet.probes.capacity() * size_of::<Vec<u64>>()
            + fleet.probe_tokens.capacity() * 4;
        let bytes = LIVE.load(Ordering::Relaxed) - before - probes;
        let stats = fleet.index.stats();
        println!(
            "  {} workers x {capacity} blocks: {} entries over {} blocks, {:.1} MiB, {:.1} bytes per entry",
            WORKERS,
            stats.entries,
            stats.blocks,
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / stats.entries as f64,
        );
    }
}

fn bench_prefix(c: &mut Criterion) {
    let mut rng = SmallRng::seed_from_u64(7);
    let fleet = fill(CAPACITY, &mut rng);
    let probe = &fleet.probes[0];
    let found = fleet.index.matches(probe, BLOCK);
    println!(
        "probe: {} blocks, {} owners, deepest {:?}",
        probe.len(),
        found.len(),
        found.first()
    );

    let mut group = c.benchmark_group("prefix");
    group.throughput(Throughput::Elements(PROBE_BLOCKS as u64));
    let mut hashes = Vec::new();
    group.bench_function("hash 32,768 tokens", |b| {
        b.iter(|| fleet.hash_probe(&mut hashes))
    });
    group.bench_function("match 512 blocks, warm", |b| {
        b.iter(|| fleet.index.matches(black_box(probe), BLOCK))
    });
    let mut next = 0;
    group.bench_function("match 512 blocks, rotating over 256 prompts", |b| {
        b.iter(|| {
            next = (next + 1) % PROBES;
            fleet.index.matches(black_box(&fleet.probes[next]), BLOCK)
        })
    });
    group.bench_function("hash + match 512 blocks", |b| {
        b.iter(|| {
            fleet.hash_probe(&mut hashes);
            fleet.index.matches(&hashes, BLOCK)
        })
    });
    group.bench_function("insert 512 blocks, all held", |b| {
        b.iter(|| fleet.index.insert(WorkerId(0), black_box(probe)))
    });
    // A full worker takes a new turn: 480 held blocks refreshed, 32 new ones added and as many of
    // its oldest evicted.
    let held = &probe[..HELD_BLOCKS];
    group.bench_function("insert 512 blocks, 32 new on a full worker", |b| {
        b.iter_batched(
            || {
                let mut chain = held.to_vec();
                chain.extend((0..PROBE_BLOCKS - HELD_BLOCKS).map(|_| rng.random::<u64>()));
                chain
            },
            |chain| fleet.index.insert(WorkerId(0), &chain),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, report_memory, bench_prefix);
criterion_main!(benches);

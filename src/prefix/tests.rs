//! The owner index against a naive model, and under concurrent use.
use std::cmp::Reverse;
use std::collections::{HashSet, VecDeque};
use std::num::NonZeroU32;
use std::sync::Arc;

use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{IndexStats, OwnerIndex, OwnerMatch, block_hashes, prefix_seed};
use crate::worker::WorkerId;

const BLOCK: NonZeroU32 = NonZeroU32::new(2).unwrap();

/// The same semantics, written the obvious way: per worker a deque of hashes, most recent first, and
/// a match is the length of the chain's leading run found in it.
struct Model {
    held: Vec<VecDeque<u64>>,
    capacity: Vec<usize>,
}

impl Model {
    fn insert(&mut self, worker: usize, hashes: &[u64]) {
        let Some(held) = self.held.get_mut(worker) else {
            return;
        };
        let capacity = self.capacity[worker];
        if capacity == 0 {
            return;
        }
        for &hash in hashes.iter().rev() {
            held.retain(|&h| h != hash);
            held.push_front(hash);
            held.truncate(capacity);
        }
    }

    fn set_capacity(&mut self, worker: usize, blocks: usize) {
        if let Some(held) = self.held.get_mut(worker) {
            self.capacity[worker] = blocks;
            held.truncate(blocks);
        }
    }

    fn remove(&mut self, worker: usize) {
        if let Some(held) = self.held.get_mut(worker) {
            held.clear();
            self.capacity[worker] = 0;
        }
    }

    fn matches(&self, hashes: &[u64]) -> Vec<OwnerMatch> {
        ranked(self.held.iter().enumerate().map(|(worker, held)| {
            (
                worker,
                hashes.iter().take_while(|h| held.contains(h)).count(),
            )
        }))
    }

    fn stats(&self) -> IndexStats {
        let held: Vec<usize> = self.held.iter().map(VecDeque::len).collect();
        IndexStats {
            blocks: self.held.iter().flatten().collect::<HashSet<_>>().len(),
            entries: held.iter().sum(),
            held,
        }
    }
}

/// The owners of a chain from `(worker, leading blocks it holds)`: those holding any, deepest first
/// and by worker among equals.
fn ranked(held: impl Iterator<Item = (usize, usize)>) -> Vec<OwnerMatch> {
    let mut found: Vec<OwnerMatch> = held
        .filter(|(_, blocks)| *blocks > 0)
        .map(|(worker, blocks)| OwnerMatch {
            worker: WorkerId(worker as u32),
            matched_tokens: blocks as u64 * u64::from(BLOCK.get()),
        })
        .collect();
    found.sort_by_key(|owner| (Reverse(owner.matched_tokens), owner.worker));
    found
}

#[derive(Clone, Debug)]
enum Op {
    Insert(usize, Vec<u32>),
    Match(Vec<u32>),
    SetCapacity(usize, usize),
    Remove(usize),
}

/// Prompts over a three-token alphabet in blocks of two: nine distinct first blocks, so chains share
/// prefixes often.
fn prompt() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0..3_u32, 0..12)
}

/// The pool has 130 workers so that owner bitsets span three words; operations name four of them,
/// or 130, which is outside the pool.
const POOL: usize = 130;

fn worker() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![0, 1, 64, 129, 130])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (worker(), prompt()).prop_map(|(w, p)| Op::Insert(w, p)),
        3 => prompt().prop_map(Op::Match),
        1 => (worker(), 0..8_usize).prop_map(|(w, c)| Op::SetCapacity(w, c)),
        1 => worker().prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_index_behaves_like_the_naive_model(
        capacity in prop::collection::vec(0..8_usize, POOL),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let seed = prefix_seed("model", None);
        let index = OwnerIndex::new(&capacity);
        let mut model = Model { held: vec![VecDeque::new(); POOL], capacity };
        for op in ops {
            match &op {
                Op::Insert(worker, prompt) => {
                    let hashes = block_hashes(seed, prompt, BLOCK);
                    index.insert(WorkerId(*worker as u32), &hashes);
                    model.insert(*worker, &hashes);
                    prop_assert_eq!(index.matches(&hashes, BLOCK), model.matches(&hashes));
                }
                Op::Match(prompt) => {
                    let hashes = block_hashes(seed, prompt, BLOCK);
                    prop_assert_eq!(index.matches(&hashes, BLOCK), model.matches(&hashes));
                }
                Op::SetCapacity(worker, blocks) => {
                    index.set_capacity(WorkerId(*worker as u32), *blocks);
                    model.set_capacity(*worker, *blocks);
                }
                Op::Remove(worker) => {
                    index.remove_worker(WorkerId(*worker as u32));
                    model.remove(*worker);
                }
            }
            prop_assert_eq!(index.stats(), model.stats(), "after {:?}", op);
            for (worker, held) in model.held.iter().enumerate() {
                prop_assert_eq!(
                    index.held_in_order(WorkerId(worker as u32)),
                    held.iter().copied().collect::<Vec<_>>()
                );
            }
            index.assert_consistent();
        }
        // A sibling that adopts every worker's blocks holds the same lists in the same order, and
        // one with half the capacity keeps each list's most recent half.
        let same = OwnerIndex::new(&model.capacity);
        let half: Vec<usize> = model.capacity.iter().map(|blocks| blocks / 2).collect();
        let smaller = OwnerIndex::new(&half);
        for worker in (0..POOL).map(|worker| WorkerId(worker as u32)) {
            let blocks = index.blocks_of(worker);
            same.adopt(worker, &blocks);
            smaller.adopt(worker, &blocks);
            prop_assert_eq!(same.held_in_order(worker), index.held_in_order(worker));
            let mut newest = index.held_in_order(worker);
            newest.truncate(half[worker.index()]);
            prop_assert_eq!(smaller.held_in_order(worker), newest);
        }
        prop_assert_eq!(same.stats(), index.stats());
        same.assert_consistent();
        smaller.assert_consistent();
    }
}

#[test]
fn concurrent_inserts_and_matches_leave_a_consistent_index() {
    const WORKERS: usize = 8;
    const CAPACITY: usize = 40;
    let index = Arc::new(OwnerIndex::new(&[CAPACITY; WORKERS]));
    let seed = prefix_seed("model", None);
    std::thread::scope(|scope| {
        for thread in 0..4_u64 {
            let index = Arc::clone(&index);
            scope.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(thread);
                for round in 0..3_000 {
                    let len = rng.random_range(0..24);
                    let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..3)).collect();
                    let hashes = block_hashes(seed, &prompt, BLOCK);
                    let worker = WorkerId(rng.random_range(0..WORKERS as u32));
                    index.insert(worker, &hashes);
                    let found = index.matches(&hashes, BLOCK);
                    assert!(found.windows(2).all(|pair| {
                        (Reverse(pair[0].matched_tokens), pair[0].worker)
                            < (Reverse(pair[1].matched_tokens), pair[1].worker)
                    }));
                    assert!(found.iter().all(|owner| {
                        owner.matched_tokens <= hashes.len() as u64 * u64::from(BLOCK.get())
                    }));
                    if thread == 0 && round % 500 == 0 {
                        index.set_capacity(worker, rng.random_range(10..CAPACITY));
                    }
                    if thread == 1 && round % 1_000 == 999 {
                        index.remove_worker(worker);
                        index.set_capacity(worker, CAPACITY);
                    }
                }
            });
        }
    });
    index.assert_consistent();
    let stats = index.stats();
    assert!(stats.held.iter().all(|&held| held <= CAPACITY));
    assert!(stats.blocks <= stats.entries);
}

#[test]
fn long_chains_held_to_many_depths_match_exactly_like_a_linear_walk() {
    // Worker w holds the first depths[w] blocks of one 600-block chain; the walk gallops over the long
    // stretches where nobody drops, and must still find every boundary.
    let seed = prefix_seed("m", None);
    let tokens: Vec<u32> = (0..1200).collect();
    let hashes = block_hashes(seed, &tokens, BLOCK);
    assert_eq!(hashes.len(), 600);
    let depths = [600, 1, 2, 3, 64, 65, 127, 128, 129, 300, 599, 0, 17, 300];
    let index = OwnerIndex::new(&[1000; 14]);
    for (worker, depth) in depths.iter().enumerate() {
        if *depth > 0 {
            index.insert(WorkerId(worker as u32), &hashes[..*depth]);
        }
    }
    let expected = ranked(depths.into_iter().enumerate());
    assert_eq!(index.matches(&hashes, BLOCK), expected);
    // A shorter probe stops at its own end.
    let short = index.matches(&hashes[..100], BLOCK);
    assert!(short.iter().all(|owner| owner.matched_tokens <= 200));
    assert_eq!(short.first().map(|owner| owner.matched_tokens), Some(200));
}

//! Unit tests, and the inspection helpers the model-based tests in `prefix::tests` use too.

use super::*;

const BLOCK: NonZeroU32 = NonZeroU32::new(64).unwrap();

impl OwnerIndex {
    /// `worker`'s blocks, most recent first.
    pub(crate) fn held_in_order(&self, worker: WorkerId) -> Vec<u64> {
        let lru = lock(self.lrus.get(worker.index()).unwrap());
        lru.in_order().into_iter().map(|(_, hash)| hash).collect()
    }

    /// Checks that the LRUs, the block map and the shared lists describe the same (block, owner)
    /// pairs, each pair once, with every slot pointing at its block.
    pub(crate) fn assert_consistent(&self) {
        let mut pairs = 0;
        for (worker, lru) in self.lrus.iter().enumerate() {
            let lru = lock(lru);
            let order = lru.in_order();
            assert_eq!(order.len(), lru.len, "w{worker}: list length");
            assert!(lru.len <= lru.capacity, "w{worker}: over capacity");
            for (slot, hash) in order {
                let holder = Holder {
                    worker: worker as u32,
                    slot: NonZeroU32::new(slot).unwrap(),
                };
                let owned = self.with_owners(hash, |held| match held {
                    Held::Nobody => false,
                    Held::One(one) => one == holder,
                    Held::Several(owners) => owners.holders.contains(&holder),
                });
                assert!(owned, "w{worker}: {hash:x} not owned");
            }
            pairs += lru.len;
        }
        let mut listed = 0;
        let mut shared = 0;
        for block in self.blocks.iter() {
            match *block.value() {
                Owners::One(_) => listed += 1,
                Owners::Shared => {
                    let owners = self.shared.get(block.key()).unwrap();
                    let holders = &owners.holders;
                    assert!(holders.len() >= 2, "{:x}: {holders:?}", block.key());
                    assert!(
                        holders
                            .windows(2)
                            .all(|pair| pair[0].worker < pair[1].worker)
                    );
                    let mut workers = vec![0_u64; owners.workers.len()];
                    for holder in holders {
                        let (word, bit) = bit_of(holder.worker);
                        workers[word] |= bit;
                    }
                    assert_eq!(workers, owners.workers, "{:x}: bitset", block.key());
                    listed += holders.len();
                    shared += 1;
                }
            }
        }
        assert_eq!(listed, pairs, "owner entries vs LRU entries");
        assert_eq!(self.shared.len(), shared, "shared lists vs shared blocks");
    }
}

fn owner(worker: u32, blocks: u64) -> OwnerMatch {
    OwnerMatch {
        worker: WorkerId(worker),
        matched_tokens: blocks * 64,
    }
}

#[test]
fn a_worker_matches_as_many_leading_blocks_as_it_holds() {
    let index = OwnerIndex::new(&[10, 10]);
    index.insert(WorkerId(1), &[1, 2, 3]);
    assert_eq!(index.matches(&[1, 2, 3, 4], BLOCK), [owner(1, 3)]);
    assert_eq!(index.matches(&[1, 2, 9, 3], BLOCK), [owner(1, 2)]);
    assert_eq!(index.matches(&[1, 2], BLOCK), [owner(1, 2)]);
    index.assert_consistent();
}

#[test]
fn a_hole_in_the_chain_stops_the_run() {
    let index = OwnerIndex::new(&[10]);
    index.insert(WorkerId(0), &[1, 3, 4]);
    assert_eq!(index.matches(&[1, 2, 3, 4], BLOCK), [owner(0, 1)]);
}

#[test]
fn a_prompt_whose_first_block_nobody_holds_matches_nobody() {
    let index = OwnerIndex::new(&[10]);
    index.insert(WorkerId(0), &[2, 3]);
    assert_eq!(index.matches(&[1, 2, 3], BLOCK), []);
    assert_eq!(index.matches(&[], BLOCK), []);
}

#[test]
fn owners_come_deepest_first_then_by_worker_id() {
    let index = OwnerIndex::new(&[10, 10, 10, 10]);
    index.insert(WorkerId(3), &[1]);
    index.insert(WorkerId(2), &[1, 2, 3]);
    index.insert(WorkerId(0), &[1]);
    index.insert(WorkerId(1), &[1, 2]);
    assert_eq!(
        index.matches(&[1, 2, 3], BLOCK),
        [owner(2, 3), owner(1, 2), owner(0, 1), owner(3, 1)]
    );
    index.assert_consistent();
}

#[test]
fn the_least_recently_used_blocks_go_first_beyond_capacity() {
    let index = OwnerIndex::new(&[3]);
    index.insert(WorkerId(0), &[1, 2]);
    index.insert(WorkerId(0), &[3, 4]);
    // A chain's first block is its most recent: 2 was the oldest.
    assert_eq!(index.held_in_order(WorkerId(0)), [3, 4, 1]);
    assert_eq!(index.matches(&[1, 2], BLOCK), [owner(0, 1)]);
    index.assert_consistent();
}

#[test]
fn refreshing_a_chain_saves_it_from_eviction() {
    let index = OwnerIndex::new(&[2]);
    index.insert(WorkerId(0), &[1]);
    index.insert(WorkerId(0), &[2]);
    index.insert(WorkerId(0), &[1]);
    index.insert(WorkerId(0), &[3]);
    assert_eq!(index.held_in_order(WorkerId(0)), [3, 1]);
    index.assert_consistent();
}

#[test]
fn a_chain_longer_than_the_capacity_keeps_its_first_blocks() {
    let index = OwnerIndex::new(&[2]);
    index.insert(WorkerId(0), &[1, 2, 3, 4]);
    assert_eq!(index.held_in_order(WorkerId(0)), [1, 2]);
    assert_eq!(index.matches(&[1, 2, 3, 4], BLOCK), [owner(0, 2)]);
    index.assert_consistent();
}

#[test]
fn shrinking_the_capacity_evicts_the_least_recent_blocks() {
    let index = OwnerIndex::new(&[10]);
    index.insert(WorkerId(0), &[1, 2, 3]);
    index.insert(WorkerId(0), &[4]);
    index.set_capacity(WorkerId(0), 2);
    assert_eq!(index.held_in_order(WorkerId(0)), [4, 1]);
    assert_eq!(index.stats().blocks, 2);
    index.insert(WorkerId(0), &[5]);
    assert_eq!(index.held_in_order(WorkerId(0)), [5, 4]);
    index.assert_consistent();
}

#[test]
fn a_worker_without_capacity_holds_nothing_until_it_gets_some() {
    let index = OwnerIndex::new(&[0]);
    index.insert(WorkerId(0), &[1]);
    assert_eq!(index.matches(&[1], BLOCK), []);
    index.set_capacity(WorkerId(0), 1);
    index.insert(WorkerId(0), &[1]);
    assert_eq!(index.matches(&[1], BLOCK), [owner(0, 1)]);
}

#[test]
fn a_removed_worker_disappears_from_every_owner_set() {
    let index = OwnerIndex::new(&[10, 10, 10]);
    index.insert(WorkerId(0), &[1, 2]);
    index.insert(WorkerId(1), &[1, 2, 3]);
    index.insert(WorkerId(2), &[1]);
    index.remove_worker(WorkerId(1));
    assert_eq!(index.matches(&[1, 2, 3], BLOCK), [owner(0, 2), owner(2, 1)]);
    // A decision that raced the removal cannot bring it back.
    index.insert(WorkerId(1), &[1, 2, 3]);
    assert_eq!(index.matches(&[1, 2, 3], BLOCK), [owner(0, 2), owner(2, 1)]);
    assert_eq!(
        index.stats(),
        IndexStats {
            blocks: 2,
            entries: 3,
            held: vec![2, 0, 1],
        }
    );
    index.assert_consistent();
}

#[test]
fn a_shared_block_returns_to_a_single_owner_as_owners_leave() {
    let index = OwnerIndex::new(&[1, 1, 1]);
    for worker in 0..3 {
        index.insert(WorkerId(worker), &[1]);
    }
    index.assert_consistent();
    index.insert(WorkerId(0), &[2]);
    index.insert(WorkerId(2), &[3]);
    assert_eq!(index.matches(&[1], BLOCK), [owner(1, 1)]);
    index.assert_consistent();
    index.remove_worker(WorkerId(1));
    assert_eq!(index.stats().blocks, 2);
    index.assert_consistent();
}

#[test]
fn fleets_beyond_64_workers_match_every_owner() {
    let index = OwnerIndex::new(&[10; 300]);
    for worker in [299, 3, 64, 130, 63] {
        index.insert(WorkerId(worker), &[1, 2]);
    }
    index.insert(WorkerId(130), &[1, 2, 3]);
    index.insert(WorkerId(64), &[1, 5]);
    assert_eq!(
        index.matches(&[1, 2, 3], BLOCK),
        [
            owner(130, 3),
            owner(3, 2),
            owner(63, 2),
            owner(64, 2),
            owner(299, 2)
        ]
    );
    index.assert_consistent();
}

#[test]
fn workers_outside_the_pool_are_ignored() {
    let index = OwnerIndex::new(&[10]);
    index.insert(WorkerId(1), &[1]);
    index.set_capacity(WorkerId(1), 5);
    index.remove_worker(WorkerId(1));
    assert_eq!(index.matches(&[1], BLOCK), []);
    assert_eq!(index.stats().held, [0]);
}

#[test]
fn freed_slots_are_reused_before_the_slab_grows() {
    let index = OwnerIndex::new(&[4]);
    for round in 0..100 {
        index.insert(WorkerId(0), &[round, round + 1000]);
    }
    let lru = lock(&index.lrus[0]);
    // The sentinel, four blocks and the one about to be evicted.
    let (used, allocated) = lru.slab();
    assert_eq!(used, 6);
    assert!(allocated <= 6);
}

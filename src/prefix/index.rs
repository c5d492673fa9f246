//! The owner index: which workers hold which prompt blocks, learned from cachepick's own decisions.
//!
//! Engines do not tell cachepick what they cache, so the index records what cachepick sent where:
//! right after each decision the selected worker's block hashes are inserted, synchronously, so a
//! burst of identical prompts already sees the first one's placement. Each worker keeps its blocks in
//! a least-recently-used list bounded by its KV capacity in blocks, the way the engine's own cache
//! evicts. The index is approximate: a worker may have evicted a block earlier (other traffic, a
//! restart) or kept it longer than the index believes.
//!
//! # Data structures
//! - `blocks`: block hash → its owner, packed with the owner's LRU slot into 8 bytes; a block with
//!   two or more owners says so and keeps its owners in `shared`, as a list sorted by worker and as a
//!   bitset of workers. Most blocks have one owner (the conversation's worker); the shared ones are
//!   mostly system prompts, which many workers hold and many prompts start with.
//! - Per worker an `Lru`: a slab of 16-byte nodes linked in recency order. A node's slot never
//!   moves while the block is held, and the block map remembers it, so refreshing a block needs no
//!   per-worker map. A single-owner block thus costs 16 bytes of LRU plus a 17-byte table bucket
//!   divided by the table's load factor; `benches/prefix.rs` measures 40 to 51 bytes per (block,
//!   owner) entry at a million entries.
//!
//! # Locking
//! Both maps are `DashMap`s, sharded read-write locks, so concurrent `matches` only share-lock
//! shards and never wait for each other, and an insert blocks only the readers of the one shard it
//! is writing. Every path takes locks in this order and holds at most one of each kind at a time: a
//! worker's `Mutex<Lru>`, then one `blocks` shard, then one `shared` shard. `matches` takes no worker
//! lock. Inserts for different workers therefore meet only on shard locks, which nobody holds while
//! waiting for a worker lock, so no cycle (and no deadlock) can form; eviction releases the shard of
//! the block being added before it locks the shard of the block being evicted. No lock is held
//! across I/O or an await.
//!
//! # Recency within a chain
//! [`OwnerIndex::insert`] refreshes a chain from its last block to its first, so the first block
//! ends up most recent. A block's ancestors are in every chain that contains it, so they are always
//! at least as recent as it is: eviction trims chains from their ends and never punches a hole at
//! the start, the same reason vLLM frees a finished request's blocks tail first. It also means a
//! concurrent `matches` sees a worker on a new chain only once the whole chain is in place.

use std::cmp::Reverse;
use std::num::NonZeroU32;
use std::sync::{Mutex, MutexGuard, PoisonError};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::keyed::KeyedHash;
use super::lru::{EngineKeys, Lru, MAX_BLOCKS_PER_WORKER};
use crate::worker::WorkerId;

/// A concurrent map of prompt blocks to the workers believed to hold them, for one pool.
///
/// `Send + Sync`; share it with an `Arc`. Worker ids outside the pool it was built for are ignored.
pub struct OwnerIndex {
    blocks: DashMap<u64, Owners, KeyedHash>,
    /// Owners of the blocks marked `Owners::Shared`.
    shared: DashMap<u64, SharedOwners, KeyedHash>,
    /// One LRU per worker, indexed by [`WorkerId`].
    lrus: Box<[Mutex<Lru>]>,
}

/// One worker's match in the owner index: how many leading prompt tokens it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OwnerMatch {
    pub worker: WorkerId,
    pub matched_tokens: u64,
}

/// What the index holds, for metrics and `cachepick explain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks with at least one owner.
    pub blocks: usize,
    /// (block, owner) pairs: the sum of `held`.
    pub entries: usize,
    /// Blocks each worker holds, indexed by [`WorkerId`].
    pub held: Vec<usize>,
}

impl OwnerIndex {
    /// An empty index for a pool whose worker `i` can hold `capacity_blocks[i]` blocks.
    ///
    /// The caller computes capacities in blocks of the index's block size (engine-reported KV tokens
    /// divided by it, else a configured default); [`OwnerIndex::set_capacity`] corrects them later.
    pub fn new(capacity_blocks: &[usize]) -> Self {
        let hasher = KeyedHash::new();
        OwnerIndex {
            blocks: DashMap::with_hasher(hasher.clone()),
            shared: DashMap::with_hasher(hasher),
            lrus: capacity_blocks
                .iter()
                .map(|&capacity| Mutex::new(Lru::new(capacity)))
                .collect(),
        }
    }

    /// Records that `worker` now holds the chain `hashes` (in prompt order), as its most recently
    /// used blocks, evicting its least recently used blocks beyond its capacity.
    pub fn insert(&self, worker: WorkerId, hashes: &[u64]) {
        self.insert_locked(worker, hashes);
    }

    /// [`OwnerIndex::insert`], returning the worker's LRU still locked (`None` if nothing was held).
    fn insert_locked(&self, worker: WorkerId, hashes: &[u64]) -> Option<MutexGuard<'_, Lru>> {
        let mut lru = lock(self.lrus.get(worker.index())?);
        if lru.capacity == 0 {
            return None;
        }
        // Last block first, so that the first block ends up most recent (see the module docs).
        for &hash in hashes.iter().rev() {
            self.hold(worker.0, &mut lru, hash);
            self.evict_beyond_capacity(worker.0, &mut lru);
        }
        Some(lru)
    }

    /// For each worker holding the chain's first block, how many leading prompt tokens it holds:
    /// the longest run of consecutive blocks from the first, times `block_size`. Deepest first, ties
    /// by worker id.
    ///
    /// The walk follows the chain and intersects the owners still matching with each block's owners,
    /// stopping as soon as none is left, so a miss costs one lookup. Ownership is prefix-closed — a
    /// worker holding a block holds its ancestors, because `insert` refreshes a chain last block
    /// first and eviction takes the least recent — so once a block drops nobody, the walk gallops
    /// ahead (1, 2, 4, … blocks) while every surviving worker still holds the probed block, then
    /// binary-searches the first block where one of them stops. A conversation owned by a few workers
    /// to a few depths thus costs tens of lookups instead of one per block. While an insert races a
    /// match, a probe may see a later block before its ancestors and report a deeper match than the
    /// linear walk would; the index is approximate, and the next decision sees the settled state.
    pub fn matches(&self, hashes: &[u64], block_size: NonZeroU32) -> Vec<OwnerMatch> {
        let mut walk = Walk::new(self.lrus.len(), block_size);
        let Some(&first) = hashes.first() else {
            return walk.finish(1);
        };
        self.with_owners(first, |held| walk.start(held));
        let blocks = hashes.len();
        // `depth` is the index of the next block to apply; every alive worker holds the ones before.
        let mut depth = 1;
        while walk.alive > 0 && depth < blocks {
            let Some(&hash) = hashes.get(depth) else {
                break;
            };
            let alive = walk.alive;
            self.with_owners(hash, |held| walk.step(depth as u64, held));
            depth += 1;
            if walk.alive < alive || walk.alive == 0 {
                continue;
            }
            // Nobody dropped: find the first later block not held by every alive worker.
            let covered = |index: usize| {
                hashes
                    .get(index)
                    .is_some_and(|&hash| self.with_owners(hash, |held| walk.covers(held)))
            };
            let (mut good, mut bad, mut step) = (depth - 1, blocks, 1);
            while good + step < blocks {
                if covered(good + step) {
                    good += step;
                    step *= 2;
                } else {
                    bad = good + step;
                    break;
                }
            }
            while bad - good > 1 {
                let middle = good + (bad - good) / 2;
                if covered(middle) {
                    good = middle;
                } else {
                    bad = middle;
                }
            }
            depth = good + 1;
        }
        walk.finish(depth as u64)
    }

    /// Sets how many blocks `worker` can hold, evicting its least recently used blocks if it now
    /// holds more; engine-reported capacity may arrive after the configured default.
    pub fn set_capacity(&self, worker: WorkerId, blocks: usize) {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return;
        };
        let mut lru = lock(lru);
        lru.capacity = blocks.min(MAX_BLOCKS_PER_WORKER);
        self.evict_beyond_capacity(worker.0, &mut lru);
    }

    /// Forgets every block of `worker`, which was removed from the pool, and gives it no capacity, so
    /// an insert racing the removal records nothing; only [`OwnerIndex::set_capacity`] brings it back
    /// (the picker calls it only for workers its current roster still routes to).
    pub fn remove_worker(&self, worker: WorkerId) {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return;
        };
        let mut lru = lock(lru);
        while let Some(hash) = lru.pop_oldest() {
            self.release(worker.0, hash);
        }
        // Drops the slab too, rather than keeping it for a worker that may never return.
        let engine = lru.engine.is_some();
        *lru = Lru::new(0);
        if engine {
            lru.engine = Some(EngineKeys::new());
        }
    }

    /// An empty index whose workers also remember, per block, the engine's own hash for it (see
    /// [`OwnerIndex::insert_tagged`]): the index of a pool that learns from the engines' KV events.
    pub fn with_engine_keys(capacity_blocks: &[usize]) -> Self {
        let index = OwnerIndex::new(capacity_blocks);
        for lru in &index.lrus {
            lock(lru).engine = Some(EngineKeys::new());
        }
        index
    }

    /// [`OwnerIndex::insert`], then tags the chain's last block with `engine`, the engine's hash of
    /// the block that ends there, so that [`OwnerIndex::tagged`] and [`OwnerIndex::remove_tagged`]
    /// find it by that hash. A block carries one tag; a later tag replaces it, and an engine hash
    /// tags one block. Without engine keys ([`OwnerIndex::new`]) nothing is tagged.
    pub fn insert_tagged(&self, worker: WorkerId, hashes: &[u64], engine: u64) {
        let Some(mut lru) = self.insert_locked(worker, hashes) else {
            return;
        };
        // The last block is the least recent of the chain: a capacity below the chain's length has
        // already evicted it.
        let Some(slot) = hashes.last().and_then(|&tip| self.slot_of(worker.0, tip)) else {
            return;
        };
        lru.tag(slot.get(), engine);
    }

    /// Makes the blocks of the chain `hashes` that `worker` already holds its most recent, first block
    /// most recent, adding none: what a cache hit does to the engine's own LRU, which no event reports.
    pub fn touch(&self, worker: WorkerId, hashes: &[u64]) {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return;
        };
        let mut lru = lock(lru);
        for &hash in hashes.iter().rev() {
            if let Some(slot) = self.slot_of(worker.0, hash) {
                lru.touch(slot);
            }
        }
    }

    /// The block `worker` holds under the engine hash `engine`.
    pub fn tagged(&self, worker: WorkerId, engine: u64) -> Option<u64> {
        let lru = lock(self.lrus.get(worker.index())?);
        let slot = lru.engine.as_ref()?.find(engine)?;
        lru.node(slot).map(|node| node.hash)
    }

    /// Forgets the block `worker` holds under the engine hash `engine`, and returns it.
    pub fn remove_tagged(&self, worker: WorkerId, engine: u64) -> Option<u64> {
        let mut lru = lock(self.lrus.get(worker.index())?);
        let slot = lru.engine.as_ref()?.find(engine)?;
        let hash = lru.node(slot)?.hash;
        lru.remove(slot);
        self.release(worker.0, hash);
        Some(hash)
    }

    /// Forgets that `worker` holds `hash`; whether it did.
    pub fn remove(&self, worker: WorkerId, hash: u64) -> bool {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return false;
        };
        let mut lru = lock(lru);
        let Some(slot) = self.slot_of(worker.0, hash) else {
            return false;
        };
        lru.remove(slot.get());
        self.release(worker.0, hash);
        true
    }

    /// Forgets every block of `worker` (its engine restarted or dropped its cache), keeping its
    /// capacity: unlike [`OwnerIndex::remove_worker`], it goes on learning.
    pub fn clear_worker(&self, worker: WorkerId) {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return;
        };
        let mut lru = lock(lru);
        while let Some(hash) = lru.pop_oldest() {
            self.release(worker.0, hash);
        }
        let capacity = lru.capacity;
        let engine = lru.engine.is_some();
        *lru = Lru::new(capacity);
        if engine {
            lru.engine = Some(EngineKeys::new());
        }
    }

    /// Engine hashes known per worker (tags), indexed by [`WorkerId`].
    pub fn tags(&self) -> Vec<usize> {
        self.lrus
            .iter()
            .map(|lru| lock(lru).engine.as_ref().map_or(0, |keys| keys.tagged()))
            .collect()
    }

    /// The blocks `worker` holds, least recent first: what a starting sibling replica adopts.
    pub fn blocks_of(&self, worker: WorkerId) -> Vec<u64> {
        self.lrus
            .get(worker.index())
            .map(|lru| lock(lru).oldest_first())
            .unwrap_or_default()
    }

    /// Records `blocks` (least recent first, as [`OwnerIndex::blocks_of`] gives them) on `worker`, each
    /// as its most recent block in turn, so the worker's list ends in the order the sibling had,
    /// trimmed to this index's capacity from the least recent end. Prefix closure carries over: the
    /// sibling's ancestors were more recent than their descendants, and so are they here. Returns how
    /// many blocks the worker holds after.
    pub fn adopt(&self, worker: WorkerId, blocks: &[u64]) -> usize {
        let Some(lru) = self.lrus.get(worker.index()) else {
            return 0;
        };
        let mut lru = lock(lru);
        if lru.capacity == 0 {
            return 0;
        }
        // Only the newest `capacity` can stay; replaying the older ones would evict them at once.
        let keep = blocks.len().saturating_sub(lru.capacity);
        for &hash in blocks.get(keep..).unwrap_or_default() {
            self.hold(worker.0, &mut lru, hash);
            self.evict_beyond_capacity(worker.0, &mut lru);
        }
        lru.len
    }

    /// Counts what the index holds. Exact when no insert runs concurrently, otherwise a close view.
    pub fn stats(&self) -> IndexStats {
        let held: Vec<usize> = self.lrus.iter().map(|lru| lock(lru).len).collect();
        IndexStats {
            blocks: self.blocks.len(),
            entries: held.iter().sum(),
            held,
        }
    }

    /// Makes `hash` the most recent block of `worker`, adding it to the block's owners if needed.
    fn hold(&self, worker: u32, lru: &mut Lru, hash: u64) {
        match self.blocks.entry(hash) {
            Entry::Vacant(vacant) => {
                if let Some(slot) = lru.push(hash) {
                    vacant.insert(Owners::One(Holder { worker, slot }));
                }
            }
            Entry::Occupied(mut occupied) => match *occupied.get() {
                Owners::One(holder) if holder.worker == worker => lru.touch(holder.slot),
                Owners::One(other) => {
                    let Some(slot) = lru.push(hash) else {
                        return;
                    };
                    let mut owners = SharedOwners::default();
                    owners.add(other);
                    owners.add(Holder { worker, slot });
                    self.shared.insert(hash, owners);
                    *occupied.get_mut() = Owners::Shared;
                }
                Owners::Shared => {
                    let mut owners = self.shared.entry(hash).or_default();
                    match owners.get(worker) {
                        Some(holder) => lru.touch(holder.slot),
                        None => {
                            if let Some(slot) = lru.push(hash) {
                                owners.add(Holder { worker, slot });
                            }
                        }
                    }
                }
            },
        }
    }

    /// Where `worker` keeps `hash` in its LRU, if it holds it.
    fn slot_of(&self, worker: u32, hash: u64) -> Option<NonZeroU32> {
        let owners = self.blocks.get(&hash)?;
        match *owners {
            Owners::One(holder) => (holder.worker == worker).then_some(holder.slot),
            Owners::Shared => self
                .shared
                .get(&hash)
                .and_then(|shared| shared.get(worker))
                .map(|holder| holder.slot),
        }
    }

    /// Removes `worker` from the owners of `hash`; the block disappears with its last owner.
    fn release(&self, worker: u32, hash: u64) {
        let Entry::Occupied(mut occupied) = self.blocks.entry(hash) else {
            return;
        };
        match *occupied.get() {
            Owners::One(holder) => {
                if holder.worker == worker {
                    occupied.remove();
                }
            }
            Owners::Shared => {
                let Entry::Occupied(mut owners) = self.shared.entry(hash) else {
                    // A shared block always has its owners; without them nobody is known to hold it.
                    occupied.remove();
                    return;
                };
                owners.get_mut().remove(worker);
                match *owners.get().holders.as_slice() {
                    [] => {
                        owners.remove();
                        occupied.remove();
                    }
                    [last] => {
                        owners.remove();
                        *occupied.get_mut() = Owners::One(last);
                    }
                    _ => {}
                }
            }
        }
    }

    fn evict_beyond_capacity(&self, worker: u32, lru: &mut Lru) {
        while lru.len > lru.capacity {
            let Some(oldest) = lru.pop_oldest() else {
                return;
            };
            self.release(worker, oldest);
        }
    }

    /// Runs `f` on the owners of `hash`.
    fn with_owners<R>(&self, hash: u64, f: impl FnOnce(Held<'_>) -> R) -> R {
        let Some(owners) = self.blocks.get(&hash) else {
            return f(Held::Nobody);
        };
        match *owners {
            Owners::One(holder) => {
                drop(owners);
                f(Held::One(holder))
            }
            // The `blocks` guard stays held, so the owners cannot collapse back to one between the
            // two reads; lock order `blocks` then `shared`, as everywhere.
            Owners::Shared => match self.shared.get(&hash) {
                Some(shared) => f(Held::Several(&shared)),
                None => f(Held::Nobody),
            },
        }
    }
}

/// The owners of one block, as `matches` reads them.
enum Held<'a> {
    Nobody,
    One(Holder),
    Several(&'a SharedOwners),
}

/// A worker's hold on a block, and where the block sits in that worker's LRU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    worker: u32,
    slot: NonZeroU32,
}

/// The owners of one block. `Shared` fits in the niche of `slot`, keeping a map bucket at 16 bytes.
#[derive(Clone, Copy, Debug)]
enum Owners {
    One(Holder),
    /// Two or more owners, listed in `OwnerIndex::shared`.
    Shared,
}

const _: () = assert!(size_of::<Owners>() == 8);

/// The owners of a block held by two or more workers: their holds sorted by worker, and the same
/// workers as a bitset, so that `matches` intersects a popular block in one word per 64 workers.
#[derive(Default)]
struct SharedOwners {
    holders: Vec<Holder>,
    workers: Vec<u64>,
}

impl SharedOwners {
    fn get(&self, worker: u32) -> Option<Holder> {
        let at = self.find(worker).ok()?;
        self.holders.get(at).copied()
    }

    /// Adds `holder`, whose worker is not an owner yet.
    fn add(&mut self, holder: Holder) {
        if let Err(at) = self.find(holder.worker) {
            self.holders.insert(at, holder);
            let (word, bit) = bit_of(holder.worker);
            if self.workers.len() <= word {
                self.workers.resize(word + 1, 0);
            }
            if let Some(word) = self.workers.get_mut(word) {
                *word |= bit;
            }
        }
    }

    fn remove(&mut self, worker: u32) {
        if let Ok(at) = self.find(worker) {
            self.holders.remove(at);
            let (word, bit) = bit_of(worker);
            if let Some(word) = self.workers.get_mut(word) {
                *word &= !bit;
            }
        }
    }

    fn find(&self, worker: u32) -> Result<usize, usize> {
        self.holders
            .binary_search_by_key(&worker, |holder| holder.worker)
    }
}

/// The word and the bit of `worker` in a worker bitset.
fn bit_of(worker: u32) -> (usize, u64) {
    ((worker / 64) as usize, 1 << (worker % 64))
}

/// The state of one `matches` call: the workers that held every block so far, as a bitset.
struct Walk {
    /// How many bits of `workers` are set; the walk stops at 0.
    alive: usize,
    workers: Vec<u64>,
    found: Vec<OwnerMatch>,
    block_size: u64,
}

impl Walk {
    fn new(workers: usize, block_size: NonZeroU32) -> Self {
        Walk {
            alive: 0,
            workers: vec![0; workers.div_ceil(64)],
            found: Vec::new(),
            block_size: u64::from(block_size.get()),
        }
    }

    /// Starts from the owners of the first block.
    fn start(&mut self, held: Held<'_>) {
        match held {
            Held::Nobody => {}
            Held::One(holder) => {
                let (word, bit) = bit_of(holder.worker);
                if let Some(word) = self.workers.get_mut(word) {
                    *word = bit;
                    self.alive = 1;
                }
            }
            Held::Several(owners) => {
                for (alive, owners) in self.workers.iter_mut().zip(&owners.workers) {
                    *alive = *owners;
                }
                self.alive = self.count();
            }
        }
    }

    /// Whether every alive worker holds the block.
    fn covers(&self, held: Held<'_>) -> bool {
        match held {
            Held::Nobody => self.alive == 0,
            Held::One(holder) => {
                let (word, bit) = bit_of(holder.worker);
                self.alive == 1 && self.workers.get(word).is_some_and(|alive| alive & bit != 0)
            }
            Held::Several(owners) => self
                .workers
                .iter()
                .enumerate()
                .all(|(at, alive)| *alive & !owners.workers.get(at).copied().unwrap_or(0) == 0),
        }
    }

    /// Keeps the workers holding block `depth`; the others matched `depth` blocks.
    fn step(&mut self, depth: u64, held: Held<'_>) {
        match held {
            Held::Nobody => self.keep(depth, |_| 0),
            Held::One(holder) => {
                let (word, bit) = bit_of(holder.worker);
                // Deep in a conversation one worker is left and holds the block: nothing changes.
                let holds = self.workers.get(word).is_some_and(|alive| alive & bit != 0);
                if !(holds && self.alive == 1) {
                    self.keep(depth, |at| if at == word { bit } else { 0 });
                }
            }
            Held::Several(owners) => {
                self.keep(depth, |at| owners.workers.get(at).copied().unwrap_or(0));
            }
        }
    }

    /// Intersects the alive workers with `owners(word index)`, recording the ones that drop out.
    fn keep(&mut self, depth: u64, owners: impl Fn(usize) -> u64) {
        let matched_tokens = depth * self.block_size;
        for (at, alive) in self.workers.iter_mut().enumerate() {
            let mut dropped = *alive & !owners(at);
            *alive &= !dropped;
            while dropped != 0 {
                let bit = dropped.trailing_zeros();
                dropped &= dropped - 1;
                self.found.push(OwnerMatch {
                    worker: WorkerId(at as u32 * 64 + bit),
                    matched_tokens,
                });
                self.alive = self.alive.saturating_sub(1);
            }
        }
    }

    /// The matches, deepest first, once the workers still alive held all `depth` blocks walked.
    fn finish(mut self, depth: u64) -> Vec<OwnerMatch> {
        if self.alive > 0 {
            self.keep(depth, |_| 0);
        }
        self.found
            .sort_unstable_by_key(|owner| (Reverse(owner.matched_tokens), owner.worker));
        self.found
    }

    fn count(&self) -> usize {
        self.workers
            .iter()
            .map(|word| word.count_ones() as usize)
            .sum()
    }
}

/// A poisoned lock only means a panic elsewhere mid-update, which the lints rule out in `prefix`;
/// routing on whatever it holds beats failing every later request.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;

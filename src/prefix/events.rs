//! The owner index of a pool in `events` mode: what each engine says it holds, re-keyed by tokens.
//!
//! Engines name their blocks with hashes cachepick cannot reproduce (vLLM's default is SHA-256 over a
//! pickle with a per-process seed), so a stored block is keyed by its *tokens* instead: the engine's
//! token ids, cut into blocks of the pool's `block_size` and chained from the prompt's seed exactly as
//! [`block_hashes`] chains a request's prompt. Equal prefixes therefore get equal keys whichever
//! engine, replica or process computed them, and every picker replica that reads the same streams
//! builds the same index with no protocol between replicas. The engine's hash is kept only to resolve
//! a later `BlockRemoved` and a child's parent ([`OwnerIndex::insert_tagged`]).
//!
//! # Engine blocks and index blocks
//! An engine block of `E` tokens and the pool's block of `B` tokens need not agree. A stored engine
//! block continues its parent's chain: the parent's last full index block (its *tip*) plus the
//! tokens after it (its *tail*, shorter than `B`). Appending the block's own tokens completes zero or
//! more index blocks; the last completed one is tagged with the engine hash, the earlier ones (when
//! `E > B`) and the new tail are kept on the side under the same hash. So `E = B` (vLLM's 16 with
//! `block_size: 16`) costs one tagged block each, `E = kB` (SGLang's 64 with 16) k blocks, and `E < B`
//! (SGLang's page size 1) one side entry per page and a tagged block every `B / E` pages. Any `E`
//! works; `E` a multiple of `B` is the cheap case and the one to configure.
//!
//! # Owners
//! Each data-parallel rank of a worker is its own cache with its own engine hashes, so each rank is
//! its own slot in the index; a worker's match is its best rank's. Blocks count only when the engine
//! holds them on the GPU (the caller filters tiers).
//!
//! # Speculation
//! Events arrive after the engine has prefilled, a few hundred milliseconds after the decision. Until
//! then a burst of identical prompts would all miss and scatter, so a decision also records its
//! prompt for the chosen worker in a small speculative index that forgets it after
//! `speculative_ttl`; a worker's match is the deeper of the two, and explain says which.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::hash::block_hashes_into;
use super::index::{IndexStats, OwnerIndex, OwnerMatch, lock};
use super::keyed::KeyedHash;
use crate::config::PoolConfig;
use crate::worker::WorkerId;
use peers::PeerGuesses;

/// Where a worker's match comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DepthSource {
    /// The engine's own KV events.
    Events,
    /// A recent decision of this replica, or of a peer that announced it over `replica_sync`, not yet
    /// confirmed by the engine.
    Speculative,
}

/// One worker's match with where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SourcedMatch {
    pub worker: WorkerId,
    /// Leading tokens the engine's events say the worker holds.
    pub events_tokens: u64,
    /// Leading tokens a recent decision of this replica (or an announced one of a peer) placed there.
    pub speculative_tokens: u64,
}

impl SourcedMatch {
    pub fn source(&self) -> DepthSource {
        if self.events_tokens >= self.speculative_tokens {
            DepthSource::Events
        } else {
            DepthSource::Speculative
        }
    }
}

/// What one `store` did, for the stream's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// Engine blocks recorded.
    pub blocks: u64,
    /// Engine blocks whose parent this index does not know (stored before the subscription, or lost
    /// with a dropped batch): skipped, since their tokens cannot be placed in a chain.
    pub orphans: u64,
    /// Engine blocks not recorded because the slot's side entries are at their bound.
    pub over_bound: u64,
}

/// A stream's position in the index: data-parallel rank `rank` of worker `worker`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot(u32);

/// The owner index of one pool in `events` mode. `Send + Sync`; share it with an `Arc`.
pub struct EventIndex {
    /// Truth from the events, one LRU per (worker, rank) slot, bounded by the worker's capacity.
    truth: OwnerIndex,
    /// Per slot: the side entries of engine blocks that end mid index block or span several.
    sides: Box<[Mutex<Sides>]>,
    /// The worker of each slot.
    slot_worker: Box<[WorkerId]>,
    /// The first slot of each worker.
    first_slot: Box<[u32]>,
    speculative: OwnerIndex,
    guesses: Mutex<Guesses>,
    /// The other replicas' guesses (`replica_sync`), by checkpoint.
    peers: Mutex<PeerGuesses>,
    speculative_ttl: Duration,
    block_size: NonZeroU32,
    workers: usize,
    /// The load snapshot version the capacities were last set from.
    capacity_version: AtomicU64,
    /// Per slot: its stream broke and has not yet shown the engine is the same one, so its entries
    /// make no owner (they may describe a cache that died with its engine).
    suspended: Box<[AtomicBool]>,
}

/// The most blocks a worker's guesses hold, and the longest chain one guess records.
const MAX_GUESSED_BLOCKS: usize = 1 << 14;

/// This replica's guesses in flight: the order they expire in, and for each worker how many of them
/// hold each block, so that a block leaves the guesses with the last guess that holds it. A hot prefix
/// guessed again and again stays while the engine is still prefilling it, which at a fleet's knee
/// takes longer than `speculative_ttl`.
struct Guesses {
    queue: VecDeque<Guess>,
    holding: Vec<HashMap<u64, u32, KeyedHash>>,
}

/// A decision's placement and when it stops counting.
struct Guess {
    until: Instant,
    worker: WorkerId,
    hashes: Box<[u64]>,
}

/// A slot's side entries: engine hash → what a child needs beyond the tagged tip.
#[derive(Default)]
struct Sides {
    entries: HashMap<u64, Side, RandomState>,
    bound: usize,
}

struct Side {
    /// The last full index block at or before the engine block's end (or the seed).
    tip: u64,
    /// Tokens after `tip`, fewer than a block.
    tail: Box<[u32]>,
    /// Index blocks this engine block completed before its last one (only when `E > B`).
    earlier: Box<[u64]>,
}

impl EventIndex {
    /// An empty index for a pool whose worker `i` has `ranks[i]` data-parallel ranks and can hold
    /// `capacity_blocks[i]` of the pool's blocks per rank.
    pub fn new(
        ranks: &[u32],
        capacity_blocks: &[usize],
        block_size: NonZeroU32,
        speculative_ttl: Duration,
    ) -> Self {
        let mut slot_worker = Vec::new();
        let mut first_slot = Vec::new();
        let mut capacities = Vec::new();
        for (worker, (&ranks, &capacity)) in ranks.iter().zip(capacity_blocks).enumerate() {
            first_slot.push(slot_worker.len() as u32);
            for _ in 0..ranks.max(1) {
                slot_worker.push(WorkerId(worker as u32));
                capacities.push(capacity);
            }
        }
        // A guess covers a burst, not a cache: a few thousand blocks a worker.
        let guesses: Vec<usize> = capacity_blocks
            .iter()
            .map(|&c| c.min(MAX_GUESSED_BLOCKS))
            .collect();
        EventIndex {
            truth: OwnerIndex::with_engine_keys(&capacities),
            sides: capacities
                .iter()
                .map(|&bound| {
                    Mutex::new(Sides {
                        entries: HashMap::default(),
                        bound,
                    })
                })
                .collect(),
            slot_worker: slot_worker.into(),
            first_slot: first_slot.into(),
            speculative: OwnerIndex::new(&guesses),
            guesses: Mutex::new(Guesses {
                queue: VecDeque::new(),
                holding: (0..ranks.len())
                    .map(|_| HashMap::with_hasher(KeyedHash::new()))
                    .collect(),
            }),
            peers: Mutex::default(),
            speculative_ttl,
            block_size,
            workers: ranks.len(),
            capacity_version: AtomicU64::new(0),
            suspended: capacities.iter().map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// An index for `pool` whose worker slot `i` can hold `capacity_blocks[i]` blocks per rank. Every
    /// slot has as many rank slots as the pool's largest data-parallel degree (its file's workers and
    /// its template), so a worker that joins later finds its slots laid out; a worker with fewer ranks
    /// leaves the rest empty.
    pub fn for_pool(pool: &PoolConfig, capacity_blocks: &[usize]) -> Self {
        let ranks = vec![Self::ranks_per_worker(pool); capacity_blocks.len()];
        EventIndex::new(
            &ranks,
            capacity_blocks,
            pool.block_size,
            pool.index.speculative_ttl,
        )
    }

    /// Rank slots each worker slot of `pool` gets.
    pub fn ranks_per_worker(pool: &PoolConfig) -> u32 {
        pool.workers
            .iter()
            .map(|worker| worker.dp_size.get())
            .chain([pool.template.dp_size.get()])
            .max()
            .unwrap_or(1)
    }

    /// Forgets everything `worker`'s ranks hold and its guesses, and bounds them at `blocks` (0 for a
    /// slot nobody holds): the slot's worker left, joined, or restarted.
    pub fn reset_worker(&self, worker: WorkerId, blocks: usize) {
        for slot in self.slots_of(worker) {
            self.clear(slot);
            self.suspend(slot, false);
        }
        self.set_capacity(worker, blocks);
    }

    /// Every rank's slot of `worker`; its slots are consecutive.
    fn slots_of(&self, worker: WorkerId) -> impl Iterator<Item = Slot> + '_ {
        let first = self
            .first_slot
            .get(worker.index())
            .copied()
            .unwrap_or(u32::MAX);
        (first..)
            .take_while(move |&slot| self.slot_worker.get(slot as usize) == Some(&worker))
            .map(Slot)
    }

    /// The slot of rank `rank` of `worker`, if both exist.
    pub fn slot(&self, worker: WorkerId, rank: u32) -> Option<Slot> {
        let first = *self.first_slot.get(worker.index())?;
        let slot = first.checked_add(rank)?;
        (self.slot_worker.get(slot as usize) == Some(&worker)).then_some(Slot(slot))
    }

    /// Records engine blocks `blocks` (engine hash, tokens) stored by `slot` after the engine block
    /// `parent` (`None`: the prompt's first block, chained from `seed`).
    pub fn store<'t>(
        &self,
        slot: Slot,
        seed: u64,
        parent: Option<u64>,
        blocks: impl IntoIterator<Item = (u64, &'t [u32])>,
    ) -> Stored {
        let mut stored = Stored::default();
        let worker = WorkerId(slot.0);
        let Some(sides) = self.sides.get(slot.0 as usize) else {
            return stored;
        };
        let mut sides = lock(sides);
        let (mut tip, mut tail): (u64, Vec<u32>) = match parent {
            None => (seed, Vec::new()),
            Some(parent) => match sides.entries.get(&parent) {
                Some(side) => (side.tip, side.tail.to_vec()),
                None => match self.truth.tagged(worker, parent) {
                    Some(tip) => (tip, Vec::new()),
                    None => {
                        stored.orphans = blocks.into_iter().count() as u64;
                        return stored;
                    }
                },
            },
        };
        let block = self.block_size.get() as usize;
        let mut keys = Vec::new();
        let mut tokens = Vec::new();
        for (engine, own) in blocks {
            // The tail and this block's tokens, cut into full index blocks from the tip.
            tokens.clear();
            tokens.extend_from_slice(&tail);
            tokens.extend_from_slice(own);
            block_hashes_into(tip, &tokens, self.block_size, &mut keys);
            let complete = keys.len() * block;
            tail.clear();
            tail.extend_from_slice(tokens.get(complete..).unwrap_or_default());
            if let Some(&last) = keys.last() {
                self.truth.insert_tagged(worker, &keys, engine);
                tip = last;
            }
            let earlier = keys.split_last().map_or(&[][..], |(_, earlier)| earlier);
            if !tail.is_empty() || !earlier.is_empty() {
                if sides.entries.len() >= sides.bound && !sides.entries.contains_key(&engine) {
                    stored.over_bound += 1;
                    continue;
                }
                sides.entries.insert(
                    engine,
                    Side {
                        tip,
                        tail: tail.clone().into(),
                        earlier: earlier.into(),
                    },
                );
            } else {
                sides.entries.remove(&engine);
            }
            stored.blocks += 1;
        }
        stored
    }

    /// Forgets the engine blocks `engines` of `slot`; how many it knew.
    pub fn remove(&self, slot: Slot, engines: &[u64]) -> u64 {
        let worker = WorkerId(slot.0);
        let Some(sides) = self.sides.get(slot.0 as usize) else {
            return 0;
        };
        let mut sides = lock(sides);
        let mut known = 0;
        for &engine in engines {
            let side = sides.entries.remove(&engine);
            let tagged = self.truth.remove_tagged(worker, engine).is_some();
            if let Some(side) = &side {
                for &hash in side.earlier.iter() {
                    self.truth.remove(worker, hash);
                }
            }
            known += u64::from(tagged || side.is_some());
        }
        known
    }

    /// Forgets everything `slot` held: its engine restarted, dropped its cache, or its stream lost
    /// batches that cannot be replayed.
    /// The worker's guesses go too: whatever this replica sent there is not in the new cache.
    pub fn clear(&self, slot: Slot) {
        if let Some(sides) = self.sides.get(slot.0 as usize) {
            let mut sides = lock(sides);
            sides.entries = HashMap::default();
            self.truth.clear_worker(WorkerId(slot.0));
        }
        if let Some(&worker) = self.slot_worker.get(slot.0 as usize) {
            self.speculative.clear_worker(worker);
            lock(&self.peers).clear_worker(worker);
        }
    }

    /// Stops (or resumes) counting `slot`'s entries toward its worker's matches, keeping them: while
    /// its stream is down and until the reconnection shows the same engine is there.
    pub fn suspend(&self, slot: Slot, suspended: bool) {
        if let Some(flag) = self.suspended.get(slot.0 as usize) {
            flag.store(suspended, Ordering::Relaxed);
        }
    }

    /// Whether every rank of `worker` is suspended.
    fn worker_suspended(&self, worker: WorkerId) -> bool {
        let mut slots = self.slots_of(worker).peekable();
        slots.peek().is_some() && slots.all(|slot| self.is_suspended(slot))
    }

    pub fn is_suspended(&self, slot: Slot) -> bool {
        self.suspended
            .get(slot.0 as usize)
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }

    /// Whether the capacities were last set from a snapshot older than `version`; records `version`.
    pub fn capacity_outdated(&self, version: u64) -> bool {
        self.capacity_version.fetch_max(version, Ordering::Relaxed) < version
    }

    /// Bounds every rank of `worker` at `blocks` (the engine-reported KV capacity, which may arrive
    /// after the configured default): the engine's events say what it holds, but nothing it sends may
    /// grow the index beyond what it can hold.
    pub fn set_capacity(&self, worker: WorkerId, blocks: usize) {
        for slot in self.slots_of(worker) {
            self.truth.set_capacity(WorkerId(slot.0), blocks);
            if let Some(sides) = self.sides.get(slot.0 as usize) {
                lock(sides).bound = blocks;
            }
        }
        // A worker that joins after start-up had no capacity when the guesses were sized.
        self.speculative
            .set_capacity(worker, blocks.min(MAX_GUESSED_BLOCKS));
    }

    /// Records that `worker` was just chosen for the prompt `hashes`: a guess until `now +
    /// speculative_ttl`, and the blocks its ranks already hold become their most recent. Engines
    /// report what they store and evict, not what they reuse, so without this the index's own bound
    /// would evict a conversation's hot prefix first while the engine keeps it.
    pub fn speculate(&self, worker: WorkerId, hashes: &[u64], now: Instant) {
        for slot in self.slots_of(worker) {
            self.truth.touch(WorkerId(slot.0), hashes);
        }
        if hashes.is_empty() || self.speculative_ttl.is_zero() {
            return;
        }
        let hashes = hashes.get(..MAX_GUESSED_BLOCKS).unwrap_or(hashes);
        let mut guesses = lock(&self.guesses);
        self.expire(&mut guesses, now);
        let Some(holding) = guesses.holding.get_mut(worker.index()) else {
            return;
        };
        self.speculative.insert(worker, hashes);
        for &hash in hashes {
            *holding.entry(hash).or_insert(0) += 1;
        }
        guesses.queue.push_back(Guess {
            until: now + self.speculative_ttl,
            worker,
            hashes: hashes.into(),
        });
    }

    /// Records another replica's guess (announced over `replica_sync`): `worker` holds the chain whose
    /// checkpoint hashes are `checkpoints`, until `speculative_ttl` passes or the worker's slot is
    /// cleared. `false` when it was not recorded (no guesses kept, or the table is full).
    pub fn peer_guess(&self, worker: WorkerId, checkpoints: &[u64], now: Instant) -> bool {
        if checkpoints.is_empty()
            || self.speculative_ttl.is_zero()
            || worker.index() >= self.workers
        {
            return false;
        }
        let mut peers = lock(&self.peers);
        peers.expire(now);
        peers.insert(worker, checkpoints, now + self.speculative_ttl)
    }

    /// For each worker holding the prompt's first block, how many leading tokens it holds, by the
    /// events or by a live guess (this replica's or a peer's), whichever is deeper. Deepest first, ties by worker id.
    pub fn matches(&self, hashes: &[u64], now: Instant) -> Vec<OwnerMatch> {
        let mut found: Vec<OwnerMatch> = self
            .sourced(hashes, now)
            .into_iter()
            .map(|sourced| OwnerMatch {
                worker: sourced.worker,
                matched_tokens: sourced.events_tokens.max(sourced.speculative_tokens),
            })
            .collect();
        found.sort_unstable_by_key(|owner| (std::cmp::Reverse(owner.matched_tokens), owner.worker));
        found
    }

    /// [`EventIndex::matches`] with both depths, for explain. In worker order.
    pub fn sourced(&self, hashes: &[u64], now: Instant) -> Vec<SourcedMatch> {
        let mut by_worker: Vec<SourcedMatch> = Vec::new();
        for owner in self.truth.matches(hashes, self.block_size) {
            if self.is_suspended(Slot(owner.worker.0)) {
                continue;
            }
            if let Some(&worker) = self.slot_worker.get(owner.worker.index())
                && let Some(found) = sourced_entry(&mut by_worker, worker)
            {
                found.events_tokens = found.events_tokens.max(owner.matched_tokens);
            }
        }
        {
            let mut guesses = lock(&self.guesses);
            self.expire(&mut guesses, now);
        }
        for owner in self.speculative.matches(hashes, self.block_size) {
            // A guess is about the engine this replica sent to; while the worker's streams are down
            // that engine may be gone.
            if self.worker_suspended(owner.worker) {
                continue;
            }
            if let Some(found) = sourced_entry(&mut by_worker, owner.worker) {
                found.speculative_tokens = owner.matched_tokens;
            }
        }
        let peers = {
            let mut peers = lock(&self.peers);
            peers.expire(now);
            peers.deepest(hashes)
        };
        for (worker, depth) in peers {
            if self.worker_suspended(worker) {
                continue;
            }
            let tokens = (depth as u64).saturating_mul(u64::from(self.block_size.get()));
            if let Some(found) = sourced_entry(&mut by_worker, worker) {
                found.speculative_tokens = found.speculative_tokens.max(tokens);
            }
        }
        by_worker
    }

    /// Drops the guesses that expired by `now`; a block goes with the last live guess that holds it.
    fn expire(&self, guesses: &mut Guesses, now: Instant) {
        while guesses
            .queue
            .front()
            .is_some_and(|guess| guess.until <= now)
        {
            let Some(guess) = guesses.queue.pop_front() else {
                break;
            };
            let Some(holding) = guesses.holding.get_mut(guess.worker.index()) else {
                continue;
            };
            for &hash in guess.hashes.iter() {
                let last = match holding.get_mut(&hash) {
                    Some(count) if *count > 1 => {
                        *count -= 1;
                        false
                    }
                    Some(_) => {
                        holding.remove(&hash);
                        true
                    }
                    None => true,
                };
                if last {
                    self.speculative.remove(guess.worker, hash);
                }
            }
            // A burst's counts go with it; the map need not keep the burst's room.
            if holding.capacity() > 4 * holding.len().max(1024) {
                holding.shrink_to(2 * holding.len());
            }
        }
    }

    /// What the index holds, per worker (summed over its ranks), from the events only.
    pub fn stats(&self) -> EventIndexStats {
        let truth = self.truth.stats();
        let tags = self.truth.tags();
        let mut held = vec![0; self.workers];
        let mut engine_keys = vec![0; self.workers];
        let mut side_entries = vec![0; self.workers];
        for (slot, &worker) in self.slot_worker.iter().enumerate() {
            let at = worker.index();
            if let Some(total) = held.get_mut(at) {
                *total += truth.held.get(slot).copied().unwrap_or(0);
            }
            if let Some(total) = engine_keys.get_mut(at) {
                *total += tags.get(slot).copied().unwrap_or(0);
            }
            if let (Some(total), Some(sides)) = (side_entries.get_mut(at), self.sides.get(slot)) {
                *total += lock(sides).entries.len();
            }
        }
        EventIndexStats {
            index: IndexStats {
                blocks: truth.blocks,
                entries: truth.entries,
                held,
            },
            engine_keys,
            side_entries,
            speculative_entries: self.speculative.stats().entries + lock(&self.peers).entries(),
        }
    }
}

/// What an [`EventIndex`] holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventIndexStats {
    /// The blocks the events say each worker holds (on the GPU).
    pub index: IndexStats,
    /// Engine hashes remembered, per worker.
    pub engine_keys: Vec<usize>,
    /// Side entries (engine blocks ending mid index block, or spanning several), per worker.
    pub side_entries: Vec<usize>,
    /// (block, worker) guesses alive.
    pub speculative_entries: usize,
}

/// The entry of `worker` in a list kept in worker order, added with no depth if missing.
fn sourced_entry(by_worker: &mut Vec<SourcedMatch>, worker: WorkerId) -> Option<&mut SourcedMatch> {
    let at = match by_worker.binary_search_by_key(&worker, |found| found.worker) {
        Ok(at) => at,
        Err(at) => {
            by_worker.insert(
                at,
                SourcedMatch {
                    worker,
                    events_tokens: 0,
                    speculative_tokens: 0,
                },
            );
            at
        }
    };
    by_worker.get_mut(at)
}

mod peers;

#[cfg(test)]
mod tests;

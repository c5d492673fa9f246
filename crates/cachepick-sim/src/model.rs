//! One data-parallel rank of a simulated inference engine: a KV block cache with prefix reuse and a
//! scheduler with at most `max_running` running requests and a strict FIFO queue, simplified from
//! vLLM's v1 scheduler.
//!
//! The model is pure and synchronous (no clock, no I/O, no randomness): the server drives it with
//! request events under a lock and asks [`timing`](super::timing) how long each step takes.
//!
//! # Cache
//! A prompt's full blocks of `block_size` tokens are named by chained hashes ([`block_hashes`]); the
//! simulator hashes on its own (64-bit FNV-1a), sharing no code with the picker it is meant to test.
//! Cached blocks live in a map from hash to reference count; the unreferenced ones also sit in an LRU
//! and are evicted oldest first when an admission needs room. A finished request releases its blocks
//! tail first, so a prompt's tail is evicted before its head and the cache stays mostly
//! prefix-closed. The rest of a request's footprint (its partial last prompt block and its output
//! blocks) is anonymous: pinned while it runs, freed when it ends, never reused.
//!
//! # Scheduler
//! A request is admitted when fewer than `max_running` run and its blocks fit in the free plus
//! evictable space; otherwise it waits. Only the head of the queue is ever considered, so a head that
//! does not fit blocks every request behind it (head-of-line blocking, as in vLLM).
// The server calls the model under a lock for every request event: it must not panic on any input.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::HashMap;
use std::num::NonZeroU32;

use hashlink::{LinkedHashMap, LinkedHashSet};

use crate::stats::{RankCounters, RankStats};

/// Identifies a request on one rank; the server assigns them.
pub type RequestId = u64;

/// FNV-1a 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// Parent hash of every prompt's first block ("sim-root" in ASCII), so the first block's hash depends
/// on a fixed seed just like every later block depends on its parent.
const ROOT_PARENT: u64 = 0x7369_6d2d_726f_6f74;

/// A request that starts running: how much of its prompt the cache already held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub id: RequestId,
    /// Prompt tokens found in the prefix cache: whole blocks, at most all but the last prompt token.
    pub cached_tokens: u32,
    /// Prompt tokens the prefill computes; at least one for a non-empty prompt.
    pub uncached_tokens: u32,
}

/// What became of a submitted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submit {
    Admitted(Admission),
    /// Waiting in the FIFO queue behind `position` other requests (0 is the head).
    Queued {
        position: usize,
    },
}

/// Why a rank refuses a request outright.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the rank's waiting queue is full ({limit} requests waiting)")]
    QueueFull { limit: u32 },
    #[error(
        "the request needs {needed_blocks} KV blocks for its prompt and output but the rank holds only \
         {capacity}; it could never run"
    )]
    TooLong { needed_blocks: u64, capacity: u64 },
    /// The server reused an id that is still running or waiting; the model refuses rather than
    /// confuse two requests' blocks.
    #[error("request id {id} is already running or waiting on this rank")]
    DuplicateId { id: RequestId },
}

/// The chained hashes of `prompt`'s full blocks, first block first: each names the whole prefix up
/// to the end of its block. A trailing partial block has no hash.
pub fn block_hashes(prompt: &[u32], block_size: NonZeroU32) -> impl Iterator<Item = u64> + '_ {
    let size = usize::try_from(block_size.get()).unwrap_or(usize::MAX);
    prompt
        .chunks_exact(size)
        .scan(ROOT_PARENT, |parent, block| {
            let mut hash = fnv1a(FNV_OFFSET, &parent.to_le_bytes());
            for token in block {
                hash = fnv1a(hash, &token.to_le_bytes());
            }
            *parent = hash;
            Some(hash)
        })
}

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// A request waiting for admission; its hashes are computed once, at submit.
#[derive(Debug)]
struct Pending {
    hashes: Vec<u64>,
    prompt_len: u64,
    /// Prompt plus output blocks it holds while it runs.
    total_blocks: u64,
}

impl Pending {
    /// Blocks it holds that are not cached: the partial last prompt block and the output blocks.
    fn anonymous_blocks(&self) -> u64 {
        self.total_blocks.saturating_sub(len_u64(self.hashes.len()))
    }
}

/// A running request: the cached blocks it pins and the anonymous blocks it holds.
#[derive(Debug)]
struct Active {
    hashes: Vec<u64>,
    anonymous: u64,
}

/// How an admission would use the cache now.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// Leading blocks found in the cache, capped so at least one prompt token is computed.
    hit_blocks: u64,
    /// Full prompt blocks not in the cache: each needs a free block.
    new_blocks: u64,
    /// Cached blocks the request would take out of the LRU by pinning them: not evictable for it.
    from_lru: u64,
}

/// One data-parallel rank: its KV cache, its running requests and its queue.
#[derive(Debug)]
pub struct RankModel {
    rank: u32,
    block_size: NonZeroU32,
    kv_blocks: NonZeroU32,
    max_running: NonZeroU32,
    max_queue: Option<u32>,
    /// Every cached block, by hash, with the number of running requests that pin it.
    refs: HashMap<u64, u32>,
    /// The cached blocks no running request pins, least recently released first (evicted first).
    lru: LinkedHashSet<u64>,
    /// Anonymous blocks held by running requests.
    anonymous: u64,
    running: HashMap<RequestId, Active>,
    /// Waiting requests in arrival order.
    queue: LinkedHashMap<RequestId, Pending>,
    counters: RankCounters,
}

impl RankModel {
    pub fn new(
        rank: u32,
        block_size: NonZeroU32,
        kv_blocks: NonZeroU32,
        max_running: NonZeroU32,
        max_queue: Option<u32>,
    ) -> RankModel {
        RankModel {
            rank,
            block_size,
            kv_blocks,
            max_running,
            max_queue,
            refs: HashMap::new(),
            lru: LinkedHashSet::new(),
            anonymous: 0,
            running: HashMap::new(),
            queue: LinkedHashMap::new(),
            counters: RankCounters::default(),
        }
    }

    /// A new request with these prompt tokens that will produce `output_tokens` tokens.
    ///
    /// It is admitted at once when nothing waits and it fits; otherwise it joins the queue, unless the
    /// queue is full. A request longer than the whole cache is refused, as it could never run.
    pub fn submit(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        output_tokens: u32,
    ) -> Result<Submit, Refusal> {
        if self.running.contains_key(&id) || self.queue.contains_key(&id) {
            return Err(self.refuse(Refusal::DuplicateId { id }));
        }
        let prompt_len = len_u64(prompt.len());
        let total_blocks = prompt_len
            .saturating_add(u64::from(output_tokens))
            .div_ceil(u64::from(self.block_size.get()));
        let capacity = u64::from(self.kv_blocks.get());
        if total_blocks > capacity {
            return Err(self.refuse(Refusal::TooLong {
                needed_blocks: total_blocks,
                capacity,
            }));
        }
        // Only a request that could start now is worth checking before the queue limit; a full queue
        // refuses the rest without hashing their prompts.
        let may_start = self.queue.is_empty() && self.running() < self.running_limit();
        if !may_start {
            self.check_queue_room()?;
        }
        let pending = Pending {
            hashes: block_hashes(prompt, self.block_size).collect(),
            prompt_len,
            total_blocks,
        };
        if may_start {
            let plan = self.plan(&pending);
            if self.fits(&plan, &pending) {
                return Ok(Submit::Admitted(self.admit(id, pending, plan)));
            }
            self.check_queue_room()?;
        }
        let position = self.queue.len();
        self.queue.insert(id, pending);
        Ok(Submit::Queued { position })
    }

    /// The request ended, running or still waiting: `completed` false means its client went away
    /// (abort). `generated` output tokens are added to the counters. Returns the requests admitted as
    /// a result, in FIFO order. Unknown ids are ignored (returns empty).
    pub fn finish(&mut self, id: RequestId, completed: bool, generated: u32) -> Vec<Admission> {
        if let Some(active) = self.running.remove(&id) {
            self.release(active);
            if completed {
                self.counters.finished_length += 1;
            } else {
                self.counters.aborted += 1;
            }
        } else if self.queue.remove(&id).is_some() {
            // A waiting request never ran: whatever ended it, it did not finish.
            self.counters.aborted += 1;
        } else {
            return Vec::new();
        }
        self.counters.generation_tokens = self
            .counters
            .generation_tokens
            .saturating_add(u64::from(generated));
        self.admit_from_queue()
    }

    /// Changes limits at run time; returns any admissions it allows. Shrinking `kv_blocks` evicts
    /// unreferenced blocks down to the new capacity; if pinned blocks exceed it, nothing more is
    /// admitted until they are released. Running requests beyond a smaller `max_running` run on, and
    /// waiting requests beyond a smaller `max_queue` keep their place. A waiting request longer than a
    /// smaller cache stays at the head (blocking the queue) until its client gives up.
    pub fn set_limits(
        &mut self,
        kv_blocks: NonZeroU32,
        max_running: NonZeroU32,
        max_queue: Option<u32>,
    ) -> Vec<Admission> {
        self.kv_blocks = kv_blocks;
        self.max_running = max_running;
        self.max_queue = max_queue;
        self.trim();
        self.admit_from_queue()
    }

    /// Requests admitted and not finished.
    pub fn running(&self) -> u64 {
        len_u64(self.running.len())
    }

    /// Requests in the queue.
    pub fn waiting(&self) -> u64 {
        len_u64(self.queue.len())
    }

    /// Prompt tokens a request with this prompt would find cached now (no state change).
    pub fn cached_tokens(&self, prompt: &[u32]) -> u32 {
        let prompt_len = len_u64(prompt.len());
        let cacheable = usize::try_from(self.cacheable_blocks(prompt_len)).unwrap_or(usize::MAX);
        let hit = block_hashes(prompt, self.block_size)
            .take(cacheable)
            .take_while(|hash| self.refs.contains_key(hash))
            .count();
        saturate_u32(len_u64(hit).saturating_mul(u64::from(self.block_size.get())))
    }

    /// Every [`RankStats`] field except the latency histograms, which the server keeps.
    pub fn stats(&self) -> RankStats {
        let waiting_uncached_tokens = self
            .queue
            .values()
            .map(|pending| {
                let hit = self.hit_blocks(&pending.hashes, pending.prompt_len);
                pending.prompt_len.saturating_sub(self.tokens(hit))
            })
            .fold(0u64, u64::saturating_add);
        RankStats {
            rank: self.rank,
            running: self.running(),
            waiting: self.waiting(),
            waiting_uncached_tokens,
            kv_used_blocks: self.used_blocks(),
            kv_pinned_blocks: self.pinned_blocks(),
            kv_total_blocks: u64::from(self.kv_blocks.get()),
            block_size: self.block_size.get(),
            max_running: u64::from(self.max_running.get()),
            counters: self.counters,
            ..RankStats::default()
        }
    }

    /// Counts a request refused before it reached the model (e.g. an injected failure).
    pub fn count_rejected(&mut self) {
        self.counters.rejected += 1;
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }

    /// Whether `id` is running or waiting on this rank.
    pub fn is_live(&self, id: RequestId) -> bool {
        self.running.contains_key(&id) || self.queue.contains_key(&id)
    }

    fn refuse(&mut self, refusal: Refusal) -> Refusal {
        self.counters.rejected += 1;
        refusal
    }

    fn check_queue_room(&mut self) -> Result<(), Refusal> {
        match self.max_queue {
            Some(limit) if self.waiting() >= u64::from(limit) => {
                Err(self.refuse(Refusal::QueueFull { limit }))
            }
            _ => Ok(()),
        }
    }

    fn running_limit(&self) -> u64 {
        u64::from(self.max_running.get())
    }

    /// Cached blocks plus anonymous blocks in use.
    fn used_blocks(&self) -> u64 {
        len_u64(self.refs.len()).saturating_add(self.anonymous)
    }

    /// Blocks held by running requests: referenced cached blocks plus anonymous blocks.
    fn pinned_blocks(&self) -> u64 {
        len_u64(self.refs.len().saturating_sub(self.lru.len())).saturating_add(self.anonymous)
    }

    fn tokens(&self, blocks: u64) -> u64 {
        blocks.saturating_mul(u64::from(self.block_size.get()))
    }

    /// Leading blocks a prompt may take from the cache: at least one token is always computed, so a
    /// prompt of exactly N full blocks hits at most N-1 (as vLLM).
    fn cacheable_blocks(&self, prompt_len: u64) -> u64 {
        prompt_len.saturating_sub(1) / u64::from(self.block_size.get())
    }

    fn hit_blocks(&self, hashes: &[u64], prompt_len: u64) -> u64 {
        let cacheable = usize::try_from(self.cacheable_blocks(prompt_len)).unwrap_or(usize::MAX);
        let hit = hashes
            .iter()
            .take(cacheable)
            .take_while(|hash| self.refs.contains_key(hash))
            .count();
        len_u64(hit)
    }

    fn plan(&self, pending: &Pending) -> Plan {
        let mut plan = Plan {
            hit_blocks: self.hit_blocks(&pending.hashes, pending.prompt_len),
            new_blocks: 0,
            from_lru: 0,
        };
        for hash in &pending.hashes {
            match self.refs.get(hash) {
                Some(0) => plan.from_lru += 1,
                Some(_) => {}
                None => plan.new_blocks += 1,
            }
        }
        plan
    }

    /// Whether the request's new and anonymous blocks fit in the free space plus what eviction can
    /// free, not counting the blocks it pins itself. Never true while pinned blocks exceed a shrunk
    /// capacity: then the LRU is empty and `used > capacity`.
    fn fits(&self, plan: &Plan, pending: &Pending) -> bool {
        let needed = plan.new_blocks.saturating_add(pending.anonymous_blocks());
        let evictable = len_u64(self.lru.len()).saturating_sub(plan.from_lru);
        self.used_blocks().saturating_add(needed)
            <= u64::from(self.kv_blocks.get()).saturating_add(evictable)
    }

    /// Starts a request that fits: pins its cached blocks, evicts for the rest, caches its new full
    /// prompt blocks.
    fn admit(&mut self, id: RequestId, pending: Pending, plan: Plan) -> Admission {
        // Pin first, so eviction cannot take a block this request is about to use.
        let mut fresh = Vec::new();
        for hash in &pending.hashes {
            match self.refs.get_mut(hash) {
                Some(count) => {
                    if *count == 0 {
                        self.lru.remove(hash);
                    }
                    *count = count.saturating_add(1);
                }
                None => fresh.push(*hash),
            }
        }
        let anonymous = pending.anonymous_blocks();
        let needed = len_u64(fresh.len()).saturating_add(anonymous);
        let capacity = u64::from(self.kv_blocks.get());
        while self.used_blocks().saturating_add(needed) > capacity && self.evict_one() {}
        // A block past the first miss, or repeated within the prompt, may be cached already.
        for hash in fresh {
            let count = self.refs.entry(hash).or_insert(0);
            *count = count.saturating_add(1);
        }
        self.anonymous = self.anonymous.saturating_add(anonymous);

        let cached = self.tokens(plan.hit_blocks).min(pending.prompt_len);
        let counters = &mut self.counters;
        counters.prompt_tokens = counters.prompt_tokens.saturating_add(pending.prompt_len);
        counters.prefix_queried_tokens = counters
            .prefix_queried_tokens
            .saturating_add(pending.prompt_len);
        counters.prefix_hit_tokens = counters.prefix_hit_tokens.saturating_add(cached);
        self.running.insert(
            id,
            Active {
                hashes: pending.hashes,
                anonymous,
            },
        );
        Admission {
            id,
            cached_tokens: saturate_u32(cached),
            uncached_tokens: saturate_u32(pending.prompt_len.saturating_sub(cached)),
        }
    }

    /// Admits from the head of the queue while the head fits.
    fn admit_from_queue(&mut self) -> Vec<Admission> {
        let mut admitted = Vec::new();
        while self.running() < self.running_limit() {
            let Some((_, head)) = self.queue.front() else {
                break;
            };
            let plan = self.plan(head);
            if !self.fits(&plan, head) {
                break;
            }
            let Some((id, pending)) = self.queue.pop_front() else {
                break;
            };
            admitted.push(self.admit(id, pending, plan));
        }
        admitted
    }

    /// Unpins a finished request's blocks, tail first so the LRU evicts a prompt's tail before its
    /// head, and frees its anonymous blocks.
    fn release(&mut self, active: Active) {
        for hash in active.hashes.iter().rev() {
            if let Some(count) = self.refs.get_mut(hash) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.lru.insert(*hash);
                }
            }
        }
        self.anonymous = self.anonymous.saturating_sub(active.anonymous);
        self.trim();
    }

    /// Evicts unreferenced blocks while the cache holds more than its capacity (after a shrink).
    fn trim(&mut self) {
        let capacity = u64::from(self.kv_blocks.get());
        while self.used_blocks() > capacity && self.evict_one() {}
    }

    /// Evicts the least recently released unreferenced block; false when there is none.
    fn evict_one(&mut self) -> bool {
        match self.lru.pop_front() {
            Some(hash) => {
                self.refs.remove(&hash);
                self.counters.evicted_blocks += 1;
                true
            }
            None => false,
        }
    }
}

fn len_u64(len: usize) -> u64 {
    u64::try_from(len).unwrap_or(u64::MAX)
}

fn saturate_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    /// A rank with block size 4.
    fn rank(kv_blocks: u32, max_running: u32, max_queue: Option<u32>) -> RankModel {
        RankModel::new(0, nz(4), nz(kv_blocks), nz(max_running), max_queue)
    }

    /// `len` tokens starting at `start`, distinct from other ranges.
    fn tokens(start: u32, len: u32) -> Vec<u32> {
        (start..start + len).collect()
    }

    fn admitted(result: Result<Submit, Refusal>) -> Admission {
        match result {
            Ok(Submit::Admitted(admission)) => admission,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    fn hashes(prompt: &[u32]) -> Vec<u64> {
        block_hashes(prompt, nz(4)).collect()
    }

    /// Checks the state invariants that hold after every operation.
    fn check_invariants(model: &RankModel) {
        // The LRU holds exactly the unreferenced cached blocks.
        let zero = model.refs.values().filter(|count| **count == 0).count();
        assert_eq!(zero, model.lru.len());
        for hash in model.lru.iter() {
            assert_eq!(model.refs.get(hash), Some(&0));
        }
        // Reference counts are the running requests' pins; anonymous blocks are theirs too.
        let pins: u64 = model.running.values().map(|a| a.hashes.len() as u64).sum();
        let refs: u64 = model.refs.values().map(|c| u64::from(*c)).sum();
        assert_eq!(pins, refs);
        let anonymous: u64 = model.running.values().map(|a| a.anonymous).sum();
        assert_eq!(anonymous, model.anonymous);
        for active in model.running.values() {
            for hash in &active.hashes {
                assert!(model.refs.get(hash).is_some_and(|c| *c > 0));
            }
        }
        for id in model.queue.keys() {
            assert!(!model.running.contains_key(id));
        }
        // Over capacity only while everything cached is pinned (after a shrink).
        let stats = model.stats();
        assert!(stats.kv_used_blocks <= stats.kv_total_blocks || model.lru.is_empty());
        assert!(stats.kv_pinned_blocks <= stats.kv_used_blocks);
        assert_eq!(stats.running, model.running.len() as u64);
        assert_eq!(stats.waiting, model.queue.len() as u64);
        assert_eq!(
            stats.kv_used_blocks,
            model.refs.len() as u64 + model.anonymous
        );
        // Work conserving: a head that could start would have started.
        if let Some((_, head)) = model.queue.front()
            && model.running() < model.running_limit()
        {
            assert!(!model.fits(&model.plan(head), head));
        }
    }

    #[test]
    fn block_hashes_are_chained_and_cover_full_blocks_only() {
        let a = hashes(&tokens(0, 11));
        assert_eq!(a.len(), 2);
        let b = hashes(&tokens(0, 8));
        assert_eq!(a, b);
        // Same second block after a different first block: a different hash.
        let mut c = tokens(0, 8);
        c[0] = 99;
        let c = hashes(&c);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        assert!(hashes(&[]).is_empty());
        assert!(hashes(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn repeated_prompt_hits_all_but_the_last_token() {
        let mut model = rank(64, 4, None);
        let prompt = tokens(0, 10);
        let first = admitted(model.submit(1, &prompt, 5));
        assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 10));
        model.finish(1, true, 5);
        assert_eq!(model.cached_tokens(&prompt), 8);
        let second = admitted(model.submit(2, &prompt, 5));
        assert_eq!((second.cached_tokens, second.uncached_tokens), (8, 2));

        // Exactly three full blocks: the last one is always computed.
        let exact = tokens(100, 12);
        admitted(model.submit(3, &exact, 0));
        model.finish(3, true, 0);
        assert_eq!(model.cached_tokens(&exact), 8);
        let again = admitted(model.submit(4, &exact, 0));
        assert_eq!((again.cached_tokens, again.uncached_tokens), (8, 4));

        let counters = model.stats().counters;
        assert_eq!(counters.prompt_tokens, 44);
        assert_eq!(counters.prefix_queried_tokens, 44);
        assert_eq!(counters.prefix_hit_tokens, 16);
        assert_eq!(counters.generation_tokens, 5);
        assert_eq!(counters.finished_length, 2);
    }

    #[test]
    fn shared_prefix_hits_exactly_the_shared_full_blocks() {
        let mut model = rank(64, 4, None);
        admitted(model.submit(1, &tokens(0, 16), 0));
        // Shares 6 tokens: one full block.
        let mut other = tokens(0, 6);
        other.extend(tokens(500, 10));
        assert_eq!(admitted(model.submit(2, &other, 0)).cached_tokens, 4);
        // Shares 12 tokens: three full blocks, hit while the first request still runs (shared).
        let mut other = tokens(0, 12);
        other.extend(tokens(700, 3));
        assert_eq!(admitted(model.submit(3, &other, 0)).cached_tokens, 12);
        assert_eq!(model.cached_tokens(&[]), 0);
        assert_eq!(admitted(model.submit(4, &[], 0)).cached_tokens, 0);
        check_invariants(&model);
    }

    #[test]
    fn queue_forms_beyond_max_running_and_drains_in_fifo_order() {
        let mut model = rank(64, 2, None);
        admitted(model.submit(1, &tokens(0, 4), 1));
        admitted(model.submit(2, &tokens(10, 4), 1));
        assert_eq!(
            model.submit(3, &tokens(20, 4), 1),
            Ok(Submit::Queued { position: 0 })
        );
        assert_eq!(
            model.submit(4, &tokens(30, 4), 1),
            Ok(Submit::Queued { position: 1 })
        );
        assert_eq!((model.running(), model.waiting()), (2, 2));
        let next = model.finish(2, true, 1);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
        let next = model.finish(1, true, 1);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [4]);
        assert_eq!((model.running(), model.waiting()), (2, 0));
        assert!(model.finish(77, true, 1).is_empty());
        check_invariants(&model);
    }

    #[test]
    fn full_queue_refuses() {
        let mut model = rank(64, 1, Some(1));
        admitted(model.submit(1, &tokens(0, 4), 1));
        assert_eq!(
            model.submit(2, &tokens(10, 4), 1),
            Ok(Submit::Queued { position: 0 })
        );
        assert_eq!(
            model.submit(3, &tokens(20, 4), 1),
            Err(Refusal::QueueFull { limit: 1 })
        );
        assert_eq!(model.stats().counters.rejected, 1);
        model.count_rejected();
        assert_eq!(model.stats().counters.rejected, 2);

        // A request that can start is never refused for a full (zero-length) queue.
        let mut model = rank(64, 1, Some(0));
        admitted(model.submit(1, &tokens(0, 4), 1));
        assert_eq!(
            model.submit(2, &tokens(10, 4), 1),
            Err(Refusal::QueueFull { limit: 0 })
        );
    }

    #[test]
    fn request_longer_than_the_cache_is_refused() {
        let mut model = rank(4, 1, None);
        assert_eq!(
            model.submit(1, &tokens(0, 16), 1),
            Err(Refusal::TooLong {
                needed_blocks: 5,
                capacity: 4
            })
        );
        assert_eq!(model.stats().counters.rejected, 1);
        admitted(model.submit(2, &tokens(0, 16), 0));
        assert_eq!(
            model.submit(2, &tokens(0, 1), 0),
            Err(Refusal::DuplicateId { id: 2 })
        );
        assert_eq!(model.stats().counters.rejected, 2);
        let message = Refusal::TooLong {
            needed_blocks: 5,
            capacity: 4,
        }
        .to_string();
        assert!(message.contains("5 KV blocks") && message.contains("only 4"));
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut model = rank(6, 4, None);
        let a = tokens(0, 12);
        let b = tokens(100, 12);
        admitted(model.submit(1, &a, 0));
        model.finish(1, true, 0);
        admitted(model.submit(2, &b, 0));
        model.finish(2, true, 0);
        assert_eq!(model.stats().kv_used_blocks, 6);
        // A probe one token longer may hit all three blocks of a prompt.
        let probe = |p: &[u32]| {
            let mut p = p.to_vec();
            p.push(9999);
            p
        };
        assert_eq!(model.cached_tokens(&probe(&a)), 12);
        assert_eq!(model.cached_tokens(&probe(&b)), 12);

        let ha = hashes(&a);
        admitted(model.submit(3, &tokens(200, 4), 0));
        assert!(!model.refs.contains_key(&ha[2]));
        assert_eq!(model.cached_tokens(&probe(&a)), 8);
        admitted(model.submit(4, &tokens(300, 4), 0));
        assert_eq!(model.cached_tokens(&probe(&a)), 4);
        assert_eq!(model.cached_tokens(&probe(&b)), 12);
        admitted(model.submit(5, &tokens(400, 4), 0));
        assert_eq!(model.cached_tokens(&probe(&a)), 0);
        assert_eq!(model.cached_tokens(&probe(&b)), 12);
        admitted(model.submit(6, &tokens(500, 4), 0));
        assert_eq!(model.cached_tokens(&probe(&b)), 8);
        assert_eq!(model.stats().counters.evicted_blocks, 4);
        check_invariants(&model);
    }

    #[test]
    fn hit_refreshes_recency() {
        let mut model = rank(6, 4, None);
        let a = tokens(0, 12);
        let b = tokens(100, 12);
        admitted(model.submit(1, &a, 0));
        model.finish(1, true, 0);
        admitted(model.submit(2, &b, 0));
        model.finish(2, true, 0);
        // Reusing A makes B the least recently used.
        admitted(model.submit(3, &a, 0));
        model.finish(3, true, 0);
        admitted(model.submit(4, &tokens(200, 4), 0));
        let hb = hashes(&b);
        assert!(!model.refs.contains_key(&hb[2]));
        assert_eq!(model.cached_tokens(&[a.clone(), vec![1]].concat()), 12);
    }

    #[test]
    fn pinned_blocks_survive_pressure_and_the_head_blocks_the_queue() {
        let mut model = rank(6, 4, None);
        let r = tokens(0, 12);
        // Three cached blocks and one anonymous output block.
        admitted(model.submit(1, &r, 4));
        let stats = model.stats();
        assert_eq!((stats.kv_used_blocks, stats.kv_pinned_blocks), (4, 4));
        // Needs three blocks; two are free and nothing is evictable: waits at the head.
        assert_eq!(
            model.submit(2, &tokens(100, 8), 4),
            Ok(Submit::Queued { position: 0 })
        );
        // Fits in one block but waits behind the head.
        assert_eq!(
            model.submit(3, &tokens(200, 1), 0),
            Ok(Submit::Queued { position: 1 })
        );
        for hash in hashes(&r) {
            assert_eq!(model.refs.get(&hash), Some(&1));
        }
        assert_eq!(model.stats().counters.evicted_blocks, 0);
        // A request sharing the pinned prefix would hit it (but it waits: the queue is not empty).
        assert_eq!(model.cached_tokens(&tokens(0, 13)), 12);
        check_invariants(&model);

        let next = model.finish(1, true, 4);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [2, 3]);
        // Request 3 took the one block it needed from R's tail.
        assert_eq!(model.stats().counters.evicted_blocks, 1);
        assert_eq!(model.cached_tokens(&tokens(0, 13)), 8);
        check_invariants(&model);
    }

    #[test]
    fn aborting_a_waiting_request_lets_the_next_one_in() {
        let mut model = rank(6, 4, None);
        admitted(model.submit(1, &tokens(0, 12), 4));
        assert_eq!(
            model.submit(2, &tokens(100, 8), 4),
            Ok(Submit::Queued { position: 0 })
        );
        assert_eq!(
            model.submit(3, &tokens(200, 1), 0),
            Ok(Submit::Queued { position: 1 })
        );
        let next = model.finish(2, false, 0);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
        let stats = model.stats();
        assert_eq!((stats.running, stats.waiting), (2, 0));
        assert_eq!(stats.counters.aborted, 1);
        model.finish(1, false, 2);
        let counters = model.stats().counters;
        assert_eq!((counters.aborted, counters.generation_tokens), (2, 2));
        check_invariants(&model);
    }

    #[test]
    fn stats_report_the_state() {
        let mut model = RankModel::new(3, nz(4), nz(10), nz(1), Some(5));
        admitted(model.submit(1, &tokens(0, 10), 3));
        model.finish(1, true, 3);
        // Running: 8 cached tokens hit, blocks [c0 c1] pinned, [partial+output] anonymous = 4-2.
        admitted(model.submit(2, &tokens(0, 10), 3));
        // Waiting: shares 8 tokens with the cache, 14 long.
        let mut waiting = tokens(0, 8);
        waiting.extend(tokens(900, 6));
        assert_eq!(
            model.submit(3, &waiting, 0),
            Ok(Submit::Queued { position: 0 })
        );
        let stats = model.stats();
        assert_eq!(stats.rank, 3);
        assert_eq!((stats.running, stats.waiting), (1, 1));
        assert_eq!(stats.waiting_uncached_tokens, 6);
        assert_eq!(stats.kv_used_blocks, 4);
        assert_eq!(stats.kv_pinned_blocks, 4);
        assert_eq!(stats.kv_total_blocks, 10);
        assert_eq!(stats.block_size, 4);
        assert_eq!(stats.max_running, 1);
        assert_eq!(stats.ttft, Default::default());
        assert_eq!(stats.counters.prompt_tokens, 20);
        assert_eq!(stats.counters.prefix_hit_tokens, 8);
        assert!((stats.kv_usage() - 0.4).abs() < 1e-9);
        check_invariants(&model);
    }

    #[test]
    fn set_limits_shrinks_and_grows() {
        let mut model = rank(8, 1, None);
        admitted(model.submit(1, &tokens(0, 8), 0));
        model.finish(1, true, 0);
        admitted(model.submit(2, &tokens(100, 12), 4));
        assert_eq!(model.stats().kv_used_blocks, 6);
        assert_eq!(
            model.submit(3, &tokens(200, 1), 0),
            Ok(Submit::Queued { position: 0 })
        );
        // Growing max_running admits the head.
        let next = model.set_limits(nz(8), nz(2), None);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
        assert_eq!(model.stats().kv_used_blocks, 7);

        // Shrinking below the pinned blocks evicts everything unpinned and admits nothing.
        assert!(model.set_limits(nz(3), nz(4), None).is_empty());
        let stats = model.stats();
        assert_eq!((stats.kv_used_blocks, stats.kv_pinned_blocks), (5, 5));
        assert_eq!(stats.counters.evicted_blocks, 2);
        assert_eq!(
            model.submit(4, &tokens(300, 1), 0),
            Ok(Submit::Queued { position: 0 })
        );
        check_invariants(&model);
        // Still over capacity after request 3 leaves: nothing is admitted.
        assert!(model.finish(3, true, 0).is_empty());
        assert_eq!(model.stats().kv_used_blocks, 4);
        // Request 2 leaves: its blocks are trimmed to the capacity and request 4 runs.
        let next = model.finish(2, true, 4);
        assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [4]);
        assert!(model.stats().kv_used_blocks <= 3);
        check_invariants(&model);

        // Growing the cache again lets a longer request run.
        assert!(model.submit(5, &tokens(0, 20), 0).is_err());
        model.set_limits(nz(8), nz(4), None);
        admitted(model.submit(5, &tokens(0, 20), 0));
        check_invariants(&model);
    }

    #[test]
    fn huge_prompt_is_cheap_enough() {
        let mut model = RankModel::new(0, nz(16), nz(8192), nz(64), None);
        let prompt = tokens(0, 100_000);
        admitted(model.submit(1, &prompt, 64));
        model.finish(1, true, 64);
        let again = admitted(model.submit(2, &prompt, 64));
        assert_eq!(again.cached_tokens, 99_984);
        assert_eq!(again.uncached_tokens, 16);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Submit {
            family: u32,
            shared: u32,
            variant: u32,
            suffix: u32,
            output: u32,
        },
        Finish {
            pick: usize,
            completed: bool,
            generated: u32,
        },
        FinishUnknown,
        SetLimits {
            kv_blocks: u32,
            max_running: u32,
            max_queue: Option<u32>,
        },
        CountRejected,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0u32..3, 0u32..40, 0u32..3, 0u32..12, 0u32..12).prop_map(
                |(family, shared, variant, suffix, output)| Op::Submit {
                    family,
                    shared,
                    variant,
                    suffix,
                    output
                }
            ),
            4 => (any::<usize>(), any::<bool>(), 0u32..20).prop_map(|(pick, completed, generated)| {
                Op::Finish {
                    pick,
                    completed,
                    generated,
                }
            }),
            1 => Just(Op::FinishUnknown),
            1 => (1u32..40, 1u32..6, proptest::option::of(0u32..5)).prop_map(
                |(kv_blocks, max_running, max_queue)| Op::SetLimits {
                    kv_blocks,
                    max_running,
                    max_queue
                }
            ),
            1 => Just(Op::CountRejected),
        ]
    }

    /// A prompt from a family's shared stem followed by a variant's suffix, so prompts share
    /// prefixes of many lengths.
    fn prompt(family: u32, shared: u32, variant: u32, suffix: u32) -> Vec<u32> {
        let mut prompt: Vec<u32> = (0..shared).map(|i| family * 1000 + i).collect();
        prompt.extend((0..suffix).map(|i| 100_000 + family * 10_000 + variant * 1000 + i));
        prompt
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn random_event_sequences_keep_the_invariants(
            block_size in 1u32..6,
            kv_blocks in 1u32..40,
            max_running in 1u32..6,
            max_queue in proptest::option::of(0u32..5),
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut model = RankModel::new(0, nz(block_size), nz(kv_blocks), nz(max_running), max_queue);
            let mut next_id: RequestId = 0;
            let mut live: BTreeSet<RequestId> = BTreeSet::new();
            let mut prompt_lens = std::collections::HashMap::new();
            let mut last_admitted: Option<RequestId> = None;
            let (mut submitted, mut refused, mut ended, mut injected) = (0u64, 0u64, 0u64, 0u64);

            for op in ops {
                let used_before = model.stats().kv_used_blocks;
                let running_before = model.running();
                let mut admissions = Vec::new();
                let mut limits_changed = false;
                match op {
                    Op::Submit { family, shared, variant, suffix, output } => {
                        let tokens = prompt(family, shared, variant, suffix);
                        let id = next_id;
                        next_id += 1;
                        submitted += 1;
                        prompt_lens.insert(id, tokens.len() as u32);
                        let expected_cached = model.cached_tokens(&tokens);
                        match model.submit(id, &tokens, output) {
                            Ok(Submit::Admitted(admission)) => {
                                prop_assert_eq!(admission.cached_tokens, expected_cached);
                                live.insert(id);
                                admissions.push(admission);
                            }
                            Ok(Submit::Queued { position }) => {
                                prop_assert_eq!(position as u64 + 1, model.waiting());
                                live.insert(id);
                            }
                            Err(Refusal::TooLong { needed_blocks, capacity }) => {
                                prop_assert!(needed_blocks > capacity);
                                refused += 1;
                            }
                            Err(Refusal::QueueFull { limit }) => {
                                prop_assert_eq!(Some(limit), model.max_queue);
                                prop_assert!(model.waiting() >= u64::from(limit));
                                refused += 1;
                            }
                            Err(Refusal::DuplicateId { .. }) => prop_assert!(false, "fresh id refused"),
                        }
                    }
                    Op::Finish { pick, completed, generated } => {
                        if !live.is_empty() {
                            let id = *live.iter().nth(pick % live.len()).unwrap();
                            live.remove(&id);
                            ended += 1;
                            admissions = model.finish(id, completed, generated);
                        }
                    }
                    Op::FinishUnknown => {
                        prop_assert!(model.finish(next_id + 1000, true, 5).is_empty());
                    }
                    Op::SetLimits { kv_blocks, max_running, max_queue } => {
                        limits_changed = true;
                        admissions = model.set_limits(nz(kv_blocks), nz(max_running), max_queue);
                    }
                    Op::CountRejected => {
                        injected += 1;
                        model.count_rejected();
                    }
                }

                check_invariants(&model);
                let stats = model.stats();
                for admission in &admissions {
                    // FIFO: ids are submitted in increasing order, so admissions are too.
                    prop_assert!(last_admitted.is_none_or(|last| admission.id > last));
                    last_admitted = Some(admission.id);
                    prop_assert!(model.running.contains_key(&admission.id));
                    prop_assert_eq!(
                        admission.cached_tokens + admission.uncached_tokens,
                        prompt_lens[&admission.id]
                    );
                    prop_assert_eq!(admission.cached_tokens % block_size, 0);
                }
                if !admissions.is_empty() {
                    prop_assert!(stats.kv_used_blocks <= stats.kv_total_blocks);
                    prop_assert!(stats.running <= stats.max_running);
                }
                if !limits_changed {
                    // Only a shrink can put the rank over its limits, and it does not grow over them.
                    if stats.kv_used_blocks > stats.kv_total_blocks {
                        prop_assert!(used_before > stats.kv_total_blocks);
                    }
                    if stats.running > stats.max_running {
                        prop_assert!(stats.running <= running_before);
                    }
                }
                prop_assert_eq!(stats.running + stats.waiting, live.len() as u64);
                let c = stats.counters;
                prop_assert_eq!(c.rejected, refused + injected);
                prop_assert_eq!(c.finished_length + c.aborted, ended);
                prop_assert_eq!(submitted, refused + ended + live.len() as u64);
            }
        }
    }
}

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
//! # Events
//! With [`RankModel::record_events`] on, the model also keeps the KV cache events an engine would
//! publish for what it did, in order, until the server takes them ([`RankModel::take_events`]) after
//! each call and publishes them as one batch (one scheduler step). A [`CacheEvent::Stored`] names the
//! full blocks an admission actually inserted (one event per run of consecutive new blocks, with the
//! hash of the block before the run as its parent); a [`CacheEvent::Removed`] the blocks eviction
//! dropped; [`CacheEvent::AllCleared`] a reset of the prefix cache. Blocks found in the cache produce
//! nothing. The hashes are the model's own.
//!
//! # Scheduler
//! A request is admitted when fewer than `max_running` run and its blocks fit in the free plus
//! evictable space; otherwise it waits. Only the head of the queue is ever considered, so a head that
//! does not fit blocks every request behind it (head-of-line blocking, as in vLLM).
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

/// A change of the KV cache, as an engine reports it in its KV cache events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive full blocks entered the cache: `hashes[i]` covers
    /// `tokens[i * block_size..(i + 1) * block_size]`; `parent` is the hash of the block before the
    /// first one (`None` for a prompt's first block).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    /// Blocks were evicted, in eviction order.
    Removed { hashes: Vec<u64> },
    /// The whole prefix cache was dropped.
    AllCleared,
}

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
    /// The tokens of the full blocks, kept only while the model records events.
    tokens: Vec<u32>,
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
    /// The events not yet taken, when recording.
    events: Option<Vec<CacheEvent>>,
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
            events: None,
        }
    }

    /// Starts (or stops) recording the KV cache events of every later call. Off by default: nothing
    /// takes the events of a rank that does not publish them.
    pub fn record_events(&mut self, on: bool) {
        if on != self.events.is_some() {
            self.events = on.then(Vec::new);
        }
    }

    /// The events recorded since the last call, oldest first; empty when not recording.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Drops every cached block, as vLLM's `/reset_prefix_cache` and SGLang's `/flush_cache` do:
    /// only when no request runs (their blocks are in use), so it returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.running.is_empty() {
            return false;
        }
        self.refs.clear();
        self.lru.clear();
        if let Some(events) = &mut self.events {
            events.push(CacheEvent::AllCleared);
        }
        true
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
        let hashes: Vec<u64> = block_hashes(prompt, self.block_size).collect();
        let tokens = if self.events.is_some() {
            let full = hashes
                .len()
                .saturating_mul(usize::try_from(self.block_size.get()).unwrap_or(usize::MAX));
            prompt.get(..full).unwrap_or(prompt).to_vec()
        } else {
            Vec::new()
        };
        let pending = Pending {
            hashes,
            tokens,
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
        let waiting_tokens = self
            .queue
            .values()
            .map(|pending| pending.prompt_len)
            .fold(0u64, u64::saturating_add);
        RankStats {
            rank: self.rank,
            running: self.running(),
            waiting: self.waiting(),
            requests: self.running().saturating_add(self.waiting()),
            waiting_uncached_tokens,
            waiting_tokens,
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
        for (index, hash) in pending.hashes.iter().enumerate() {
            match self.refs.get_mut(hash) {
                Some(count) => {
                    if *count == 0 {
                        self.lru.remove(hash);
                    }
                    *count = count.saturating_add(1);
                }
                None => fresh.push((index, *hash)),
            }
        }
        let anonymous = pending.anonymous_blocks();
        let needed = len_u64(fresh.len()).saturating_add(anonymous);
        let capacity = u64::from(self.kv_blocks.get());
        while self.used_blocks().saturating_add(needed) > capacity && self.evict_one() {}
        // A block past the first miss may be cached already (it was not fresh then); a block
        // repeated within the prompt is inserted once, by its first occurrence.
        let mut inserted = Vec::new();
        for (index, hash) in fresh {
            let count = self.refs.entry(hash).or_insert(0);
            if *count == 0 {
                inserted.push(index);
            }
            *count = count.saturating_add(1);
        }
        self.record_stored(&pending, &inserted);
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

    /// One `Stored` event per run of consecutive inserted blocks (`inserted` holds their indices in
    /// the prompt, ascending).
    fn record_stored(&mut self, pending: &Pending, inserted: &[usize]) {
        let Some(events) = &mut self.events else {
            return;
        };
        let size = usize::try_from(self.block_size.get()).unwrap_or(usize::MAX);
        let mut rest = inserted;
        while let Some((&start, _)) = rest.split_first() {
            let run = rest
                .iter()
                .enumerate()
                .take_while(|(offset, index)| **index == start.saturating_add(*offset))
                .count();
            let end = start.saturating_add(run);
            let hashes = pending.hashes.get(start..end).unwrap_or_default().to_vec();
            let tokens = pending
                .tokens
                .get(start.saturating_mul(size)..end.saturating_mul(size))
                .unwrap_or_default()
                .to_vec();
            let parent = start
                .checked_sub(1)
                .and_then(|before| pending.hashes.get(before))
                .copied();
            events.push(CacheEvent::Stored {
                hashes,
                parent,
                tokens,
            });
            rest = rest.get(run..).unwrap_or_default();
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
                if let Some(events) = &mut self.events {
                    // Evictions of one call are one event, as an engine frees blocks in a sweep.
                    match events.last_mut() {
                        Some(CacheEvent::Removed { hashes }) => hashes.push(hash),
                        _ => events.push(CacheEvent::Removed { hashes: vec![hash] }),
                    }
                }
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
mod tests;

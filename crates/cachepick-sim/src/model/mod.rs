//! One data-parallel rank of the slots model (`timing: slots`): the KV block cache ([`crate::cache`])
//! with a scheduler of at most `max_running` running requests and a strict FIFO queue, simplified from
//! vLLM's v1 scheduler.
//!
//! The model is pure and synchronous (no clock, no I/O, no randomness): the server drives it with
//! request events under a lock and asks [`timing`](super::timing) how long each request's prefill and
//! tokens take.
//!
//! # Cache
//! An admitted request holds blocks for its whole prompt and output at once: its prompt's full blocks
//! cached (a hit pins the cached ones), the rest anonymous. A finished request releases its blocks
//! tail first, so a prompt's tail is evicted before its head and the cache stays mostly prefix-closed.
//!
//! # Events
//! With [`RankModel::record_events`] on, the cache keeps the KV cache events an engine would publish
//! for what it did, in order, until the server takes them ([`RankModel::take_events`]) after each call
//! and publishes them as one batch. A [`CacheEvent::Stored`] names the full blocks an admission actually
//! inserted (one event per run of consecutive new blocks, with the hash of the block before the run as
//! its parent); a [`CacheEvent::Removed`] the blocks eviction dropped; [`CacheEvent::AllCleared`] a
//! reset of the prefix cache. Blocks found in the cache produce nothing.
//!
//! # Scheduler
//! A request is admitted when fewer than `max_running` run and its blocks fit in the free plus
//! evictable space; otherwise it waits. Only the head of the queue is ever considered, so a head that
//! does not fit blocks every request behind it (head-of-line blocking, as in vLLM).
use std::collections::HashMap;
use std::num::NonZeroU32;

use hashlink::LinkedHashMap;

use crate::cache::{BlockPool, Hold, Holder, len_u64};
use crate::stats::{RankCounters, RankStats};

pub use crate::cache::{CacheEvent, block_hashes};

/// Identifies a request on one rank; the server assigns them.
pub type RequestId = u64;

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

/// A request on the rank; its hashes are computed once, at submit.
#[derive(Debug)]
struct Pending {
    hashes: Vec<u64>,
    /// The tokens of the full blocks, kept only while the model records events.
    tokens: Vec<u32>,
    prompt_len: u64,
    output: u64,
    /// The blocks it holds while it runs.
    hold: Hold,
}

/// One data-parallel rank: its KV cache, its running requests and its queue.
#[derive(Debug)]
pub struct RankModel {
    rank: u32,
    block_size: NonZeroU32,
    max_running: NonZeroU32,
    max_queue: Option<u32>,
    pool: BlockPool,
    running: HashMap<RequestId, Pending>,
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
            max_running,
            max_queue,
            pool: BlockPool::new(block_size, kv_blocks),
            running: HashMap::new(),
            queue: LinkedHashMap::new(),
            counters: RankCounters::default(),
        }
    }

    /// Starts (or stops) recording the KV cache events of every later call. Off by default: nothing
    /// takes the events of a rank that does not publish them.
    pub fn record_events(&mut self, on: bool) {
        self.pool.record_events(on);
    }

    /// The events recorded since the last call, oldest first; empty when not recording.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.pool.take_events()
    }

    /// Drops every cached block, as vLLM's `/reset_prefix_cache` and SGLang's `/flush_cache` do:
    /// only when no request runs (their blocks are in use), so it returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.running.is_empty() && self.pool.reset()
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
        let output = u64::from(output_tokens);
        let needed_blocks = self.pool.blocks_for(prompt_len.saturating_add(output));
        if needed_blocks > self.pool.capacity() {
            return Err(self.refuse(Refusal::TooLong {
                needed_blocks,
                capacity: self.pool.capacity(),
            }));
        }
        // Only a request that could start now is worth checking before the queue limit; a full queue
        // refuses the rest without hashing their prompts.
        let may_start = self.queue.is_empty() && self.running() < self.running_limit();
        if !may_start {
            self.check_queue_room()?;
        }
        let hashes: Vec<u64> = block_hashes(prompt, self.block_size).collect();
        let tokens = if self.pool.recording() {
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
            output,
            hold: Hold::default(),
        };
        if may_start {
            match self.admit(id, pending) {
                Ok(admission) => return Ok(Submit::Admitted(admission)),
                Err(pending) => {
                    self.check_queue_room()?;
                    let position = self.queue.len();
                    self.queue.insert(id, pending);
                    return Ok(Submit::Queued { position });
                }
            }
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
            self.pool.release(&active.hashes, active.hold);
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
        self.pool.set_capacity(kv_blocks);
        self.max_running = max_running;
        self.max_queue = max_queue;
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
        let hashes: Vec<u64> = block_hashes(prompt, self.block_size).collect();
        let hit = self.hit_blocks(&hashes, len_u64(prompt.len()));
        saturate_u32(hit.saturating_mul(self.pool.block_size()))
    }

    /// Every [`RankStats`] field except the latency histograms, which the server keeps.
    pub fn stats(&self) -> RankStats {
        let waiting_uncached_tokens = self
            .queue
            .values()
            .map(|pending| {
                let hit = self.hit_blocks(&pending.hashes, pending.prompt_len);
                pending
                    .prompt_len
                    .saturating_sub(hit.saturating_mul(self.pool.block_size()))
            })
            .fold(0u64, u64::saturating_add);
        let waiting_tokens = self
            .queue
            .values()
            .map(|pending| pending.prompt_len)
            .fold(0u64, u64::saturating_add);
        let mut counters = self.counters;
        counters.evicted_blocks = self.pool.evicted;
        RankStats {
            rank: self.rank,
            running: self.running(),
            waiting: self.waiting(),
            requests: self.running().saturating_add(self.waiting()),
            waiting_uncached_tokens,
            waiting_tokens,
            kv_used_blocks: self.pool.used(),
            kv_pinned_blocks: self.pool.pinned(),
            kv_total_blocks: self.pool.capacity(),
            block_size: self.block_size.get(),
            max_running: u64::from(self.max_running.get()),
            counters,
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

    /// Leading blocks a prompt may take from the cache: at least one token is always computed, so a
    /// prompt of exactly N full blocks hits at most N-1 (as vLLM).
    fn hit_blocks(&self, hashes: &[u64], prompt_len: u64) -> u64 {
        let cap = prompt_len.saturating_sub(1) / self.pool.block_size();
        self.pool.hit_blocks(hashes, cap)
    }

    /// Starts `pending` if its blocks fit: pins its cached blocks, evicts for the rest, caches its new
    /// full prompt blocks. Gives it back when they do not fit.
    fn admit(&mut self, id: RequestId, mut pending: Pending) -> Result<Admission, Pending> {
        let hit = self.hit_blocks(&pending.hashes, pending.prompt_len);
        let holder = Holder {
            hashes: &pending.hashes,
            tokens: &pending.tokens,
            hold: Hold::default(),
        };
        let Some(hold) = self
            .pool
            .grow(&holder, pending.prompt_len.saturating_add(pending.output))
        else {
            return Err(pending);
        };
        pending.hold = hold;
        let cached = hit
            .saturating_mul(self.pool.block_size())
            .min(pending.prompt_len);
        let counters = &mut self.counters;
        counters.prompt_tokens = counters.prompt_tokens.saturating_add(pending.prompt_len);
        counters.prefix_queried_tokens = counters
            .prefix_queried_tokens
            .saturating_add(pending.prompt_len);
        counters.prefix_hit_tokens = counters.prefix_hit_tokens.saturating_add(cached);
        let admission = Admission {
            id,
            cached_tokens: saturate_u32(cached),
            uncached_tokens: saturate_u32(pending.prompt_len.saturating_sub(cached)),
        };
        self.running.insert(id, pending);
        Ok(admission)
    }

    /// Admits from the head of the queue while the head fits.
    fn admit_from_queue(&mut self) -> Vec<Admission> {
        let mut admitted = Vec::new();
        while self.running() < self.running_limit() {
            let Some((id, pending)) = self.queue.pop_front() else {
                break;
            };
            match self.admit(id, pending) {
                Ok(admission) => admitted.push(admission),
                Err(pending) => {
                    // The head does not fit: it keeps its place, and blocks the queue.
                    self.queue.insert(id, pending);
                    self.queue.to_front(&id);
                    break;
                }
            }
        }
        admitted
    }
}

fn saturate_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;

//! The step model: one data-parallel rank of an engine as a GPU that runs one step at a time, the
//! simulator's default timing (`timing: step`).
//!
//! Each step the scheduler ([`StepRank::schedule`]) packs work into one token budget, the GPU runs it
//! for a time that follows from what was packed ([`profile`]), and at the end ([`StepRank::complete`])
//! every request whose tokens are all computed emits one output token. Concurrent prefills therefore
//! share one budget and queue behind each other, a long prefill chunk slows every decode in its step,
//! and a cache hit skips its tokens in the budget. Two schedulers, as the engines have:
//!
//! - **vLLM V1** (`vllm/v1/core/sched/scheduler.py`): running requests first, in admission order, each
//!   taking what it still needs (one token for a decode, the rest of its prompt up to the budget for a
//!   chunked prefill); a running request whose KV does not fit preempts the newest running request
//!   (recompute: its blocks are freed, it goes to the front of the queue); then, only if nothing was
//!   preempted, waiting requests in order while budget, `max_num_seqs` and their first chunk's KV allow,
//!   stopping at the first that does not fit.
//! - **SGLang** (`python/sglang/srt/managers/scheduler.py`, `schedule_policy.py`): prefill first — if a
//!   prefill batch can be formed (the chunked request, then waiting requests, each reserving its future
//!   output against the free KV) it runs instead of the decode batch, which gets no token that step;
//!   otherwise every decoding request takes one token, and when their KV does not fit the request with
//!   the fewest outputs is retracted to the queue. `lpm` orders the queue by cached prefix while at
//!   most 128 wait.
//!
//! Pure and synchronous, like [`crate::model`]: the server's engine loop calls it under the rank's lock
//! and sleeps each step's duration.

pub mod predict;
pub mod profile;

mod sched;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;

use crate::cache::{BlockPool, CacheEvent, Hold, Holder, PromptBlocks, block_hashes, len_u64};
use crate::config::Engine;
use crate::model::{Refusal, RequestId};
use crate::stats::{RankCounters, RankStats};

pub use profile::{Profile, StepWork};

/// SGLang's `schedule_policy`: the order in which waiting requests are considered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SchedulePolicy {
    /// Arrival order.
    #[default]
    Fcfs,
    /// Longest cached prefix first, while at most [`LPM_MAX_WAITING`] wait; arrival order beyond.
    Lpm,
}

impl SchedulePolicy {
    pub const ALL: [SchedulePolicy; 2] = [SchedulePolicy::Fcfs, SchedulePolicy::Lpm];

    pub fn as_str(self) -> &'static str {
        match self {
            SchedulePolicy::Fcfs => "fcfs",
            SchedulePolicy::Lpm => "lpm",
        }
    }
}

/// SGLang falls back from `lpm` to `fcfs` above this many waiting requests (`_determine_active_policy`).
pub const LPM_MAX_WAITING: usize = 128;

/// What bounds one rank's scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    pub engine: Engine,
    pub block_size: NonZeroU32,
    pub kv_blocks: NonZeroU32,
    /// vLLM's `max_num_seqs`, SGLang's `max_running_requests`.
    pub max_running: NonZeroU32,
    /// Waiting requests accepted before a 503; `None` is unbounded.
    pub max_queue: Option<u32>,
    /// Tokens per step: vLLM's `max_num_batched_tokens`, SGLang's `chunked_prefill_size`.
    pub batch_tokens: NonZeroU32,
    /// SGLang's `max_prefill_tokens`: new input tokens per prefill batch (the first request may exceed it).
    pub max_prefill_tokens: NonZeroU32,
    pub policy: SchedulePolicy,
}

impl StepLimits {
    /// The limits `params` set for a rank of `engine` with blocks of `block_size` tokens.
    pub fn of(
        engine: Engine,
        block_size: NonZeroU32,
        params: &crate::config::SimParams,
    ) -> StepLimits {
        StepLimits {
            engine,
            block_size,
            kv_blocks: params.kv_blocks,
            max_running: params.max_running,
            max_queue: params.max_queue,
            batch_tokens: params.batch_tokens,
            max_prefill_tokens: params.max_prefill_tokens,
            policy: params.schedule_policy,
        }
    }
}

/// One request on the rank.
#[derive(Debug)]
struct Seq {
    prompt_len: u64,
    max_tokens: u32,
    /// Chained hashes of the prompt's full blocks.
    hashes: Vec<u64>,
    /// The tokens of those blocks, kept only while events are recorded.
    tokens: Vec<u32>,
    /// Tokens whose KV exists (vLLM's `num_computed_tokens`).
    computed: u64,
    generated: u32,
    /// The blocks it holds.
    hold: Hold,
    /// Tokens the cache held at its first admission: the `cached_tokens` of its usage.
    cached: Option<u32>,
    /// Leading prompt tokens whose KV another worker computed and this rank pulls (vLLM's NIXL
    /// `do_remote_prefill`): they are not computed here, but their blocks are allocated and cached as
    /// if they were. A preemption loses them, and the request then computes its prompt itself.
    remote: u64,
}

impl Seq {
    /// Prompt plus the outputs so far: what the KV must catch up to.
    fn num_tokens(&self) -> u64 {
        self.prompt_len.saturating_add(u64::from(self.generated))
    }

    /// Tokens still to compute before it emits its next token.
    fn pending(&self) -> u64 {
        self.num_tokens().saturating_sub(self.computed)
    }

    /// Decoding: past its prompt, one token to compute per step.
    fn decoding(&self) -> bool {
        self.generated > 0 && self.pending() <= 1
    }

    fn holder(&self) -> Holder<'_> {
        Holder {
            hashes: &self.hashes,
            tokens: &self.tokens,
            hold: self.hold,
        }
    }
}

/// One step the scheduler formed: who computes how many tokens, and its shape for the profile.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    scheduled: Vec<(RequestId, u64)>,
    /// Requests that started this step, with the tokens their first lookup found cached.
    pub admitted: Vec<(RequestId, u32)>,
    pub work: StepWork,
}

impl Step {
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// What a completed step did to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emission {
    /// It produced an output token; `generated` counts them, 1 being the first.
    Token { id: RequestId, generated: u32 },
    /// It produced everything it asked for and left the rank.
    Finished { id: RequestId },
}

/// SGLang's scheduler state beyond the queues.
#[derive(Clone, Copy, Debug)]
struct SglangState {
    /// The share of their remaining output running requests are assumed to still need.
    new_token_ratio: f64,
    /// Hit share of the latest prefill batch (`sglang:cache_hit_rate`).
    last_hit_rate: f64,
}

/// SGLang's `new_token_ratio` constants (`new_token_ratio_tracker.py`, `environ.py`), at
/// `schedule_conservativeness` 1.
pub const SGLANG_INIT_NEW_TOKEN_RATIO: f64 = 0.7;
pub const SGLANG_MIN_NEW_TOKEN_RATIO: f64 = 0.7 * 0.14;
pub const SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;
pub const SGLANG_RETRACT_DECODE_STEPS: f64 = 20.0;
/// A request's future output counts at most this much in SGLang's admission reservation.
pub const SGLANG_CLIP_MAX_NEW_TOKENS: u64 = 4096;

/// One data-parallel rank under the step model.
#[derive(Debug)]
pub struct StepRank {
    rank: u32,
    limits: StepLimits,
    pool: BlockPool,
    seqs: HashMap<RequestId, Seq>,
    /// Admission order.
    running: Vec<RequestId>,
    waiting: VecDeque<RequestId>,
    counters: RankCounters,
    /// Model seconds the GPU spent in steps, and how many.
    busy: f64,
    steps: u64,
    sglang: SglangState,
}

impl StepRank {
    pub fn new(rank: u32, limits: StepLimits) -> StepRank {
        StepRank {
            rank,
            pool: BlockPool::new(limits.block_size, limits.kv_blocks),
            limits,
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            counters: RankCounters::default(),
            busy: 0.0,
            steps: 0,
            sglang: SglangState {
                new_token_ratio: SGLANG_INIT_NEW_TOKEN_RATIO,
                last_hit_rate: 0.0,
            },
        }
    }

    pub fn limits(&self) -> &StepLimits {
        &self.limits
    }

    pub fn record_events(&mut self, on: bool) {
        self.pool.record_events(on);
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.pool.take_events()
    }

    /// A new request; it waits until a step admits it. Refused when the queue is full, or when its
    /// prompt and output could never fit the rank's KV.
    pub fn submit(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_tokens: u32,
    ) -> Result<(), Refusal> {
        self.submit_remote(id, prompt, max_tokens, 0)
    }

    /// [`submit`](Self::submit) a request whose first `remote` prompt tokens were prefilled by another
    /// worker and transferred here: its first admission counts them as held.
    pub fn submit_remote(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_tokens: u32,
        remote: u64,
    ) -> Result<(), Refusal> {
        if self.seqs.contains_key(&id) {
            return Err(self.refuse(Refusal::DuplicateId { id }));
        }
        let prompt_len = len_u64(prompt.len());
        let output = u64::from(max_tokens);
        let needed_blocks = match self.limits.engine {
            Engine::Vllm => self.pool.blocks_for(prompt_len.saturating_add(output)),
            // SGLang admits only what its prompt and clipped output leave room beside, even alone.
            Engine::Sglang => self.pool.blocks_for(
                prompt_len
                    .saturating_add(output.min(SGLANG_CLIP_MAX_NEW_TOKENS))
                    .saturating_add(1),
            ),
        };
        if needed_blocks > self.pool.capacity() {
            return Err(self.refuse(Refusal::TooLong {
                needed_blocks,
                capacity: self.pool.capacity(),
            }));
        }
        if let Some(limit) = self.limits.max_queue
            && len_u64(self.waiting.len()) >= u64::from(limit)
        {
            return Err(self.refuse(Refusal::QueueFull { limit }));
        }
        let hashes: Vec<u64> = block_hashes(prompt, self.limits.block_size).collect();
        let tokens = if self.pool.recording() {
            let full = hashes
                .len()
                .saturating_mul(usize::try_from(self.limits.block_size.get()).unwrap_or(1));
            prompt.get(..full).unwrap_or(prompt).to_vec()
        } else {
            Vec::new()
        };
        self.seqs.insert(
            id,
            Seq {
                prompt_len,
                max_tokens,
                hashes,
                tokens,
                computed: 0,
                generated: 0,
                hold: Hold::default(),
                cached: None,
                remote: remote.min(prompt_len),
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// The client went away: the request leaves the rank wherever it is, its blocks released. False
    /// for an id the rank does not hold (it finished, or never came).
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.running.retain(|other| *other != id);
        self.waiting.retain(|other| *other != id);
        self.pool.release(&seq.hashes, seq.hold);
        // Its tokens were counted as each step produced them.
        self.counters.aborted = self.counters.aborted.saturating_add(1);
        true
    }

    /// Forms the next step; empty when there is nothing the GPU can do now.
    pub fn schedule(&mut self) -> Step {
        match self.limits.engine {
            Engine::Vllm => sched::vllm(self),
            Engine::Sglang => sched::sglang(self),
        }
    }

    /// Applies a step that ran for `seconds` (model time): its tokens are computed, every request that
    /// caught up emits a token, and those that produced all they asked for leave.
    pub fn complete(&mut self, step: &Step, seconds: f64) -> Vec<Emission> {
        self.busy += seconds.max(0.0);
        self.steps = self.steps.saturating_add(1);
        let mut emissions = Vec::new();
        for &(id, tokens) in &step.scheduled {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            seq.computed = seq.computed.saturating_add(tokens).min(seq.num_tokens());
            if seq.pending() > 0 {
                continue;
            }
            // vLLM V1 counts a prompt's tokens when its prefill completes, with its first output
            // (`IterationStats.update_from_output`, `is_prefilling`); its cache hits when the request
            // is scheduled. The difference is the prefill in progress, which readers can see.
            if seq.generated == 0 && self.limits.engine == Engine::Vllm {
                self.counters.prompt_tokens =
                    self.counters.prompt_tokens.saturating_add(seq.prompt_len);
            }
            if seq.generated < seq.max_tokens {
                seq.generated = seq.generated.saturating_add(1);
                self.counters.generation_tokens = self.counters.generation_tokens.saturating_add(1);
                emissions.push(Emission::Token {
                    id,
                    generated: seq.generated,
                });
            }
            if seq.generated >= seq.max_tokens {
                emissions.push(Emission::Finished { id });
            }
        }
        for emission in &emissions {
            if let Emission::Finished { id } = emission
                && let Some(seq) = self.seqs.remove(id)
            {
                self.running.retain(|other| other != id);
                self.pool.release(&seq.hashes, seq.hold);
                self.counters.finished_length = self.counters.finished_length.saturating_add(1);
            }
        }
        emissions
    }

    /// New limits at run time; a smaller KV evicts unpinned blocks down to it.
    pub fn set_limits(&mut self, limits: StepLimits) {
        self.pool.set_capacity(limits.kv_blocks);
        self.limits = StepLimits {
            engine: self.limits.engine,
            block_size: self.limits.block_size,
            ..limits
        };
    }

    /// Drops every cached block, only while no request holds blocks; returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        !self.seqs.values().any(|seq| seq.hold.blocks > 0) && self.pool.reset()
    }

    /// Whether a step could be formed now (something runs, or waits and might start).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn running(&self) -> u64 {
        len_u64(self.running.len())
    }

    pub fn waiting(&self) -> u64 {
        len_u64(self.waiting.len())
    }

    /// Prompt tokens a request with this prompt would find cached now (no state change).
    pub fn cached_tokens(&self, prompt: &[u32]) -> u32 {
        self.cached_tokens_of(&PromptBlocks::of(prompt, self.limits.block_size))
    }

    /// [`StepRank::cached_tokens`] of a prompt already hashed, at this rank's block size (a fleet's
    /// ranks share one).
    pub fn cached_tokens_of(&self, prompt: &PromptBlocks) -> u32 {
        debug_assert_eq!(prompt.block_size, self.limits.block_size);
        let cap = self.hit_cap(prompt.len, prompt.hashes.len());
        saturate_u32(
            self.pool
                .hit_blocks(&prompt.hashes, cap)
                .saturating_mul(self.pool.block_size()),
        )
    }

    /// Every [`RankStats`] field but the latency histograms, as this engine reports them.
    pub fn stats(&self) -> RankStats {
        let decoding = len_u64(
            self.running
                .iter()
                .filter_map(|id| self.seqs.get(id))
                .filter(|seq| seq.decoding())
                .count(),
        );
        let mut waiting_uncached_tokens = 0u64;
        let mut waiting_tokens = 0u64;
        for seq in self.waiting.iter().filter_map(|id| self.seqs.get(id)) {
            let cap = self.hit_cap(seq.num_tokens(), seq.hashes.len());
            let hit = self
                .pool
                .hit_blocks(&seq.hashes, cap)
                .saturating_mul(self.pool.block_size());
            waiting_uncached_tokens =
                waiting_uncached_tokens.saturating_add(seq.num_tokens().saturating_sub(hit));
            waiting_tokens = waiting_tokens.saturating_add(seq.num_tokens());
        }
        // A prefill under way is still uncached work ahead of a new request.
        let prefilling: u64 = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|seq| !seq.decoding())
            .map(Seq::pending)
            .fold(0, u64::saturating_add);
        let (running, uncached) = match self.limits.engine {
            // vLLM counts every running request, mid-prefill ones included; SGLang's
            // `num_running_reqs` is the decode batch alone, and its uncached tokens add the
            // chunked request's remainder.
            Engine::Vllm => (self.running(), waiting_uncached_tokens),
            Engine::Sglang => (decoding, waiting_uncached_tokens.saturating_add(prefilling)),
        };
        let mut counters = self.counters;
        counters.evicted_blocks = self.pool.evicted;
        RankStats {
            rank: self.rank,
            running,
            waiting: self.waiting(),
            requests: len_u64(self.seqs.len()),
            waiting_uncached_tokens: uncached,
            waiting_tokens,
            kv_used_blocks: self.pool.used(),
            kv_pinned_blocks: self.pool.pinned(),
            kv_total_blocks: self.pool.capacity(),
            block_size: self.limits.block_size.get(),
            max_running: u64::from(self.limits.max_running.get()),
            counters,
            busy_seconds: self.busy,
            steps: self.steps,
            last_prefill_hit_rate: Some(self.sglang.last_hit_rate),
            ..RankStats::default()
        }
    }

    pub fn count_rejected(&mut self) {
        self.counters.rejected = self.counters.rejected.saturating_add(1);
    }

    fn refuse(&mut self, refusal: Refusal) -> Refusal {
        self.count_rejected();
        refusal
    }

    /// Leading blocks a lookup may take: at least one token is always computed (vLLM caps the hit at
    /// `num_tokens − 1`), and only the prompt's full blocks are cached.
    fn hit_cap(&self, num_tokens: u64, hashes: usize) -> u64 {
        (num_tokens.saturating_sub(1) / self.pool.block_size()).min(len_u64(hashes))
    }
}

fn saturate_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

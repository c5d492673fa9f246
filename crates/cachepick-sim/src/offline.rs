//! One simulated worker in virtual time: the step model's ranks, the API server's one loop and the
//! engine's histograms, with every time passed in (model seconds) and no I/O. `cachepick replay --clock
//! virtual` runs a fleet of these in one process, on one event queue.
//!
//! It composes the same pure parts as the HTTP server's engine loop and request handler
//! ([`crate::server`]), in the same order, so that the two paths model one engine:
//!
//! - a request received at `t` reaches the scheduler after the profile's front and after the API loop
//!   has tokenized it, behind whatever that loop has queued ([`OfflineWorker::accept`]);
//! - it is submitted to the rank with the fewest waiting, then running, requests;
//! - an idle rank forms a step at once; a step lasts the profile's time for its work, times the jitter
//!   factor; when it ends its tokens are applied, the first tokens and finished requests reported, the
//!   API loop charged for every token it produced, and the next step formed at the same instant;
//! - `/metrics` is rendered on the API loop after what it has queued ([`OfflineWorker::metrics_ready`]),
//!   from the ranks' state at that moment, in the engine's exposition ([`crate::expo`]).
//!
//! What the HTTP server has and this does not: the network and HTTP framing, the real tokenizer's
//! time (the profile's front stands for it), the slots model, restarts and admin controls,
//! prefill/decode transfers. The validation against the wall-clock replay says how much that matters.

use std::collections::HashMap;
use std::num::NonZeroU32;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::cache::{CacheEvent, PromptBlocks};
use crate::config::{Engine, SimConfig, SimParams};
use crate::model::{Refusal, RequestId};
use crate::stats::{Histogram, LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS, RankStats, TOKEN_BUCKETS};
use crate::step::{Emission, Step, StepLimits, StepRank};

/// What a step's end meant for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Happened {
    /// Its first output token; `cached` prompt tokens were found in the cache at its admission.
    FirstToken { id: RequestId, cached: u32 },
    /// It produced every token it asked for and left the worker.
    Finished { id: RequestId },
}

/// A request on the worker, with the times its histograms are made of.
#[derive(Clone, Copy, Debug)]
struct Request {
    received: f64,
    submitted: f64,
    prompt_len: u64,
    /// When it was first scheduled, and what its first lookup found cached.
    scheduled: Option<(f64, u32)>,
    first_token: Option<f64>,
}

/// One data-parallel rank: the step model, the step on the GPU, and the engine's histograms.
#[derive(Debug)]
struct Rank {
    model: StepRank,
    /// The step running and its model duration (before jitter).
    running: Option<(Step, f64)>,
    ttft: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    prefill_time: Histogram,
    prefill_tokens: Histogram,
    rng: SmallRng,
}

/// One worker of the fleet in virtual time.
#[derive(Debug)]
pub struct OfflineWorker {
    engine: Engine,
    model: String,
    params: SimParams,
    block_size: NonZeroU32,
    ranks: Vec<Rank>,
    /// When the API server's loop is next free.
    api_free: f64,
    requests: HashMap<RequestId, Request>,
}

impl OfflineWorker {
    /// Worker `index` of a fleet configured by `config` (the step model; its time scale is ignored:
    /// virtual time is model time). Each rank draws its jitter from `config.seed`, the worker and the
    /// rank.
    pub fn new(config: &SimConfig, index: u32) -> OfflineWorker {
        let ranks = (0..config.dp_size.get())
            .map(|rank| {
                let limits = StepLimits::of(config.engine, config.block_size, &config.params);
                let seed = config.seed
                    ^ u64::from(index).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ u64::from(rank).wrapping_mul(0xA076_1D64_78BD_642F);
                Rank {
                    model: StepRank::new(rank, limits),
                    running: None,
                    ttft: Histogram::over(LATENCY_BUCKETS),
                    e2e: Histogram::over(LATENCY_BUCKETS),
                    queue_time: Histogram::over(REQUEST_LATENCY_BUCKETS),
                    prefill_time: Histogram::over(REQUEST_LATENCY_BUCKETS),
                    prefill_tokens: Histogram::over(TOKEN_BUCKETS),
                    rng: SmallRng::seed_from_u64(seed),
                }
            })
            .collect();
        OfflineWorker {
            engine: config.engine,
            model: config.model.clone(),
            params: config.params.clone(),
            block_size: config.block_size,
            ranks,
            api_free: 0.0,
            requests: HashMap::new(),
        }
    }

    /// Records the KV cache events of every rank, for an index fed by them.
    pub fn record_events(&mut self, on: bool) {
        for rank in &mut self.ranks {
            rank.model.record_events(on);
        }
    }

    /// Every rank's cache events since the last call, rank by rank.
    pub fn take_events(&mut self) -> Vec<Vec<CacheEvent>> {
        self.ranks
            .iter_mut()
            .map(|rank| rank.model.take_events())
            .collect()
    }

    /// Queues `seconds` of work on the API loop at `now`; returns when it is done.
    fn api_work(&mut self, now: f64, seconds: f64) -> f64 {
        self.api_free = self.api_free.max(now) + seconds.max(0.0);
        self.api_free
    }

    /// A request of `prompt_len` tokens received at `now`: when it reaches the scheduler, after the
    /// front and the API loop's tokenizing.
    pub fn accept(&mut self, now: f64, prompt_len: usize) -> f64 {
        let profile = &self.params.profile;
        let (front, per_token) = (profile.front, profile.api_token);
        let tokenized = self.api_work(now, prompt_len as f64 * per_token);
        (now + front).max(tokenized)
    }

    /// Submits a request received at `received` to the least-loaded rank at `now`. When that rank was
    /// idle it starts a step: its index and end are returned, for the caller to call
    /// [`step_ended`](Self::step_ended) then.
    pub fn submit(
        &mut self,
        now: f64,
        id: RequestId,
        prompt: &[u32],
        max_tokens: u32,
        received: f64,
    ) -> Result<Option<(usize, f64)>, Refusal> {
        let rank = (0..self.ranks.len())
            .min_by_key(|&at| {
                self.ranks.get(at).map_or((u64::MAX, u64::MAX), |rank| {
                    (rank.model.waiting(), rank.model.running())
                })
            })
            .unwrap_or(0);
        let Some(state) = self.ranks.get_mut(rank) else {
            return Ok(None);
        };
        state.model.submit(id, prompt, max_tokens)?;
        self.requests.insert(
            id,
            Request {
                received,
                submitted: now,
                prompt_len: prompt.len() as u64,
                scheduled: None,
                first_token: None,
            },
        );
        let idle = state.running.is_none();
        Ok(if idle {
            self.start_step(rank, now).map(|end| (rank, end))
        } else {
            None
        })
    }

    /// Forms rank `rank`'s next step at `now`; its end, or `None` when there is nothing to run.
    fn start_step(&mut self, rank: usize, now: f64) -> Option<f64> {
        let state = self.ranks.get_mut(rank)?;
        let step = state.model.schedule();
        if step.is_empty() {
            state.running = None;
            return None;
        }
        for (id, cached) in &step.admitted {
            if let Some(request) = self.requests.get_mut(id) {
                request.scheduled.get_or_insert((now, *cached));
            }
        }
        let seconds = self.params.profile.step_time(&step.work);
        let factor = crate::timing::jitter_factor(self.params.jitter, &mut state.rng);
        state.running = Some((step, seconds));
        Some(now + seconds * factor)
    }

    /// The step on rank `rank` ended at `now`: what it meant for its requests, and the end of the next
    /// step, formed at once, if there is one.
    pub fn step_ended(&mut self, rank: usize, now: f64) -> (Vec<Happened>, Option<f64>) {
        let Some(state) = self.ranks.get_mut(rank) else {
            return (Vec::new(), None);
        };
        let Some((step, seconds)) = state.running.take() else {
            return (Vec::new(), None);
        };
        let mut happened = Vec::new();
        let mut tokens = 0_u64;
        for emission in state.model.complete(&step, seconds) {
            match emission {
                Emission::Token { id, generated } => {
                    tokens += 1;
                    let Some(request) = self.requests.get_mut(&id) else {
                        continue;
                    };
                    if generated == 1 {
                        state.ttft.observe(now - request.received);
                        request.first_token = Some(now);
                        let cached = request.scheduled.map_or(0, |(_, cached)| cached);
                        happened.push(Happened::FirstToken { id, cached });
                    }
                }
                Emission::Finished { id } => {
                    if let Some(request) = self.requests.remove(&id) {
                        state.e2e.observe(now - request.received);
                        if let (Some((scheduled, cached)), Some(first)) =
                            (request.scheduled, request.first_token)
                        {
                            state.queue_time.observe(scheduled - request.submitted);
                            state.prefill_time.observe(first - scheduled);
                            state.prefill_tokens.observe(
                                request.prompt_len.saturating_sub(u64::from(cached)) as f64,
                            );
                        }
                        happened.push(Happened::Finished { id });
                    }
                }
            }
        }
        let output = tokens as f64 * self.params.profile.api_output;
        self.api_work(now, output);
        let next = self.start_step(rank, now);
        (happened, next)
    }

    /// A `/metrics` request received at `now`: when its answer is rendered, behind the API loop's
    /// queue. Render it then with [`render_metrics`](Self::render_metrics).
    pub fn metrics_ready(&mut self, now: f64) -> f64 {
        let render = self.params.profile.api_metrics;
        self.api_work(now, render)
    }

    /// The engine's `/metrics` exposition of the ranks' state now.
    pub fn render_metrics(&self) -> String {
        crate::expo::render_metrics(self.engine, &self.model, &self.stats())
    }

    /// Every rank's stats, histograms included.
    pub fn stats(&self) -> Vec<RankStats> {
        self.ranks
            .iter()
            .map(|rank| RankStats {
                ttft: rank.ttft.clone(),
                e2e: rank.e2e.clone(),
                queue_time: rank.queue_time.clone(),
                prefill_time: rank.prefill_time.clone(),
                prefill_tokens: rank.prefill_tokens.clone(),
                ..rank.model.stats()
            })
            .collect()
    }

    /// A prompt of these token ids hashed into this worker's blocks, once for every question
    /// [`OfflineWorker::cached_tokens`] and [`OfflineWorker::outlook`] are asked of the fleet (whose
    /// workers share one block size).
    pub fn prompt_blocks(&self, prompt: &[u32]) -> PromptBlocks {
        PromptBlocks::of(prompt, self.block_size)
    }

    /// The most any rank holds of a prompt: what an index fed by KV events with no lag would see.
    pub fn cached_tokens(&self, prompt: &PromptBlocks) -> u32 {
        self.ranks
            .iter()
            .map(|rank| rank.model.cached_tokens_of(prompt))
            .max()
            .unwrap_or(0)
    }

    /// The soonest first token any rank would give a prompt behind `in_flight` (received, not yet
    /// submitted), from the true state, front included, with what that rank holds of it: the
    /// oracle's view.
    pub fn outlook(
        &self,
        prompt: &PromptBlocks,
        in_flight: &[&PromptBlocks],
    ) -> Option<(f64, u32)> {
        let profile = &self.params.profile;
        self.ranks
            .iter()
            .map(|rank| {
                let seconds =
                    rank.model.predict_ttft_of(prompt, in_flight, profile) + profile.front;
                (seconds, rank.model.cached_tokens_of(prompt))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
    }

    /// Model seconds the ranks' GPUs spent in steps, summed.
    pub fn busy_seconds(&self) -> f64 {
        self.ranks
            .iter()
            .map(|rank| rank.model.stats().busy_seconds)
            .sum()
    }

    /// Requests the worker holds.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// The engine.
    pub fn engine(&self) -> Engine {
        self.engine
    }
}

/// The fleet's tokenizer, as its workers read a completion's text prompt: tokenized whole, as engines
/// do (the picker's segment cache is not here).
pub struct WorkerTokenizer(cachepick_tokenizer::Tokenizer);

impl WorkerTokenizer {
    pub fn load(config: &SimConfig) -> Result<WorkerTokenizer, String> {
        cachepick_tokenizer::Tokenizer::load(&config.tokenizer, config.chat_template.as_deref())
            .map(WorkerTokenizer)
            .map_err(|error| error.to_string())
    }

    /// A completion's text prompt's token ids.
    pub fn tokens(&self, text: &str) -> Result<Vec<u32>, String> {
        crate::server::tokens(&self.0, &crate::wire::Prompt::Text(text.to_owned()))
    }
}

//! A rank's engine under either timing model, and the step model's engine loop.
//!
//! Under the slots model ([`crate::model`]) each request paces itself: admission wakes it, then it
//! sleeps its own prefill and token gaps. Under the step model ([`crate::step`]) one loop per rank is
//! the GPU: it forms a step, sleeps the step's duration, applies it, and tells each request what it got
//! through a `watch` channel (cached tokens at admission, tokens so far, done), so a request waits on
//! the engine instead of on a timer. Steps are timed against an ideal clock: the next step of a busy
//! rank starts when the previous one was due to end, not when the loop woke, so the timer's granularity
//! never slows the modelled GPU; a loop that falls further behind than [`MAX_LAG`] (a starved machine)
//! starts again from now and counts the time it lost.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;

use super::{Incarnation, Rank, Shared, sleep_unpaused};
use crate::cache::CacheEvent;
use crate::config::{Engine, SimParams, Timing};
use crate::model::{Admission, RankModel, RequestId};
use crate::stats::{Histogram, RankStats};
use crate::step::{Emission, StepLimits, StepRank};
use crate::timing;

/// How far behind its ideal clock a step loop may fall before it gives the time up.
const MAX_LAG: Duration = Duration::from_millis(50);

/// What a step-model request has been given so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Progress {
    /// Prompt tokens the cache held when it was admitted; `None` while it waits.
    pub cached: Option<u32>,
    /// Output tokens produced.
    pub generated: u32,
    /// It produced everything it asked for.
    pub done: bool,
}

/// The engine loop's end of one request.
pub(super) struct Handle {
    progress: watch::Sender<Progress>,
    received: Instant,
    /// When it reached the scheduler (vLLM's `queued_ts`).
    submitted: Instant,
    prompt_len: u64,
    /// The start of the step that first scheduled it (vLLM's `scheduled_ts`, a preemption aside)
    /// and the prompt tokens its first lookup found cached.
    scheduled: Option<(Instant, u32)>,
    /// The end of the step that gave its first token.
    first_token: Option<Instant>,
}

/// A rank's engine: the model and the requests waiting on it.
pub(super) enum RankEngine {
    Slots {
        model: RankModel,
        /// Requests queued for admission.
        waiters: HashMap<RequestId, oneshot::Sender<Admission>>,
    },
    Step {
        model: StepRank,
        requests: HashMap<RequestId, Handle>,
        /// Wakes the loop of an idle rank.
        wake: Arc<Notify>,
        /// Wall seconds the loop gave up after falling behind.
        lagged: f64,
    },
}

/// How a submission went.
pub(super) enum Submitted {
    /// Slots model: admitted at once.
    Admitted(Admission),
    /// Slots model: queued; the admission comes on this channel.
    Queued(oneshot::Receiver<Admission>),
    /// Step model: waiting for a step to admit it.
    Stepping(watch::Receiver<Progress>),
}

impl RankEngine {
    pub fn new(
        spec_rank: u32,
        engine: Engine,
        timing: Timing,
        block_size: std::num::NonZeroU32,
        params: &SimParams,
    ) -> RankEngine {
        match timing {
            Timing::Slots => RankEngine::Slots {
                model: RankModel::new(
                    spec_rank,
                    block_size,
                    params.kv_blocks,
                    params.max_running,
                    params.max_queue,
                ),
                waiters: HashMap::new(),
            },
            Timing::Step => RankEngine::Step {
                model: StepRank::new(spec_rank, StepLimits::of(engine, block_size, params)),
                requests: HashMap::new(),
                wake: Arc::new(Notify::new()),
                lagged: 0.0,
            },
        }
    }

    pub fn record_events(&mut self, on: bool) {
        match self {
            RankEngine::Slots { model, .. } => model.record_events(on),
            RankEngine::Step { model, .. } => model.record_events(on),
        }
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        match self {
            RankEngine::Slots { model, .. } => model.take_events(),
            RankEngine::Step { model, .. } => model.take_events(),
        }
    }

    pub fn running(&self) -> u64 {
        match self {
            RankEngine::Slots { model, .. } => model.running(),
            RankEngine::Step { model, .. } => model.running(),
        }
    }

    pub fn waiting(&self) -> u64 {
        match self {
            RankEngine::Slots { model, .. } => model.waiting(),
            RankEngine::Step { model, .. } => model.waiting(),
        }
    }

    pub fn stats(&self) -> RankStats {
        match self {
            RankEngine::Slots { model, .. } => model.stats(),
            RankEngine::Step { model, lagged, .. } => RankStats {
                lagged_seconds: *lagged,
                ..model.stats()
            },
        }
    }

    pub fn count_rejected(&mut self) {
        match self {
            RankEngine::Slots { model, .. } => model.count_rejected(),
            RankEngine::Step { model, .. } => model.count_rejected(),
        }
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        match self {
            RankEngine::Slots { model, .. } => model.reset_prefix_cache(),
            RankEngine::Step { model, .. } => model.reset_prefix_cache(),
        }
    }

    /// Submits a request; `Err` is the model's refusal. `remote` leading prompt tokens were prefilled
    /// elsewhere and pulled here (the step model holds them; the slots model, which has no PD, ignores
    /// them).
    pub fn submit(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        output: u32,
        remote: u32,
        received: Instant,
    ) -> Result<Submitted, crate::model::Refusal> {
        match self {
            RankEngine::Slots { model, waiters } => match model.submit(id, prompt, output)? {
                crate::model::Submit::Admitted(admission) => Ok(Submitted::Admitted(admission)),
                crate::model::Submit::Queued { .. } => {
                    let (sender, receiver) = oneshot::channel();
                    waiters.insert(id, sender);
                    Ok(Submitted::Queued(receiver))
                }
            },
            RankEngine::Step {
                model,
                requests,
                wake,
                ..
            } => {
                model.submit_remote(id, prompt, output, u64::from(remote))?;
                let (progress, receiver) = watch::channel(Progress::default());
                let handle = Handle {
                    progress,
                    received,
                    submitted: Instant::now(),
                    prompt_len: prompt.len() as u64,
                    scheduled: None,
                    first_token: None,
                };
                requests.insert(id, handle);
                wake.notify_one();
                Ok(Submitted::Stepping(receiver))
            }
        }
    }

    /// The request ended on its client's side (its ticket dropped): `completed` and `generated` say
    /// how, for the slots model; the step model knows. Returns the slots model's admissions.
    pub fn end(&mut self, id: RequestId, completed: bool, generated: u32) -> Vec<Admission> {
        match self {
            RankEngine::Slots { model, waiters } => {
                waiters.remove(&id);
                model.finish(id, completed, generated)
            }
            RankEngine::Step {
                model,
                requests,
                wake,
                ..
            } => {
                requests.remove(&id);
                if model.abort(id) {
                    wake.notify_one();
                }
                Vec::new()
            }
        }
    }

    /// New parameters: limits at once (the slots model may admit), timings from the next step.
    pub fn set_params(
        &mut self,
        engine: Engine,
        block_size: std::num::NonZeroU32,
        params: &SimParams,
    ) -> Vec<Admission> {
        match self {
            RankEngine::Slots { model, .. } => {
                model.set_limits(params.kv_blocks, params.max_running, params.max_queue)
            }
            RankEngine::Step { model, wake, .. } => {
                model.set_limits(StepLimits::of(engine, block_size, params));
                wake.notify_one();
                Vec::new()
            }
        }
    }

    /// Wakes the slots model's admitted requests.
    pub fn wake(&mut self, admitted: Vec<Admission>) {
        if let RankEngine::Slots { waiters, .. } = self {
            for admission in admitted {
                if let Some(waiter) = waiters.remove(&admission.id) {
                    // A waiter that is gone has already told the model (its ticket's drop).
                    let _ = waiter.send(admission);
                }
            }
        }
    }

    /// Model seconds until a request with this prompt would emit its first token here (the step
    /// model's prediction; `None` under the slots model).
    pub fn predict_ttft(
        &self,
        prompt: &[u32],
        in_flight: &[&[u32]],
        params: &SimParams,
    ) -> Option<f64> {
        match self {
            RankEngine::Slots { .. } => None,
            RankEngine::Step { model, .. } => {
                Some(model.predict_ttft(prompt, in_flight, &params.profile))
            }
        }
    }

    pub fn cached_tokens(&self, prompt: &[u32]) -> u32 {
        match self {
            RankEngine::Slots { model, .. } => model.cached_tokens(prompt),
            RankEngine::Step { model, .. } => model.cached_tokens(prompt),
        }
    }
}

/// Applies a step that ran for `seconds` and ended at `end` to the rank's requests: first tokens
/// and finished requests observed, their clients told. Returns the tokens it produced.
fn complete(rank: &mut Rank, step: &crate::step::Step, seconds: f64, end: Instant) -> u64 {
    let mut tokens = 0_u64;
    let RankEngine::Step {
        model, requests, ..
    } = &mut rank.engine
    else {
        return 0;
    };
    for emission in model.complete(step, seconds) {
        match emission {
            Emission::Token { id, generated } => {
                tokens += 1;
                if let Some(handle) = requests.get_mut(&id) {
                    if generated == 1 {
                        rank.ttft.observe(handle.received.elapsed().as_secs_f64());
                        handle.first_token = Some(end);
                    }
                    handle
                        .progress
                        .send_modify(|progress| progress.generated = generated);
                }
            }
            Emission::Finished { id } => {
                if let Some(handle) = requests.remove(&id) {
                    rank.e2e.observe(handle.received.elapsed().as_secs_f64());
                    observe_phases(
                        &handle,
                        &mut rank.queue_time,
                        &mut rank.prefill_time,
                        &mut rank.prefill_tokens,
                    );
                    handle.progress.send_modify(|progress| progress.done = true);
                }
            }
        }
    }
    tokens
}

/// vLLM's per-request phases of a finished request, as `update_from_finished_request` computes them:
/// queue = first scheduled − queued, prefill = first token − first scheduled, and the prompt tokens
/// the prefill computed. A request that never got its first token records none.
fn observe_phases(
    handle: &Handle,
    queue: &mut Histogram,
    prefill: &mut Histogram,
    tokens: &mut Histogram,
) {
    let (Some((scheduled, cached)), Some(first)) = (handle.scheduled, handle.first_token) else {
        return;
    };
    queue.observe(
        scheduled
            .saturating_duration_since(handle.submitted)
            .as_secs_f64(),
    );
    prefill.observe(first.saturating_duration_since(scheduled).as_secs_f64());
    tokens.observe(handle.prompt_len.saturating_sub(u64::from(cached)) as f64);
}

/// The engine loop of step rank `index`: runs until its incarnation's tasks are aborted.
pub(super) async fn run(shared: Arc<Shared>, incarnation: Arc<Incarnation>, index: usize) {
    let Some(wake) = incarnation.rank(index).and_then(|rank| match &rank.engine {
        RankEngine::Step { wake, .. } => Some(Arc::clone(wake)),
        RankEngine::Slots { .. } => None,
    }) else {
        return;
    };
    let seed = shared.spec.seed ^ (index as u64).wrapping_mul(0xA076_1D64_78BD_642F);
    let mut rng = SmallRng::seed_from_u64(seed);
    // When the previous step was due to end, while the rank stays busy.
    let mut clock: Option<Instant> = None;
    loop {
        let params = shared.params.load_full();
        let Some((step, seconds)) = incarnation.rank(index).and_then(|mut rank| {
            let RankEngine::Step {
                model, requests, ..
            } = &mut rank.engine
            else {
                return None;
            };
            let step = model.schedule();
            // The step starts where the previous one was due to end (or now, on an idle rank).
            let starts = clock.unwrap_or_else(Instant::now);
            for (id, cached) in &step.admitted {
                if let Some(handle) = requests.get_mut(id) {
                    handle
                        .progress
                        .send_modify(|progress| progress.cached = Some(*cached));
                    handle.scheduled.get_or_insert((starts, *cached));
                }
            }
            let seconds = params.profile.step_time(&step.work);
            Some((step, seconds))
        }) else {
            return;
        };
        if step.is_empty() {
            clock = None;
            wake.notified().await;
            continue;
        }
        let now = Instant::now();
        let start = match clock {
            Some(due) if now.saturating_duration_since(due) <= MAX_LAG => due,
            Some(due) => {
                let lost = now.saturating_duration_since(due).as_secs_f64();
                if let Some(mut rank) = incarnation.rank(index)
                    && let RankEngine::Step { lagged, .. } = &mut rank.engine
                {
                    *lagged += lost;
                }
                now
            }
            None => now,
        };
        let factor = timing::jitter_factor(params.jitter, &mut rng) * params.time_scale;
        let wall = Duration::try_from_secs_f64(seconds * factor).unwrap_or(Duration::MAX);
        let due = start.checked_add(wall).unwrap_or(start);
        let behind = due <= Instant::now();
        let end = sleep_unpaused(&shared, due).await;
        if behind {
            // Catching up runs steps back to back: let the rank's requests and connections run too.
            tokio::task::yield_now().await;
        }
        clock = Some(end);
        let Some(mut rank) = incarnation.rank(index) else {
            return;
        };
        let tokens = complete(&mut rank, &step, seconds, end);
        rank.flush_events();
        // The API server's loop processes every token the step produced (`api_work`).
        super::api::api_work(&shared, tokens as f64 * params.profile.api_output);
    }
}

//! Generating an answer: parse, tokenize, submit to the least-loaded rank, wait for admission under a
//! [`Ticket`], then prefill and decode — at the pace of the rank's engine loop (the step model), or at
//! the pace [`timing`] sets for the request itself (the slots model) — answered whole (JSON) or as it
//! is produced (SSE).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use cachepick_tokenizer::{Chat, ChatTurn, Tokenizer};

use super::bootstrap::{self, Disaggregation};
use super::engine::{Progress, Submitted};
use super::{Arrival, Body, Incarnation, Rank, Shared, error, json, lock, nixl, sleep_unpaused};
use crate::SimParams;
use crate::config::{Engine, LoadFailure, Timing};
use crate::model::{Refusal, RequestId};
use crate::timing;
use crate::wire::{self, Api, KvTransfer, Outcome, Prompt, SimRequest};

/// A request known to a rank's model; its drop tells the model the request ended.
struct Ticket {
    incarnation: Arc<Incarnation>,
    rank: usize,
    id: RequestId,
    completed: bool,
    generated: u32,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(mut rank) = self.incarnation.rank(self.rank) {
            let admitted = rank.engine.end(self.id, self.completed, self.generated);
            rank.publish_events();
            rank.wake(admitted);
        }
    }
}

pub(super) async fn generate(
    shared: Arc<Shared>,
    incarnation: Arc<Incarnation>,
    api: Api,
    body: Bytes,
    mut arrival: Arrival,
) -> Response<Body> {
    let params = shared.params.load_full();
    let (request, prompt, output) = match accept(&shared, &incarnation, &params, api, &body) {
        Ok(accepted) => accepted,
        Err((status, message)) => return error(status, &message),
    };
    let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let received = Instant::now();
    if shared.spec.timing == Timing::Step {
        // The API server parses and tokenizes before the scheduler sees the request; a paused engine
        // does not stop it. Its tokenizing takes the server's one loop in turn.
        let front = Duration::try_from_secs_f64(params.profile.front * params.time_scale)
            .unwrap_or(Duration::ZERO);
        let tokenized =
            super::api::api_work(&shared, prompt.len() as f64 * params.profile.api_token);
        tokio::time::sleep_until((received + front).max(tokenized)).await;
    }
    let transfer = match transfer(&shared, &incarnation, &request, &prompt, &params).await {
        Ok(transfer) => transfer,
        Err((status, message)) => return error(status, &message),
    };
    let remote = match &transfer {
        Transfer::Pulled(pulled) => pulled.tokens,
        _ => 0,
    };
    let (ticket, submitted, rank_index) = {
        let Some((rank_index, mut rank)) = incarnation.least_loaded() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "no engine rank");
        };
        let submitted = rank.engine.submit(id, &prompt, output, remote, received);
        rank.publish_events();
        arrival.arrived();
        let submitted = match submitted {
            Ok(submitted) => submitted,
            Err(refusal) => return refused(refusal),
        };
        let ticket = Ticket {
            incarnation: Arc::clone(&incarnation),
            rank: rank_index,
            id,
            completed: false,
            generated: 0,
        };
        (ticket, submitted, rank_index)
    };
    let rng = SmallRng::seed_from_u64(shared.spec.seed ^ id.rotate_left(17));
    let Some((cached_tokens, pace)) = admitted(submitted, rng).await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine restarted");
    };

    let run = Run {
        shared: Arc::clone(&shared),
        request_seed: shared.spec.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        api,
        id: format!("{}-{id}", api_prefix(api)),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs()),
        prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        output,
        cached_tokens,
        received,
        ticket,
        pace,
    };
    let headers = ResponseHeaders {
        served_by: shared.id.clone(),
        rank: (shared.spec.dp_size > 1).then_some(rank_index),
        cached: cached_tokens,
        transfer,
    };
    if request.stream {
        stream_response(run, request, headers)
    } else {
        complete_response(run, headers).await
    }
}

/// A request as the API server takes it: parsed, checked against the worker's role and the model's
/// context, tokenized; with the output length it asks for. An error is the status and message it is
/// answered with.
fn accept(
    shared: &Shared,
    incarnation: &Incarnation,
    params: &SimParams,
    api: Api,
    body: &Bytes,
) -> Result<(SimRequest, Vec<u32>, u32), (StatusCode, String)> {
    let mut request = read(shared, api, body)?;
    // SGLang's prefill worker computes the prompt and one token, answered whole; its router drains it.
    let mode = shared.spec.disaggregation;
    if mode == Disaggregation::Prefill {
        request.max_tokens = Some(1);
        request.stream = false;
    }
    if mode != Disaggregation::Null && request.bootstrap.is_none() {
        let message = format!(
            "a {} worker (disaggregation_mode {}) needs bootstrap_host, bootstrap_port and \
             bootstrap_room",
            mode.as_str(),
            mode.as_str()
        );
        return Err((StatusCode::BAD_REQUEST, message));
    }
    if params.failure_rate > 0.0 && lock(&shared.rng).random::<f64>() < params.failure_rate {
        if let Some(mut rank) = incarnation.rank(0) {
            rank.engine.count_rejected();
        }
        return Err((
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected failure (failure_rate)".to_owned(),
        ));
    }
    let prompt = tokens(&shared.spec.tokenizer, &request.prompt)
        .map_err(|message| (StatusCode::BAD_REQUEST, message))?;
    let output = request
        .max_tokens
        .unwrap_or(params.default_max_tokens.get());
    let total = u64::try_from(prompt.len())
        .unwrap_or(u64::MAX)
        .saturating_add(u64::from(output));
    if total > u64::from(params.max_model_len.get()) {
        let message = format!(
            "This model's maximum context length is {} tokens. However, you requested {total} tokens \
             ({} in the messages, {output} in the completion). Please reduce the length of the \
             messages or completion.",
            params.max_model_len,
            prompt.len()
        );
        return Err((StatusCode::BAD_REQUEST, message));
    }
    Ok((request, prompt, output))
}

/// The KV a request brings: a decode leg pulls what its prefill worker leased before the scheduler can
/// run it; a prefill leg leases its room. An error is the status and message the request is answered with.
async fn transfer(
    shared: &Arc<Shared>,
    incarnation: &Incarnation,
    request: &SimRequest,
    prompt: &[u32],
    params: &SimParams,
) -> Result<Transfer, (StatusCode, String)> {
    match &request.kv_transfer {
        Some(KvTransfer::RemotePrefill {
            engine_id,
            request_id,
            host,
            port,
        }) => {
            let held = incarnation
                .rank(0)
                .map_or(0, |rank| rank.engine.cached_tokens(prompt));
            match nixl::pull(shared, engine_id, request_id, host, *port, held).await {
                Ok(pulled) => Ok(Transfer::Pulled(pulled)),
                Err(why) => match params.pd.load_failure {
                    LoadFailure::Fail => Err((
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("KV transfer failed (kv_load_failure_policy fail): {why}"),
                    )),
                    LoadFailure::Recompute => Ok(Transfer::Recomputed),
                },
            }
        }
        Some(KvTransfer::RemoteDecode) => Ok(Transfer::Leased),
        None => match (shared.spec.disaggregation, &request.bootstrap) {
            (Disaggregation::Prefill, Some(rendezvous)) => Ok(Transfer::Room(rendezvous.room)),
            (Disaggregation::Decode, Some(rendezvous)) => {
                let held = incarnation
                    .rank(0)
                    .map_or(0, |rank| rank.engine.cached_tokens(prompt));
                let pulled = bootstrap::pull(
                    shared,
                    &rendezvous.host,
                    rendezvous.port,
                    rendezvous.room,
                    held,
                )
                .await;
                match pulled {
                    Ok(pulled) => Ok(Transfer::Pulled(pulled)),
                    Err(why) => {
                        let message = format!(
                            "Decode transfer failed for request rid=bootstrap_room {}: {why}",
                            rendezvous.room
                        );
                        Err((StatusCode::INTERNAL_SERVER_ERROR, message))
                    }
                }
            }
            _ => Ok(Transfer::None),
        },
    }
}

/// The admission a submission ends in (the slots model) or the first progress that names its cached
/// tokens (the step model); `None` when the engine restarted meanwhile.
async fn admitted(submitted: Submitted, rng: SmallRng) -> Option<(u32, Pace)> {
    match submitted {
        Submitted::Admitted(admission) => Some((
            admission.cached_tokens,
            Pace::Slots {
                uncached: admission.uncached_tokens,
                rng,
            },
        )),
        Submitted::Queued(receiver) => receiver.await.ok().map(|admission| {
            (
                admission.cached_tokens,
                Pace::Slots {
                    uncached: admission.uncached_tokens,
                    rng,
                },
            )
        }),
        Submitted::Stepping(mut progress) => {
            let cached = progress
                .wait_for(|progress| progress.cached.is_some() || progress.done)
                .await
                .ok()
                .map(|progress| progress.cached.unwrap_or(0))?;
            Some((cached, Pace::Step { progress, seen: 0 }))
        }
    }
}

/// Which leg of a disaggregated request this is, as the response headers report it.
enum Transfer {
    /// Aggregated: prefilled here.
    None,
    /// A prefill leg: its KV is leased for a decode worker.
    Leased,
    /// An SGLang prefill leg: its KV waits in this bootstrap room for the decode worker.
    Room(u64),
    /// A decode leg that pulled its KV.
    Pulled(nixl::Pulled),
    /// A decode leg whose pull failed, prefilled here (`kv_load_failure_policy: recompute`).
    Recomputed,
}

fn api_prefix(api: Api) -> &'static str {
    match api {
        Api::Chat => "chatcmpl",
        Api::Completion => "cmpl",
        Api::Generate => "gen",
    }
}

/// What paces a running request's tokens.
enum Pace {
    /// The slots model: its own prefill of `uncached` tokens and token gaps, drawn from `rng`.
    Slots { uncached: u32, rng: SmallRng },
    /// The step model: whatever its rank's engine loop reports; `seen` tokens were already taken.
    Step {
        progress: watch::Receiver<Progress>,
        seen: u32,
    },
}

fn refused(refusal: Refusal) -> Response<Body> {
    match refusal {
        Refusal::QueueFull { .. } => error(StatusCode::SERVICE_UNAVAILABLE, &refusal.to_string()),
        Refusal::TooLong { .. } => error(StatusCode::BAD_REQUEST, &refusal.to_string()),
        Refusal::DuplicateId { .. } => {
            error(StatusCode::INTERNAL_SERVER_ERROR, &refusal.to_string())
        }
    }
}

/// The request's body parsed for `api`, or the status and message the engine refuses it with: 4xx for
/// a body it would not take, 404 for another model than the one served (SGLang's `/generate` names none
/// it checks).
pub(super) fn read(
    shared: &Shared,
    api: Api,
    body: &[u8],
) -> Result<SimRequest, (StatusCode, String)> {
    let request = wire::parse(api, body).map_err(|problem| {
        let status = StatusCode::from_u16(problem.status()).unwrap_or(StatusCode::BAD_REQUEST);
        (status, problem.to_string())
    })?;
    if let Some(model) = request.model.as_deref()
        && model != shared.spec.model
        && api != Api::Generate
    {
        return Err((
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        ));
    }
    Ok(request)
}

/// The prompt's tokens as the engine sees them: a chat rendered by the template and tokenized whole
/// without added special tokens; a text prompt tokenized whole with them; token ids as given.
pub(crate) fn tokens(tokenizer: &Tokenizer, prompt: &Prompt) -> Result<Vec<u32>, String> {
    match prompt {
        Prompt::Tokens(tokens) => Ok(tokens.clone()),
        Prompt::Text(text) => tokenizer
            .encode_whole(text, true)
            .map_err(|error| error.to_string()),
        Prompt::Chat { messages, tools } => {
            let parts: Vec<[std::borrow::Cow<'_, str>; 1]> = messages
                .iter()
                .map(|message| [std::borrow::Cow::Borrowed(message.content.as_str())])
                .collect();
            let turns: Vec<ChatTurn<'_>> = messages
                .iter()
                .zip(&parts)
                .map(|(message, parts)| ChatTurn {
                    role: &message.role,
                    parts,
                })
                .collect();
            let text = tokenizer
                .render_chat(Chat::new(&turns).with_tools(tools.as_deref()))
                .map_err(|error| error.to_string())?;
            tokenizer
                .encode_whole(&text, false)
                .map_err(|error| error.to_string())
        }
    }
}

struct ResponseHeaders {
    served_by: String,
    rank: Option<usize>,
    cached: u32,
    transfer: Transfer,
}

impl ResponseHeaders {
    fn apply(&self, response: &mut Response<Body>) {
        let headers = response.headers_mut();
        if let Ok(value) = HeaderValue::from_str(&self.served_by) {
            headers.insert("x-served-by", value);
        }
        headers.insert("x-cached-tokens", HeaderValue::from(self.cached));
        if let Some(rank) = self.rank {
            headers.insert("x-served-by-rank", HeaderValue::from(rank));
        }
        // Which leg this was, and for a decode leg where its KV came from.
        let kind = match &self.transfer {
            Transfer::None => "local",
            Transfer::Leased | Transfer::Room(_) => "leased",
            Transfer::Pulled(_) => "pulled",
            Transfer::Recomputed => "recomputed",
        };
        headers.insert("x-kv-transfer", HeaderValue::from_static(kind));
        if let Transfer::Pulled(pulled) = &self.transfer {
            if let Ok(value) = HeaderValue::from_str(&pulled.prefill_worker) {
                headers.insert("x-prefilled-by", value);
            }
            headers.insert("x-kv-pulled-tokens", HeaderValue::from(pulled.tokens));
            headers.insert("x-kv-moved-tokens", HeaderValue::from(pulled.moved));
        }
    }
}

/// An admitted request being generated.
struct Run {
    shared: Arc<Shared>,
    request_seed: u64,
    api: Api,
    id: String,
    created: u64,
    prompt_tokens: u32,
    output: u32,
    cached_tokens: u32,
    received: Instant,
    ticket: Ticket,
    pace: Pace,
}

impl Run {
    fn running(&self) -> u64 {
        self.ticket
            .incarnation
            .rank(self.ticket.rank)
            .map_or(1, |rank| rank.engine.running())
    }

    /// Waits for the first output token: the slots model's own prefill (which records the TTFT), or
    /// the step at whose end the engine emits it.
    async fn prefill(&mut self) {
        if let Pace::Step { progress, seen } = &mut self.pace {
            if let Ok(now) = progress
                .wait_for(|progress| progress.generated > 0 || progress.done)
                .await
            {
                *seen = now.generated.min(1);
            }
            return;
        }
        let params = self.shared.params.load_full();
        let running = self.running();
        let Pace::Slots { uncached, rng } = &mut self.pace else {
            return;
        };
        let duration = timing::prefill(&params, *uncached, running, rng);
        sleep_unpaused(&self.shared, Instant::now() + duration).await;
        self.observe(|rank, seconds| rank.ttft.observe(seconds));
    }

    /// Waits until at least one more token is due and returns how many are (at most `remaining`). The
    /// slots model sleeps its gaps, `deadline` advancing by each so timer granularity never slows the
    /// stream; the step model takes every token the engine produced since the last call.
    async fn next_tokens(&mut self, deadline: &mut Instant, remaining: u32) -> u32 {
        if let Pace::Step { progress, seen } = &mut self.pace {
            let before = *seen;
            return match progress
                .wait_for(|progress| progress.generated > before || progress.done)
                .await
            {
                Ok(now) if now.generated > before => {
                    *seen = now.generated;
                    (now.generated - before).min(remaining)
                }
                // Done, or the engine is gone: nothing more will come.
                _ => remaining,
            };
        }
        let params = self.shared.params.load_full();
        let running = self.running();
        let Pace::Slots { rng, .. } = &mut self.pace else {
            return remaining;
        };
        let gap = timing::token_gap(&params, running, rng);
        *deadline = sleep_unpaused(&self.shared, *deadline + gap).await;
        let now = Instant::now();
        let mut due = 1;
        while due < remaining {
            let gap = timing::token_gap(&params, running, rng);
            if *deadline + gap > now {
                break;
            }
            *deadline += gap;
            due += 1;
        }
        due
    }

    fn text(&self, from: u32, count: u32) -> String {
        (from..from.saturating_add(count))
            .map(|index| wire::output_token(self.request_seed, index))
            .collect()
    }

    fn observe(&self, record: impl FnOnce(&mut Rank, f64)) {
        if let Some(mut rank) = self.ticket.incarnation.rank(self.ticket.rank) {
            record(&mut rank, self.received.elapsed().as_secs_f64());
        }
    }

    fn finish(&mut self) {
        self.ticket.completed = true;
        self.ticket.generated = self.output;
        // The step model's engine loop records the end-to-end latency when the request leaves it.
        if matches!(self.pace, Pace::Slots { .. }) {
            self.observe(|rank, seconds| rank.e2e.observe(seconds));
        }
    }

    fn outcome<'a>(&'a self, text: &'a str, completion_tokens: u32) -> Outcome<'a> {
        Outcome {
            id: &self.id,
            model: &self.shared.spec.model,
            created: self.created,
            text,
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            cached_tokens: self.cached_tokens,
            finish_reason: "length",
            vllm: self.shared.spec.engine == Engine::Vllm,
        }
    }
}

async fn complete_response(mut run: Run, headers: ResponseHeaders) -> Response<Body> {
    run.prefill().await;
    let mut deadline = Instant::now();
    let mut produced = if run.output > 0 { 1 } else { 0 };
    run.ticket.generated = produced;
    while produced < run.output {
        produced += run.next_tokens(&mut deadline, run.output - produced).await;
        run.ticket.generated = produced;
    }
    run.finish();
    let text = run.text(0, run.output);
    let mut body = wire::response_body(run.api, &run.outcome(&text, run.output));
    // A prefill leg that ended on its cap answers the parameters its decode worker pulls with.
    if matches!(headers.transfer, Transfer::Leased) {
        let params = nixl::lease(
            &run.shared,
            &run.ticket.incarnation,
            &run.id,
            run.prompt_tokens,
        );
        body = nixl::with_params(body, &params);
    }
    if let Transfer::Room(room) = headers.transfer {
        bootstrap::hold(
            &run.shared,
            &run.ticket.incarnation,
            room,
            run.prompt_tokens,
        );
    }
    let mut response = json(StatusCode::OK, body);
    headers.apply(&mut response);
    response
}

/// Where a stream is.
enum Phase {
    Prefill,
    Decode { produced: u32, deadline: Instant },
    End,
    Done,
}

fn stream_response(run: Run, request: SimRequest, headers: ResponseHeaders) -> Response<Body> {
    let include_usage = request.include_usage;
    let events =
        futures_util::stream::unfold((run, Phase::Prefill), move |(mut run, phase)| async move {
            match phase {
                Phase::Prefill => {
                    run.prefill().await;
                    if run.output == 0 {
                        return Some((Bytes::new(), (run, Phase::End)));
                    }
                    // A client that leaves mid-stream still cost the tokens it was sent.
                    run.ticket.generated = 1;
                    let text = run.text(0, 1);
                    let chunk = wire::stream_chunk(run.api, &run.outcome(&text, 1), &text, true);
                    let next = Phase::Decode {
                        produced: 1,
                        deadline: Instant::now(),
                    };
                    Some((chunk, (run, next)))
                }
                Phase::Decode {
                    produced,
                    mut deadline,
                } if produced < run.output => {
                    let due = run.next_tokens(&mut deadline, run.output - produced).await;
                    let text = run.text(produced, due);
                    let total = produced + due;
                    run.ticket.generated = total;
                    let cumulative;
                    // SGLang's /generate sends the text so far in every event, OpenAI APIs the delta.
                    let outcome_text = if run.api == Api::Generate {
                        cumulative = run.text(0, total);
                        cumulative.as_str()
                    } else {
                        text.as_str()
                    };
                    let chunk = wire::stream_chunk(
                        run.api,
                        &run.outcome(outcome_text, total),
                        &text,
                        false,
                    );
                    Some((
                        chunk,
                        (
                            run,
                            Phase::Decode {
                                produced: total,
                                deadline,
                            },
                        ),
                    ))
                }
                Phase::Decode { .. } | Phase::End => {
                    run.finish();
                    let text = run.text(0, run.output);
                    let end =
                        wire::stream_end(run.api, &run.outcome(&text, run.output), include_usage);
                    Some((end, (run, Phase::Done)))
                }
                Phase::Done => None,
            }
        })
        .filter(|chunk| std::future::ready(!chunk.is_empty()))
        .map(|chunk| Ok::<_, Infallible>(Frame::data(chunk)));
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(events)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
        .headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    headers.apply(&mut response);
    response
}

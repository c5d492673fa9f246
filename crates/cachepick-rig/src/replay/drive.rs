//! The open-loop driver: every request is sent at its scheduled time, streamed to the end, and measured.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;

use super::behind::{Held, InProcess, REQUEST_ID_HEADER, Tickets};
use super::trace::{Item, PromptBuilder};
use cachepick::protocol::{DECISION_HEADER, DESTINATION, PREFIX_TOKENS_HEADER, REFUSAL_HEADER};

use crate::client::{Client as PickerClient, Verdict};

/// Where requests go: to an HTTP router in front of the workers (Envoy with cachepick, or another
/// router under comparison), to the picker over ext_proc and then to the chosen worker, or to the
/// worker an in-process router (a re-implemented peer, the oracle) chooses, directly or through Envoy.
#[derive(Clone)]
pub enum Route {
    Proxy(SocketAddr),
    Direct(PickerClient),
    /// An in-process router asked directly; the request goes straight to the worker it chose, and a
    /// peer's ticket is told of the first chunk and the end.
    InProcess(InProcess),
    /// Envoy in front, its ext_proc an in-process router's server ([`super::behind`]), which files a
    /// peer's ticket under the request's number for the driver to settle.
    Behind {
        envoy: SocketAddr,
        tickets: Arc<Tickets>,
    },
}

/// How one request ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum End {
    /// Streamed to the end with usage.
    Ok,
    /// The picker refused it (an immediate response).
    #[default]
    Refused,
    /// Any other failure: a worker error status, a broken or cut-off stream, no usage.
    Error,
    /// Not sent: the in-flight bound was reached.
    Dropped,
}

/// One request's outcome as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub index: usize,
    pub phase: usize,
    /// Scheduled send time from the start of the run.
    pub at: Duration,
    pub end: End,
    pub status: u16,
    /// The decision reason (or the rejection reason).
    pub reason: String,
    /// The worker that served it (`x-served-by`).
    pub worker: Option<String>,
    /// Leading prompt tokens the picker credited that worker with (its `x-cachepick-prefix-tokens`, as
    /// the worker received it); `None` when the worker was not told.
    pub prefix_tokens: Option<u64>,
    /// The answer came through Envoy (it carries [`ENVOY_UPSTREAM_TIME`]).
    pub through_envoy: bool,
    pub ttft: Option<Duration>,
    pub e2e: Option<Duration>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The trace's id of the prompt's first prefix block: requests that share it share their leading
    /// tokens.
    pub first_block: Option<u64>,
}

const PATH: &str = "/v1/completions";
/// The header Envoy's router adds to every answer it proxied from an upstream.
const ENVOY_UPSTREAM_TIME: &str = "x-envoy-upstream-service-time";
/// How long one request may take, from sending it to the end of its streamed answer.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);

/// Sends every item at `timestamp_ms / speedup` after the start, at most `max_in_flight` at once (a
/// request due while the bound is reached is dropped and counted, so arrivals stay open-loop).
pub async fn drive(
    route: &Route,
    items: &[Item],
    prompts: &PromptBuilder,
    model: &str,
    speedup: f64,
    max_in_flight: usize,
) -> Vec<Sample> {
    let http: HttpClient<HttpConnector, Full<Bytes>> = HttpClient::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let limit = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let first = items.first().map_or(0, |item| item.timestamp_ms);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(items.len());
    let mut samples = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let at = Duration::from_secs_f64((item.timestamp_ms - first) as f64 / 1000.0 / speedup);
        tokio::time::sleep_until(started + at).await;
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            samples.push(Sample {
                index,
                phase: item.phase,
                at,
                end: End::Dropped,
                first_block: item.hash_ids.first().copied(),
                ..Sample::default()
            });
            continue;
        };
        let prompt = prompts.prompt(item);
        let body = serde_json::json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": item.output_length,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let http = http.clone();
        let route = route.clone();
        let phase = item.phase;
        let first_block = item.hash_ids.first().copied();
        tasks.push(tokio::spawn(async move {
            let mut sample = one(&http, route, body, &prompt, index as u64).await;
            sample.index = index;
            sample.phase = phase;
            sample.first_block = first_block;
            sample.at = at;
            drop(permit);
            sample
        }));
    }
    for task in tasks {
        if let Ok(sample) = task.await {
            samples.push(sample);
        }
    }
    samples.sort_by_key(|sample| sample.index);
    samples
}

/// Sends one streaming completion of `prompt` and reads it to the end, within [`REQUEST_DEADLINE`].
///
/// Over 100 lines: one request from its route to its last byte, filling one sample as it goes.
async fn one(
    http: &HttpClient<HttpConnector, Full<Bytes>>,
    route: Route,
    body: String,
    prompt: &str,
    id: u64,
) -> Sample {
    let mut sample = Sample {
        end: End::Error,
        ..Sample::default()
    };
    let started = Instant::now();
    // Held to the end of the request: dropping it ends the request's load on the peer's replica.
    let mut ticket: Option<Held> = None;
    // Settles a ticket filed behind Envoy when the request ends, however it ends.
    let mut settle: Option<Settle> = None;
    let (addr, headers) = match route {
        Route::Proxy(addr) => (addr, Vec::new()),
        Route::Behind { envoy, tickets } => {
            settle = Some(Settle { tickets, id });
            (envoy, vec![(REQUEST_ID_HEADER, id.to_string())])
        }
        Route::InProcess(router) => match router.decide(prompt.to_owned()).await {
            Ok(decided) => {
                ticket = decided.ticket;
                (decided.worker, decided.headers)
            }
            Err(reason) => {
                sample.reason = reason;
                return sample;
            }
        },
        Route::Direct(client) => match client.decide(PATH, body.as_bytes()).await {
            Ok(Verdict::Route {
                endpoints,
                reason,
                prefix_tokens,
            }) => {
                let Some(first) = endpoints.first().copied() else {
                    return sample;
                };
                let destination: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
                (
                    first,
                    vec![
                        (DESTINATION, destination.join(",")),
                        (DECISION_HEADER, reason),
                        (PREFIX_TOKENS_HEADER, prefix_tokens.to_string()),
                    ],
                )
            }
            Ok(Verdict::Refuse { status, reason, .. }) => {
                sample.status = status;
                sample.reason = reason;
                sample.end = End::Refused;
                return sample;
            }
            Err(error) => {
                sample.reason = format!("ext_proc error: {error}");
                return sample;
            }
        },
    };
    let mut request =
        Request::post(format!("http://{addr}{PATH}")).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let Ok(request) = request.body(Full::new(Bytes::from(body))) else {
        return sample;
    };
    let deadline = tokio::time::Instant::now() + REQUEST_DEADLINE;
    let Ok(Ok(response)) = tokio::time::timeout_at(deadline, http.request(request)).await else {
        return sample;
    };
    sample.status = response.status().as_u16();
    let header = |name: &str| crate::header_text(response.headers(), name);
    if let Some(refusal) = header(REFUSAL_HEADER) {
        sample.reason = refusal;
        sample.end = End::Refused;
        return sample;
    }
    // The simulated worker echoes the routing headers it received: the decision that steered it.
    let echoed = format!("x-sim-echo-{DECISION_HEADER}");
    sample.reason = header(&echoed).unwrap_or_else(|| "none".to_owned());
    sample.prefix_tokens = header(&format!("x-sim-echo-{PREFIX_TOKENS_HEADER}"))
        .and_then(|tokens| tokens.trim().parse().ok());
    sample.worker = header("x-served-by");
    sample.through_envoy = response.headers().contains_key(ENVOY_UPSTREAM_TIME);
    let mut body = response.into_body();
    let mut tail = Vec::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(None | Some(Err(_))) => break,
            Err(_) => return sample,
        };
        if let Some(data) = frame.data_ref() {
            if sample.ttft.is_none() && data.windows(6).any(|window| window == b"data: ") {
                sample.ttft = Some(started.elapsed());
                if let Some(ticket) = &mut ticket {
                    ticket.first_token();
                }
                if let Some(settle) = &settle {
                    settle.tickets.first_token(settle.id);
                }
            }
            tail.extend_from_slice(data);
            if tail.len() > 16 * 1024 {
                tail.drain(..tail.len() - 4 * 1024);
            }
        }
    }
    sample.e2e = Some(started.elapsed());
    let text = String::from_utf8_lossy(&tail);
    let usage = text
        .rsplit("data: ")
        .filter_map(|event| serde_json::from_str::<serde_json::Value>(event.trim()).ok())
        .find_map(|event| event.get("usage").cloned().filter(|usage| !usage.is_null()));
    if let Some(usage) = usage {
        let count = |pointer: &str| usage.pointer(pointer).and_then(serde_json::Value::as_u64);
        sample.prompt_tokens = count("/prompt_tokens").unwrap_or(0);
        sample.cached_tokens = count("/prompt_tokens_details/cached_tokens").unwrap_or(0);
        if sample.status == 200 {
            sample.end = End::Ok;
        }
    }
    sample
}

/// Request `id`'s ticket behind Envoy, let go when the request ends.
struct Settle {
    tickets: Arc<Tickets>,
    id: u64,
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.tickets.settle(self.id);
    }
}

/// Requests per worker, in a stable order.
pub fn per_worker(samples: &[Sample], endpoints: &[SocketAddr]) -> Vec<(String, u64)> {
    let mut counts: HashMap<String, u64> = endpoints.iter().map(|e| (e.to_string(), 0)).collect();
    for sample in samples {
        if let Some(worker) = &sample.worker {
            *counts.entry(worker.clone()).or_default() += 1;
        }
    }
    let mut counts: Vec<(String, u64)> = counts.into_iter().collect();
    counts.sort();
    counts
}

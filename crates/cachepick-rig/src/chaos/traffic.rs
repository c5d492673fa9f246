//! The good traffic: a seeded mix of conversations (groups sharing a system prompt, each conversation's
//! next turn extending its last), sent open-loop through Envoy at a steady rate, each request streamed to
//! its end and recorded as its client saw it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use cachepick::protocol::REFUSAL_HEADER;

use super::classify::{ClientFailure, Observed};
use crate::replay::trace::{Item, PromptBuilder, TRACE_BLOCK_TOKENS};

/// The header that ties a client's request to Envoy's access-log line.
pub const ID_HEADER: &str = "x-chaos-id";
/// The path every good request uses.
pub const PATH: &str = "/v1/completions";

/// System prompts the conversations share, each [`SYSTEM_BLOCKS`] trace blocks long.
const GROUPS: u64 = 8;
const SYSTEM_BLOCKS: u64 = 2;
/// Turns after which a conversation ends; each turn adds one block.
const MAX_TURNS: u64 = 6;
/// Conversations open at once.
const OPEN: usize = 32;
/// Share of arrivals that start a new conversation rather than continue one.
const NEW_SHARE: f64 = 0.35;
const OUTPUT_TOKENS: u32 = 16;

/// One good request: when it is sent and what it asks.
#[derive(Clone, Debug)]
pub struct Good {
    pub id: u64,
    pub at: Duration,
    pub item: Item,
}

/// Poisson arrivals at `rate` per second over `length`, each a conversation's next turn.
pub fn conversations(length: Duration, rate: f64, seed: u64) -> Vec<Good> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x600D_7EA5);
    let rate = if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        1.0
    };
    let mut open: VecDeque<(u64, u64, u64)> = VecDeque::new(); // (group, conversation, turns so far)
    let mut next_conversation = 0_u64;
    let mut at = 0.0_f64;
    let mut out = Vec::new();
    loop {
        at += -(1.0 - rng.random::<f64>()).ln() / rate;
        if at >= length.as_secs_f64() {
            break;
        }
        let continuing =
            !open.is_empty() && (open.len() >= OPEN || rng.random::<f64>() >= NEW_SHARE);
        let (group, conversation, turns) = if continuing {
            let index = rng.random_range(0..open.len());
            let Some(mut chosen) = open.remove(index) else {
                continue;
            };
            chosen.2 += 1;
            chosen
        } else {
            // Popular system prompts first: group g with weight 1 / (g + 1).
            let weights: f64 = (0..GROUPS).map(|g| 1.0 / (g + 1) as f64).sum();
            let mut pick = rng.random::<f64>() * weights;
            let mut group = 0;
            for g in 0..GROUPS {
                pick -= 1.0 / (g + 1) as f64;
                if pick <= 0.0 {
                    group = g;
                    break;
                }
            }
            next_conversation += 1;
            (group, next_conversation, 1)
        };
        let mut hash_ids: Vec<u64> = (0..SYSTEM_BLOCKS)
            .map(|block| group * SYSTEM_BLOCKS + block)
            .collect();
        // Block ids above the system prompts' range: a conversation's blocks are its own.
        hash_ids.extend((0..turns).map(|turn| 1_000 + conversation * MAX_TURNS + turn));
        let blocks = hash_ids.len() as u32;
        out.push(Good {
            id: out.len() as u64,
            at: Duration::from_secs_f64(at),
            item: Item {
                timestamp_ms: (at * 1000.0) as u64,
                // The last block half full: a conversation's next turn shares all but its tail.
                input_length: blocks * TRACE_BLOCK_TOKENS as u32 - TRACE_BLOCK_TOKENS as u32 / 2,
                output_length: OUTPUT_TOKENS,
                hash_ids,
                phase: 0,
            },
        });
        if turns < MAX_TURNS {
            open.push_back((group, conversation, turns));
        }
    }
    out
}

/// The body of a good request.
pub fn body(prompts: &PromptBuilder, model: &str, item: &Item, stream: bool) -> String {
    let mut body = serde_json::json!({
        "model": model,
        "prompt": prompts.prompt(item),
        "max_tokens": item.output_length,
        "stream": stream,
    });
    if stream && let Some(map) = body.as_object_mut() {
        map.insert(
            "stream_options".to_owned(),
            serde_json::json!({"include_usage": true}),
        );
    }
    body.to_string()
}

/// What became of one good request.
#[derive(Clone, Debug)]
pub struct Sent {
    pub id: String,
    pub seen: Observed,
}

/// Sends every request at its time after `start` to Envoy at `envoy`, at most `max_in_flight` at once
/// (one due beyond it is not sent, and counted by the caller from the returned `None`s), each within
/// `deadline`.
pub async fn drive(
    envoy: SocketAddr,
    requests: &[Good],
    prompts: &PromptBuilder,
    model: &str,
    start: Instant,
    deadline: Duration,
    max_in_flight: usize,
) -> (Vec<Sent>, usize) {
    let http: HttpClient<HttpConnector, Full<Bytes>> = HttpClient::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http();
    let limit = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let mut tasks = Vec::with_capacity(requests.len());
    let mut not_sent = 0;
    for request in requests {
        tokio::time::sleep_until(start + request.at).await;
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            not_sent += 1;
            continue;
        };
        let body = body(prompts, model, &request.item, true);
        let http = http.clone();
        let id = request.id.to_string();
        tasks.push(tokio::spawn(async move {
            let seen = one(&http, envoy, &id, body, start, deadline).await;
            drop(permit);
            Sent { id, seen }
        }));
    }
    let mut sent = Vec::with_capacity(tasks.len());
    for task in tasks {
        if let Ok(one) = task.await {
            sent.push(one);
        }
    }
    (sent, not_sent)
}

/// One streaming completion through Envoy, read to its end.
async fn one(
    http: &HttpClient<HttpConnector, Full<Bytes>>,
    envoy: SocketAddr,
    id: &str,
    body: String,
    start: Instant,
    deadline: Duration,
) -> Observed {
    let mut seen = Observed {
        sent: start.elapsed(),
        ..Observed::default()
    };
    let until = Instant::now() + deadline;
    let request = Request::post(format!("http://{envoy}{PATH}"))
        .header("content-type", "application/json")
        .header(ID_HEADER, id)
        .body(Full::new(Bytes::from(body)));
    let Ok(request) = request else {
        seen.failure = Some(ClientFailure::Connect(
            "cannot build the request".to_owned(),
        ));
        seen.ended = start.elapsed();
        return seen;
    };
    let response = match tokio::time::timeout_at(until, http.request(request)).await {
        Err(_) => {
            seen.failure = Some(ClientFailure::Timeout);
            seen.ended = start.elapsed();
            return seen;
        }
        Ok(Err(error)) => {
            seen.failure = Some(if error.is_connect() {
                ClientFailure::Connect(error.to_string())
            } else {
                ClientFailure::Broken(error.to_string())
            });
            seen.ended = start.elapsed();
            return seen;
        }
        Ok(Ok(response)) => response,
    };
    seen.status = Some(response.status().as_u16());
    let header = |name: &str| crate::header_text(response.headers(), name);
    seen.refusal = header(REFUSAL_HEADER);
    seen.served_by = header("x-served-by");
    let mut body = response.into_body();
    let mut tail = Vec::new();
    loop {
        match tokio::time::timeout_at(until, body.frame()).await {
            Err(_) => {
                seen.failure = Some(ClientFailure::Timeout);
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(error))) => {
                seen.failure = Some(ClientFailure::Broken(error.to_string()));
                break;
            }
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    tail.extend_from_slice(data);
                    if tail.len() > 16 * 1024 {
                        tail.drain(..tail.len() - 4 * 1024);
                    }
                }
            }
        }
    }
    seen.ended = start.elapsed();
    seen.complete = seen.failure.is_none() && has_usage(&tail);
    seen
}

/// Whether a response body (JSON, or SSE events) ends with a usage object, as a finished generation
/// does.
pub fn has_usage(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    text.rsplit("data: ")
        .chain(std::iter::once(text.as_ref()))
        .filter_map(|event| serde_json::from_str::<serde_json::Value>(event.trim()).ok())
        .any(|event| event.get("usage").is_some_and(|usage| !usage.is_null()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_extend_their_own_prefix_and_arrive_at_the_rate() {
        let requests = conversations(Duration::from_secs(100), 10.0, 3);
        assert!((800..1_200).contains(&requests.len()), "{}", requests.len());
        assert!(requests.windows(2).all(|pair| pair[0].at <= pair[1].at));
        // Some request is a later turn of an earlier one: its blocks start with all of the earlier one's.
        let continued = requests.iter().any(|later| {
            requests.iter().any(|earlier| {
                earlier.at < later.at
                    && earlier.item.hash_ids.len() + 1 == later.item.hash_ids.len()
                    && later.item.hash_ids.starts_with(&earlier.item.hash_ids)
            })
        });
        assert!(continued);
        assert!(requests.iter().all(|request| {
            let blocks = request.item.hash_ids.len() as u64;
            (SYSTEM_BLOCKS + 1..=SYSTEM_BLOCKS + MAX_TURNS).contains(&blocks)
        }));
        assert_eq!(
            conversations(Duration::from_secs(5), 10.0, 3).len(),
            conversations(Duration::from_secs(5), 10.0, 3).len()
        );
    }

    #[test]
    fn usage_is_found_in_json_and_in_the_last_sse_event() {
        assert!(has_usage(br#"{"choices":[],"usage":{"prompt_tokens":3}}"#));
        assert!(has_usage(
            b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n"
        ));
        assert!(!has_usage(b"data: {\"choices\":[]}\n\n"));
        assert!(!has_usage(br#"{"usage":null}"#));
    }
}

//! vLLM's NixlConnector between simulated workers: the prefill leg's lease and parameters, and the
//! decode leg's pull.
//!
//! A prefill leg (`kv_transfer_params.do_remote_decode`) that ends on its output cap answers, besides
//! its one token, the `kv_transfer_params` vLLM's scheduler returns (`do_remote_prefill`,
//! `remote_block_ids`, `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`,
//! `remote_num_tokens`), and leases the prompt's KV for [`PdParams::lease`]. The engine id names the
//! worker's incarnation: a restart loses every lease, and parameters from before it no longer match.
//!
//! A decode leg (`do_remote_prefill`) claims the lease from the named worker — the simulator's stand-in
//! for NIXL's side-channel handshake and READ is one HTTP request, `GET /sim/nixl/<engine>/<request>`
//! — then waits, counted as waiting (vLLM's `WAITING_FOR_REMOTE_KVS`), while the tokens it does not
//! hold cross its link: `tokens × kv_bytes_per_token / link_bytes_per_second`, transfers queued first
//! come first served on the decode worker's link. It then runs with the pulled tokens held, and
//! their blocks enter its prefix cache (published as `BlockStored`) as vLLM's `cache_blocks` does.
//!
//! [`PdParams::lease`]: crate::config::PdParams

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use super::{Body, Incarnation, Shared, error, json, lock};

/// NIXL's side channel fails fast on an unreachable peer (a ZMQ receive timeout of about 5 s).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(5);

/// A finished prefill's KV, kept for its decode worker.
pub(super) struct Lease {
    tokens: u32,
    expires: Instant,
}

/// The leases of one incarnation, by request id.
pub(super) type Leases = std::sync::Mutex<HashMap<String, Lease>>;

/// The engine id an incarnation answers in its parameters.
pub(super) fn engine_id(shared: &Shared, incarnation: &Incarnation) -> String {
    format!("{}@{}", shared.id, incarnation.started)
}

/// Leases a finished prefill's `tokens` and returns the parameters its response carries.
pub(super) fn lease(
    shared: &Shared,
    incarnation: &Incarnation,
    request_id: &str,
    tokens: u32,
) -> serde_json::Value {
    let params = shared.params.load_full();
    let lease = params.pd.lease.mul_f64(params.time_scale.max(0.0));
    let now = Instant::now();
    {
        let mut leases = lock(&incarnation.leases);
        leases.retain(|_, lease| lease.expires > now);
        leases.insert(
            request_id.to_owned(),
            Lease {
                tokens,
                expires: now + lease,
            },
        );
    }
    let blocks = u64::from(tokens).div_ceil(u64::from(shared.spec.block_size.get()));
    serde_json::json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": (0..blocks).collect::<Vec<u64>>(),
        "remote_engine_id": engine_id(shared, incarnation),
        "remote_request_id": request_id,
        "remote_host": shared.spec.addr.ip().to_string(),
        "remote_port": shared.spec.addr.port(),
        "tp_size": 1,
        "remote_num_tokens": tokens,
    })
}

/// Appends `params` to a JSON object response body as its `kv_transfer_params` member.
pub(super) fn with_params(mut body: Vec<u8>, params: &serde_json::Value) -> Vec<u8> {
    let Some(end) = body.iter().rposition(|byte| *byte == b'}') else {
        return body;
    };
    let member = format!(",\"kv_transfer_params\":{params}}}");
    body.truncate(end);
    body.extend_from_slice(member.as_bytes());
    body
}

/// `GET /sim/nixl/<engine>/<request>` on the prefill worker: hands the lease over once (404 when it
/// expired, was taken, or names another incarnation).
pub(super) fn claim(shared: &Shared, incarnation: &Incarnation, path: &str) -> Response<Body> {
    let rest = path.trim_start_matches("/sim/nixl/");
    let Some((engine, request)) = rest.rsplit_once('/') else {
        return error(
            StatusCode::BAD_REQUEST,
            "expected /sim/nixl/<engine>/<request>",
        );
    };
    if engine != engine_id(shared, incarnation) {
        return error(StatusCode::NOT_FOUND, "unknown engine id (restarted?)");
    }
    let lease = lock(&incarnation.leases).remove(request);
    match lease {
        Some(lease) if lease.expires > Instant::now() => json(
            StatusCode::OK,
            serde_json::json!({"tokens": lease.tokens, "served_by": shared.id})
                .to_string()
                .into_bytes(),
        ),
        Some(_) => error(StatusCode::NOT_FOUND, "the KV lease expired"),
        None => error(StatusCode::NOT_FOUND, "no KV lease for this request"),
    }
}

/// What a decode leg pulled.
pub(super) struct Pulled {
    /// Prompt tokens the prefill worker computed and leased.
    pub tokens: u32,
    /// Of them, the tokens that crossed the link (the rest this worker held).
    pub moved: u32,
    /// The prefill worker, as it names itself.
    pub prefill_worker: String,
}

/// Claims the lease and waits out the transfer of the tokens this worker lacks (`held` of them it
/// holds already); the error says why the KV could not be pulled.
pub(super) async fn pull(
    shared: &Arc<Shared>,
    engine_id: &str,
    request_id: &str,
    host: &str,
    port: u16,
    held: u32,
) -> Result<Pulled, String> {
    let addr: SocketAddr = format!("{host}:{port}")
        .parse()
        .or_else(|_| format!("[{host}]:{port}").parse())
        .map_err(|_| format!("remote_host {host:?} is not an IP address"))?;
    let shared_count = &shared.transferring;
    shared_count.fetch_add(1, Ordering::Relaxed);
    let result = async {
        let (tokens, prefill_worker) =
            tokio::time::timeout(CLAIM_TIMEOUT, claim_over_http(addr, engine_id, request_id))
                .await
                .map_err(|_| format!("the prefill worker {addr} did not answer the handshake"))??;
        let moved = tokens.saturating_sub(held);
        cross_link(shared, moved).await;
        Ok(Pulled {
            tokens,
            moved,
            prefill_worker,
        })
    }
    .await;
    shared_count.fetch_sub(1, Ordering::Relaxed);
    result
}

/// Waits while `tokens` of KV cross this (decode) worker's link: `tokens × kv_bytes_per_token / link
/// bandwidth`, transfers queued first come first served.
pub(super) async fn cross_link(shared: &Shared, tokens: u32) {
    let params = shared.params.load_full();
    let bytes = u64::from(tokens).saturating_mul(params.profile.kv_bytes_per_token);
    let seconds = bytes as f64 / params.pd.link_bytes_per_second.max(1.0) * params.time_scale;
    let duration = Duration::try_from_secs_f64(seconds).unwrap_or(Duration::ZERO);
    // The decode worker's link carries its transfers one after another.
    let done = {
        let mut free = lock(&shared.link_free);
        let start = (*free).max(Instant::now());
        *free = start + duration;
        *free
    };
    tokio::time::sleep_until(done).await;
}

async fn claim_over_http(
    addr: SocketAddr,
    engine_id: &str,
    request_id: &str,
) -> Result<(u32, String), String> {
    fetch_kv(addr, &format!("/sim/nixl/{engine_id}/{request_id}"))
        .await
        .map_err(|failure| match failure {
            FetchFailure::Unreachable(problem) => {
                format!("the prefill worker {addr} is unreachable: {problem}")
            }
            FetchFailure::Refused(problem) => {
                format!("the prefill worker {addr} refused the pull ({problem})")
            }
        })
}

/// Why a decode worker could not take KV from a prefill worker: no answer, or an answer without it.
pub(super) enum FetchFailure {
    Unreachable(String),
    Refused(String),
}

/// `GET path` on the prefill worker at `addr` (a NIXL claim, an SGLang room): the tokens it hands
/// over and the worker's name for itself.
pub(super) async fn fetch_kv(addr: SocketAddr, path: &str) -> Result<(u32, String), FetchFailure> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let request = Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .map_err(|problem| FetchFailure::Refused(problem.to_string()))?;
    let response = client
        .request(request)
        .await
        .map_err(|problem| FetchFailure::Unreachable(problem.to_string()))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), 64 << 10)
        .collect()
        .await
        .map_err(|problem| FetchFailure::Unreachable(problem.to_string()))?
        .to_bytes();
    if !status.is_success() {
        return Err(FetchFailure::Refused(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body)
        )));
    }
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|problem| FetchFailure::Refused(problem.to_string()))?;
    let tokens = value
        .get("tokens")
        .and_then(serde_json::Value::as_u64)
        .and_then(|tokens| u32::try_from(tokens).ok())
        .ok_or_else(|| FetchFailure::Refused("the answer names no tokens".to_owned()))?;
    let served_by = value
        .get("served_by")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_owned();
    Ok((tokens, served_by))
}

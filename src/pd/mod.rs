//! The handshake of a prefill/decode (PD) pool: vLLM's NixlConnector two-stage relay, performed by
//! cachepick itself (no sidecar).
//!
//! Once the policy chose a prefill worker (the ladder over the pool's `prefill` workers) and a decode
//! worker (decode pressure over its `decode` workers), [`Relay::prefill`] sends the prefill worker the
//! request re-written as vLLM's proxies write it — `kv_transfer_params: {do_remote_decode: true}`, one
//! output token, not streamed — and waits for the `kv_transfer_params` it answers. The decode worker then
//! gets the client's body with those parameters spliced in ([`decode_body`]), and pulls the KV.
//!
//! Failures never cost the client its request: a prefill worker that fails (connection, status, a body
//! that is not the engine's JSON) is replaced once by the next-best prefill worker; if that fails too,
//! or the answer carries no parameters (vLLM answers none for a prefill that stopped before its cap),
//! or the pool's bound of prefill legs in flight is reached, or the body is not one cachepick can
//! re-write (compressed, or not a chat or completion), the decode worker gets the client's body
//! untouched and prefills it itself, as vLLM does without parameters. [`Handoff`] says which, in the
//! `x-cachepick-pd` header and `cachepick_pd_handoffs_total`.
//!
//! The prefill leg is bounded in time (`pd.prefill_timeout`, and the stream's own deadline), in
//! response size (`pd.max_prefill_response_bytes`) and in number (`pd.max_inflight_prefills`), and is
//! dropped — its connection closed, which makes vLLM abort the request — when the client goes away.

mod body;
mod bootstrap;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::config::{PdConfig, WorkerConfig};

pub use body::{decode_body, prefill_body};
pub use bootstrap::{Dispatched, rendezvous_body};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What became of a request's prefill leg. The label values are public: `x-cachepick-pd` and
/// `cachepick_pd_handoffs_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Handoff {
    /// The chosen prefill worker answered the parameters; the decode worker pulls the KV.
    RemotePrefill,
    /// The chosen prefill worker failed; the next-best one answered the parameters.
    RemotePrefillRetried,
    /// Both prefill attempts failed (or the deadline passed): the decode worker prefills locally.
    LocalPrefillFailed,
    /// A prefill worker answered without parameters: the decode worker prefills locally.
    LocalPrefillNoParams,
    /// `pd.max_inflight_prefills` legs were in flight: the decode worker prefills locally.
    LocalPrefillSaturated,
    /// The body cannot be re-written for a prefill leg (compressed, or not a chat or completion): the
    /// decode worker prefills locally.
    LocalPrefillUnreadable,
    /// Conditional disaggregation: the decode worker lacks little of the prompt and has room.
    LocalPrefillShortSuffix,
    /// Conditional disaggregation: the prompt's prefill owner is queued and the decode worker holds
    /// the prefix.
    LocalPrefillOwnerQueued,
}

impl Handoff {
    pub const ALL: [Handoff; 8] = [
        Handoff::RemotePrefill,
        Handoff::RemotePrefillRetried,
        Handoff::LocalPrefillFailed,
        Handoff::LocalPrefillNoParams,
        Handoff::LocalPrefillSaturated,
        Handoff::LocalPrefillUnreadable,
        Handoff::LocalPrefillShortSuffix,
        Handoff::LocalPrefillOwnerQueued,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Handoff::RemotePrefill => "remote_prefill",
            Handoff::RemotePrefillRetried => "remote_prefill_retried",
            Handoff::LocalPrefillFailed => "local_prefill_failed",
            Handoff::LocalPrefillNoParams => "local_prefill_no_params",
            Handoff::LocalPrefillSaturated => "local_prefill_saturated",
            Handoff::LocalPrefillUnreadable => "local_prefill_unreadable",
            Handoff::LocalPrefillShortSuffix => "local_prefill_short_suffix",
            Handoff::LocalPrefillOwnerQueued => "local_prefill_owner_queued",
        }
    }

    /// Whether the decode worker pulls the KV (the body carries parameters).
    pub fn is_remote(self) -> bool {
        matches!(self, Handoff::RemotePrefill | Handoff::RemotePrefillRetried)
    }
}

/// The prefill leg of one request: what the client sent, and where to send it.
pub struct Leg<'a> {
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: &'a str,
    /// The client's body, identity-encoded.
    pub body: Bytes,
    /// The request's `x-request-id`, sent on the prefill leg so both legs share it, as vLLM's proxies do.
    pub request_id: Option<&'a str>,
    /// The client's `authorization`, which an engine started with `--api-key` requires on both legs.
    pub authorization: Option<&'a [u8]>,
    /// The chosen prefill worker, then the one that replaces it if it fails.
    pub prefill: &'a [SocketAddr],
}

/// A finished prefill leg.
#[derive(Debug)]
pub struct Relayed {
    pub handoff: Handoff,
    /// The prefill worker that answered the parameters.
    pub prefill: Option<SocketAddr>,
    /// The decode leg's body when it carries parameters; `None`: the client's body as it came.
    pub body: Option<Vec<u8>>,
    /// Each failed attempt: the worker and why.
    pub failures: Vec<(SocketAddr, String)>,
    /// How long the prefill leg took.
    pub elapsed: Duration,
}

/// One PD pool's prefill legs: its client to the prefill workers and its bound of legs in flight.
pub struct Relay {
    client: HttpClient,
    inflight: Arc<Semaphore>,
    config: PdConfig,
    /// `bootstrap`: the rooms this relay mints, and the prefill workers' own bootstrap ports (a worker
    /// not named takes `pd.bootstrap_port`).
    rooms: bootstrap::Rooms,
    bootstrap_ports: std::collections::HashMap<SocketAddr, u16>,
}

/// An SGLang request's prefill leg, sent and not waited for.
pub struct Rendezvous {
    pub handoff: Handoff,
    /// The prefill worker that was sent the leg.
    pub prefill: Option<SocketAddr>,
    /// Both legs' body; `None`: the client's, untouched (the leg was not sent).
    pub body: Option<Vec<u8>>,
    /// The leg in flight.
    pub dispatched: Option<Dispatched>,
}

impl Relay {
    /// `workers` are the pool's, read for their bootstrap ports.
    pub fn new(config: &PdConfig, workers: &[WorkerConfig]) -> Relay {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        Relay {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector),
            inflight: Arc::new(Semaphore::new(config.max_inflight_prefills.get())),
            config: config.clone(),
            rooms: bootstrap::Rooms::new(),
            bootstrap_ports: workers
                .iter()
                .filter_map(|worker| Some((worker.endpoint, worker.bootstrap_port?)))
                .collect(),
        }
    }

    /// SGLang's rendezvous: mints a room, sends the chosen prefill worker the client's body with it
    /// (not waited for; `on_end` hears how the leg ended and how long it took) and answers the same
    /// body for the decode worker. SGLang's decode worker cannot prefill alone, so a leg that cannot
    /// be sent (the bound of legs in flight, a body that is not a JSON object) leaves the body as the
    /// client sent it, which the decode worker refuses with its own 400.
    pub fn rendezvous(
        &self,
        leg: Leg<'_>,
        on_end: impl FnOnce(Result<(), String>, Duration) + Send + 'static,
    ) -> Rendezvous {
        let unsent = |handoff| Rendezvous {
            handoff,
            prefill: None,
            body: None,
            dispatched: None,
        };
        let Some(&worker) = leg.prefill.first() else {
            return unsent(Handoff::LocalPrefillFailed);
        };
        let Ok(permit) = Arc::clone(&self.inflight).try_acquire_owned() else {
            return unsent(Handoff::LocalPrefillSaturated);
        };
        let port = self
            .bootstrap_ports
            .get(&worker)
            .copied()
            .unwrap_or(self.config.bootstrap_port);
        let room = self.rooms.mint();
        let Some(body) = rendezvous_body(&leg.body, worker, port, room) else {
            return unsent(Handoff::LocalPrefillUnreadable);
        };
        let client = self.client.clone();
        let outbound = bootstrap::Outbound {
            path: leg.path.to_owned(),
            body: Bytes::from(body.clone()),
            request_id: leg.request_id.map(str::to_owned),
            authorization: leg.authorization.map(<[u8]>::to_vec),
        };
        let limit = self.config.max_prefill_response_bytes.get();
        let timeout = self.config.prefill_timeout;
        let task = tokio::spawn(async move {
            let _permit = permit;
            let started = Instant::now();
            let ended = bootstrap::send(&client, worker, outbound, limit, timeout).await;
            on_end(ended, started.elapsed());
        });
        Rendezvous {
            handoff: Handoff::RemotePrefill,
            prefill: Some(worker),
            body: Some(body),
            dispatched: Some(Dispatched::new(task)),
        }
    }

    pub fn config(&self) -> &PdConfig {
        &self.config
    }

    /// Legs in flight now.
    pub fn inflight(&self) -> usize {
        self.config
            .max_inflight_prefills
            .get()
            .saturating_sub(self.inflight.available_permits())
    }

    /// Runs the prefill leg until `deadline` (cut to `pd.prefill_timeout` from now). Never fails: what
    /// cannot be done remotely is done by the decode worker, and the answer says so.
    pub async fn prefill(&self, leg: Leg<'_>, deadline: Instant) -> Relayed {
        let started = Instant::now();
        let deadline = deadline.min(started + self.config.prefill_timeout);
        let local = |handoff, failures| Relayed {
            handoff,
            prefill: None,
            body: None,
            failures,
            elapsed: started.elapsed(),
        };
        let Ok(_permit) = self.inflight.try_acquire() else {
            return local(Handoff::LocalPrefillSaturated, Vec::new());
        };
        // A multi-megabyte prompt is parsed and written again off the async workers.
        let (path, body) = (leg.path.to_owned(), leg.body.clone());
        let tagged = tokio::task::spawn_blocking(move || prefill_body(&path, &body)).await;
        let Ok(Some(tagged)) = tagged else {
            return local(Handoff::LocalPrefillUnreadable, Vec::new());
        };
        let tagged = Bytes::from(tagged);
        let mut failures = Vec::new();
        for (attempt, &worker) in leg.prefill.iter().take(ATTEMPTS).enumerate() {
            let call = self.call(worker, &leg, tagged.clone());
            let answer = match tokio::time::timeout_at(deadline, call).await {
                Ok(answer) => answer,
                Err(_) => {
                    failures.push((worker, "no answer within the prefill deadline".to_owned()));
                    break;
                }
            };
            match answer {
                Ok(Some(params)) => {
                    let Some(body) = decode_body(&leg.body, &params) else {
                        return local(Handoff::LocalPrefillUnreadable, failures);
                    };
                    return Relayed {
                        handoff: if attempt == 0 {
                            Handoff::RemotePrefill
                        } else {
                            Handoff::RemotePrefillRetried
                        },
                        prefill: Some(worker),
                        body: Some(body),
                        failures,
                        elapsed: started.elapsed(),
                    };
                }
                Ok(None) => return local(Handoff::LocalPrefillNoParams, failures),
                Err(why) => failures.push((worker, why)),
            }
        }
        local(Handoff::LocalPrefillFailed, failures)
    }

    /// One attempt: the tagged body to `worker`; its `kv_transfer_params` (raw JSON), `None` when the
    /// engine answered without them, or why the attempt failed.
    async fn call(
        &self,
        worker: SocketAddr,
        leg: &Leg<'_>,
        body: Bytes,
    ) -> Result<Option<Box<serde_json::value::RawValue>>, String> {
        let request = leg_request(worker, leg.path, body, leg.request_id, leg.authorization)?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|error| format!("unreachable: {error}"))?;
        let status = response.status();
        let limit = self.config.max_prefill_response_bytes.get();
        let bytes = Limited::new(response.into_body(), limit)
            .collect()
            .await
            .map_err(|error| format!("the answer could not be read: {error}"))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!("answered {status}"));
        }
        body::params_of(&bytes)
            .map_err(|error| format!("the answer is not the engine's JSON: {error}"))
    }
}

/// A prefill leg's request to `worker`: the client's `x-request-id`, so both legs share it as vLLM's
/// proxies do, and its `authorization`, which an engine started with `--api-key` requires on both.
fn leg_request(
    worker: SocketAddr,
    path: &str,
    body: Bytes,
    request_id: Option<&str>,
    authorization: Option<&[u8]>,
) -> Result<Request<Full<Bytes>>, String> {
    let mut request = Request::post(format!("http://{worker}{path}"))
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .body(Full::new(body))
        .map_err(|error| error.to_string())?;
    let headers = request.headers_mut();
    if let Some(id) = request_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        headers.insert("x-request-id", id);
    }
    if let Some(value) = authorization.and_then(|value| HeaderValue::from_bytes(value).ok()) {
        headers.insert(AUTHORIZATION, value);
    }
    Ok(request)
}

/// The chosen prefill worker, then one replacement.
const ATTEMPTS: usize = 2;

/// A prefill worker that does not accept a connection within this is treated as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

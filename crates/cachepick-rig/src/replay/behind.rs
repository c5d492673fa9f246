//! The routers that decide in the replay's own process — the re-implemented peers ([`super::peers`])
//! and the oracle ([`super::oracle`]) — put on cachepick's path: the same generated Envoy bootstrap in
//! front of the same fleet, with an ext_proc server of their own in cachepick's place.
//!
//! Without this, those arms sent each request straight to the worker they chose, while cachepick's
//! arms paid Envoy, the ext_proc round trip and the body's parsing: a fixed 1.5–2 wall ms per request
//! that the replay's time scale multiplies into model time (BENCHMARKS.md, the burst below the knee).
//! Now every arm pays the proxy, and what remains between the rows is the deciding.
//!
//! The server answers as cachepick does in BUFFERED mode (`src/extproc/process.rs`): CONTINUE to the
//! request headers, the decision on the body's answer (the destination and selected headers, the
//! `envoy.lb` metadata, the decision and credited-prefix headers the worker echoes), CONTINUE to the
//! response headers when the bootstrap sends them, and it lets Envoy end the stream. The body is parsed
//! as JSON for its prompt, as any body-reading picker must. The bootstrap differs from cachepick's in
//! one place: the workers cluster lists the fleet statically, since no picker serves EDS
//! ([`bootstrap`]).
//!
//! A peer's decision holds load on its router replica until the request's first token and its end;
//! the driver sees both, so the server files each ticket under the request's [`REQUEST_ID_HEADER`] and
//! the driver settles it ([`Tickets`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use futures_util::Stream;
use serde_yaml::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use cachepick::protocol::{DECISION_HEADER, PREFIX_TOKENS_HEADER};

use super::dynamo::{self, DynamoRouter, Reservation};
use super::oracle::{self, Oracle};
use super::peers::{PeerRouter, Ticket};
use crate::overhead::noop::{answer, routing_answer, serve_processor};

/// The header the driver numbers each request with, so the server and the driver name the same ticket.
pub const REQUEST_ID_HEADER: &str = "x-replay-request";

/// A router that decides in process.
#[derive(Clone)]
pub enum InProcess {
    Peer(Arc<PeerRouter>),
    Oracle(Arc<Oracle>),
    /// Dynamo's own selection service, asked over HTTP ([`super::dynamo`]).
    Dynamo(Arc<DynamoRouter>),
}

/// What holds a request's load on the router that placed it until the request ends: a re-implemented
/// peer's ticket or the Dynamo service's reservation.
pub enum Held {
    Peer(Ticket),
    Dynamo(Reservation),
}

impl Held {
    /// The request's first response chunk arrived.
    pub fn first_token(&mut self) {
        match self {
            Held::Peer(ticket) => ticket.first_token(),
            Held::Dynamo(reservation) => reservation.first_token(),
        }
    }
}

/// What an in-process router decided: the worker, the headers the worker is sent with, and (a peer)
/// the ticket that holds the request's load until it ends.
pub struct Decided {
    pub worker: SocketAddr,
    pub headers: Vec<(&'static str, String)>,
    pub ticket: Option<Held>,
    /// A prefill/decode fleet's prefill leg (`worker` decodes).
    pub prefill: Option<PrefillLeg>,
}

/// Where a request's prefill leg goes, tagged for the oracle's count, and by which handshake.
#[derive(Clone, Copy, Debug)]
pub struct PrefillLeg {
    pub worker: SocketAddr,
    pub tag: u64,
    /// SGLang's bootstrap rendezvous (the legs run together); else vLLM's NIXL relay (prefill first).
    pub bootstrap: bool,
}

impl InProcess {
    /// Decides for a completion whose prompt is `prompt`, off the runtime's workers (the in-process
    /// routers hash or tokenize the prompt against every worker; the Dynamo service is asked over
    /// HTTP, its client tokenizing off them too); why not, when it cannot.
    pub async fn decide(&self, prompt: String) -> Result<Decided, String> {
        if let InProcess::Dynamo(router) = self {
            let reservation = router.choose(&prompt).await?;
            return Ok(Decided {
                worker: reservation.worker,
                headers: vec![
                    (DECISION_HEADER, dynamo::LABEL.to_owned()),
                    (PREFIX_TOKENS_HEADER, reservation.cached_tokens.to_string()),
                ],
                ticket: Some(Held::Dynamo(reservation)),
                prefill: None,
            });
        }
        let router = self.clone();
        tokio::task::spawn_blocking(move || router.decide_now(&prompt))
            .await
            .map_err(|error| format!("the decision task failed: {error}"))?
    }

    fn decide_now(&self, prompt: &str) -> Result<Decided, String> {
        match self {
            InProcess::Peer(router) => {
                let ticket = router
                    .choose(prompt)
                    .ok_or_else(|| "the peer had no worker".to_owned())?;
                Ok(Decided {
                    worker: ticket.worker,
                    headers: vec![
                        (DECISION_HEADER, router.rule().label().to_owned()),
                        (PREFIX_TOKENS_HEADER, ticket.cached_tokens.to_string()),
                    ],
                    ticket: Some(Held::Peer(ticket)),
                    prefill: None,
                })
            }
            InProcess::Oracle(oracle) if oracle.prefill_workers().is_some() => {
                let choice = oracle
                    .choose_pd(prompt)
                    .ok_or_else(|| "the oracle had no prediction".to_owned())?;
                Ok(Decided {
                    worker: choice.decode.worker,
                    headers: vec![
                        (DECISION_HEADER, oracle::LABEL.to_owned()),
                        (
                            PREFIX_TOKENS_HEADER,
                            choice.prefill.cached_tokens.to_string(),
                        ),
                        (
                            cachepick_sim::server::DISPATCH_TAG,
                            choice.decode.tag.to_string(),
                        ),
                    ],
                    ticket: None,
                    prefill: Some(PrefillLeg {
                        worker: choice.prefill.worker,
                        tag: choice.prefill.tag,
                        bootstrap: oracle.engine() == cachepick_sim::Engine::Sglang,
                    }),
                })
            }
            InProcess::Oracle(oracle) => {
                let choice = oracle
                    .choose(prompt)
                    .ok_or_else(|| "the oracle had no prediction".to_owned())?;
                Ok(Decided {
                    worker: choice.worker,
                    headers: vec![
                        (DECISION_HEADER, oracle::LABEL.to_owned()),
                        (PREFIX_TOKENS_HEADER, choice.cached_tokens.to_string()),
                        (cachepick_sim::server::DISPATCH_TAG, choice.tag.to_string()),
                    ],
                    ticket: None,
                    prefill: None,
                })
            }
            // Asked over HTTP in `decide`, never on a blocking thread.
            InProcess::Dynamo(_) => Err("the Dynamo service is asked asynchronously".to_owned()),
        }
    }
}

/// The peers' tickets of requests in flight, by [`REQUEST_ID_HEADER`].
#[derive(Default)]
pub struct Tickets(Mutex<HashMap<u64, Held>>);

impl Tickets {
    fn file(&self, id: u64, ticket: Held) {
        self.lock().insert(id, ticket);
    }

    /// Request `id`'s first token arrived: its prefill no longer counts on the peer's replica.
    pub fn first_token(&self, id: u64) {
        if let Some(ticket) = self.lock().get_mut(&id) {
            ticket.first_token();
        }
    }

    /// Request `id` ended: its load leaves the peer's replica.
    pub fn settle(&self, id: u64) {
        let ticket = self.lock().remove(&id);
        drop(ticket);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Held>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An in-process router's ext_proc server; stops when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Server {
    /// Serves `router` on a fresh loopback port, filing peers' tickets in `tickets`.
    pub async fn start(router: InProcess, tickets: Arc<Tickets>) -> std::io::Result<Server> {
        let listener = tokio::net::TcpListener::bind(crate::free_port()?).await?;
        let addr = listener.local_addr()?;
        let processor = ExternalProcessorServer::new(Processor { router, tickets });
        let (stop, task) = serve_processor(listener, processor).await;
        Ok(Server {
            addr,
            stop: Some(stop),
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

struct Processor {
    router: InProcess,
    tickets: Arc<Tickets>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (sender, receiver) = mpsc::channel(4);
        tokio::spawn(one_stream(
            self.router.clone(),
            Arc::clone(&self.tickets),
            request.into_inner(),
            sender,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// Answers one request's messages until Envoy ends the stream.
async fn one_stream(
    router: InProcess,
    tickets: Arc<Tickets>,
    mut inbound: Streaming<ProcessingRequest>,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut id = None;
    while let Ok(Some(message)) = inbound.message().await {
        let Some(request) = message.request else {
            continue;
        };
        let response = match request {
            processing_request::Request::RequestHeaders(headers) => {
                id = headers.headers.as_ref().and_then(|map| {
                    map.headers
                        .iter()
                        .find(|header| header.key.eq_ignore_ascii_case(REQUEST_ID_HEADER))
                        .and_then(|header| std::str::from_utf8(&header.raw_value).ok())
                        .and_then(|text| text.trim().parse::<u64>().ok())
                });
                answer(processing_response::Response::RequestHeaders(
                    HeadersResponse::default(),
                ))
            }
            processing_request::Request::RequestBody(body) => {
                decision(&router, &tickets, id, &body.body).await
            }
            processing_request::Request::RequestTrailers(_) => answer(
                processing_response::Response::RequestTrailers(TrailersResponse::default()),
            ),
            processing_request::Request::ResponseHeaders(_) => answer(
                processing_response::Response::ResponseHeaders(HeadersResponse::default()),
            ),
            processing_request::Request::ResponseBody(_) => answer(
                processing_response::Response::ResponseBody(BodyResponse::default()),
            ),
            processing_request::Request::ResponseTrailers(_) => answer(
                processing_response::Response::ResponseTrailers(TrailersResponse::default()),
            ),
        };
        if out.send(Ok(response)).await.is_err() {
            return;
        }
    }
}

/// The body's answer: the router's decision on the prompt, or CONTINUE without one (Envoy's fallback
/// serves it, and the worker echoes no decision, so the report counts it as undecided).
async fn decision(
    router: &InProcess,
    tickets: &Tickets,
    id: Option<u64>,
    body: &[u8],
) -> ProcessingResponse {
    let undecided = || {
        answer(processing_response::Response::RequestBody(
            BodyResponse::default(),
        ))
    };
    let Some(prompt) = prompt_of(body) else {
        return undecided();
    };
    let Ok(mut decided) = router.decide(prompt).await else {
        return undecided();
    };
    // A prefill/decode fleet, as cachepick's relay runs it: vLLM's prefill leg first, the decode
    // worker given its parameters (or the plain body to prefill itself when the leg failed); SGLang's
    // prefill leg sent beside the decode leg, both with the same room.
    let decode_body = match decided.prefill {
        Some(leg) if leg.bootstrap => rendezvous(leg, body),
        Some(leg) => prefill_leg(leg.worker, leg.tag, body).await,
        None => None,
    };
    if let Some(replaced) = &decode_body {
        decided
            .headers
            .push(("content-length", replaced.len().to_string()));
    }
    let headers: Vec<(&str, &str)> = decided
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    let response = routing_answer(decided.worker, &headers, |mut common| {
        if let Some(replaced) = decode_body {
            common.body_mutation = Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(replaced)),
            });
        }
        processing_response::Response::RequestBody(BodyResponse {
            response: Some(common),
        })
    });
    if let (Some(ticket), Some(id)) = (decided.ticket, id) {
        tickets.file(id, ticket);
    }
    response
}

/// vLLM's NIXL prefill leg to `worker` (tagged for the oracle's count): the decode leg's body with the
/// parameters it answers, or `None` when it failed or answered none.
async fn prefill_leg(worker: SocketAddr, tag: u64, body: &[u8]) -> Option<Vec<u8>> {
    use http_body_util::{BodyExt, Full};
    let path = "/v1/completions";
    let tagged = cachepick::pd::prefill_body(path, body)?;
    let client = leg_client();
    let request = http::Request::post(format!("http://{worker}{path}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(cachepick_sim::server::DISPATCH_TAG, tag.to_string())
        .body(Full::new(bytes::Bytes::from(tagged)))
        .ok()?;
    let response = client.request(request).await.ok()?;
    if response.status() != http::StatusCode::OK {
        return None;
    }
    let answer = response.into_body().collect().await.ok()?.to_bytes();
    let answer: serde_json::Value = serde_json::from_slice(&answer).ok()?;
    let params = answer
        .get("kv_transfer_params")
        .filter(|params| params.is_object())?;
    let raw = serde_json::value::to_raw_value(params).ok()?;
    cachepick::pd::decode_body(body, &raw)
}

/// SGLang's rendezvous for `leg`: a fresh room spliced into the body (the simulator's bootstrap server
/// is on the prefill worker's own port), the prefill leg sent and drained in the background, and the
/// same body returned for the decode leg; `None` when the body is not a JSON object.
fn rendezvous(leg: PrefillLeg, body: &[u8]) -> Option<Vec<u8>> {
    use http_body_util::{BodyExt, Full};
    static ROOMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let room = ROOMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let joined = cachepick::pd::rendezvous_body(body, leg.worker, leg.worker.port(), room)?;
    let request = http::Request::post(format!("http://{}/v1/completions", leg.worker))
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(cachepick_sim::server::DISPATCH_TAG, leg.tag.to_string())
        .body(Full::new(bytes::Bytes::from(joined.clone())))
        .ok()?;
    tokio::spawn(async move {
        let client = leg_client();
        if let Ok(response) = client.request(request).await {
            let _ = response.into_body().collect().await;
        }
    });
    Some(joined)
}

/// The plain HTTP client a prefill leg is sent with.
fn leg_client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// The completion's prompt: the string `prompt` of a JSON body.
fn prompt_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Completion {
        prompt: String,
    }
    serde_json::from_slice::<Completion>(body)
        .ok()
        .map(|completion| completion.prompt)
}

/// `generated` (the bootstrap `cachepick envoy-config` writes for the fleet, its ext_proc cluster at
/// the in-process router's server) with the workers cluster holding `workers` statically in place of
/// cachepick's EDS, and the EDS cluster gone. Everything else — listener, filters, timeouts, the
/// override_host steering and its fallback — is cachepick's.
pub fn bootstrap(generated: &str, workers: &[SocketAddr]) -> Result<String, String> {
    use cachepick::envoy_config::{WORKERS_CLUSTER, XDS_CLUSTER};
    let mut root: Value = serde_yaml::from_str(generated)
        .map_err(|error| format!("the bootstrap is not YAML: {error}"))?;
    let clusters = root
        .get_mut("static_resources")
        .and_then(|resources| resources.get_mut("clusters"))
        .and_then(Value::as_sequence_mut)
        .ok_or("the bootstrap has no clusters")?;
    clusters.retain(|cluster| cluster.get("name").and_then(Value::as_str) != Some(XDS_CLUSTER));
    let cluster = clusters
        .iter_mut()
        .find(|cluster| cluster.get("name").and_then(Value::as_str) == Some(WORKERS_CLUSTER))
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| format!("the bootstrap has no cluster {WORKERS_CLUSTER}"))?;
    cluster.remove("eds_cluster_config");
    cluster.insert("type".into(), "STATIC".into());
    let endpoints: Vec<String> = workers
        .iter()
        .map(|worker| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}}}",
                worker.ip(),
                worker.port()
            )
        })
        .collect();
    let assignment: Value = serde_yaml::from_str(&format!(
        "{{cluster_name: {WORKERS_CLUSTER}, endpoints: [{{lb_endpoints: [{}]}}]}}",
        endpoints.join(", ")
    ))
    .map_err(|error| error.to_string())?;
    cluster.insert("load_assignment".into(), assignment);
    serde_yaml::to_string(&root).map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_is_read_from_a_completion_and_nothing_from_anything_else() {
        assert_eq!(
            prompt_of(br#"{"model":"m","prompt":"hello","stream":true}"#).as_deref(),
            Some("hello")
        );
        assert_eq!(prompt_of(br#"{"model":"m","messages":[]}"#), None);
        assert_eq!(prompt_of(b"not json"), None);
    }

    #[test]
    fn the_workers_cluster_lists_the_fleet_where_cachepick_would_serve_eds() {
        use cachepick::envoy_config::{EnvoyOptions, WORKERS_CLUSTER, XDS_CLUSTER, render};
        let yaml = "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n      - {endpoint: \"127.0.0.1:8002\"}\n";
        let config = cachepick::config::parse(yaml, "t.yaml", &Default::default()).expect("config");
        let server: SocketAddr = "127.0.0.1:7001".parse().expect("addr");
        let generated = render(
            &config,
            &EnvoyOptions {
                pickers: vec![server.into()],
                ..EnvoyOptions::for_config(&config)
            },
        );
        assert!(
            generated.contains(XDS_CLUSTER),
            "the generated bootstrap uses EDS"
        );
        let workers: Vec<SocketAddr> = ["127.0.0.1:8001", "127.0.0.1:8002"]
            .iter()
            .map(|w| w.parse().expect("addr"))
            .collect();
        let edited: Value =
            serde_yaml::from_str(&bootstrap(&generated, &workers).expect("edited")).expect("YAML");
        let clusters = edited["static_resources"]["clusters"]
            .as_sequence()
            .expect("clusters");
        let named = |name: &str| {
            clusters
                .iter()
                .find(|cluster| cluster["name"].as_str() == Some(name))
        };
        assert!(named(XDS_CLUSTER).is_none());
        let cluster = named(WORKERS_CLUSTER).expect("workers");
        assert_eq!(cluster["type"].as_str(), Some("STATIC"));
        assert!(cluster.get("eds_cluster_config").is_none());
        let ports: Vec<u64> = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_sequence()
            .expect("endpoints")
            .iter()
            .filter_map(|e| e["endpoint"]["address"]["socket_address"]["port_value"].as_u64())
            .collect();
        assert_eq!(ports, [8001, 8002]);
        // The steering stays cachepick's.
        assert!(cluster["load_balancing_policy"].is_mapping());
        let picker = named("cachepick").expect("the ext_proc cluster");
        assert!(
            serde_yaml::to_string(picker)
                .expect("yaml")
                .contains("7001")
        );
    }
}

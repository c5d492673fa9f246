//! A running cachepick in front of a simulated fleet, for tests of the real gRPC interface: the fleet,
//! the picker started through `app::run` on free loopback ports, a raw ext_proc stream driven message by
//! message, readers of the responses, gRPC health, and plain HTTP to the workers and `metrics_listen`.
//!
//! Every await is bounded by [`DEADLINE`] so a broken picker fails the test instead of hanging it.
//!
//! It stands on `sim_client` (plain HTTP, the deadline, the simulator's model and paths) and `sim_fleet`:
//! a test that names `picker` in its `mod support { … }` names those two beside it.

#![allow(dead_code)] // not every test uses every helper

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, HttpBody, HttpHeaders, HttpTrailers, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
    body_mutation, external_processor_client::ExternalProcessorClient, processing_request,
    processing_response,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use http::{Method, StatusCode};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use cachepick::config::Overrides;
use cachepick::extproc::{
    DECISION_HEADER, DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, LIVENESS, PREFIX_TOKENS_HEADER,
    READINESS, REFUSAL_HEADER, SUBSET_KEY, SUBSET_NAMESPACE,
};
use cachepick_rig::stage::{Picker, on_free_ports};
use cachepick_sim::Engine;
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;

#[allow(unused_imports)] // not every test uses every re-export
pub use super::sim_client::{CHAT, COMPLETIONS, DEADLINE, MODEL, Reply, bounded};
use super::sim_client::{metric, read_whole};
use super::sim_fleet;

/// The request header that makes a decision fail on purpose, in a build with the hook.
pub const FAULT: &str = "x-fault-injection";

/// Fails the test, loudly, in a build without the fault-injection hook (a constant of the build).
pub fn require_fault_injection() {
    if !cachepick::extproc::FAULT_INJECTION {
        panic!(
            "this build of cachepick has no fault injection: the root package's tests enable the \
             `fault-injection` feature through the rig's dev-dependency; build them with `cargo test`"
        );
    }
}

/// A simulated vLLM fleet with the byte tokenizer, 16-token blocks and a fast clock, and a cachepick
/// serving it through `app::run`.
pub struct Harness {
    pub fleet: Fleet,
    /// The ext_proc and health listener.
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub max_body_bytes: usize,
    channel: Channel,
    picker: Option<Picker>,
    /// How long `start` took until readiness.
    pub ready_after: Duration,
}

impl Harness {
    /// Starts `workers` simulated workers and cachepick with the fleet's generated configuration plus
    /// `head` (top-level YAML keys, e.g. `max_body_bytes: 64KiB`), then waits for readiness.
    pub async fn start(workers: u32, head: &str) -> Harness {
        Harness::start_with_tokenizer(workers, head, TokenizerConfig::Bytes).await
    }

    /// [`start`](Self::start) with another tokenizer for the fleet and the picker.
    pub async fn start_with_tokenizer(
        workers: u32,
        head: &str,
        tokenizer: TokenizerConfig,
    ) -> Harness {
        Harness::start_edited(workers, head, tokenizer, |generated| generated).await
    }

    /// [`start`](Self::start) under the product's default policy (the prefill-time unit), not the
    /// request-unit limits the simulator's generated configuration sets.
    pub async fn start_default_policy(workers: u32, head: &str) -> Harness {
        let without_policy = |generated: String| {
            let mut in_policy = false;
            let kept: Vec<&str> = generated
                .lines()
                .filter(|line| {
                    if !line.starts_with(' ') {
                        in_policy = *line == "policy:";
                    }
                    !in_policy
                })
                .collect();
            kept.join("\n")
        };
        Harness::start_edited(workers, head, TokenizerConfig::Bytes, without_policy).await
    }

    async fn start_edited(
        workers: u32,
        head: &str,
        tokenizer: TokenizerConfig,
        edit: impl FnOnce(String) -> String,
    ) -> Harness {
        let started = Instant::now();
        let mut sim = sim_fleet::config(Engine::Vllm, workers);
        sim.tokenizer = tokenizer;
        let fleet = sim_fleet::start(&sim).await;
        let generated = edit(fleet.cachepick_config());
        assert!(
            generated.contains("scrape_interval: 200ms"),
            "the generated config changed its scrape interval:\n{generated}"
        );
        let yaml = format!("{head}\n{generated}");
        let config = on_free_ports(&yaml, "extproc test", Overrides::default())
            .unwrap_or_else(|error| panic!("{error}\n{yaml}"));
        let (listen, metrics_listen) = (config.listen, config.metrics_listen);
        let max_body_bytes = config.max_body_bytes.get();
        let picker = Picker::spawn(config);
        let channel = connect(listen, &picker).await;
        let mut harness = Harness {
            fleet,
            listen,
            metrics_listen,
            max_body_bytes,
            channel,
            picker: Some(picker),
            ready_after: Duration::ZERO,
        };
        // Liveness holds as soon as the server answers; readiness follows the first scrape round, and
        // the ext_proc service's status with it.
        assert_eq!(harness.health(LIVENESS).await, ServingStatus::Serving);
        let deadline = Instant::now() + DEADLINE;
        loop {
            let status = harness.health(READINESS).await;
            match status {
                ServingStatus::Serving => break,
                ServingStatus::NotServing => {}
                other => panic!("readiness is {other:?}, expected NOT_SERVING or SERVING"),
            }
            assert!(
                Instant::now() < deadline,
                "readiness not SERVING within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            harness.health(EXT_PROC_SERVICE).await,
            ServingStatus::Serving
        );
        harness.ready_after = started.elapsed();
        harness
    }

    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.fleet.endpoints()
    }

    /// gRPC health of `service`.
    pub async fn health(&self, service: &str) -> ServingStatus {
        let mut client = HealthClient::new(self.channel.clone());
        let request = HealthCheckRequest {
            service: service.to_owned(),
        };
        let reply = bounded("a health check", DEADLINE, client.check(request))
            .await
            .unwrap_or_else(|status| panic!("health check of {service:?}: {status}"))
            .into_inner();
        ServingStatus::try_from(reply.status).expect("a known serving status")
    }

    /// cachepick's own client, connected to this picker.
    pub async fn client(&self) -> cachepick_rig::client::Client {
        bounded(
            "the ext_proc client connects",
            DEADLINE,
            cachepick_rig::client::Client::connect(self.listen),
        )
        .await
        .expect("the ext_proc client connects")
    }

    /// A raw ext_proc client on the shared connection, without a decode limit.
    pub fn raw(&self) -> ExternalProcessorClient<Channel> {
        ExternalProcessorClient::new(self.channel.clone()).max_decoding_message_size(usize::MAX)
    }

    /// Opens one `Process` stream.
    pub async fn open(&self) -> ExtProcStream {
        let (sender, receiver) = mpsc::channel(16);
        let mut client = self.raw();
        let responses = bounded(
            "the Process stream opens",
            DEADLINE,
            client.process(ReceiverStream::new(receiver)),
        )
        .await
        .unwrap_or_else(|status| panic!("Process: {status}"))
        .into_inner();
        ExtProcStream {
            sender: Some(sender),
            responses,
        }
    }

    /// Sends `requests` on a fresh stream and reads every response until the server ends it.
    pub async fn exchange(&self, requests: Vec<ProcessingRequest>) -> Exchanged {
        let mut stream = self.open().await;
        for request in requests {
            stream.send(request).await;
        }
        stream.read_to_end().await
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> String {
        let reply = http(
            Method::GET,
            self.metrics_listen,
            "/metrics",
            &[],
            Vec::new(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.text()
    }

    /// Polls `/metrics` until `done` holds on the text; panics after `DEADLINE`.
    pub async fn wait_metrics(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let text = self.metrics().await;
            if done(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "waited {DEADLINE:?} for {what}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Polls `/metrics` until no ext_proc stream is active; panics after `DEADLINE`.
    pub async fn wait_streams_closed(&self, what: &str) -> String {
        self.wait_metrics(what, |text| {
            metric(text, "cachepick_extproc_streams_active", &[]) == 0.0
        })
        .await
    }

    /// `GET path` on `metrics_listen` (`/debug/...`), whatever its status.
    pub async fn get_debug(&self, path: &str) -> Reply {
        http(Method::GET, self.metrics_listen, path, &[], Vec::new()).await
    }

    /// Asserts that `route` names one of the fleet's workers first.
    pub fn assert_routed_to_a_worker(&self, route: &Route) {
        assert!(self.endpoints().contains(&route.endpoints[0]), "{route:?}");
    }

    /// Stops cachepick through its shutdown future and checks that `app::run` returns `Ok` in time.
    pub async fn stop(mut self) {
        let picker = self.picker.take().expect("running");
        bounded("app::run returns after shutdown", DEADLINE, picker.stop())
            .await
            .expect("app::run ended cleanly");
    }
}

/// Connects to the picker as soon as it listens (it binds inside `app::run`).
async fn connect(addr: SocketAddr, picker: &Picker) -> Channel {
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(
            !picker.has_ended(),
            "app::run ended before it served (see the test output)"
        );
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .expect("a valid URI")
            .connect_timeout(Duration::from_secs(1));
        match endpoint.connect().await {
            Ok(channel) => return channel,
            Err(error) => assert!(
                Instant::now() < deadline,
                "cannot connect to {addr} within {DEADLINE:?}: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One `Process` stream driven by hand.
pub struct ExtProcStream {
    sender: Option<mpsc::Sender<ProcessingRequest>>,
    pub responses: Streaming<ProcessingResponse>,
}

impl ExtProcStream {
    /// Sends one message. A server that already ended the stream may not take it: that is not an error.
    pub async fn send(&mut self, request: ProcessingRequest) {
        if let Some(sender) = &self.sender {
            let _ = bounded("a message is queued", DEADLINE, sender.send(request)).await;
        }
    }

    /// The next response, which must come: no error, and not the end of the stream.
    pub async fn next_response(&mut self, what: &str) -> ProcessingResponse {
        self.next().await.expect("no error").expect(what)
    }

    /// The next response, which must be the headers response.
    pub async fn next_headers_response(&mut self) -> ProcessingResponse {
        let response = self.next_response("a headers response").await;
        assert!(is_headers_response(&response), "{response:?}");
        response
    }

    /// Asserts that the server ends the stream cleanly now.
    pub async fn expect_clean_end(&mut self) {
        let end = self.next().await;
        assert!(matches!(end, Ok(None)), "expected a clean end, got {end:?}");
    }

    /// Half-closes the client side (no more messages), as a proxy whose request ended would.
    pub fn close_send(&mut self) {
        self.sender = None;
    }

    /// The next response; `Ok(None)` when the server ended the stream cleanly.
    pub async fn next(&mut self) -> Result<Option<ProcessingResponse>, Status> {
        bounded("a response", DEADLINE, self.responses.message()).await
    }

    /// Reads until the server ends the stream or sends nothing for `quiet`: the responses, and the end
    /// if there was one (`None` when the server went quiet with the stream still open).
    pub async fn read_until_quiet(
        &mut self,
        quiet: Duration,
    ) -> (Vec<ProcessingResponse>, Option<Result<(), Status>>) {
        let mut responses = Vec::new();
        loop {
            match tokio::time::timeout(quiet, self.responses.message()).await {
                Err(_) => return (responses, None),
                Ok(Ok(Some(response))) => responses.push(response),
                Ok(Ok(None)) => return (responses, Some(Ok(()))),
                Ok(Err(status)) => return (responses, Some(Err(status))),
            }
        }
    }

    /// Reads until the server ends the stream (cleanly or not).
    pub async fn read_to_end(mut self) -> Exchanged {
        let mut responses = Vec::new();
        loop {
            match self.next().await {
                Ok(Some(response)) => responses.push(response),
                Ok(None) => {
                    return Exchanged {
                        responses,
                        end: Ok(()),
                    };
                }
                Err(status) => {
                    return Exchanged {
                        responses,
                        end: Err(status),
                    };
                }
            }
        }
    }
}

/// Everything a stream answered, and how it ended.
#[derive(Debug)]
pub struct Exchanged {
    pub responses: Vec<ProcessingResponse>,
    /// `Ok` when the server ended the stream with an OK status.
    pub end: Result<(), Status>,
}

impl Exchanged {
    /// Asserts a clean end and returns the responses.
    pub fn clean(self) -> Vec<ProcessingResponse> {
        if let Err(status) = &self.end {
            panic!(
                "the stream ended with {status:?} after {:?}",
                self.responses
            );
        }
        self.responses
    }
}

// Building requests the way Envoy 1.40 sends them: lower-case keys, values in `raw_value` only.

pub fn raw_header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

/// A request-headers message: the pseudo-headers for `method path`, `extra` headers, the body mode in
/// `protocol_config` (Envoy sends it on the first message), and `metadata` as `metadata_context`.
pub fn headers(
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    end_of_stream: bool,
    mode: BodySendMode,
    metadata: Option<Metadata>,
) -> ProcessingRequest {
    let mut list = vec![
        raw_header(":authority", "gateway.local"),
        raw_header(":path", path),
        raw_header(":method", method),
        raw_header(":scheme", "http"),
        raw_header("x-request-id", "test"),
    ];
    if method == "POST" {
        list.push(raw_header("content-type", "application/json"));
    }
    list.extend(extra.iter().map(|(key, value)| raw_header(key, value)));
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            ..ProtocolConfiguration::default()
        }),
        metadata_context: metadata,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers: list }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// A POST's request-headers message in BUFFERED mode.
pub fn post_headers(path: &str) -> ProcessingRequest {
    headers("POST", path, &[], false, BodySendMode::Buffered, None)
}

/// A POST's request-headers message in FULL_DUPLEX_STREAMED mode, with `extra` headers.
pub fn duplex_headers(path: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    headers(
        "POST",
        path,
        extra,
        false,
        BodySendMode::FullDuplexStreamed,
        None,
    )
}

/// A POST's request-headers message in STREAMED mode with `send_body_without_waiting_for_header_response`
/// (`cachepick envoy-config --mode streamed`): the body's chunks follow without waiting for the answer.
pub fn streamed_headers(path: &str) -> ProcessingRequest {
    let mut message = headers("POST", path, &[], false, BodySendMode::Streamed, None);
    if let Some(config) = message.protocol_config.as_mut() {
        config.send_body_without_waiting_for_header_response = true;
    }
    message
}

/// A request-body message.
pub fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// A request-trailers message: the end of a body that has trailers.
pub fn trailers(list: &[(&str, &str)]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(HttpTrailers {
            trailers: Some(HeaderMap {
                headers: list
                    .iter()
                    .map(|(key, value)| raw_header(key, value))
                    .collect(),
            }),
        })),
        ..ProcessingRequest::default()
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(text.to_owned())),
    }
}

/// The proxy's subset hint as `metadata_context`, with `hint` as the key's value.
pub fn subset_metadata(hint: Value) -> Metadata {
    Metadata {
        filter_metadata: HashMap::from([(
            SUBSET_NAMESPACE.to_owned(),
            Struct {
                fields: HashMap::from([(SUBSET_KEY.to_owned(), hint)]),
            },
        )]),
        ..Metadata::default()
    }
}

/// A subset hint given as one string (`ip:port[,ip:port...]`).
pub fn subset_string(text: &str) -> Metadata {
    subset_metadata(string_value(text))
}

/// A subset hint given as a list of strings.
pub fn subset_list(items: &[String]) -> Metadata {
    let list = envoy_types::pb::google::protobuf::ListValue {
        values: items.iter().map(|item| string_value(item)).collect(),
    };
    subset_metadata(Value {
        kind: Some(value::Kind::ListValue(list)),
    })
}

// Reading responses.

/// One `set_headers` entry, with both value fields so a test can tell them apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetHeader {
    pub key: String,
    pub value: String,
    pub raw_value: Vec<u8>,
    pub append_action: i32,
}

impl SetHeader {
    pub fn raw(&self) -> String {
        String::from_utf8_lossy(&self.raw_value).into_owned()
    }
}

pub fn set_headers(mutation: &HeaderMutation) -> Vec<SetHeader> {
    mutation
        .set_headers
        .iter()
        .map(|option| {
            let header = option.header.clone().unwrap_or_default();
            SetHeader {
                key: header.key,
                value: header.value,
                raw_value: header.raw_value,
                append_action: option.append_action,
            }
        })
        .collect()
}

/// The one set header named `key`; panics if absent or repeated.
pub fn find_header(mutation: &HeaderMutation, key: &str) -> SetHeader {
    let found: Vec<SetHeader> = set_headers(mutation)
        .into_iter()
        .filter(|header| header.key == key)
        .collect();
    match found.as_slice() {
        [one] => one.clone(),
        other => panic!("expected one {key} in the mutation, found {other:?}: {mutation:?}"),
    }
}

/// The common response of a headers or body response.
pub fn common(response: &ProcessingResponse) -> Option<&CommonResponse> {
    match response.response.as_ref()? {
        processing_response::Response::RequestHeaders(headers) => headers.response.as_ref(),
        processing_response::Response::RequestBody(body) => body.response.as_ref(),
        _ => None,
    }
}

pub fn is_headers_response(response: &ProcessingResponse) -> bool {
    matches!(
        response.response,
        Some(processing_response::Response::RequestHeaders(_))
    )
}

pub fn is_body_response(response: &ProcessingResponse) -> bool {
    matches!(
        response.response,
        Some(processing_response::Response::RequestBody(_))
    )
}

pub fn is_trailers_response(response: &ProcessingResponse) -> bool {
    matches!(
        response.response,
        Some(processing_response::Response::RequestTrailers(_))
    )
}

pub fn immediate(response: &ProcessingResponse) -> Option<&ImmediateResponse> {
    match response.response.as_ref()? {
        processing_response::Response::ImmediateResponse(immediate) => Some(immediate),
        _ => None,
    }
}

/// `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]`, if present as a string.
pub fn metadata_destination(response: &ProcessingResponse) -> Option<String> {
    let namespace = response
        .dynamic_metadata
        .as_ref()?
        .fields
        .get(LB_NAMESPACE)?;
    let Some(value::Kind::StructValue(fields)) = &namespace.kind else {
        return None;
    };
    match &fields.fields.get(DESTINATION)?.kind {
        Some(value::Kind::StringValue(text)) => Some(text.clone()),
        _ => None,
    }
}

/// A routing answer read off a response's header mutation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub endpoints: Vec<SocketAddr>,
    pub reason: String,
    pub prefix_tokens: u64,
}

impl Route {
    /// The endpoints as Envoy reads them from the destination header: `ip:port` joined by commas.
    pub fn destination(&self) -> String {
        self.endpoints
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The routing answer a response carries; panics on anything else.
pub fn route_of(response: &ProcessingResponse) -> Route {
    let mutation = common(response)
        .and_then(|common| common.header_mutation.as_ref())
        .unwrap_or_else(|| panic!("no header mutation in {response:?}"));
    let destination = find_header(mutation, DESTINATION).raw();
    Route {
        endpoints: destination
            .split(',')
            .map(|entry| {
                entry
                    .trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("not ip:port: {destination:?}"))
            })
            .collect(),
        reason: find_header(mutation, DECISION_HEADER).raw(),
        prefix_tokens: find_header(mutation, PREFIX_TOKENS_HEADER)
            .raw()
            .parse()
            .expect("a token count"),
    }
}

/// The body chunk a FULL_DUPLEX_STREAMED body response echoes; panics on anything else.
pub fn streamed_chunk(response: &ProcessingResponse) -> &StreamedBodyResponse {
    match common(response)
        .and_then(|common| common.body_mutation.as_ref())
        .and_then(|mutation| mutation.mutation.as_ref())
    {
        Some(body_mutation::Mutation::StreamedResponse(streamed)) => streamed,
        _ => panic!("not a streamed_response: {response:?}"),
    }
}

/// A refusal read off an immediate response, with its JSON body checked for the error shape.
#[derive(Clone, Debug)]
pub struct Refused {
    pub status: i32,
    pub reason: String,
    pub content_type: String,
    pub body: serde_json::Value,
}

pub fn refusal_of(response: &ProcessingResponse) -> Refused {
    let immediate = immediate(response)
        .unwrap_or_else(|| panic!("expected an immediate response, got {response:?}"));
    let mutation = immediate
        .headers
        .as_ref()
        .unwrap_or_else(|| panic!("no headers on {immediate:?}"));
    let body: serde_json::Value = serde_json::from_slice(&immediate.body).unwrap_or_else(|error| {
        panic!(
            "the immediate body is not JSON ({error}): {}",
            String::from_utf8_lossy(&immediate.body)
        )
    });
    Refused {
        status: immediate.status.map_or(0, |status| status.code),
        reason: find_header(mutation, REFUSAL_HEADER).raw(),
        content_type: find_header(mutation, "content-type").raw(),
        body,
    }
}

// Plain HTTP/1.1 to the workers and `metrics_listen`.

/// One HTTP/1.1 exchange on a fresh connection, bounded by `DEADLINE`.
pub async fn http(
    method: Method,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Reply {
    let what = format!("{method} http://{addr}{path}");
    let client = super::sim_client::Client::new();
    let exchange =
        async { read_whole(client.send_raw(method, addr, path, headers, body).await).await };
    bounded(&what, DEADLINE, exchange)
        .await
        .unwrap_or_else(|error| panic!("{what}: {error}"))
}

// Request bodies.

/// Text of `len` bytes that shares no block with another seed's text (the seed leads every line).
///
/// The byte tokenizer packs 4 bytes into a token, so a 16-token block is 64 bytes; a prefix counts as
/// an owner's only from `min_match_tokens` (1024 by default, 4 KiB of text), so prompts meant to hit
/// are made of 8 KB.
pub fn text(seed: u64, len: usize) -> String {
    let mut out = String::with_capacity(len + 64);
    let mut line = 0u64;
    while out.len() < len {
        let _ = write!(
            out,
            "seed {seed:08} line {line:06} lorem ipsum dolor sit amet. "
        );
        line += 1;
    }
    out.truncate(len);
    out
}

/// A chat completion body with one user message of `len` bytes.
pub fn chat(seed: u64, len: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text(seed, len)}],
        "max_tokens": 2,
    }))
    .expect("JSON")
}

//! The overhead bench's no-op ext_proc servers: the ext_proc protocol with nothing decided, so that arm
//! (c) costs what the protocol costs and arm (d) minus arm (c) is cachepick's own work; and arm (c′),
//! the same server answering as cachepick answers with a decision made in advance, so that (d) minus
//! (c′) is cachepick's computing alone and (c′) minus (c) what Envoy does with a routing answer.
//!
//! It is built as cachepick's server is (`src/extproc/mod.rs`): tonic on the same tokio runtime, gRPC
//! health (`envoy.service.ext_proc.v3.ExternalProcessor` SERVING, which the generated Envoy cluster
//! health-checks), TCP_NODELAY, the same HTTP/2 keepalive, a decode limit that takes a whole buffered
//! body, one task per stream answering through a channel, and the stream ended cleanly after its last
//! answer. Every message is answered as soon as it arrives, with CONTINUE and no mutation: the headers,
//! a buffered body, trailers; a FULL_DUPLEX_STREAMED chunk is sent straight back (`streamed_response`),
//! the least that mode allows, since Envoy forwards only the body the processor returns.
//!
//! With [`Reply::Probe`] (the round-trip experiments' variants, `Variant`), it answers as a processor
//! that decides on the body has to, and sets [`PROBE_HEADER`] (cachepick's decision header) to `probe`
//! where cachepick would set its decision, so the run shows whether that header still reaches the
//! worker: when Envoy skips the request headers, the buffered body's answer carries it; in STREAMED
//! mode with `send_body_without_waiting_for_header_response`, the headers answer is held until the last
//! chunk has arrived and carries it, followed by one CONTINUE per chunk.
//!
//! With [`Reply::Route`] (arm (c′)) it answers in cachepick's shape (`src/extproc/process.rs`): in
//! BUFFERED mode CONTINUE to the headers and the decision on the body's answer; in FULL_DUPLEX_STREAMED
//! and STREAMED mode the headers answer held until the body is whole, then the decision on it, then the
//! body echoed in cachepick's chunks (duplex) or one CONTINUE per chunk (streamed). The decision is
//! cachepick's four headers and its `envoy.lb` metadata naming the one worker, with
//! [`ROUTE_LABEL`] as the decision: what Envoy must apply is the same, only nothing was computed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation, processing_request,
    processing_response,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use futures_util::Stream;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use cachepick::extproc::{
    DECISION_HEADER, DESTINATION, LB_NAMESPACE, PREFIX_TOKENS_HEADER, SELECTED_HEADER,
};

/// The header the probe sets: the one cachepick's decision travels in, which the worker echoes.
pub const PROBE_HEADER: &str = cachepick::extproc::DECISION_HEADER;
/// The decision [`Reply::Route`] sends, where cachepick sends a reason such as `cache_miss`.
pub const ROUTE_LABEL: &str = "noop_route";

/// What a server answers where a processor that decides on the body puts its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Nothing: CONTINUE to every message as it arrives (arm (c)).
    Continue,
    /// [`PROBE_HEADER`] set to `probe` (the round-trip experiments).
    Probe,
    /// cachepick's answer, decided in advance, routing to this worker (arm (c′)).
    Route(SocketAddr),
}

/// gRPC health service name Envoy's ext_proc cluster checks.
const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// cachepick's (`src/extproc/mod.rs`).
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// A buffered body arrives in one message: room for the largest body the bench sends, and more.
const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// Messages the server received, per body mode (from each stream's `protocol_config`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Received {
    pub streams: u64,
    pub headers: u64,
    pub bodies: u64,
    pub trailers: u64,
    /// Messages that carried `attributes` (the filter's `request_attributes`, such as `request.path`).
    pub with_attributes: u64,
}

#[derive(Debug, Default)]
struct Counts {
    streams: AtomicU64,
    headers: AtomicU64,
    bodies: AtomicU64,
    trailers: AtomicU64,
    with_attributes: AtomicU64,
}

impl Counts {
    fn snapshot(&self) -> Received {
        Received {
            streams: self.streams.load(Ordering::Relaxed),
            headers: self.headers.load(Ordering::Relaxed),
            bodies: self.bodies.load(Ordering::Relaxed),
            trailers: self.trailers.load(Ordering::Relaxed),
            with_attributes: self.with_attributes.load(Ordering::Relaxed),
        }
    }
}

/// What each body mode's streams sent.
#[derive(Debug, Default)]
struct Tally {
    buffered: Counts,
    duplex: Counts,
    streamed: Counts,
    other: Counts,
}

impl Tally {
    fn of(&self, mode: Option<BodySendMode>) -> &Counts {
        match mode {
            Some(BodySendMode::Buffered) => &self.buffered,
            Some(BodySendMode::FullDuplexStreamed) => &self.duplex,
            Some(BodySendMode::Streamed) => &self.streamed,
            _ => &self.other,
        }
    }
}

/// A running no-op server; stops when dropped.
pub struct NoopServer {
    addr: SocketAddr,
    tally: Arc<Tally>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl NoopServer {
    /// Serves on `addr` (loopback, a concrete port) on the current runtime, answering as `reply` says.
    pub async fn start(addr: SocketAddr, reply: Reply) -> std::io::Result<NoopServer> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let tally = Arc::new(Tally::default());
        let processor = ExternalProcessorServer::new(Noop {
            tally: Arc::clone(&tally),
            reply,
        });
        let (stop, task) = serve_processor(listener, processor).await;
        Ok(NoopServer {
            addr,
            tally,
            stop: Some(stop),
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Request headers and body messages received in every mode.
    pub fn total_messages(&self) -> u64 {
        [
            &self.tally.buffered,
            &self.tally.duplex,
            &self.tally.streamed,
            &self.tally.other,
        ]
        .iter()
        .map(|counts| {
            counts.headers.load(Ordering::Relaxed) + counts.bodies.load(Ordering::Relaxed)
        })
        .sum()
    }

    /// What the streams in `mode` sent so far (`None`: streams that named no buffered or duplex mode).
    pub fn received(&self, mode: Option<BodySendMode>) -> Received {
        self.tally.of(mode).snapshot()
    }
}

impl Drop for NoopServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// Serves `processor` on `listener` as cachepick serves its own (gRPC health SERVING for the ext_proc
/// service, TCP_NODELAY, the same HTTP/2 keepalive, a decode limit that takes a whole buffered body)
/// until the returned sender fires or is dropped.
pub(crate) async fn serve_processor<P: ExternalProcessor>(
    listener: tokio::net::TcpListener,
    processor: ExternalProcessorServer<P>,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(EXT_PROC_SERVICE, tonic_health::ServingStatus::Serving)
        .await;
    let processor = processor.max_decoding_message_size(MAX_MESSAGE);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        // The reporter must live as long as the server, or health answers go stale.
        let _reporter = reporter;
        let _ = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(HTTP2_KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE_TIMEOUT))
            .add_service(health)
            .add_service(processor)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await;
    });
    (stop, task)
}

struct Noop {
    tally: Arc<Tally>,
    reply: Reply,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;
type Sender = mpsc::Sender<Result<ProcessingResponse, Status>>;

#[tonic::async_trait]
impl ExternalProcessor for Noop {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (sender, receiver) = mpsc::channel(8);
        tokio::spawn(drive(Arc::clone(&self.tally), self.reply, inbound, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// Answers each message of one stream as it comes (or, deciding, holds the headers answer as the
/// module says); ends the stream (cleanly, as cachepick does) once the request is complete.
///
/// Over 100 lines: one loop over a stream's messages whose state (mode, the held answer) lives
/// across them.
async fn drive(
    tally: Arc<Tally>,
    reply: Reply,
    mut inbound: Streaming<ProcessingRequest>,
    out: Sender,
) {
    let mut mode = None;
    let mut no_wait = false;
    let mut counted = false;
    let mut saw_headers = false;
    // The headers answer held back: the chunks it waits for, and (duplex) their bytes to echo.
    let mut held: Option<(usize, Vec<u8>)> = None;
    while let Ok(Some(message)) = inbound.message().await {
        if let Some(config) = &message.protocol_config {
            mode = BodySendMode::try_from(config.request_body_mode).ok();
            no_wait = config.send_body_without_waiting_for_header_response;
        }
        let counts = tally.of(mode);
        if !counted {
            counted = true;
            counts.streams.fetch_add(1, Ordering::Relaxed);
        }
        if !message.attributes.is_empty() {
            counts.with_attributes.fetch_add(1, Ordering::Relaxed);
        }
        let Some(request) = message.request else {
            continue;
        };
        let (responses, done) = match request {
            processing_request::Request::RequestHeaders(headers) => {
                saw_headers = true;
                counts.headers.fetch_add(1, Ordering::Relaxed);
                let streamed_no_wait = mode == Some(BodySendMode::Streamed) && no_wait;
                let duplex = mode == Some(BodySendMode::FullDuplexStreamed);
                let hold = match reply {
                    Reply::Continue => false,
                    Reply::Probe => streamed_no_wait,
                    Reply::Route(_) => streamed_no_wait || duplex,
                };
                if hold && !headers.end_of_stream {
                    held = Some((0, Vec::new()));
                    continue;
                }
                (
                    vec![answer(processing_response::Response::RequestHeaders(
                        HeadersResponse::default(),
                    ))],
                    headers.end_of_stream,
                )
            }
            processing_request::Request::RequestBody(body) => {
                counts.bodies.fetch_add(1, Ordering::Relaxed);
                let ends = body.end_of_stream || body.end_of_stream_without_message;
                let duplex = mode == Some(BodySendMode::FullDuplexStreamed);
                match held.as_mut() {
                    Some((chunks, bytes)) => {
                        *chunks += 1;
                        if duplex {
                            bytes.extend_from_slice(&body.body);
                        }
                        if !ends {
                            continue;
                        }
                        // The body is whole: the held headers answer with the decision, then the
                        // body echoed (duplex) or one CONTINUE per chunk, in order.
                        let mut responses = vec![decision(reply, |common| {
                            processing_response::Response::RequestHeaders(HeadersResponse {
                                response: Some(common),
                            })
                        })];
                        if duplex {
                            responses.extend(echo(bytes));
                        } else {
                            responses.extend((0..*chunks).map(|_| {
                                answer(processing_response::Response::RequestBody(
                                    BodyResponse::default(),
                                ))
                            }));
                        }
                        (responses, true)
                    }
                    None if duplex => (echo(&body.body), ends),
                    None => {
                        // BUFFERED: the whole body in this one message, whatever end_of_stream says
                        // (false when trailers follow). The probe decides here only when the headers
                        // were skipped; cachepick (and so the routing reply) always does.
                        let body_decides = match reply {
                            Reply::Continue => false,
                            Reply::Probe => !saw_headers,
                            Reply::Route(_) => true,
                        };
                        let response = if body_decides {
                            decision(reply, |common| {
                                processing_response::Response::RequestBody(BodyResponse {
                                    response: Some(common),
                                })
                            })
                        } else {
                            answer(processing_response::Response::RequestBody(
                                BodyResponse::default(),
                            ))
                        };
                        (vec![response], mode == Some(BodySendMode::Buffered) || ends)
                    }
                }
            }
            processing_request::Request::RequestTrailers(_) => {
                counts.trailers.fetch_add(1, Ordering::Relaxed);
                (
                    vec![answer(processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    ))],
                    true,
                )
            }
            processing_request::Request::ResponseHeaders(_) => (
                vec![answer(processing_response::Response::ResponseHeaders(
                    HeadersResponse::default(),
                ))],
                false,
            ),
            processing_request::Request::ResponseBody(_) => (
                vec![answer(processing_response::Response::ResponseBody(
                    BodyResponse::default(),
                ))],
                false,
            ),
            processing_request::Request::ResponseTrailers(_) => (
                vec![answer(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))],
                false,
            ),
        };
        for response in responses {
            if out.send(Ok(response)).await.is_err() {
                return;
            }
        }
        if done {
            return;
        }
    }
}

pub(crate) fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// The duplex body sent back: in cachepick's chunks, the last ending the stream (an empty body is one
/// empty chunk).
fn echo(body: &[u8]) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[]]
    } else {
        body.chunks(cachepick::extproc::MAX_STREAMED_CHUNK)
            .collect()
    };
    let last = chunks.len().saturating_sub(1);
    chunks
        .into_iter()
        .enumerate()
        .map(|(index, chunk)| {
            let echoed = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: chunk.to_vec(),
                        end_of_stream: index == last,
                        ..StreamedBodyResponse::default()
                    },
                )),
            };
            answer(processing_response::Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(echoed),
                    ..CommonResponse::default()
                }),
            }))
        })
        .collect()
}

/// The answer that carries `reply`'s decision, built by `wrap` from its common response.
fn decision(
    reply: Reply,
    wrap: impl FnOnce(CommonResponse) -> processing_response::Response,
) -> ProcessingResponse {
    match reply {
        Reply::Continue => answer(wrap(CommonResponse::default())),
        Reply::Probe => answer(wrap(probe())),
        Reply::Route(worker) => route(worker, wrap),
    }
}

/// cachepick's routing answer, decided in advance: its four headers and the `envoy.lb` metadata.
fn route(
    worker: SocketAddr,
    wrap: impl FnOnce(CommonResponse) -> processing_response::Response,
) -> ProcessingResponse {
    routing_answer(
        worker,
        &[(DECISION_HEADER, ROUTE_LABEL), (PREFIX_TOKENS_HEADER, "0")],
        wrap,
    )
}

/// A routing answer in cachepick's shape: `worker` in its destination and selected headers and in the
/// `envoy.lb` metadata, and `headers` set beside them (the decision, the credited prefix, …).
pub(crate) fn routing_answer(
    worker: SocketAddr,
    headers: &[(&str, &str)],
    wrap: impl FnOnce(CommonResponse) -> processing_response::Response,
) -> ProcessingResponse {
    let worker = worker.to_string();
    let set_headers = [
        (DESTINATION, worker.as_str()),
        (SELECTED_HEADER, worker.as_str()),
    ]
    .into_iter()
    .chain(headers.iter().copied())
    .map(|(key, value)| header(key, value))
    .collect();
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        }),
        ..CommonResponse::default()
    };
    let string = |text: String| Value {
        kind: Some(value::Kind::StringValue(text)),
    };
    let namespace = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), string(worker))]),
    };
    ProcessingResponse {
        response: Some(wrap(common)),
        dynamic_metadata: Some(Struct {
            fields: HashMap::from([(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(value::Kind::StructValue(namespace)),
                },
            )]),
        }),
        ..ProcessingResponse::default()
    }
}

/// A header set as cachepick sets its headers (`raw_value`, overwrite).
fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd.into(),
        ..HeaderValueOption::default()
    }
}

/// A common answer that sets [`PROBE_HEADER`] to `probe`.
fn probe() -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![header(PROBE_HEADER, "probe")],
            remove_headers: Vec::new(),
        }),
        ..CommonResponse::default()
    }
}

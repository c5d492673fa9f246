//! The overhead bench's no-op ext_proc server: the ext_proc protocol with nothing decided, so that arm
//! (c) costs what the protocol costs and arm (d) minus arm (c) is cachepick's own work.
//!
//! It is built as cachepick's server is (`src/extproc/mod.rs`): tonic on the same tokio runtime, gRPC
//! health (`envoy.service.ext_proc.v3.ExternalProcessor` SERVING, which the generated Envoy cluster
//! health-checks), TCP_NODELAY, the same HTTP/2 keepalive, a decode limit that takes a whole buffered
//! body, one task per stream answering through a channel, and the stream ended cleanly after its last
//! answer. Every message is answered as soon as it arrives, with CONTINUE and no mutation: the headers,
//! a buffered body, trailers; a FULL_DUPLEX_STREAMED chunk is sent straight back (`streamed_response`),
//! the least that mode allows, since Envoy forwards only the body the processor returns.
//!
//! With `probe` (the round-trip experiments' variants, `Variant`), it answers as a processor that
//! decides on the body has to, and sets [`PROBE_HEADER`] (cachepick's decision header) to `probe` where
//! cachepick would set its decision, so the run shows whether that header still reaches the worker:
//! when Envoy skips the request headers, the buffered body's answer carries it; in STREAMED mode with
//! `send_body_without_waiting_for_header_response`, the headers answer is held until the last chunk has
//! arrived and carries it, followed by one CONTINUE per chunk.

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
use futures_util::Stream;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The header the probe sets: the one cachepick's decision travels in, which the worker echoes.
pub const PROBE_HEADER: &str = cachepick::extproc::DECISION_HEADER;

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
    /// Serves on `addr` (loopback, a concrete port) on the current runtime; `probe` as the module says.
    pub async fn start(addr: SocketAddr, probe: bool) -> std::io::Result<NoopServer> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let tally = Arc::new(Tally::default());
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(EXT_PROC_SERVICE, tonic_health::ServingStatus::Serving)
            .await;
        let processor = ExternalProcessorServer::new(Noop {
            tally: Arc::clone(&tally),
            probe,
        })
        .max_decoding_message_size(MAX_MESSAGE);
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
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

struct Noop {
    tally: Arc<Tally>,
    probe: bool,
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
        tokio::spawn(drive(Arc::clone(&self.tally), self.probe, inbound, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// Answers each message of one stream as it comes; ends the stream (cleanly, as cachepick does) once
/// the request is complete.
async fn drive(
    tally: Arc<Tally>,
    probe_on: bool,
    mut inbound: Streaming<ProcessingRequest>,
    out: Sender,
) {
    let mut mode = None;
    let mut no_wait = false;
    let mut counted = false;
    let mut saw_headers = false;
    // STREAMED without waiting: the headers answer held back, and the chunks it waits for.
    let mut held: Option<usize> = None;
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
                if probe_on
                    && mode == Some(BodySendMode::Streamed)
                    && no_wait
                    && !headers.end_of_stream
                {
                    held = Some(0);
                    continue;
                }
                (
                    vec![processing_response::Response::RequestHeaders(
                        HeadersResponse::default(),
                    )],
                    headers.end_of_stream,
                )
            }
            processing_request::Request::RequestBody(body) => {
                counts.bodies.fetch_add(1, Ordering::Relaxed);
                let ends = body.end_of_stream || body.end_of_stream_without_message;
                match (mode, held.as_mut()) {
                    (_, Some(chunks)) => {
                        *chunks += 1;
                        if !ends {
                            continue;
                        }
                        // The body is whole: the held headers answer (with the probe, as a decision
                        // would be), then one CONTINUE per chunk, in order.
                        let mut responses = vec![processing_response::Response::RequestHeaders(
                            HeadersResponse {
                                response: Some(probe()),
                            },
                        )];
                        responses.extend((0..*chunks).map(|_| {
                            processing_response::Response::RequestBody(BodyResponse::default())
                        }));
                        (responses, true)
                    }
                    (Some(BodySendMode::FullDuplexStreamed), None) => {
                        let echo = BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(
                                StreamedBodyResponse {
                                    body: body.body,
                                    end_of_stream: ends,
                                    ..StreamedBodyResponse::default()
                                },
                            )),
                        };
                        let common = CommonResponse {
                            body_mutation: Some(echo),
                            ..CommonResponse::default()
                        };
                        (
                            vec![processing_response::Response::RequestBody(BodyResponse {
                                response: Some(common),
                            })],
                            ends,
                        )
                    }
                    (_, None) => {
                        // BUFFERED: the whole body in this one message, whatever end_of_stream says
                        // (false when trailers follow).
                        let response = if saw_headers || !probe_on {
                            BodyResponse::default()
                        } else {
                            BodyResponse {
                                response: Some(probe()),
                            }
                        };
                        (
                            vec![processing_response::Response::RequestBody(response)],
                            mode == Some(BodySendMode::Buffered) || ends,
                        )
                    }
                }
            }
            processing_request::Request::RequestTrailers(_) => {
                counts.trailers.fetch_add(1, Ordering::Relaxed);
                (
                    vec![processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    )],
                    true,
                )
            }
            processing_request::Request::ResponseHeaders(_) => (
                vec![processing_response::Response::ResponseHeaders(
                    HeadersResponse::default(),
                )],
                false,
            ),
            processing_request::Request::ResponseBody(_) => (
                vec![processing_response::Response::ResponseBody(
                    BodyResponse::default(),
                )],
                false,
            ),
            processing_request::Request::ResponseTrailers(_) => (
                vec![processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                )],
                false,
            ),
        };
        for response in responses {
            let answer = ProcessingResponse {
                response: Some(response),
                ..ProcessingResponse::default()
            };
            if out.send(Ok(answer)).await.is_err() {
                return;
            }
        }
        if done {
            return;
        }
    }
}

/// A common answer that sets [`PROBE_HEADER`] as cachepick sets its headers (`raw_value`, overwrite).
fn probe() -> CommonResponse {
    let header = HeaderValueOption {
        header: Some(HeaderValue {
            key: PROBE_HEADER.to_owned(),
            raw_value: b"probe".to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd.into(),
        ..HeaderValueOption::default()
    };
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![header],
            remove_headers: Vec::new(),
        }),
        ..CommonResponse::default()
    }
}

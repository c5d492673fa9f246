//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one gRPC stream per HTTP request.
//!
//! The stream is driven as a small state machine over Envoy's messages:
//! - request headers: remember the path and the subset hint, strip client-sent `x-cachepick-*` and
//!   destination headers; a header-only request (`end_of_stream`) is decided here;
//! - BUFFERED body: the whole body arrives in one message; the answer is the body response, whose
//!   header mutation carries the destination;
//! - FULL_DUPLEX_STREAMED body: chunks are buffered to the end of the stream; the (delayed) headers
//!   response carries the destination and the body is re-emitted as `streamed_response` chunks;
//! - STREAMED body with `send_body_without_waiting_for_header_response`: chunks are buffered to the end
//!   of the stream as in duplex mode, the delayed headers response carries the destination, and each
//!   chunk is answered with CONTINUE (Envoy holds the body itself, so nothing is echoed). Envoy sends
//!   the body without waiting for the headers response, which saves BUFFERED mode's round trip.
//!
//! Once the answer is sent the server ends the stream cleanly: Envoy proceeds with what it was told and
//! later resets its side, which is normal and not counted as an error.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, external_processor_server::ExternalProcessor,
    processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use super::lb;
use super::served::{self, Follow};
use crate::metrics::StreamEnd;
use crate::protocol::{
    DECISION_HEADER, DESTINATION, OWNED_PREFIX, PREFIX_TOKENS_HEADER, REJECT_HEADER, RefusalReason,
    SELECTED_HEADER, SHED_METADATA, ShedReason, error_json,
};
use crate::route::admission::BodyShare;
use crate::route::{Answer, CommitGate, Inbound, Refusal, Routed, Service};

/// Envoy recommends at most 64 KiB per streamed chunk; this leaves room for the message's framing.
pub const MAX_STREAMED_CHUNK: usize = 62_000;

/// Longest wait for the next message of a request whose answer is still owed: a client that stops
/// sending its body mid-way must not hold a stream (and, in duplex mode, its buffered bytes) forever.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(60);

/// The most of a decision's deadline kept, after its commit, for its answer to be sent (a tenth of the
/// deadline when that is less).
const ANSWER_TIME: Duration = Duration::from_millis(50);

/// Whether this build can inject faults into decisions (the `fault-injection` cargo feature, for tests
/// only): a request with `x-fault-injection: panic` then panics inside its decision, and one with
/// `x-fault-injection: sleep=<ms>` holds its decision slot that long before deciding (a slow decision).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// The request header that injects a fault, read only by builds with the `fault-injection` feature. Not
/// an `x-cachepick-*` header: the generated Envoy configuration strips those from clients.
#[cfg(feature = "fault-injection")]
const FAULT_HEADER: &str = "x-fault-injection";

/// The ext_proc service.
pub struct Processor {
    service: Arc<Service>,
    /// The longest a stream may take from its first message to its answer.
    stream_deadline: Duration,
    /// How a routed request's stream waits for its response report (`served`).
    follow: Follow,
}

impl Processor {
    pub fn new(service: Arc<Service>, stream_deadline: Duration, follow: Follow) -> Processor {
        Processor {
            service,
            stream_deadline,
            follow,
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Only a stream whose filter says it reports the response waits for it (`served`).
        let follow = self.follow.for_stream(request.metadata());
        let inbound = request.into_inner();
        // One answer in flight at a time is all a stream ever has, plus the duplex body chunks.
        let (sender, receiver) = mpsc::channel(8);
        let service = Arc::clone(&self.service);
        let stream_end = Instant::now() + self.stream_deadline;
        service.metrics().stream_opened();
        tokio::spawn(async move {
            let end = drive(&service, inbound, &sender, stream_end, &follow).await;
            service.metrics().stream_closed(end);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// What the stream has learnt so far.
struct Exchange {
    path: String,
    /// `:method`: only a POST is learned from.
    method: String,
    subset: Option<Vec<SocketAddr>>,
    /// Client-sent headers cachepick owns, to be removed.
    spoofed: Vec<String>,
    content_encoding: Option<String>,
    /// The configured tenant header's value.
    tenant: Option<String>,
    body: Vec<u8>,
    /// The whole body once the decision is owed: shared with the decision (a cheap clone), so the answer
    /// can still re-emit it in duplex mode when the decision is given up on.
    whole: Bytes,
    /// Duplex, shed before the body ended (`body_budget`): the request continues without a destination
    /// and each further chunk is echoed as it arrives, never held.
    forwarding: bool,
    /// The body's bytes, counted against the budget of every stream together; given back when the
    /// exchange ends.
    share: BodyShare,
    /// Body messages received (a duplex request with trailers may have none).
    chunks: usize,
    body_mode: Option<BodySendMode>,
    /// Envoy sends the body without waiting for the headers response (`protocol_config`).
    no_wait: bool,
    /// The headers response is owed (duplex and streamed: it is sent with the decision).
    headers_pending: bool,
    /// The fault injected into the decision (`x-fault-injection`).
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
}

impl Exchange {
    /// Whether the body goes back to Envoy through cachepick (FULL_DUPLEX_STREAMED), rather than being
    /// held by Envoy and answered with CONTINUE (STREAMED).
    fn echoes(&self) -> bool {
        self.body_mode == Some(BodySendMode::FullDuplexStreamed)
    }

    /// The answers to the body chunks held so far, when the request continues: the body itself in
    /// duplex mode (`ends`: it ends the stream), one CONTINUE per chunk in streamed mode.
    fn release_body(&self, body: &[u8], chunks: usize, ends: bool) -> Vec<ProcessingResponse> {
        if self.echoes() {
            streamed_body(body, ends)
        } else {
            (0..chunks)
                .map(|_| {
                    response(processing_response::Response::RequestBody(
                        BodyResponse::default(),
                    ))
                })
                .collect()
        }
    }

    fn new(share: BodyShare) -> Exchange {
        Exchange {
            path: String::new(),
            method: String::new(),
            subset: None,
            spoofed: Vec::new(),
            content_encoding: None,
            tenant: None,
            body: Vec::new(),
            whole: Bytes::new(),
            forwarding: false,
            share,
            chunks: 0,
            body_mode: None,
            no_wait: false,
            headers_pending: false,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }
}

type Sender = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Runs one stream to its end and says how it ended.
async fn drive(
    service: &Arc<Service>,
    mut inbound: Streaming<ProcessingRequest>,
    out: &Sender,
    stream_end: Instant,
    follow: &Follow,
) -> StreamEnd {
    let mut exchange = Exchange::new(service.admission().budget().share());
    loop {
        let left = stream_end.saturating_duration_since(Instant::now());
        let wait = MESSAGE_DEADLINE.min(left);
        let message = match tokio::time::timeout(wait, inbound.message()).await {
            Ok(Ok(Some(message))) => message,
            // Envoy closed its side before we answered: the client went away.
            Ok(Ok(None)) => return StreamEnd::Reset,
            Ok(Err(status)) if is_reset(&status) => return StreamEnd::Reset,
            Ok(Err(status)) => {
                tracing::debug!(%status, "ext_proc stream failed");
                // Say so, rather than end cleanly: a clean close would let Envoy carry on unrouted and
                // count nothing as failed.
                let _ = out.send(Err(status)).await;
                return StreamEnd::Error;
            }
            Err(_) => {
                // The client stopped sending its request: its own fault, answered as such.
                let within = if wait < MESSAGE_DEADLINE {
                    "the stream deadline (overload.stream_deadline)".to_owned()
                } else {
                    format!("{} s", MESSAGE_DEADLINE.as_secs())
                };
                let refusal = service.refuse(
                    RefusalReason::BodyTimeout,
                    format!("the request was not received within {within}"),
                );
                let sent = send_all(out, vec![immediate(&refusal)]).await;
                return if sent {
                    StreamEnd::Answered
                } else {
                    StreamEnd::Reset
                };
            }
        };
        if let Some(config) = &message.protocol_config {
            exchange.body_mode = BodySendMode::try_from(config.request_body_mode).ok();
            exchange.no_wait = config.send_body_without_waiting_for_header_response;
        }
        let Some(request) = message.request else {
            continue;
        };
        let step = match request {
            processing_request::Request::RequestHeaders(headers) => on_headers(
                service,
                &mut exchange,
                headers,
                message.metadata_context.as_ref(),
            ),
            processing_request::Request::RequestBody(body) => on_body(service, &mut exchange, body),
            processing_request::Request::RequestTrailers(_) => on_trailers(&exchange),
            // The response comes before the answer only out of order; answered so Envoy never waits.
            other => Step::Reply(served::other_reply(&other).into_iter().collect()),
        };
        let received = Instant::now();
        let (responses, answer) = match step {
            Step::Wait => continue,
            Step::Reply(responses) => {
                if !send_all(out, responses).await {
                    return StreamEnd::Reset;
                }
                continue;
            }
            Step::Refuse(refusal) => (vec![immediate(&refusal)], Answer::Refuse(refusal)),
            Step::Shed(reason) => {
                return shed(service, out, &exchange, reason, None, received).await;
            }
            Step::Finish(responses) => {
                return if send_all(out, responses).await {
                    StreamEnd::Shed
                } else {
                    StreamEnd::Reset
                };
            }
            Step::Decide(ending) => {
                match decide(
                    service,
                    &mut exchange,
                    &mut inbound,
                    out,
                    ending,
                    stream_end,
                )
                .await
                {
                    Decided::Answer(responses, answer) => (responses, answer),
                    Decided::Shed(reason) => {
                        return shed(service, out, &exchange, reason, Some(ending), received).await;
                    }
                    Decided::Gone => {
                        service.metrics().overload.shed(ShedReason::Cancelled);
                        return StreamEnd::Reset;
                    }
                }
            }
        };
        // The decision's latency ends when its first message is on its way; a duplex body echo after
        // it is Envoy's transfer, not the decision.
        let mut responses = responses.into_iter();
        let mut sent = match responses.next() {
            Some(first) => out.send(Ok(first)).await.is_ok(),
            None => true,
        };
        let seconds = received.elapsed().as_secs_f64();
        service.observe_latency(&answer, seconds);
        let outcome = match answer {
            Answer::Route(_) => "routed",
            Answer::Refuse(_) => "refused",
            Answer::Shed(_) => "shed",
        };
        service.metrics().overload.observe_answer(outcome, seconds);
        for response in responses {
            sent = sent && out.send(Ok(response)).await.is_ok();
        }
        if !sent {
            return StreamEnd::Reset;
        }
        // A routed request's credit waits for the response's report; anything else ends here.
        return served::follow(service, follow, &mut inbound, out, answer).await;
    }
}

/// Gives the request up so that Envoy routes it by its own load balancing and the client is still
/// served; never an HTTP error of cachepick's own.
///
/// With a gRPC error, which Envoy's `failure_mode_allow` turns into exactly that — except in duplex mode
/// once the body has been streamed to cachepick: Envoy no longer holds it and answers a gRPC error with
/// a 500 (observed with Envoy 1.40, `envoy/README.md`). There the request is continued without a
/// destination instead: the headers response with no routing headers, the body streamed back, so
/// `override_host` falls back to the cluster's load balancing.
async fn shed(
    service: &Service,
    out: &Sender,
    exchange: &Exchange,
    reason: ShedReason,
    ending: Option<Ending>,
    owed: Instant,
) -> StreamEnd {
    let overload = &service.metrics().overload;
    overload.shed(reason);
    if let (true, Some(ending)) = (exchange.headers_pending, ending) {
        let sent = send_all(out, unrouted(exchange, ending)).await;
        overload.observe_answer("shed", owed.elapsed().as_secs_f64());
        return if sent {
            StreamEnd::Shed
        } else {
            StreamEnd::Reset
        };
    }
    let code = match reason {
        ShedReason::QueueFull | ShedReason::BodyBudget => tonic::Code::ResourceExhausted,
        ShedReason::Deadline | ShedReason::StreamDeadline => tonic::Code::DeadlineExceeded,
        ShedReason::Cancelled => tonic::Code::Cancelled,
        ShedReason::Internal => tonic::Code::Internal,
    };
    let mut status = Status::new(
        code,
        format!(
            "cachepick shed the request ({}); the proxy routes it by itself",
            reason.as_str()
        ),
    );
    status
        .metadata_mut()
        .insert(SHED_METADATA, MetadataValue::from_static(reason.as_str()));
    let sent = out.send(Err(status)).await.is_ok();
    overload.observe_answer("shed", owed.elapsed().as_secs_f64());
    if sent {
        StreamEnd::Shed
    } else {
        StreamEnd::Reset
    }
}

enum Step {
    /// Nothing to send yet (a duplex chunk before the end of the body).
    Wait,
    /// Give the request up with a gRPC error, and end the stream.
    Shed(ShedReason),
    /// Send these and end the stream (a shed duplex request whose body ended while being forwarded).
    Finish(Vec<ProcessingResponse>),
    /// Protocol replies; the stream goes on.
    Reply(Vec<ProcessingResponse>),
    /// The request is complete: decide, answer, and end the stream.
    Decide(Ending),
    /// Answer with this refusal, no decision needed, and end the stream.
    Refuse(Refusal),
}

/// What completed the request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Headers with `end_of_stream`: there is no body.
    Headers,
    /// The body's last message.
    Body,
    /// Trailers (duplex): answered last, after the body.
    Trailers,
}

async fn send_all(out: &Sender, responses: Vec<ProcessingResponse>) -> bool {
    for response in responses {
        if out.send(Ok(response)).await.is_err() {
            return false;
        }
    }
    true
}

fn on_headers(
    service: &Service,
    exchange: &mut Exchange,
    headers: HttpHeaders,
    metadata: Option<&Metadata>,
) -> Step {
    for header in headers
        .headers
        .iter()
        .flat_map(|map: &HeaderMap| &map.headers)
    {
        let key = header.key.to_ascii_lowercase();
        if key == ":path" {
            // As sent, query string included: the service reads the API off it.
            exchange.path = String::from_utf8_lossy(&header.raw_value).into_owned();
        } else if key == ":method" {
            exchange.method = String::from_utf8_lossy(&header.raw_value).into_owned();
        } else if key == "content-encoding" {
            exchange.content_encoding =
                Some(String::from_utf8_lossy(&header.raw_value).into_owned());
        } else if service.salt_header() == Some(key.as_str()) {
            exchange.tenant = Some(String::from_utf8_lossy(&header.raw_value).into_owned());
        } else if (key.starts_with(OWNED_PREFIX) || key == DESTINATION)
            && !exchange.spoofed.contains(&key)
        {
            exchange.spoofed.push(key);
        } else {
            #[cfg(feature = "fault-injection")]
            if key == FAULT_HEADER {
                exchange.fault = Fault::parse(&header.raw_value);
            }
        }
    }
    exchange.subset = metadata.and_then(lb::subset_hint);
    if headers.end_of_stream {
        // No body follows (a GET): decide now, in the headers response.
        return Step::Decide(Ending::Headers);
    }
    match exchange.body_mode {
        Some(BodySendMode::FullDuplexStreamed) => {
            // The headers response is the one that carries the decision; it waits for the body.
            exchange.headers_pending = true;
            Step::Wait
        }
        // The chunks come without waiting for the headers response, which carries the decision.
        Some(BodySendMode::Streamed) if exchange.no_wait => {
            exchange.headers_pending = true;
            Step::Wait
        }
        Some(BodySendMode::Buffered) | None => {
            Step::Reply(vec![headers_response(HeaderMutation {
                set_headers: Vec::new(),
                remove_headers: exchange.spoofed.clone(),
            })])
        }
        // STREAMED waiting for the headers response, BUFFERED_PARTIAL or NONE: the body never arrives
        // whole before Envoy picks the host, so no decision could take effect. Fail loudly rather than
        // route blind.
        Some(mode) => Step::Refuse(service.refuse(
            RefusalReason::UnsupportedBodyMode,
            format!(
                "cachepick needs the ext_proc filter's request_body_mode to be BUFFERED or \
                 FULL_DUPLEX_STREAMED, got {}",
                mode.as_str_name()
            ),
        )),
    }
}

fn on_body(service: &Service, exchange: &mut Exchange, body: HttpBody) -> Step {
    let duplex = exchange.headers_pending;
    let ends = body.end_of_stream || body.end_of_stream_without_message;
    if exchange.forwarding {
        // Shed mid-body: each chunk goes straight back to Envoy (or is let through), nothing is held.
        let responses = exchange.release_body(&body.body, 1, ends);
        return if ends {
            Step::Finish(responses)
        } else {
            Step::Reply(responses)
        };
    }
    let limit = service.max_body_bytes();
    if exchange.body.len().saturating_add(body.body.len()) > limit {
        return Step::Refuse(service.refuse(
            RefusalReason::TooLarge,
            format!("the request body exceeds max_body_bytes ({limit} bytes)"),
        ));
    }
    // Over the budget of every stream's bodies together: shed, so that the request is still served.
    if !exchange.share.grow(body.body.len()) {
        if !duplex {
            return Step::Shed(ShedReason::BodyBudget);
        }
        // Duplex or streamed: the headers response is cachepick's to give, so the request continues
        // without a destination; what was held goes back (or through) now, and the rest as it comes.
        service.metrics().overload.shed(ShedReason::BodyBudget);
        exchange.forwarding = true;
        let mut held = std::mem::take(&mut exchange.body);
        held.extend_from_slice(&body.body);
        exchange.share.release();
        let mut responses = vec![headers_response(HeaderMutation {
            set_headers: Vec::new(),
            remove_headers: exchange.spoofed.clone(),
        })];
        responses.extend(exchange.release_body(&held, exchange.chunks + 1, ends));
        return if ends {
            Step::Finish(responses)
        } else {
            Step::Reply(responses)
        };
    }
    exchange.chunks += 1;
    if exchange.body.is_empty() {
        // The common case (BUFFERED, or a duplex body's first chunk) keeps the message's buffer.
        exchange.body = body.body;
    } else {
        exchange.body.extend_from_slice(&body.body);
    }
    // BUFFERED sends the whole body in one message; its end_of_stream is false when trailers follow
    // (they come in their own message, or not at all with trailer mode SKIP), so that message is the
    // end either way. Duplex chunks end at end_of_stream, or at the trailers.
    if ends || !duplex {
        Step::Decide(Ending::Body)
    } else {
        Step::Wait
    }
}

/// Trailers end a duplex body (the proto's signal that the whole body has arrived); in other modes the
/// decision is already made and this only acknowledges them.
fn on_trailers(exchange: &Exchange) -> Step {
    if exchange.forwarding {
        Step::Finish(vec![response(
            processing_response::Response::RequestTrailers(TrailersResponse::default()),
        )])
    } else if exchange.headers_pending {
        Step::Decide(Ending::Trailers)
    } else {
        Step::Reply(vec![response(
            processing_response::Response::RequestTrailers(TrailersResponse::default()),
        )])
    }
}

/// How a decision ended.
enum Decided {
    /// The answer's messages, in the order Envoy expects them.
    Answer(Vec<ProcessingResponse>, Answer),
    /// Given up: answered with a gRPC error.
    Shed(ShedReason),
    /// The stream closed while the decision waited or ran: there is no one to answer.
    Gone,
}

/// Resolves when the stream is gone: Envoy reset it (the client went away, or Envoy gave up waiting),
/// which shows as an error on the inbound side or as the response side being dropped. A half-close is
/// not that: a client that has sent everything still wants its answer. Messages a complete request
/// does not expect are skipped.
async fn closed(inbound: &mut Streaming<ProcessingRequest>, out: &Sender) {
    let reset = async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => {}
                Ok(None) => std::future::pending::<()>().await,
                Err(_) => return,
            }
        }
    };
    tokio::select! {
        () = reset => {}
        () = out.closed() => {}
    }
}

/// Decides through admission, on the blocking pool, within the decision deadline, while watching the
/// stream: the decision is owed from now; it waits for a slot in the bounded queue, and is shed when
/// the queue is full, at its deadline, or (without an answer) when the stream closes. A decision that
/// ends after its deadline or its stream is not committed ([`CommitGate`]).
async fn decide(
    service: &Arc<Service>,
    exchange: &mut Exchange,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Sender,
    ending: Ending,
    stream_end: Instant,
) -> Decided {
    let owed = Instant::now();
    let deadline = owed + service.admission().decision_deadline();
    let (deadline, late) = if stream_end < deadline {
        (stream_end, ShedReason::StreamDeadline)
    } else {
        (deadline, ShedReason::Deadline)
    };
    // The last commit comes a little before the deadline: what follows it (the answer built, queued and
    // sent by a busy runtime) must still arrive by the deadline.
    let answer_time = (service.admission().decision_deadline() / 10).min(ANSWER_TIME);
    let commit_by = deadline.checked_sub(answer_time).unwrap_or(deadline);
    let gate = CommitGate::until(commit_by);
    exchange.whole = Bytes::from(std::mem::take(&mut exchange.body));
    let body = (ending != Ending::Headers).then(|| exchange.whole.clone());
    let request = Pending {
        path: exchange.path.clone(),
        method: exchange.method.clone(),
        subset: exchange.subset.clone(),
        content_encoding: exchange.content_encoding.clone(),
        tenant: exchange.tenant.clone(),
        body,
        #[cfg(feature = "fault-injection")]
        fault: exchange.fault,
    };
    let work = {
        let service = Arc::clone(service);
        let gate = gate.clone();
        async move {
            let admitted = service.admit(commit_by, request.body.as_deref()).await?;
            let decided = tokio::task::spawn_blocking(move || {
                // The slot is held until the work ends, even when its answer was given up on.
                let _admitted = admitted;
                request.route(&service, &gate)
            })
            .await;
            Ok::<_, ShedReason>(decided)
        }
    };
    let decided = tokio::select! {
        biased;
        () = closed(inbound, out) => {
            gate.cancel();
            return Decided::Gone;
        }
        // The gate closes by itself at the same instant: the decision, if it runs on, cannot commit.
        () = tokio::time::sleep_until(deadline.into()) => return Decided::Shed(late),
        decided = work => decided,
    };
    let answer = match decided {
        Err(reason) => return Decided::Shed(reason),
        Ok(Err(error)) => {
            // A panic in the decision: fail open, never a 5xx of cachepick's own.
            tracing::error!(%error, "the decision task failed; the request is failed open");
            return Decided::Shed(ShedReason::Internal);
        }
        Ok(Ok(Answer::Shed(reason))) => {
            return Decided::Shed(if reason == ShedReason::Deadline {
                late
            } else {
                reason
            });
        }
        Ok(Ok(Answer::Refuse(refusal))) if refusal.reason.fails_open() => {
            tracing::warn!(reason = refusal.reason.as_str(), message = %refusal.message,
                "the decision failed inside cachepick; the request is failed open");
            return Decided::Shed(ShedReason::Internal);
        }
        Ok(Ok(answer)) => answer,
    };
    let duplex = exchange.headers_pending;
    let responses = match (&answer, ending, duplex) {
        (Answer::Refuse(refusal), ..) => vec![immediate(refusal)],
        // Handled above; an empty answer would leave Envoy waiting, so it never gets here.
        (Answer::Shed(reason), ..) => return Decided::Shed(*reason),
        (Answer::Route(routed), Ending::Headers, _) => vec![routed_in_headers(exchange, routed)],
        (Answer::Route(routed), _, true) => {
            // Duplex and streamed order: the delayed headers response, the body (echoed or let
            // through), then the trailers if they ended it.
            let mut responses = vec![routed_in_headers(exchange, routed)];
            if exchange.chunks > 0 {
                responses.extend(exchange.release_body(
                    &exchange.whole,
                    exchange.chunks,
                    ending == Ending::Body,
                ));
            }
            if ending == Ending::Trailers {
                responses.push(response(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                )));
            }
            responses
        }
        (Answer::Route(routed), _, false) => vec![lb::with_metadata(
            routed,
            response(processing_response::Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(mutation(exchange, routed)),
                    ..CommonResponse::default()
                }),
            })),
        )],
    };
    Decided::Answer(responses, answer)
}

/// What a decision needs of the exchange, owned, so it can run on the blocking pool.
struct Pending {
    path: String,
    method: String,
    subset: Option<Vec<SocketAddr>>,
    content_encoding: Option<String>,
    tenant: Option<String>,
    body: Option<Bytes>,
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
}

impl Pending {
    fn route(&self, service: &Service, gate: &CommitGate) -> Answer {
        #[cfg(feature = "fault-injection")]
        match self.fault {
            Some(Fault::Panic) => inject_panic(),
            Some(Fault::Sleep(pause)) => std::thread::sleep(pause),
            None => {}
        }
        service.answer(
            &Inbound {
                path: &self.path,
                // Envoy always sends `:method`; a client of another kind may not.
                method: Some(self.method.as_str()).filter(|method| !method.is_empty()),
                body: self.body.as_deref(),
                subset: self.subset.as_deref(),
                content_encoding: self.content_encoding.as_deref(),
                tenant: self.tenant.as_deref(),
            },
            gate,
        )
    }
}

/// A fault injected into a decision (test builds only).
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug)]
enum Fault {
    Panic,
    Sleep(Duration),
}

#[cfg(feature = "fault-injection")]
impl Fault {
    fn parse(value: &[u8]) -> Option<Fault> {
        let value = std::str::from_utf8(value).ok()?;
        if value == "panic" {
            return Some(Fault::Panic);
        }
        let millis = value.strip_prefix("sleep=")?.parse().ok()?;
        Some(Fault::Sleep(Duration::from_millis(millis)))
    }
}

/// The injected fault: a panic inside the decision, as a bug would cause one.
#[cfg(feature = "fault-injection")]
#[allow(clippy::panic)]
fn inject_panic() {
    panic!("fault injected by {FAULT_HEADER}: panic");
}

/// A duplex or streamed request given up on after its body arrived, continued without a destination:
/// the delayed headers response with only the removal of client-sent routing headers, the body streamed
/// back (or let through), and the trailers response if they ended it. Envoy's `override_host` then uses
/// the cluster's own load balancing.
fn unrouted(exchange: &Exchange, ending: Ending) -> Vec<ProcessingResponse> {
    let mut responses = vec![headers_response(HeaderMutation {
        set_headers: Vec::new(),
        remove_headers: exchange.spoofed.clone(),
    })];
    if exchange.chunks > 0 {
        responses.extend(exchange.release_body(
            &exchange.whole,
            exchange.chunks,
            ending == Ending::Body,
        ));
    }
    if ending == Ending::Trailers {
        responses.push(response(processing_response::Response::RequestTrailers(
            TrailersResponse::default(),
        )));
    }
    responses
}

/// A routed answer as a headers response (header-only requests and duplex).
fn routed_in_headers(exchange: &Exchange, routed: &Routed) -> ProcessingResponse {
    lb::with_metadata(routed, headers_response(mutation(exchange, routed)))
}

fn headers_response(mutation: HeaderMutation) -> ProcessingResponse {
    response(processing_response::Response::RequestHeaders(
        HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                ..CommonResponse::default()
            }),
        },
    ))
}

/// The body, re-emitted in chunks Envoy accepts; with `ends`, the last one ends the stream (not when
/// trailers follow). An empty body is one empty chunk, so every body response carries a body mutation.
fn streamed_body(body: &[u8], ends: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[]]
    } else {
        body.chunks(MAX_STREAMED_CHUNK).collect()
    };
    let last = chunks.len().saturating_sub(1);
    chunks
        .into_iter()
        .enumerate()
        .map(|(index, chunk)| {
            response(processing_response::Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: chunk.to_vec(),
                                end_of_stream: ends && index == last,
                                ..StreamedBodyResponse::default()
                            },
                        )),
                    }),
                    ..CommonResponse::default()
                }),
            }))
        })
        .collect()
}

/// The destination and decision headers, overwriting whatever the client sent, and the removal of the
/// client's other `x-cachepick-*` headers.
fn mutation(exchange: &Exchange, routed: &Routed) -> HeaderMutation {
    let selected = routed
        .endpoints
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    let set = [
        (DESTINATION, routed.destination()),
        (SELECTED_HEADER, selected),
        (DECISION_HEADER, routed.label().to_owned()),
        (PREFIX_TOKENS_HEADER, routed.matched_tokens.to_string()),
    ];
    let remove_headers = exchange
        .spoofed
        .iter()
        .filter(|key| !set.iter().any(|(name, _)| name == key))
        .cloned()
        .collect();
    let set_headers = set
        .into_iter()
        .map(|(key, value)| header(key, value.into_bytes()))
        .collect();
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// Envoy 1.40 reads `raw_value` only (`value` alone is written empty; both is an error).
fn header(key: &str, raw_value: Vec<u8>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value,
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// A refusal as Envoy's local reply — status, JSON body, content type and the reason header: the one
/// place a [`Refusal`] becomes an `ImmediateResponse`.
fn immediate(refusal: &Refusal) -> ProcessingResponse {
    let status = refusal.status();
    let reason = refusal.reason.as_str();
    response(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![
                    header("content-type", b"application/json".to_vec()),
                    header(REJECT_HEADER, reason.as_bytes().to_vec()),
                ],
                remove_headers: Vec::new(),
            }),
            body: error_json(reason, &refusal.message),
            details: format!("cachepick_{reason}"),
            ..ImmediateResponse::default()
        },
    ))
}

fn response(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// Envoy resets the stream when the HTTP request ends; that is the normal end, not a failure.
fn is_reset(status: &Status) -> bool {
    matches!(status.code(), tonic::Code::Cancelled | tonic::Code::Unknown)
        || status.message().contains("reset")
        || status.message().contains("Reset")
}

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
//!
//! This file is the dialogue only: what the stream buffers and when it answers. The decision is handed
//! off to `handoff.rs` (deadline, admission, the blocking pool) and every answer is built by `answer.rs`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    external_processor_server::ExternalProcessor, processing_request,
};
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::answer::{self, Ending, Held, Sender};
use super::handoff::{self, Decided, Pending};
#[cfg(feature = "fault-injection")]
use super::handoff::{FAULT_HEADER, Fault};
use super::lb;
use super::relay;
use super::served::{self, Follow};
use super::trace;
use crate::metrics::StreamEnd;
use crate::protocol::{DESTINATION, OWNED_PREFIX, PREFILLER_HEADER, RefusalReason};
use crate::route::admission::BodyShare;
use crate::route::{Answer, Refusal, Service};

/// Longest wait for the next message of a request whose answer is still owed: a client that stops
/// sending its body mid-way must not hold a stream (and, in duplex mode, its buffered bytes) forever.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(60);

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
    /// `x-request-id` and `authorization`, which a prefill/decode request's prefill leg carries too.
    request_id: Option<String>,
    authorization: Option<Vec<u8>>,
    /// The W3C `traceparent`, whose span the request's span continues.
    traceparent: Option<Vec<u8>>,
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

    /// `body`, held as `chunks` messages, to be released when the request continues.
    fn held<'a>(&self, body: &'a [u8], chunks: usize) -> Held<'a> {
        Held {
            body,
            chunks,
            echoes: self.echoes(),
        }
    }

    /// What the decision needs, owned; from here on the whole body is `whole`, shared with the
    /// decision, so the answer can still re-emit it in duplex mode when the decision is given up on.
    fn pending(&mut self, ending: Ending) -> Pending {
        self.whole = Bytes::from(std::mem::take(&mut self.body));
        Pending {
            path: self.path.clone(),
            method: self.method.clone(),
            subset: self.subset.clone(),
            content_encoding: self.content_encoding.clone(),
            tenant: self.tenant.clone(),
            body: (ending != Ending::Headers).then(|| self.whole.clone()),
            #[cfg(feature = "fault-injection")]
            fault: self.fault,
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
            request_id: None,
            authorization: None,
            traceparent: None,
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

/// Runs one stream to its end and says how it ended.
///
/// Over 100 lines: a stream's one loop, its deadline, step, answer and accounting in one place, so
/// each stream's end is classified once.
async fn drive(
    service: &Arc<Service>,
    mut inbound: Streaming<ProcessingRequest>,
    out: &Sender,
    stream_end: Instant,
    follow: &Follow,
) -> StreamEnd {
    let mut exchange = Exchange::new(service.admission().budget().share());
    // An SGLang prefill leg in flight, aborted if its decode leg is never handed to Envoy.
    let mut dispatched = None;
    // The request's span, made once its headers (its id, its trace context) are known.
    let mut span = tracing::Span::none();
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
                let sent = send_all(out, vec![answer::immediate(&refusal)]).await;
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
            processing_request::Request::RequestHeaders(headers) => {
                let step = on_headers(
                    service,
                    &mut exchange,
                    headers,
                    message.metadata_context.as_ref(),
                );
                span = trace::request_span(
                    exchange.request_id.as_deref(),
                    exchange.traceparent.as_deref(),
                );
                step
            }
            processing_request::Request::RequestBody(body) => on_body(service, &mut exchange, body),
            processing_request::Request::RequestTrailers(_) => on_trailers(&exchange),
            // The response comes before the answer only out of order; answered so Envoy never waits.
            other => Step::Reply(answer::response_phase(&other).into_iter().collect()),
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
            Step::Refuse(refusal) => (vec![answer::immediate(&refusal)], Answer::Refuse(refusal)),
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
                let request = exchange.pending(ending);
                let decided = handoff::decide(service, request, &mut inbound, out, stream_end)
                    .instrument(span.clone())
                    .await;
                match decided {
                    Decided::Route(mut routed) => {
                        // A prefill/decode request's prefill leg runs before Envoy is answered.
                        let source = relay::LegSource {
                            path: &exchange.path,
                            body: &exchange.whole,
                            content_encoding: exchange.content_encoding.as_deref(),
                            request_id: exchange.request_id.as_deref(),
                            authorization: exchange.authorization.as_deref(),
                        };
                        let prefilled = match relay::prefill(
                            service,
                            &mut routed,
                            source,
                            &mut inbound,
                            stream_end,
                        )
                        .instrument(span.clone())
                        .await
                        {
                            Ok(prefilled) => prefilled,
                            Err(relay::Gone) => {
                                service.metrics().overload.shed(RefusalReason::Cancelled);
                                return StreamEnd::Reset;
                            }
                        };
                        dispatched = prefilled.dispatched;
                        let replaced = prefilled.body;
                        let body = replaced.as_deref().unwrap_or(&exchange.whole);
                        let held = exchange.held(body, exchange.chunks);
                        let delayed = exchange.headers_pending;
                        let traceparent = trace::traceparent_of(&span);
                        let responses = answer::routed(
                            &routed,
                            &exchange.spoofed,
                            held,
                            ending,
                            delayed,
                            replaced.is_some(),
                            traceparent.as_deref(),
                        );
                        (responses, Answer::Route(routed))
                    }
                    Decided::Refuse(refusal) => {
                        (vec![answer::immediate(&refusal)], Answer::Refuse(refusal))
                    }
                    Decided::Shed(reason) => {
                        return shed(service, out, &exchange, reason, Some(ending), received).await;
                    }
                    Decided::Gone => {
                        service.metrics().overload.shed(RefusalReason::Cancelled);
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
        trace::record(
            &span,
            &answer,
            u64::try_from(received.elapsed().as_micros()).unwrap_or(u64::MAX),
        );
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
            // Dropping an SGLang prefill leg whose decode leg never left aborts it.
            return StreamEnd::Reset;
        }
        if let Some(leg) = dispatched.take() {
            leg.release();
        }
        // A routed request's credit waits for the response's report; anything else ends here. The
        // request's span lives until then but does not instrument the wait: instrumenting it made a
        // small decision about 70 µs slower under `serve`'s log subscriber (BENCHMARKS.md, issue 27).
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
    reason: RefusalReason,
    ending: Option<Ending>,
    owed: Instant,
) -> StreamEnd {
    let overload = &service.metrics().overload;
    overload.shed(reason);
    let sent = match (exchange.headers_pending, ending) {
        (true, Some(ending)) => {
            let held = exchange.held(&exchange.whole, exchange.chunks);
            send_all(out, answer::unrouted(&exchange.spoofed, held, ending)).await
        }
        _ => out.send(Err(answer::shed_status(reason))).await.is_ok(),
    };
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
    Shed(RefusalReason),
    /// Send these and end the stream (a shed duplex request whose body ended while being forwarded).
    Finish(Vec<ProcessingResponse>),
    /// Protocol replies; the stream goes on.
    Reply(Vec<ProcessingResponse>),
    /// The request is complete: decide, answer, and end the stream.
    Decide(Ending),
    /// Answer with this refusal, no decision needed, and end the stream.
    Refuse(Refusal),
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
        } else if key == "x-request-id" {
            exchange.request_id = Some(String::from_utf8_lossy(&header.raw_value).into_owned());
        } else if key == "authorization" {
            exchange.authorization = Some(header.raw_value.clone());
        } else if key == trace::TRACEPARENT {
            exchange.traceparent = Some(header.raw_value.clone());
        } else if service.salt_header() == Some(key.as_str()) {
            exchange.tenant = Some(String::from_utf8_lossy(&header.raw_value).into_owned());
        } else if (key.starts_with(OWNED_PREFIX) || key == DESTINATION || key == PREFILLER_HEADER)
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
            Step::Reply(vec![answer::stripped(&exchange.spoofed)])
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
        let responses = exchange.held(&body.body, 1).release(ends);
        return Step::forwarded(responses, ends);
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
            return Step::Shed(RefusalReason::BodyBudget);
        }
        // Duplex or streamed: the headers response is cachepick's to give, so the request continues
        // without a destination; what was held goes back (or through) now, and the rest as it comes.
        service.metrics().overload.shed(RefusalReason::BodyBudget);
        exchange.forwarding = true;
        let mut held = std::mem::take(&mut exchange.body);
        held.extend_from_slice(&body.body);
        exchange.share.release();
        let mut responses = vec![answer::stripped(&exchange.spoofed)];
        responses.extend(exchange.held(&held, exchange.chunks + 1).release(ends));
        return Step::forwarded(responses, ends);
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

impl Step {
    /// What a request continued without a destination answers to a body message: the last one ends
    /// the stream.
    fn forwarded(responses: Vec<ProcessingResponse>, ends: bool) -> Step {
        if ends {
            Step::Finish(responses)
        } else {
            Step::Reply(responses)
        }
    }
}

/// Trailers end a duplex body (the proto's signal that the whole body has arrived); in other modes the
/// decision is already made and this only acknowledges them.
fn on_trailers(exchange: &Exchange) -> Step {
    if exchange.forwarding {
        Step::Finish(vec![answer::trailers()])
    } else if exchange.headers_pending {
        Step::Decide(Ending::Trailers)
    } else {
        Step::Reply(vec![answer::trailers()])
    }
}

/// Whether the stream ended because the proxy went away: it cancelled the call (Envoy resets the stream
/// when the HTTP request ends: the normal end, not a failure), or the transport under the stream stopped
/// carrying it — a reset whatever its reason code, a GOAWAY, the connection's end. tonic gives those the
/// code their HTTP/2 reason maps to (a GOAWAY's NO_ERROR is `Internal`), so they are known by the hyper or
/// I/O error under the status. What remains is the stream's own error: a message that does not decode
/// or is over the size limit.
fn is_reset(status: &Status) -> bool {
    if matches!(status.code(), tonic::Code::Cancelled | tonic::Code::Unknown) {
        return true;
    }
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<hyper::Error>() || error.is::<std::io::Error>() {
            return true;
        }
        source = error.source();
    }
    false
}

//! Every `ProcessingResponse` cachepick sends Envoy, and the gRPC status of a shed: the wire's answers,
//! written in one place.
//!
//! - a routed request: the destination and decision headers (`raw_value`, overwriting) beside the
//!   `envoy.lb` metadata, in the headers response (header-only, duplex, streamed) or the body response
//!   (buffered);
//! - a request continued without a destination: only the removal of client-sent routing headers;
//! - the body held in duplex or streamed mode, released in Envoy's order: the body itself re-emitted as
//!   `streamed_response` chunks (duplex), or one CONTINUE per chunk (streamed), then the trailers;
//! - a refusal: Envoy's local reply ([`immediate`], the one place a [`Refusal`] becomes HTTP);
//! - a shed: a gRPC error ([`shed_status`], the shed's gRPC status);
//! - the response phase: the empty answers that let the response go on unchanged.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation, processing_request,
    processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use tonic::Status;
use tonic::metadata::MetadataValue;

use super::lb;
use crate::protocol::{
    DECISION_HEADER, DECODE_DECISION_HEADER, DECODE_PRESSURE_HEADER, DESTINATION, PD_HEADER,
    PREDICTED_TTFT_HEADER, PREFILL_HEADER, PREFILLER_HEADER, PREFIX_TOKENS_HEADER, REFUSAL_HEADER,
    RefusalReason, SELECTED_HEADER, SHED_METADATA, error_json,
};
use crate::route::{Refusal, Routed};

/// The stream's outbound side: answers, or the gRPC error that ends the stream.
pub(super) type Sender = tokio::sync::mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Envoy recommends at most 64 KiB per streamed chunk; this leaves room for the message's framing.
pub const MAX_STREAMED_CHUNK: usize = 62_000;

/// What completed the request.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// Headers with `end_of_stream`: there is no body.
    Headers,
    /// The body's last message.
    Body,
    /// Trailers (duplex): answered last, after the body.
    Trailers,
}

/// Body chunks a duplex or streamed stream holds, and how they go back when the request continues.
#[derive(Clone, Copy)]
pub(super) struct Held<'a> {
    pub body: &'a [u8],
    /// Body messages received, each owed an answer in streamed mode.
    pub chunks: usize,
    /// The body goes back to Envoy through cachepick (FULL_DUPLEX_STREAMED), rather than being held by
    /// Envoy and answered with CONTINUE (STREAMED).
    pub echoes: bool,
}

impl Held<'_> {
    /// The answers to the chunks, when the request continues: the body itself in duplex mode (`ends`:
    /// it ends the stream), one CONTINUE per chunk in streamed mode.
    pub(super) fn release(self, ends: bool) -> Vec<ProcessingResponse> {
        if self.echoes {
            streamed_body(self.body, ends)
        } else {
            (0..self.chunks)
                .map(|_| {
                    response(processing_response::Response::RequestBody(
                        BodyResponse::default(),
                    ))
                })
                .collect()
        }
    }
}

/// A routed request's answer, in the order Envoy expects it: the headers response of a header-only
/// request; in duplex and streamed mode (`delayed`: the headers response waited for the body) the
/// headers response, then what was held; else (buffered) the body response.
///
/// With `replaced`, `held.body` is a new body for the upstream (a prefill/decode request's decode leg):
/// the body response carries it whole and sets its length (buffered), it is what streams back
/// (duplex), or it replaces the first chunk and the others are cleared (streamed).
pub(super) fn routed(
    routed: &Routed,
    spoofed: &[String],
    held: Held<'_>,
    ending: Ending,
    delayed: bool,
    replaced: bool,
    traceparent: Option<&str>,
) -> Vec<ProcessingResponse> {
    let in_headers = || {
        lb::with_metadata(
            routed,
            headers_response(mutation(spoofed, routed, None, traceparent)),
        )
    };
    match (ending, delayed) {
        (Ending::Headers, _) => vec![in_headers()],
        (_, true) if replaced && !held.echoes => {
            let mut responses = vec![in_headers()];
            responses.extend(replaced_chunks(held));
            if ending == Ending::Trailers {
                responses.push(trailers());
            }
            responses
        }
        (_, true) => continued(in_headers(), held, ending),
        (_, false) => {
            let length = replaced.then_some(held.body.len());
            vec![lb::with_metadata(
                routed,
                response(processing_response::Response::RequestBody(BodyResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(mutation(spoofed, routed, length, traceparent)),
                        body_mutation: replaced.then(|| BodyMutation {
                            mutation: Some(body_mutation::Mutation::Body(held.body.to_vec())),
                        }),
                        ..CommonResponse::default()
                    }),
                })),
            )]
        }
    }
}

/// Streamed mode with a new body: the first chunk's answer replaces it with the whole new body, every
/// later chunk's clears it.
fn replaced_chunks(held: Held<'_>) -> Vec<ProcessingResponse> {
    (0..held.chunks.max(1))
        .map(|index| {
            let mutation = if index == 0 {
                body_mutation::Mutation::Body(held.body.to_vec())
            } else {
                body_mutation::Mutation::ClearBody(true)
            };
            response(processing_response::Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(mutation),
                    }),
                    ..CommonResponse::default()
                }),
            }))
        })
        .collect()
}

/// A duplex or streamed request given up on after its body arrived, continued without a destination:
/// the delayed headers response with only the removal of client-sent routing headers, the body streamed
/// back (or let through), and the trailers response if they ended it. Envoy's `override_host` then uses
/// the cluster's own load balancing.
pub(super) fn unrouted(
    spoofed: &[String],
    held: Held<'_>,
    ending: Ending,
) -> Vec<ProcessingResponse> {
    continued(stripped(spoofed), held, ending)
}

/// Duplex and streamed order: the delayed headers response, the body (echoed or let through), then the
/// trailers if they ended it.
fn continued(
    headers: ProcessingResponse,
    held: Held<'_>,
    ending: Ending,
) -> Vec<ProcessingResponse> {
    let mut responses = vec![headers];
    if held.chunks > 0 {
        responses.extend(held.release(ending == Ending::Body));
    }
    if ending == Ending::Trailers {
        responses.push(trailers());
    }
    responses
}

/// The headers response of a request that goes on without a destination (yet): only the removal of
/// client-sent routing headers.
pub(super) fn stripped(spoofed: &[String]) -> ProcessingResponse {
    headers_response(HeaderMutation {
        set_headers: Vec::new(),
        remove_headers: spoofed.to_vec(),
    })
}

/// The acknowledgement of request trailers.
pub(super) fn trailers() -> ProcessingResponse {
    response(processing_response::Response::RequestTrailers(
        TrailersResponse::default(),
    ))
}

/// A refusal as Envoy's local reply — status, JSON body, content type and the reason header: the one
/// place a [`Refusal`] becomes an `ImmediateResponse`.
pub(super) fn immediate(refusal: &Refusal) -> ProcessingResponse {
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
                    header(REFUSAL_HEADER, reason.as_bytes().to_vec()),
                ],
                remove_headers: Vec::new(),
            }),
            body: error_json(reason, &refusal.message),
            details: format!("cachepick_{reason}"),
            ..ImmediateResponse::default()
        },
    ))
}

/// A shed as the gRPC error that Envoy's `failure_mode_allow` turns into routing by its own load
/// balancing, its reason in the `x-cachepick-shed-reason` metadata: the one place a [`RefusalReason`]
/// becomes a status.
pub(super) fn shed_status(reason: RefusalReason) -> Status {
    let code = grpc_code(reason);
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
    status
}

/// The gRPC code of a reason, wherever cachepick answers one with a gRPC status: a shed ends its
/// ext_proc stream with it, the admin API refuses with it. The one place a reason becomes a code.
pub(super) fn grpc_code(reason: RefusalReason) -> tonic::Code {
    use tonic::Code;
    match reason {
        RefusalReason::QueueFull | RefusalReason::BodyBudget => Code::ResourceExhausted,
        RefusalReason::Deadline | RefusalReason::StreamDeadline => Code::DeadlineExceeded,
        RefusalReason::Cancelled => Code::Cancelled,
        // The rest by the HTTP status a client would get.
        _ => match reason.status() {
            404 => Code::NotFound,
            // gRPC's own answer to a message over the size limit, and to a caller over its rate.
            413 | 429 => Code::ResourceExhausted,
            400..=499 => Code::InvalidArgument,
            _ => Code::Internal,
        },
    }
}

/// The empty answer to the response's headers: the response goes on unchanged.
pub(super) fn response_headers() -> ProcessingResponse {
    response(processing_response::Response::ResponseHeaders(
        HeadersResponse::default(),
    ))
}

/// The empty answer to a response-phase message that needs one (the filter skips these by default;
/// a hand-written configuration may send them), so Envoy never waits on cachepick.
pub(super) fn response_phase(request: &processing_request::Request) -> Option<ProcessingResponse> {
    use processing_response::Response;
    let response_of = match request {
        processing_request::Request::ResponseHeaders(_) => return Some(response_headers()),
        processing_request::Request::ResponseBody(_) => {
            Response::ResponseBody(BodyResponse::default())
        }
        processing_request::Request::ResponseTrailers(_) => {
            Response::ResponseTrailers(TrailersResponse::default())
        }
        _ => return None,
    };
    Some(response(response_of))
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
/// A prefill/decode request also names its prefill worker, its decode reason and its prefill leg's
/// outcome; a buffered body replaced for the upstream gets its new `content-length`.
/// `traceparent`, when given, replaces the request's own: the engine's spans continue cachepick's.
fn mutation(
    spoofed: &[String],
    routed: &Routed,
    content_length: Option<usize>,
    traceparent: Option<&str>,
) -> HeaderMutation {
    let selected = routed
        .endpoints
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    let mut set = vec![
        (DESTINATION, routed.destination()),
        (SELECTED_HEADER, selected),
        (DECISION_HEADER, routed.label().to_owned()),
        (PREFIX_TOKENS_HEADER, routed.matched_tokens.to_string()),
    ];
    if let Some(us) = routed.predicted_ttft_us {
        set.push((
            PREDICTED_TTFT_HEADER,
            format!("{}.{:03}", us / 1000, us % 1000),
        ));
    }
    if let Some(pd) = &routed.pd {
        let prefill = pd
            .prefilled_by
            .or_else(|| pd.prefill.first().copied())
            .map(|worker| worker.to_string())
            .unwrap_or_default();
        // A request its decode worker prefills itself names no prefill worker to the sidecar.
        if pd.handshake == crate::config::Handshake::Sidecar && pd.local.is_none() {
            set.push((PREFILLER_HEADER, prefill.clone()));
        }
        set.push((PREFILL_HEADER, prefill));
        set.push((DECODE_DECISION_HEADER, pd.decode.reason.as_str().to_owned()));
        set.push((DECODE_PRESSURE_HEADER, pd.decode.pressure.to_string()));
        if let Some(handoff) = pd.handoff {
            set.push((PD_HEADER, handoff.as_str().to_owned()));
        }
    }
    if let Some(length) = content_length {
        set.push(("content-length", length.to_string()));
    }
    if let Some(traceparent) = traceparent {
        set.push((super::trace::TRACEPARENT, traceparent.to_owned()));
    }
    let remove_headers = spoofed
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

fn response(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;

    fn routed(predicted_ttft_us: Option<u64>) -> Routed {
        Routed {
            pool: "m".to_owned(),
            endpoints: vec!["127.0.0.1:8000".parse().unwrap()],
            reason: Reason::CacheHit,
            matched_tokens: 4096,
            prompt_tokens: 5000,
            passthrough: false,
            predicted_ttft_us,
            credit: None,
            pd: None,
        }
    }

    fn value(mutation: &HeaderMutation, name: &str) -> Option<String> {
        mutation
            .set_headers
            .iter()
            .filter_map(|option| option.header.as_ref())
            .find(|header| header.key == name)
            .map(|header| String::from_utf8_lossy(&header.raw_value).into_owned())
    }

    #[test]
    fn a_prediction_is_sent_in_milliseconds_and_its_absence_sends_nothing() {
        let predicted = mutation(&[], &routed(Some(12_345)), None, None);
        assert_eq!(
            value(&predicted, PREDICTED_TTFT_HEADER).as_deref(),
            Some("12.345")
        );
        let sub_ms = mutation(&[], &routed(Some(7)), None, None);
        assert_eq!(
            value(&sub_ms, PREDICTED_TTFT_HEADER).as_deref(),
            Some("0.007")
        );
        // A client's copy is removed, not kept, when cachepick made no prediction.
        let spoofed = [PREDICTED_TTFT_HEADER.to_owned()];
        let none = mutation(&spoofed, &routed(None), None, None);
        assert_eq!(value(&none, PREDICTED_TTFT_HEADER), None);
        assert_eq!(none.remove_headers, spoofed);
    }
}

//! The response phase of an ext_proc stream: Envoy's report of who served a routed request.
//!
//! With `feedback.enabled`, a stream whose answer committed a credit ([`Routed::credit`]), and whose
//! filter announces its response phase (the gRPC metadata `x-cachepick-feedback`, which the generated
//! filter sends as `initial_metadata`), is not ended after the answer: it waits for Envoy's
//! `response_headers` message (the generated filter sets
//! `response_header_mode: SEND` and `response_attributes: [upstream.address, response.code]`), answers
//! it at once with an empty headers response (the response goes on unchanged), and hands the status
//! and the upstream host to [`Service::settle`], which confirms, moves or retracts the credit. Then the
//! stream ends cleanly, as every stream does after its last needed answer.
//!
//! The wait is bounded: by `feedback.wait`, by the stream (Envoy resets it when the HTTP request ends,
//! or never sends the message when its filter skips the response phase), and by the picker's drain
//! (after `shutdown_grace` every follower lets go, so a stop is never held by a long generation).
//! Whichever comes first without a report leaves the credit as committed (`unreported`): today's
//! behaviour without feedback. A request that was refused, shed or passed through has nothing to
//! settle and its stream ends at its answer, as before.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, processing_request,
};
use envoy_types::pb::google::protobuf::{Struct, value};
use tokio::sync::watch;
use tonic::Streaming;

use super::answer::{self, Sender};
use crate::metrics::StreamEnd;
use crate::route::{Answer, ServedReport, Service};

use crate::protocol::{
    FEEDBACK_METADATA, RESPONSE_CODE_ATTRIBUTE as RESPONSE_CODE,
    UPSTREAM_ADDRESS_ATTRIBUTE as UPSTREAM_ADDRESS,
};

/// How long a stream follows its request for the report, and the signal that ends every wait.
#[derive(Clone, Debug)]
pub struct Follow {
    /// `None`: feedback is off; every stream ends at its answer.
    pub wait: Option<Duration>,
    /// Turns true once the picker's drain grace has passed.
    pub stopped: watch::Receiver<bool>,
}

impl Follow {
    /// This stream's follow: the configured one when the stream's gRPC metadata carries
    /// [`FEEDBACK_METADATA`] (the generated filter's `initial_metadata`: its response phase is on),
    /// else none, so that a client that never sends the response phase (a hand-written filter that
    /// skips it, the rig's client) sees every stream end at its answer, as without feedback.
    pub fn for_stream(&self, metadata: &tonic::metadata::MetadataMap) -> Follow {
        Follow {
            wait: self
                .wait
                .filter(|_| metadata.get(FEEDBACK_METADATA).is_some()),
            stopped: self.stopped.clone(),
        }
    }
}

/// After the answer: waits for the response report of a request whose answer credited a worker, and
/// settles the credit; returns at once for any other answer.
pub(super) async fn follow(
    service: &Arc<Service>,
    follow: &Follow,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Sender,
    answer: Answer,
) -> StreamEnd {
    let (Some(wait), Answer::Route(routed)) = (follow.wait, answer) else {
        return StreamEnd::Answered;
    };
    let Some(credit) = routed.credit else {
        return StreamEnd::Answered;
    };
    let mut stopped = follow.stopped.clone();
    let report = async {
        loop {
            let message = match inbound.message().await {
                Ok(Some(message)) => message,
                // The request ended (or the client went away) before the response.
                Ok(None) | Err(_) => return None,
            };
            let Some(request) = message.request else {
                continue;
            };
            let processing_request::Request::ResponseHeaders(headers) = request else {
                // Nothing else is configured after the answer; answered so Envoy never waits.
                if let Some(reply) = answer::response_phase(&request)
                    && out.send(Ok(reply)).await.is_err()
                {
                    return None;
                }
                continue;
            };
            // Answered first: the response waits for nothing of what follows.
            let answered = out.send(Ok(answer::response_headers())).await.is_ok();
            tracing::trace!(attributes = ?message.attributes, "response phase");
            return report_of(&headers, &message.attributes).map(|report| (report, answered));
        }
    };
    let reported = tokio::select! {
        reported = report => reported,
        _ = stopped.wait_for(|stopped| *stopped) => None,
        () = tokio::time::sleep(wait) => None,
    };
    let report = reported.map(|(report, _)| report);
    service.settle(&routed.pool, &credit, report);
    match reported {
        Some((_, false)) => StreamEnd::Reset,
        _ => StreamEnd::Answered,
    }
}

/// The status and upstream host of a `response_headers` message: the `:status` header (else the
/// `response.code` attribute) and the `upstream.address` attribute, in whichever attribute set Envoy
/// keyed it (the filter's name). `None` without a status.
pub fn report_of(
    headers: &HttpHeaders,
    attributes: &std::collections::HashMap<String, Struct>,
) -> Option<ServedReport> {
    let header_status = headers
        .headers
        .iter()
        .flat_map(|map| &map.headers)
        .find(|header| header.key == ":status")
        .and_then(|header| std::str::from_utf8(&header.raw_value).ok()?.parse().ok());
    let attribute = |name: &str| {
        attributes
            .values()
            .find_map(|set| set.fields.get(name))
            .and_then(|value| value.kind.as_ref())
    };
    let attribute_status = match attribute(RESPONSE_CODE) {
        Some(value::Kind::NumberValue(code)) if (100.0..1000.0).contains(code) => {
            // Checked to be a three-digit status above.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Some(*code as u16)
        }
        _ => None,
    };
    let upstream = match attribute(UPSTREAM_ADDRESS) {
        Some(value::Kind::StringValue(address)) => address.parse::<SocketAddr>().ok(),
        _ => None,
    };
    Some(ServedReport {
        status: header_status.or(attribute_status)?,
        upstream,
        at: std::time::Instant::now(),
    })
}

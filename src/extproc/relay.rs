//! A prefill/decode request between its decision and its answer: the prefill leg runs (`pd`) while
//! the stream is watched, so a client that goes away takes its prefill leg with it.

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use tokio::time::Instant;
use tonic::Streaming;

use crate::pd::{Handoff, Leg, Relayed};
use crate::route::{Routed, Service};

/// What a stream knows of its request that the prefill leg needs.
pub(super) struct LegSource<'a> {
    pub path: &'a str,
    pub body: &'a Bytes,
    pub content_encoding: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub authorization: Option<&'a [u8]>,
}

/// The client went away while its prefill leg ran.
pub(super) struct Gone;

/// Runs `routed`'s prefill leg, if it has one, until `stream_end`: the decode leg's body (`None`: the
/// client's, untouched), with the outcome recorded in `routed.pd`, the metrics and the log.
pub(super) async fn prefill(
    service: &Service,
    routed: &mut Routed,
    source: LegSource<'_>,
    inbound: &mut Streaming<ProcessingRequest>,
    stream_end: Instant,
) -> Result<Option<Vec<u8>>, Gone> {
    let Some(pd) = routed.pd.as_mut() else {
        return Ok(None);
    };
    let Some(relay) = service.picker().relay(&routed.pool) else {
        return Ok(None);
    };
    // The answer must still reach Envoy before the stream's deadline.
    let deadline =
        stream_end - ANSWER_TIME.min(stream_end.saturating_duration_since(Instant::now()));
    let relayed = if source
        .content_encoding
        .is_some_and(|coding| !coding.trim().eq_ignore_ascii_case("identity"))
    {
        // The engine reads the compressed body as the client sent it; cachepick would have to
        // re-compress the re-written one, so the decode worker prefills it instead.
        Relayed {
            handoff: Handoff::LocalPrefillUnreadable,
            prefill: None,
            body: None,
            failures: Vec::new(),
            elapsed: std::time::Duration::ZERO,
        }
    } else {
        let leg = Leg {
            path: source.path,
            body: source.body.clone(),
            request_id: source.request_id,
            authorization: source.authorization,
            prefill: &pd.prefill,
        };
        let run = relay.prefill(leg, deadline);
        tokio::pin!(run);
        loop {
            tokio::select! {
                relayed = &mut run => break relayed,
                message = inbound.message() => match message {
                    // Nothing is owed to Envoy yet; a message now is out of order and ignored.
                    Ok(Some(_)) => {}
                    // Envoy closed the stream: the client left. Dropping the leg closes its
                    // connection, and the engine aborts the prefill.
                    Ok(None) | Err(_) => return Err(Gone),
                },
            }
        }
    };
    for (worker, why) in &relayed.failures {
        tracing::info!(pool = %routed.pool, prefill = %worker, why = %why, "prefill leg failed");
    }
    service.metrics().pd.record_handoff(
        &routed.pool,
        relayed.handoff,
        relayed.failures.len(),
        relayed.elapsed.as_secs_f64(),
    );
    pd.handoff = Some(relayed.handoff);
    pd.prefilled_by = relayed.prefill;
    Ok(relayed.body)
}

/// What is kept of the stream's deadline for the answer to reach Envoy.
const ANSWER_TIME: std::time::Duration = std::time::Duration::from_millis(50);

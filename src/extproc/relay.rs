//! A prefill/decode request between its decision and its answer: the prefill leg runs (`pd`) while
//! the stream is watched, so a client that goes away takes its prefill leg with it. An SGLang leg
//! (`bootstrap`) is sent and not waited for: it is aborted if the answer never reaches Envoy, and
//! otherwise ends with the engines (SGLang's decode worker aborts its room at the prefill worker when
//! its client leaves).

use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use tokio::time::Instant;
use tonic::Streaming;

use crate::config::Handshake;
use crate::pd::{Dispatched, Handoff, Leg, Relayed};
use crate::route::{Routed, Service};

/// What a stream knows of its request that the prefill leg needs.
pub(super) struct LegSource<'a> {
    pub path: &'a str,
    pub body: &'a Bytes,
    pub content_encoding: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub authorization: Option<&'a [u8]>,
}

impl LegSource<'_> {
    /// The prefill leg to `prefill` (the chosen worker, then its replacement).
    fn leg<'a>(&'a self, prefill: &'a [std::net::SocketAddr]) -> Leg<'a> {
        Leg {
            path: self.path,
            body: self.body.clone(),
            request_id: self.request_id,
            authorization: self.authorization,
            prefill,
        }
    }
}

/// The client went away while its prefill leg ran.
pub(super) struct Gone;

/// The decode leg's body (`None`: the client's, untouched) and an SGLang prefill leg in flight.
pub(super) struct Prefilled {
    pub body: Option<Vec<u8>>,
    pub dispatched: Option<Dispatched>,
}

/// Runs `routed`'s prefill leg, if it has one, until `stream_end` (an SGLang leg: until sent), with
/// the outcome recorded in `routed.pd`, the metrics and the log.
pub(super) async fn prefill(
    service: &Arc<Service>,
    routed: &mut Routed,
    source: LegSource<'_>,
    inbound: &mut Streaming<ProcessingRequest>,
    stream_end: Instant,
) -> Result<Prefilled, Gone> {
    let none = Prefilled {
        body: None,
        dispatched: None,
    };
    let Some(pd) = routed.pd.as_mut() else {
        return Ok(none);
    };
    // Conditional disaggregation chose the decode worker to prefill: no leg, said so.
    if let Some(local) = pd.local {
        let handoff = crate::route::local_handoff(local);
        service
            .metrics()
            .pd
            .record_handoff(&routed.pool, handoff, 0, 0.0);
        pd.handoff = Some(handoff);
        return Ok(none);
    }
    let Some(relay) = service.picker().relay(&routed.pool) else {
        return Ok(none);
    };
    if relay.config().handshake == Handshake::Bootstrap {
        let leg = source.leg(&pd.prefill);
        let (metrics, pool) = (Arc::clone(service), routed.pool.clone());
        let sent = relay.rendezvous(leg, move |ended, took| {
            if let Err(why) = &ended {
                tracing::info!(pool = %pool, why = %why, seconds = took.as_secs_f64(), "prefill leg failed");
            }
            metrics.metrics().pd.record_leg_end(&pool, ended.is_ok());
        });
        service
            .metrics()
            .pd
            .record_handoff(&routed.pool, sent.handoff, 0, 0.0);
        pd.handoff = Some(sent.handoff);
        pd.prefilled_by = sent.prefill;
        return Ok(Prefilled {
            body: sent.body,
            dispatched: sent.dispatched,
        });
    }
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
        let leg = source.leg(&pd.prefill);
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
    Ok(Prefilled {
        body: relayed.body,
        dispatched: None,
    })
}

/// What is kept of the stream's deadline for the answer to reach Envoy.
const ANSWER_TIME: std::time::Duration = std::time::Duration::from_millis(50);

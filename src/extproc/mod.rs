//! The gRPC face of cachepick on `listen`: the Envoy ext_proc service, EDS for Envoy's workers cluster
//! (`eds.rs`) and gRPC health.
//!
//! This is the only module that sees protobuf and tonic types; everything it hands inward is a plain
//! domain type, and everything it sends out is built here from a domain outcome.
//!
//! Health follows the Endpoint Picker Protocol's service names: `liveness` is SERVING while the process
//! runs; `readiness` and the ext_proc service are SERVING while the picker can decide with what it
//! knows: every pool has completed a scrape round and at least one worker's reading is fresh. They turn
//! NOT_SERVING when every reading has gone stale (and back when one is fresh again), and for good when
//! the picker starts draining (SIGTERM/SIGINT): it keeps answering for `overload.shutdown_grace`, so
//! Envoy's health check moves its traffic to other replicas first.
//!
//! The listener is bounded: HTTP/2 streams per connection, open connections, connections without a
//! stream (closed after `overload.idle_timeout`, or `first_stream_timeout` before their first; at the
//! cap the one idle longest makes room: `listener.rs`), keepalive on both HTTP/2 and TCP (a peer that
//! vanished is noticed and its streams freed).

mod admin;
mod answer;
pub mod eds;
mod handoff;
mod lb;
mod listener;
mod process;
mod relay;
mod served;
mod trace;
mod transport;

/// The generated `cachepick.v1` admin API (messages, server, client), for tests and Rust tools.
pub use admin::pb as admin_api;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use answer::MAX_STREAMED_CHUNK;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
pub use handoff::FAULT_INJECTION;
pub use listener::CLOSE_GRACE;
pub use transport::{HANDSHAKE_TIMEOUT, MAX_PENDING_HANDSHAKES};

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::auth::BearerToken;
use crate::config::{FeedbackConfig, OverloadConfig};
use crate::health::Readiness;
/// The wire names, defined in [`crate::protocol`]; re-exported here for the callers that speak
/// ext_proc (tests, the demo, replay).
pub use crate::protocol::{
    DECISION_HEADER, DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, LIVENESS, PREFIX_TOKENS_HEADER,
    READINESS, REFUSAL_HEADER, SELECTED_HEADER, SUBSET_KEY, SUBSET_NAMESPACE,
};
use crate::route::Service;
use crate::tls::ServerTls;

/// Who reaches what on `listen`, and how.
#[derive(Clone, Default)]
pub struct Access {
    /// Serve the admin API and reflection (`Config::debug_on_listen`).
    pub debug: bool,
    /// When set, the admin API and reflection require `authorization: Bearer <token>`.
    pub token: Option<BearerToken>,
    /// TLS on every connection (ext_proc, EDS, health, admin); `None` is plain text.
    pub tls: Option<Arc<ServerTls>>,
}

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Room for the headers and metadata Envoy sends beside a body of `max_body_bytes`.
const MESSAGE_OVERHEAD: usize = 1 << 20;

/// HTTP/2 PING every 30 s on an idle connection, and the peer gone after 10 s without the answer:
/// Envoy's own `connection_keepalive` is the same, so either side notices a vanished peer.
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive under HTTP/2's, for connections that never carry a stream.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// What the gRPC listener serves and how it is bounded, beyond the request service.
#[derive(Clone)]
pub struct ServeOptions {
    /// Who reaches what, and how (admin API, token, TLS).
    pub access: Access,
    pub overload: OverloadConfig,
    /// Whether a routed request's stream waits for Envoy's response report, and how long.
    pub feedback: FeedbackConfig,
    /// `load.freshness` (how often readiness is looked at) and `load.silent_after` (how recent a
    /// reading or a sign of life readiness needs).
    pub freshness: Duration,
    pub silent_after: Duration,
    /// Where readiness is also published, for the HTTP probes on `metrics_listen`.
    pub readiness: Readiness,
    /// True once the replica's warm start is over (adopted a sibling's index, or found none to):
    /// readiness waits for it.
    pub warmed: watch::Receiver<bool>,
}

/// Readiness and the ext_proc service's health (what Envoy's health check asks) change together, and
/// the HTTP probes' view with them.
async fn set_readiness(reporter: &HealthReporter, readiness: &Readiness, status: ServingStatus) {
    readiness.set(status == ServingStatus::Serving);
    for service in [READINESS, EXT_PROC_SERVICE] {
        reporter.set_service_status(service, status).await;
    }
}

/// Keeps readiness true to what the picker can do: NOT_SERVING until every pool has had a scrape round
/// and the warm start is over, then SERVING exactly while some worker answers (`Service::can_route`: a late reading is not a worker
/// gone); NOT_SERVING for good once `draining`.
async fn follow_readiness(
    reporter: HealthReporter,
    readiness: Readiness,
    service: Arc<Service>,
    (freshness, silent_after): (Duration, Duration),
    mut warmed: watch::Receiver<bool>,
    mut draining: watch::Receiver<bool>,
) {
    // Ready only once every pool has completed a scrape round (a pool whose scraper is gone never
    // is), and the warm start is over.
    for mut round in service.rounds() {
        tokio::select! {
            waited = round.wait_for(|completed| *completed > 0) => {
                if waited.is_err() {
                    return;
                }
            }
            _ = draining.wait_for(|draining| *draining) => return,
        }
    }
    tokio::select! {
        waited = warmed.wait_for(|warm| *warm) => {
            if waited.is_err() {
                return;
            }
        }
        _ = draining.wait_for(|draining| *draining) => return,
    }
    // Lifecycles change when scrapes end: looking four times per freshness follows them closely.
    let every = (freshness / 4).clamp(Duration::from_millis(10), Duration::from_millis(250));
    let mut ready = false;
    loop {
        let can_route = service.can_route(Instant::now(), silent_after);
        if can_route != ready {
            ready = can_route;
            if ready {
                set_readiness(&reporter, &readiness, ServingStatus::Serving).await;
                tracing::info!("ready: every pool has had a scrape round and a worker answers");
            } else {
                set_readiness(&reporter, &readiness, ServingStatus::NotServing).await;
                tracing::warn!(
                    "not ready: no worker answers its scrapes; Envoy routes by its own load balancing"
                );
            }
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = draining.wait_for(|draining| *draining) => return,
        }
    }
}

/// The admin API and gRPC reflection, behind the bearer token when one is set.
fn add_debug(
    routes: &mut tonic::service::RoutesBuilder,
    service: &Arc<Service>,
    token: Option<BearerToken>,
) {
    let guard = transport::guard(token, Arc::clone(service));
    routes.add_service(InterceptedService::new(
        admin::server(Arc::clone(service)),
        guard.clone(),
    ));
    if let Some(reflection) = admin::reflection_v1() {
        routes.add_service(InterceptedService::new(reflection, guard.clone()));
    }
    if let Some(reflection) = admin::reflection_v1alpha() {
        routes.add_service(InterceptedService::new(reflection, guard));
    }
}

/// Serves ext_proc and health on `listener` until `shutdown` resolves, then drains: readiness is
/// withdrawn at once, requests are answered for `overload.shutdown_grace`, then the server stops.
pub async fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let ServeOptions {
        access,
        overload,
        feedback,
        freshness,
        silent_after,
        readiness,
        warmed,
    } = options;
    let Access { debug, token, tls } = access;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    set_readiness(&reporter, &readiness, ServingStatus::NotServing).await;
    let (drain, draining) = watch::channel(false);
    let follower_task = tokio::spawn(follow_readiness(
        reporter.clone(),
        readiness.clone(),
        Arc::clone(&service),
        (freshness, silent_after),
        warmed,
        draining,
    ));
    // A BUFFERED body arrives in one message: the decode limit follows max_body_bytes (tonic's 4 MiB
    // default would fail larger prompts before cachepick could answer 413 or route them).
    let max_message = service.max_body_bytes().saturating_add(MESSAGE_OVERHEAD);
    // EDS for Envoy's workers cluster: the roster the picker routes over, pushed on every change.
    let (assignments, follower) = eds::follow(service.picker().loads().cloned().collect());
    // Followers of the response phase let go once the drain's grace has passed (`served`).
    let (stop_following, following) = watch::channel(false);
    let follow = served::Follow {
        wait: feedback.enabled.then_some(feedback.wait),
        stopped: following,
    };
    let processor = ExternalProcessorServer::new(process::Processor::new(
        Arc::clone(&service),
        overload.stream_deadline,
        follow,
    ))
    .max_decoding_message_size(max_message);
    let grace = overload.shutdown_grace;
    let mut routes = tonic::service::Routes::builder();
    routes
        .add_service(health)
        .add_service(processor)
        .add_service(eds::server(assignments));
    if debug {
        add_debug(&mut routes, &service, token);
    }
    let routes = routes.routes().prepare();
    let shutdown = async move {
        shutdown.await;
        // Withdraw readiness first and keep answering: Envoy's health check sees NOT_SERVING and
        // moves new requests to other replicas before this one stops.
        let _ = drain.send(true);
        set_readiness(&reporter, &readiness, ServingStatus::NotServing).await;
        tracing::info!(
            grace_seconds = grace.as_secs_f64(),
            "draining: readiness withdrawn, answering until the grace ends"
        );
        tokio::time::sleep(grace).await;
        let _ = stop_following.send(true);
        // An EDS stream lasts as long as Envoy does, and the graceful shutdown waits for every
        // stream: stopping the roster's follower ends them (Envoy moves to another replica).
        drop(follower);
    };
    let bounds = listener::Bounds::new(
        &overload,
        (HTTP2_KEEPALIVE_INTERVAL, HTTP2_KEEPALIVE_TIMEOUT),
    );
    match tls {
        None => {
            // TCP_NODELAY: an answer is one small frame; without it, Nagle holds that frame until
            // Envoy's delayed ACK (40 ms on Linux), which measured as a 40 ms stall on every decision.
            let incoming = tonic::transport::server::TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(TCP_KEEPALIVE));
            listener::serve(incoming, routes, bounds, service, shutdown).await;
        }
        Some(tls) => {
            let refresh = tokio::spawn(transport::refresh(Arc::clone(&tls), Arc::clone(&service)));
            let incoming = transport::tls_incoming(listener, tls, Arc::clone(&service));
            listener::serve(incoming, routes, bounds, Arc::clone(&service), shutdown).await;
            refresh.abort();
        }
    }
    follower_task.abort();
    Ok(())
}

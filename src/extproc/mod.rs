//! The gRPC face of cachepick on `listen`: the Envoy ext_proc service, EDS for Envoy's workers cluster
//! (`eds.rs`) and gRPC health.
//!
//! This is the only module that sees protobuf and tonic types; everything it hands inward is a plain
//! domain type, and everything it sends out is built here from a domain outcome.
//!
//! Health follows the Endpoint Picker Protocol's service names: `liveness` is SERVING while the process
//! runs; `readiness` and the ext_proc service turn SERVING once every pool has completed a scrape round,
//! so a gateway never routes through a picker that has not seen the fleet's load yet.

mod admin;
pub mod eds;
mod process;
mod transport;

/// The generated `cachepick.v1` admin API (messages, server, client), for tests and Rust tools.
pub use admin::pb as admin_api;

use std::future::Future;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
pub use process::MAX_STREAMED_CHUNK;
pub use transport::{HANDSHAKE_TIMEOUT, MAX_PENDING_HANDSHAKES};

use thiserror::Error;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::auth::BearerToken;
/// The wire names, defined in [`crate::protocol`]; re-exported here for the callers that speak
/// ext_proc (tests, the demo, replay).
pub use crate::protocol::{
    DECISION_HEADER, DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, LIVENESS, PREFIX_TOKENS_HEADER,
    READINESS, REJECT_HEADER, SELECTED_HEADER, SUBSET_KEY, SUBSET_NAMESPACE,
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

/// Readiness and the ext_proc service's health (what Envoy's health check asks) change together.
async fn set_readiness(reporter: &HealthReporter, status: ServingStatus) {
    for service in [READINESS, EXT_PROC_SERVICE] {
        reporter.set_service_status(service, status).await;
    }
}

/// Serves ext_proc and health on `listener` until `shutdown` resolves.
///
/// `access` says whether the admin API and reflection are served, behind which token, and whether
/// connections are TLS.
pub async fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    access: Access,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let Access { debug, token, tls } = access;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    set_readiness(&reporter, ServingStatus::NotServing).await;
    let rounds = service.rounds();
    let readiness = tokio::spawn(async move {
        // Ready once every pool has completed a scrape round; a pool whose scraper is gone never is.
        for mut round in rounds {
            if round.wait_for(|completed| *completed > 0).await.is_err() {
                return;
            }
        }
        set_readiness(&reporter, ServingStatus::Serving).await;
        tracing::info!("ready: every pool has a scrape round");
    });
    // A BUFFERED body arrives in one message: the decode limit follows max_body_bytes (tonic's 4 MiB
    // default would fail larger prompts before cachepick could answer 413 or route them).
    let max_message = service.max_body_bytes().saturating_add(MESSAGE_OVERHEAD);
    // EDS for Envoy's workers cluster: the roster the picker routes over, pushed on every change.
    let (assignments, follower) = eds::follow(service.picker().loads().cloned().collect());
    let processor = ExternalProcessorServer::new(process::Processor::new(Arc::clone(&service)))
        .max_decoding_message_size(max_message);
    let guard = transport::guard(token, Arc::clone(&service));
    let admin =
        debug.then(|| InterceptedService::new(admin::server(Arc::clone(&service)), guard.clone()));
    let reflection_v1 = admin::reflection_v1()
        .filter(|_| debug)
        .map(|reflection| InterceptedService::new(reflection, guard.clone()));
    let reflection_v1alpha = admin::reflection_v1alpha()
        .filter(|_| debug)
        .map(|reflection| InterceptedService::new(reflection, guard));
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(processor)
        .add_service(eds::server(assignments))
        .add_optional_service(admin)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha);
    let shutdown = async move {
        shutdown.await;
        // An EDS stream lasts as long as Envoy does, and the graceful shutdown waits for every
        // stream: stopping the roster's follower ends them (Envoy moves to another replica).
        drop(follower);
    };
    let served = match tls {
        None => {
            // TCP_NODELAY: an answer is one small frame; without it, Nagle holds that frame until
            // Envoy's delayed ACK (40 ms on Linux), which measured as a 40 ms stall on every decision.
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(tls) => {
            let refresh = tokio::spawn(transport::refresh(Arc::clone(&tls), Arc::clone(&service)));
            let incoming = transport::tls_incoming(listener, tls, Arc::clone(&service));
            let served = router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await;
            refresh.abort();
            served
        }
    };
    readiness.abort();
    Ok(served?)
}

//! The gRPC face of cachepick on `listen`: the Envoy ext_proc service and gRPC health.
//!
//! This is the only module that sees protobuf and tonic types; everything it hands inward is a plain
//! domain type, and everything it sends out is built here from a domain outcome.
//!
//! Health follows the Endpoint Picker Protocol's service names: `liveness` is SERVING while the process
//! runs; `readiness` and the ext_proc service report NOT_SERVING until the processor is wired to load
//! data, so that a gateway never routes through a picker that cannot decide yet.

use std::future::Future;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::ServingStatus;

/// gRPC health service names, as the Gateway API Inference Extension expects them.
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    reporter
        .set_service_status(READINESS, ServingStatus::NotServing)
        .await;
    reporter
        .set_service_status(EXT_PROC_SERVICE, ServingStatus::NotServing)
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}

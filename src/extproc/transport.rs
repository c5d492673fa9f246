//! How connections reach the gRPC services on `listen`: plain TCP, or TLS accepted here with rustls
//! (mTLS when a client CA is configured), and the bearer token in front of the admin API.
//!
//! TLS handshakes run beside the accept loop, each bounded in time and in number, so a client that
//! connects and never finishes its handshake (or speaks plain text) costs one short-lived task and
//! delays nobody. Each handshake uses the configuration current when it starts; [`refresh`] re-reads the
//! certificate files so a rotated certificate reaches new connections without a restart.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status};

use crate::auth::BearerToken;
use crate::metrics::DebugListener;
use crate::route::Service;
use crate::tls::ServerTls;

/// A client has this long from its TCP connection to a completed handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; a connection beyond them is closed at once. Envoy opens a handful of
/// connections per worker thread, so only a flood of stalled clients ever reaches this.
pub const MAX_PENDING_HANDSHAKES: usize = 128;

/// Completed handshakes waiting for tonic to take them.
const HANDED_OVER: usize = 64;
/// The pause after a failed accept (out of file descriptors, say), and the least time between two logs.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);
const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Accepts on `listener` and completes TLS handshakes with `tls`'s current configuration; the stream
/// yields each connection once it is encrypted. Ends, closing the listener, when the stream is dropped.
pub(super) fn tls_incoming(
    listener: TcpListener,
    tls: Arc<ServerTls>,
    service: Arc<Service>,
) -> ReceiverStream<Result<TlsStream<TcpStream>, io::Error>> {
    let (sender, receiver) = mpsc::channel(HANDED_OVER);
    let pending = Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES));
    tokio::spawn(async move {
        let mut last_logged: Option<Instant> = None;
        loop {
            let accepted = tokio::select! {
                () = sender.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    if last_logged.is_none_or(|at| at.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL) {
                        tracing::warn!(%error, "ext_proc listener accept failed");
                        last_logged = Some(Instant::now());
                    }
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&pending).try_acquire_owned() else {
                service.metrics().tls_handshake_failed();
                drop(stream);
                continue;
            };
            // TCP_NODELAY: an answer is one small frame; without it, Nagle holds it until Envoy's
            // delayed ACK (40 ms on Linux).
            let _ = stream.set_nodelay(true);
            let acceptor = TlsAcceptor::from(tls.config());
            let sender = sender.clone();
            let service = Arc::clone(&service);
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                drop(permit);
                match handshake {
                    Ok(Ok(stream)) => {
                        let _ = sender.send(Ok(stream)).await;
                    }
                    Ok(Err(error)) => {
                        service.metrics().tls_handshake_failed();
                        tracing::debug!(%error, "TLS handshake on listen failed");
                    }
                    Err(_) => {
                        service.metrics().tls_handshake_failed();
                        tracing::debug!("TLS handshake on listen timed out");
                    }
                }
            });
        }
    });
    ReceiverStream::new(receiver)
}

/// Re-reads the certificate files every `tls.reload_interval` until aborted.
pub(super) async fn refresh(tls: Arc<ServerTls>, service: Arc<Service>) {
    let mut ticks = tokio::time::interval(tls.files().reload_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let files = tls.files().clone();
        let outcome = tokio::task::spawn_blocking({
            let tls = Arc::clone(&tls);
            move || tls.refresh()
        })
        .await;
        match outcome {
            Ok(Ok(false)) => {}
            Ok(Ok(true)) => {
                service.metrics().tls_reloaded(true);
                tracing::info!(cert_file = %files.cert_file.display(), "listen's TLS certificate reloaded");
            }
            Ok(Err(error)) => {
                service.metrics().tls_reloaded(false);
                tracing::warn!(%error, "listen's TLS files changed but cannot be used; the previous certificate stays");
            }
            Err(error) => tracing::warn!(%error, "re-reading listen's TLS files failed"),
        }
    }
}

/// The admin API's and reflection's gate: with a token, a call without `authorization: Bearer <token>`
/// is refused UNAUTHENTICATED before it reaches the service.
pub(super) fn guard(
    token: Option<BearerToken>,
    service: Arc<Service>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + Send + Sync + 'static {
    move |request: Request<()>| {
        let Some(token) = &token else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .map(|value| value.as_bytes());
        if token.admits(given) {
            Ok(request)
        } else {
            service.metrics().debug_unauthorized(DebugListener::Grpc);
            Err(Status::unauthenticated(
                "the admin API requires authorization: Bearer <token> (debug_token_file)",
            ))
        }
    }
}

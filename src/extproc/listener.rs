//! The gRPC listener's connections, served here with hyper's HTTP/2 server over tonic's routes, so that
//! each connection can be closed gracefully on its own: when it has held no stream for
//! `overload.idle_timeout`, when it opened none within `overload.first_stream_timeout`, or when a
//! newcomer at `overload.max_connections` needs its place and it is the one idle longest
//! (`crate::connections`). tonic's own server closes connections only by age or at shutdown, so a
//! client that connects, answers pings and never opens a stream would hold its place forever, and a
//! cap full of them would lock Envoy, `grpc_health_probe` and the kubelet out.
//!
//! A close is HTTP/2's graceful one: GOAWAY, then the connection ends once its streams have (a stream
//! the client opened as the GOAWAY crossed it is still answered). A peer that does not finish the
//! close within [`CLOSE_GRACE`] with no stream open is cut; one whose stream outlives
//! `overload.stream_deadline` after the close began is cut then.
//!
//! With every connection holding a stream the cap works as before: the next connection waits
//! (accepted, then held) until one ends or goes idle.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tonic::body::Body;
use tonic::codegen::Service as TowerService;
use tonic::service::Routes;
use tonic::transport::server::Connected;

use crate::config::OverloadConfig;
use crate::connections::{CloseReason, Conn, Guarded, IdleLimits, Registry};
use crate::route::Service;

/// How long a closing connection's peer has to finish the GOAWAY exchange (one round trip) once no
/// stream is open.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// The pause after a failed accept.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// How the listener serves and bounds its connections.
pub(super) struct Bounds {
    pub max_connections: usize,
    pub limits: IdleLimits,
    /// The longest a closing connection may keep a stream open.
    pub stream_deadline: Duration,
    pub max_concurrent_streams: u32,
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
}

impl Bounds {
    pub fn new(overload: &OverloadConfig, keepalive: (Duration, Duration)) -> Bounds {
        Bounds {
            max_connections: overload.max_connections.get(),
            limits: IdleLimits {
                idle: Some(overload.idle_timeout),
                first_stream: Some(overload.first_stream_timeout),
            },
            stream_deadline: overload.stream_deadline,
            max_concurrent_streams: overload.max_concurrent_streams.get(),
            keepalive_interval: keepalive.0,
            keepalive_timeout: keepalive.1,
        }
    }
}

/// Serves `routes` on every connection `incoming` yields until `shutdown` resolves; then stops
/// accepting (dropping `incoming` closes the listener), closes every connection gracefully and waits
/// for their streams to end.
pub(super) async fn serve<I, IO>(
    incoming: I,
    routes: Routes,
    bounds: Bounds,
    service: Arc<Service>,
    shutdown: impl Future<Output = ()>,
) where
    I: Stream<Item = std::io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let registry = Registry::new(bounds.max_connections);
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(bounds.max_concurrent_streams)
        .keep_alive_interval(bounds.keepalive_interval)
        .keep_alive_timeout(bounds.keepalive_timeout);
    let shared = Arc::new(Shared {
        builder,
        routes,
        limits: bounds.limits,
        stream_deadline: bounds.stream_deadline,
        open: service.metrics().overload.connections.clone(),
        service,
    });
    let (stop, stopping) = watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    {
        let incoming = incoming;
        tokio::pin!(incoming);
        tokio::pin!(shutdown);
        loop {
            while connections.try_join_next().is_some() {}
            let io = tokio::select! {
                () = &mut shutdown => break,
                next = incoming.next() => match next {
                    Some(Ok(io)) => io,
                    Some(Err(error)) => {
                        // Out of file descriptors (EMFILE) and the like fail again at once: a pause
                        // keeps the loop from spinning a core and flooding the log.
                        tracing::warn!(%error, "accepting a gRPC connection failed");
                        tokio::select! {
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(ACCEPT_ERROR_BACKOFF) => continue,
                        }
                    }
                    None => break,
                },
            };
            // At the cap the connection idle longest makes room; with every one busy, this waits.
            let place = tokio::select! {
                () = &mut shutdown => break,
                place = registry.admit() => place,
            };
            let shared = Arc::clone(&shared);
            let stopping = stopping.clone();
            connections.spawn(async move {
                connection(io, place.conn(), &shared, stopping).await;
                drop(place);
            });
        }
    }
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

/// What every connection's task reads.
struct Shared {
    builder: http2::Builder<TokioExecutor>,
    routes: Routes,
    limits: IdleLimits,
    stream_deadline: Duration,
    open: IntGauge,
    service: Arc<Service>,
}

/// Why a connection's task stopped serving it normally.
enum Ending {
    /// The peer closed it, or it failed.
    Ended,
    Close(CloseReason),
    Shutdown,
}

async fn connection<IO>(
    io: IO,
    conn: &Arc<Conn>,
    shared: &Shared,
    mut stopping: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    shared.open.inc();
    let service = Tracked {
        routes: shared.routes.clone(),
        conn: Arc::clone(conn),
        info: io.connect_info(),
    };
    let served = shared.builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(served);
    let ending = tokio::select! {
        ended = served.as_mut() => {
            if let Err(error) = ended {
                tracing::debug!(%error, "gRPC connection ended with an error");
            }
            Ending::Ended
        }
        reason = conn.closed_for(shared.limits) => Ending::Close(reason),
        _ = stopping.wait_for(|stop| *stop) => Ending::Shutdown,
    };
    match ending {
        Ending::Ended => {}
        Ending::Shutdown => {
            served.as_mut().graceful_shutdown();
            let _ = served.await;
        }
        Ending::Close(reason) => {
            shared.service.metrics().overload.connection_closed(reason);
            tracing::debug!(
                reason = reason.as_str(),
                "closing a gRPC connection that holds no stream"
            );
            served.as_mut().graceful_shutdown();
            tokio::select! {
                _ = served.as_mut() => {}
                () = conn.quiet_after(CLOSE_GRACE) => {}
                () = tokio::time::sleep(shared.stream_deadline.max(CLOSE_GRACE)) => {}
            }
        }
    }
    shared.open.dec();
}

/// tonic's routes for one connection: each request is a stream of that connection, open until its
/// response body is done with; the connection's details go into the request's extensions (as tonic's
/// server puts them, for `Request::remote_addr`).
#[derive(Clone)]
struct Tracked<Info> {
    routes: Routes,
    conn: Arc<Conn>,
    info: Info,
}

impl<Info: Clone + Send + Sync + 'static> hyper::service::Service<Request<Incoming>>
    for Tracked<Info>
{
    type Response = Response<Guarded<Body>>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>,
    >;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        let stream = self.conn.stream_opened();
        request.extensions_mut().insert(self.info.clone());
        let mut routes = self.routes.clone();
        Box::pin(async move {
            // tonic's routes are always ready: they route by path, and each service is cloned per call.
            std::future::poll_fn(|context: &mut Context<'_>| {
                TowerService::<Request<Incoming>>::poll_ready(&mut routes, context)
            })
            .await?;
            let response = routes.call(request).await?;
            Ok(response.map(|body| Guarded::new(body, stream)))
        })
    }
}

//! The HTTP endpoint on `metrics_listen`: Prometheus `/metrics` and the debug endpoints.
//!
//! - `GET /metrics`: the text exposition of every cachepick metric.
//! - `GET /livez`: 200 while the process serves; `GET /readyz`: 200 while the picker is ready (the gRPC
//!   `readiness` service's status), 503 otherwise. The kubelet's probes use these: this listener's
//!   bounds are its own, so clients that fill `listen` cannot make a probe fail, and they need no TLS
//!   when `listen` has it.
//! - `GET /debug/snapshot`: every pool's current load snapshot as cachepick sees it (JSON).
//! - `POST /debug/explain?path=/v1/chat/completions`: how the posted body would be routed now, against
//!   the live owner index and load, without routing it (JSON; the refusal's status and body otherwise).
//!
//! The debug endpoints describe the fleet (workers, their load, what they cache) and the routing of
//! arbitrary prompts, which is why the listener is bound to loopback by default
//! (`metrics_listen: 127.0.0.1:9090`): it is for the operator, not for clients of the gateway. They exist
//! only when a [`DebugSource`] is given; otherwise they answer 404.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

use cachepick_decode::duration;

use crate::auth::BearerToken;
use crate::config::HttpLimits;
use crate::connections::{CloseReason, Conn, Guarded, IdleLimits, Place, Registry};
use crate::health::Readiness;
use crate::metrics::{DebugListener, HttpRefusal, Metrics};
use crate::protocol::error_json;

/// An explanation being worked out: Ok = 200 JSON; Err((status, json body)) = the refusal.
pub type ExplainFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Vec<u8>, (u16, Vec<u8>)>> + Send>>;

/// What the debug endpoints read; `app` adapts the request service to it.
pub trait DebugSource: Send + Sync + 'static {
    /// `GET /debug/config`: the running configuration as YAML, every key with its effective value
    /// (defaults, flags and the last applied reload included), secrets redacted.
    fn config_yaml(&self) -> Vec<u8>;
    /// `GET /debug/snapshot`: JSON of every pool's current load snapshot as cachepick sees it, and its
    /// admission state.
    fn snapshot_json(&self) -> Vec<u8>;
    /// `POST /debug/explain?path=/v1/chat/completions`: how this body would be routed now, without
    /// routing it. The source runs it through the decisions' admission (its own share of blocking
    /// threads, rate-limited: 429 over the rate), never on the runtime.
    /// `headers` are the call's own: its `content-encoding` and tenant header are the explained
    /// request's.
    fn explain_json(&self, path: String, headers: &HeaderMap, body: Bytes) -> ExplainFuture;
    /// Request bodies larger than this get 413 before they are read whole.
    fn max_body_bytes(&self) -> usize;
}

/// The API path `/debug/explain` assumes when the query names none.
const DEFAULT_EXPLAIN_PATH: &str = "/v1/chat/completions";

/// The pause after a failed accept, and the least time between two logs of one.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);
const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(1);

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";
const YAML: &str = "application/yaml";
const EXPOSITION: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Who may use what on `metrics_listen`, and the listener's bounds.
#[derive(Clone)]
pub struct Access {
    /// The debug endpoints' source; `None` answers 404 on `/debug/*`.
    pub debug: Option<Arc<dyn DebugSource>>,
    /// When set, `/debug/*` requires `authorization: Bearer <token>`; `/metrics` stays open.
    pub token: Option<BearerToken>,
    pub limits: HttpLimits,
    /// What `/readyz` answers.
    pub readiness: Readiness,
}

/// What every connection's service reads.
struct Shared {
    metrics: Arc<Metrics>,
    debug: Option<Arc<dyn DebugSource>>,
    token: Option<BearerToken>,
    limits: HttpLimits,
    readiness: Readiness,
}

/// Serves `/metrics` (and, with a debug source, `/debug/*`) on `listener` until `shutdown` resolves.
///
/// HTTP/1.1 only (Prometheus, curl and the CLI speak it): HTTP/2 has no header-read timeout to bound an
/// idle or slow client with. At most `limits.max_connections` connections are open at once. At the cap,
/// the connection that has waited longest for a request's headers is closed to make room (slow clients
/// holding every place would otherwise refuse every scrape and probe), so a newcomer that sends its
/// request at once is served; only when every connection has a request in progress is the newcomer
/// accepted and closed at once rather than left in the kernel's backlog (it fails fast instead of timing
/// out, and costs a file descriptor for an instant). Every connection is bounded in time: its headers by `header_read_timeout` (which also closes an
/// idle keep-alive connection), each request by `request_timeout` (a body trickled slowly included), and
/// the connection as a whole by `connection_lifetime`.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    access: Access,
    shutdown: impl Future<Output = ()>,
) {
    let Access {
        debug,
        token,
        limits,
        readiness,
    } = access;
    let shared = Arc::new(Shared {
        metrics,
        debug,
        token,
        limits,
        readiness,
    });
    let registry = Registry::new(limits.max_connections.get());
    tokio::pin!(shutdown);
    let mut last_logged: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors (EMFILE) and the like: accept fails again at once, so
                // retrying without a pause would spin a core and flood the log.
                if last_logged.is_none_or(|at| at.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL) {
                    tracing::warn!(%error, "metrics listener accept failed");
                    last_logged = Some(Instant::now());
                }
                tokio::select! {
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(ACCEPT_ERROR_BACKOFF) => continue,
                }
            }
        };
        let Some(place) = registry.try_admit() else {
            shared.metrics.http_refused(HttpRefusal::ConnectionCap);
            drop(stream);
            continue;
        };
        tokio::spawn(connection(stream, place, Arc::clone(&shared)));
    }
}

/// One connection, within its bounds; `place` is its place under the connection cap.
async fn connection(stream: TcpStream, place: Place, shared: Arc<Shared>) {
    let open = shared.metrics.http_connections().clone();
    open.inc();
    let limits = shared.limits;
    let conn: Arc<Conn> = Arc::clone(place.conn());
    let service = service_fn({
        let shared = Arc::clone(&shared);
        let conn = Arc::clone(&conn);
        move |request| {
            let shared = Arc::clone(&shared);
            // From its headers to the end of its answer a request is in progress: the connection is
            // not one to close at the cap.
            let stream = conn.stream_opened();
            async move {
                let answer = tokio::time::timeout(limits.request_timeout, route(request, &shared));
                let response = match answer.await {
                    Ok(response) => response,
                    Err(_) => {
                        shared.metrics.http_refused(HttpRefusal::RequestTimeout);
                        let mut response = error(
                            StatusCode::REQUEST_TIMEOUT,
                            "request_timeout",
                            &format!(
                                "the request was not received and answered within {} (metrics_http.request_timeout)",
                                duration::format(limits.request_timeout)
                            ),
                        );
                        response
                            .headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                        response
                    }
                };
                Ok::<_, Infallible>(response.map(|body| Guarded::new(body, stream)))
            }
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        reason = conn.closed_for(IdleLimits::default()) => {
            // Only eviction ends a wait here: the header timeout is hyper's.
            if reason == CloseReason::Evicted {
                shared.metrics.http_refused(HttpRefusal::Evicted);
            }
            Ok(())
        }
        () = tokio::time::sleep(limits.connection_lifetime) => {
            shared.metrics.http_refused(HttpRefusal::Lifetime);
            // The request in progress, if any, may finish; none follows it.
            connection.as_mut().graceful_shutdown();
            tokio::time::timeout(limits.request_timeout, connection.as_mut())
                .await
                .unwrap_or(Ok(()))
        }
    };
    if let Err(error) = ended {
        if error.is_timeout() {
            shared.metrics.http_refused(HttpRefusal::HeaderTimeout);
        }
        tracing::debug!(%error, "metrics connection ended with an error");
    }
    open.dec();
    drop(place);
}

async fn route(request: Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let method = request.method();
    let debug = shared.debug.clone();
    let path = request.uri().path();
    if debug.is_some()
        && path.starts_with("/debug/")
        && let Some(token) = &shared.token
        && !token.admits(
            request
                .headers()
                .get(header::AUTHORIZATION)
                .map(HeaderValue::as_bytes),
        )
    {
        shared.metrics.debug_unauthorized(DebugListener::Http);
        let mut response = error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the debug endpoints require authorization: Bearer <token> (debug_token_file)",
        );
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    match (path, debug) {
        // `/healthz` is the name many load balancers probe by default; it means what `/livez` does.
        ("/livez" | "/healthz", _) => {
            if method == Method::GET {
                respond(StatusCode::OK, TEXT, Bytes::from_static(b"live\n"))
            } else {
                not_allowed("GET")
            }
        }
        ("/readyz", _) => {
            if method != Method::GET {
                not_allowed("GET")
            } else if shared.readiness.is_ready() {
                respond(StatusCode::OK, TEXT, Bytes::from_static(b"ready\n"))
            } else {
                respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    Bytes::from_static(b"not ready\n"),
                )
            }
        }
        ("/metrics", _) => {
            if method == Method::GET {
                respond(StatusCode::OK, EXPOSITION, shared.metrics.render().into())
            } else {
                not_allowed("GET")
            }
        }
        ("/debug/config", Some(debug)) => {
            if method == Method::GET {
                respond(StatusCode::OK, YAML, debug.config_yaml().into())
            } else {
                not_allowed("GET")
            }
        }
        ("/debug/snapshot", Some(debug)) => {
            if method == Method::GET {
                respond(StatusCode::OK, JSON, debug.snapshot_json().into())
            } else {
                not_allowed("GET")
            }
        }
        ("/debug/explain", Some(debug)) => {
            if method == Method::POST {
                explain(request, debug).await
            } else {
                not_allowed("POST")
            }
        }
        (path, None) if path.starts_with("/debug/") => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "the debug endpoints are not enabled in this process",
        ),
        _ => respond(
            StatusCode::NOT_FOUND,
            TEXT,
            Bytes::from_static(b"not found\n"),
        ),
    }
}

/// `POST /debug/explain`: checks the query and the body's size, then asks the source (which runs it
/// through admission, off the runtime: tokenizing a long prompt is CPU work).
async fn explain(request: Request<Incoming>, debug: Arc<dyn DebugSource>) -> Response<Full<Bytes>> {
    let path = match explain_path(request.uri().query()) {
        Ok(path) => path.to_owned(),
        Err(message) => return error(StatusCode::BAD_REQUEST, "invalid_path", &message),
    };
    let limit = debug.max_body_bytes();
    let headers = request.headers().clone();
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > u64::try_from(limit).unwrap_or(u64::MAX)) {
        return too_large(limit);
    }
    let body = match Limited::new(request.into_body(), limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(cause) if cause.downcast_ref::<LengthLimitError>().is_some() => {
            return too_large(limit);
        }
        Err(cause) => {
            return error(
                StatusCode::BAD_REQUEST,
                "body_read_error",
                &format!("cannot read the request body: {cause}"),
            );
        }
    };
    match debug.explain_json(path, &headers, body).await {
        Ok(json) => respond(StatusCode::OK, JSON, json.into()),
        Err((status, json)) => respond(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            JSON,
            json.into(),
        ),
    }
}

/// The `path` query parameter (the API path the body is for), `/v1/chat/completions` without one.
fn explain_path(query: Option<&str>) -> Result<&str, String> {
    let path = query
        .into_iter()
        .flat_map(|query| query.split('&'))
        .find_map(|pair| pair.strip_prefix("path="))
        .unwrap_or(DEFAULT_EXPLAIN_PATH);
    if path.starts_with('/') {
        Ok(path)
    } else {
        Err(format!(
            "the path query parameter must be an API path starting with '/', got {path:?}"
        ))
    }
}

fn too_large(limit: usize) -> Response<Full<Bytes>> {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        &format!("the request body is larger than {limit} bytes"),
    )
}

fn not_allowed(allow: &'static str) -> Response<Full<Bytes>> {
    let mut response = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        &format!("this endpoint answers {allow} only"),
    );
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    response
}

/// A JSON error in cachepick's (OpenAI's) shape: `{"error": {"message", "type"}}`.
fn error(status: StatusCode, kind: &str, message: &str) -> Response<Full<Bytes>> {
    respond(status, JSON, error_json(kind, message).into())
}

fn respond(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use http::HeaderMap;
    use http_body_util::StreamBody;
    use http_body_util::combinators::BoxBody;
    use hyper::body::Frame;
    use tokio::net::TcpStream;

    use super::*;

    /// Echoes what it was asked; refuses bodies that are exactly `refuse`.
    #[derive(Default)]
    struct Fake {
        paths: Mutex<Vec<String>>,
    }

    impl DebugSource for Fake {
        fn config_yaml(&self) -> Vec<u8> {
            b"listen: 127.0.0.1:9002\n".to_vec()
        }

        fn snapshot_json(&self) -> Vec<u8> {
            br#"{"pools":[{"pool":"m","workers":2}]}"#.to_vec()
        }

        fn explain_json(&self, path: String, _headers: &HeaderMap, body: Bytes) -> ExplainFuture {
            self.paths.lock().unwrap().push(path.clone());
            let answer = if body.as_ref() == b"refuse" {
                Err((
                    404,
                    br#"{"error":{"message":"no","type":"unknown_model"}}"#.to_vec(),
                ))
            } else {
                let echo = serde_json::json!({ "path": path, "bytes": body.len() });
                Ok(serde_json::to_vec(&echo).unwrap())
            };
            Box::pin(std::future::ready(answer))
        }

        fn max_body_bytes(&self) -> usize {
            64
        }
    }

    async fn start(debug: Option<Arc<dyn DebugSource>>) -> SocketAddr {
        start_with(debug, HttpLimits::default()).await
    }

    async fn start_with(debug: Option<Arc<dyn DebugSource>>, limits: HttpLimits) -> SocketAddr {
        start_ready(debug, limits, Readiness::default()).await
    }

    async fn start_ready(
        debug: Option<Arc<dyn DebugSource>>,
        limits: HttpLimits,
        readiness: Readiness,
    ) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new().unwrap());
        let access = Access {
            debug,
            token: None,
            limits,
            readiness,
        };
        tokio::spawn(serve(listener, metrics, access, std::future::pending()));
        addr
    }

    struct Reply {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    }

    impl Reply {
        fn json(&self) -> serde_json::Value {
            assert_eq!(self.headers[header::CONTENT_TYPE], JSON);
            serde_json::from_slice(&self.body).unwrap()
        }
    }

    async fn call(
        addr: SocketAddr,
        method: Method,
        uri: &str,
        body: BoxBody<Bytes, Infallible>,
    ) -> Reply {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::HOST, addr.to_string())
            .body(body)
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    }

    fn full(body: &'static [u8]) -> BoxBody<Bytes, Infallible> {
        Full::new(Bytes::from_static(body)).boxed()
    }

    /// A body without a length: sent chunked, so only the `Limited` reader can catch its size.
    fn chunked(chunks: usize, size: usize) -> BoxBody<Bytes, Infallible> {
        let frames = (0..chunks).map(move |_| Ok(Frame::data(Bytes::from(vec![b'x'; size]))));
        StreamBody::new(futures_util::stream::iter(frames)).boxed()
    }

    #[tokio::test]
    async fn metrics_and_snapshot() {
        let addr = start(Some(Arc::new(Fake::default()))).await;
        let reply = call(addr, Method::GET, "/metrics", full(b"")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.headers[header::CONTENT_TYPE], EXPOSITION);
        assert!(
            std::str::from_utf8(&reply.body)
                .unwrap()
                .contains("cachepick_build_info")
        );

        let reply = call(addr, Method::GET, "/debug/snapshot", full(b"")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.json()["pools"][0]["pool"], "m");

        let reply = call(addr, Method::GET, "/debug/config", full(b"")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.headers[header::CONTENT_TYPE], YAML);
        assert_eq!(&reply.body[..], b"listen: 127.0.0.1:9002\n");

        let reply = call(addr, Method::GET, "/nowhere", full(b"")).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn the_probes_follow_readiness() {
        let readiness = Readiness::default();
        let addr = start_ready(None, HttpLimits::default(), readiness.clone()).await;
        let reply = call(addr, Method::GET, "/readyz", full(b"")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        // Alive while not ready: liveness under both its names.
        for path in ["/livez", "/healthz"] {
            assert_eq!(
                call(addr, Method::GET, path, full(b"")).await.status,
                StatusCode::OK,
                "{path}"
            );
        }
        readiness.set(true);
        assert_eq!(
            call(addr, Method::GET, "/readyz", full(b"")).await.status,
            StatusCode::OK
        );
        assert_eq!(
            call(addr, Method::GET, "/livez", full(b"")).await.status,
            StatusCode::OK
        );
        let reply = call(addr, Method::POST, "/readyz", full(b"")).await;
        assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    }

    #[tokio::test]
    async fn explain_answers_and_passes_refusals_through() {
        let fake = Arc::new(Fake::default());
        let addr = start(Some(Arc::clone(&fake) as Arc<dyn DebugSource>)).await;

        let reply = call(
            addr,
            Method::POST,
            "/debug/explain",
            full(b"{\"model\":\"m\"}"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        let json = reply.json();
        assert_eq!(json["path"], DEFAULT_EXPLAIN_PATH);
        assert_eq!(json["bytes"], 13);

        let reply = call(
            addr,
            Method::POST,
            "/debug/explain?x=1&path=/v1/completions",
            full(b"{}"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.json()["path"], "/v1/completions");

        let reply = call(addr, Method::POST, "/debug/explain", full(b"refuse")).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND);
        assert_eq!(
            reply.body,
            Bytes::from_static(br#"{"error":{"message":"no","type":"unknown_model"}}"#)
        );

        assert_eq!(
            *fake.paths.lock().unwrap(),
            [
                DEFAULT_EXPLAIN_PATH,
                "/v1/completions",
                DEFAULT_EXPLAIN_PATH
            ]
        );

        let reply = call(
            addr,
            Method::POST,
            "/debug/explain?path=v1/completions",
            full(b"{}"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        assert_eq!(reply.json()["error"]["type"], "invalid_path");
        assert_eq!(
            fake.paths.lock().unwrap().len(),
            3,
            "a bad path never reaches the source"
        );
    }

    #[tokio::test]
    async fn explain_refuses_bodies_over_the_limit() {
        let fake = Arc::new(Fake::default());
        let addr = start(Some(Arc::clone(&fake) as Arc<dyn DebugSource>)).await;

        // Declared by Content-Length: refused before the body is read.
        let reply = call(addr, Method::POST, "/debug/explain", full(&[b'x'; 65])).await;
        assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(reply.json()["error"]["type"], "body_too_large");
        assert!(reply.json()["error"]["message"].is_string());

        // Chunked: cut off by the limited reader.
        let reply = call(addr, Method::POST, "/debug/explain", chunked(5, 16)).await;
        assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(reply.json()["error"]["type"], "body_too_large");

        // Exactly at the limit, chunked: accepted.
        let reply = call(addr, Method::POST, "/debug/explain", chunked(4, 16)).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.json()["bytes"], 64);
        assert_eq!(fake.paths.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn wrong_methods_get_405_with_allow() {
        let addr = start(Some(Arc::new(Fake::default()))).await;
        for (method, uri, allow) in [
            (Method::GET, "/debug/explain", "POST"),
            (Method::POST, "/debug/snapshot", "GET"),
            (Method::POST, "/debug/config", "GET"),
            (Method::POST, "/metrics", "GET"),
        ] {
            let reply = call(addr, method.clone(), uri, full(b"")).await;
            assert_eq!(
                reply.status,
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {uri}"
            );
            assert_eq!(reply.headers[header::ALLOW], allow, "{method} {uri}");
            assert_eq!(reply.json()["error"]["type"], "method_not_allowed");
        }
    }

    #[tokio::test]
    async fn without_a_source_debug_is_404_and_metrics_still_served() {
        let addr = start(None).await;
        for (method, uri) in [
            (Method::GET, "/debug/snapshot"),
            (Method::GET, "/debug/config"),
            (Method::POST, "/debug/explain"),
            (Method::GET, "/debug/explain"),
        ] {
            let reply = call(addr, method.clone(), uri, full(b"{}")).await;
            assert_eq!(reply.status, StatusCode::NOT_FOUND, "{method} {uri}");
            assert_eq!(reply.json()["error"]["type"], "not_found");
        }
        let reply = call(addr, Method::GET, "/metrics", full(b"")).await;
        assert_eq!(reply.status, StatusCode::OK);
    }

    /// The header-read timer also runs while a keep-alive connection waits for its next request, so an
    /// idle connection does not hold its slot.
    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_by_the_header_timeout() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let limits = HttpLimits {
            header_read_timeout: Duration::from_millis(300),
            ..HttpLimits::default()
        };
        let addr = start_with(None, limits).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: cachepick\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buffer = [0_u8; 4096];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match stream.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => answer.extend_from_slice(&buffer[..read]),
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "the idle connection stayed open");
        assert!(
            answer.starts_with(b"HTTP/1.1 200 OK"),
            "one answer, then the close"
        );
    }

    #[test]
    fn explain_path_defaults_and_checks() {
        assert_eq!(explain_path(None), Ok(DEFAULT_EXPLAIN_PATH));
        assert_eq!(explain_path(Some("a=b")), Ok(DEFAULT_EXPLAIN_PATH));
        assert_eq!(
            explain_path(Some("path=/v1/completions&a=b")),
            Ok("/v1/completions")
        );
        assert!(explain_path(Some("path=")).is_err());
        assert!(explain_path(Some("path=v1")).is_err());
    }
}

//! The overhead bench's worker: a real HTTP/1.1 server that reads each request body whole and answers a
//! short non-streamed chat completion at once, and serves a vLLM `/metrics` page (rendered by the
//! simulator's own exposition code) so cachepick can scrape it.
//!
//! Not a `cachepick-sim` worker: the simulator tokenizes every prompt whole (o200k), which on a 200 KB
//! body takes milliseconds — more than the proxy path being measured, and noisier — however small its
//! time scale. What is measured here is the path to the worker, so the worker does as little as a real
//! HTTP server can. Like the simulator it echoes the routing headers it received as `x-sim-echo-<name>`,
//! so the client sees what the gateway told it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use cachepick_sim::Engine;
use cachepick_sim::stats::RankStats;

/// What the worker answers every generation request with.
const COMPLETION: &str = r#"{"id":"chatcmpl-overhead","object":"chat.completion","created":0,"model":"overhead-model","choices":[{"index":0,"message":{"role":"assistant","content":"A worker that holds the prefix skips its prefill."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":11,"total_tokens":12}}"#;

/// A running worker; stops when dropped.
pub struct Worker {
    addr: SocketAddr,
    served: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Worker {
    /// Binds `addr` (a loopback address with a concrete port) and serves until dropped.
    pub async fn start(addr: SocketAddr, model: &str) -> std::io::Result<Worker> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let metrics = Bytes::from(cachepick_sim::expo::render_metrics(
            Engine::Vllm,
            model,
            &[RankStats {
                kv_total_blocks: 8_192,
                block_size: 16,
                max_running: 64,
                ..RankStats::default()
            }],
        ));
        let served = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(serve(listener, metrics, Arc::clone(&served)));
        Ok(Worker { addr, served, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Generation requests answered so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, metrics: Bytes, served: Arc<AtomicU64>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let metrics = metrics.clone();
        let served = Arc::clone(&served);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let metrics = metrics.clone();
                let served = Arc::clone(&served);
                async move { Ok::<_, Infallible>(answer(request, metrics, &served).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    request: Request<Incoming>,
    metrics: Bytes,
    served: &AtomicU64,
) -> Response<Full<Bytes>> {
    let echoed: Vec<(String, HeaderValue)> = request
        .headers()
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-gateway-") || name.starts_with("x-cachepick-")
        })
        .map(|(name, value)| (format!("x-sim-echo-{}", name.as_str()), value.clone()))
        .collect();
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => (StatusCode::OK, "text/plain; version=0.0.4", metrics),
        (&Method::GET, "/health") => (StatusCode::OK, "text/plain", Bytes::new()),
        (&Method::POST, _) => match request.into_body().collect().await {
            Ok(_) => {
                served.fetch_add(1, Ordering::Relaxed);
                (
                    StatusCode::OK,
                    "application/json",
                    Bytes::from_static(COMPLETION.as_bytes()),
                )
            }
            Err(_) => (StatusCode::BAD_REQUEST, "text/plain", Bytes::new()),
        },
        _ => (StatusCode::NOT_FOUND, "text/plain", Bytes::new()),
    };
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    for (name, value) in echoed {
        if let Ok(name) = http::HeaderName::from_bytes(name.as_bytes()) {
            headers.append(name, value);
        }
    }
    response
}

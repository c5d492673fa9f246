//! A stand-in inference engine for scraping tests: a real HTTP/1.1 server on loopback whose `/metrics`
//! (or any path) answers however the test sets it, switchable at run time.

#![allow(dead_code)] // each test binary uses a different part

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// How the engine answers.
#[derive(Clone, Debug)]
pub enum Mode {
    /// 200 with this body and content type.
    Body(&'static str, String),
    /// This status with a short text body.
    Status(u16),
    /// Accepts the request and never answers.
    Hang,
    /// 200 with `size` bytes of `#` comment lines, with or without a Content-Length.
    Huge { size: usize, declared: bool },
    /// Answers after a delay.
    Slow(Duration, String),
}

/// A running fake engine; stops when dropped.
pub struct FakeEngine {
    pub addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    hits: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FakeEngine {
    pub async fn start(mode: Mode) -> Self {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), mode).await
    }

    /// An engine on `addr` (any loopback IP and port; port 0 picks one).
    pub async fn start_at(addr: SocketAddr, mode: Mode) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let mode = Arc::new(Mutex::new(mode));
        let hits = Arc::new(AtomicUsize::new(0));
        let task = {
            let mode = Arc::clone(&mode);
            let hits = Arc::clone(&hits);
            tokio::spawn(async move {
                // Connections live in the accept task's set, so stopping the engine closes them too,
                // as a process that dies does: a client's kept-alive connection must not outlive it.
                let mut connections = tokio::task::JoinSet::new();
                loop {
                    while connections.try_join_next().is_some() {}
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let mode = Arc::clone(&mode);
                    let hits = Arc::clone(&hits);
                    connections.spawn(async move {
                        let service = service_fn(move |request: Request<Incoming>| {
                            let mode = mode.lock().unwrap().clone();
                            hits.fetch_add(1, Ordering::SeqCst);
                            async move { Ok::<_, Infallible>(answer(request, mode).await) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            })
        };
        FakeEngine {
            addr,
            mode,
            hits,
            task,
        }
    }

    pub fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// Requests received so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = BoxBody<Bytes, Infallible>;

async fn answer(_request: Request<Incoming>, mode: Mode) -> Response<Body> {
    let full = |text: String| Full::new(Bytes::from(text)).boxed();
    match mode {
        Mode::Body(content_type, text) => Response::builder()
            .header("content-type", content_type)
            .body(full(text))
            .unwrap(),
        Mode::Status(code) => Response::builder()
            .status(code)
            .body(full(format!("status {code}\n")))
            .unwrap(),
        Mode::Hang => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        Mode::Slow(delay, text) => {
            tokio::time::sleep(delay).await;
            Response::builder().body(full(text)).unwrap()
        }
        Mode::Huge { size, declared } => {
            let chunk = Bytes::from(
                "# filler line of a far too large exposition ...........\n".repeat(1024),
            );
            let chunks = size.div_ceil(chunk.len());
            let body = if declared {
                Full::new(Bytes::from(vec![b'#'; size])).boxed()
            } else {
                let frames = stream::iter((0..chunks).map(move |_| Ok(Frame::data(chunk.clone()))));
                StreamBody::new(frames).boxed()
            };
            Response::builder().body(body).unwrap()
        }
    }
}

/// An address on loopback where nothing listens: connecting is refused.
pub fn refused_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.local_addr().expect("local addr")
}

/// A vLLM exposition: one `(engine rank, waiting, running, kv usage)` per data-parallel engine, with the
/// HELP/TYPE lines, a histogram and the cache config a real server emits.
pub fn vllm_metrics(ranks: &[(u32, u64, u64, f64)]) -> String {
    let mut out = String::new();
    out.push_str("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n");
    vllm_gauge(
        &mut out,
        "num_requests_waiting",
        ranks,
        |(_, waiting, _, _)| format!("{waiting}.0"),
    );
    vllm_gauge(
        &mut out,
        "num_requests_running",
        ranks,
        |(_, _, running, _)| format!("{running}.0"),
    );
    vllm_gauge(
        &mut out,
        "kv_cache_usage_perc",
        ranks,
        |(_, _, _, usage)| usage.to_string(),
    );
    out.push_str("# TYPE vllm:cache_config_info gauge\n");
    for (rank, _, _, _) in ranks {
        out.push_str(&format!(
            "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",engine=\"{rank}\",num_gpu_blocks=\"1000\"}} 1.0\n"
        ));
    }
    out.push_str("# TYPE vllm:time_to_first_token_seconds histogram\n");
    for le in ["0.01", "0.1", "1.0", "+Inf"] {
        out.push_str(&format!(
            "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"{le}\",model_name=\"m\"}} 3.0\n"
        ));
    }
    out
}

/// One vLLM gauge with its TYPE line: a sample per rank, `value` read off the rank's tuple.
fn vllm_gauge(
    out: &mut String,
    name: &str,
    ranks: &[(u32, u64, u64, f64)],
    value: impl Fn(&(u32, u64, u64, f64)) -> String,
) {
    out.push_str(&format!("# TYPE vllm:{name} gauge\n"));
    for rank in ranks {
        out.push_str(&format!(
            "vllm:{name}{{engine=\"{}\",model_name=\"m\"}} {}\n",
            rank.0,
            value(rank)
        ));
    }
}

/// An SGLang exposition: one `(dp rank, queued, running)` per rank, repeated for a second TP rank that
/// must be ignored.
pub fn sglang_metrics(ranks: &[(u32, u64, u64)]) -> String {
    let mut out = String::new();
    for tp in ["0", "1"] {
        for (rank, queued, running) in ranks {
            let labels = format!("dp_rank=\"{rank}\",model_name=\"m\",tp_rank=\"{tp}\"");
            out.push_str(&format!("sglang:num_queue_reqs{{{labels}}} {queued}\n"));
            out.push_str(&format!("sglang:num_running_reqs{{{labels}}} {running}\n"));
            out.push_str(&format!("sglang:num_used_tokens{{{labels}}} 1000\n"));
            out.push_str(&format!("sglang:max_total_num_tokens{{{labels}}} 50000\n"));
            out.push_str(&format!("sglang:max_running_requests{{{labels}}} 128\n"));
        }
    }
    out
}

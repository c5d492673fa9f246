//! A simulated fleet: N workers on loopback, the cachepick configuration that fronts them, and a small
//! control endpoint to kill and restart workers (a crashed worker cannot answer its own admin routes).
//!
//! With `kv_events` on, worker `i`'s ranks publish on contiguous ports: free runs the workers probe
//! for themselves, or, from `kv_events.base_port`, a block of `dp_size` live ports followed (with
//! replay) by `dp_size` replay ports, worker after worker.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use cachepick_tokenizer::{TokenizeError, Tokenizer};

use crate::config::{Engine, SimConfig, Timing, TokenizerConfig};
use crate::server::{Disaggregation, KvEventsSpec, StartError, Worker, WorkerSpec};

/// Why the fleet could not start.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("cannot load the simulator's tokenizer: {0}")]
    Tokenizer(#[from] TokenizeError),
    #[error("worker {index}: {source}")]
    Start { index: u32, source: StartError },
    #[error("port {base} + {index} is beyond 65535")]
    PortRange { base: u16, index: u32 },
    #[error("KV event port {base} + {offset} (worker {index}) is beyond 65535")]
    KvPortRange { base: u16, index: u32, offset: u32 },
    #[error("cannot listen on {addr} for the fleet control: {source}")]
    Control {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Running simulated workers; dropping the fleet stops them.
pub struct Fleet {
    config: SimConfig,
    workers: Vec<Worker>,
    tokenizer: Arc<Tokenizer>,
}

impl Fleet {
    /// Loads the tokenizer once and starts every worker.
    pub async fn start(config: &SimConfig) -> Result<Fleet, FleetError> {
        // Workers tokenize whole prompts, as engines do; the picker's segment cache is not here.
        let tokenizer = Arc::new(Tokenizer::load(
            &config.tokenizer,
            config.chat_template.as_deref(),
        )?);
        let mut workers = Vec::with_capacity(config.workers.get() as usize);
        for index in 0..config.workers.get() {
            let port = match config.base_port {
                Some(base) => u16::try_from(u32::from(base) + index)
                    .map_err(|_| FleetError::PortRange { base, index })?,
                None => 0,
            };
            let spec = WorkerSpec {
                index,
                addr: SocketAddr::new(config.host, port),
                engine: config.engine,
                model: config.model.clone(),
                dp_size: config.dp_size.get(),
                block_size: config.block_size,
                timing: config.timing,
                seed: config.seed.wrapping_add(u64::from(index)),
                tokenizer: Arc::clone(&tokenizer),
                tokenizer_name: tokenizer_name(&config.tokenizer),
                params: config.params.clone(),
                kv_events: kv_events_spec(config, index)?,
                disaggregation: match (config.engine, config.prefill_workers) {
                    (Engine::Sglang, Some(prefill)) if index < prefill => Disaggregation::Prefill,
                    (Engine::Sglang, Some(_)) => Disaggregation::Decode,
                    _ => Disaggregation::Null,
                },
            };
            let worker = Worker::start(spec)
                .await
                .map_err(|source| FleetError::Start { index, source })?;
            workers.push(worker);
        }
        Ok(Fleet {
            config: config.clone(),
            workers,
            tokenizer,
        })
    }

    /// Stops every worker and waits until its ports are closed, so a fleet started next on the same
    /// fixed ports can bind them (dropping a fleet closes them soon after, not at once).
    pub async fn stop(self) {
        for worker in &self.workers {
            worker.kill().await;
        }
    }

    /// A completion's text prompt as the workers tokenize it.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, String> {
        crate::server::tokens(&self.tokenizer, &crate::wire::Prompt::Text(text.to_owned()))
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn worker(&self, index: usize) -> Option<&Worker> {
        self.workers.get(index)
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.workers.iter().map(Worker::addr).collect()
    }

    /// A cachepick configuration with one pool holding every worker. Relative tokenizer and template
    /// paths are made absolute, so the file works from any directory. With KV events on, every worker
    /// entry names rank 0's sockets (`kv_events: {endpoint, replay_endpoint}`, the latter only with
    /// replay); rank `r` is on the next ports. It sets no `index:` mode: that is the picker's choice. The simulator does not know
    /// cachepick's schema beyond this text: whoever runs both validates it (`cachepick sim` does, before
    /// writing it).
    pub fn cachepick_config(&self) -> String {
        let listen = SocketAddr::from(([127, 0, 0, 1], 9002));
        let metrics_listen = SocketAddr::from(([127, 0, 0, 1], 9090));
        self.cachepick_config_at(listen, metrics_listen)
    }

    /// [`cachepick_config`](Self::cachepick_config) with the picker's listeners at `listen` and
    /// `metrics_listen`.
    pub fn cachepick_config_at(&self, listen: SocketAddr, metrics_listen: SocketAddr) -> String {
        let workers: Vec<ConfiguredWorker> = self
            .workers
            .iter()
            .map(|worker| ConfiguredWorker {
                endpoint: worker.addr(),
                kv_live: worker.kv_events().and_then(|events| events.live_endpoint()),
                kv_replay: worker
                    .kv_events()
                    .and_then(|events| events.replay_endpoint()),
            })
            .collect();
        cachepick_config_for(&self.config, &workers, listen, metrics_listen)
    }

    /// Serves the fleet control on `listener` until the future is dropped:
    /// `GET /workers`, `POST /workers/{i}/kill`, `POST /workers/{i}/start`.
    pub async fn serve_control(self: Arc<Self>, listener: TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                // EMFILE and the like fail again at once: pause instead of spinning.
                tokio::time::sleep(crate::server::ACCEPT_ERROR_BACKOFF).await;
                continue;
            };
            let fleet = Arc::clone(&self);
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let fleet = Arc::clone(&fleet);
                    async move { Ok::<_, Infallible>(fleet.control(request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    }

    async fn control(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let path = request.uri().path().to_owned();
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (request.method(), parts.as_slice()) {
            (&Method::GET, ["workers"]) => reply(StatusCode::OK, self.listing()),
            (&Method::POST, ["workers", index, action]) => {
                let Some(worker) = index.parse::<usize>().ok().and_then(|i| self.worker(i)) else {
                    return reply(StatusCode::NOT_FOUND, error_json("no such worker"));
                };
                match *action {
                    "kill" => {
                        worker.kill().await;
                        reply(StatusCode::OK, self.listing())
                    }
                    "start" => match worker.restart().await {
                        Ok(()) => reply(StatusCode::OK, self.listing()),
                        Err(problem) => reply(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            error_json(&problem.to_string()),
                        ),
                    },
                    _ => reply(StatusCode::NOT_FOUND, error_json("actions: kill, start")),
                }
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                error_json("routes: GET /workers, POST /workers/{i}/kill, POST /workers/{i}/start"),
            ),
        }
    }

    fn listing(&self) -> Vec<u8> {
        let workers: Vec<serde_json::Value> = self
            .workers
            .iter()
            .map(|worker| {
                serde_json::json!({
                    "index": worker.index(),
                    "endpoint": worker.addr().to_string(),
                    "up": worker.is_up(),
                    "kv_events": worker.kv_events().and_then(|events| events.live_endpoint()),
                    "kv_events_replay": worker.kv_events().and_then(|events| events.replay_endpoint()),
                })
            })
            .collect();
        serde_json::to_vec_pretty(&serde_json::json!({ "workers": workers })).unwrap_or_default()
    }
}

/// One worker as cachepick's configuration names it: its endpoint and rank 0's KV event sockets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfiguredWorker {
    pub endpoint: SocketAddr,
    pub kv_live: Option<String>,
    pub kv_replay: Option<String>,
}

/// The cachepick configuration of a fleet configured by `config` whose workers are `workers`
/// ([`Fleet::cachepick_config_at`] for a running fleet; a fleet in virtual time names addresses it
/// never binds).
pub fn cachepick_config_for(
    config: &SimConfig,
    workers: &[ConfiguredWorker],
    listen: SocketAddr,
    metrics_listen: SocketAddr,
) -> String {
    let gate = match config.timing {
        // A step-model rank's waiting queue is its prefill backlog beyond one step's budget,
        // whatever its running limit: cachepick's own defaults (4 waiting, floor 2) fit it.
        Timing::Step => (4, 2),
        // A queue of a quarter of the running slots is where waiting starts to dominate TTFT.
        Timing::Slots => (
            (config.params.max_running.get() / 4).max(1),
            (config.params.max_running.get() / 8).max(1),
        ),
    };
    let mut out = String::new();
    let gate_why = match config.timing {
        Timing::Step => {
            "a step-model rank's waiting queue is its prefill backlog beyond one step's token budget, \
             which cachepick's own defaults fit"
        }
        Timing::Slots => {
            "a quarter of the running slots: where waiting starts to dominate the time to first token"
        }
    };
    let _ = writeln!(
        out,
        "# Generated by `cachepick sim` for {} simulated {} worker(s) serving `{}`.\n\
         # Start the picker with: cachepick serve --config <this file>\n\
         listen: {listen}\n\
         metrics_listen: {metrics_listen}\n\
         policy:\n  \
           # The queue gate: a prefix owner with this many requests waiting is passed over and the\n  \
           # request diverted to a less loaded worker ({gate_why}).\n  \
           worker_queue_limit: {}\n  \
           # The saturation floor: when no worker has a fresh reading below this many waiting, a\n  \
           # diversion buys no shorter queue, so the request stays on its least-pressured owner\n  \
           # (saturation_pin).\n  \
           saturation_queue_floor: {}\n\
         # Loopback workers answer at once: scraped five times a second, a reading is fresh for 1 s.\n\
         load:\n  \
           scrape_interval: 200ms\n  \
           scrape_timeout: 150ms\n  \
           freshness: 1s\n\
         pools:\n  \
           - model: {}\n    \
             engine: {}\n    \
             block_size: {}\n    \
             tokenizer: {}",
        config.workers,
        config.engine.as_str(),
        config.model,
        gate.0,
        gate.1,
        yaml_string(&config.model),
        config.engine.as_str(),
        config.block_size,
        tokenizer_yaml(&config.tokenizer),
    );
    if let Some(template) = &config.chat_template {
        let _ = writeln!(
            out,
            "    chat_template: {}",
            yaml_string(&absolute(template).display().to_string())
        );
    }
    // A disaggregated SGLang fleet: the picker performs the bootstrap rendezvous, and each prefill
    // worker's bootstrap server answers on its own port.
    let prefill_workers = match config.engine {
        Engine::Sglang => config.prefill_workers,
        Engine::Vllm => None,
    };
    if prefill_workers.is_some() {
        let _ = writeln!(out, "    pd: {{handshake: bootstrap}}");
    }
    let _ = writeln!(out, "    workers:");
    for (index, worker) in workers.iter().enumerate() {
        let _ = writeln!(out, "      - endpoint: {}", worker.endpoint);
        if let Some(prefill) = prefill_workers {
            if u32::try_from(index).is_ok_and(|index| index < prefill) {
                let port = worker.endpoint.port();
                let _ = writeln!(out, "        role: prefill\n        bootstrap_port: {port}");
            } else {
                let _ = writeln!(out, "        role: decode");
            }
        }
        if config.dp_size.get() > 1 {
            let _ = writeln!(out, "        dp_size: {}", config.dp_size);
        }
        // Rank 0's sockets; rank r is on the next ports, as the engines bind `port + rank`.
        if let Some(live) = &worker.kv_live {
            let _ = writeln!(out, "        kv_events:\n          endpoint: {live}");
            if let Some(replay) = &worker.kv_replay {
                let _ = writeln!(out, "          replay_endpoint: {replay}");
            }
        }
    }
    out
}

/// Where `cachepick sim --emit-config` writes cachepick's configuration, and the picker's listeners it
/// names (`--picker-listen`, `--picker-metrics-listen`).
#[derive(Clone, Debug)]
pub struct EmitConfig {
    pub path: PathBuf,
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
}

impl EmitConfig {
    /// The picker's listeners the emitted file names unless told otherwise: cachepick's own defaults.
    pub const DEFAULT_LISTEN: &str = "127.0.0.1:9002";
    pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9090";
}

/// Runs `cachepick sim`: starts the fleet, writes the cachepick config if asked (once `validate`, the
/// caller's check of cachepick's schema, accepts it), prints where everything is, and serves until
/// `shutdown` resolves.
pub async fn run(
    config: SimConfig,
    emit_config: Option<EmitConfig>,
    validate: impl FnOnce(&str) -> Result<(), String>,
    control: SocketAddr,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    let fleet = Arc::new(Fleet::start(&config).await?);
    let listener = TcpListener::bind(control)
        .await
        .map_err(|source| FleetError::Control {
            addr: control,
            source,
        })?;
    let control = listener
        .local_addr()
        .map_err(|source| FleetError::Control {
            addr: control,
            source,
        })?;
    if let Some(emit) = &emit_config {
        let text = fleet.cachepick_config_at(emit.listen, emit.metrics_listen);
        validate(&text).map_err(RunError::Emitted)?;
        std::fs::write(&emit.path, text).map_err(|source| RunError::Write {
            path: emit.path.clone(),
            source,
        })?;
    }
    let params = &config.params;
    println!(
        "cachepick sim: {} {} worker(s) serving `{}` (block {} tokens, {} KV blocks and {} running per rank, \
         dp_size {}, time scale {})",
        config.workers,
        config.engine.as_str(),
        config.model,
        config.block_size,
        params.kv_blocks,
        params.max_running,
        config.dp_size,
        params.time_scale,
    );
    for worker in fleet.workers() {
        match worker.kv_events() {
            Some(events) => println!(
                "worker {} http://{} kv events ({}) {}{}",
                worker.index(),
                worker.addr(),
                events.format.as_str(),
                events.live_endpoint().unwrap_or_default(),
                events
                    .replay_endpoint()
                    .map(|replay| format!(" replay {replay}"))
                    .unwrap_or_default(),
            ),
            None => println!("worker {} http://{}", worker.index(), worker.addr()),
        }
    }
    println!(
        "control http://{control} (GET /workers, POST /workers/N/kill, POST /workers/N/start)"
    );
    if let Some(path) = &emit_config {
        println!("config {}", path.path.display());
    }
    let serving = tokio::spawn(Arc::clone(&fleet).serve_control(listener));
    shutdown.await;
    serving.abort();
    Ok(())
}

/// Why `cachepick sim` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("the generated cachepick configuration does not validate (a bug): {0}")]
    Emitted(String),
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Worker `index`'s KV event ports: with a base port, its block of `dp_size` live ports and then (with
/// replay) `dp_size` replay ports, right after the previous worker's; without one, free ports.
fn kv_events_spec(config: &SimConfig, index: u32) -> Result<Option<KvEventsSpec>, FleetError> {
    let Some(events) = &config.kv_events else {
        return Ok(None);
    };
    let dp = config.dp_size.get();
    let (live_port, replay_port) = match events.base_port {
        Some(base) => {
            let stride = if events.replay {
                dp.saturating_mul(2)
            } else {
                dp
            };
            let port = |offset: u32| {
                u16::try_from(u32::from(base).saturating_add(offset)).map_err(|_| {
                    FleetError::KvPortRange {
                        base,
                        index,
                        offset,
                    }
                })
            };
            let first = index.saturating_mul(stride);
            // The last port of the block must exist too.
            port(first.saturating_add(stride).saturating_sub(1))?;
            let replay = if events.replay {
                Some(port(first.saturating_add(dp))?)
            } else {
                None
            };
            (Some(port(first)?), replay)
        }
        None => (None, None),
    };
    Ok(Some(KvEventsSpec {
        config: events.clone(),
        live_port,
        replay_port,
    }))
}

fn reply(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_json(message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "error": { "message": message } })).unwrap_or_default()
}

fn tokenizer_name(tokenizer: &TokenizerConfig) -> String {
    match tokenizer {
        TokenizerConfig::Tiktoken { encoding } => format!("tiktoken:{}", encoding.as_str()),
        TokenizerConfig::HuggingFace { path } => absolute(path).display().to_string(),
        TokenizerConfig::Bytes => "bytes".to_owned(),
    }
}

fn tokenizer_yaml(tokenizer: &TokenizerConfig) -> String {
    match tokenizer {
        TokenizerConfig::Tiktoken { encoding } => {
            format!("{{kind: tiktoken, encoding: {}}}", encoding.as_str())
        }
        TokenizerConfig::HuggingFace { path } => format!(
            "{{kind: huggingface, path: {}}}",
            yaml_string(&absolute(path).display().to_string())
        ),
        TokenizerConfig::Bytes => "{kind: bytes}".to_owned(),
    }
}

/// A double-quoted YAML scalar (JSON string syntax is valid YAML).
fn yaml_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| format!("{text:?}"))
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

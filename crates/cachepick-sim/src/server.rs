//! One simulated worker: an HTTP/1.1 server on loopback that serves the engine's API, metrics,
//! discovery and admin endpoints over per-rank [`RankModel`]s.
//!
//! A request's life: parse → (injected failure) → tokenize the whole prompt → pick the least-loaded rank
//! → submit to its model (admitted, queued, or refused) → wait for admission → prefill → decode → finish.
//! Everything after submission holds a [`Ticket`], whose drop tells the model the request ended, so a
//! client that goes away mid-queue or mid-stream frees its slot exactly as an engine aborts a request.
//! A streamed response is generated inside its body, on the connection's task: crashing the worker
//! aborts the connection tasks and with them every stream, the way a dying process drops its sockets.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use cachepick_tokenizer::{ChatTurn, Tokenizer};

use crate::config::{Engine, SimParams};
use crate::expo::{self, Identity};
use crate::model::{Admission, RankModel, Refusal, RequestId, Submit};
use crate::stats::{Histogram, RankStats};
use crate::timing;
use crate::wire::{self, Api, Outcome, Prompt, SimRequest};

type Body = BoxBody<Bytes, Infallible>;

/// Request bodies larger than this are refused with 413 before they are parsed.
const MAX_REQUEST_BYTES: usize = 64 << 20;

/// What a worker is and serves; fixed for its life.
#[derive(Clone)]
pub struct WorkerSpec {
    pub index: u32,
    pub addr: SocketAddr,
    pub engine: Engine,
    pub model: String,
    pub dp_size: u32,
    pub block_size: std::num::NonZeroU32,
    pub seed: u64,
    pub tokenizer: Arc<Tokenizer>,
    /// How `/server_info` names the tokenizer.
    pub tokenizer_name: String,
    pub params: SimParams,
}

/// How `/metrics` (and `/v1/loads`) answer; set through `/admin/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsMode {
    /// The model's state now.
    #[default]
    Live,
    /// The text captured when this mode was set, repeated: a stuck exporter.
    Frozen,
    /// Accepts the request and never answers.
    Hang,
    /// 500.
    Fail,
    /// 200 with bytes that are not an exposition.
    Garbage,
}

/// Values reported instead of the model's, on every rank; `None` keeps the model's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FakeMetrics {
    pub waiting: Option<u64>,
    pub running: Option<u64>,
    pub kv_usage: Option<f64>,
}

/// One rank: its model, the requests waiting for admission, and its latency histograms.
struct Rank {
    model: RankModel,
    waiters: HashMap<RequestId, oneshot::Sender<Admission>>,
    ttft: Histogram,
    e2e: Histogram,
}

impl Rank {
    /// Wakes the requests the model admitted.
    fn wake(&mut self, admitted: Vec<Admission>) {
        for admission in admitted {
            if let Some(waiter) = self.waiters.remove(&admission.id) {
                // A waiter that is gone has already told the model (its ticket's drop), so nothing leaks.
                let _ = waiter.send(admission);
            }
        }
    }

    fn stats(&self) -> RankStats {
        let mut stats = self.model.stats();
        stats.ttft = self.ttft.clone();
        stats.e2e = self.e2e.clone();
        stats
    }
}

/// The state one run of the worker owns; a restart starts a new one, empty, as a restarted engine is.
struct Incarnation {
    ranks: Vec<Mutex<Rank>>,
}

impl Incarnation {
    fn new(spec: &WorkerSpec, params: &SimParams) -> Incarnation {
        let ranks = (0..spec.dp_size)
            .map(|rank| {
                Mutex::new(Rank {
                    model: RankModel::new(
                        rank,
                        spec.block_size,
                        params.kv_blocks,
                        params.max_running,
                        params.max_queue,
                    ),
                    waiters: HashMap::new(),
                    ttft: Histogram::default(),
                    e2e: Histogram::default(),
                })
            })
            .collect();
        Incarnation { ranks }
    }

    fn rank(&self, index: usize) -> Option<MutexGuard<'_, Rank>> {
        self.ranks.get(index).map(lock)
    }

    /// The rank an engine's internal balancer would choose — fewest waiting, then fewest running —
    /// locked, with its index. Every rank is locked (in index order, the only multi-rank lock order)
    /// until the choice is made, so two simultaneous arrivals cannot both see the same rank idle.
    fn least_loaded(&self) -> Option<(usize, MutexGuard<'_, Rank>)> {
        let guards: Vec<MutexGuard<'_, Rank>> = self.ranks.iter().map(lock).collect();
        let chosen = guards
            .iter()
            .enumerate()
            .min_by_key(|(_, rank)| (rank.model.waiting(), rank.model.running()))
            .map(|(index, _)| index)?;
        guards
            .into_iter()
            .enumerate()
            .find(|(index, _)| *index == chosen)
    }

    fn stats(&self) -> Vec<RankStats> {
        self.ranks.iter().map(|rank| lock(rank).stats()).collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic under the lock cannot leave a rank half-updated in a way that matters more than losing
    // the whole simulated worker would, so the state is used as it is.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Run-time controls.
#[derive(Clone, Copy, Debug, Default)]
struct Controls {
    metrics: MetricsMode,
    fake: Option<FakeMetrics>,
}

/// The running or crashed server.
enum Life {
    Up {
        incarnation: Arc<Incarnation>,
        server: JoinHandle<()>,
        /// Tells the accept loop to cut every connection and return.
        stop: oneshot::Sender<()>,
    },
    Down,
}

struct Shared {
    spec: WorkerSpec,
    /// The endpoint as cachepick names it; sent as `x-served-by`.
    id: String,
    params: ArcSwap<SimParams>,
    controls: Mutex<Controls>,
    /// The exposition and loads captured by `MetricsMode::Frozen`.
    frozen: Mutex<Option<(String, Vec<u8>)>>,
    paused: watch::Sender<bool>,
    life: Mutex<Life>,
    next_request: AtomicU64,
    /// Seeds the shared draws (injected failures); each request has its own generator.
    rng: Mutex<SmallRng>,
}

/// A simulated worker. Dropping it stops its server.
pub struct Worker {
    shared: Arc<Shared>,
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

impl Worker {
    /// Binds `spec.addr` (port 0 takes a free one) and starts serving.
    pub async fn start(mut spec: WorkerSpec) -> Result<Worker, StartError> {
        let listener = TcpListener::bind(spec.addr)
            .await
            .map_err(|source| StartError::Bind {
                addr: spec.addr,
                source,
            })?;
        spec.addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: spec.addr,
            source,
        })?;
        let shared = Arc::new(Shared {
            id: spec.addr.to_string(),
            params: ArcSwap::from_pointee(spec.params.clone()),
            controls: Mutex::new(Controls::default()),
            frozen: Mutex::new(None),
            paused: watch::Sender::new(false),
            life: Mutex::new(Life::Down),
            next_request: AtomicU64::new(0),
            rng: Mutex::new(SmallRng::seed_from_u64(spec.seed)),
            spec,
        });
        launch(&shared, listener);
        Ok(Worker { shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.spec.addr
    }

    pub fn index(&self) -> u32 {
        self.shared.spec.index
    }

    pub fn is_up(&self) -> bool {
        matches!(*lock(&self.shared.life), Life::Up { .. })
    }

    /// Stops serving: when this returns the port is closed, open connections and streams are cut and
    /// the state is lost.
    pub async fn kill(&self) {
        kill(&self.shared).await;
    }

    /// Starts again on the same port with an empty cache and queue, as a restarted engine.
    pub async fn restart(&self) -> Result<(), StartError> {
        restart(&self.shared).await
    }

    /// Every rank's state and counters now.
    pub fn stats(&self) -> Vec<RankStats> {
        current(&self.shared).map_or_else(Vec::new, |incarnation| incarnation.stats())
    }

    pub fn params(&self) -> SimParams {
        SimParams::clone(&self.shared.params.load())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // No await in a drop: the port closes once the runtime drops the aborted task.
        if let Life::Up { server, .. } =
            std::mem::replace(&mut *lock(&self.shared.life), Life::Down)
        {
            server.abort();
        }
    }
}

fn current(shared: &Shared) -> Option<Arc<Incarnation>> {
    match &*lock(&shared.life) {
        Life::Up { incarnation, .. } => Some(Arc::clone(incarnation)),
        Life::Down => None,
    }
}

fn launch(shared: &Arc<Shared>, listener: TcpListener) {
    let incarnation = Arc::new(Incarnation::new(&shared.spec, &shared.params.load()));
    let (stop, stopped) = oneshot::channel();
    let server = tokio::spawn(accept_loop(
        listener,
        Arc::clone(shared),
        Arc::clone(&incarnation),
        stopped,
    ));
    let previous = std::mem::replace(
        &mut *lock(&shared.life),
        Life::Up {
            incarnation,
            server,
            stop,
        },
    );
    if let Life::Up { server, .. } = previous {
        server.abort();
    }
}

async fn kill(shared: &Shared) {
    let previous = std::mem::replace(&mut *lock(&shared.life), Life::Down);
    if let Life::Up { server, stop, .. } = previous {
        // The loop returns after every connection task is gone and drops the listener on the way
        // out: once it is joined, the port is closed and no stream survives.
        let _ = stop.send(());
        let _ = server.await;
    }
}

async fn restart(shared: &Arc<Shared>) -> Result<(), StartError> {
    kill(shared).await;
    let addr = shared.spec.addr;
    // The aborted accept loop releases the port when its task is dropped, which happens on the
    // runtime shortly after `abort`; retry briefly rather than fail on that race.
    let mut attempts = 0;
    let listener = loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => break listener,
            Err(source) if attempts >= 50 => return Err(StartError::Bind { addr, source }),
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    launch(shared, listener);
    Ok(())
}

/// The pause after a failed accept (the fleet's control listener uses it too).
pub(crate) const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    incarnation: Arc<Incarnation>,
    mut stop: oneshot::Receiver<()>,
) {
    // Connections live in this task's set: a crash aborts them all, and so does aborting the task.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => {
                drop(listener);
                connections.shutdown().await;
                return;
            }
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // EMFILE and the like fail again at once: pause instead of spinning.
                    tokio::select! {
                        _ = &mut stop => {
                            drop(listener);
                            connections.shutdown().await;
                            return;
                        }
                        () = tokio::time::sleep(ACCEPT_ERROR_BACKOFF) => continue,
                    }
                };
                let _ = stream.set_nodelay(true);
                let shared = Arc::clone(&shared);
                let incarnation = Arc::clone(&incarnation);
                connections.spawn(async move {
                    let service = service_fn(move |request| {
                        let shared = Arc::clone(&shared);
                        let incarnation = Arc::clone(&incarnation);
                        async move {
                            let served_by = HeaderValue::from_str(&shared.id).ok();
                            let echoed = routing_headers(request.headers());
                            let mut response = route(shared, incarnation, request).await;
                            // Errors too: a test sees which worker refused a request.
                            if let Some(served_by) = served_by {
                                response.headers_mut().insert("x-served-by", served_by);
                            }
                            for (name, value) in echoed {
                                response.headers_mut().append(name, value);
                            }
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// The routing headers the request arrived with (`x-gateway-*`, `x-cachepick-*`), renamed
/// `x-sim-echo-<name>`: what a gateway in front told this worker, visible to the client and to tests.
fn routing_headers(headers: &http::HeaderMap) -> Vec<(http::HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-gateway-") || name.starts_with("x-cachepick-")
        })
        .filter_map(|(name, value)| {
            let echoed = format!("x-sim-echo-{}", name.as_str());
            Some((
                http::HeaderName::from_bytes(echoed.as_bytes()).ok()?,
                value.clone(),
            ))
        })
        .collect()
}

async fn route(
    shared: Arc<Shared>,
    incarnation: Arc<Incarnation>,
    request: Request<Incoming>,
) -> Response<Body> {
    let path = request.uri().path().to_owned();
    let engine = shared.spec.engine;
    match (request.method(), path.as_str()) {
        (&Method::POST, "/v1/chat/completions" | "/v1/completions" | "/generate") => {
            let api = Api::from_path(&path).unwrap_or(Api::Chat);
            match read_body(request).await {
                Ok(body) => generate(shared, incarnation, api, body).await,
                Err(response) => response,
            }
        }
        (&Method::GET, "/metrics") => metrics(&shared, &incarnation, Scrape::Metrics).await,
        (&Method::GET, "/v1/loads") if engine == Engine::Sglang => {
            metrics(&shared, &incarnation, Scrape::Loads).await
        }
        (&Method::GET, "/health" | "/health_generate" | "/ping") => {
            text(StatusCode::OK, String::new())
        }
        (&Method::GET, "/v1/models") => json(StatusCode::OK, expo::models_json(&identity(&shared))),
        (&Method::GET, "/version") if engine == Engine::Vllm => {
            json(StatusCode::OK, expo::version_json(&identity(&shared)))
        }
        (&Method::GET, "/server_info" | "/get_server_info") if engine == Engine::Sglang => {
            json(StatusCode::OK, expo::server_info_json(&identity(&shared)))
        }
        (&Method::GET, "/model_info" | "/get_model_info") if engine == Engine::Sglang => {
            json(StatusCode::OK, expo::model_info_json(&identity(&shared)))
        }
        (_, route) if route.starts_with("/admin/") => {
            let method = request.method().clone();
            match read_body(request).await {
                Ok(body) => admin(&shared, &incarnation, &method, route, &body).await,
                Err(response) => response,
            }
        }
        _ => error(StatusCode::NOT_FOUND, &format!("no route for {path}")),
    }
}

async fn read_body(request: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(request.into_body(), MAX_REQUEST_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(cause) if cause.is::<http_body_util::LengthLimitError>() => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body exceeds {MAX_REQUEST_BYTES} bytes"),
        )),
        Err(cause) => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("cannot read the request body: {cause}"),
        )),
    }
}

fn identity(shared: &Shared) -> Identity<'_> {
    let params = shared.params.load();
    Identity {
        engine: shared.spec.engine,
        model: &shared.spec.model,
        dp_size: shared.spec.dp_size,
        block_size: shared.spec.block_size.get(),
        max_running: u64::from(params.max_running.get()),
        kv_blocks: u64::from(params.kv_blocks.get()),
        max_model_len: params.max_model_len.get(),
        tokenizer: &shared.spec.tokenizer_name,
    }
}

// Generation.

/// A request known to a rank's model; its drop tells the model the request ended.
struct Ticket {
    incarnation: Arc<Incarnation>,
    rank: usize,
    id: RequestId,
    completed: bool,
    generated: u32,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(mut rank) = self.incarnation.rank(self.rank) {
            rank.waiters.remove(&self.id);
            let admitted = rank.model.finish(self.id, self.completed, self.generated);
            rank.wake(admitted);
        }
    }
}

async fn generate(
    shared: Arc<Shared>,
    incarnation: Arc<Incarnation>,
    api: Api,
    body: Bytes,
) -> Response<Body> {
    let request = match wire::parse(api, &body) {
        Ok(request) => request,
        Err(problem) => {
            let status = StatusCode::from_u16(problem.status()).unwrap_or(StatusCode::BAD_REQUEST);
            return error(status, &problem.to_string());
        }
    };
    if let Some(model) = request.model.as_deref()
        && model != shared.spec.model
        && api != Api::Generate
    {
        return error(
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
        );
    }
    let params = shared.params.load_full();
    if params.failure_rate > 0.0 && lock(&shared.rng).random::<f64>() < params.failure_rate {
        if let Some(mut rank) = incarnation.rank(0) {
            rank.model.count_rejected();
        }
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected failure (failure_rate)",
        );
    }
    let prompt = match tokens(&shared.spec.tokenizer, &request.prompt) {
        Ok(prompt) => prompt,
        Err(message) => return error(StatusCode::BAD_REQUEST, &message),
    };
    let output = request
        .max_tokens
        .unwrap_or(params.default_max_tokens.get());
    let total = u64::try_from(prompt.len())
        .unwrap_or(u64::MAX)
        .saturating_add(u64::from(output));
    if total > u64::from(params.max_model_len.get()) {
        let message = format!(
            "This model's maximum context length is {} tokens. However, you requested {total} tokens \
             ({} in the messages, {output} in the completion). Please reduce the length of the \
             messages or completion.",
            params.max_model_len,
            prompt.len()
        );
        return error(StatusCode::BAD_REQUEST, &message);
    }

    let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let received = Instant::now();
    let (ticket, admission, rank_index) = {
        let Some((rank_index, mut rank)) = incarnation.least_loaded() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "no engine rank");
        };
        let admission = match rank.model.submit(id, &prompt, output) {
            Ok(Submit::Admitted(admission)) => Ok(admission),
            Ok(Submit::Queued { .. }) => {
                let (sender, receiver) = oneshot::channel();
                rank.waiters.insert(id, sender);
                Err(receiver)
            }
            Err(refusal) => return refused(refusal),
        };
        let ticket = Ticket {
            incarnation: Arc::clone(&incarnation),
            rank: rank_index,
            id,
            completed: false,
            generated: 0,
        };
        (ticket, admission, rank_index)
    };
    let admission = match admission {
        Ok(admission) => admission,
        Err(receiver) => match receiver.await {
            Ok(admission) => admission,
            Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the engine restarted"),
        },
    };

    let run = Run {
        shared: Arc::clone(&shared),
        request_seed: shared.spec.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        api,
        id: format!("{}-{id}", api_prefix(api)),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs()),
        prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        output,
        admission,
        received,
        ticket,
        rng: SmallRng::seed_from_u64(shared.spec.seed ^ id.rotate_left(17)),
    };
    let headers = ResponseHeaders {
        served_by: shared.id.clone(),
        rank: (shared.spec.dp_size > 1).then_some(rank_index),
        cached: admission.cached_tokens,
    };
    if request.stream {
        stream_response(run, request, headers)
    } else {
        complete_response(run, headers).await
    }
}

fn api_prefix(api: Api) -> &'static str {
    match api {
        Api::Chat => "chatcmpl",
        Api::Completion => "cmpl",
        Api::Generate => "gen",
    }
}

fn refused(refusal: Refusal) -> Response<Body> {
    match refusal {
        Refusal::QueueFull { .. } => error(StatusCode::SERVICE_UNAVAILABLE, &refusal.to_string()),
        Refusal::TooLong { .. } => error(StatusCode::BAD_REQUEST, &refusal.to_string()),
        Refusal::DuplicateId { .. } => {
            error(StatusCode::INTERNAL_SERVER_ERROR, &refusal.to_string())
        }
    }
}

/// The prompt's tokens as the engine sees them: a chat rendered by the template and tokenized whole
/// without added special tokens; a text prompt tokenized whole with them; token ids as given.
fn tokens(tokenizer: &Tokenizer, prompt: &Prompt) -> Result<Vec<u32>, String> {
    match prompt {
        Prompt::Tokens(tokens) => Ok(tokens.clone()),
        Prompt::Text(text) => tokenizer
            .encode_whole(text, true)
            .map_err(|error| error.to_string()),
        Prompt::Chat { messages, tools } => {
            let parts: Vec<[std::borrow::Cow<'_, str>; 1]> = messages
                .iter()
                .map(|message| [std::borrow::Cow::Borrowed(message.content.as_str())])
                .collect();
            let turns: Vec<ChatTurn<'_>> = messages
                .iter()
                .zip(&parts)
                .map(|(message, parts)| ChatTurn {
                    role: &message.role,
                    parts,
                })
                .collect();
            let text = tokenizer
                .render_chat(&turns, tools.as_deref())
                .map_err(|error| error.to_string())?;
            tokenizer
                .encode_whole(&text, false)
                .map_err(|error| error.to_string())
        }
    }
}

struct ResponseHeaders {
    served_by: String,
    rank: Option<usize>,
    cached: u32,
}

impl ResponseHeaders {
    fn apply(&self, response: &mut Response<Body>) {
        let headers = response.headers_mut();
        if let Ok(value) = HeaderValue::from_str(&self.served_by) {
            headers.insert("x-served-by", value);
        }
        headers.insert("x-cached-tokens", HeaderValue::from(self.cached));
        if let Some(rank) = self.rank {
            headers.insert("x-served-by-rank", HeaderValue::from(rank));
        }
    }
}

/// An admitted request being generated.
struct Run {
    shared: Arc<Shared>,
    request_seed: u64,
    api: Api,
    id: String,
    created: u64,
    prompt_tokens: u32,
    output: u32,
    admission: Admission,
    received: Instant,
    ticket: Ticket,
    rng: SmallRng,
}

impl Run {
    fn running(&self) -> u64 {
        self.ticket
            .incarnation
            .rank(self.ticket.rank)
            .map_or(1, |rank| rank.model.running())
    }

    /// Sleeps until `until` without counting time spent paused: a pause during the sleep pushes the
    /// end back by its length, as a stopped engine makes no progress. Returns the end it slept to.
    async fn sleep_unpaused(&self, mut until: Instant) -> Instant {
        let mut paused = self.shared.paused.subscribe();
        loop {
            if *paused.borrow_and_update() {
                let since = Instant::now();
                if paused.wait_for(|paused| !paused).await.is_err() {
                    return until;
                }
                until += since.elapsed();
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep_until(until) => return until,
                changed = paused.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep_until(until).await;
                        return until;
                    }
                }
            }
        }
    }

    async fn prefill(&mut self) {
        let params = self.shared.params.load_full();
        let running = self.running();
        let duration = timing::prefill(
            &params,
            self.admission.uncached_tokens,
            running,
            &mut self.rng,
        );
        self.sleep_unpaused(Instant::now() + duration).await;
        self.observe(|rank, seconds| rank.ttft.observe(seconds));
    }

    /// Sleeps until the next token is due and returns how many tokens are due by then (at least one);
    /// `deadline` advances by each token's gap, so timer granularity never slows the stream down.
    async fn next_tokens(&mut self, deadline: &mut Instant, remaining: u32) -> u32 {
        let params = self.shared.params.load_full();
        let running = self.running();
        let gap = timing::token_gap(&params, running, &mut self.rng);
        *deadline = self.sleep_unpaused(*deadline + gap).await;
        let now = Instant::now();
        let mut due = 1;
        while due < remaining {
            let gap = timing::token_gap(&params, running, &mut self.rng);
            if *deadline + gap > now {
                break;
            }
            *deadline += gap;
            due += 1;
        }
        due
    }

    fn text(&self, from: u32, count: u32) -> String {
        (from..from.saturating_add(count))
            .map(|index| wire::output_token(self.request_seed, index))
            .collect()
    }

    fn observe(&self, record: impl FnOnce(&mut Rank, f64)) {
        if let Some(mut rank) = self.ticket.incarnation.rank(self.ticket.rank) {
            record(&mut rank, self.received.elapsed().as_secs_f64());
        }
    }

    fn finish(&mut self) {
        self.ticket.completed = true;
        self.ticket.generated = self.output;
        self.observe(|rank, seconds| rank.e2e.observe(seconds));
    }

    fn outcome<'a>(&'a self, text: &'a str, completion_tokens: u32) -> Outcome<'a> {
        Outcome {
            id: &self.id,
            model: &self.shared.spec.model,
            created: self.created,
            text,
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            cached_tokens: self.admission.cached_tokens,
            finish_reason: "length",
        }
    }
}

async fn complete_response(mut run: Run, headers: ResponseHeaders) -> Response<Body> {
    run.prefill().await;
    let mut deadline = Instant::now();
    let mut produced = if run.output > 0 { 1 } else { 0 };
    run.ticket.generated = produced;
    while produced < run.output {
        produced += run.next_tokens(&mut deadline, run.output - produced).await;
        run.ticket.generated = produced;
    }
    run.finish();
    let text = run.text(0, run.output);
    let body = wire::response_body(run.api, &run.outcome(&text, run.output));
    let mut response = json(StatusCode::OK, body);
    headers.apply(&mut response);
    response
}

/// Where a stream is.
enum Phase {
    Prefill,
    Decode { produced: u32, deadline: Instant },
    End,
    Done,
}

fn stream_response(run: Run, request: SimRequest, headers: ResponseHeaders) -> Response<Body> {
    let include_usage = request.include_usage;
    let events =
        futures_util::stream::unfold((run, Phase::Prefill), move |(mut run, phase)| async move {
            match phase {
                Phase::Prefill => {
                    run.prefill().await;
                    if run.output == 0 {
                        return Some((Bytes::new(), (run, Phase::End)));
                    }
                    // A client that leaves mid-stream still cost the tokens it was sent.
                    run.ticket.generated = 1;
                    let text = run.text(0, 1);
                    let chunk = wire::stream_chunk(run.api, &run.outcome(&text, 1), &text, true);
                    let next = Phase::Decode {
                        produced: 1,
                        deadline: Instant::now(),
                    };
                    Some((chunk, (run, next)))
                }
                Phase::Decode {
                    produced,
                    mut deadline,
                } if produced < run.output => {
                    let due = run.next_tokens(&mut deadline, run.output - produced).await;
                    let text = run.text(produced, due);
                    let total = produced + due;
                    run.ticket.generated = total;
                    let cumulative;
                    // SGLang's /generate sends the text so far in every event, OpenAI APIs the delta.
                    let outcome_text = if run.api == Api::Generate {
                        cumulative = run.text(0, total);
                        cumulative.as_str()
                    } else {
                        text.as_str()
                    };
                    let chunk = wire::stream_chunk(
                        run.api,
                        &run.outcome(outcome_text, total),
                        &text,
                        false,
                    );
                    Some((
                        chunk,
                        (
                            run,
                            Phase::Decode {
                                produced: total,
                                deadline,
                            },
                        ),
                    ))
                }
                Phase::Decode { .. } | Phase::End => {
                    run.finish();
                    let text = run.text(0, run.output);
                    let end =
                        wire::stream_end(run.api, &run.outcome(&text, run.output), include_usage);
                    Some((end, (run, Phase::Done)))
                }
                Phase::Done => None,
            }
        })
        .filter(|chunk| std::future::ready(!chunk.is_empty()))
        .map(|chunk| Ok::<_, Infallible>(Frame::data(chunk)));
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(events)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
        .headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    headers.apply(&mut response);
    response
}

// Metrics.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scrape {
    Metrics,
    Loads,
}

/// The ranks' stats with the fake values applied.
fn reported(shared: &Shared, incarnation: &Incarnation) -> Vec<RankStats> {
    let fake = lock(&shared.controls).fake;
    let mut stats = incarnation.stats();
    if let Some(fake) = fake {
        for rank in &mut stats {
            if let Some(waiting) = fake.waiting {
                rank.waiting = waiting;
            }
            if let Some(running) = fake.running {
                rank.running = running;
            }
            if let Some(usage) = fake.kv_usage {
                let used = (usage.clamp(0.0, 1.0) * rank.kv_total_blocks as f64).round();
                rank.kv_pinned_blocks = used as u64;
                rank.kv_used_blocks = rank.kv_used_blocks.max(used as u64);
            }
        }
    }
    stats
}

fn render(shared: &Shared, incarnation: &Incarnation) -> (String, Vec<u8>) {
    let stats = reported(shared, incarnation);
    (
        expo::render_metrics(shared.spec.engine, &shared.spec.model, &stats),
        expo::render_loads(&stats),
    )
}

async fn metrics(shared: &Shared, incarnation: &Incarnation, scrape: Scrape) -> Response<Body> {
    let mode = lock(&shared.controls).metrics;
    let (exposition, loads) = match mode {
        MetricsMode::Live => render(shared, incarnation),
        MetricsMode::Frozen => lock(&shared.frozen)
            .clone()
            .unwrap_or_else(|| render(shared, incarnation)),
        MetricsMode::Hang => {
            std::future::pending::<()>().await;
            (String::new(), Vec::new())
        }
        MetricsMode::Fail => {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "metrics failure (admin)");
        }
        MetricsMode::Garbage => {
            return text(
                StatusCode::OK,
                "<html>\u{0}\u{1} not an exposition {{{{ \"loads\": ]]\n".to_owned(),
            );
        }
    };
    match scrape {
        Scrape::Metrics => {
            let mut response = text(StatusCode::OK, exposition);
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        Scrape::Loads => json(StatusCode::OK, loads),
    }
}

// Admin.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsControl {
    mode: Option<MetricsMode>,
    /// `null` clears the fake values; absent keeps them.
    #[serde(default, deserialize_with = "present")]
    fake: Option<Option<FakeMetrics>>,
}

fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CrashControl {
    /// Restart by itself after this long; absent stays down until the fleet control restarts it.
    restart_after_ms: Option<u64>,
}

async fn admin(
    shared: &Arc<Shared>,
    incarnation: &Incarnation,
    method: &Method,
    path: &str,
    body: &[u8],
) -> Response<Body> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    match (method, path) {
        (&Method::GET, "/admin/state") => json(StatusCode::OK, state_json(shared, incarnation)),
        (&Method::POST, "/admin/config") => {
            let source = String::from_utf8_lossy(body);
            let current = shared.params.load_full();
            match crate::decode::parse_params(&source, &current) {
                Ok(params) => {
                    apply_params(shared, incarnation, params);
                    json(StatusCode::OK, state_json(shared, incarnation))
                }
                Err(problem) => error(StatusCode::BAD_REQUEST, &problem.to_string()),
            }
        }
        (&Method::POST, "/admin/metrics") => {
            let control: MetricsControl = match serde_json::from_slice(body) {
                Ok(control) => control,
                Err(problem) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "expected {{\"mode\": \"live|frozen|hang|fail|garbage\", \"fake\": \
                             {{\"waiting\", \"running\", \"kv_usage\"}} | null}}: {problem}"
                        ),
                    );
                }
            };
            if control.mode == Some(MetricsMode::Frozen) {
                *lock(&shared.frozen) = Some(render(shared, incarnation));
            }
            let mut controls = lock(&shared.controls);
            if let Some(mode) = control.mode {
                controls.metrics = mode;
            }
            if let Some(fake) = control.fake {
                controls.fake = fake;
            }
            drop(controls);
            json(StatusCode::OK, state_json(shared, incarnation))
        }
        (&Method::POST, "/admin/pause") => {
            shared.paused.send_replace(true);
            json(StatusCode::OK, state_json(shared, incarnation))
        }
        (&Method::POST, "/admin/resume") => {
            shared.paused.send_replace(false);
            json(StatusCode::OK, state_json(shared, incarnation))
        }
        (&Method::POST, "/admin/crash") => {
            let control: CrashControl = match serde_json::from_slice(body) {
                Ok(control) => control,
                Err(problem) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("expected {{\"restart_after_ms\": N}} or nothing: {problem}"),
                    );
                }
            };
            // Answer first, then die: the caller learns the crash was accepted.
            let shared = Arc::clone(shared);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                kill(&shared).await;
                if let Some(after) = control.restart_after_ms {
                    tokio::time::sleep(Duration::from_millis(after)).await;
                    let _ = restart(&shared).await;
                }
            });
            json(StatusCode::ACCEPTED, b"{\"crashing\": true}".to_vec())
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no admin route {method} {path}"),
        ),
    }
}

/// Installs new parameters; limits apply to the models at once (and may admit waiting requests),
/// timings from each request's next step.
fn apply_params(shared: &Shared, incarnation: &Incarnation, params: SimParams) {
    for rank in &incarnation.ranks {
        let mut rank = lock(rank);
        let admitted =
            rank.model
                .set_limits(params.kv_blocks, params.max_running, params.max_queue);
        rank.wake(admitted);
    }
    shared.params.store(Arc::new(params));
}

fn state_json(shared: &Shared, incarnation: &Incarnation) -> Vec<u8> {
    let params = shared.params.load_full();
    let controls = *lock(&shared.controls);
    let ranks: Vec<serde_json::Value> = incarnation
        .stats()
        .iter()
        .map(|rank| {
            serde_json::json!({
                "rank": rank.rank,
                "running": rank.running,
                "waiting": rank.waiting,
                "waiting_uncached_tokens": rank.waiting_uncached_tokens,
                "kv_used_blocks": rank.kv_used_blocks,
                "kv_pinned_blocks": rank.kv_pinned_blocks,
                "kv_total_blocks": rank.kv_total_blocks,
                "block_size": rank.block_size,
                "max_running": rank.max_running,
                "prompt_tokens": rank.counters.prompt_tokens,
                "generation_tokens": rank.counters.generation_tokens,
                "prefix_queried_tokens": rank.counters.prefix_queried_tokens,
                "prefix_hit_tokens": rank.counters.prefix_hit_tokens,
                "finished": rank.counters.finished_length,
                "aborted": rank.counters.aborted,
                "rejected": rank.counters.rejected,
                "evicted_blocks": rank.counters.evicted_blocks,
            })
        })
        .collect();
    let value = serde_json::json!({
        "id": shared.id,
        "index": shared.spec.index,
        "engine": shared.spec.engine.as_str(),
        "model": shared.spec.model,
        "paused": *shared.paused.borrow(),
        "metrics_mode": controls.metrics,
        "fake_metrics": controls.fake,
        "params": params_json(&params),
        "ranks": ranks,
    });
    serde_json::to_vec_pretty(&value).unwrap_or_default()
}

fn params_json(params: &SimParams) -> serde_json::Value {
    let ms = |duration: Duration| duration.as_secs_f64() * 1000.0;
    serde_json::json!({
        "kv_blocks": params.kv_blocks,
        "max_running": params.max_running,
        "max_queue": params.max_queue,
        "max_model_len": params.max_model_len,
        "default_max_tokens": params.default_max_tokens,
        "prefill_overhead_ms": ms(params.prefill_overhead),
        "prefill_per_token_ms": ms(params.prefill_per_token),
        "inter_token_latency_ms": ms(params.inter_token_latency),
        "load_slowdown": params.load_slowdown,
        "jitter": params.jitter,
        "time_scale": params.time_scale,
        "failure_rate": params.failure_rate,
    })
}

// Responses.

fn json(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(BodyExt::boxed(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    let mut response = Response::new(BodyExt::boxed(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, wire::error_body(status.as_u16(), message))
}

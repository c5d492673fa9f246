//! One simulated worker: an HTTP/1.1 server on loopback that serves the engine's API, metrics,
//! discovery and admin endpoints over per-rank engines ([`crate::step::StepRank`] under the step model,
//! [`crate::model::RankModel`] under the slots model).
//!
//! A request's life: parse → (injected failure) → tokenize the whole prompt → the API server's front →
//! pick the least-loaded rank → submit to its engine (queued, or refused) → wait for admission → prefill
//! → decode → finish; under the step model the rank's engine loop admits, prefills and decodes it step by
//! step.
//! Everything after submission holds a `Ticket` (in `generate`), whose drop tells the model the
//! request ended, so a client that goes away mid-queue or mid-stream frees its slot exactly as an engine
//! aborts a request. A streamed response is generated inside its body, on the connection's task:
//! crashing the worker aborts the connection tasks and with them every stream, the way a dying process
//! drops its sockets.
//!
//! With KV cache events on, every rank also has a publisher task ([`crate::kv_events`]) that lives and
//! dies with the incarnation: the model records its cache changes, and the rank hands them to its
//! publisher as one numbered batch, without waiting — after each slots-model call, at the end of each
//! step under the step model.
//!
//! Here: the worker, its ranks and the routing, and what an in-process observer (the replay's oracle)
//! may read of it. The worker's life (start, kill, restart) is in `life`, a rank's engine and the step
//! loop in `engine`, a request's generation in `generate`, the admin controls and the metrics modes
//! they set in `admin`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use cachepick_tokenizer::Tokenizer;

use crate::config::{Engine, KvEventsConfig, SimParams, Timing};
use crate::expo::Identity;
use crate::kv_events::KvEventEndpoints;
use crate::kv_events::publisher::{PublisherSpec, RankStream};
use crate::model::Admission;
use crate::stats::{Histogram, REQUEST_LATENCY_BUCKETS, RankStats, TOKEN_BUCKETS};
use crate::wire;

mod admin;
mod api;
mod bootstrap;
mod engine;
mod generate;
mod life;
mod nixl;
mod routes;
mod tokenize;

use engine::RankEngine;

pub use admin::{FakeMetrics, MetricsMode};
pub use bootstrap::Disaggregation;
pub(crate) use generate::tokens;

use admin::Controls;
use life::{bind_kv_events, kill, launch, restart};

type Body = BoxBody<Bytes, Infallible>;

/// Request bodies larger than this are refused with 413 before they are parsed.
const MAX_REQUEST_BYTES: usize = 64 << 20;

/// The header a request's sender may tag it with, so the sender can later ask the worker whether the
/// request has reached a rank's queue ([`Worker::take_arrived`]): the replay's oracle uses it to know
/// which of its dispatches it still has to count as in flight.
pub const DISPATCH_TAG: &str = "x-sim-dispatch-tag";

/// A tagged request on its way to a rank: marked arrived once it is queued, refused or failed (on
/// drop at the latest), so its sender stops counting it as in flight.
pub(super) struct Arrival {
    shared: Arc<Shared>,
    tag: Option<u64>,
}

impl Arrival {
    pub(super) fn arrived(&mut self) {
        if let Some(tag) = self.tag.take() {
            lock(&self.shared.arrived).insert(tag);
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.arrived();
    }
}

/// What a worker is and serves; fixed for its life.
#[derive(Clone)]
pub struct WorkerSpec {
    pub index: u32,
    pub addr: SocketAddr,
    pub engine: Engine,
    pub model: String,
    pub dp_size: u32,
    pub block_size: std::num::NonZeroU32,
    pub timing: Timing,
    pub seed: u64,
    pub tokenizer: Arc<Tokenizer>,
    /// How `/server_info` names the tokenizer.
    pub tokenizer_name: String,
    pub params: SimParams,
    /// KV cache events; `None` publishes nothing.
    pub kv_events: Option<KvEventsSpec>,
    /// SGLang's `disaggregation_mode`; always `Null` for vLLM, whose workers serve either leg.
    pub disaggregation: Disaggregation,
}

/// How a worker publishes KV cache events, and on which ports.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsSpec {
    pub config: KvEventsConfig,
    /// Rank 0's PUB port; rank `r` uses this plus `r`. `None` takes a free run of ports.
    pub live_port: Option<u16>,
    /// Rank 0's ROUTER port (with replay on); rank `r` uses this plus `r`. `None` takes a free run.
    pub replay_port: Option<u16>,
}

/// One rank: its engine, and its latency histograms.
struct Rank {
    engine: RankEngine,
    ttft: Histogram,
    e2e: Histogram,
    /// vLLM's per-request phases (`RankStats::queue_time` and its neighbours), observed by the step
    /// model's engine loop when a request finishes.
    queue_time: Histogram,
    prefill_time: Histogram,
    prefill_tokens: Histogram,
    /// The rank's KV event stream, when events are on.
    events: Option<RankStream>,
}

impl Rank {
    /// Publishes what the last slots-model call changed in the cache as one batch (nothing when it
    /// changed nothing). Called under the rank's lock right after every model call that can change the
    /// cache. A step model's changes wait for its step to end ([`Rank::flush_events`]).
    fn publish_events(&mut self) {
        if matches!(self.engine, RankEngine::Slots { .. }) {
            self.flush_events();
        }
    }

    /// Publishes every cache change recorded so far as one batch: the step model's engine loop at the
    /// end of each step, and a prefix-cache reset.
    fn flush_events(&mut self) {
        if let Some(stream) = &mut self.events {
            let events = self.engine.take_events();
            if !events.is_empty() {
                stream.push(events);
            }
        }
    }

    /// Wakes the requests the slots model admitted.
    fn wake(&mut self, admitted: Vec<Admission>) {
        self.engine.wake(admitted);
    }

    fn stats(&self) -> RankStats {
        let mut stats = self.engine.stats();
        stats.ttft = self.ttft.clone();
        stats.e2e = self.e2e.clone();
        stats.queue_time = self.queue_time.clone();
        stats.prefill_time = self.prefill_time.clone();
        stats.prefill_tokens = self.prefill_tokens.clone();
        stats
    }
}

/// The state one run of the worker owns; a restart starts a new one, empty, as a restarted engine is.
struct Incarnation {
    ranks: Vec<Mutex<Rank>>,
    /// When this run started, in seconds since the Unix epoch.
    started: f64,
    /// Finished prefills' KV kept for their decode workers (`nixl`); a restart loses them.
    leases: nixl::Leases,
    /// Finished SGLang prefills waiting for their decode workers (`bootstrap`); a restart loses them.
    rooms: bootstrap::Rooms,
}

impl Incarnation {
    /// Fresh ranks; `streams[r]` is rank `r`'s event stream (none when events are off).
    fn new(
        spec: &WorkerSpec,
        params: &SimParams,
        streams: Vec<RankStream>,
        started: f64,
    ) -> Incarnation {
        let mut streams = streams.into_iter();
        let ranks = (0..spec.dp_size)
            .map(|rank| {
                let mut engine =
                    RankEngine::new(rank, spec.engine, spec.timing, spec.block_size, params);
                let events = streams.next();
                engine.record_events(events.is_some());
                Mutex::new(Rank {
                    engine,
                    ttft: Histogram::default(),
                    e2e: Histogram::default(),
                    queue_time: Histogram::over(REQUEST_LATENCY_BUCKETS),
                    prefill_time: Histogram::over(REQUEST_LATENCY_BUCKETS),
                    prefill_tokens: Histogram::over(TOKEN_BUCKETS),
                    events,
                })
            })
            .collect();
        Incarnation {
            ranks,
            started,
            leases: nixl::Leases::default(),
            rooms: bootstrap::Rooms::default(),
        }
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
            .min_by_key(|(_, rank)| (rank.engine.waiting(), rank.engine.running()))
            .map(|(index, _)| index)?;
        guards
            .into_iter()
            .enumerate()
            .find(|(index, _)| *index == chosen)
    }

    /// Every rank's stats; `transferring` decode legs (waiting for their KV) count as waiting on the
    /// first rank, as vLLM counts `WAITING_FOR_REMOTE_KVS` requests in `num_requests_waiting`.
    fn stats(&self, transferring: u64) -> Vec<RankStats> {
        self.ranks
            .iter()
            .enumerate()
            .map(|(index, rank)| {
                let stats = lock(rank).stats();
                let extra = if index == 0 { transferring } else { 0 };
                RankStats {
                    process_start_time: self.started,
                    waiting: stats.waiting.saturating_add(extra),
                    ..stats
                }
            })
            .collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic under the lock cannot leave a rank half-updated in a way that matters more than losing
    // the whole simulated worker would, so the state is used as it is.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The running or crashed server.
enum Life {
    Up {
        incarnation: Arc<Incarnation>,
        server: JoinHandle<()>,
        /// Tells the accept loop to cut every connection and return.
        stop: oneshot::Sender<()>,
        /// The ranks' KV event publishers; aborting one closes its sockets and loses its ring.
        publishers: Vec<JoinHandle<()>>,
        /// The ranks' engine loops (the step model), which die with the run.
        loops: Vec<JoinHandle<()>>,
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
    /// Where the ranks publish KV cache events, fixed for the worker's life.
    kv_events: Option<KvEventEndpoints>,
    kv_publisher: Option<Arc<PublisherSpec>>,
    /// The last run's start time, so a restart's is always later even if the clock steps back.
    last_start: Mutex<f64>,
    /// Tags of tagged requests that have reached a rank (or ended) and that their sender has not taken.
    arrived: Mutex<std::collections::HashSet<u64>>,
    /// Decode legs waiting for their KV to be pulled (`nixl`).
    transferring: AtomicU64,
    /// When the worker's link is free of the transfers queued on it.
    link_free: Mutex<tokio::time::Instant>,
    /// When the API server's one loop is free of the work queued on it ([`api_work`]).
    api_free: Mutex<tokio::time::Instant>,
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
    #[error("cannot bind the KV event ports ({what}): {source}")]
    KvEvents {
        what: String,
        source: std::io::Error,
    },
}

impl Worker {
    /// Binds `spec.addr` (port 0 takes a free one) and starts serving.
    pub async fn start(mut spec: WorkerSpec) -> Result<Worker, StartError> {
        let listener = life::bind_http(spec.addr).map_err(|source| StartError::Bind {
            addr: spec.addr,
            source,
        })?;
        spec.addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: spec.addr,
            source,
        })?;
        let (kv_events, kv_listeners) = match &spec.kv_events {
            Some(events) => {
                let (endpoints, listeners) = bind_kv_events(&spec, events)?;
                (Some(endpoints), listeners)
            }
            None => (None, Vec::new()),
        };
        let kv_publisher = spec
            .kv_events
            .as_ref()
            .map(|events| Arc::new(PublisherSpec::new(&events.config, spec.block_size.get())));
        let shared = Arc::new(Shared {
            id: spec.addr.to_string(),
            params: ArcSwap::from_pointee(spec.params.clone()),
            controls: Mutex::new(Controls::default()),
            frozen: Mutex::new(None),
            paused: watch::Sender::new(false),
            life: Mutex::new(Life::Down),
            next_request: AtomicU64::new(0),
            rng: Mutex::new(SmallRng::seed_from_u64(spec.seed)),
            kv_events,
            kv_publisher,
            last_start: Mutex::new(0.0),
            arrived: Mutex::new(std::collections::HashSet::new()),
            transferring: AtomicU64::new(0),
            link_free: Mutex::new(tokio::time::Instant::now()),
            api_free: Mutex::new(tokio::time::Instant::now()),
            spec,
        });
        launch(&shared, listener, kv_listeners);
        Ok(Worker { shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.spec.addr
    }

    pub fn index(&self) -> u32 {
        self.shared.spec.index
    }

    /// Where and in which format the ranks publish KV cache events; `None` when events are off.
    pub fn kv_events(&self) -> Option<&KvEventEndpoints> {
        self.shared.kv_events.as_ref()
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
        current(&self.shared).map_or_else(Vec::new, |incarnation| {
            incarnation.stats(
                self.shared
                    .transferring
                    .load(std::sync::atomic::Ordering::Relaxed),
            )
        })
    }

    pub fn params(&self) -> SimParams {
        SimParams::clone(&self.shared.params.load())
    }

    /// What every rank holds of a prompt of these token ids, and how long the model predicts it would
    /// take there to a first token behind the prompts `in_flight` to this worker (sent, not yet in a
    /// queue): the true state, which only an oracle in the same process can read (`cachepick replay`'s
    /// limit). Empty under the slots model and for a worker that is down.
    pub fn outlook(&self, tokens: &[u32], in_flight: &[&[u32]]) -> Vec<RankOutlook> {
        let Some(incarnation) = current(&self.shared) else {
            return Vec::new();
        };
        let params = self.shared.params.load();
        (0u32..)
            .zip(&incarnation.ranks)
            .filter_map(|(rank, state)| {
                let state = lock(state);
                let seconds = state.engine.predict_ttft(tokens, in_flight, &params)?;
                Some(RankOutlook {
                    rank,
                    cached_tokens: state.engine.cached_tokens(tokens),
                    predicted_ttft: seconds + params.profile.front,
                })
            })
            .collect()
    }

    /// What each rank's cache holds of a prompt of these token ids, rank by rank: the true state, as
    /// an index fed by KV events would see it with no lag (`cachepick replay`'s re-implemented peer
    /// routers read it). Empty for a worker that is down.
    pub fn cached_tokens(&self, tokens: &[u32]) -> Vec<u32> {
        let Some(incarnation) = current(&self.shared) else {
            return Vec::new();
        };
        incarnation
            .ranks
            .iter()
            .map(|state| lock(state).engine.cached_tokens(tokens))
            .collect()
    }
}

impl Worker {
    /// Of `tags` (sent in [`DISPATCH_TAG`]), those whose requests have reached a rank's queue or
    /// ended; they are forgotten as they are returned.
    pub fn take_arrived(&self, tags: &[u64]) -> Vec<u64> {
        let mut arrived = lock(&self.shared.arrived);
        tags.iter()
            .copied()
            .filter(|tag| arrived.remove(tag))
            .collect()
    }
}

/// One rank's share of a prompt and the model's prediction for it ([`Worker::outlook`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankOutlook {
    pub rank: u32,
    /// Prompt tokens its cache holds.
    pub cached_tokens: u32,
    /// Model seconds to the first token, the API server's front included.
    pub predicted_ttft: f64,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // No await in a drop: the port closes once the runtime drops the aborted task.
        if let Life::Up {
            server,
            publishers,
            loops,
            ..
        } = std::mem::replace(&mut *lock(&self.shared.life), Life::Down)
        {
            server.abort();
            for task in publishers.into_iter().chain(loops) {
                task.abort();
            }
        }
    }
}

fn current(shared: &Shared) -> Option<Arc<Incarnation>> {
    match &*lock(&shared.life) {
        Life::Up { incarnation, .. } => Some(Arc::clone(incarnation)),
        Life::Down => None,
    }
}

/// Sleeps until `until` without counting time spent paused: a pause during the sleep pushes the end
/// back by its length, as a stopped engine makes no progress. Returns the end it slept to.
async fn sleep_unpaused(shared: &Shared, mut until: tokio::time::Instant) -> tokio::time::Instant {
    let mut paused = shared.paused.subscribe();
    loop {
        if *paused.borrow_and_update() {
            let since = tokio::time::Instant::now();
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
            _ = &mut stop => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // EMFILE and the like fail again at once: pause instead of spinning.
                    tokio::select! {
                        _ = &mut stop => break,
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
                            let mut response = routes::route(shared, incarnation, request).await;
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
    drop(listener);
    connections.shutdown().await;
}

/// The routing headers the request arrived with (`x-gateway-*`, `x-cachepick-*`, llm-d's
/// `x-prefiller-host-port`, and the `traceparent` and `x-request-id` an engine's tracing reads), renamed
/// `x-sim-echo-<name>`: what a gateway in front told this worker, visible to the client and to tests.
fn routing_headers(headers: &http::HeaderMap) -> Vec<(http::HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-gateway-")
                || name.starts_with("x-cachepick-")
                || name == "x-prefiller-host-port"
                || name == "traceparent"
                || name == "x-request-id"
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
        disaggregation: shared.spec.disaggregation.as_str(),
        bootstrap_port: shared.spec.addr.port(),
        kv_events: shared.kv_events.as_ref(),
    }
}

// Responses.

/// A whole body of `content_type`.
fn full(status: StatusCode, body: impl Into<Bytes>, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(BodyExt::boxed(Full::new(body.into())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn json(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    full(status, body, "application/json")
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    full(status, body, "text/plain; charset=utf-8")
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, wire::error_body(status.as_u16(), message))
}

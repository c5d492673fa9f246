//! The per-pool scraper: reads every worker's load each `scrape_interval` and publishes whole snapshots.
//!
//! One task per pool keeps every worker's latest sample per data-parallel rank. Each tick it starts a
//! request for every worker that has none in flight, at most `max_concurrent_scrapes` at a time, each
//! bounded by `scrape_timeout` and `max_body_bytes`. Results are applied as they arrive and a new
//! snapshot is published right away, so a hung worker delays nobody else's sample; routing decisions read
//! whichever snapshot is current and never wait on a scrape. A failed scrape keeps the old rank samples,
//! which age out of `freshness` on their own: staleness is a property of time, not of the last outcome.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use prometheus::IntCounter;
use thiserror::Error;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::MissedTickBehavior;

use super::dispatch::DispatchTable;
use super::engine::{self, ExtractError, Identity, RankLoad, Report};
use super::snapshot::DispatchCounts;
use super::snapshot::{
    Capacity, EngineLoad, Lifecycle, PoolSnapshot, Reading, ScrapeOutcome, WorkerState,
};
use super::tls::{HttpClient, ScrapeTlsClient};
use crate::config::{
    Config, Discovery, LoadConfig, LoadSource, ModelMatch, PoolConfig, WorkerConfig,
};
use crate::worker::{Engine, WorkerId};

/// A warning that the gate is blind is repeated at most this often per pool.
const BLIND_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Why one scrape produced no report.
#[derive(Debug, Error)]
pub enum ScrapeError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("invalid scrape URL: {0}")]
    Url(String),
    #[error("answered HTTP {0}")]
    Status(http::StatusCode),
    #[error("request failed: {0}")]
    Request(String),
    #[error("body larger than the {limit}-byte cap (load.max_body_bytes)")]
    BodyTooLarge { limit: usize },
    #[error("reading the body failed: {0}")]
    Body(String),
    #[error("body is not UTF-8 text")]
    NotUtf8,
    #[error(transparent)]
    Extract(#[from] ExtractError),
}

impl ScrapeError {
    pub fn outcome(&self) -> ScrapeOutcome {
        match self {
            ScrapeError::Timeout(_) => ScrapeOutcome::Timeout,
            ScrapeError::Connect(_) | ScrapeError::Url(_) => ScrapeOutcome::ConnectError,
            ScrapeError::Status(_)
            | ScrapeError::Request(_)
            | ScrapeError::BodyTooLarge { .. }
            | ScrapeError::Body(_) => ScrapeOutcome::HttpError,
            ScrapeError::NotUtf8 | ScrapeError::Extract(_) => ScrapeOutcome::ParseError,
        }
    }
}

/// What a scraper reports to: the process's metrics, implemented there (`metrics` may import `load`,
/// not the other way round). Asked only while the scraper is built.
pub trait ScrapeObserver: Send + Sync {
    /// The counter of `worker`'s scrapes in `pool` that end in `outcome`; asked once per worker and
    /// outcome, incremented by the scraper on every scrape.
    fn scrape_counter(&self, pool: &str, worker: &str, outcome: ScrapeOutcome) -> IntCounter;
    /// `pool`'s snapshots are to be reported from now on (the freshness gauges).
    fn watch_pool(&self, pool: Arc<PoolLoad>);
    /// `worker` left `pool`: its counters go, so a churning fleet does not grow the metrics forever.
    fn worker_left(&self, pool: &str, worker: &str);
}

/// What the request path shares with a pool's scraper: the current snapshot and the dispatch counts.
#[derive(Debug)]
pub struct PoolLoad {
    label: String,
    current: ArcSwap<PoolSnapshot>,
    dispatches: DispatchTable,
    rounds: watch::Sender<u64>,
    /// The workers discovery wants in the pool (the file's list, DNS, Kubernetes): the scraper
    /// reconciles its roster against the latest value.
    desired: watch::Sender<Arc<[WorkerConfig]>>,
    /// Bumped each time a published snapshot changes who is in the pool or in which state, so
    /// followers (the index, the event feeds, EDS) need not compare every snapshot.
    roster: watch::Sender<u64>,
    /// Restarts seen elsewhere (a KV event stream whose sequence started over), for the scraper.
    restarts: mpsc::UnboundedSender<WorkerId>,
    /// Taken by the pool's scraper.
    restart_reports: Mutex<Option<mpsc::UnboundedReceiver<WorkerId>>>,
}

impl PoolLoad {
    /// Every pool's load state of `config`, in configuration order, with no readings yet: what a picker
    /// is built on (the scrapers that fill them are started separately, or not at all in tests).
    pub fn for_pools(config: &Config) -> Vec<Arc<Self>> {
        config
            .pools
            .iter()
            .map(|pool| PoolLoad::new(pool, &config.load))
            .collect()
    }

    /// The pool's roster with no readings yet, and capacities from configuration where given.
    pub fn new(pool: &PoolConfig, load: &LoadConfig) -> Arc<Self> {
        let workers = pool
            .workers
            .iter()
            .enumerate()
            .map(|(index, worker)| {
                let id = WorkerId(u32::try_from(index).unwrap_or(u32::MAX));
                let mut state = WorkerState::new(id, worker.endpoint, worker.role);
                state.ranks = worker.dp_size.get();
                state.capacity = Capacity {
                    max_running: worker.max_running_requests.map(|max| max.get()),
                    max_total_tokens: worker.max_total_tokens.map(|max| max.get()),
                };
                state
            })
            .collect();
        let (restarts, restart_reports) = mpsc::unbounded_channel();
        Arc::new(PoolLoad {
            label: pool_label(&pool.model).to_owned(),
            current: ArcSwap::from_pointee(PoolSnapshot::new(0, load.freshness, workers)),
            dispatches: DispatchTable::new(pool.max_workers.get().max(pool.workers.len())),
            rounds: watch::channel(0).0,
            desired: watch::channel(pool.workers.clone().into()).0,
            roster: watch::channel(0).0,
            restarts,
            restart_reports: Mutex::new(Some(restart_reports)),
        })
    }

    /// The pool's name in metrics and logs: its model, or `*`.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The current snapshot; hold it for one decision, never across an await.
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.current.load_full()
    }

    pub fn dispatches(&self) -> &DispatchTable {
        &self.dispatches
    }

    /// Completed scrape rounds; a pool is ready once this is at least 1.
    pub fn rounds(&self) -> watch::Receiver<u64> {
        self.rounds.subscribe()
    }

    /// Where discovery publishes the workers it wants in the pool; `discovery::publish` sends only
    /// changes.
    pub fn desired(&self) -> &watch::Sender<Arc<[WorkerConfig]>> {
        &self.desired
    }

    /// The engine of the worker in slot `id` restarted, as a KV event stream saw: its scraper marks it
    /// `restarted` as it does for a restart seen in a scrape.
    pub fn report_restart(&self, id: WorkerId) {
        let _ = self.restarts.send(id);
    }

    /// Changes when a snapshot with a different roster (workers, states, restarts) is published.
    pub fn roster_changes(&self) -> watch::Receiver<u64> {
        self.roster.subscribe()
    }
}

fn pool_label(model: &ModelMatch) -> &str {
    match model {
        ModelMatch::Exact(name) => name,
        ModelMatch::Any => "*",
    }
}

/// What the rest of the picker does when the roster changes, implemented by the request path (`load`
/// cannot import it). Called synchronously, before the snapshot that shows the change is published,
/// so no decision reads a roster the owner index has not caught up with.
pub trait RosterObserver: Send + Sync {
    /// `worker` takes slot `id`, free or freed: nothing recorded for the slot counts for it.
    fn joined(&self, id: WorkerId, worker: &WorkerConfig);
    /// The worker in slot `id` left the pool; the slot may be taken again.
    fn left(&self, id: WorkerId);
    /// The engine of the worker in slot `id` restarted: its cache is empty.
    fn restarted(&self, id: WorkerId);
}

/// One worker as the scraper tracks it.
struct Tracked {
    id: WorkerId,
    /// As discovery described it; a changed description is applied in place.
    config: WorkerConfig,
    state: WorkerState,
    target: Arc<Target>,
    /// Latest sample of each rank, with when it was requested.
    ranks: Vec<Option<(Instant, RankLoad)>>,
    configured: Capacity,
    in_flight: bool,
    /// `cachepick_scrapes_total` for this worker, one handle per outcome (in `ScrapeOutcome::ALL` order).
    counters: Vec<IntCounter>,
    /// Scrapes in a row that could not connect or timed out.
    failures: u32,
    /// The engine run the last answer came from.
    identity: Option<Identity>,
    /// When the state last changed to `Restarted` or `Draining`.
    since: Instant,
}

/// What a request needs to know about its worker; shared with the in-flight future.
struct Target {
    url: Result<Uri, String>,
    source: LoadSource,
    engine: Engine,
    dp_size: u32,
}

impl Target {
    fn new(worker: &WorkerConfig, engine: Engine) -> Self {
        let url = worker.scrape_url();
        Target {
            url: url
                .parse::<Uri>()
                .map_err(|error| format!("{url}: {error}")),
            source: worker.load_source,
            engine,
            dp_size: worker.dp_size.get(),
        }
    }
}

/// A finished request: the worker (slot and generation), round, when it was sent, the dispatch count at
/// that moment, result.
type Fetched = (
    (WorkerId, u64),
    u64,
    Instant,
    u64,
    Result<Report, ScrapeError>,
);

/// Scrapes one pool. Owned by its task; shares only [`PoolLoad`] with the request path.
pub struct Scraper {
    pool: Arc<PoolLoad>,
    /// By increasing id.
    workers: Vec<Tracked>,
    engine: Engine,
    client: HttpClient,
    config: LoadConfig,
    limiter: Arc<Semaphore>,
    version: u64,
    /// Rounds started, which tags each request.
    round: u64,
    completed_rounds: u64,
    last_blind_warning: Option<Instant>,
    observer: Arc<dyn ScrapeObserver>,
    roster: Option<Arc<dyn RosterObserver>>,
    desired: watch::Receiver<Arc<[WorkerConfig]>>,
    /// Restarts reported by the KV event streams; `None` when another scraper of the pool took them.
    restarts: Option<mpsc::UnboundedReceiver<WorkerId>>,
    /// Slots no worker holds, lowest first.
    free: BTreeSet<u32>,
    /// The next occupant's generation.
    generation: u64,
    /// What the last published snapshot's roster looked like.
    roster_key: Vec<(WorkerId, u64, Lifecycle, u64)>,
    last_full_warning: Option<Instant>,
    /// A discovered pool's source has not answered yet: until it has, an empty roster is not a
    /// completed round (the pool is not ready with no workers it was never told of).
    awaiting_source: bool,
}

impl Scraper {
    pub fn new(
        pool_config: &PoolConfig,
        config: &LoadConfig,
        pool: Arc<PoolLoad>,
        observer: Arc<dyn ScrapeObserver>,
    ) -> Self {
        let roster = pool.snapshot();
        let slots = u32::try_from(pool.dispatches.len()).unwrap_or(u32::MAX);
        let mut free: BTreeSet<u32> = (0..slots).collect();
        let mut desired = pool.desired.subscribe();
        // The file's workers are in the first snapshot already; what discovery sends later is news.
        desired.mark_unchanged();
        let restarts = pool
            .restart_reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut scraper = Scraper {
            workers: Vec::new(),
            engine: pool_config.engine,
            client: HttpClient::new(config, None),
            config: config.clone(),
            limiter: Arc::new(Semaphore::new(config.max_concurrent_scrapes.get())),
            version: roster.version,
            round: 0,
            completed_rounds: 0,
            last_blind_warning: None,
            observer: Arc::clone(&observer),
            roster: None,
            restarts,
            desired,
            free: BTreeSet::new(),
            generation: 0,
            roster_key: Vec::new(),
            last_full_warning: None,
            awaiting_source: pool_config.discovery != Discovery::Static,
            pool,
        };
        let now = Instant::now();
        for (worker, state) in pool_config.workers.iter().zip(roster.workers()) {
            free.remove(&state.id.0);
            scraper.generation = scraper.generation.max(state.generation + 1);
            scraper
                .workers
                .push(scraper.track(worker, state.clone(), now));
        }
        scraper.free = free;
        scraper.roster_key = roster_key(&roster);
        observer.watch_pool(Arc::clone(&scraper.pool));
        scraper
    }

    /// Scrapes `https://` URLs with `tls` (`load.tls`); without it the scraper speaks plain HTTP only.
    pub fn with_tls(mut self, tls: &ScrapeTlsClient) -> Self {
        self.client = HttpClient::new(&self.config, Some(tls));
        self
    }

    /// Tells `roster` about every change of the roster from now on; the workers already present are
    /// announced as joining.
    pub fn with_roster(mut self, roster: Arc<dyn RosterObserver>) -> Self {
        for worker in &self.workers {
            roster.joined(worker.id, &worker.config);
        }
        self.roster = Some(roster);
        self
    }

    fn track(&self, worker: &WorkerConfig, state: WorkerState, now: Instant) -> Tracked {
        let label = self.pool.label();
        let endpoint = worker.endpoint.to_string();
        Tracked {
            id: state.id,
            config: worker.clone(),
            configured: state.capacity,
            state,
            target: Arc::new(Target::new(worker, self.engine)),
            ranks: vec![None; worker.dp_size.get() as usize],
            in_flight: false,
            counters: ScrapeOutcome::ALL
                .iter()
                .map(|outcome| self.observer.scrape_counter(label, &endpoint, *outcome))
                .collect(),
            failures: 0,
            identity: None,
            since: now,
        }
    }

    fn position(&self, id: WorkerId) -> Option<usize> {
        self.workers
            .binary_search_by_key(&id, |worker| worker.id)
            .ok()
    }

    /// Worker slots without a request in flight, those whose last scrape succeeded first: the permit
    /// queue is first-come, so this keeps failing or hung workers from holding up healthy ones.
    fn idle_healthy_first(&self) -> Vec<WorkerId> {
        let mut idle: Vec<(bool, WorkerId)> = self
            .workers
            .iter()
            .filter(|worker| !worker.in_flight)
            .map(|worker| {
                let failing = worker
                    .state
                    .scrape
                    .last_outcome
                    .is_some_and(|outcome| outcome != ScrapeOutcome::Ok);
                (failing, worker.id)
            })
            .collect();
        idle.sort_unstable();
        idle.into_iter().map(|(_, id)| id).collect()
    }

    /// Brings the roster to what discovery wants, if it said anything new since: the one-shot
    /// commands' step before their rounds ([`Scraper::run`] follows discovery by itself). Whether it
    /// did.
    pub fn follow_discovery(&mut self) -> bool {
        if !self.desired.has_changed().unwrap_or(false) {
            return false;
        }
        let desired = Arc::clone(&self.desired.borrow_and_update());
        self.awaiting_source = false;
        self.reconcile(&desired, Instant::now());
        self.publish();
        true
    }

    /// Scrapes every worker once, waits for all of them, and publishes: the `snapshot` command's round.
    pub async fn round(&mut self) {
        self.round += 1;
        let fetches: Vec<_> = self
            .idle_healthy_first()
            .into_iter()
            .map(|id| self.start(id))
            .collect();
        let results = futures_util::future::join_all(fetches).await;
        let now = Instant::now();
        for fetched in results {
            self.apply(fetched, now);
        }
        self.publish();
        self.finish_round(now);
    }

    /// Scrapes every `scrape_interval` until `shutdown` resolves, and follows discovery.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.config.scrape_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut in_flight = FuturesUnordered::new();
        // Requests still outstanding per round, so a round ends when its own requests do.
        let mut pending: BTreeMap<u64, usize> = BTreeMap::new();
        let mut discovering = true;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(id) = next_restart(&mut self.restarts) => {
                    if self.mark_restarted(id, Instant::now()) {
                        self.publish();
                    }
                }
                changed = self.desired.changed(), if discovering => {
                    if changed.is_err() {
                        // Nobody can send any more: the roster stays as it is.
                        discovering = false;
                        continue;
                    }
                    let desired = Arc::clone(&self.desired.borrow_and_update());
                    self.awaiting_source = false;
                    // Joiners are scraped at once: they serve only once they answer.
                    for id in self.reconcile(&desired, Instant::now()) {
                        in_flight.push(self.start(id));
                    }
                    self.publish();
                }
                _ = ticker.tick() => {
                    self.round += 1;
                    let now = Instant::now();
                    if self.expire(now) {
                        self.publish();
                    }
                    let idle = self.idle_healthy_first();
                    if idle.is_empty() {
                        // A round over no workers is complete at once, once the source has spoken.
                        if self.workers.is_empty() && !self.awaiting_source {
                            self.finish_round(now);
                        }
                        continue;
                    }
                    pending.insert(self.round, idle.len());
                    for id in idle {
                        in_flight.push(self.start(id));
                    }
                }
                Some(fetched) = in_flight.next(), if !in_flight.is_empty() => {
                    let now = Instant::now();
                    let mut done = vec![fetched.1];
                    self.apply(fetched, now);
                    // Apply everything that is already finished before publishing once.
                    while let Some(Some(fetched)) = in_flight.next().now_or_never() {
                        done.push(fetched.1);
                        self.apply(fetched, now);
                    }
                    self.publish();
                    for round in done {
                        if let Some(count) = pending.get_mut(&round) {
                            *count = count.saturating_sub(1);
                            if *count == 0 {
                                pending.remove(&round);
                                self.finish_round(Instant::now());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Brings the roster to `desired`: newcomers take free slots, workers no longer listed drain, a
    /// draining worker listed again stays, a changed description is applied. Returns the newcomers.
    fn reconcile(&mut self, desired: &[WorkerConfig], now: Instant) -> Vec<WorkerId> {
        let label = self.pool.label().to_owned();
        let wanted: BTreeMap<SocketAddr, &WorkerConfig> = desired
            .iter()
            .map(|worker| (worker.endpoint, worker))
            .collect();
        for worker in &mut self.workers {
            match wanted.get(&worker.state.endpoint) {
                None if worker.state.lifecycle != Lifecycle::Draining => {
                    tracing::info!(pool = %label, worker = %worker.state.endpoint, "worker left discovery; draining");
                    worker.state.lifecycle = Lifecycle::Draining;
                    worker.since = now;
                }
                None => {}
                Some(config) => {
                    if worker.state.lifecycle == Lifecycle::Draining {
                        tracing::info!(pool = %label, worker = %worker.state.endpoint, "worker back in discovery");
                        worker.state.lifecycle =
                            answered_state(worker.failures, self.config.unreachable_after);
                    }
                    if **config != worker.config {
                        worker.reconfigure(config, self.engine);
                    }
                }
            }
        }
        let mut joined = Vec::new();
        for (endpoint, config) in wanted {
            if self
                .workers
                .iter()
                .any(|worker| worker.state.endpoint == endpoint)
            {
                continue;
            }
            let Some(slot) = self.free.pop_first() else {
                if self
                    .last_full_warning
                    .is_none_or(|last| now.saturating_duration_since(last) >= BLIND_WARNING_EVERY)
                {
                    self.last_full_warning = Some(now);
                    tracing::warn!(pool = %label, worker = %endpoint, max_workers = self.pool.dispatches.len(),
                        "discovery lists more workers than max_workers; the rest are left out");
                }
                continue;
            };
            let id = WorkerId(slot);
            let mut state = WorkerState::new(id, endpoint, config.role);
            state.ranks = config.dp_size.get();
            state.generation = self.generation;
            self.generation += 1;
            state.capacity = configured_capacity(config);
            let tracked = self.track(config, state, now);
            if let Some(roster) = &self.roster {
                roster.joined(id, config);
            }
            self.pool.dispatches.reset(id);
            tracing::info!(pool = %label, worker = %endpoint, slot = id.0, "worker joined");
            let at = self.workers.partition_point(|worker| worker.id < id);
            self.workers.insert(at, tracked);
            joined.push(id);
        }
        joined
    }

    /// Time-driven changes: a drain that ran out, a restart that is old news. Whether anything changed.
    fn expire(&mut self, now: Instant) -> bool {
        let mut changed = false;
        let drain = self.config.drain_timeout;
        let leaving: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|worker| {
                worker.state.lifecycle == Lifecycle::Draining
                    && now.saturating_duration_since(worker.since) >= drain
            })
            .map(|worker| worker.id)
            .collect();
        for id in leaving {
            self.leave(id, "drain timeout");
            changed = true;
        }
        for worker in &mut self.workers {
            if worker.state.lifecycle == Lifecycle::Restarted
                && now.saturating_duration_since(worker.since) >= self.config.freshness
            {
                worker.state.lifecycle = Lifecycle::Healthy;
                changed = true;
            }
        }
        changed
    }

    /// The engine of the worker in slot `id` restarted: its prefixes are forgotten at once, and it shows
    /// `restarted` for one `freshness`. Whether a worker was there to mark.
    fn mark_restarted(&mut self, id: WorkerId, now: Instant) -> bool {
        let label = self.pool.label();
        let Some(worker) = self
            .position(id)
            .and_then(|at| self.workers.get_mut(at))
            .filter(|worker| worker.state.lifecycle != Lifecycle::Draining)
        else {
            return false;
        };
        tracing::warn!(pool = label, worker = %worker.state.endpoint, "worker engine restarted; its cached prefixes are forgotten");
        worker.state.lifecycle = Lifecycle::Restarted;
        worker.state.incarnation += 1;
        worker.since = now;
        self.pool.dispatches.reset(id);
        if let Some(roster) = &self.roster {
            roster.restarted(id);
        }
        true
    }

    /// Removes the worker in slot `id` and frees the slot.
    fn leave(&mut self, id: WorkerId, why: &str) {
        let Some(at) = self.position(id) else {
            return;
        };
        let worker = self.workers.remove(at);
        tracing::info!(pool = self.pool.label(), worker = %worker.state.endpoint, why, "worker left the pool");
        if let Some(roster) = &self.roster {
            roster.left(id);
        }
        self.observer
            .worker_left(self.pool.label(), &worker.state.endpoint.to_string());
        self.pool.dispatches.reset(id);
        self.free.insert(id.0);
    }

    /// Starts a request for the worker in slot `id`; the future owns everything it needs.
    fn start(&mut self, id: WorkerId) -> impl Future<Output = Fetched> + use<> {
        let round = self.round;
        let dispatches = self.pool.dispatches();
        let request = self
            .position(id)
            .and_then(|at| self.workers.get_mut(at))
            .map(|worker| {
                worker.in_flight = true;
                (
                    Arc::clone(&worker.target),
                    dispatches.since_reading(worker.id),
                    worker.state.generation,
                )
            });
        let client = self.client.clone();
        let limiter = Arc::clone(&self.limiter);
        let (timeout, max_body) = (self.config.scrape_timeout, self.config.max_body_bytes);
        async move {
            let Some((target, dispatched, generation)) = request else {
                return (
                    (id, u64::MAX),
                    round,
                    Instant::now(),
                    0,
                    Err(ScrapeError::Url("no such worker".into())),
                );
            };
            // Closed only if the scraper is dropped, and then nobody reads the result.
            let _permit = limiter.acquire_owned().await;
            let sent = Instant::now();
            let result =
                match tokio::time::timeout(timeout, fetch(&client, &target, max_body)).await {
                    Ok(result) => result,
                    Err(_) => Err(ScrapeError::Timeout(timeout)),
                };
            ((id, generation), round, sent, dispatched, result)
        }
    }

    /// Records one result: rank samples, status, counters, dispatch count, and the worker's state.
    fn apply(&mut self, ((id, generation), _, sent, dispatched, result): Fetched, now: Instant) {
        let dispatches = self.pool.dispatches();
        let label = self.pool.label();
        let unreachable_after = self.config.unreachable_after;
        let Some(worker) = self
            .position(id)
            .and_then(|at| self.workers.get_mut(at))
            // The slot's worker left (and perhaps another took it) while the request was out.
            .filter(|worker| worker.state.generation == generation)
        else {
            return;
        };
        worker.in_flight = false;
        let outcome = match &result {
            Ok(_) => ScrapeOutcome::Ok,
            Err(error) => error.outcome(),
        };
        if let Some(counter) = ScrapeOutcome::ALL
            .iter()
            .position(|o| *o == outcome)
            .and_then(|position| worker.counters.get(position))
        {
            counter.inc();
        }
        let was_failing = worker
            .state
            .scrape
            .last_outcome
            .is_some_and(|o| o != ScrapeOutcome::Ok);
        let status = &mut worker.state.scrape;
        status.attempts += 1;
        status.last_outcome = Some(outcome);
        let unanswered = matches!(
            outcome,
            ScrapeOutcome::ConnectError | ScrapeOutcome::Timeout
        );
        worker.failures = if unanswered {
            worker.failures.saturating_add(1)
        } else {
            0
        };
        let mut restarted = false;
        let mut idle = false;
        match result {
            Ok(report) => {
                if let Some(earlier) = &worker.identity
                    && report.identity.restarted_since(earlier)
                {
                    restarted = true;
                    // The old run's samples describe a cache that is gone.
                    worker.ranks.iter_mut().for_each(|rank| *rank = None);
                }
                worker.identity = Some(report.identity);
                let before = worker.state.reading.map(|reading| reading.captured_at);
                for (slot, rank) in worker.ranks.iter_mut().zip(report.ranks) {
                    if let Some(rank) = rank {
                        *slot = Some((sent, rank));
                    }
                }
                let missing: Vec<String> = report_missing(&worker.ranks, sent);
                status.last_error = (!missing.is_empty()).then(|| {
                    Arc::from(format!(
                        "rank {} missing from the last response",
                        missing.join(", ")
                    ))
                });
                worker.state.reading = combine(&worker.ranks);
                worker.state.capacity = capacity(&worker.ranks, worker.configured);
                if let Some(reading) = worker.state.reading
                    && reading.complete
                    && before.is_none_or(|before| reading.captured_at > before)
                {
                    // The engine's numbers cover what was sent before the request, not what was sent
                    // while it was in flight.
                    dispatches.forget(worker.id, dispatched);
                    idle = reading.load.waiting == 0 && reading.load.running == 0;
                }
                if was_failing {
                    tracing::info!(pool = label, worker = %worker.state.endpoint, "worker scrape recovered");
                }
            }
            Err(error) => {
                if !was_failing {
                    tracing::warn!(pool = label, worker = %worker.state.endpoint, %error, "worker scrape failing");
                } else {
                    tracing::debug!(pool = label, worker = %worker.state.endpoint, %error, "worker scrape failed");
                }
                status.last_error = Some(Arc::from(error.to_string()));
            }
        }
        let endpoint = worker.state.endpoint;
        match worker.state.lifecycle {
            // A draining worker leaves once it has nothing left to serve or cannot be reached.
            Lifecycle::Draining => {
                if idle || unanswered {
                    let why = if idle {
                        "drained"
                    } else {
                        "unreachable while draining"
                    };
                    self.leave(id, why);
                }
            }
            _ if restarted => {
                self.mark_restarted(id, now);
            }
            Lifecycle::Restarted if unanswered => {
                worker.state.lifecycle = answered_state(worker.failures, unreachable_after);
            }
            Lifecycle::Restarted => {}
            _ => {
                let next = answered_state(worker.failures, unreachable_after);
                let next = match (worker.state.lifecycle, next) {
                    // A new worker stays new until it answers once, however many failures.
                    (Lifecycle::New, Lifecycle::Healthy) if unanswered => Lifecycle::New,
                    _ => next,
                };
                if next != worker.state.lifecycle {
                    match next {
                        Lifecycle::Unreachable => tracing::warn!(pool = label, worker = %endpoint,
                            failures = worker.failures, "worker unreachable; not an owner until it answers"),
                        _ => {
                            tracing::info!(pool = label, worker = %endpoint, state = next.as_str(), "worker state")
                        }
                    }
                    worker.state.lifecycle = next;
                }
            }
        }
    }

    fn publish(&mut self) {
        self.version += 1;
        let workers = self
            .workers
            .iter()
            .map(|worker| worker.state.clone())
            .collect();
        let snapshot = PoolSnapshot::with_slots(self.version, self.config.freshness, workers);
        let key = roster_key(&snapshot);
        self.pool.current.store(Arc::new(snapshot));
        if key != self.roster_key {
            self.roster_key = key;
            self.pool.roster.send_modify(|version| *version += 1);
        }
    }

    /// End-of-round bookkeeping: the blind-gate warning and the completed-round count.
    fn finish_round(&mut self, now: Instant) {
        let snapshot = self.pool.snapshot();
        let total = snapshot.workers().len();
        let fresh = snapshot
            .workers()
            .iter()
            .filter(|worker| {
                worker
                    .reading
                    .is_some_and(|reading| snapshot.is_fresh(&reading, now))
            })
            .count();
        if fresh == 0
            && total > 0
            && self
                .last_blind_warning
                .is_none_or(|last| now.saturating_duration_since(last) >= BLIND_WARNING_EVERY)
        {
            self.last_blind_warning = Some(now);
            tracing::warn!(
                pool = self.pool.label(),
                workers = total,
                "no worker of the pool has a fresh load reading: the queue gate admits every owner blind"
            );
        }
        self.completed_rounds += 1;
        self.pool.rounds.send_replace(self.completed_rounds);
    }
}

impl Tracked {
    /// Applies a changed description from discovery: what is scraped, and how.
    fn reconfigure(&mut self, config: &WorkerConfig, engine: Engine) {
        if config.dp_size != self.config.dp_size {
            self.ranks = vec![None; config.dp_size.get() as usize];
            self.state.reading = None;
        }
        self.state.role = config.role;
        self.configured = configured_capacity(config);
        self.target = Arc::new(Target::new(config, engine));
        self.config = config.clone();
    }
}

/// The state of a worker that is not draining or restarted, after `failures` unanswered scrapes.
fn answered_state(failures: u32, unreachable_after: NonZeroU32) -> Lifecycle {
    if failures >= unreachable_after.get() {
        Lifecycle::Unreachable
    } else {
        Lifecycle::Healthy
    }
}

/// Capacities given in configuration, which override the engine's.
fn configured_capacity(worker: &WorkerConfig) -> Capacity {
    Capacity {
        max_running: worker.max_running_requests.map(|max| max.get()),
        max_total_tokens: worker.max_total_tokens.map(|max| max.get()),
    }
}

/// The next restart a KV event stream reported; pending forever without a receiver.
async fn next_restart(
    restarts: &mut Option<mpsc::UnboundedReceiver<WorkerId>>,
) -> Option<WorkerId> {
    match restarts {
        Some(restarts) => restarts.recv().await,
        None => std::future::pending().await,
    }
}

/// Who is in the pool and in which state: a change of it is a roster change.
fn roster_key(snapshot: &PoolSnapshot) -> Vec<(WorkerId, u64, Lifecycle, u64)> {
    snapshot
        .workers()
        .iter()
        .map(|worker| {
            (
                worker.id,
                worker.generation,
                worker.lifecycle,
                worker.incarnation,
            )
        })
        .collect()
}

/// Ranks with no sample at all, or whose sample predates the latest request (the response lacked them).
fn report_missing(ranks: &[Option<(Instant, RankLoad)>], sent: Instant) -> Vec<String> {
    ranks
        .iter()
        .enumerate()
        .filter(|(_, rank)| rank.is_none_or(|(at, _)| at < sent))
        .map(|(index, _)| index.to_string())
        .collect()
}

/// Sums the ranks into one reading, stamped with the oldest rank's time. Complete only when every rank
/// has a sample; an optional measure is summed only when every present rank has it.
fn combine(ranks: &[Option<(Instant, RankLoad)>]) -> Option<Reading> {
    let present = || ranks.iter().flatten();
    let captured_at = present().map(|(at, _)| *at).min()?;
    let sum_all = |field: fn(&RankLoad) -> Option<u64>| -> Option<u64> {
        present().try_fold(0_u64, |sum, (_, rank)| {
            field(rank).map(|value| sum.saturating_add(value))
        })
    };
    Some(Reading {
        captured_at,
        complete: present().count() == ranks.len(),
        load: EngineLoad {
            waiting: present().fold(0, |sum, (_, rank)| sum.saturating_add(rank.waiting)),
            running: present().fold(0, |sum, (_, rank)| sum.saturating_add(rank.running)),
            waiting_uncached_tokens: sum_all(|rank| rank.waiting_uncached_tokens),
            used_tokens: sum_all(|rank| rank.used_tokens),
        },
    })
}

/// Capacity summed over ranks when every rank reported it; configuration overrides the engine.
fn capacity(ranks: &[Option<(Instant, RankLoad)>], configured: Capacity) -> Capacity {
    let sum_every = |field: fn(&RankLoad) -> Option<u64>| -> Option<u64> {
        ranks.iter().try_fold(0_u64, |sum, rank| {
            rank.as_ref()
                .and_then(|(_, rank)| field(rank))
                .map(|value| sum.saturating_add(value))
        })
    };
    Capacity {
        max_running: configured
            .max_running
            .or_else(|| sum_every(|rank| rank.max_running)),
        max_total_tokens: configured
            .max_total_tokens
            .or_else(|| sum_every(|rank| rank.max_total_tokens)),
    }
}

/// One HTTP request and the extraction of its body; the caller bounds it in time.
async fn fetch(
    client: &HttpClient,
    target: &Target,
    max_body: NonZeroUsize,
) -> Result<Report, ScrapeError> {
    let uri = target.url.clone().map_err(ScrapeError::Url)?;
    let accept = match target.source {
        LoadSource::Metrics => "text/plain;version=0.0.4",
        LoadSource::Loads => "application/json",
    };
    let request = Request::get(uri)
        .header(header::ACCEPT, accept)
        .body(Empty::<Bytes>::new())
        .map_err(|error| ScrapeError::Url(error.to_string()))?;
    let response = client.request(request).await.map_err(|error| {
        if error.is_connect() {
            ScrapeError::Connect(source_message(&error))
        } else {
            ScrapeError::Request(source_message(&error))
        }
    })?;
    if !response.status().is_success() {
        return Err(ScrapeError::Status(response.status()));
    }
    let limit = max_body.get();
    let declared = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ScrapeError::BodyTooLarge { limit });
    }
    let body = Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|error| {
            if error.downcast_ref::<LengthLimitError>().is_some() {
                ScrapeError::BodyTooLarge { limit }
            } else {
                ScrapeError::Body(error.to_string())
            }
        })?
        .to_bytes();
    let report = match target.source {
        LoadSource::Metrics => {
            let text = std::str::from_utf8(&body).map_err(|_| ScrapeError::NotUtf8)?;
            engine::from_metrics(target.engine, text, target.dp_size)?
        }
        LoadSource::Loads => engine::from_loads_json(&body, target.dp_size)?,
    };
    Ok(report)
}

/// The innermost cause, which is where hyper puts the useful text ("Connection refused").
fn source_message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

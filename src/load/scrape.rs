//! The per-pool scraper: reads every worker's load each `scrape_interval` and publishes whole snapshots.
//!
//! One task per pool keeps every worker's latest sample per data-parallel rank. Each tick it starts a
//! request for every worker that has none in flight, at most `max_concurrent_scrapes` at a time, each
//! bounded by `scrape_timeout` and `max_body_bytes`. Results are applied as they arrive and a new
//! snapshot is published right away, so a hung worker delays nobody else's sample; routing decisions read
//! whichever snapshot is current and never wait on a scrape. A failed scrape keeps the old rank samples,
//! which age out of `freshness` on their own: staleness is a property of time, not of the last outcome.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus::IntCounter;
use thiserror::Error;
use tokio::sync::{Semaphore, watch};
use tokio::time::MissedTickBehavior;

use super::dispatch::DispatchTable;
use super::engine::{self, ExtractError, RankLoad, Report};
use super::snapshot::DispatchCounts;
use super::snapshot::{Capacity, EngineLoad, PoolSnapshot, Reading, ScrapeOutcome, WorkerState};
use crate::config::{Config, LoadConfig, LoadSource, ModelMatch, PoolConfig, WorkerConfig};
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
                state.capacity = Capacity {
                    max_running: worker.max_running_requests.map(|max| max.get()),
                    max_total_tokens: worker.max_total_tokens.map(|max| max.get()),
                };
                state
            })
            .collect();
        Arc::new(PoolLoad {
            label: pool_label(&pool.model).to_owned(),
            current: ArcSwap::from_pointee(PoolSnapshot::new(0, load.freshness, workers)),
            dispatches: DispatchTable::new(pool.max_workers.get().max(pool.workers.len())),
            rounds: watch::channel(0).0,
            desired: watch::channel(pool.workers.clone().into()).0,
            roster: watch::channel(0).0,
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

/// One worker as the scraper tracks it.
struct Tracked {
    id: WorkerId,
    state: WorkerState,
    target: Arc<Target>,
    /// Latest sample of each rank, with when it was requested.
    ranks: Vec<Option<(Instant, RankLoad)>>,
    configured: Capacity,
    in_flight: bool,
    /// `cachepick_scrapes_total` for this worker, one handle per outcome (in `ScrapeOutcome::ALL` order).
    counters: Vec<IntCounter>,
}

/// What a request needs to know about its worker; shared with the in-flight future.
struct Target {
    url: Result<Uri, String>,
    source: LoadSource,
    engine: Engine,
    dp_size: u32,
}

/// A finished request: worker index, round, when it was sent, the dispatch count at that moment, result.
type Fetched = (usize, u64, Instant, u64, Result<Report, ScrapeError>);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// Scrapes one pool. Owned by its task; shares only [`PoolLoad`] with the request path.
pub struct Scraper {
    pool: Arc<PoolLoad>,
    workers: Vec<Tracked>,
    client: HttpClient,
    config: LoadConfig,
    limiter: Arc<Semaphore>,
    version: u64,
    /// Rounds started, which tags each request.
    round: u64,
    completed_rounds: u64,
    last_blind_warning: Option<Instant>,
}

impl Scraper {
    pub fn new(
        pool_config: &PoolConfig,
        config: &LoadConfig,
        pool: Arc<PoolLoad>,
        observer: &dyn ScrapeObserver,
    ) -> Self {
        let label = pool.label().to_owned();
        let roster = pool.snapshot();
        let workers = pool_config
            .workers
            .iter()
            .zip(roster.workers())
            .map(|(worker, state)| {
                let endpoint = worker.endpoint.to_string();
                let url = worker.scrape_url();
                Tracked {
                    id: state.id,
                    state: state.clone(),
                    target: Arc::new(Target {
                        url: url
                            .parse::<Uri>()
                            .map_err(|error| format!("{url}: {error}")),
                        source: worker.load_source,
                        engine: pool_config.engine,
                        dp_size: worker.dp_size.get(),
                    }),
                    ranks: vec![None; worker.dp_size.get() as usize],
                    configured: state.capacity,
                    in_flight: false,
                    counters: ScrapeOutcome::ALL
                        .iter()
                        .map(|outcome| observer.scrape_counter(&label, &endpoint, *outcome))
                        .collect(),
                }
            })
            .collect();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.scrape_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(config.scrape_interval.saturating_mul(4))
            .pool_max_idle_per_host(1)
            .build(connector);
        observer.watch_pool(Arc::clone(&pool));
        Scraper {
            pool,
            workers,
            client,
            config: *config,
            limiter: Arc::new(Semaphore::new(config.max_concurrent_scrapes.get())),
            version: 0,
            round: 0,
            completed_rounds: 0,
            last_blind_warning: None,
        }
    }

    /// Worker indices without a request in flight, those whose last scrape succeeded first: the permit
    /// queue is first-come, so this keeps failing or hung workers from holding up healthy ones.
    fn idle_healthy_first(&self) -> Vec<usize> {
        let mut idle: Vec<(bool, usize)> = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, worker)| !worker.in_flight)
            .map(|(index, worker)| {
                let failing = worker
                    .state
                    .scrape
                    .last_outcome
                    .is_some_and(|outcome| outcome != ScrapeOutcome::Ok);
                (failing, index)
            })
            .collect();
        idle.sort_unstable();
        idle.into_iter().map(|(_, index)| index).collect()
    }

    /// Scrapes every worker once, waits for all of them, and publishes: the `snapshot` command's round.
    pub async fn round(&mut self) {
        self.round += 1;
        let fetches: Vec<_> = self
            .idle_healthy_first()
            .into_iter()
            .map(|index| self.start(index))
            .collect();
        let results = futures_util::future::join_all(fetches).await;
        for fetched in results {
            self.apply(fetched);
        }
        self.publish();
        self.finish_round(Instant::now());
    }

    /// Scrapes every `scrape_interval` until `shutdown` resolves.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.config.scrape_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut in_flight = FuturesUnordered::new();
        // Requests still outstanding per round, so a round ends when its own requests do.
        let mut pending: BTreeMap<u64, usize> = BTreeMap::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = ticker.tick() => {
                    self.round += 1;
                    let idle = self.idle_healthy_first();
                    if idle.is_empty() {
                        continue;
                    }
                    pending.insert(self.round, idle.len());
                    for index in idle {
                        in_flight.push(self.start(index));
                    }
                }
                Some(fetched) = in_flight.next(), if !in_flight.is_empty() => {
                    let mut done = vec![fetched.1];
                    self.apply(fetched);
                    // Apply everything that is already finished before publishing once.
                    while let Some(Some(fetched)) = in_flight.next().now_or_never() {
                        done.push(fetched.1);
                        self.apply(fetched);
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

    /// Starts a request for worker `index`; the future owns everything it needs.
    fn start(&mut self, index: usize) -> impl Future<Output = Fetched> + use<> {
        let round = self.round;
        let dispatches = self.pool.dispatches();
        let request = self.workers.get_mut(index).map(|worker| {
            worker.in_flight = true;
            (
                Arc::clone(&worker.target),
                dispatches.since_reading(worker.id),
            )
        });
        let client = self.client.clone();
        let limiter = Arc::clone(&self.limiter);
        let config = self.config;
        async move {
            let Some((target, dispatched)) = request else {
                return (
                    index,
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
                match tokio::time::timeout(config.scrape_timeout, fetch(&client, &target, &config))
                    .await
                {
                    Ok(result) => result,
                    Err(_) => Err(ScrapeError::Timeout(config.scrape_timeout)),
                };
            (index, round, sent, dispatched, result)
        }
    }

    /// Records one result: rank samples, status, counters, dispatch count.
    fn apply(&mut self, (index, _, sent, dispatched, result): Fetched) {
        let dispatches = self.pool.dispatches();
        let label = self.pool.label();
        let Some(worker) = self.workers.get_mut(index) else {
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
        match result {
            Ok(report) => {
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
    }

    fn publish(&mut self) {
        self.version += 1;
        let workers = self
            .workers
            .iter()
            .map(|worker| worker.state.clone())
            .collect();
        let snapshot = PoolSnapshot::new(self.version, self.config.freshness, workers);
        self.pool.current.store(Arc::new(snapshot));
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
    config: &LoadConfig,
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
    let limit = config.max_body_bytes.get();
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

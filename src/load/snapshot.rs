//! The immutable per-pool load snapshot the policy decides from.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::worker::{Role, WorkerId};

/// Engine-reported load of one worker, summed over its data-parallel ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Requests queued in the engine, not yet scheduled (`num_requests_waiting`, `num_queue_reqs`).
    pub waiting: u64,
    /// Requests in the running batch.
    pub running: u64,
    /// Prompt tokens of the queued requests that miss the engine's prefix cache, where the engine
    /// reports it (SGLang `/v1/loads`). The best single measure of prefill backlog.
    pub waiting_uncached_tokens: Option<u64>,
    /// KV-cache tokens in use.
    pub used_tokens: Option<u64>,
}

/// One worker's reading: the sum over its ranks, stamped with the age of its oldest rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// When the oldest of the summed rank samples was taken.
    pub captured_at: Instant,
    /// Whether every one of the worker's `dp_size` ranks contributed. A partial sum makes a worker look
    /// idler than it is, so an incomplete reading is never fresh.
    pub complete: bool,
    pub load: EngineLoad,
}

/// Hard limits of a worker, learned from the engine or set in configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    /// Most requests the engine runs at once (`max_running_requests`).
    pub max_running: Option<u64>,
    /// KV-cache size in tokens (`max_total_num_tokens`, or blocks × block size).
    pub max_total_tokens: Option<u64>,
}

/// A worker as the policy sees it at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerState {
    pub id: WorkerId,
    pub endpoint: SocketAddr,
    pub role: Role,
    /// False for a worker that is being removed: it keeps its place (ids stay dense) but never receives
    /// requests and never counts as part of the fleet.
    pub routable: bool,
    pub capacity: Capacity,
    pub reading: Option<Reading>,
    /// How the last scrape went, for operators; the policy never reads it.
    pub scrape: ScrapeStatus,
}

/// The result of a worker's most recent scrape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScrapeStatus {
    pub attempts: u64,
    pub last_outcome: Option<ScrapeOutcome>,
    /// Why the last scrape failed, or which ranks it lacked.
    pub last_error: Option<Arc<str>>,
}

/// How one scrape ended; the values are the `outcome` label of `cachepick_scrapes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScrapeOutcome {
    Ok,
    Timeout,
    HttpError,
    ParseError,
    ConnectError,
}

impl ScrapeOutcome {
    pub const ALL: [ScrapeOutcome; 5] = [
        ScrapeOutcome::Ok,
        ScrapeOutcome::Timeout,
        ScrapeOutcome::HttpError,
        ScrapeOutcome::ParseError,
        ScrapeOutcome::ConnectError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ScrapeOutcome::Ok => "ok",
            ScrapeOutcome::Timeout => "timeout",
            ScrapeOutcome::HttpError => "http_error",
            ScrapeOutcome::ParseError => "parse_error",
            ScrapeOutcome::ConnectError => "connect_error",
        }
    }
}

impl WorkerState {
    /// A routable worker with no reading yet, as at start-up.
    pub fn new(id: WorkerId, endpoint: SocketAddr, role: Role) -> Self {
        WorkerState {
            id,
            endpoint,
            role,
            routable: true,
            capacity: Capacity::default(),
            reading: None,
            scrape: ScrapeStatus::default(),
        }
    }
}

/// Everything known about one pool's workers, published whole by the scraper.
#[derive(Clone, Debug)]
pub struct PoolSnapshot {
    /// Increases with every publication, so logs and traces can name the data a decision used.
    pub version: u64,
    /// A reading older than this is not fresh (`load.freshness`).
    pub freshness: Duration,
    /// Indexed by [`WorkerId`]: `workers[i].id == WorkerId(i)`.
    workers: Vec<WorkerState>,
}

impl PoolSnapshot {
    /// Builds a snapshot, assigning each worker the id of its position.
    pub fn new(version: u64, freshness: Duration, mut workers: Vec<WorkerState>) -> Self {
        for (index, worker) in workers.iter_mut().enumerate() {
            worker.id = WorkerId(u32::try_from(index).unwrap_or(u32::MAX));
        }
        PoolSnapshot {
            version,
            freshness,
            workers,
        }
    }

    pub fn workers(&self) -> &[WorkerState] {
        &self.workers
    }

    pub fn worker(&self, id: WorkerId) -> Option<&WorkerState> {
        self.workers.get(id.index())
    }

    /// The worker's load if its reading is complete and younger than `freshness` at `now`.
    pub fn fresh_load(&self, id: WorkerId, now: Instant) -> Option<&EngineLoad> {
        let reading = self.worker(id)?.reading.as_ref()?;
        self.is_fresh(reading, now).then_some(&reading.load)
    }

    /// Whether `reading` counts at `now`: every rank reported, and the oldest of them is younger than
    /// `freshness`.
    pub fn is_fresh(&self, reading: &Reading, now: Instant) -> bool {
        reading.complete && now.saturating_duration_since(reading.captured_at) < self.freshness
    }
}

/// Requests the picker dispatched to each worker since that worker's last fresh reading.
///
/// Engines report load with a delay of up to one scrape interval; without this correction a burst of
/// requests arriving between two scrapes would all see the same "idle" worker. The count is added to
/// *load* (off-owner picks) only, never to *waiting*: inventing queue depth would trip the queue gate
/// on requests the engine may already be running.
pub trait DispatchCounts {
    fn since_reading(&self, id: WorkerId) -> u64;
}

/// A plain per-worker vector of counts, indexed by [`WorkerId`]; missing entries count as zero.
#[derive(Clone, Copy, Debug, Default)]
pub struct Dispatches<'a>(pub &'a [u64]);

impl DispatchCounts for Dispatches<'_> {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.0.get(id.index()).copied().unwrap_or(0)
    }
}

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
    /// The engine's KV block in tokens, as it reports it (`cache_config_info`): it reuses a cached
    /// prefix in whole blocks only, so no match counts for more than its whole blocks.
    pub engine_block: Option<u64>,
}

/// A worker's prefill and queue as learned from its engine's counters and histograms, in wall time;
/// `None` until enough has been seen (see `load::rate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefillEstimate {
    /// Uncached prompt tokens a prefill computes per second (all the worker's ranks), from the
    /// engine's per-request prefill histograms: what prices the request's own prefill.
    pub prefill_tokens_per_second: Option<u64>,
    /// Uncached prompt tokens the worker completes per second while requests wait: how fast its queue
    /// drains, slots and decoding included; what prices the queue ahead.
    pub drain_tokens_per_second: Option<u64>,
    /// Uncached prompt tokens a request brings, on average.
    pub uncached_per_request: Option<u64>,
    /// The uncached tokens of the requests waiting at the latest reading, by their own sizes as
    /// predicted when they were routed there (`DispatchTable::queued`); `None` when no request routed
    /// there is remembered.
    pub waiting_routed_tokens: Option<u64>,
    /// The same prediction's mean over the requests routed there before the reading (up to 64): the
    /// yardstick that puts the waiting ones against the engine's own `uncached_per_request`.
    pub routed_per_request: Option<u64>,
    /// Uncached prompt tokens of the prefills under way at the latest reading (their prompt tokens
    /// times the share of recent lookups the cache missed), where the engine's counters tell (vLLM).
    pub prefilling_tokens: Option<u64>,
    /// The mean time recent requests waited in the engine's queue, by its own histogram, in µs.
    pub queue_wait_us: Option<u64>,
}

/// A worker as the policy sees it at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerState {
    pub id: WorkerId,
    pub endpoint: SocketAddr,
    pub role: Role,
    /// Where the worker is in its life in the pool; the policy reads it through [`WorkerState::tier`].
    pub lifecycle: Lifecycle,
    /// Which occupant of the slot `id` this is: a slot freed by a worker that left and taken by a new
    /// one gets a new generation, so nothing recorded for the old one is credited to the new one.
    pub generation: u64,
    /// Restarts of this worker's engine seen so far: each one voids what the index holds for it.
    pub incarnation: u64,
    /// Data-parallel ranks (`dp_size`): the reading is their sum, and the queue gate's per-rank limit
    /// and floor are scaled by it.
    pub ranks: u32,
    pub capacity: Capacity,
    pub reading: Option<Reading>,
    /// What the worker's counters taught about its prefill (see `load::rate`).
    pub prefill: PrefillEstimate,
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
            lifecycle: Lifecycle::New,
            generation: 0,
            incarnation: 0,
            ranks: 1,
            capacity: Capacity::default(),
            reading: None,
            prefill: PrefillEstimate::default(),
            scrape: ScrapeStatus::default(),
        }
    }
}

impl WorkerState {
    /// How the policy may use the worker.
    pub fn tier(&self) -> Tier {
        self.lifecycle.tier()
    }

    /// Whether the policy may choose the worker at all (every tier but `Excluded`).
    pub fn routable(&self) -> bool {
        self.tier() != Tier::Excluded
    }
}

/// A worker's place in its life in the pool: one state machine, driven by the scraper (scrapes,
/// discovery) and shown to operators as `cachepick_workers{pool,state}`.
///
/// ```text
///   joins ─▶ new ──scrape answered──▶ healthy ◀──answered── unreachable
///             │                        │  ▲  ▲                  ▲
///             │            scrape timed out  answered           │
///             │                        ▼  │  │                  │
///             │                        late ─┘── unanswered ────┤  (no sign of life meanwhile)
///             └──connect failures──────────────────────────────┘
///                                         └─ one freshness later ─ restarted ◀─ start time changed,
///   left discovery (any state) ─▶ draining ─▶ gone (slot freed)                   counters went back
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    /// Joined, not yet answered a scrape: used only when nothing better is left.
    New,
    /// Answers its scrapes.
    Healthy,
    /// Its last scrape timed out, yet it is not gone: it answered one of its last `unreachable_after`
    /// scrapes, or it published KV events or served a response since. A busy engine's API server
    /// answers `/metrics` late (vLLM serves it on the loop that also tokenizes). Still an owner; its
    /// reading ages out of `freshness`, and the queue gate then fails open on it.
    Late,
    /// `unreachable_after` consecutive scrapes could not connect, or timed out with no other sign of
    /// life: never an owner, used only when nothing better is left, so fail-open survives a
    /// fleet-wide outage of the scrapes.
    Unreachable,
    /// Removed from discovery: no new requests; it leaves when idle, gone or at `drain_timeout`.
    Draining,
    /// Its engine restarted with an empty cache (start time changed or counters went backwards):
    /// routable, its index entries forgotten; healthy again one `freshness` later.
    Restarted,
}

impl Lifecycle {
    pub const ALL: [Lifecycle; 6] = [
        Lifecycle::New,
        Lifecycle::Healthy,
        Lifecycle::Late,
        Lifecycle::Unreachable,
        Lifecycle::Draining,
        Lifecycle::Restarted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::New => "new",
            Lifecycle::Healthy => "healthy",
            Lifecycle::Late => "late",
            Lifecycle::Unreachable => "unreachable",
            Lifecycle::Draining => "draining",
            Lifecycle::Restarted => "restarted",
        }
    }

    pub fn tier(self) -> Tier {
        match self {
            Lifecycle::Healthy | Lifecycle::Late | Lifecycle::Restarted => Tier::Preferred,
            Lifecycle::New | Lifecycle::Unreachable => Tier::LastResort,
            Lifecycle::Draining => Tier::Excluded,
        }
    }

    /// Whether the worker answers, if late: the picker can route by what it knows of it (readiness).
    pub fn answers(self) -> bool {
        matches!(
            self,
            Lifecycle::Healthy | Lifecycle::Late | Lifecycle::Restarted
        )
    }

    /// Whether Envoy's workers cluster lists the worker: every worker the picker may choose, and new
    /// ones before it does (so the endpoint exists in Envoy by the time it is chosen).
    pub fn in_envoy(self) -> bool {
        self != Lifecycle::Draining
    }
}

/// How the policy may use a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// Part of the fleet.
    Preferred,
    /// Part of the fleet only when no preferred worker is; never an owner when unreachable.
    LastResort,
    /// Never chosen.
    Excluded,
}

/// Everything known about one pool's workers, published whole by the scraper.
#[derive(Clone, Debug)]
pub struct PoolSnapshot {
    /// Increases with every publication, so logs and traces can name the data a decision used.
    pub version: u64,
    /// A reading older than this is not fresh (`load.freshness`).
    pub freshness: Duration,
    /// The workers present, by increasing id. Ids are slots: a worker that left frees its slot, so
    /// ids can have gaps, and `workers[i].id == WorkerId(i)` holds until a worker leaves.
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

    /// Builds a snapshot of workers that keep their ids (their slots).
    pub fn with_slots(version: u64, freshness: Duration, mut workers: Vec<WorkerState>) -> Self {
        workers.sort_unstable_by_key(|worker| worker.id);
        workers.dedup_by_key(|worker| worker.id);
        PoolSnapshot {
            version,
            freshness,
            workers,
        }
    }

    /// The workers present, by increasing id.
    pub fn workers(&self) -> &[WorkerState] {
        &self.workers
    }

    /// One more than the highest id present: the length of a vector indexed by [`WorkerId`].
    pub fn slots(&self) -> usize {
        self.workers
            .last()
            .map_or(0, |worker| worker.id.index() + 1)
    }

    pub fn worker(&self, id: WorkerId) -> Option<&WorkerState> {
        // Without gaps, a worker sits at its id; with gaps, before it.
        match self.workers.get(id.index()) {
            Some(worker) if worker.id == id => Some(worker),
            _ => {
                let end = id.index().min(self.workers.len());
                let before = self.workers.get(..end)?;
                let at = before.binary_search_by_key(&id, |worker| worker.id).ok()?;
                before.get(at)
            }
        }
    }

    /// The worker at `endpoint`, if present.
    pub fn by_endpoint(&self, endpoint: SocketAddr) -> Option<&WorkerState> {
        self.workers
            .iter()
            .find(|worker| worker.endpoint == endpoint)
    }

    /// The endpoints Envoy's workers cluster must hold: every worker the picker may send a request to,
    /// and new ones before it does; not the draining ones, and not decode-only ones (so Envoy's own
    /// fallback never sends a prefill there).
    pub fn envoy_endpoints(&self) -> Vec<SocketAddr> {
        self.workers
            .iter()
            .filter(|worker| worker.lifecycle.in_envoy() && worker.role.serves_prefill())
            .map(|worker| worker.endpoint)
            .collect()
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

    /// Uncached prompt tokens of those requests, as the picker predicted them when it sent them.
    fn uncached_since_reading(&self, _id: WorkerId) -> u64 {
        0
    }

    /// The number of the pool's last off-owner placement that went to `id` (0 for none): the
    /// tie-break that spreads new prefixes over workers otherwise equal.
    fn last_cold(&self, _id: WorkerId) -> u64 {
        0
    }
}

/// A plain per-worker vector of counts, indexed by [`WorkerId`]; missing entries count as zero.
#[derive(Clone, Copy, Debug, Default)]
pub struct Dispatches<'a>(pub &'a [u64]);

impl DispatchCounts for Dispatches<'_> {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.0.get(id.index()).copied().unwrap_or(0)
    }
}

/// Per-worker `(requests, uncached tokens)` dispatched since the last reading, indexed by [`WorkerId`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenDispatches<'a>(pub &'a [(u64, u64)]);

impl DispatchCounts for TokenDispatches<'_> {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.0.get(id.index()).map_or(0, |(count, _)| *count)
    }

    fn uncached_since_reading(&self, id: WorkerId) -> u64 {
        self.0.get(id.index()).map_or(0, |(_, tokens)| *tokens)
    }
}

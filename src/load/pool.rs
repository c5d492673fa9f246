//! The pool's published state and who is told about it: [`PoolLoad`] (the current snapshot, the dispatch
//! counts, discovery's desired set, the round and roster-change counters) and the two observer traits
//! the scraper reports to ([`ScrapeObserver`] for metrics, [`RosterObserver`] for the request path).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use arc_swap::ArcSwap;
use prometheus::IntCounter;
use tokio::sync::{mpsc, watch};

use super::dispatch::DispatchTable;
use super::snapshot::{Capacity, PoolSnapshot, ScrapeOutcome, WorkerState};
use crate::config::{Config, LoadConfig, ModelMatch, PoolConfig, WorkerConfig};
use crate::worker::WorkerId;

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

/// Where a pool's dispatches are announced to the other picker replicas (`replica_sync`,
/// implemented by `sync::ReplicaSync`); never blocks. `checkpoints` is the prompt's chain at the
/// checkpoint depths, as the pool's index recorded it (`prefix::checkpoints`; empty where peers
/// cannot use it).
pub trait Announce: Send + Sync + std::fmt::Debug {
    fn announce(&self, pool: &str, worker: SocketAddr, uncached_tokens: u64, checkpoints: &[u64]);
}

/// Where another replica's guess of where a prompt's prefix now is goes: the pool's index, in `events`
/// mode (implemented above this layer, by the route's index).
pub trait PeerGuesses: Send + Sync + std::fmt::Debug {
    /// `worker` holds the chain whose checkpoint hashes are `checkpoints`, as of `now`.
    fn guess(&self, worker: WorkerId, checkpoints: &[u64], now: Instant);
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
    /// A prefill/decode pool (`pools[].pd`): its decode workers take requests too (their decode legs).
    disaggregated: bool,
    /// Taken by the pool's scraper.
    restart_reports: Mutex<Option<mpsc::UnboundedReceiver<WorkerId>>>,
    /// `replica_sync`: where each dispatch is announced to the other replicas, once set at start-up.
    sync: OnceLock<Arc<dyn Announce>>,
    /// Where the peers' guesses go, once the picker that owns the pool's index sets it.
    guesses: OnceLock<Arc<dyn PeerGuesses>>,
    /// Per slot, when the worker last showed it is alive other than by answering a scrape (a KV event
    /// batch, a response it served), in milliseconds after `epoch` plus one; 0 for never. A scrape
    /// that times out on a worker heard from meanwhile is late, not a sign the worker is gone.
    heard: Box<[AtomicU64]>,
    epoch: Instant,
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
                state.capacity = configured_capacity(worker, pool.engine_block_size);
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
            sync: OnceLock::new(),
            guesses: OnceLock::new(),
            disaggregated: pool.pd.is_some(),
            heard: (0..pool.max_workers.get().max(pool.workers.len()))
                .map(|_| AtomicU64::new(0))
                .collect(),
            // The scrape loop's clock (tokio's), which stamps when scrapes were sent.
            epoch: tokio::time::Instant::now().into_std(),
        })
    }

    /// The worker in slot `id` showed it is alive at `at`: its engine published a KV event batch, or it
    /// served a response. Read when one of its scrapes times out.
    pub fn heard_from(&self, id: WorkerId, at: Instant) {
        let since = at.saturating_duration_since(self.epoch);
        let stamp = u64::try_from(since.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        if let Some(heard) = self.heard.get(id.index()) {
            heard.fetch_max(stamp, Ordering::Relaxed);
        }
    }

    /// Whether the worker in slot `id` was heard from at or after `at`.
    pub fn heard_since(&self, id: WorkerId, at: Instant) -> bool {
        let Some(heard) = self.heard.get(id.index()) else {
            return false;
        };
        let stamp = heard.load(Ordering::Relaxed);
        let at =
            u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX);
        stamp > 0 && stamp > at
    }

    /// Forgets what was heard from slot `id`: a new occupant, or a new run of the engine.
    pub(super) fn forget_heard(&self, id: WorkerId) {
        if let Some(heard) = self.heard.get(id.index()) {
            heard.store(0, Ordering::Relaxed);
        }
    }

    /// Whether Envoy must know `role`'s workers: those that take requests, which in a prefill/decode
    /// pool include the decode workers (each request's decode leg goes to one).
    pub fn takes_requests(&self, role: crate::worker::Role) -> bool {
        role.serves_prefill() || self.disaggregated
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

    /// Announces this pool's dispatches to the other replicas through `sync` from now on.
    pub fn announce_through(&self, sync: Arc<dyn Announce>) {
        let _ = self.sync.set(sync);
    }

    /// Counts one request sent to worker `id` at `endpoint`, bringing `uncached_tokens`, and
    /// announces it, with the prompt's `checkpoints`, to the other replicas when `replica_sync` is on.
    pub fn dispatched(
        &self,
        id: WorkerId,
        endpoint: SocketAddr,
        uncached_tokens: u64,
        checkpoints: &[u64],
    ) {
        self.dispatches.record(id, uncached_tokens);
        if let Some(sync) = self.sync.get() {
            sync.announce(&self.label, endpoint, uncached_tokens, checkpoints);
        }
    }

    /// Whether dispatches are announced to other replicas (so their checkpoints are worth computing).
    pub fn announces(&self) -> bool {
        self.sync.get().is_some()
    }

    /// Sends the peers' guesses of where prefixes are to `guesses` from now on.
    pub fn take_guesses_through(&self, guesses: Arc<dyn PeerGuesses>) {
        let _ = self.guesses.set(guesses);
    }

    /// A peer's guess: `worker` holds the chain with these checkpoint hashes, as of `now`.
    pub fn peer_guess(&self, worker: WorkerId, checkpoints: &[u64], now: Instant) {
        if let (Some(guesses), false) = (self.guesses.get(), checkpoints.is_empty()) {
            guesses.guess(worker, checkpoints, now);
        }
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

    /// Makes `snapshot` the current one; `roster_changed` tells the roster's followers.
    pub(super) fn publish(&self, snapshot: PoolSnapshot, roster_changed: bool) {
        self.current.store(Arc::new(snapshot));
        if roster_changed {
            self.roster.send_modify(|version| *version += 1);
        }
    }

    /// `rounds` scrape rounds are complete.
    pub(super) fn rounds_completed(&self, rounds: u64) {
        self.rounds.send_replace(rounds);
    }

    /// The restarts the KV event streams report, for the first scraper of the pool that asks.
    pub(super) fn take_restart_reports(&self) -> Option<mpsc::UnboundedReceiver<WorkerId>> {
        self.restart_reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

fn pool_label(model: &ModelMatch) -> &str {
    match model {
        ModelMatch::Exact(name) => name,
        ModelMatch::Any => "*",
    }
}

/// Capacities given in configuration, which override the engine's.
/// `engine_block` is the pool's `engine_block_size`.
pub(super) fn configured_capacity(
    worker: &WorkerConfig,
    engine_block: Option<std::num::NonZeroU32>,
) -> Capacity {
    Capacity {
        engine_block: engine_block.map(|size| u64::from(size.get())),
        max_running: worker.max_running_requests.map(|max| max.get()),
        max_total_tokens: worker.max_total_tokens.map(|max| max.get()),
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

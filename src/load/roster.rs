//! The roster: which worker holds which slot, in which generation and lifecycle state, and what its
//! latest rank samples say. A synchronous state machine: the scrape loop hands it discovery's desired
//! set, restarts, finished scrapes and the time (`now` is always an argument), and it publishes the
//! pool's snapshot. No HTTP and no timers: every rule here is testable as a table.
//!
//! - **Slots and generations.** A newcomer takes the lowest free slot and a new generation; a worker
//!   that leaves frees its slot. A reading requested from an earlier occupant of a slot is discarded.
//! - **Lifecycle.** `new` until a scrape answers; `healthy`; `unreachable` after `unreachable_after`
//!   scrapes in a row that could not connect or timed out; `draining` once discovery no longer lists it,
//!   leaving when idle, unreachable or at `drain_timeout`; `restarted` for one `freshness` after its
//!   engine started over.
//! - **Publication.** Observers hear of joins, leaves and restarts before the snapshot that shows them
//!   is published.
#![deny(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::IntCounter;

use super::dispatch::{DispatchTable, Window};
use super::engine::{Identity, Report};
use super::fetch::{ScrapeError, Target};
use super::pool::{PoolLoad, RosterObserver, ScrapeObserver, configured_capacity};
use super::rate::PrefillMeter;
use super::samples::RankSamples;
use super::share::{Arrivals, ShareMeter};
use super::snapshot::{
    Capacity, Lifecycle, PoolSnapshot, PrefillEstimate, ScrapeOutcome, WorkerState,
};
use crate::config::{LoadConfig, PoolConfig, RateWindow, WorkerConfig};
use crate::worker::{Engine, WorkerId};

/// A warning that the gate is blind is repeated at most this often per pool.
const BLIND_WARNING_EVERY: Duration = Duration::from_secs(60);

/// One worker as the roster tracks it.
struct Tracked {
    id: WorkerId,
    /// As discovery described it; a changed description is applied in place.
    config: WorkerConfig,
    state: WorkerState,
    target: Arc<Target>,
    ranks: RankSamples,
    configured: Capacity,
    in_flight: bool,
    /// `cachepick_scrapes_total` for this worker, one handle per outcome (in `ScrapeOutcome::ALL` order).
    counters: Vec<IntCounter>,
    /// Scrapes in a row that could not connect or timed out.
    failures: u32,
    /// The engine run the last answer came from.
    identity: Option<Identity>,
    /// When its last scrape that got an answer (of any kind) was sent.
    answered: Option<Instant>,
    /// What its counters teach about its prefill.
    meter: PrefillMeter,
    /// Its counters at the last reading, for the requests that reached it from every router.
    arrivals: Arrivals,
    /// When the state last changed to `Restarted` or `Draining`.
    since: Instant,
}

/// What the loop needs to scrape one worker, taken when the scrape starts.
pub(super) struct Scrape {
    id: WorkerId,
    pub(super) target: Arc<Target>,
    /// The slot's occupant, which the result must still be when it arrives.
    generation: u64,
    /// What was counted for the worker when the request was sent: a newer reading covers it.
    dispatched: Window,
}

impl Scrape {
    /// The scrape's result, for [`Roster::apply`]: requested at `sent`.
    pub(super) fn finished(self, sent: Instant, result: Result<Report, ScrapeError>) -> Fetched {
        Fetched {
            id: self.id,
            generation: self.generation,
            sent,
            dispatched: self.dispatched,
            result,
        }
    }
}

/// A finished scrape, as the roster applies it.
pub(super) struct Fetched {
    pub(super) id: WorkerId,
    pub(super) generation: u64,
    /// When the request was sent: the samples it brings are that old.
    pub(super) sent: Instant,
    pub(super) dispatched: Window,
    pub(super) result: Result<Report, ScrapeError>,
}

/// One pool's roster. Owned by the pool's scrape loop; shares only [`PoolLoad`] with the request path.
pub(super) struct Roster {
    pool: Arc<PoolLoad>,
    engine: Engine,
    /// The pool's `engine_block_size`, part of every worker's configured capacity.
    engine_block: Option<std::num::NonZeroU32>,
    freshness: Duration,
    drain_timeout: Duration,
    unreachable_after: NonZeroU32,
    silent_after: Duration,
    rate: RateWindow,
    /// By increasing id.
    workers: Vec<Tracked>,
    /// Slots no worker holds, lowest first.
    free: BTreeSet<u32>,
    /// The next occupant's generation.
    generation: u64,
    version: u64,
    /// What the last published snapshot's roster looked like.
    roster_key: Vec<(WorkerId, u64, Lifecycle, u64)>,
    completed_rounds: u64,
    last_blind_warning: Option<Instant>,
    last_full_warning: Option<Instant>,
    observer: Arc<dyn ScrapeObserver>,
    roster: Option<Arc<dyn RosterObserver>>,
    /// Arrivals at the pool's workers against this replica's dispatches (`share.rs`).
    share: ShareMeter,
}

impl Roster {
    /// The roster of `pool`'s first snapshot: the file's workers in their slots.
    pub(super) fn new(
        pool_config: &PoolConfig,
        config: &LoadConfig,
        pool: Arc<PoolLoad>,
        observer: Arc<dyn ScrapeObserver>,
        now: Instant,
    ) -> Self {
        let first = pool.snapshot();
        let slots = u32::try_from(pool.dispatches().len()).unwrap_or(u32::MAX);
        let mut roster = Roster {
            pool,
            engine: pool_config.engine,
            engine_block: pool_config.engine_block_size,
            freshness: config.freshness,
            drain_timeout: config.drain_timeout,
            unreachable_after: config.unreachable_after,
            silent_after: config.silent_after,
            rate: config.rate,
            workers: Vec::new(),
            free: (0..slots).collect(),
            generation: 0,
            version: first.version,
            roster_key: roster_key(&first),
            completed_rounds: 0,
            last_blind_warning: None,
            last_full_warning: None,
            observer,
            roster: None,
            share: ShareMeter::default(),
        };
        for (worker, state) in pool_config.workers.iter().zip(first.workers()) {
            roster.free.remove(&state.id.0);
            roster.generation = roster.generation.max(state.generation + 1);
            let tracked = roster.track(worker, state.clone(), now);
            roster.workers.push(tracked);
        }
        roster
    }

    /// Whether no worker holds a slot.
    pub(super) fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Tells `roster` about every change from now on; the workers already present are announced as
    /// joining.
    pub(super) fn observe(&mut self, roster: Arc<dyn RosterObserver>) {
        for worker in &self.workers {
            roster.joined(worker.id, &worker.config);
        }
        self.roster = Some(roster);
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
            ranks: RankSamples::new(worker.dp_size.get()),
            in_flight: false,
            counters: ScrapeOutcome::ALL
                .iter()
                .map(|outcome| self.observer.scrape_counter(label, &endpoint, *outcome))
                .collect(),
            failures: 0,
            identity: None,
            answered: None,
            meter: PrefillMeter::new(self.rate),
            arrivals: Arrivals::default(),
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
    pub(super) fn idle_healthy_first(&self) -> Vec<WorkerId> {
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

    /// The endpoint of the worker in slot `id`.
    pub(super) fn endpoint(&self, id: WorkerId) -> Option<SocketAddr> {
        let at = self.position(id)?;
        self.workers.get(at).map(|worker| worker.config.endpoint)
    }

    /// Marks a scrape of the worker in slot `id` in flight, and hands out what its request needs;
    /// `None` when no worker holds the slot.
    pub(super) fn begin_scrape(&mut self, id: WorkerId) -> Option<Scrape> {
        let dispatches = self.pool.dispatches();
        let worker = self.position(id).and_then(|at| self.workers.get_mut(at))?;
        worker.in_flight = true;
        Some(Scrape {
            id,
            target: Arc::clone(&worker.target),
            generation: worker.state.generation,
            dispatched: dispatches.window(worker.id),
        })
    }

    /// Brings the roster to `desired`: newcomers take free slots, workers no longer listed drain, a
    /// draining worker listed again stays, a changed description is applied. Returns the newcomers.
    pub(super) fn reconcile(&mut self, desired: &[WorkerConfig], now: Instant) -> Vec<WorkerId> {
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
                            answered_state(worker.failures, self.unreachable_after, false);
                    }
                    if **config != worker.config {
                        worker.reconfigure(config, self.engine, self.engine_block);
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
                    tracing::warn!(pool = %label, worker = %endpoint, max_workers = self.pool.dispatches().len(),
                        "discovery lists more workers than max_workers; the rest are left out");
                }
                continue;
            };
            let id = WorkerId(slot);
            let mut state = WorkerState::new(id, endpoint, config.role);
            state.ranks = config.dp_size.get();
            state.generation = self.generation;
            self.generation += 1;
            state.capacity = configured_capacity(config, self.engine_block);
            let tracked = self.track(config, state, now);
            if let Some(roster) = &self.roster {
                roster.joined(id, config);
            }
            self.pool.dispatches().reset(id);
            self.pool.forget_heard(id);
            tracing::info!(pool = %label, worker = %endpoint, slot = id.0, "worker joined");
            let at = self.workers.partition_point(|worker| worker.id < id);
            self.workers.insert(at, tracked);
            joined.push(id);
        }
        joined
    }

    /// Time-driven changes: a drain that ran out, a restart that is old news. Whether anything changed.
    pub(super) fn expire(&mut self, now: Instant) -> bool {
        let mut changed = false;
        let drain = self.drain_timeout;
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
                && now.saturating_duration_since(worker.since) >= self.freshness
            {
                worker.state.lifecycle = Lifecycle::Healthy;
                changed = true;
            }
        }
        changed
    }

    /// The engine of the worker in slot `id` restarted: its prefixes are forgotten at once, and it shows
    /// `restarted` for one `freshness`. Whether a worker was there to mark.
    pub(super) fn mark_restarted(&mut self, id: WorkerId, now: Instant) -> bool {
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
        self.pool.dispatches().reset(id);
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
        self.pool.dispatches().reset(id);
        self.free.insert(id.0);
    }

    /// Records one finished scrape: rank samples, status, counters, dispatch count, and the worker's
    /// state. A result for an earlier occupant of the slot is discarded.
    pub(super) fn apply(&mut self, fetched: Fetched, now: Instant) {
        let Fetched {
            id,
            generation,
            sent,
            dispatched,
            result,
        } = fetched;
        let dispatches = self.pool.dispatches();
        let label = self.pool.label();
        let unreachable_after = self.unreachable_after;
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
        worker.count(outcome);
        let was_failing = worker
            .state
            .scrape
            .last_outcome
            .is_some_and(|o| o != ScrapeOutcome::Ok);
        let status = &mut worker.state.scrape;
        status.attempts += 1;
        status.last_outcome = Some(outcome);
        // A scrape that timed out is late, not unanswered, while the worker showed a sign of life
        // within `silent_after`: an answer to a scrape, a KV event batch, a response it served. A busy
        // engine answers `/metrics` last; only a silent one is taken for gone.
        let timed_out = outcome == ScrapeOutcome::Timeout;
        let since = now.checked_sub(self.silent_after).unwrap_or(now);
        let alive = timed_out
            && (worker.answered.is_some_and(|answered| answered >= since)
                || self.pool.heard_since(id, since));
        let unanswered = outcome == ScrapeOutcome::ConnectError || (timed_out && !alive);
        if !matches!(
            outcome,
            ScrapeOutcome::ConnectError | ScrapeOutcome::Timeout
        ) {
            worker.answered = Some(sent);
        }
        worker.failures = if unanswered {
            worker.failures.saturating_add(1)
        } else {
            0
        };
        let mut restarted = false;
        let mut idle = false;
        match result {
            Ok(report) => {
                (restarted, idle) =
                    worker.absorb(report, (sent, dispatched), dispatches, &mut self.share);
                if was_failing {
                    tracing::info!(pool = label, worker = %worker.state.endpoint, "worker scrape recovered");
                }
            }
            Err(error) => {
                if !was_failing && !timed_out {
                    tracing::warn!(pool = label, worker = %worker.state.endpoint, %error, "worker scrape failing");
                } else if !was_failing {
                    tracing::info!(pool = label, worker = %worker.state.endpoint, %error, alive,
                        "worker scrape late; still an owner, its gate fails open once its reading is stale");
                } else {
                    tracing::debug!(pool = label, worker = %worker.state.endpoint, %error, "worker scrape failed");
                }
                status.last_error = Some(Arc::from(error.to_string()));
            }
        }
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
            Lifecycle::Restarted if unanswered || timed_out => {
                worker.state.lifecycle =
                    answered_state(worker.failures, unreachable_after, timed_out);
            }
            Lifecycle::Restarted => {}
            _ => worker.settle(label, unreachable_after, timed_out, unanswered),
        }
    }

    /// Publishes the roster as a new snapshot, telling the roster's followers when who is in the pool
    /// or in which state changed.
    pub(super) fn publish(&mut self) {
        self.version += 1;
        let workers = self
            .workers
            .iter()
            .map(|worker| worker.state.clone())
            .collect();
        let snapshot = PoolSnapshot::with_slots(self.version, self.freshness, workers);
        let key = roster_key(&snapshot);
        let changed = key != self.roster_key;
        if changed {
            self.roster_key = key;
        }
        self.pool.publish(snapshot, changed);
    }

    /// End-of-round bookkeeping: the blind-gate warning and the completed-round count.
    pub(super) fn finish_round(&mut self, now: Instant) {
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
        self.pool.rounds_completed(self.completed_rounds);
    }
}

impl Tracked {
    /// `cachepick_scrapes_total{outcome}` for this worker.
    fn count(&self, outcome: ScrapeOutcome) {
        if let Some(counter) = ScrapeOutcome::ALL
            .iter()
            .position(|o| *o == outcome)
            .and_then(|position| self.counters.get(position))
        {
            counter.inc();
        }
    }

    /// Takes in a report the worker answered with: a restart forgets the old run's samples and
    /// counters; a newer complete reading settles what was dispatched before the request was `sent`
    /// and feeds the arrival share and the prefill meter. Returns whether the engine restarted and
    /// whether it is idle.
    fn absorb(
        &mut self,
        report: Report,
        (sent, dispatched): (Instant, Window),
        dispatches: &DispatchTable,
        share: &mut ShareMeter,
    ) -> (bool, bool) {
        let restarted = self
            .identity
            .is_some_and(|earlier| report.identity.restarted_since(&earlier));
        let mut idle = false;
        if restarted {
            // The old run's samples describe a cache that is gone, its counters a run that is.
            self.ranks.clear();
            self.meter.reset();
            self.arrivals.reset();
        }
        self.identity = Some(report.identity);
        let before = self.state.reading.map(|reading| reading.captured_at);
        self.ranks.record(report.ranks, sent);
        self.state.scrape.last_error = self.ranks.missing(sent);
        self.state.reading = self.ranks.reading();
        self.state.capacity = self.ranks.capacity(self.configured);
        if let Some(reading) = self.state.reading
            && reading.complete
            && before.is_none_or(|before| reading.captured_at > before)
        {
            // The engine's numbers cover what was sent before the request, not what was sent
            // while it was in flight.
            dispatches.forget(self.id, dispatched);
            if let Some(arrived) = self
                .arrivals
                .observe(report.progress.first_tokens, reading.load.waiting)
            {
                share.observe(arrived, dispatched.seen());
                dispatches.set_share(share.scale());
            }
            idle = reading.load.waiting == 0 && reading.load.running == 0;
            self.meter
                .observe(reading.captured_at, &report.progress, reading.load.waiting);
            let routed = dispatches.queued(self.id, dispatched, reading.load.waiting);
            self.state.prefill = PrefillEstimate {
                waiting_routed_tokens: routed.map(|queue| queue.waiting_tokens),
                routed_per_request: routed.map(|queue| queue.per_request),
                ..self.meter.estimate()
            };
        }
        (restarted, idle)
    }

    /// The state of a worker neither draining nor restarted after a scrape that `timed_out`, or went
    /// `unanswered` (counted towards unreachable): logged when it changes.
    fn settle(
        &mut self,
        pool: &str,
        unreachable_after: NonZeroU32,
        timed_out: bool,
        unanswered: bool,
    ) {
        let next = answered_state(self.failures, unreachable_after, timed_out);
        let next = match (self.state.lifecycle, next) {
            // A new worker stays new until it answers once, however many failures.
            (Lifecycle::New, Lifecycle::Healthy | Lifecycle::Late) if timed_out || unanswered => {
                Lifecycle::New
            }
            _ => next,
        };
        if next == self.state.lifecycle {
            return;
        }
        let endpoint = self.state.endpoint;
        match next {
            Lifecycle::Unreachable => tracing::warn!(pool, worker = %endpoint,
                failures = self.failures, "worker unreachable; not an owner until it answers"),
            _ => tracing::info!(pool, worker = %endpoint, state = next.as_str(), "worker state"),
        }
        self.state.lifecycle = next;
    }

    /// Applies a changed description from discovery: what is scraped, and how.
    fn reconfigure(
        &mut self,
        config: &WorkerConfig,
        engine: Engine,
        engine_block: Option<std::num::NonZeroU32>,
    ) {
        if config.dp_size != self.config.dp_size {
            self.ranks = RankSamples::new(config.dp_size.get());
            self.state.reading = None;
        }
        self.state.role = config.role;
        self.configured = configured_capacity(config, engine_block);
        self.target = Arc::new(Target::new(config, engine));
        self.config = config.clone();
    }
}

/// The state of a worker that is not draining or restarted, after `failures` unanswered scrapes in a
/// row, the last of them `timed_out`.
fn answered_state(failures: u32, unreachable_after: NonZeroU32, timed_out: bool) -> Lifecycle {
    if failures >= unreachable_after.get() {
        Lifecycle::Unreachable
    } else if timed_out {
        Lifecycle::Late
    } else {
        Lifecycle::Healthy
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

#[cfg(test)]
mod tests;

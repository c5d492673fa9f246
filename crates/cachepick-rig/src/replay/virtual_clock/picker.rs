//! cachepick's arm in virtual time: its own request pipeline, in process, with the time passed in.
//!
//! Each picker replica is what `cachepick serve` builds from the arm's configuration — the
//! [`Service`] over a [`Picker`] and its pools' loads — minus the servers. What differs is who drives
//! it:
//!
//! - a request is routed by [`Service::route`] with a live commit at the virtual moment, its body the
//!   completion the wall-clock replay sends; replicas take requests in turn (Envoy's round robin over
//!   the picker cluster); the decision costs no virtual time;
//! - each replica's roster is a [`ScrapeDriver`]: every `scrape_interval` each idle worker is asked
//!   for `/metrics`, which the worker renders on its API loop behind what that loop has queued
//!   ([`cachepick_sim::offline::OfflineWorker::metrics_ready`]); the answer is read by the product's
//!   parser and applied when it is ready, or the scrape fails at `scrape_timeout`;
//! - a routed request's credit is settled at its first token, as Envoy's response-phase report would
//!   settle it (`feedback.enabled`);
//! - with `replica_sync`, each dispatch's announcement is encoded as the datagram and delivered to
//!   every other replica after [`SYNC_DELAY`], through the receive task's own last step
//!   ([`take_announcement`]);
//! - in `events` mode, what each rank's cache did is encoded as the engine's KV event batch (the
//!   simulator's encoder, the fleet engine's format) and delivered to every replica after
//!   [`EVENT_DELAY`], decoded by the product's decoder and applied by its applier to the rank's slot
//!   of the pool's index, as a subscriber applies it. No batch is lost or reordered.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use cachepick::config::{self, Config, IndexMode};
use cachepick::events::EventBatch;
use cachepick::events::apply::Applier;
use cachepick::events::decode::decode_batch;
use cachepick::events::stream::Stream;
use cachepick::load::{
    Announce, Announcement, PoolLoad, ScrapeDriver, ScrapeError, ScrapeObserver, ScrapeTicket,
    SyncKeys, take_announcement,
};
use cachepick::metrics::Metrics;
use cachepick::route::{
    Answer, Commit, CommitGate, Credit, Inbound, IndexSnapshot, Moment, Picker, ServedReport,
    Service,
};
use cachepick::worker::WorkerId;
use cachepick_sim::fleet::{ConfiguredWorker, cachepick_config_for};
use cachepick_sim::kv_events::encode_batch;
use cachepick_sim::{KvEventsFormat, SimConfig};

use super::engine::{Belief, Cx, Routed, Router, Wake};
use crate::replay::ReplayError;
use crate::replay::arms::{arm_text, load_yaml};

/// A `replica_sync` datagram's time on loopback between two replicas.
pub const SYNC_DELAY: Duration = Duration::from_micros(200);

/// A KV event batch's time from the engine's publisher to every picker's subscriber.
pub const EVENT_DELAY: Duration = Duration::from_millis(1);

/// The path every request is sent to, as the wall-clock replay sends it.
pub(super) const PATH: &str = "/v1/completions";

/// The endpoints a virtual fleet's configuration names: never bound, only compared.
pub(super) fn endpoints(sim: &SimConfig) -> Vec<SocketAddr> {
    (0..sim.workers.get())
        .map(|index| SocketAddr::from(([127, 0, 0, 1], 20_000 + index as u16)))
        .collect()
}

/// The arm's configuration: the fleet's generated one with the arm's `policy:`, the load section in
/// model time and the index mode, validated as `serve` validates it.
pub(super) fn configuration(
    sim: &SimConfig,
    policy: &str,
    mode: IndexMode,
    interval: Option<Duration>,
) -> Result<Config, ReplayError> {
    let workers: Vec<ConfiguredWorker> = endpoints(sim)
        .into_iter()
        .map(|endpoint| ConfiguredWorker {
            endpoint,
            kv_live: None,
            kv_replay: None,
        })
        .collect();
    let listen = SocketAddr::from(([127, 0, 0, 1], 9002));
    let metrics = SocketAddr::from(([127, 0, 0, 1], 9090));
    let generated = cachepick_config_for(sim, &workers, listen, metrics);
    let load = load_yaml(sim, interval);
    let text = arm_text(&generated, policy, Some(&load), mode)?;
    config::parse(
        &text,
        "the virtual replay's configuration",
        &config::Overrides::default(),
    )
    .map_err(|error| ReplayError::Picker(error.to_string()))
}

/// An `events` pool's appliers, worker by worker and rank by rank, as its feeds build them (none in
/// `approximate` mode).
fn appliers(service: &Service, pool: &config::PoolConfig, dp_size: u32) -> Vec<Vec<Applier>> {
    let Some((_, index)) = service
        .picker()
        .event_indexes()
        .into_iter()
        .find(|(config, _)| config.index.mode == IndexMode::Events)
    else {
        return Vec::new();
    };
    let model = match &pool.model {
        config::ModelMatch::Exact(name) => name.clone(),
        config::ModelMatch::Any => "*".to_owned(),
    };
    (0..pool.workers.len())
        .map(|worker| {
            let id = WorkerId(u32::try_from(worker).unwrap_or(u32::MAX));
            (0..dp_size)
                .filter_map(|rank| {
                    let slot = index.slot(id, rank)?;
                    let sockets = pool.workers.get(worker)?.kv_events.for_rank(rank);
                    let stream = Arc::new(Stream::new(id, rank, sockets.live, sockets.replay));
                    Some(Applier::new(
                        Arc::clone(&index),
                        slot,
                        model.clone(),
                        stream,
                    ))
                })
                .collect()
        })
        .collect()
}

/// Announcements a replica made, waiting to be delivered.
#[derive(Debug, Default)]
struct Outbox(Mutex<Vec<Sent>>);

/// One announcement: the pool, the worker, the uncached tokens, the chain's checkpoint hashes.
type Sent = (String, SocketAddr, u64, Vec<u64>);

impl Announce for Outbox {
    fn announce(&self, pool: &str, worker: SocketAddr, uncached_tokens: u64, checkpoints: &[u64]) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push((
            pool.to_owned(),
            worker,
            uncached_tokens,
            checkpoints.to_vec(),
        ));
    }
}

/// One picker replica.
struct Replica {
    service: Arc<Service>,
    /// `events` mode: the appliers of the pool's index, by worker and rank.
    appliers: Vec<Vec<Applier>>,
    driver: ScrapeDriver,
    /// Each pool's load with its `max_model_len`, as the sync's receive task holds them.
    loads: Vec<(Arc<PoolLoad>, u64)>,
    outbox: Arc<Outbox>,
}

/// A scrape in flight: whose, of which worker, and when its answer is ready there.
struct InFlight {
    replica: usize,
    worker: usize,
    ready: f64,
    ticket: ScrapeTicket,
}

/// The last replica of an arm joins it while it runs (`--join-at`): at `at` model seconds after the
/// first arrival it starts scraping, and once its first scrape round is complete (when `serve` would
/// say it is ready) it takes its turn in the round robin, with its siblings' owner indexes adopted
/// first when [`JoinStart::Warm`] (their snapshots through the product's own encoding, as `serve`
/// asks for them), or cold. Before it starts nobody sends it anything. In `events` mode it gets no batch until it is
/// ready, then every batch published since the start, in order, as a stream that subscribes and asks
/// the engine to replay from the beginning gets them (a replay ring that holds the whole run: the
/// engine's own is bounded), then the live ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Join {
    pub at: f64,
    pub start: JoinStart,
}

/// How the last replica starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum JoinStart {
    /// It is there from the start, like the others: what the joining ones are held to.
    Present,
    /// It joins at `at` and learns from its own traffic, as `serve` did before the warm start.
    Cold,
    /// It joins at `at` and adopts its siblings' owner indexes first.
    Warm,
}

/// Where the joining replica is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Joining {
    NotYet,
    Scraping,
    Joined,
}

/// cachepick's arm: `replicas` pickers of one configuration.
pub(super) struct PickerRouter {
    replicas: Vec<Replica>,
    join: Option<Join>,
    joining: Joining,
    /// `events` mode, while a replica is joining: every batch published so far, for its replay.
    history: Vec<(usize, u32, Arc<EventBatch>)>,
    /// Virtual time 0 as an `Instant`: the product's types take instants; only differences matter.
    epoch: Instant,
    rng: SmallRng,
    workers: BTreeMap<SocketAddr, usize>,
    interval: f64,
    timeout: f64,
    scrapes: BTreeMap<u64, InFlight>,
    next_ticket: u64,
    sync: bool,
    /// What the replicas' announcements are sealed and opened with: the sync between loopback
    /// replicas, as the wall-clock replay runs it.
    sync_keys: SyncKeys,
    /// `events` mode: the engines' batch format and block size.
    events: Option<(KvEventsFormat, u32)>,
    /// Each routed request's credit, with the replica that committed it.
    credits: Vec<Option<(usize, String, Credit)>>,
}

impl PickerRouter {
    pub fn new(
        config: &Config,
        sim: &SimConfig,
        (replicas, sync, join): (usize, bool, Option<Join>),
        requests: usize,
        seed: u64,
    ) -> Result<PickerRouter, ReplayError> {
        // The one reading of the clock: the origin virtual time is counted from.
        let epoch = Instant::now();
        let fail = |error: String| ReplayError::Picker(error);
        let mut built = Vec::with_capacity(replicas);
        for _ in 0..replicas.max(1) {
            let loads = PoolLoad::for_pools(config);
            let picker = Picker::new(config, &loads).map_err(|error| fail(error.to_string()))?;
            let metrics = Arc::new(Metrics::new().map_err(|error| fail(error.to_string()))?);
            let service = Service::with_overload(picker, Arc::clone(&metrics), &config.overload);
            let (Some(pool), Some(load)) = (config.pools.first(), loads.first()) else {
                return Err(fail("the configuration has no pool".to_owned()));
            };
            let observer: Arc<dyn ScrapeObserver> = metrics;
            let driver = ScrapeDriver::new(
                pool,
                &config.load,
                Arc::clone(load),
                observer,
                service.roster(0),
                epoch,
            );
            let outbox = Arc::new(Outbox::default());
            if sync {
                load.announce_through(Arc::clone(&outbox) as Arc<dyn Announce>);
            }
            let loads = config
                .pools
                .iter()
                .zip(&loads)
                .map(|(pool, load)| (Arc::clone(load), pool.max_model_len.get()))
                .collect();
            let appliers = appliers(&service, pool, sim.dp_size.get());
            built.push(Replica {
                appliers,
                service,
                driver,
                loads,
                outbox,
            });
        }
        let join = join.filter(|join| built.len() > 1 && join.start != JoinStart::Present);
        Ok(PickerRouter {
            replicas: built,
            join,
            joining: if join.is_some() {
                Joining::NotYet
            } else {
                Joining::Joined
            },
            history: Vec::new(),
            epoch,
            rng: SmallRng::seed_from_u64(seed),
            workers: endpoints(sim)
                .into_iter()
                .enumerate()
                .map(|(index, endpoint)| (endpoint, index))
                .collect(),
            interval: config.load.scrape_interval.as_secs_f64(),
            timeout: config.load.scrape_timeout.as_secs_f64(),
            scrapes: BTreeMap::new(),
            next_ticket: 0,
            sync,
            sync_keys: SyncKeys::loopback_only(),
            events: (config.pools.first().map(|pool| pool.index.mode) == Some(IndexMode::Events))
                .then(|| {
                    (
                        KvEventsFormat::default_for(sim.engine),
                        sim.block_size.get(),
                    )
                }),
            credits: (0..requests).map(|_| None).collect(),
        })
    }

    fn at(&self, now: f64) -> Instant {
        self.epoch + Duration::from_secs_f64(now.max(0.0))
    }

    /// Replicas that exist: the joining one not before it starts.
    fn present(&self) -> usize {
        match self.joining {
            Joining::NotYet => self.replicas.len() - 1,
            Joining::Scraping | Joining::Joined => self.replicas.len(),
        }
    }

    /// Replicas that take requests: the joining one once it is ready.
    fn active(&self) -> usize {
        match self.joining {
            Joining::NotYet | Joining::Scraping => self.replicas.len() - 1,
            Joining::Joined => self.replicas.len(),
        }
    }

    /// Moves the joining replica along at `now`: it starts scraping at its time, and is ready (warm
    /// or cold) once its first scrape round is complete.
    fn follow_join(&mut self, cx: &mut Cx<'_>) {
        let Some(join) = self.join else {
            return;
        };
        let joiner = self.replicas.len() - 1;
        let first = cx
            .workload
            .requests
            .first()
            .map_or(0.0, |request| request.at);
        if self.joining == Joining::NotYet && cx.now - first >= join.at {
            self.joining = Joining::Scraping;
            cx.schedule(cx.now, Wake::Tick { replica: joiner });
        }
        let scraped = self.replicas.get(joiner).is_some_and(|state| {
            state
                .loads
                .iter()
                .all(|(load, _)| *load.rounds().borrow() > 0)
        });
        if self.joining != Joining::Scraping || !scraped {
            return;
        }
        self.joining = Joining::Joined;
        for (worker, rank, batch) in std::mem::take(&mut self.history) {
            cx.schedule(
                cx.now + EVENT_DELAY.as_secs_f64(),
                Wake::KvEvents {
                    replica: joiner,
                    worker,
                    rank,
                    batch,
                },
            );
        }
        if join.start != JoinStart::Warm {
            return;
        }
        let Some((state, siblings)) = self.replicas.split_last() else {
            return;
        };
        for sibling in siblings {
            let bytes = sibling.service.picker().index_snapshot().encode();
            if let Ok(snapshot) = IndexSnapshot::decode(&bytes) {
                state.service.picker().adopt(&snapshot);
            }
        }
    }

    /// Replica `replica`'s scrape round at `now`.
    fn tick(&mut self, replica: usize, cx: &mut Cx<'_>) {
        let at = self.at(cx.now);
        let Some(state) = self.replicas.get_mut(replica) else {
            return;
        };
        for ticket in state.driver.tick(at) {
            let Some(&worker) = self.workers.get(&ticket.endpoint) else {
                state
                    .driver
                    .failed(ticket, ScrapeError::Connect("no such worker".into()), at);
                continue;
            };
            let Some(engine) = cx.workers.get_mut(worker) else {
                continue;
            };
            let ready = engine.metrics_ready(cx.now);
            self.next_ticket += 1;
            let id = self.next_ticket;
            cx.schedule(
                ready.min(cx.now + self.timeout),
                Wake::Scraped { ticket: id },
            );
            self.scrapes.insert(
                id,
                InFlight {
                    replica,
                    worker,
                    ready,
                    ticket,
                },
            );
        }
        cx.schedule(cx.now + self.interval, Wake::Tick { replica });
    }

    /// Scrape `ticket`'s answer is ready, or its timeout came first.
    fn scraped(&mut self, ticket: u64, cx: &mut Cx<'_>) {
        let Some(scrape) = self.scrapes.remove(&ticket) else {
            return;
        };
        let at = self.at(cx.now);
        let Some(state) = self.replicas.get_mut(scrape.replica) else {
            return;
        };
        // Nanosecond rounding of the queue's clock aside, the answer is not ready: the timeout won.
        if scrape.ready > cx.now + 1e-6 {
            let timeout = Duration::from_secs_f64(self.timeout);
            state
                .driver
                .failed(scrape.ticket, ScrapeError::Timeout(timeout), at);
            return;
        }
        let body = cx
            .workers
            .get(scrape.worker)
            .map(|worker| worker.render_metrics())
            .unwrap_or_default();
        state.driver.answered(scrape.ticket, body.as_bytes(), at);
    }

    /// Delivers what replica `from` announced to every other replica, after the datagram's delay.
    fn send_announcements(&mut self, from: usize, cx: &mut Cx<'_>) {
        let Some(state) = self.replicas.get(from) else {
            return;
        };
        let sent = std::mem::take(
            &mut *state
                .outbox
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (pool, worker, uncached_tokens, checkpoints) in sent {
            // Delivered in order, once each, in virtual time: the receiver's freshness and replay
            // checks (wall-clock milliseconds) are skipped, the MAC is not.
            let announcement = Announcement {
                origin: from as u64,
                sequence: 0,
                sent_at_ms: 0,
                pool: &pool,
                worker,
                uncached_tokens,
                checkpoints,
            };
            let Some(datagram) = announcement.seal(&self.sync_keys) else {
                continue;
            };
            for replica in (0..self.present()).filter(|replica| *replica != from) {
                cx.schedule(
                    cx.now + SYNC_DELAY.as_secs_f64(),
                    Wake::Announced {
                        replica,
                        datagram: datagram.clone(),
                    },
                );
            }
        }
    }
}

impl Router for PickerRouter {
    fn start(&mut self, cx: &mut Cx<'_>) {
        if self.events.is_some() {
            for worker in cx.workers.iter_mut() {
                worker.record_events(true);
            }
        }
        for replica in 0..self.present() {
            cx.schedule(0.0, Wake::Tick { replica });
        }
    }

    fn route(&mut self, request: usize, cx: &mut Cx<'_>) -> Option<Routed> {
        self.follow_join(cx);
        let body = cx.workload.body(request, cx.text(request));
        // By the request's place in the arrivals, which is also the order of the calls: the same
        // request goes to the same replica in every arm that has as many replicas taking requests.
        let replica = request % self.active();
        let moment = Moment {
            at: self.at(cx.now),
            seed: self.rng.random(),
        };
        let state = self.replicas.get(replica)?;
        let inbound = Inbound {
            method: Some("POST"),
            ..Inbound::new(PATH, Some(&body))
        };
        let answer = state
            .service
            .route(&inbound, Commit::Live(&CommitGate::open()), moment)
            .answer;
        if self.sync {
            self.send_announcements(replica, cx);
        }
        let Answer::Route(routed) = answer else {
            return None;
        };
        let worker = *self.workers.get(routed.endpoints.first()?)?;
        if let (Some(credit), Some(slot)) = (routed.credit.clone(), self.credits.get_mut(request)) {
            *slot = Some((replica, routed.pool.clone(), credit));
        }
        Some(Routed {
            worker,
            reason: routed.label(),
            belief: Some(Belief {
                credited_tokens: routed.matched_tokens,
                predicted_s: routed.predicted_ttft_us.map(|us| us as f64 / 1e6),
            }),
            replica,
        })
    }

    fn wake(&mut self, wake: Wake, cx: &mut Cx<'_>) {
        match wake {
            Wake::Tick { replica } => self.tick(replica, cx),
            Wake::Scraped { ticket } => self.scraped(ticket, cx),
            Wake::Announced { replica, datagram } => {
                if let (Some(state), Some(announcement)) = (
                    self.replicas.get(replica),
                    Announcement::open(&datagram, &self.sync_keys).ok(),
                ) {
                    take_announcement(&announcement, &state.loads, self.at(cx.now));
                }
            }
            Wake::KvEvents {
                replica,
                worker,
                rank,
                batch,
            } => {
                let applier = self
                    .replicas
                    .get(replica)
                    .and_then(|state| state.appliers.get(worker))
                    .and_then(|ranks| ranks.get(rank as usize));
                if let Some(applier) = applier {
                    applier.apply(&batch);
                }
            }
        }
    }

    fn published(&mut self, worker: usize, cx: &mut Cx<'_>) {
        let Some((format, block_size)) = self.events else {
            return;
        };
        let Some(engine) = cx.workers.get_mut(worker) else {
            return;
        };
        let batches = engine.take_events();
        for (rank, events) in (0u32..).zip(batches) {
            if events.is_empty() {
                continue;
            }
            let payload = encode_batch(format, cx.now, rank, block_size, &events);
            // Every replica's subscriber gets the same bytes and its decoder makes the same batch of
            // them: decoded once, applied by each replica's own applier.
            let Ok(batch) = decode_batch(&payload) else {
                continue;
            };
            let batch = Arc::new(batch);
            if self.active() < self.replicas.len() {
                self.history.push((worker, rank, Arc::clone(&batch)));
            }
            for replica in 0..self.active() {
                cx.schedule(
                    cx.now + EVENT_DELAY.as_secs_f64(),
                    Wake::KvEvents {
                        replica,
                        worker,
                        rank,
                        batch: Arc::clone(&batch),
                    },
                );
            }
        }
    }

    fn first_token(&mut self, request: usize, worker: usize, cx: &mut Cx<'_>) {
        let Some((replica, pool, credit)) = self.credits.get_mut(request).and_then(Option::take)
        else {
            return;
        };
        let upstream = self
            .workers
            .iter()
            .find(|(_, index)| **index == worker)
            .map(|(endpoint, _)| *endpoint);
        let report = ServedReport {
            status: 200,
            upstream,
            at: self.at(cx.now),
        };
        if let Some(state) = self.replicas.get(replica) {
            state.service.settle(&pool, &credit, Some(report));
        }
    }
}

//! Every KV event stream of every `events` pool: one subscriber per worker rank, each feeding its
//! rank's slot of the pool's [`EventIndex`]. Workers join and leave with the pool's roster: a joining
//! worker's subscribers start at once (or with the feeds, if they have not started), a leaving one's
//! stop.
//!
//! A worker whose sockets the engine names (`index.sockets: advertised`, no `kv_events:` of its own)
//! is subscribed at the pool's ports at once and asked where it publishes ([`locate`]) until it
//! answers, then every [`LOCATE_EVERY`]: an engine restarted on a new port, or one that starts
//! advertising, is followed. A rank whose socket moves is another publisher, so what its slot learned
//! is forgotten and its stream starts over.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use super::apply::Applier;
use super::locate::{self, LocateError, RankSockets};
use super::stream::{Stream, StreamView};
use super::subscriber::Subscriber;
use crate::config::{
    IndexMode, KvEventEndpoints, KvEventsFrom, ModelMatch, PoolConfig, WorkerConfig,
};
use crate::load::{HttpClient, PoolLoad};
use crate::prefix::EventIndex;
use crate::worker::WorkerId;

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;
type ShutdownFactory = Arc<dyn Fn() -> Shutdown + Send + Sync>;

/// How often an engine is asked again once it answered (or said it does not advertise).
pub const LOCATE_EVERY: Duration = Duration::from_secs(30);
/// Retries while the engine cannot be asked (it is still starting: vLLM answers about a minute after
/// it starts), doubling to [`LOCATE_EVERY`].
const LOCATE_RETRY: Duration = Duration::from_millis(500);

/// What the feeds run with once started.
#[derive(Clone)]
struct Started {
    shutdown: ShutdownFactory,
    /// Asks the engines where they publish: the scrapers' client, TLS included.
    client: HttpClient,
}

/// One rank's stream and its subscriber.
struct RankFeed {
    sockets: KvEventEndpoints,
    stream: Arc<Stream>,
    /// Waiting for [`EventFeeds::start`].
    pending: Option<Subscriber>,
    running: Option<tokio::task::AbortHandle>,
}

impl Drop for RankFeed {
    fn drop(&mut self) {
        if let Some(task) = &self.running {
            task.abort();
        }
    }
}

/// One worker's streams, one per rank, and what finds their sockets.
struct WorkerFeed {
    /// The worker as it joined: a later join that changes none of what the feed reads keeps it.
    joined: WorkerConfig,
    ranks: Vec<RankFeed>,
    /// Asks the engine where it publishes; `Some(None)` until the feeds start.
    locator: Option<Option<tokio::task::AbortHandle>>,
}

impl Drop for WorkerFeed {
    fn drop(&mut self) {
        if let Some(Some(task)) = &self.locator {
            task.abort();
        }
    }
}

/// Whether a worker that joins again as `new` can keep the feed it has as `old`.
fn same_feed(old: &WorkerConfig, new: &WorkerConfig) -> bool {
    (
        old.endpoint,
        old.kv_events,
        old.kv_events_from,
        old.dp_size,
        &old.metrics_url,
    ) == (
        new.endpoint,
        new.kv_events,
        new.kv_events_from,
        new.dp_size,
        &new.metrics_url,
    )
}

/// One pool's streams.
pub struct PoolFeed {
    pub pool: String,
    index: Arc<EventIndex>,
    topic: String,
    grace: Duration,
    workers: Mutex<BTreeMap<WorkerId, WorkerFeed>>,
    /// The pool's load, once known: where the streams report the restarts they see.
    load: Arc<OnceLock<Arc<PoolLoad>>>,
}

/// The streams of every `events` pool.
pub struct EventFeeds {
    pools: Vec<Arc<PoolFeed>>,
    /// Set by [`EventFeeds::start`]: how a subscriber started later learns of the shutdown.
    started: Mutex<Option<Started>>,
}

impl EventFeeds {
    /// A subscriber for every rank of every file worker of each `events` pool, feeding that pool's
    /// index; workers that join later come through [`EventFeeds::join`].
    pub fn new<'c>(
        pools_and_indexes: impl IntoIterator<Item = (&'c PoolConfig, Arc<EventIndex>)>,
    ) -> EventFeeds {
        let mut pools = Vec::new();
        for (pool, index) in pools_and_indexes {
            if pool.index.mode != IndexMode::Events {
                continue;
            }
            let feed = Arc::new(PoolFeed {
                pool: match &pool.model {
                    ModelMatch::Exact(name) => name.clone(),
                    ModelMatch::Any => "*".to_owned(),
                },
                index,
                topic: pool.index.topic.clone(),
                grace: pool.index.stream_grace,
                workers: Mutex::new(BTreeMap::new()),
                load: Arc::new(OnceLock::new()),
            });
            for (id, worker) in pool.workers.iter().enumerate() {
                feed.join(WorkerId(id as u32), worker, None);
            }
            pools.push(feed);
        }
        EventFeeds {
            pools,
            started: Mutex::new(None),
        }
    }

    /// Starts every subscriber on the current runtime, and those of workers that join later; each stops
    /// when its `shutdown()` completes or its worker leaves. Engines are asked where they publish with
    /// `client`. The subscribers started now are returned so the caller can wait for them.
    pub fn start<F>(
        &self,
        shutdown: impl Fn() -> F + Send + Sync + 'static,
        client: HttpClient,
    ) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let shutdown: ShutdownFactory = Arc::new(move || Box::pin(shutdown()) as Shutdown);
        let started = Started { shutdown, client };
        *self.started.lock().unwrap_or_else(PoisonError::into_inner) = Some(started.clone());
        let mut handles = Vec::new();
        for pool in &self.pools {
            let mut workers = pool.workers.lock().unwrap_or_else(PoisonError::into_inner);
            for (&id, worker) in workers.iter_mut() {
                for rank in &mut worker.ranks {
                    if let Some(subscriber) = rank.pending.take() {
                        let handle = tokio::spawn(subscriber.run((started.shutdown)()));
                        rank.running = Some(handle.abort_handle());
                        handles.push(handle);
                    }
                }
                if let Some(locator @ None) = &mut worker.locator {
                    *locator = Some(pool.spawn_locator(id, worker.joined.clone(), &started));
                }
            }
        }
        handles
    }

    fn started(&self) -> Option<Started> {
        self.started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `worker` takes slot `id` of pool `pool`: subscribes to its ranks (at once if the feeds run). A
    /// worker already there with the same sockets keeps its streams.
    pub fn join(&self, pool: &str, id: WorkerId, worker: &WorkerConfig) {
        if let Some(feed) = self.pools.iter().find(|feed| feed.pool == pool) {
            feed.join(id, worker, self.started());
        }
    }

    /// The worker in slot `id` of pool `pool` left: its subscribers stop.
    pub fn leave(&self, pool: &str, id: WorkerId) {
        if let Some(feed) = self.pools.iter().find(|feed| feed.pool == pool) {
            feed.workers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        }
    }

    /// The streams of pool `pool` report the engine restarts they see to `load` from now on.
    pub fn report_restarts(&self, pool: &str, load: Arc<PoolLoad>) {
        if let Some(feed) = self.pools.iter().find(|feed| feed.pool == pool) {
            let _ = feed.load.set(load);
        }
    }

    pub fn pools(&self) -> impl Iterator<Item = &PoolFeed> {
        self.pools.iter().map(|pool| &**pool)
    }

    /// Streams whose first try is over, and all streams, over every pool.
    pub fn settled(&self) -> (usize, usize) {
        self.pools
            .iter()
            .flat_map(|feed| feed.streams())
            .fold((0, 0), |(settled, all), stream| {
                (settled + usize::from(stream.settled()), all + 1)
            })
    }

    /// Every stream's counters now, by pool.
    pub fn views(&self, now: Instant) -> Vec<(String, Vec<StreamView>)> {
        self.pools
            .iter()
            .map(|feed| (feed.pool.clone(), feed.views(now)))
            .collect()
    }
}

impl PoolFeed {
    fn join(self: &Arc<Self>, id: WorkerId, worker: &WorkerConfig, started: Option<Started>) {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        if workers
            .get(&id)
            .is_some_and(|feed| same_feed(&feed.joined, worker))
        {
            return;
        }
        let mut feed = WorkerFeed {
            joined: worker.clone(),
            ranks: Vec::new(),
            locator: None,
        };
        // Until the engine names its sockets, the pool's ports: where engines publish by default.
        let from = match worker.kv_events_from {
            KvEventsFrom::Engine => KvEventsFrom::Pool,
            from => from,
        };
        for rank in 0..worker.dp_size.get() {
            let sockets = worker.kv_events.for_rank(rank);
            if let Some(subscribed) = self.subscribe(id, rank, sockets, from, started.as_ref()) {
                feed.ranks.push(subscribed);
            }
        }
        if worker.kv_events_from == KvEventsFrom::Engine {
            feed.locator = Some(
                started
                    .as_ref()
                    .map(|started| self.spawn_locator(id, worker.clone(), started)),
            );
        }
        // Replacing a feed drops the old one, which stops its subscribers and its locator.
        workers.insert(id, feed);
    }

    /// A subscriber for rank `rank` of worker `id` at `sockets`, started if the feeds run.
    fn subscribe(
        &self,
        id: WorkerId,
        rank: u32,
        sockets: KvEventEndpoints,
        from: KvEventsFrom,
        started: Option<&Started>,
    ) -> Option<RankFeed> {
        let slot = self.index.slot(id, rank)?;
        let stream = Arc::new(Stream::new(id, rank, sockets.live, sockets.replay).named_by(from));
        let applier = Applier::new(
            Arc::clone(&self.index),
            slot,
            self.pool.clone(),
            Arc::clone(&stream),
        )
        .reporting_to(Arc::clone(&self.load), id);
        let subscriber = Subscriber::new(applier, self.topic.clone(), self.grace);
        let (pending, running) = match started {
            Some(started) => {
                let handle = tokio::spawn(subscriber.run((started.shutdown)()));
                (None, Some(handle.abort_handle()))
            }
            None => (Some(subscriber), None),
        };
        Some(RankFeed {
            sockets,
            stream,
            pending,
            running,
        })
    }

    fn spawn_locator(
        self: &Arc<Self>,
        id: WorkerId,
        worker: WorkerConfig,
        started: &Started,
    ) -> tokio::task::AbortHandle {
        let feed = Arc::downgrade(self);
        let started = started.clone();
        let shutdown = (started.shutdown)();
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown => {}
                () = locate_forever(feed, id, worker, started) => {}
            }
        })
        .abort_handle()
    }

    /// The engine of worker `id` (as `worker`) named `answer`: ranks it names move there, the others
    /// are at the pool's ports. Says whether any rank moved.
    fn located(
        &self,
        id: WorkerId,
        worker: &WorkerConfig,
        answer: &RankSockets,
        started: &Started,
    ) -> bool {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(feed) = workers.get_mut(&id) else {
            return false;
        };
        if !same_feed(&feed.joined, worker) {
            return false;
        }
        let mut moved = false;
        for rank in &mut feed.ranks {
            let r = rank.stream.rank;
            let (sockets, from) = match answer.get(r as usize).copied().flatten() {
                Some(sockets) => (sockets, KvEventsFrom::Engine),
                None => (worker.kv_events.for_rank(r), KvEventsFrom::Pool),
            };
            if sockets == rank.sockets {
                rank.stream.set_from(from);
                continue;
            }
            // Another publisher (or the same engine restarted on another port): what the slot learned
            // from the old socket is not this one's.
            if let Some(slot) = self.index.slot(id, r) {
                self.index.clear(slot);
            }
            if let Some(subscribed) = self.subscribe(id, r, sockets, from, Some(started)) {
                *rank = subscribed;
                moved = true;
            }
        }
        moved
    }

    /// The pool's streams, by worker slot and rank.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .flat_map(|feed| feed.ranks.iter().map(|rank| Arc::clone(&rank.stream)))
            .collect()
    }

    fn views(&self, now: Instant) -> Vec<StreamView> {
        self.streams()
            .iter()
            .map(|stream| stream.view(now))
            .collect()
    }
}

/// Asks worker `id`'s engine where it publishes, again and again, and moves its streams there; logs
/// each change of the answer. Ends when the pool's feed is gone.
async fn locate_forever(
    feed: Weak<PoolFeed>,
    id: WorkerId,
    worker: WorkerConfig,
    started: Started,
) {
    let mut retry = LOCATE_RETRY;
    let mut last: Option<Result<RankSockets, LocateError>> = None;
    loop {
        let answer = locate::ask(&started.client, &worker).await;
        let Some(pool) = feed.upgrade() else {
            return;
        };
        let wait = match &answer {
            Ok(sockets) => {
                if pool.located(id, &worker, sockets, &started) {
                    tracing::info!(pool = %pool.pool, worker = %worker.endpoint, sockets = ?sockets,
                        "the engine named its KV event sockets; subscribing there");
                }
                LOCATE_EVERY
            }
            Err(error) if error.is_answer() => {
                // What the engine says now stands: ranks it no longer names go back to the pool's ports.
                pool.located(id, &worker, &Vec::new(), &started);
                if last
                    .as_ref()
                    .is_none_or(|last| last.as_ref().err() != Some(error))
                {
                    tracing::warn!(pool = %pool.pool, worker = %worker.endpoint, %error,
                        "KV event sockets stay at the pool's ports (a worker's kv_events: overrides)");
                }
                LOCATE_EVERY
            }
            Err(error) => {
                tracing::debug!(pool = %pool.pool, worker = %worker.endpoint, %error,
                    "cannot ask the engine where it publishes yet");
                retry = retry.saturating_mul(2).min(LOCATE_EVERY);
                retry
            }
        };
        drop(pool);
        if answer.as_ref().is_ok() || answer.as_ref().is_err_and(LocateError::is_answer) {
            retry = LOCATE_RETRY;
            last = Some(answer);
        }
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests;

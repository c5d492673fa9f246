//! Every KV event stream of every `events` pool: one subscriber per worker rank, each feeding its
//! rank's slot of the pool's [`EventIndex`]. Workers join and leave with the pool's roster: a joining
//! worker's subscribers start at once (or with the feeds, if they have not started), a leaving one's
//! stop.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::apply::Applier;
use super::stream::{Stream, StreamView};
use super::subscriber::Subscriber;
use crate::config::{IndexMode, KvEventEndpoints, ModelMatch, PoolConfig, WorkerConfig};
use crate::load::PoolLoad;
use crate::prefix::EventIndex;
use crate::worker::WorkerId;

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;
type ShutdownFactory = Arc<dyn Fn() -> Shutdown + Send + Sync>;

/// One worker's streams, one per rank, and what stops their subscribers.
struct WorkerFeed {
    sockets: KvEventEndpoints,
    streams: Vec<Arc<Stream>>,
    /// Waiting for [`EventFeeds::start`].
    pending: Vec<Subscriber>,
    running: Vec<tokio::task::AbortHandle>,
}

impl Drop for WorkerFeed {
    fn drop(&mut self) {
        for task in &self.running {
            task.abort();
        }
    }
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
    pools: Vec<PoolFeed>,
    /// Set by [`EventFeeds::start`]: how a subscriber started later learns of the shutdown.
    started: Mutex<Option<ShutdownFactory>>,
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
            let feed = PoolFeed {
                pool: match &pool.model {
                    ModelMatch::Exact(name) => name.clone(),
                    ModelMatch::Any => "*".to_owned(),
                },
                index,
                topic: pool.index.topic.clone(),
                grace: pool.index.stream_grace,
                workers: Mutex::new(BTreeMap::new()),
                load: Arc::new(OnceLock::new()),
            };
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
    /// when its `shutdown()` completes or its worker leaves. The tasks started now are returned so the
    /// caller can wait for them.
    pub fn start<F>(
        &self,
        shutdown: impl Fn() -> F + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let factory: ShutdownFactory = Arc::new(move || Box::pin(shutdown()) as Shutdown);
        *self.started.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&factory));
        let mut handles = Vec::new();
        for pool in &self.pools {
            let mut workers = pool.workers.lock().unwrap_or_else(PoisonError::into_inner);
            for worker in workers.values_mut() {
                for subscriber in std::mem::take(&mut worker.pending) {
                    let handle = tokio::spawn(subscriber.run(factory()));
                    worker.running.push(handle.abort_handle());
                    handles.push(handle);
                }
            }
        }
        handles
    }

    fn started(&self) -> Option<ShutdownFactory> {
        self.started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `worker` takes slot `id` of pool `pool`: subscribes to its ranks (at once if the feeds run). A
    /// worker already subscribed at the same sockets keeps its streams.
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

    pub fn pools(&self) -> &[PoolFeed] {
        &self.pools
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
    fn join(&self, id: WorkerId, worker: &WorkerConfig, started: Option<ShutdownFactory>) {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        if workers
            .get(&id)
            .is_some_and(|feed| feed.sockets == worker.kv_events)
        {
            return;
        }
        let mut feed = WorkerFeed {
            sockets: worker.kv_events,
            streams: Vec::new(),
            pending: Vec::new(),
            running: Vec::new(),
        };
        for rank in 0..worker.dp_size.get() {
            let Some(slot) = self.index.slot(id, rank) else {
                continue;
            };
            let sockets = worker.kv_events.for_rank(rank);
            let stream = Arc::new(Stream::new(id, rank, sockets.live, sockets.replay));
            let applier = Applier::new(
                Arc::clone(&self.index),
                slot,
                self.pool.clone(),
                Arc::clone(&stream),
            )
            .reporting_to(Arc::clone(&self.load), id);
            let subscriber = Subscriber::new(applier, self.topic.clone(), self.grace);
            match &started {
                Some(shutdown) => {
                    let handle = tokio::spawn(subscriber.run(shutdown()));
                    feed.running.push(handle.abort_handle());
                }
                None => feed.pending.push(subscriber),
            }
            feed.streams.push(stream);
        }
        // Replacing a feed drops the old one, which stops its subscribers.
        workers.insert(id, feed);
    }

    /// The pool's streams, by worker slot and rank.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .flat_map(|feed| feed.streams.iter().cloned())
            .collect()
    }

    fn views(&self, now: Instant) -> Vec<StreamView> {
        self.streams()
            .iter()
            .map(|stream| stream.view(now))
            .collect()
    }
}

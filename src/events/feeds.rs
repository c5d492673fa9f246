//! Every KV event stream of every `events` pool: one subscriber per worker rank, each feeding its
//! rank's slot of the pool's [`EventIndex`].

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::apply::Applier;
use super::stream::{Stream, StreamView};
use super::subscriber::Subscriber;
use crate::config::{IndexMode, ModelMatch, PoolConfig};
use crate::prefix::EventIndex;
use crate::worker::WorkerId;

/// One pool's streams.
pub struct PoolFeed {
    pub pool: String,
    pub streams: Vec<Arc<Stream>>,
}

/// The streams of every `events` pool, and their subscribers until they are started.
pub struct EventFeeds {
    pools: Vec<PoolFeed>,
    /// Taken by [`EventFeeds::start`].
    subscribers: Mutex<Vec<Subscriber>>,
}

impl EventFeeds {
    /// A subscriber for every rank of every worker of each `events` pool, feeding that pool's index.
    pub fn new<'c>(
        pools_and_indexes: impl IntoIterator<Item = (&'c PoolConfig, Arc<EventIndex>)>,
    ) -> EventFeeds {
        let mut pools = Vec::new();
        let mut subscribers = Vec::new();
        for (pool, index) in pools_and_indexes {
            if pool.index.mode != IndexMode::Events {
                continue;
            }
            let model = match &pool.model {
                ModelMatch::Exact(name) => name.clone(),
                ModelMatch::Any => "*".to_owned(),
            };
            let mut streams = Vec::new();
            for (id, worker) in pool.workers.iter().enumerate() {
                let worker_id = WorkerId(id as u32);
                for rank in 0..worker.dp_size.get() {
                    let Some(slot) = index.slot(worker_id, rank) else {
                        continue;
                    };
                    let sockets = worker.kv_events.for_rank(rank);
                    let stream =
                        Arc::new(Stream::new(worker_id, rank, sockets.live, sockets.replay));
                    let applier =
                        Applier::new(Arc::clone(&index), slot, model.clone(), Arc::clone(&stream));
                    subscribers.push(Subscriber::new(
                        applier,
                        pool.index.topic.clone(),
                        pool.index.stream_grace,
                    ));
                    streams.push(stream);
                }
            }
            pools.push(PoolFeed {
                pool: model,
                streams,
            });
        }
        EventFeeds {
            pools,
            subscribers: Mutex::new(subscribers),
        }
    }

    /// Starts every subscriber on the current runtime, once; each stops when its `shutdown()`
    /// completes. The tasks are returned so the caller can wait for them.
    pub fn start<F>(&self, shutdown: impl Fn() -> F) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let subscribers = match self.subscribers.lock() {
            Ok(mut subscribers) => std::mem::take(&mut *subscribers),
            Err(_) => Vec::new(),
        };
        subscribers
            .into_iter()
            .map(|subscriber| tokio::spawn(subscriber.run(shutdown())))
            .collect()
    }

    pub fn pools(&self) -> &[PoolFeed] {
        &self.pools
    }

    /// Every stream's counters now, by pool.
    pub fn views(&self, now: Instant) -> Vec<(String, Vec<StreamView>)> {
        self.pools
            .iter()
            .map(|feed| {
                (
                    feed.pool.clone(),
                    feed.streams.iter().map(|stream| stream.view(now)).collect(),
                )
            })
            .collect()
    }
}

//! A worker's life: binding its ports (the HTTP listener, each rank's KV event sockets), launching an
//! incarnation (its ranks, their engine loops and event publishers, the accept loop), and killing and
//! restarting it as an engine process dies and comes back.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::{
    Incarnation, KvEventsSpec, Life, Shared, StartError, WorkerSpec, accept_loop, engine, lock,
};
use crate::config::Timing;
use crate::kv_events::publisher::{self, RankListeners, RankStream};
use crate::kv_events::{KvEventEndpoints, RankEventEndpoints};
use crate::net::bind_reusable;

/// The accept queue of a worker's HTTP listener: uvicorn's default `backlog`, which vLLM's and
/// SGLang's API servers run with. Tokio's own `bind` asks for 128, which a burst of Envoy's new
/// upstream connections overflows on a loaded machine while the accept loop waits for a core: the
/// kernel then drops the SYNs and Envoy counts connect timeouts a real engine would not cause.
const HTTP_BACKLOG: u32 = 2048;

/// Binds a worker's HTTP listener (see [`bind_reusable`]).
pub(super) fn bind_http(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    bind_reusable(addr, HTTP_BACKLOG)
}

/// Binds a worker's KV event ports: per rank a PUB listener and, with replay, a ROUTER listener, each
/// kind on consecutive ports from rank 0's.
pub(super) fn bind_kv_events(
    spec: &WorkerSpec,
    events: &KvEventsSpec,
) -> Result<(KvEventEndpoints, Vec<RankListeners>), StartError> {
    let host = spec.addr.ip();
    let error = |what: &str| {
        let what = what.to_owned();
        move |source| StartError::KvEvents { what, source }
    };
    let live =
        publisher::bind_ports(host, events.live_port, spec.dp_size).map_err(error("live"))?;
    let replay = if events.config.replay {
        publisher::bind_ports(host, events.replay_port, spec.dp_size)
            .map_err(error("replay"))?
            .into_iter()
            .map(Some)
            .collect()
    } else {
        std::iter::repeat_with(|| None)
            .take(live.len())
            .collect::<Vec<_>>()
    };
    let mut ranks = Vec::new();
    let mut listeners = Vec::new();
    for ((rank, live), replay) in (0u32..).zip(live).zip(replay) {
        ranks.push(RankEventEndpoints {
            rank,
            live: live.local_addr().map_err(error("live"))?,
            replay: replay
                .as_ref()
                .map(std::net::TcpListener::local_addr)
                .transpose()
                .map_err(error("replay"))?,
        });
        listeners.push(RankListeners { live, replay });
    }
    let endpoints = KvEventEndpoints {
        format: events.config.format,
        topic: events.config.topic.clone(),
        ranks,
    };
    Ok((endpoints, listeners))
}

/// Binds the KV event ports of `endpoints` again, after a restart.
async fn rebind_kv_events(endpoints: &KvEventEndpoints) -> Result<Vec<RankListeners>, StartError> {
    let mut listeners = Vec::new();
    for rank in &endpoints.ranks {
        let live = publisher::rebind(rank.live)
            .await
            .map_err(|source| StartError::KvEvents {
                what: format!("live {}", rank.live),
                source,
            })?;
        let replay = match rank.replay {
            Some(addr) => {
                Some(
                    publisher::rebind(addr)
                        .await
                        .map_err(|source| StartError::KvEvents {
                            what: format!("replay {addr}"),
                            source,
                        })?,
                )
            }
            None => None,
        };
        listeners.push(RankListeners { live, replay });
    }
    Ok(listeners)
}

pub(super) fn launch(
    shared: &Arc<Shared>,
    listener: TcpListener,
    kv_listeners: Vec<RankListeners>,
) {
    let mut streams = Vec::new();
    let mut publishers = Vec::new();
    if let Some(spec) = &shared.kv_publisher {
        for (rank, listeners) in (0u32..).zip(kv_listeners) {
            let (stream, batches) = RankStream::new();
            streams.push(stream);
            publishers.push(tokio::spawn(publisher::run(
                Arc::clone(spec),
                rank,
                listeners,
                batches,
            )));
        }
    }
    let incarnation = Arc::new(Incarnation::new(
        &shared.spec,
        &shared.params.load(),
        streams,
        start_time(shared),
    ));
    let (stop, stopped) = oneshot::channel();
    let server = tokio::spawn(accept_loop(
        listener,
        Arc::clone(shared),
        Arc::clone(&incarnation),
        stopped,
    ));
    let loops = match shared.spec.timing {
        Timing::Step => (0..incarnation.ranks.len())
            .map(|rank| {
                tokio::spawn(engine::run(
                    Arc::clone(shared),
                    Arc::clone(&incarnation),
                    rank,
                ))
            })
            .collect(),
        Timing::Slots => Vec::new(),
    };
    let previous = std::mem::replace(
        &mut *lock(&shared.life),
        Life::Up {
            incarnation,
            server,
            stop,
            publishers,
            loops,
        },
    );
    if let Life::Up {
        server,
        publishers,
        loops,
        ..
    } = previous
    {
        server.abort();
        for task in publishers.into_iter().chain(loops) {
            task.abort();
        }
    }
}

/// Now, in seconds since the Unix epoch with sub-second precision (a restart within the same second
/// still shows), and always after the previous run's start.
fn start_time(shared: &Shared) -> f64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64());
    let mut last = lock(&shared.last_start);
    // A microsecond is far above an f64's resolution at today's epoch (about 0.24 µs).
    let started = now.max(*last + 1e-6);
    *last = started;
    started
}

pub(super) async fn kill(shared: &Shared) {
    let previous = std::mem::replace(&mut *lock(&shared.life), Life::Down);
    if let Life::Up {
        server,
        stop,
        publishers,
        loops,
        ..
    } = previous
    {
        // A dead engine computes nothing more.
        for task in &loops {
            task.abort();
        }
        // The loop returns after every connection task is gone and drops the listener on the way
        // out: once it is joined, the port is closed and no stream survives.
        let _ = stop.send(());
        let _ = server.await;
        // A dead engine's event sockets close with it, and its ring is gone.
        for publisher in publishers {
            publisher.abort();
            let _ = publisher.await;
        }
    }
}

pub(super) async fn restart(shared: &Arc<Shared>) -> Result<(), StartError> {
    kill(shared).await;
    let addr = shared.spec.addr;
    // The aborted accept loop releases the port when its task is dropped, which happens on the
    // runtime shortly after `abort`; retry briefly rather than fail on that race.
    let mut attempts = 0;
    let listener = loop {
        match bind_http(addr) {
            Ok(listener) => break listener,
            Err(source) if attempts >= 50 => return Err(StartError::Bind { addr, source }),
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let kv_listeners = match &shared.kv_events {
        Some(endpoints) => rebind_kv_events(endpoints).await?,
        None => Vec::new(),
    };
    launch(shared, listener, kv_listeners);
    Ok(())
}

//! A pool's `index:` section and a worker's `kv_events:` sockets.
//!
//! In `events` mode the picker subscribes to every worker's KV event stream. By default a worker
//! publishes on its own IP at the pool's `index.port` (vLLM's and SGLang's documented 5557) and
//! replays on `index.replay_port` when one is given; a worker's `kv_events:` names both sockets
//! explicitly, for engines on other addresses (or, on loopback, a fleet sharing one IP). Rank `r` of a
//! data-parallel worker is at each port plus `r`, as the engines bind them, so every rank's port must
//! exist. The sockets are resolved in every mode, so switching a pool to `events` changes one key.

use std::net::SocketAddr;
use std::time::Duration;

use super::Validator;
use crate::config::{
    DepthRatio, IndexConfig, IndexMode, IndexSockets, KvEventEndpoints, KvEventsFrom,
};
use cachepick_decode::{Decode, Map, Node, Phase, Place, Res, Val, with_default};

const INDEX_KEYS: &[&str] = &[
    "mode",
    "speculative_ttl",
    "stream_grace",
    "topic",
    "port",
    "replay_port",
    "commit_share",
    "sockets",
];
const KV_EVENTS_KEYS: &[&str] = &["endpoint", "replay_endpoint"];
const TCP_ENDPOINT: &str =
    "a ZeroMQ TCP endpoint with an IP and a port, such as tcp://10.0.0.11:5557";

/// The pool's `index:`, with the default ports its workers' sockets are resolved against.
pub(super) struct IndexDraft {
    pub(super) config: IndexConfig,
    pub(super) port: Val<u16>,
    pub(super) replay_port: Option<Val<u16>>,
}

/// A worker's own `kv_events:`, as given.
#[derive(Default)]
pub(super) struct WorkerKvEvents {
    pub(super) live: Option<Val<SocketAddr>>,
    pub(super) replay: Option<Val<SocketAddr>>,
}

impl Validator<'_> {
    pub(super) fn index(&mut self, pool: &Map) -> Res<IndexDraft> {
        let map = self.section(pool, "index", INDEX_KEYS)?;
        let defaults = IndexConfig::default();
        let mode = self.opt(&map, "mode", |v, node, at| {
            v.keyword(
                node,
                at,
                &[IndexMode::Approximate, IndexMode::Events],
                IndexMode::as_str,
            )
        });
        let ttl = self.opt(&map, "speculative_ttl", Self::duration);
        let ttl = self.check(with_default(ttl, defaults.speculative_ttl), |ttl| {
            if ttl > Duration::from_secs(60) {
                Err(
                    "must be at most 60s: a guess that outlives the engine's own events hides them"
                        .to_owned(),
                )
            } else {
                Ok(ttl)
            }
        });
        let grace = self.positive_duration(&map, "stream_grace", defaults.stream_grace);
        // The empty topic, the default, subscribes to every message: what vLLM publishes without one.
        let topic = self.opt(&map, "topic", |v, node, at| {
            v.text(node, at, "a string").map(str::to_owned)
        });
        let port = self.opt(&map, "port", Self::port);
        let port = with_default(port, IndexConfig::DEFAULT_LIVE_PORT);
        let replay_port = self.opt(&map, "replay_port", Self::port);
        let sockets = self.opt(&map, "sockets", |v, node, at| {
            v.keyword(node, at, &IndexSockets::ALL, IndexSockets::as_str)
        });
        let share = self.opt(&map, "commit_share", Self::number);
        let share = self.check(with_default(share, defaults.commit_share.get()), |share| {
            DepthRatio::new(share)
                .filter(|share| share.get() > 0.0)
                .ok_or_else(|| format!("must be above 0 and at most 1, got {share}"))
        });
        Ok(IndexDraft {
            config: IndexConfig {
                mode: with_default(mode, IndexMode::default())?.value,
                speculative_ttl: ttl?.value,
                topic: topic?.map(|topic| topic.value).unwrap_or_default(),
                stream_grace: grace?.value,
                sockets: with_default(sockets, IndexSockets::default())?.value,
                commit_share: share?.value,
            },
            port: port?,
            replay_port: replay_port?,
        })
    }

    /// A worker's `kv_events:`; absent is the pool's ports on the worker's IP.
    pub(super) fn worker_kv_events(&mut self, worker: &Map) -> Res<WorkerKvEvents> {
        if worker.get("kv_events").is_none() {
            return Ok(WorkerKvEvents::default());
        }
        let map = self.section(worker, "kv_events", KV_EVENTS_KEYS)?;
        let live = self.opt(&map, "endpoint", Self::tcp_endpoint);
        let replay = self.opt(&map, "replay_endpoint", Self::tcp_endpoint);
        Ok(WorkerKvEvents {
            live: live?,
            replay: replay?,
        })
    }

    /// The worker's resolved sockets and who named them; every rank's port must exist.
    pub(super) fn resolve_kv_events(
        &mut self,
        index: &IndexDraft,
        own: WorkerKvEvents,
        endpoint: SocketAddr,
        dp_size: u32,
    ) -> Res<(KvEventEndpoints, KvEventsFrom)> {
        let from = if own.live.is_some() || own.replay.is_some() {
            KvEventsFrom::Worker
        } else {
            index.config.kv_events_from()
        };
        let live = own.live.unwrap_or_else(|| Val {
            value: SocketAddr::new(endpoint.ip(), index.port.value),
            at: index.port.at.clone(),
        });
        let replay = own.replay.or_else(|| {
            index.replay_port.as_ref().map(|port| Val {
                value: SocketAddr::new(endpoint.ip(), port.value),
                at: port.at.clone(),
            })
        });
        let last_rank = dp_size.saturating_sub(1);
        let mut fits = Ok(());
        for socket in std::iter::once(&live).chain(replay.as_ref()) {
            if u32::from(socket.value.port()) + last_rank > u32::from(u16::MAX) {
                let message = format!(
                    "{}: with dp_size {dp_size} rank {last_rank} would publish on port {}, beyond 65535",
                    socket.value,
                    u32::from(socket.value.port()) + last_rank
                );
                fits = Err(self.report(Phase::Cross, socket.at.clone(), message));
            }
        }
        fits?;
        let sockets = KvEventEndpoints {
            live: live.value,
            replay: replay.map(|replay| replay.value),
        };
        Ok((sockets, from))
    }

    pub(super) fn port(&mut self, node: &Node, at: &Place) -> Res<u16> {
        let port = self.integer(node, at)?;
        match u16::try_from(port) {
            Ok(port) if port > 0 => Ok(port),
            _ => Err(self.type_error(node, at, "a port from 1 to 65535")),
        }
    }

    fn tcp_endpoint(&mut self, node: &Node, at: &Place) -> Res<SocketAddr> {
        let text = self.string(node, at)?;
        let parsed = text
            .strip_prefix("tcp://")
            .and_then(|rest| rest.parse::<SocketAddr>().ok())
            .filter(|addr| addr.port() != 0 && !addr.ip().is_unspecified());
        match parsed {
            Some(addr) => Ok(addr),
            None => Err(self.type_error(node, at, TCP_ENDPOINT)),
        }
    }
}

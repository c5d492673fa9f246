//! One rank's publisher: a task that owns the rank's PUB socket, its ROUTER replay socket and its replay
//! ring. The request path hands it batches through a bounded channel and never waits for it.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{
    PubSocket, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketRecv, SocketSend,
    ZmqMessage,
};

use super::{END_SEQ, encode_batch};
use crate::cache::CacheEvent;
use crate::config::{KvEventsConfig, KvEventsFormat};
use crate::net::bind_reusable;

/// Batches a rank may have waiting for its publisher; beyond it a batch is dropped (and counted).
const QUEUE_BATCHES: usize = 4096;

/// One rank's model events of one step, numbered, on their way to the publisher.
#[derive(Debug)]
pub(crate) struct Outgoing {
    seq: u64,
    ts: f64,
    events: Vec<CacheEvent>,
    /// Sent on the live socket; false for a batch dropped on purpose.
    live: bool,
    /// Kept in the replay ring; false for a batch dropped on purpose and unreplayably.
    ring: bool,
}

/// The request path's end of a rank's stream: numbering, the faults asked for, the counts. Lives in the
/// rank (under its lock), so the numbering follows the model's order.
#[derive(Debug)]
pub(crate) struct RankStream {
    sender: mpsc::Sender<Outgoing>,
    next_seq: u64,
    drop_next: u64,
    unreplayable: bool,
    /// Batches handed to the publisher.
    queued: u64,
    /// Batches kept off the live socket by `drop_next`.
    dropped_live: u64,
    /// Batches lost because the publisher's queue was full (or it is gone): a gap no replay heals.
    overflowed: u64,
}

/// What `/admin/state` reports of a rank's stream.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct StreamState {
    pub next_seq: u64,
    pub queued: u64,
    pub dropped_live: u64,
    pub overflowed: u64,
    pub drop_next: u64,
    pub unreplayable: bool,
}

impl RankStream {
    /// A stream numbered from 0 and the receiver its publisher drains.
    pub(crate) fn new() -> (RankStream, mpsc::Receiver<Outgoing>) {
        let (sender, receiver) = mpsc::channel(QUEUE_BATCHES);
        let stream = RankStream {
            sender,
            next_seq: 0,
            drop_next: 0,
            unreplayable: false,
            queued: 0,
            dropped_live: 0,
            overflowed: 0,
        };
        (stream, receiver)
    }

    /// Numbers one step's events and hands them over without waiting.
    pub(crate) fn push(&mut self, events: Vec<CacheEvent>) {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        let (live, ring) = if self.drop_next > 0 {
            self.drop_next -= 1;
            self.dropped_live = self.dropped_live.saturating_add(1);
            (false, !self.unreplayable)
        } else {
            (true, true)
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |since| since.as_secs_f64());
        let outgoing = Outgoing {
            seq,
            ts,
            events,
            live,
            ring,
        };
        match self.sender.try_send(outgoing) {
            Ok(()) => self.queued = self.queued.saturating_add(1),
            Err(_) => self.overflowed = self.overflowed.saturating_add(1),
        }
    }

    /// The next `count` batches skip the live socket; with `unreplayable`, the ring too.
    pub(crate) fn drop_next(&mut self, count: u64, unreplayable: bool) {
        self.drop_next = count;
        self.unreplayable = unreplayable;
    }

    pub(crate) fn state(&self) -> StreamState {
        StreamState {
            next_seq: self.next_seq,
            queued: self.queued,
            dropped_live: self.dropped_live,
            overflowed: self.overflowed,
            drop_next: self.drop_next,
            unreplayable: self.unreplayable,
        }
    }
}

/// What every rank's publisher of a worker shares.
#[derive(Debug)]
pub(crate) struct PublisherSpec {
    pub format: KvEventsFormat,
    pub topic: Bytes,
    pub ring_batches: usize,
    pub block_size: u32,
    pub replay_delay: Duration,
}

impl PublisherSpec {
    pub(crate) fn new(config: &KvEventsConfig, block_size: u32) -> PublisherSpec {
        PublisherSpec {
            format: config.format,
            topic: Bytes::from(config.topic.clone().into_bytes()),
            ring_batches: usize::try_from(config.ring_batches.get()).unwrap_or(usize::MAX),
            block_size,
            replay_delay: config.replay_delay,
        }
    }
}

/// One rank's bound listeners, handed to its publisher.
#[derive(Debug)]
pub(crate) struct RankListeners {
    pub live: std::net::TcpListener,
    pub replay: Option<std::net::TcpListener>,
}

/// Binds `count` listeners on consecutive ports from `first` (the engines' `port + rank`).
fn bind_run(host: IpAddr, first: u16, count: u32) -> std::io::Result<Vec<std::net::TcpListener>> {
    let mut listeners = Vec::new();
    for offset in 0..count {
        let port = u16::try_from(u32::from(first).saturating_add(offset)).map_err(|_| {
            std::io::Error::other(format!("port {first} + {offset} is beyond 65535"))
        })?;
        listeners.push(bind(SocketAddr::new(host, port))?);
    }
    Ok(listeners)
}

/// A KV event listener (see [`bind_reusable`]).
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    bind_reusable(addr, 1024)?.into_std()
}

/// `count` consecutive free ports, bound: from `first` when given, else from a free port the system
/// picks, retried until the ports after it are free too.
pub(crate) fn bind_ports(
    host: IpAddr,
    first: Option<u16>,
    count: u32,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    if let Some(first) = first {
        return bind_run(host, first, count);
    }
    let mut last_error = None;
    for _ in 0..64 {
        let head = bind(SocketAddr::new(host, 0))?;
        let port = head.local_addr()?.port();
        if count <= 1 {
            return Ok(vec![head]);
        }
        match port.checked_add(1) {
            Some(next) => match bind_run(host, next, count - 1) {
                Ok(mut rest) => {
                    rest.insert(0, head);
                    return Ok(rest);
                }
                Err(error) => last_error = Some(error),
            },
            None => continue,
        }
    }
    Err(last_error.unwrap_or_else(|| std::io::Error::other("no run of free ports found")))
}

/// Binds `addr` again after a restart, retrying while the previous socket's release is under way.
pub(crate) async fn rebind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let mut attempts = 0;
    loop {
        match bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(error) if attempts >= 50 => return Err(error),
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Runs one rank's publisher until its stream's sender is dropped or the task is aborted (a crash);
/// either way the sockets close and the ring is lost with the task.
pub(crate) async fn run(
    spec: Arc<PublisherSpec>,
    rank: u32,
    listeners: RankListeners,
    mut batches: mpsc::Receiver<Outgoing>,
) {
    let mut live = PubSocket::new();
    if live.bind_listener(listeners.live).await.is_err() {
        return;
    }
    let (mut replies, mut requests) = match listeners.replay {
        Some(listener) => {
            let mut router = RouterSocket::new();
            if router.bind_listener(listener).await.is_err() {
                return;
            }
            let (send, recv) = router.split();
            (Some(send), Some(recv))
        }
        None => (None, None),
    };
    let mut ring: VecDeque<(u64, Bytes)> = VecDeque::new();
    loop {
        tokio::select! {
            batch = batches.recv() => {
                let Some(batch) = batch else { break };
                let payload = Bytes::from(encode_batch(
                    spec.format,
                    batch.ts,
                    rank,
                    spec.block_size,
                    &batch.events,
                ));
                if batch.live {
                    let frames = vec![
                        spec.topic.clone(),
                        Bytes::copy_from_slice(&batch.seq.to_be_bytes()),
                        payload.clone(),
                    ];
                    if let Ok(message) = ZmqMessage::try_from(frames) {
                        // A PUB socket drops what its subscribers cannot take; so do we.
                        let _ = live.send(message).await;
                    }
                }
                if batch.ring {
                    if ring.len() >= spec.ring_batches {
                        ring.pop_front();
                    }
                    ring.push_back((batch.seq, payload));
                }
            }
            request = next_request(&mut requests) => match request {
                Some(request) => {
                    if let Some(replies) = &mut replies {
                        tokio::time::sleep(spec.replay_delay).await;
                        serve_replay(&spec, replies, request, &ring).await;
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

/// The next replay request; never, without a replay socket; `None` on a receive error.
async fn next_request(requests: &mut Option<RouterRecvHalf>) -> Option<ZmqMessage> {
    match requests {
        Some(requests) => requests.recv().await.ok(),
        None => std::future::pending().await,
    }
}

/// Answers `[identity, "", start_seq]` with every ring batch from `start_seq` on and the end marker,
/// framed as the engine does (see the module docs). Other requests are ignored, as the engines do.
async fn serve_replay(
    spec: &PublisherSpec,
    replies: &mut RouterSendHalf,
    request: ZmqMessage,
    ring: &VecDeque<(u64, Bytes)>,
) {
    let frames = request.into_vec();
    let [identity, _delimiter, start] = frames.as_slice() else {
        return;
    };
    let start = start_seq(start);
    let with_topic = spec.format == KvEventsFormat::VllmMap;
    for (seq, payload) in ring.iter().filter(|(seq, _)| *seq >= start) {
        let mut frames = vec![identity.clone(), Bytes::new()];
        if with_topic {
            frames.push(spec.topic.clone());
        }
        frames.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
        frames.push(payload.clone());
        if !send(replies, frames).await {
            return;
        }
    }
    let mut end = vec![identity.clone(), Bytes::new()];
    if with_topic {
        end.push(Bytes::new());
    }
    end.push(Bytes::copy_from_slice(&END_SEQ));
    end.push(Bytes::new());
    send(replies, end).await;
}

async fn send(replies: &mut RouterSendHalf, frames: Vec<Bytes>) -> bool {
    match ZmqMessage::try_from(frames) {
        Ok(message) => replies.send(message).await.is_ok(),
        Err(_) => false,
    }
}

/// A big-endian unsigned integer of any length, as Python's `int.from_bytes(b, "big")` reads it,
/// saturated to `u64`.
fn start_seq(bytes: &[u8]) -> u64 {
    let split = bytes.len().saturating_sub(8);
    let (high, low) = bytes.split_at(split);
    if high.iter().any(|byte| *byte != 0) {
        return u64::MAX;
    }
    low.iter()
        .fold(0u64, |value, byte| (value << 8) | u64::from(*byte))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_seq_reads_like_python_int_from_bytes() {
        assert_eq!(start_seq(&5u64.to_be_bytes()), 5);
        assert_eq!(start_seq(&[1, 0]), 256);
        assert_eq!(start_seq(&[]), 0);
        assert_eq!(start_seq(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 7]), 7);
        assert_eq!(start_seq(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0]), u64::MAX);
    }

    #[test]
    fn dropped_batches_still_take_their_seq() {
        let (mut stream, mut receiver) = RankStream::new();
        stream.drop_next(2, true);
        for _ in 0..3 {
            stream.push(vec![CacheEvent::AllCleared]);
        }
        let got: Vec<(u64, bool, bool)> = std::iter::from_fn(|| receiver.try_recv().ok())
            .map(|batch| (batch.seq, batch.live, batch.ring))
            .collect();
        assert_eq!(got, [(0, false, false), (1, false, false), (2, true, true)]);
        assert_eq!(stream.state().dropped_live, 2);
        assert_eq!(stream.state().next_seq, 3);
    }
}

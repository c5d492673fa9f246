//! One engine rank's KV event stream: subscribe, keep the sequence, heal gaps by replay, reset the
//! rank's entries when the engine restarted or a gap cannot be healed, reconnect with backoff.
//!
//! # Sequence rules
//! Every batch carries the publisher's sequence number, which counts batches from 0 per engine
//! process. With `e` the next expected number and `s` the one received:
//! - `s == e`: applied.
//! - `s > e`: batches `e..s` were lost (PUB/SUB drops at connect and above the high-water mark). With
//!   a replay socket they are asked for; if the replay does not start at `e` (its ring moved on) or
//!   fails, the rank is reset — its entries may describe blocks the lost batches removed. Without a
//!   replay socket the rank is reset at once.
//! - `s < e`: a new engine process (its sequence restarted), so the rank is reset and, with a replay
//!   socket, the new process's earlier batches are fetched. The exception is a batch the last replay
//!   already applied arriving again on the live socket right after it: a duplicate, skipped.
//!
//! On the first connection (and after a reset for staleness) the replay socket, when there is one, is
//! asked for everything from 0, so a picker that starts beside a warm engine learns what it already
//! holds as far as the engine's ring reaches.
//!
//! A reconnection may find a new engine process that has published nothing yet (a restarted engine
//! publishes only once it caches something), so with a replay socket the last applied batch is asked
//! for again and compared byte for byte: the same engine returns the same batch, a new one returns
//! nothing, another batch, or a ring that starts later, and the rank is reset at once instead of at
//! the new engine's first batch. Without a replay socket a restart shows only as a backwards sequence.
//!
//! While the stream is down the rank's entries are kept but make no owner: a reconnect usually finds
//! the same engine, but until it shows that (the replay returns the last batch applied, or the next
//! live batch continues the sequence) they may describe a cache that died with its engine, and a
//! request sent on their credit would pay a cold prefill on a worker that may not even be up. After
//! `stream_grace` without the stream they are forgotten and the stream is `stale`, because whatever
//! happened meanwhile (evictions, a restart) is invisible.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_channel::mpsc;
use futures_util::StreamExt;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::apply::Applier;
use super::decode::{DecodeError, decode_batch};
use super::stream::{ResetReason, StreamState};

/// The sequence number that ends a replay.
const REPLAY_END: i64 = -1;
/// How long a connection attempt, or a whole replay, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Batches one replay may return: vLLM's default ring holds 10,000.
const MAX_REPLAYED: usize = 100_000;
/// How long after a replay a live batch it already applied counts as a duplicate.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);
/// Reconnection starts fast: a restarted engine is back within a second, and until the stream is
/// back its restart cannot be seen.
const BACKOFF_START: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Why a frame or a replay could not be used.
#[derive(Debug, Error)]
pub enum StreamError {
    #[error("cannot connect to {0}: {1}")]
    Connect(SocketAddr, String),
    #[error("the stream broke: {0}")]
    Receive(String),
    #[error("a message of {0} frames; expected [topic, seq, payload] or [seq, payload]")]
    Frames(usize),
    #[error("a sequence number of {0} bytes; expected 8")]
    Sequence(usize),
    #[error("undecodable batch: {0}")]
    Decode(#[from] DecodeError),
    #[error("the replay did not finish within {0:?}")]
    ReplayTimeout(Duration),
    #[error("the replay returned more than {MAX_REPLAYED} batches")]
    ReplayTooLong,
}

/// One rank's subscriber.
pub struct Subscriber {
    applier: Applier,
    topic: String,
    grace: Duration,
    /// The next sequence number expected; `None` before the first batch and after a stale reset.
    expected: Option<u64>,
    /// Live batches from this number on, until the instant, were already applied by a replay.
    duplicates: Option<(u64, Instant)>,
    /// The last applied batch: its sequence number and a hash of its bytes.
    last: Option<(u64, u64)>,
}

impl Subscriber {
    pub fn new(applier: Applier, topic: String, grace: Duration) -> Self {
        Subscriber {
            applier,
            topic,
            grace,
            expected: None,
            duplicates: None,
            last: None,
        }
    }

    /// Runs until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let live = self.applier.stream().live;
        let mut backoff = BACKOFF_START;
        let mut down_since = Instant::now();
        loop {
            let connected = tokio::select! {
                connected = self.connect(live) => connected,
                () = &mut shutdown => return,
            };
            match connected {
                Ok((mut socket, mut events)) => {
                    backoff = BACKOFF_START;
                    self.applier
                        .stream()
                        .set_state(StreamState::Live, Instant::now());
                    tracing::debug!(%live, "kv events: subscribed");
                    self.catch_up().await;
                    let broken = tokio::select! {
                        broken = self.receive(&mut socket, &mut events) => broken,
                        () = &mut shutdown => return,
                    };
                    self.applier.suspend(true);
                    tracing::warn!(%live, error = %broken, "kv events: stream down; reconnecting");
                    down_since = Instant::now();
                    self.applier
                        .stream()
                        .set_state(StreamState::Connecting, down_since);
                }
                Err(error) => tracing::debug!(%live, %error, "kv events: not connected"),
            }
            if down_since.elapsed() >= self.grace
                && self.applier.stream().state() != StreamState::Stale
            {
                tracing::warn!(%live, grace = ?self.grace, "kv events: stream down past its grace; forgetting the worker's blocks");
                self.applier.reset(ResetReason::Stale);
                self.applier
                    .stream()
                    .set_state(StreamState::Stale, Instant::now());
                self.expected = None;
                self.last = None;
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = &mut shutdown => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// A subscribed socket and its monitor, whose `Disconnected` is how a dead engine shows: the
    /// socket itself would silently reconnect to a restarted one.
    async fn connect(
        &self,
        live: SocketAddr,
    ) -> Result<(SubSocket, mpsc::Receiver<SocketEvent>), StreamError> {
        let mut socket = SubSocket::new();
        let events = socket.monitor();
        let endpoint = format!("tcp://{live}");
        match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(&endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(StreamError::Connect(live, error.to_string())),
            Err(_) => return Err(StreamError::Connect(live, "timed out".to_owned())),
        }
        socket
            .subscribe(&self.topic)
            .await
            .map_err(|error| StreamError::Connect(live, error.to_string()))?;
        Ok((socket, events))
    }

    /// After a (re)connection: whether the engine is the one whose batches were applied, and what
    /// it published while nobody listened, from its ring (see the module docs).
    async fn catch_up(&mut self) {
        if self.applier.stream().replay.is_none() {
            // Nothing to check against: a restart shows only at the next batch.
            self.applier.suspend(false);
            return;
        }
        let from = self.last.map_or(0, |(seq, _)| seq);
        let batches = match self.replay(from).await {
            Ok(batches) => batches,
            Err(error) => {
                self.applier
                    .stream()
                    .replay_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, "kv events: catch-up replay failed");
                return;
            }
        };
        let Some((last_seq, fingerprint)) = self.last else {
            self.applier.suspend(false);
            // A first connection: nothing applied yet that could be wrong. The ring holds what the
            // engine published so far, so the next live batch is the one after it (0 if none): a
            // loss right after subscribing is then a gap like any other.
            let first = batches.is_empty();
            self.apply_replayed(from, batches);
            if first {
                self.expected = Some(0);
            }
            return;
        };
        let same_engine = batches
            .first()
            .is_some_and(|(seq, payload)| *seq == last_seq && xxh3_64(payload) == fingerprint);
        if same_engine {
            self.applier.suspend(false);
            let newer = batches.into_iter().skip(1).collect();
            self.apply_replayed(last_seq.saturating_add(1), newer);
            return;
        }
        let later_ring = batches.first().is_some_and(|(seq, _)| *seq > last_seq);
        tracing::info!(live = %self.applier.stream().live, "kv events: not the engine whose batches were applied; forgetting its blocks");
        self.applier.reset(if later_ring {
            ResetReason::Gap
        } else {
            ResetReason::Restart
        });
        self.applier.suspend(false);
        self.expected = None;
        self.last = None;
        // What the new process published so far, from its first batch.
        if !later_ring && batches.first().is_some_and(|(seq, _)| *seq > 0) {
            match self.replay(0).await {
                Ok(batches) => self.apply_replayed(0, batches),
                Err(_) => {
                    self.applier
                        .stream()
                        .replay_failures
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        } else if !later_ring {
            self.apply_replayed(0, batches);
        }
    }

    /// Receives until the socket breaks.
    async fn receive(
        &mut self,
        socket: &mut SubSocket,
        events: &mut mpsc::Receiver<SocketEvent>,
    ) -> StreamError {
        loop {
            let message = tokio::select! {
                received = socket.recv() => match received {
                    Ok(message) => message,
                    Err(error) => return StreamError::Receive(error.to_string()),
                },
                event = events.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        return StreamError::Receive("the publisher disconnected".to_owned());
                    }
                    Some(_) => continue,
                },
            };
            match live_frames(&message) {
                Ok((seq, payload)) => self.on_batch(seq, payload).await,
                Err(error) => {
                    self.applier
                        .stream()
                        .decode_errors
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%error, "kv events: unusable message");
                }
            }
        }
    }

    /// One live batch, by the sequence rules in the module docs.
    async fn on_batch(&mut self, seq: u64, payload: &[u8]) {
        let stream = self.applier.stream().clone();
        // A catch-up that could not replay leaves the rank suspended; the sequence settles it: a
        // continuation is the same engine, anything else is handled below as a gap or a restart.
        self.applier.suspend(false);
        match self.expected {
            Some(expected) if seq > expected => {
                stream.gaps.fetch_add(1, Ordering::Relaxed);
                self.heal(expected, seq).await;
            }
            Some(expected) if seq < expected => {
                let duplicate = self
                    .duplicates
                    .is_some_and(|(from, until)| seq >= from && Instant::now() < until);
                if duplicate {
                    stream.duplicates.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                tracing::info!(live = %stream.live, seq, expected, "kv events: the engine restarted");
                self.applier.reset(ResetReason::Restart);
                self.duplicates = None;
                self.last = None;
                if seq > 0 && stream.replay.is_some() {
                    self.expected = Some(0);
                    self.heal(0, seq).await;
                }
            }
            _ => {}
        }
        self.apply_payload(seq, payload);
    }

    /// Fills `from..until` from the replay socket, or resets the rank when that cannot be done.
    async fn heal(&mut self, from: u64, until: u64) {
        if self.applier.stream().replay.is_none() {
            self.count_gap_reset();
            return;
        }
        match self.replay(from).await {
            Ok(batches) if batches.first().is_some_and(|(seq, _)| *seq == from) => {
                let wanted = batches
                    .into_iter()
                    .filter(|(seq, _)| *seq < until)
                    .collect();
                self.apply_replayed(from, wanted);
            }
            Ok(_) => self.count_gap_reset(),
            Err(error) => {
                self.applier
                    .stream()
                    .replay_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, "kv events: replay failed");
                self.count_gap_reset();
            }
        }
    }

    fn count_gap_reset(&mut self) {
        self.applier.reset(ResetReason::Gap);
    }

    fn apply_replayed(&mut self, from: u64, batches: Vec<(u64, Bytes)>) {
        let stream = self.applier.stream().clone();
        stream.replays.fetch_add(1, Ordering::Relaxed);
        for (seq, payload) in batches {
            self.apply_payload(seq, &payload);
        }
        self.duplicates = Some((from, Instant::now() + DUPLICATE_WINDOW));
    }

    fn apply_payload(&mut self, seq: u64, payload: &[u8]) {
        self.last = Some((seq, xxh3_64(payload)));
        let stream = self.applier.stream();
        match decode_batch(payload) {
            Ok(batch) => self.applier.apply(&batch),
            // Its blocks stay unknown; their children will be orphans, which is counted too.
            Err(error) => {
                stream.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, seq, "kv events: undecodable batch");
            }
        }
        stream.set_last_seq(seq);
        self.expected = Some(seq.saturating_add(1));
    }

    /// Every batch the engine's ring holds from `from` on, in order, undecoded.
    async fn replay(&self, from: u64) -> Result<Vec<(u64, Bytes)>, StreamError> {
        let Some(replay) = self.applier.stream().replay else {
            return Ok(Vec::new());
        };
        let work = async {
            let mut socket = DealerSocket::new();
            socket
                .connect(&format!("tcp://{replay}"))
                .await
                .map_err(|error| StreamError::Connect(replay, error.to_string()))?;
            let request: Vec<bytes::Bytes> = vec![
                bytes::Bytes::new(),
                bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
            ];
            let request = ZmqMessage::try_from(request).map_err(|_| StreamError::Frames(0))?;
            socket
                .send(request)
                .await
                .map_err(|error| StreamError::Receive(error.to_string()))?;
            let mut batches = Vec::new();
            loop {
                let message = socket
                    .recv()
                    .await
                    .map_err(|error| StreamError::Receive(error.to_string()))?;
                let (seq, payload) = replay_frames(&message)?;
                if seq == REPLAY_END {
                    return Ok(batches);
                }
                if batches.len() >= MAX_REPLAYED {
                    return Err(StreamError::ReplayTooLong);
                }
                // A negative number other than the end is nonsense; skip it.
                if let Ok(seq) = u64::try_from(seq) {
                    batches.push((seq, Bytes::copy_from_slice(payload)));
                }
            }
        };
        match tokio::time::timeout(REPLAY_TIMEOUT, work).await {
            Ok(result) => result,
            Err(_) => Err(StreamError::ReplayTimeout(REPLAY_TIMEOUT)),
        }
    }
}

/// A live message's sequence number and payload: `[topic, seq, payload]`.
pub fn live_frames(message: &ZmqMessage) -> Result<(u64, &[u8]), StreamError> {
    let (seq, payload) = match (
        message.len(),
        message.get(0),
        message.get(1),
        message.get(2),
    ) {
        (3, Some(_topic), Some(seq), Some(payload)) => (seq, payload),
        (2, Some(seq), Some(payload), None) => (seq, payload),
        (frames, ..) => return Err(StreamError::Frames(frames)),
    };
    let seq = sequence(seq)?;
    Ok((seq as u64, payload))
}

/// A replay reply's sequence number (-1 at the end) and payload: `[topic, seq, payload]` (vLLM ≥
/// 0.26) or `[seq, payload]` (older vLLM, SGLang), after any empty delimiter frames.
pub fn replay_frames(message: &ZmqMessage) -> Result<(i64, &[u8]), StreamError> {
    let frames: Vec<&bytes::Bytes> = message
        .iter()
        .skip_while(|frame| frame.is_empty())
        .collect();
    let (seq, payload) = match frames.as_slice() {
        [_topic, seq, payload] => (*seq, *payload),
        [seq, payload] => (*seq, *payload),
        other => return Err(StreamError::Frames(other.len())),
    };
    Ok((sequence(seq)?, payload))
}

fn sequence(frame: &[u8]) -> Result<i64, StreamError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| StreamError::Sequence(frame.len()))?;
    Ok(i64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(frames: &[&[u8]]) -> ZmqMessage {
        let frames: Vec<Bytes> = frames.iter().map(|f| Bytes::copy_from_slice(f)).collect();
        ZmqMessage::try_from(frames).unwrap()
    }

    #[test]
    fn live_messages_are_topic_seq_payload() {
        let seq = 7_u64.to_be_bytes();
        assert_eq!(
            live_frames(&message(&[b"kv@a", &seq, b"payload"])).unwrap(),
            (7, &b"payload"[..])
        );
        assert!(matches!(
            live_frames(&message(&[b"kv@a", b"1234", b"payload"])),
            Err(StreamError::Sequence(4))
        ));
        assert!(matches!(
            live_frames(&message(&[b"a", b"b", b"c", b"d"])),
            Err(StreamError::Frames(4))
        ));
    }

    #[test]
    fn replies_of_both_framings_and_the_end_marker_are_read() {
        let seq = 3_u64.to_be_bytes();
        let end = (-1_i64).to_be_bytes();
        // vLLM ≥ 0.26: the DEALER sees the empty delimiter, then topic, seq, payload.
        assert_eq!(
            replay_frames(&message(&[b"", b"kv@a", &seq, b"p"])).unwrap(),
            (3, &b"p"[..])
        );
        // Older vLLM and SGLang: no topic.
        assert_eq!(
            replay_frames(&message(&[b"", &seq, b"p"])).unwrap(),
            (3, &b"p"[..])
        );
        assert_eq!(
            replay_frames(&message(&[b"", &end, b""])).unwrap(),
            (-1, &b""[..])
        );
        // An empty topic is skipped with the delimiter; the end marker with an empty topic too.
        assert_eq!(
            replay_frames(&message(&[b"", b"", &end, b""])).unwrap(),
            (-1, &b""[..])
        );
    }
}

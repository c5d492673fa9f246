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
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use super::apply::Applier;
use super::decode::{DecodeError, MAX_PAYLOAD_BYTES, decode_batch};
use super::stream::{ResetReason, StreamState};
use super::zmtp::{Connection, SocketType, ZmtpError};

/// The sequence number that ends a replay.
const REPLAY_END: i64 = -1;
/// How long a connection attempt, or a whole replay, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Batches one replay may return: vLLM's default ring holds 10,000.
const MAX_REPLAYED: usize = 100_000;
/// The most bytes one message may hold: a payload at the decoder's limit plus its topic and sequence
/// frames. A frame over it is refused from its header, before its body is read (see `zmtp`).
pub const MAX_MESSAGE_BYTES: usize = MAX_PAYLOAD_BYTES + (64 << 10);
/// The most payload bytes one replay may return. A replay is applied batch by batch as it arrives,
/// so this bounds its time and traffic, not its memory (one message at a time): 10,000 batches of
/// 25 KiB, several times what vLLM's default ring holds of ordinary traffic.
pub const MAX_REPLAY_BYTES: usize = 256 << 20;
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
    #[error("refused the stream's message: {0}")]
    Oversized(ZmtpError),
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
    #[error("the replay returned more than {MAX_REPLAY_BYTES} bytes")]
    ReplayTooLarge,
}

impl StreamError {
    fn received(error: ZmtpError) -> StreamError {
        if error.is_oversized() {
            StreamError::Oversized(error)
        } else {
            StreamError::Receive(error.to_string())
        }
    }

    /// The peer sent more than the limits allow.
    fn is_oversized(&self) -> bool {
        matches!(
            self,
            StreamError::Oversized(_) | StreamError::ReplayTooLong | StreamError::ReplayTooLarge
        )
    }
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
                Ok(mut connection) => {
                    backoff = BACKOFF_START;
                    self.applier
                        .stream()
                        .set_state(StreamState::Live, Instant::now());
                    tracing::debug!(%live, "kv events: subscribed");
                    self.catch_up().await;
                    self.applier.stream().settle();
                    let broken = tokio::select! {
                        broken = self.receive(&mut connection) => broken,
                        () = &mut shutdown => return,
                    };
                    self.applier.suspend(true);
                    tracing::warn!(%live, error = %broken, "kv events: stream down; reconnecting");
                    down_since = Instant::now();
                    self.applier
                        .stream()
                        .set_state(StreamState::Connecting, down_since);
                }
                Err(error) => {
                    // Nothing to replay from: readiness need not wait for this stream.
                    self.applier.stream().settle();
                    tracing::debug!(%live, %error, "kv events: not connected");
                }
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

    /// A subscribed connection. It never reconnects by itself: when the engine goes away a read
    /// fails, and a new connection is a new catch-up.
    async fn connect(&self, live: SocketAddr) -> Result<Connection, StreamError> {
        let work = async {
            let mut connection =
                Connection::connect(live, SocketType::Sub, MAX_MESSAGE_BYTES).await?;
            connection.subscribe(self.topic.as_bytes()).await?;
            Ok::<_, ZmtpError>(connection)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, work).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(error)) => Err(StreamError::Connect(live, error.to_string())),
            Err(_) => Err(StreamError::Connect(live, "timed out".to_owned())),
        }
    }

    /// After a (re)connection: whether the engine is the one whose batches were applied, and what
    /// it published while nobody listened, from its ring (see the module docs).
    async fn catch_up(&mut self) {
        if self.applier.stream().replay.is_none() {
            // Nothing to check against: a restart shows only at the next batch.
            self.applier.suspend(false);
            return;
        }
        if let Err(error) = self.try_catch_up().await {
            self.count_replay_failure(&error);
            tracing::debug!(%error, "kv events: catch-up replay failed");
        }
    }

    async fn try_catch_up(&mut self) -> Result<(), StreamError> {
        let from = self.last.map_or(0, |(seq, _)| seq);
        let mut replay = self.open_replay(from).await?;
        let first = replay.next().await?;
        let Some((last_seq, fingerprint)) = self.last else {
            self.applier.suspend(false);
            // A first connection: nothing applied yet that could be wrong. The ring holds what the
            // engine published so far, so the next live batch is the one after it (0 if none): a
            // loss right after subscribing is then a gap like any other.
            let empty = first.is_none();
            self.apply_replay(from, None, first, &mut replay).await?;
            if empty {
                self.expected = Some(0);
            }
            return Ok(());
        };
        let same_engine = first
            .as_ref()
            .is_some_and(|(seq, payload)| *seq == last_seq && xxh3_64(payload) == fingerprint);
        if same_engine {
            self.applier.suspend(false);
            return self
                .apply_replay(last_seq.saturating_add(1), None, None, &mut replay)
                .await;
        }
        let later_ring = first.as_ref().is_some_and(|(seq, _)| *seq > last_seq);
        tracing::info!(live = %self.applier.stream().live, "kv events: not the engine whose batches were applied; forgetting its blocks");
        self.applier.reset(if later_ring {
            ResetReason::Gap
        } else {
            ResetReason::Restart
        });
        self.applier.suspend(false);
        self.expected = None;
        self.last = None;
        if later_ring {
            return Ok(());
        }
        // What the new process published so far, from its first batch.
        if first.as_ref().is_some_and(|(seq, _)| *seq > 0) {
            drop(replay);
            let mut replay = self.open_replay(0).await?;
            let first = replay.next().await?;
            return self.apply_replay(0, None, first, &mut replay).await;
        }
        self.apply_replay(0, None, first, &mut replay).await
    }

    /// Receives until the connection breaks or the publisher sends more than a message may hold.
    async fn receive(&mut self, connection: &mut Connection) -> StreamError {
        loop {
            let message = match connection.recv().await {
                Ok(message) => message,
                Err(error) => {
                    let error = StreamError::received(error);
                    if error.is_oversized() {
                        self.applier
                            .stream()
                            .refused_frames
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    return error;
                }
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
        match self.try_heal(from, until).await {
            Ok(true) => {}
            Ok(false) => self.count_gap_reset(),
            Err(error) => {
                self.count_replay_failure(&error);
                tracing::debug!(%error, "kv events: replay failed");
                self.count_gap_reset();
            }
        }
    }

    /// Whether the replay started at `from` (and was applied up to `until`).
    async fn try_heal(&mut self, from: u64, until: u64) -> Result<bool, StreamError> {
        let mut replay = self.open_replay(from).await?;
        let first = replay.next().await?;
        if first.as_ref().is_none_or(|(seq, _)| *seq != from) {
            return Ok(false);
        }
        self.apply_replay(from, Some(until), first, &mut replay)
            .await?;
        Ok(true)
    }

    fn count_gap_reset(&mut self) {
        self.applier.reset(ResetReason::Gap);
    }

    fn count_replay_failure(&self, error: &StreamError) {
        let stream = self.applier.stream();
        stream.replay_failures.fetch_add(1, Ordering::Relaxed);
        if error.is_oversized() {
            stream.refused_replays.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Applies `first` and the rest of `replay` as they arrive, those before `until` when given. A
    /// replay that fails midway leaves what it applied; the callers reset the rank or let the next
    /// live batch show the gap.
    async fn apply_replay(
        &mut self,
        from: u64,
        until: Option<u64>,
        first: Option<(u64, Bytes)>,
        replay: &mut Replay,
    ) -> Result<(), StreamError> {
        let wanted = |seq: u64| until.is_none_or(|until| seq < until);
        if let Some((seq, payload)) = first
            && wanted(seq)
        {
            self.apply_payload(seq, &payload);
        }
        while let Some((seq, payload)) = replay.next().await? {
            if !wanted(seq) {
                break;
            }
            self.apply_payload(seq, &payload);
        }
        self.applier
            .stream()
            .replays
            .fetch_add(1, Ordering::Relaxed);
        self.duplicates = Some((from, Instant::now() + DUPLICATE_WINDOW));
        Ok(())
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

    /// Asks the engine's ring for every batch from `from` on.
    async fn open_replay(&self, from: u64) -> Result<Replay, StreamError> {
        let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
        let Some(replay) = self.applier.stream().replay else {
            return Ok(Replay::empty(deadline));
        };
        let work = async {
            let mut connection = Connection::connect(replay, SocketType::Dealer, MAX_MESSAGE_BYTES)
                .await
                .map_err(|error| StreamError::Connect(replay, error.to_string()))?;
            connection
                .send(&[b"", &from.to_be_bytes()])
                .await
                .map_err(|error| StreamError::Receive(error.to_string()))?;
            Ok(connection)
        };
        match tokio::time::timeout_at(deadline, work).await {
            Ok(Ok(connection)) => Ok(Replay {
                connection: Some(connection),
                deadline,
                batches: 0,
                bytes: 0,
            }),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(StreamError::ReplayTimeout(REPLAY_TIMEOUT)),
        }
    }
}

/// One replay's answer, read batch by batch: at most [`MAX_REPLAYED`] batches and
/// [`MAX_REPLAY_BYTES`] of payload, all within [`REPLAY_TIMEOUT`].
struct Replay {
    /// `None` once the end marker came (or there is no replay socket).
    connection: Option<Connection>,
    deadline: tokio::time::Instant,
    batches: usize,
    bytes: usize,
}

impl Replay {
    fn empty(deadline: tokio::time::Instant) -> Replay {
        Replay {
            connection: None,
            deadline,
            batches: 0,
            bytes: 0,
        }
    }

    /// The next batch, undecoded; `None` at the end.
    async fn next(&mut self) -> Result<Option<(u64, Bytes)>, StreamError> {
        loop {
            let Some(connection) = self.connection.as_mut() else {
                return Ok(None);
            };
            let message = match tokio::time::timeout_at(self.deadline, connection.recv()).await {
                Ok(Ok(message)) => message,
                Ok(Err(error)) => return Err(StreamError::received(error)),
                Err(_) => return Err(StreamError::ReplayTimeout(REPLAY_TIMEOUT)),
            };
            let (seq, payload) = replay_frames(&message)?;
            if seq == REPLAY_END {
                self.connection = None;
                return Ok(None);
            }
            self.batches += 1;
            self.bytes = self.bytes.saturating_add(payload.len());
            if self.batches > MAX_REPLAYED {
                return Err(StreamError::ReplayTooLong);
            }
            if self.bytes > MAX_REPLAY_BYTES {
                return Err(StreamError::ReplayTooLarge);
            }
            // A negative number other than the end is nonsense; skip it.
            if let Ok(seq) = u64::try_from(seq) {
                return Ok(Some((seq, payload.clone())));
            }
        }
    }
}

/// A live message's sequence number and payload: `[topic, seq, payload]`.
pub fn live_frames(message: &[Bytes]) -> Result<(u64, &[u8]), StreamError> {
    let (seq, payload) = match message {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        frames => return Err(StreamError::Frames(frames.len())),
    };
    let seq = sequence(seq)?;
    Ok((seq as u64, payload))
}

/// A replay reply's sequence number (-1 at the end) and payload: `[topic, seq, payload]` (vLLM ≥
/// 0.26) or `[seq, payload]` (older vLLM, SGLang), after any empty delimiter frames.
pub fn replay_frames(message: &[Bytes]) -> Result<(i64, &Bytes), StreamError> {
    let start = message
        .iter()
        .position(|frame| !frame.is_empty())
        .unwrap_or(message.len());
    let (seq, payload) = match message.get(start..).unwrap_or_default() {
        [_, seq, payload] | [seq, payload] => (seq, payload),
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

    fn message(frames: &[&[u8]]) -> Vec<Bytes> {
        frames.iter().map(|f| Bytes::copy_from_slice(f)).collect()
    }

    fn replayed(frames: &[&[u8]]) -> (i64, Vec<u8>) {
        let message = message(frames);
        let (seq, payload) = replay_frames(&message).unwrap();
        (seq, payload.to_vec())
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
        assert_eq!(replayed(&[b"", b"kv@a", &seq, b"p"]), (3, b"p".to_vec()));
        // Older vLLM and SGLang: no topic.
        assert_eq!(replayed(&[b"", &seq, b"p"]), (3, b"p".to_vec()));
        assert_eq!(replayed(&[b"", &end, b""]), (-1, b"".to_vec()));
        // An empty topic is skipped with the delimiter; the end marker with an empty topic too.
        assert_eq!(replayed(&[b"", b"", &end, b""]), (-1, b"".to_vec()));
    }
}

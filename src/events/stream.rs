//! One KV event stream's state and counters: written by its subscriber task, read by `/metrics`,
//! `/debug/snapshot` and `cachepick snapshot` without waiting on it.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::Medium;
use crate::config::KvEventsFrom;
use crate::worker::WorkerId;

/// Where a stream's subscriber is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamState {
    /// Not connected yet, or reconnecting; the worker's entries still count.
    Connecting,
    /// Subscribed; batches are applied as they arrive.
    Live,
    /// Down longer than `stream_grace`: the worker's entries were forgotten, so it is no owner until
    /// the stream is back.
    Stale,
}

impl StreamState {
    pub const ALL: [StreamState; 3] = [
        StreamState::Connecting,
        StreamState::Live,
        StreamState::Stale,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StreamState::Connecting => "connecting",
            StreamState::Live => "live",
            StreamState::Stale => "stale",
        }
    }

    fn from_u8(value: u8) -> StreamState {
        match value {
            1 => StreamState::Live,
            2 => StreamState::Stale,
            _ => StreamState::Connecting,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            StreamState::Connecting => 0,
            StreamState::Live => 1,
            StreamState::Stale => 2,
        }
    }
}

/// Why a stream's worker was forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetReason {
    /// The sequence went backwards: a new engine process.
    Restart,
    /// Batches were lost and the replay could not return them.
    Gap,
    /// The engine said it dropped its cache (`AllBlocksCleared`).
    Cleared,
    /// The stream was down longer than `stream_grace`.
    Stale,
}

impl ResetReason {
    pub const ALL: [ResetReason; 4] = [
        ResetReason::Restart,
        ResetReason::Gap,
        ResetReason::Cleared,
        ResetReason::Stale,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ResetReason::Restart => "restart",
            ResetReason::Gap => "gap",
            ResetReason::Cleared => "cleared",
            ResetReason::Stale => "stale",
        }
    }

    fn index(self) -> usize {
        match self {
            ResetReason::Restart => 0,
            ResetReason::Gap => 1,
            ResetReason::Cleared => 2,
            ResetReason::Stale => 3,
        }
    }
}

/// The counters of one stream: data-parallel rank `rank` of worker `worker`.
#[derive(Debug)]
pub struct Stream {
    pub worker: WorkerId,
    pub rank: u32,
    pub live: SocketAddr,
    pub replay: Option<SocketAddr>,
    /// Who named the sockets (a [`KvEventsFrom`]): the worker's `kv_events:`, the pool's ports, or
    /// the engine, which may confirm the pool's ports later.
    from: AtomicU8,
    state: AtomicU8,
    /// The last sequence number applied; -1 before the first.
    last_seq: AtomicI64,
    /// The first connection's catch-up is over (the engine's ring replayed, or found unusable), or
    /// the first connection failed: what readiness waits for at start.
    settled: AtomicBool,
    pub(super) batches: AtomicU64,
    pub(super) events: AtomicU64,
    pub(super) blocks_stored: AtomicU64,
    pub(super) blocks_removed: AtomicU64,
    pub(super) orphans: AtomicU64,
    pub(super) over_bound: AtomicU64,
    pub(super) opaque: AtomicU64,
    pub(super) unknown_events: AtomicU64,
    pub(super) decode_errors: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) replays: AtomicU64,
    pub(super) replay_failures: AtomicU64,
    pub(super) duplicates: AtomicU64,
    /// Live messages refused from their frame headers, over `MAX_MESSAGE_BYTES`
    /// (see `subscriber`): each closes the connection.
    pub(super) refused_frames: AtomicU64,
    /// Replays abandoned for returning more than their budget.
    pub(super) refused_replays: AtomicU64,
    resets: [AtomicU64; 4],
    /// Blocks held per tier, as stored minus removed (only GPU blocks make an owner).
    tiers: [AtomicI64; 4],
    /// The engine's block size, from its last `BlockStored`.
    pub(super) engine_block_size: AtomicU32,
    /// When the stream entered its state, and how many events it had received then.
    since: Mutex<Option<(Instant, u64)>>,
}

impl Stream {
    pub fn new(worker: WorkerId, rank: u32, live: SocketAddr, replay: Option<SocketAddr>) -> Self {
        Stream {
            worker,
            rank,
            live,
            replay,
            from: AtomicU8::new(from_to_u8(KvEventsFrom::Worker)),
            state: AtomicU8::new(StreamState::Connecting.to_u8()),
            last_seq: AtomicI64::new(-1),
            settled: AtomicBool::new(false),
            batches: AtomicU64::new(0),
            events: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            blocks_removed: AtomicU64::new(0),
            orphans: AtomicU64::new(0),
            over_bound: AtomicU64::new(0),
            opaque: AtomicU64::new(0),
            unknown_events: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            refused_frames: AtomicU64::new(0),
            refused_replays: AtomicU64::new(0),
            resets: Default::default(),
            tiers: Default::default(),
            engine_block_size: AtomicU32::new(0),
            since: Mutex::new(None),
        }
    }

    /// The stream's sockets were named by `from`.
    pub fn named_by(self, from: KvEventsFrom) -> Self {
        self.set_from(from);
        self
    }

    pub fn from(&self) -> KvEventsFrom {
        match self.from.load(Ordering::Relaxed) {
            0 => KvEventsFrom::Worker,
            1 => KvEventsFrom::Pool,
            _ => KvEventsFrom::Engine,
        }
    }

    pub(super) fn set_from(&self, from: KvEventsFrom) {
        self.from.store(from_to_u8(from), Ordering::Relaxed);
    }

    /// Whether the first try is over: replayed what the engine's ring held, or could not connect.
    pub fn settled(&self) -> bool {
        self.settled.load(Ordering::Relaxed)
    }

    pub(super) fn settle(&self) {
        self.settled.store(true, Ordering::Relaxed);
    }

    pub fn state(&self) -> StreamState {
        StreamState::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Moves to `state` at `now`, if it is a change.
    pub(super) fn set_state(&self, state: StreamState, now: Instant) {
        if self.state.swap(state.to_u8(), Ordering::Relaxed) != state.to_u8()
            && let Ok(mut since) = self.since.lock()
        {
            *since = Some((now, self.events.load(Ordering::Relaxed)));
        }
    }

    pub fn last_seq(&self) -> Option<u64> {
        u64::try_from(self.last_seq.load(Ordering::Relaxed)).ok()
    }

    pub(super) fn set_last_seq(&self, seq: u64) {
        self.last_seq
            .store(i64::try_from(seq).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    pub(super) fn count_reset(&self, reason: ResetReason) {
        if let Some(counter) = self.resets.get(reason.index()) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        for tier in &self.tiers {
            tier.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn add_tier(&self, medium: Medium, blocks: i64) {
        if let Some(tier) = self.tiers.get(medium_index(medium)) {
            let now = tier
                .fetch_add(blocks, Ordering::Relaxed)
                .saturating_add(blocks);
            if now < 0 {
                // A removal of blocks stored before the subscription: there is no negative cache.
                tier.store(0, Ordering::Relaxed);
            }
        }
    }

    /// A consistent-enough copy of the counters, for display.
    pub fn view(&self, now: Instant) -> StreamView {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let since = self.since.lock().ok().and_then(|since| *since);
        StreamView {
            worker: self.worker,
            rank: self.rank,
            live: self.live,
            replay: self.replay,
            from: self.from(),
            state: self.state(),
            for_ms: since.map(|(at, _)| duration_ms(now.saturating_duration_since(at))),
            events_per_second: since.and_then(|(at, events)| {
                let seconds = now.saturating_duration_since(at).as_secs_f64();
                (self.state() == StreamState::Live && seconds > 0.0)
                    .then(|| load(&self.events).saturating_sub(events) as f64 / seconds)
            }),
            last_seq: self.last_seq(),
            batches: load(&self.batches),
            events: load(&self.events),
            blocks_stored: load(&self.blocks_stored),
            blocks_removed: load(&self.blocks_removed),
            orphans: load(&self.orphans),
            over_bound: load(&self.over_bound),
            opaque: load(&self.opaque),
            unknown_events: load(&self.unknown_events),
            decode_errors: load(&self.decode_errors),
            gaps: load(&self.gaps),
            replays: load(&self.replays),
            replay_failures: load(&self.replay_failures),
            duplicates: load(&self.duplicates),
            refused_frames: load(&self.refused_frames),
            refused_replays: load(&self.refused_replays),
            resets: ResetReason::ALL.map(|reason| {
                (
                    reason,
                    self.resets
                        .get(reason.index())
                        .map_or(0, |counter| counter.load(Ordering::Relaxed)),
                )
            }),
            tiers: Medium::ALL.map(|medium| {
                (
                    medium,
                    self.tiers
                        .get(medium_index(medium))
                        .map_or(0, |tier| tier.load(Ordering::Relaxed).max(0) as u64),
                )
            }),
            engine_block_size: match self.engine_block_size.load(Ordering::Relaxed) {
                0 => None,
                size => Some(size),
            },
        }
    }
}

fn from_to_u8(from: KvEventsFrom) -> u8 {
    match from {
        KvEventsFrom::Worker => 0,
        KvEventsFrom::Pool => 1,
        KvEventsFrom::Engine => 2,
    }
}

fn medium_index(medium: Medium) -> usize {
    match medium {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::Disk => 2,
        Medium::Other => 3,
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A stream's counters at one moment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamView {
    pub worker: WorkerId,
    pub rank: u32,
    pub live: SocketAddr,
    pub replay: Option<SocketAddr>,
    pub from: KvEventsFrom,
    pub state: StreamState,
    /// How long it has been in `state`.
    pub for_ms: Option<u64>,
    /// Events received per second since the stream went live; `None` while it is not.
    pub events_per_second: Option<f64>,
    pub last_seq: Option<u64>,
    pub batches: u64,
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub orphans: u64,
    pub over_bound: u64,
    pub opaque: u64,
    pub unknown_events: u64,
    pub decode_errors: u64,
    pub gaps: u64,
    pub replays: u64,
    pub replay_failures: u64,
    pub duplicates: u64,
    /// Live messages over the byte limit, refused before their body was read.
    pub refused_frames: u64,
    /// Replays abandoned over their batch or byte budget.
    pub refused_replays: u64,
    pub resets: [(ResetReason, u64); 4],
    /// Blocks per tier the engine reports holding (stored minus removed since the subscription).
    pub tiers: [(Medium, u64); 4],
    pub engine_block_size: Option<u32>,
}

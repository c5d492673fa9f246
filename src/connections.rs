//! The connections open on a listener: how many there are (the cap), what each is doing (its open
//! streams, and since when it has held none), and the room made at the cap by closing the connection
//! that has been idle longest.
//!
//! A connection that holds no stream (no request in progress) costs its client nothing to keep and the
//! listener a place under its cap: clients that connect and never ask could otherwise fill the cap and
//! lock every other client out. So at the cap a newcomer does not wait: the open connection idle
//! longest is told to close ([`Conn::closed_for`] answers [`CloseReason::Evicted`]) and its place goes
//! to the newcomer at once. While it closes (an HTTP/2 GOAWAY round, bounded by its listener), it holds
//! a place among at most `max` closing connections, so the file descriptors held stay under twice the
//! cap. With every connection holding a stream, nothing is closed: [`Registry::try_admit`] answers
//! `None` and the listener decides (the gRPC listener waits for a place, the HTTP listener refuses).
//!
//! The listener's accept loop is the only caller of the admission methods; the connection's service
//! reports its streams ([`Conn::stream_opened`], dropping the [`Stream`] guard), and its task asks
//! [`Conn::closed_for`] when it should close for idleness or eviction.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Why a listener closed a connection it had admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// It held no stream for the idle timeout.
    Idle,
    /// It opened no stream within the first-stream timeout of its admission.
    FirstStream,
    /// A newcomer at the cap took its place: it was the connection idle longest.
    Evicted,
}

impl CloseReason {
    pub const ALL: [CloseReason; 3] = [
        CloseReason::Idle,
        CloseReason::FirstStream,
        CloseReason::Evicted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Idle => "idle",
            CloseReason::FirstStream => "first_stream",
            CloseReason::Evicted => "evicted",
        }
    }
}

/// How long a connection may hold no stream before it is closed; `None` leaves it open.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdleLimits {
    /// Since its last stream ended.
    pub idle: Option<Duration>,
    /// Since its admission, before it opened any stream.
    pub first_stream: Option<Duration>,
}

/// The connections of one listener, at most `max` open (and at most `max` more closing).
pub struct Registry {
    slots: Arc<Semaphore>,
    closing: Arc<Semaphore>,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    /// Notified when a connection becomes idle or ends: a waiting admission may find room.
    room: Arc<Notify>,
}

/// One admitted connection's place under the cap; dropping it (when the connection has ended) frees
/// the place.
pub struct Place {
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

/// One admitted connection, as its service and its task see it.
pub struct Conn {
    id: u64,
    opened: Instant,
    state: Mutex<State>,
    /// Its stream count went to or from zero.
    changed: Notify,
    /// It was chosen to make room at the cap.
    evicted: Notify,
    room: Arc<Notify>,
}

struct State {
    streams: usize,
    /// When the last stream ended (the admission, before any).
    idle_since: Instant,
    streamed: bool,
    /// Told to close (or closing for idleness): never chosen again.
    closing: bool,
    slot: Option<OwnedSemaphorePermit>,
    closing_slot: Option<OwnedSemaphorePermit>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state is a few counters, consistent after every statement: a panic elsewhere
    // leaves it usable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Registry {
    /// A registry admitting at most `max` open connections (at least one).
    pub fn new(max: usize) -> Arc<Registry> {
        let max = max.max(1);
        Arc::new(Registry {
            slots: Arc::new(Semaphore::new(max)),
            closing: Arc::new(Semaphore::new(max)),
            open: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            room: Arc::new(Notify::new()),
        })
    }

    /// Connections open now, closing ones included.
    pub fn len(&self) -> usize {
        lock(&self.open).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a connection under the cap; at the cap, closes the connection idle longest to make room
    /// for it. `None` when every open connection holds a stream (or `max` are already closing).
    pub fn try_admit(self: &Arc<Self>) -> Option<Place> {
        if let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() {
            return Some(self.register(slot));
        }
        if !self.evict_longest_idle() {
            return None;
        }
        let slot = Arc::clone(&self.slots).try_acquire_owned().ok()?;
        Some(self.register(slot))
    }

    /// Admits a connection, waiting while every open connection holds a stream: until one ends or
    /// becomes idle (and is then closed to make room).
    pub async fn admit(self: &Arc<Self>) -> Place {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if let Some(place) = self.try_admit() {
                return place;
            }
            tokio::select! {
                slot = Arc::clone(&self.slots).acquire_owned() => {
                    // The semaphore is never closed.
                    if let Ok(slot) = slot {
                        return self.register(slot);
                    }
                }
                () = room => {}
            }
        }
    }

    fn register(self: &Arc<Self>, slot: OwnedSemaphorePermit) -> Place {
        let now = Instant::now();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            id,
            opened: now,
            state: Mutex::new(State {
                streams: 0,
                idle_since: now,
                streamed: false,
                closing: false,
                slot: Some(slot),
                closing_slot: None,
            }),
            changed: Notify::new(),
            evicted: Notify::new(),
            room: Arc::clone(&self.room),
        });
        lock(&self.open).insert(id, Arc::clone(&conn));
        Place {
            conn,
            registry: Arc::clone(self),
        }
    }

    /// Tells the open connection idle longest to close, moving it from its slot to a closing one.
    fn evict_longest_idle(&self) -> bool {
        let open = lock(&self.open);
        let mut chosen: Option<(Instant, &Arc<Conn>)> = None;
        for conn in open.values() {
            let state = lock(&conn.state);
            if state.closing || state.streams > 0 {
                continue;
            }
            if chosen.is_none_or(|(since, _)| state.idle_since < since) {
                chosen = Some((state.idle_since, conn));
            }
        }
        let Some((_, conn)) = chosen else {
            return false;
        };
        let Ok(closing_slot) = Arc::clone(&self.closing).try_acquire_owned() else {
            return false;
        };
        let mut state = lock(&conn.state);
        state.closing = true;
        state.closing_slot = Some(closing_slot);
        drop(state.slot.take());
        drop(state);
        conn.evicted.notify_one();
        true
    }
}

impl Place {
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.registry.open).remove(&self.conn.id);
        let mut state = lock(&self.conn.state);
        drop(state.slot.take());
        drop(state.closing_slot.take());
        drop(state);
        self.registry.room.notify_waiters();
    }
}

impl Conn {
    /// A stream (an HTTP/2 stream, an HTTP/1 request) began; the returned guard ends it when dropped.
    pub fn stream_opened(self: &Arc<Self>) -> Stream {
        let mut state = lock(&self.state);
        state.streams += 1;
        state.streamed = true;
        if state.streams == 1 {
            self.changed.notify_waiters();
        }
        Stream(Arc::clone(self))
    }

    fn stream_closed(&self) {
        let mut state = lock(&self.state);
        state.streams = state.streams.saturating_sub(1);
        if state.streams == 0 {
            state.idle_since = Instant::now();
            drop(state);
            self.changed.notify_waiters();
            self.room.notify_waiters();
        }
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        lock(&self.state).streams
    }

    /// Resolves when this connection should close: it was evicted, or it held no stream for longer
    /// than `limits` allow. Marks it closing, so it is not chosen to make room as well.
    pub async fn closed_for(&self, limits: IdleLimits) -> CloseReason {
        let reason = loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let deadline = {
                let state = lock(&self.state);
                if state.closing {
                    // Evicted before this task asked: the notification is stored, taken below.
                    None
                } else if state.streams > 0 {
                    None
                } else if state.streamed {
                    limits
                        .idle
                        .map(|idle| (state.idle_since + idle, CloseReason::Idle))
                } else {
                    limits
                        .first_stream
                        .map(|first| (self.opened + first, CloseReason::FirstStream))
                }
            };
            let sleep = async {
                match deadline {
                    Some((at, reason)) => {
                        tokio::time::sleep_until(at.into()).await;
                        reason
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.evicted.notified() => break CloseReason::Evicted,
                reason = sleep => {
                    // A stream may have begun (and ended) as the timer fired: look again.
                    let state = lock(&self.state);
                    let since = if state.streamed { state.idle_since } else { self.opened };
                    let limit = match reason {
                        CloseReason::Idle => limits.idle,
                        _ => limits.first_stream,
                    };
                    if !state.closing
                        && state.streams == 0
                        && limit.is_some_and(|limit| since.elapsed() >= limit)
                    {
                        break reason;
                    }
                }
                () = changed => {}
            }
        };
        lock(&self.state).closing = true;
        reason
    }

    /// Resolves once `grace` has passed and no stream is open: a connection being closed lets a
    /// stream that began as the close was decided finish.
    pub async fn quiet_after(&self, grace: Duration) {
        tokio::time::sleep(grace).await;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.streams() == 0 {
                return;
            }
            changed.await;
        }
    }
}

/// One open stream of a connection; dropping it ends the stream.
pub struct Stream(Arc<Conn>);

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.stream_closed();
    }
}

/// A response body that holds its stream open until the body is done with (sent, or dropped when the
/// client reset the stream).
pub struct Guarded<B> {
    body: B,
    _stream: Stream,
}

impl<B> Guarded<B> {
    pub fn new(body: B, stream: Stream) -> Self {
        Guarded {
            body,
            _stream: stream,
        }
    }
}

impl<B: Body + Unpin> Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_the_cap_every_connection_is_admitted() {
        let registry = Registry::new(2);
        let first = registry.try_admit().unwrap();
        let second = registry.try_admit().unwrap();
        assert_eq!(registry.len(), 2);
        drop(first);
        drop(second);
        assert!(registry.is_empty());
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room() {
        let registry = Registry::new(2);
        let oldest = registry.try_admit().unwrap();
        let busy = registry.try_admit().unwrap();
        // The older connection holds a stream: the younger idle one is the longest idle.
        let stream = oldest.conn().stream_opened();
        drop(busy.conn().stream_opened());
        let third = registry.try_admit().expect("an idle connection made room");
        assert!(lock(&busy.conn().state).closing, "the idle one was chosen");
        assert!(!lock(&oldest.conn().state).closing, "the busy one stays");
        // Both others now hold streams or are closing: no room.
        let _third_stream = third.conn().stream_opened();
        assert!(registry.try_admit().is_none());
        drop(stream);
        assert!(
            registry.try_admit().is_some(),
            "a connection whose stream ended is idle again"
        );
    }

    #[test]
    fn closing_connections_are_bounded_too() {
        let registry = Registry::new(1);
        let mut held = vec![registry.try_admit().unwrap()];
        // Each newcomer evicts the previous one, which stays until its task ends: at most one closing.
        held.push(registry.try_admit().expect("the first makes room"));
        assert!(
            registry.try_admit().is_none(),
            "one closing already: the next must wait"
        );
        held.remove(0);
        assert!(registry.try_admit().is_some());
    }
}

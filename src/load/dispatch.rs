//! Router-local dispatch counts: requests sent to each worker since its last complete reading, and
//! their uncached prompt tokens as predicted at the decision; beside them, the dispatches the other
//! picker replicas announced (`replica_sync`, `sync.rs`) over the same window.

use std::sync::atomic::{AtomicU64, Ordering};

/// How many of a worker's most recent routed requests the table remembers one by one: enough for the
/// queue of any engine that is worth routing to, small enough to cost 512 bytes a worker.
const RECENT: usize = 64;

use super::snapshot::DispatchCounts;
use crate::worker::WorkerId;

/// One counter per worker of a pool. The request path increments it after each decision; the scraper
/// subtracts what had been sent when a newer complete reading was requested, since the engine's numbers
/// then include those requests. Relaxed ordering suffices: each counter is an independent estimate, never a synchronisation
/// point.
#[derive(Debug)]
pub struct DispatchTable {
    counts: Vec<AtomicU64>,
    tokens: Vec<AtomicU64>,
    /// The other replicas' announced dispatches and their uncached tokens, kept apart from this
    /// replica's: the request-count gate counts its own, as the seed defines it.
    peer_counts: Vec<AtomicU64>,
    peer_tokens: Vec<AtomicU64>,
    /// The pool's arrivals per own dispatch (`share.rs`), as `f64` bits: how much of what reaches the
    /// workers between readings this replica cannot see; the window's uncached tokens are scaled by it.
    share: AtomicU64,
    /// Per slot, the number of the pool's last off-owner placement (a request that brought the worker
    /// a prefix it did not hold) that went to it; 0 for none. Among workers otherwise equal, the one
    /// that took a new prefix least recently takes the next, so an idle fleet spreads new prefixes
    /// instead of piling them on the lowest id (llm-d's no-hit LRU scorer is the precedent).
    cold: Vec<AtomicU64>,
    cold_placements: AtomicU64,
    /// Per slot, the uncached tokens of each of the last [`RECENT`] requests routed there (sent by
    /// this replica or announced by a peer), in the order seen: the requests an engine reports
    /// waiting are the newest it was sent (it queues first come, first served), so their own sizes
    /// price its queue where the engine reports a count only.
    recent: Vec<Recent>,
}

/// One worker's recent routed requests: a ring of their uncached tokens and how many were ever seen.
#[derive(Debug)]
struct Recent {
    seen: AtomicU64,
    tokens: [AtomicU64; RECENT],
}

impl Recent {
    fn new() -> Self {
        Recent {
            seen: AtomicU64::new(0),
            tokens: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn push(&self, uncached_tokens: u64) {
        let at = self.seen.fetch_add(1, Ordering::Relaxed) % RECENT as u64;
        if let Some(slot) = self.tokens.get(at as usize) {
            slot.store(uncached_tokens, Ordering::Relaxed);
        }
    }

    fn clear(&self) {
        self.seen.store(0, Ordering::Relaxed);
        for slot in &self.tokens {
            slot.store(0, Ordering::Relaxed);
        }
    }
}

impl DispatchTable {
    pub fn new(workers: usize) -> Self {
        let zeros = || (0..workers).map(|_| AtomicU64::new(0)).collect();
        DispatchTable {
            counts: zeros(),
            tokens: zeros(),
            peer_counts: zeros(),
            peer_tokens: zeros(),
            share: AtomicU64::new(1.0_f64.to_bits()),
            cold: zeros(),
            cold_placements: AtomicU64::new(0),
            recent: (0..workers).map(|_| Recent::new()).collect(),
        }
    }

    /// Slots the table counts for.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Requests reaching the pool per request this replica sends it (at least 1).
    pub fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
    }

    pub(super) fn set_share(&self, share: f64) {
        self.share
            .store(share.max(1.0).to_bits(), Ordering::Relaxed);
    }

    /// Forgets every request counted for `id`: its worker left, restarted, or the slot has a new one.
    pub fn reset(&self, id: WorkerId) {
        for table in [
            &self.counts,
            &self.tokens,
            &self.peer_counts,
            &self.peer_tokens,
            &self.cold,
        ] {
            if let Some(slot) = table.get(id.index()) {
                slot.store(0, Ordering::Relaxed);
            }
        }
        if let Some(recent) = self.recent.get(id.index()) {
            recent.clear();
        }
    }

    /// Records that an off-owner placement (a prefix new to it) went to `id`.
    pub fn record_cold(&self, id: WorkerId) {
        let number = self
            .cold_placements
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if let Some(slot) = self.cold.get(id.index()) {
            slot.store(number, Ordering::Relaxed);
        }
    }

    /// Counts one request sent to `id`, bringing `uncached_tokens` the worker is predicted to compute.
    pub fn record(&self, id: WorkerId, uncached_tokens: u64) {
        if let Some(count) = self.counts.get(id.index()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(tokens) = self.tokens.get(id.index()) {
            tokens.fetch_add(uncached_tokens, Ordering::Relaxed);
        }
        if let Some(recent) = self.recent.get(id.index()) {
            recent.push(uncached_tokens);
        }
    }

    /// Counts one request another replica announced it sent to `id`, bringing `uncached_tokens`.
    pub fn record_peer(&self, id: WorkerId, uncached_tokens: u64) {
        if let Some(count) = self.peer_counts.get(id.index()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(tokens) = self.peer_tokens.get(id.index()) {
            tokens.fetch_add(uncached_tokens, Ordering::Relaxed);
        }
        if let Some(recent) = self.recent.get(id.index()) {
            recent.push(uncached_tokens);
        }
    }

    /// The `waiting` requests a reading of `id` reports queued, by their own uncached tokens as
    /// predicted when they were routed: the last `waiting` seen routed there before `window` was taken
    /// (when its scrape was requested), beside the mean of every remembered one routed before it.
    /// Where fewer are remembered (a queue longer than [`RECENT`], or traffic from before this replica
    /// started or that it never saw), the ones it has stand for the rest at their mean. `None` when
    /// none is remembered, or the slot was reset since.
    pub fn queued(&self, id: WorkerId, window: Window, waiting: u64) -> Option<RoutedQueue> {
        let recent = self.recent.get(id.index())?;
        let seen = recent.seen.load(Ordering::Relaxed);
        if window.mark > seen {
            return None;
        }
        let kept_from = seen.saturating_sub(RECENT as u64);
        let sum = |from: u64| {
            (from..window.mark)
                .filter_map(|n| recent.tokens.get((n % RECENT as u64) as usize))
                .map(|slot| slot.load(Ordering::Relaxed))
                .fold(0, u64::saturating_add)
        };
        let remembered = window.mark.checked_sub(kept_from).filter(|n| *n > 0)?;
        let per_request = sum(kept_from) / remembered;
        let from = window.mark.saturating_sub(waiting).max(kept_from);
        let known = window.mark.saturating_sub(from);
        let waiting_tokens = if known == 0 {
            0
        } else {
            let scaled = u128::from(sum(from)) * u128::from(waiting) / u128::from(known);
            u64::try_from(scaled).unwrap_or(u64::MAX)
        };
        Some(RoutedQueue {
            waiting_tokens,
            per_request,
        })
    }

    /// What is counted for `id` now: the window a scrape's request closes.
    pub fn window(&self, id: WorkerId) -> Window {
        let read = |table: &[AtomicU64]| {
            table
                .get(id.index())
                .map_or(0, |slot| slot.load(Ordering::Relaxed))
        };
        Window {
            count: read(&self.counts),
            tokens: read(&self.tokens),
            peer_count: read(&self.peer_counts),
            peer_tokens: read(&self.peer_tokens),
            mark: self
                .recent
                .get(id.index())
                .map_or(0, |recent| recent.seen.load(Ordering::Relaxed)),
        }
    }

    /// Forgets what `window` counted for `id`: a newer reading covers it. What was sent (or
    /// announced) since that reading was requested stays counted.
    pub fn forget(&self, id: WorkerId, window: Window) {
        for (table, amount) in [
            (&self.counts, window.count),
            (&self.tokens, window.tokens),
            (&self.peer_counts, window.peer_count),
            (&self.peer_tokens, window.peer_tokens),
        ] {
            if let Some(slot) = table.get(id.index()) {
                let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
                    Some(current.saturating_sub(amount))
                });
            }
        }
    }
}

impl DispatchCounts for DispatchTable {
    fn since_reading(&self, id: WorkerId) -> u64 {
        self.counts
            .get(id.index())
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    /// The uncached tokens this replica sent and its peers announced since the reading, times the
    /// pool's share of what neither covers: the request-count rules see the own count alone
    /// ([`DispatchCounts::since_reading`]), as the seed defines them.
    fn uncached_since_reading(&self, id: WorkerId) -> u64 {
        let window = self.window(id);
        let seen = window.tokens.saturating_add(window.peer_tokens);
        (seen as f64 * self.share()).round() as u64
    }

    fn last_cold(&self, id: WorkerId) -> u64 {
        self.cold
            .get(id.index())
            .map_or(0, |slot| slot.load(Ordering::Relaxed))
    }
}

/// A reading's queue as [`DispatchTable::queued`] prices it from the requests routed there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutedQueue {
    /// The waiting requests' uncached tokens, as predicted when each was routed.
    pub waiting_tokens: u64,
    /// The mean of the same prediction over every remembered request routed before the reading.
    pub per_request: u64,
}

/// What a [`DispatchTable`] counts for one worker at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Requests this replica sent, and their uncached tokens.
    pub count: u64,
    pub tokens: u64,
    /// Requests the other replicas announced, and their uncached tokens.
    pub peer_count: u64,
    pub peer_tokens: u64,
    /// How many requests had ever been seen routed to the worker ([`DispatchTable::queued`]).
    pub mark: u64,
}

impl Window {
    /// Requests seen sent, by this replica or announced by its peers.
    pub fn seen(&self) -> u64 {
        self.count.saturating_add(self.peer_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_forgets_what_its_request_covered_and_the_peers_tokens_count_with_the_own() {
        let table = DispatchTable::new(2);
        let id = WorkerId(1);
        table.record(id, 1_000);
        table.record_peer(id, 4_000);
        let covered = table.window(id);
        // Sent and announced while the scrape was out: the reading does not cover them.
        table.record(id, 300);
        table.record_peer(id, 200);
        assert_eq!(table.uncached_since_reading(id), 5_500);
        table.forget(id, covered);
        assert_eq!(
            table.window(id),
            Window {
                count: 1,
                tokens: 300,
                peer_count: 1,
                peer_tokens: 200,
                mark: 4,
            }
        );
        // The request-count gate counts this replica's own, as the seed defines it.
        assert_eq!(table.since_reading(id), 1);
        // What neither this replica sent nor its peers announced is priced by the share.
        table.set_share(2.0);
        assert_eq!(table.uncached_since_reading(id), 1_000);
        table.reset(id);
        assert_eq!(table.window(id), Window::default());
    }

    #[test]
    fn a_reported_queue_is_priced_by_the_requests_last_routed_before_the_reading() {
        let table = DispatchTable::new(2);
        let id = WorkerId(0);
        let queued = |window: Window, waiting: u64| {
            table
                .queued(id, window, waiting)
                .map(|queue| (queue.waiting_tokens, queue.per_request))
        };
        assert_eq!(queued(table.window(id), 2), None);
        for tokens in [8_000, 100, 30_000] {
            table.record(id, tokens);
        }
        table.record_peer(id, 500);
        let requested = table.window(id);
        // Sent while the scrape was out: the reading's queue does not hold it.
        table.record(id, 90_000);
        // Two waiting: the last two routed before the request, not two at the mean (9,650).
        assert_eq!(queued(requested, 2), Some((30_500, 9_650)));
        assert_eq!(queued(requested, 0), Some((0, 9_650)));
        assert_eq!(queued(requested, 4), Some((38_600, 9_650)));
        // Six waiting, four remembered: those four stand for the other two at their mean.
        assert_eq!(queued(requested, 6), Some((57_900, 9_650)));
        // The other worker saw nothing routed.
        let other = WorkerId(1);
        assert_eq!(table.queued(other, table.window(other), 1), None);
        // A ring that wrapped keeps the newest RECENT; a reset forgets them all.
        for _ in 0..RECENT {
            table.record(id, 1_000);
        }
        let full = table.window(id);
        assert_eq!(
            queued(full, RECENT as u64 * 2),
            Some((RECENT as u64 * 2 * 1_000, 1_000))
        );
        table.reset(id);
        assert_eq!(queued(full, 1), None);
    }
}

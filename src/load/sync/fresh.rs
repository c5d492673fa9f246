//! Replay protection for `replica_sync`: each authenticated announcement is taken once, and only while
//! it is fresh.
//!
//! A datagram's send time must be within [`FRESH_WITHIN`] of the receiver's clock, either way, and no
//! earlier than the receiver's start (a restarted receiver remembers nothing it took), so a datagram
//! captured earlier is worthless after that; within it, each sender's sequence numbers are
//! taken once, through a window of the last [`WINDOW`] numbers below the highest seen (UDP reorders;
//! anything older than the window is refused as already seen). A sender's entry is forgotten once
//! everything it sent is stale, so the table holds the replicas of the last few seconds, bounded by
//! [`MAX_ORIGINS`] in any case.

use std::collections::HashMap;
use std::time::Duration;

/// How far an announcement's send time may be from the receiver's clock: the replicas' clocks must
/// agree within it (NTP keeps them within milliseconds). An announcement is worth the seconds until
/// the worker's next reading, so a stale one is worth nothing anyway.
pub const FRESH_WITHIN: Duration = Duration::from_secs(10);

/// Sequence numbers below a sender's highest that are still told apart.
pub const WINDOW: u64 = 64;

/// Senders remembered at once: far more replicas than a fleet runs, restarts included.
pub const MAX_ORIGINS: usize = 1024;

/// Why an authenticated announcement is not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unfresh {
    /// Sent further from now than `FRESH_WITHIN`.
    Stale,
    /// Its sender's sequence number was taken already (or fell behind the window).
    Replayed,
    /// A new sender while `MAX_ORIGINS` senders sent fresh announcements.
    TooManySenders,
}

/// What was taken from each sender.
#[derive(Debug, Default)]
pub struct Seen {
    senders: HashMap<u64, Sender>,
    /// Nothing sent before this, in ms, is taken: what this process's predecessor took, it cannot
    /// tell apart from what it did not.
    since_ms: u64,
}

#[derive(Debug)]
struct Sender {
    highest: u64,
    /// Bit `i` set: sequence `highest - i` was taken.
    taken: u64,
    /// The latest send time taken, in ms.
    newest_ms: u64,
}

impl Seen {
    /// A table that takes nothing sent before `since_ms`: the receiver's start.
    pub fn since(since_ms: u64) -> Seen {
        Seen {
            since_ms,
            ..Seen::default()
        }
    }

    /// Takes `sequence` of `origin`, sent at `sent_at_ms`, if it is fresh at `now_ms` and not taken
    /// before.
    pub fn take(
        &mut self,
        origin: u64,
        sequence: u64,
        sent_at_ms: u64,
        now_ms: u64,
    ) -> Result<(), Unfresh> {
        let fresh = FRESH_WITHIN.as_millis() as u64;
        if sent_at_ms.saturating_add(fresh) < now_ms
            || sent_at_ms > now_ms.saturating_add(fresh)
            || sent_at_ms < self.since_ms
        {
            return Err(Unfresh::Stale);
        }
        if !self.senders.contains_key(&origin) && self.senders.len() >= MAX_ORIGINS {
            // Forgetting a sender is safe once all it sent is stale: a replay of it is refused as such.
            self.senders
                .retain(|_, sender| sender.newest_ms.saturating_add(2 * fresh) >= now_ms);
            if self.senders.len() >= MAX_ORIGINS {
                return Err(Unfresh::TooManySenders);
            }
        }
        let sender = self.senders.entry(origin).or_insert(Sender {
            highest: sequence,
            taken: 0,
            newest_ms: sent_at_ms,
        });
        if sequence > sender.highest {
            let ahead = sequence - sender.highest;
            sender.taken = if ahead >= WINDOW {
                0
            } else {
                sender.taken << ahead
            };
            sender.highest = sequence;
        }
        let behind = sender.highest - sequence;
        let bit = 1u64.checked_shl(u32::try_from(behind).unwrap_or(u32::MAX));
        match bit {
            Some(bit) if behind < WINDOW && sender.taken & bit == 0 => {
                sender.taken |= bit;
                sender.newest_ms = sender.newest_ms.max(sent_at_ms);
                Ok(())
            }
            _ => Err(Unfresh::Replayed),
        }
    }

    /// Senders remembered now.
    #[cfg(test)]
    pub fn senders(&self) -> usize {
        self.senders.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_780_000_000_000;

    #[test]
    fn each_sequence_is_taken_once_in_any_order_within_the_window() {
        let mut seen = Seen::default();
        for sequence in [5, 3, 4, 9, 1, 70] {
            assert_eq!(seen.take(1, sequence, NOW, NOW), Ok(()), "{sequence}");
        }
        for sequence in [5, 3, 4, 9, 70] {
            assert_eq!(seen.take(1, sequence, NOW, NOW), Err(Unfresh::Replayed));
        }
        // 70 moved the window: 6 is behind it by 64 and cannot be told apart from one taken.
        assert_eq!(seen.take(1, 6, NOW, NOW), Err(Unfresh::Replayed));
        assert_eq!(seen.take(1, 7, NOW, NOW), Ok(()));
        // Another sender's numbers are its own.
        assert_eq!(seen.take(2, 5, NOW, NOW), Ok(()));
        // A jump past the window forgets what it passed, not what it takes.
        assert_eq!(seen.take(1, 1_000, NOW, NOW), Ok(()));
        assert_eq!(seen.take(1, 1_000, NOW, NOW), Err(Unfresh::Replayed));
        assert_eq!(seen.take(1, 999, NOW, NOW), Ok(()));
        assert_eq!(seen.take(1, u64::MAX, NOW, NOW), Ok(()));
        assert_eq!(seen.take(1, 0, NOW, NOW), Err(Unfresh::Replayed));
    }

    #[test]
    fn only_what_was_sent_within_ten_seconds_of_now_is_taken() {
        let mut seen = Seen::default();
        let fresh = FRESH_WITHIN.as_millis() as u64;
        assert_eq!(seen.take(1, 1, NOW - fresh - 1, NOW), Err(Unfresh::Stale));
        assert_eq!(seen.take(1, 2, NOW + fresh + 1, NOW), Err(Unfresh::Stale));
        assert_eq!(seen.take(1, 3, NOW - fresh, NOW), Ok(()));
        assert_eq!(seen.take(1, 4, NOW + fresh, NOW), Ok(()));
        assert_eq!(seen.take(1, 5, 0, NOW), Err(Unfresh::Stale));
        assert_eq!(seen.take(1, 6, u64::MAX, NOW), Err(Unfresh::Stale));
        // A receiver that started a second ago takes nothing sent before, however fresh.
        let mut restarted = Seen::since(NOW - 1_000);
        assert_eq!(restarted.take(1, 3, NOW - 1_001, NOW), Err(Unfresh::Stale));
        assert_eq!(restarted.take(1, 3, NOW - 1_000, NOW), Ok(()));
    }

    #[test]
    fn senders_are_bounded_and_forgotten_once_all_they_sent_is_stale() {
        let mut seen = Seen::default();
        for origin in 0..MAX_ORIGINS as u64 {
            assert_eq!(seen.take(origin, 1, NOW, NOW), Ok(()));
        }
        assert_eq!(
            seen.take(u64::MAX, 1, NOW, NOW),
            Err(Unfresh::TooManySenders)
        );
        // Twenty seconds on, the senders that fell silent are forgotten; what they sent is stale, so a
        // replay of it is still refused.
        let later = NOW + 2 * FRESH_WITHIN.as_millis() as u64 + 1;
        assert_eq!(seen.take(u64::MAX, 1, later, later), Ok(()));
        assert_eq!(seen.senders(), 1);
        assert_eq!(seen.take(0, 1, NOW, later), Err(Unfresh::Stale));
    }
}

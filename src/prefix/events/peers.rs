//! Other replicas' guesses: where their recent decisions placed a prefix, known by the chain's hashes
//! at the checkpoint depths (`checkpoint.rs`), until `speculative_ttl` passes as for this replica's own.
//!
//! A guess says a worker holds the blocks up to each of its checkpoints, so a request is matched by
//! looking its own chain up at the same depths: at most [`MAX_CHECKPOINTS`] lookups. The table holds at
//! most [`MAX_ENTRIES`] hashes; a new guess makes room by dropping the oldest, which were soonest to
//! expire anyway.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::super::checkpoint::{MAX_CHECKPOINTS, checkpoint_depths};
use crate::worker::WorkerId;

/// Hashes held at once: at 48 checkpoints a guess, 5,000 guesses in flight.
pub const MAX_ENTRIES: usize = 1 << 18;

#[derive(Debug, Default)]
pub(super) struct PeerGuesses {
    /// A checkpoint hash → the workers guessed to hold it, each with its live guesses' count.
    held: HashMap<u64, Vec<(WorkerId, u32)>>,
    expiry: VecDeque<(Instant, WorkerId, Box<[u64]>)>,
    entries: usize,
}

impl PeerGuesses {
    /// Records that `worker` holds the chain whose checkpoint hashes are `checkpoints`, until `until`,
    /// dropping the oldest guesses if the table has no room. `false` for more checkpoints than a guess
    /// has.
    pub(super) fn insert(&mut self, worker: WorkerId, checkpoints: &[u64], until: Instant) -> bool {
        if checkpoints.len() > MAX_CHECKPOINTS {
            return false;
        }
        while self.entries + checkpoints.len() > MAX_ENTRIES {
            let Some((_, oldest, hashes)) = self.expiry.pop_front() else {
                break;
            };
            self.remove(oldest, &hashes);
        }
        for &hash in checkpoints {
            let workers = self.held.entry(hash).or_default();
            match workers.iter_mut().find(|(held, _)| *held == worker) {
                Some((_, count)) => *count += 1,
                None => workers.push((worker, 1)),
            }
        }
        self.entries += checkpoints.len();
        self.expiry.push_back((until, worker, checkpoints.into()));
        true
    }

    /// Forgets the guesses that expired by `now`.
    pub(super) fn expire(&mut self, now: Instant) {
        while self.expiry.front().is_some_and(|(until, ..)| *until <= now) {
            if let Some((_, worker, hashes)) = self.expiry.pop_front() {
                self.remove(worker, &hashes);
            }
        }
    }

    fn remove(&mut self, worker: WorkerId, hashes: &[u64]) {
        for hash in hashes {
            if let Some(workers) = self.held.get_mut(hash) {
                if let Some(at) = workers.iter().position(|(held, _)| *held == worker)
                    && let Some((_, count)) = workers.get_mut(at)
                {
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        workers.swap_remove(at);
                    }
                }
                if workers.is_empty() {
                    self.held.remove(hash);
                }
            }
        }
        self.entries = self.entries.saturating_sub(hashes.len());
    }

    /// Forgets every guess about `worker` (it left, joined or restarted).
    pub(super) fn clear_worker(&mut self, worker: WorkerId) {
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.expiry)
            .into_iter()
            .partition(|(_, held, _)| *held == worker);
        self.expiry = kept;
        for (_, worker, hashes) in gone {
            self.remove(worker, &hashes);
        }
    }

    /// For each worker guessed to hold a prefix of `chain`, the deepest checkpoint depth (in blocks) it
    /// shares with it.
    pub(super) fn deepest(&self, chain: &[u64]) -> Vec<(WorkerId, usize)> {
        let mut found: Vec<(WorkerId, usize)> = Vec::new();
        if self.held.is_empty() {
            return found;
        }
        for depth in checkpoint_depths().take_while(|depth| *depth <= chain.len()) {
            let Some(workers) = chain.get(depth - 1).and_then(|hash| self.held.get(hash)) else {
                continue;
            };
            for (worker, _) in workers {
                match found.iter_mut().find(|(held, _)| held == worker) {
                    Some((_, deepest)) => *deepest = depth,
                    None => found.push((*worker, depth)),
                }
            }
        }
        found
    }

    /// Hashes held now.
    pub(super) fn entries(&self) -> usize {
        self.entries
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::prefix::checkpoints;

    /// Any instant: the table reads no clock.
    #[allow(clippy::disallowed_methods)]
    fn any_instant() -> Instant {
        Instant::now()
    }

    #[test]
    fn a_guess_credits_the_deepest_checkpoint_a_chain_shares_until_it_expires() {
        let start = any_instant();
        let mut guesses = PeerGuesses::default();
        let chain: Vec<u64> = (1..=100).collect();
        assert!(guesses.insert(
            WorkerId(2),
            &checkpoints(&chain),
            start + Duration::from_secs(1)
        ));
        // The same prompt: 96 blocks (the checkpoint at or below 100).
        assert_eq!(guesses.deepest(&chain), [(WorkerId(2), 96)]);
        // A follow-up that extends it: still 96; one that shares 50 blocks: 48.
        let longer: Vec<u64> = (1..=300).collect();
        assert_eq!(guesses.deepest(&longer), [(WorkerId(2), 96)]);
        let diverged: Vec<u64> = (1..=50).chain(1_000..1_100).collect();
        assert_eq!(guesses.deepest(&diverged), [(WorkerId(2), 48)]);
        assert!(guesses.deepest(&[7_000, 7_001]).is_empty());
        // A second guess for the worker on a shorter chain, and one for another worker.
        let short: Vec<u64> = (1..=20).collect();
        guesses.insert(
            WorkerId(2),
            &checkpoints(&short),
            start + Duration::from_secs(2),
        );
        guesses.insert(
            WorkerId(3),
            &checkpoints(&short),
            start + Duration::from_secs(2),
        );
        assert_eq!(
            guesses.deepest(&chain),
            [(WorkerId(2), 96), (WorkerId(3), 20)]
        );
        // The first guess expires; the second still holds the 20 blocks for both.
        guesses.expire(start + Duration::from_secs(1));
        assert_eq!(
            guesses.deepest(&chain),
            [(WorkerId(2), 20), (WorkerId(3), 20)]
        );
        guesses.clear_worker(WorkerId(2));
        assert_eq!(guesses.deepest(&chain), [(WorkerId(3), 20)]);
        guesses.expire(start + Duration::from_secs(2));
        assert!(guesses.deepest(&chain).is_empty());
        assert_eq!(guesses.entries(), 0);
        assert!(guesses.held.is_empty());
    }

    #[test]
    fn the_table_is_bounded_and_a_new_guess_drops_the_oldest() {
        let until = any_instant() + Duration::from_secs(1);
        let mut guesses = PeerGuesses::default();
        let fits = MAX_ENTRIES / MAX_CHECKPOINTS;
        for guess in 0..fits as u64 {
            let checkpoints: Vec<u64> = (0..MAX_CHECKPOINTS as u64)
                .map(|n| guess << 8 | n)
                .collect();
            assert!(guesses.insert(WorkerId(0), &checkpoints, until));
        }
        assert_eq!(guesses.entries(), MAX_ENTRIES);
        assert_eq!(
            guesses.deepest(&[0]),
            [(WorkerId(0), 1)],
            "the oldest guess is there"
        );
        assert!(guesses.insert(WorkerId(1), &[7_000_000_000], until));
        assert_eq!(guesses.entries(), MAX_ENTRIES - MAX_CHECKPOINTS + 1);
        assert!(
            guesses.deepest(&[0]).is_empty(),
            "the oldest guess made room"
        );
        assert_eq!(guesses.deepest(&[7_000_000_000]), [(WorkerId(1), 1)]);
        assert!(!guesses.insert(WorkerId(1), &[0; MAX_CHECKPOINTS + 1], until));
    }
}

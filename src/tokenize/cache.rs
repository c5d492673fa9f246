//! The segment cache: tokens of recently seen prompt segments, keyed by a hash of their exact text.
//!
//! A segment's tokens depend only on the tokenizer, on whether the tokenizer adds its own special
//! tokens, and on the segment's text, so the key hashes exactly those (the text is fed piece by piece,
//! so a turn is looked up without first joining its header and content parts). The key is a 128-bit
//! xxh3, and each entry keeps its text, compared on every hit: xxh3 is not built to resist a client
//! crafting two texts with one key, and a collision would hand one tenant's request another's tokens.
//! The text costs about as much memory as the tokens and is counted in the same budget.
//!
//! The LRU is split into shards, each behind its own mutex, so concurrent requests rarely wait on one
//! another; a lock is held only to look up or insert, never while tokenizing. Two requests that miss the
//! same segment at once both tokenize it, and the second insert replaces the first with equal tokens.
//! Memory is bounded twice: by entries (`segment_cache_entries`) and by 4-byte units (a token, or four
//! bytes of text), at [`TOKENS_PER_ENTRY`] per entry on average (32 MiB per pool at the default 16,384
//! entries). A segment
//! longer than an eighth of its shard's token budget is not cached at all, so one huge prompt — or a
//! client sending many — cannot flush the conversations the cache exists for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hashlink::LruCache;
use xxhash_rust::xxh3::Xxh3;

use super::Mode;

/// Enough shards that a busy pool's request threads seldom meet on one lock.
const SHARDS: usize = 16;

/// The average segment the token budget allows for: a long chat turn.
pub(super) const TOKENS_PER_ENTRY: usize = 512;

/// One shard: its LRU and the units (tokens plus text) it holds.
struct Shard {
    lru: LruCache<u128, Entry>,
    tokens: usize,
}

/// A cached segment: its exact text, checked on a hit, and its tokens.
struct Entry {
    text: Box<str>,
    tokens: Arc<[u32]>,
}

impl Entry {
    /// What the entry costs against the budget, in 4-byte units.
    fn cost(&self) -> usize {
        self.tokens
            .len()
            .saturating_add(self.text.len().div_ceil(4))
    }

    /// Whether the text is `pieces` joined, without joining them.
    fn is(&self, pieces: &[&str]) -> bool {
        let mut rest = self.text.as_bytes();
        for piece in pieces {
            match rest.strip_prefix(piece.as_bytes()) {
                Some(after) => rest = after,
                None => return false,
            }
        }
        rest.is_empty()
    }
}

/// How often the cache answered, since the pool's tokenizer was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segments whose tokens came from the cache.
    pub hits: u64,
    /// Segments that were tokenized (and then cached).
    pub misses: u64,
    /// Bytes the cached tokens and texts take (4 per unit of the budget), not counting the maps' own
    /// overhead.
    pub bytes: u64,
}

pub(super) struct SegmentCache {
    /// Mixed into every key: the tokenizer's identity, so equal text under two tokenizers never shares
    /// an entry even if a cache were shared.
    seed: u64,
    shards: Box<[Mutex<Shard>]>,
    /// Tokens each shard may hold.
    shard_tokens: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl SegmentCache {
    /// A cache of about `capacity` entries in total, spread evenly over the shards.
    pub(super) fn new(capacity: usize, seed: u64) -> Self {
        let shards = SHARDS.min(capacity).max(1);
        let per_shard = capacity.div_ceil(shards).max(1);
        SegmentCache {
            seed,
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        lru: LruCache::new(per_shard),
                        tokens: 0,
                    })
                })
                .collect(),
            shard_tokens: per_shard.saturating_mul(TOKENS_PER_ENTRY),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The key of the segment whose text is `pieces` joined, tokenized in `mode`.
    pub(super) fn key(&self, mode: Mode, pieces: &[&str]) -> u128 {
        let mut hasher = Xxh3::with_seed(self.seed);
        hasher.update(&[mode as u8]);
        for piece in pieces {
            hasher.update(piece.as_bytes());
        }
        hasher.digest128()
    }

    /// The cached tokens for `key`, whose text is `pieces` joined, counting the hit or miss. An entry
    /// under the key with another text is a collision: a miss.
    pub(super) fn get(&self, key: u128, pieces: &[&str]) -> Option<Arc<[u32]>> {
        let found = self
            .with_shard(key, |shard| {
                shard
                    .lru
                    .get(&key)
                    .filter(|entry| entry.is(pieces))
                    .map(|entry| Arc::clone(&entry.tokens))
            })
            .flatten();
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Caches `tokens` unless the segment is too long to be worth its share of the budget, evicting the
    /// least recently used entries until the shard is within both of its bounds.
    pub(super) fn insert(&self, key: u128, text: &str, tokens: Arc<[u32]>) {
        let budget = self.shard_tokens;
        let entry = Entry {
            text: text.into(),
            tokens,
        };
        let len = entry.cost();
        if len > budget / 8 {
            return;
        }
        self.with_shard(key, |shard| {
            if let Some(old) = shard.lru.remove(&key) {
                shard.tokens = shard.tokens.saturating_sub(old.cost());
            }
            while shard.lru.len() >= shard.lru.capacity()
                || shard.tokens.saturating_add(len) > budget
            {
                match shard.lru.remove_lru() {
                    Some((_, evicted)) => {
                        shard.tokens = shard.tokens.saturating_sub(evicted.cost());
                    }
                    None => break,
                }
            }
            shard.lru.insert(key, entry);
            shard.tokens = shard.tokens.saturating_add(len);
        });
    }

    /// Tokens held across all shards.
    #[cfg(test)]
    pub(super) fn held_tokens(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().unwrap_or_else(PoisonError::into_inner).tokens)
            .sum()
    }

    pub(super) fn stats(&self) -> CacheStats {
        let units: usize = self
            .shards
            .iter()
            .map(|shard| shard.lock().unwrap_or_else(PoisonError::into_inner).tokens)
            .sum();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: u64::try_from(units).unwrap_or(u64::MAX).saturating_mul(4),
        }
    }

    /// Runs `f` on the shard that holds `key`, under its lock.
    fn with_shard<R>(&self, key: u128, f: impl FnOnce(&mut Shard) -> R) -> Option<R> {
        // The high bits pick the shard; the shard's own table hashes the whole key.
        let high = usize::try_from(key >> 96).unwrap_or_default();
        let shard = self.shards.get(high % self.shards.len().max(1))?;
        // A panic while the lock was held cannot leave an entry half-written (each use is one LRU
        // call), so a poisoned shard is still a good cache.
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        Some(f(&mut shard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_holds_no_more_tokens_than_its_budget_and_skips_huge_segments() {
        let cache = SegmentCache::new(16, 7);
        // One entry per shard, 512 tokens per shard.
        let huge: Arc<[u32]> = vec![1; 65].into();
        cache.insert(
            cache.key(Mode::Segment, &["huge"]),
            "huge",
            Arc::clone(&huge),
        );
        assert_eq!(
            cache.held_tokens(),
            0,
            "longer than an eighth of a shard's budget"
        );
        for i in 0..200 {
            let text = format!("segment {i}");
            let tokens: Arc<[u32]> = vec![2; 60].into();
            cache.insert(cache.key(Mode::Segment, &[text.as_str()]), &text, tokens);
        }
        assert!(cache.held_tokens() <= 16 * TOKENS_PER_ENTRY);
        // 60 tokens and up to 11 bytes of text (3 units) an entry, one entry per shard.
        assert!(cache.held_tokens() <= 16 * 63, "one entry per shard");
        let last = cache.key(Mode::Segment, &["segment 199"]);
        assert!(
            cache.get(last, &["segment ", "199"]).is_some(),
            "the newest entry survives"
        );
    }

    #[test]
    fn a_hit_needs_the_same_text_not_only_the_same_key() {
        let cache = SegmentCache::new(64, 1);
        let key = cache.key(Mode::Segment, &["tenant a's prompt"]);
        cache.insert(key, "tenant a's prompt", vec![1, 2, 3].into());
        // A key collided on purpose (stood in for by reusing the key with another text) is a miss.
        assert!(cache.get(key, &["tenant b's prompt"]).is_none());
        assert!(cache.get(key, &["tenant a's prompt", "!"]).is_none());
        assert!(cache.get(key, &["tenant a's"]).is_none());
        assert_eq!(
            cache.get(key, &["tenant a", "'s prompt"]).as_deref(),
            Some(&[1, 2, 3][..])
        );
    }

    #[test]
    fn replacing_an_entry_does_not_count_its_tokens_twice() {
        let cache = SegmentCache::new(64, 1);
        let key = cache.key(Mode::Prompt, &["same"]);
        for _ in 0..10 {
            cache.insert(key, "same", vec![3; 40].into());
        }
        assert_eq!(cache.held_tokens(), 41);
    }
}

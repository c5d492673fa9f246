//! The segment cache: tokens of recently seen prompt segments, keyed by a hash of their exact text.
//!
//! A segment's tokens depend only on the tokenizer, on whether the tokenizer adds its own special
//! tokens, and on the segment's text, so the key hashes exactly those (the text is fed piece by piece,
//! so a turn is looked up without first joining its header and content parts). The key is a 128-bit
//! xxh3: with a few thousand entries per pool a collision, which would hand back another segment's
//! tokens, is out of reach, and no text is kept to compare against.
//!
//! The LRU is split into shards, each behind its own mutex, so concurrent requests rarely wait on one
//! another; a lock is held only to look up or insert, never while tokenizing. Two requests that miss the
//! same segment at once both tokenize it, and the second insert replaces the first with equal tokens.
//! The bound is a number of entries, not bytes: memory is about entries × mean segment length × 4 bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hashlink::LruCache;
use xxhash_rust::xxh3::Xxh3;

use super::Mode;

/// Enough shards that a busy pool's request threads seldom meet on one lock.
const SHARDS: usize = 16;

type Lru = LruCache<u128, Arc<[u32]>>;

/// How often the cache answered, since the pool's tokenizer was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segments whose tokens came from the cache.
    pub hits: u64,
    /// Segments that were tokenized (and then cached).
    pub misses: u64,
}

pub(super) struct SegmentCache {
    /// Mixed into every key: the tokenizer's identity, so equal text under two tokenizers never shares
    /// an entry even if a cache were shared.
    seed: u64,
    shards: Box<[Mutex<Lru>]>,
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
                .map(|_| Mutex::new(LruCache::new(per_shard)))
                .collect(),
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

    /// The cached tokens for `key`, counting the hit or miss.
    pub(super) fn get(&self, key: u128) -> Option<Arc<[u32]>> {
        let found = self.with_shard(key, |lru| lru.get(&key).cloned()).flatten();
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    pub(super) fn insert(&self, key: u128, tokens: Arc<[u32]>) {
        self.with_shard(key, |lru| lru.insert(key, tokens));
    }

    pub(super) fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` on the shard that holds `key`, under its lock.
    fn with_shard<R>(&self, key: u128, f: impl FnOnce(&mut Lru) -> R) -> Option<R> {
        // The high bits pick the shard; the shard's own table hashes the whole key.
        let high = usize::try_from(key >> 96).unwrap_or_default();
        let shard = self.shards.get(high % self.shards.len().max(1))?;
        // A panic while the lock was held cannot leave an entry half-written (each use is one LRU
        // call), so a poisoned shard is still a good cache.
        let mut lru = shard.lock().unwrap_or_else(PoisonError::into_inner);
        Some(f(&mut lru))
    }
}

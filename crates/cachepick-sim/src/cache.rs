//! One rank's KV block cache, the same under both timing models: the chained hashes that name a
//! prompt's full blocks, the cached blocks by hash with the number of requests that pin them, the
//! unpinned ones in LRU order (free, but reusable until evicted), the anonymous blocks requests hold
//! that are not cached (a prompt's partial last block, output blocks, a block a chunk only began), and
//! the KV cache events an engine would publish for what changed.
//!
//! As in vLLM's block pool, a cached block nobody pins counts as free: an allocation takes truly free
//! blocks first and evicts the least recently released cached ones for the rest. A request holds its
//! blocks in sequence order, so the cached ones are always a prefix of what it holds. A block is cached
//! once the tokens that fill it are allocated for computation, never before: a prefill cut short by an
//! abort or a preemption leaves no half-computed block for another request to hit. The slots model
//! ([`crate::model`]) allocates a request's whole prompt and output at admission, the step model
//! ([`crate::step`]) chunk by chunk.
//!
//! The simulator hashes on its own (64-bit FNV-1a), sharing no code with the picker it is meant to test.

use std::num::NonZeroU32;

use hashlink::LinkedHashSet;
use rustc_hash::{FxBuildHasher, FxHashMap};

/// FNV-1a 64-bit offset basis.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// Parent hash of every prompt's first block ("sim-root" in ASCII), so the first block's hash depends
/// on a fixed seed just like every later block depends on its parent.
pub(crate) const ROOT_PARENT: u64 = 0x7369_6d2d_726f_6f74;

/// A change of the KV cache, as an engine reports it in its KV cache events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive full blocks entered the cache: `hashes[i]` covers
    /// `tokens[i * block_size..(i + 1) * block_size]`; `parent` is the hash of the block before the
    /// first one (`None` for a prompt's first block).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    /// Blocks were evicted, in eviction order.
    Removed { hashes: Vec<u64> },
    /// The whole prefix cache was dropped.
    AllCleared,
}

/// The chained hashes of `prompt`'s full blocks, first block first: each names the whole prefix up
/// to the end of its block. A trailing partial block has no hash.
pub fn block_hashes(prompt: &[u32], block_size: NonZeroU32) -> impl Iterator<Item = u64> + '_ {
    let size = usize::try_from(block_size.get()).unwrap_or(usize::MAX);
    prompt
        .chunks_exact(size)
        .scan(ROOT_PARENT, |parent, block| {
            let mut hash = fnv1a(FNV_OFFSET, &parent.to_le_bytes());
            for token in block {
                hash = fnv1a(hash, &token.to_le_bytes());
            }
            *parent = hash;
            Some(hash)
        })
}

/// A prompt as the cache sees it: its length and the chained hashes of its full blocks, worked out
/// once. A router that asks every worker of a fleet about one prompt (the oracle, the re-implemented
/// peers) hashes it once instead of once per worker: on a 64-worker fleet of 15k-token prompts that
/// was most of a replay's time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptBlocks {
    pub hashes: Vec<u64>,
    /// Tokens in the prompt, the trailing partial block's included.
    pub len: u64,
    pub block_size: NonZeroU32,
}

impl PromptBlocks {
    pub fn of(prompt: &[u32], block_size: NonZeroU32) -> PromptBlocks {
        PromptBlocks {
            hashes: block_hashes(prompt, block_size).collect(),
            len: len_u64(prompt.len()),
            block_size,
        }
    }
}

pub(crate) fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// The blocks one request holds: `blocks` in all, of which the first `cached` are its prompt's cached
/// blocks (`hashes[..cached]`) and the rest anonymous.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hold {
    pub blocks: u64,
    pub cached: u64,
}

/// What an allocation for one request needs to know of it.
pub struct Holder<'a> {
    /// The chained hashes of the prompt's full blocks.
    pub hashes: &'a [u64],
    /// The tokens of those blocks, when events are recorded (empty otherwise).
    pub tokens: &'a [u32],
    /// What it holds now.
    pub hold: Hold,
}

#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: NonZeroU32,
    capacity: u64,
    // Keyed by block hashes, which are hashes already: FxHash's one multiply, not SipHash, whose
    // cost was a tenth of a 64-worker replay.
    refs: FxHashMap<u64, u32>,
    lru: LinkedHashSet<u64, FxBuildHasher>,
    anonymous: u64,
    events: Option<Vec<CacheEvent>>,
    /// Cached blocks evicted to make room, since the rank started.
    pub evicted: u64,
}

impl BlockPool {
    pub fn new(block_size: NonZeroU32, capacity: NonZeroU32) -> BlockPool {
        BlockPool {
            block_size,
            capacity: u64::from(capacity.get()),
            refs: FxHashMap::default(),
            lru: LinkedHashSet::with_hasher(FxBuildHasher),
            anonymous: 0,
            events: None,
            evicted: 0,
        }
    }

    pub fn block_size(&self) -> u64 {
        u64::from(self.block_size.get())
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn record_events(&mut self, on: bool) {
        if on != self.events.is_some() {
            self.events = on.then(Vec::new);
        }
    }

    pub fn recording(&self) -> bool {
        self.events.is_some()
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Blocks that cannot be handed out: pinned cached blocks and anonymous ones.
    pub fn pinned(&self) -> u64 {
        len_u64(self.refs.len().saturating_sub(self.lru.len())).saturating_add(self.anonymous)
    }

    /// Blocks holding something: cached (pinned or not) and anonymous.
    pub fn used(&self) -> u64 {
        len_u64(self.refs.len()).saturating_add(self.anonymous)
    }

    /// Blocks an allocation could get now: truly free plus evictable.
    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.pinned())
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size())
    }

    /// Leading blocks of `hashes` in the cache, at most `cap`.
    pub fn hit_blocks(&self, hashes: &[u64], cap: u64) -> u64 {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        len_u64(
            hashes
                .iter()
                .take(cap)
                .take_while(|hash| self.refs.contains_key(hash))
                .count(),
        )
    }

    /// Makes `holder` hold enough blocks for `tokens` computed tokens: the blocks those tokens fill are
    /// cached (pinned where another request already cached them, inserted otherwise, an anonymous
    /// block it filled turned into a cached one), the block they only begin and any beyond the
    /// prompt's full blocks anonymous; new blocks come from the free space, evicting for the rest. All
    /// or nothing: `None`, and nothing changed, when they do not fit. Returns what it holds afterwards.
    pub fn grow(&mut self, holder: &Holder<'_>, tokens: u64) -> Option<Hold> {
        let Hold {
            blocks: held,
            cached,
        } = holder.hold;
        let want = self.blocks_for(tokens).max(held);
        let full = (tokens / self.block_size())
            .min(len_u64(holder.hashes.len()))
            .max(cached);
        if want == held && full == cached {
            return Some(holder.hold);
        }
        let start = usize::try_from(cached).unwrap_or(usize::MAX);
        let end = usize::try_from(full).unwrap_or(usize::MAX);
        let newly_cached = holder.hashes.get(start..end).unwrap_or_default();
        // Each newly cached block is either one it held anonymously (turned, below `held`) or a new one.
        let mut fresh = 0u64;
        let mut freed = 0u64;
        let mut from_lru = 0u64;
        for (offset, hash) in newly_cached.iter().enumerate() {
            let turned = len_u64(start.saturating_add(offset)) < held;
            match self.refs.get(hash) {
                // Someone cached it meanwhile: pin theirs, and an anonymous copy of it is freed.
                Some(count) => {
                    from_lru += u64::from(*count == 0);
                    freed += u64::from(turned);
                }
                None => fresh += u64::from(!turned),
            }
        }
        let anonymous = want.saturating_sub(held.max(full));
        let needed = fresh.saturating_add(anonymous);
        let reclaimable = len_u64(self.lru.len()).saturating_sub(from_lru);
        if self.used().saturating_add(needed)
            > self
                .capacity
                .saturating_add(reclaimable)
                .saturating_add(freed)
        {
            return None;
        }
        let mut inserted = Vec::new();
        for (offset, hash) in newly_cached.iter().enumerate() {
            let index = start.saturating_add(offset);
            if let Some(count) = self.refs.get_mut(hash) {
                if *count == 0 {
                    self.lru.remove(hash);
                }
                *count = count.saturating_add(1);
                if len_u64(index) < held {
                    self.anonymous = self.anonymous.saturating_sub(1);
                }
            } else {
                inserted.push(index);
            }
        }
        while self.used().saturating_add(needed) > self.capacity && self.evict_one() {}
        let mut stored = Vec::new();
        for index in inserted {
            let Some(hash) = holder.hashes.get(index) else {
                continue;
            };
            // A block repeated within the prompt is inserted once, by its first occurrence.
            let count = self.refs.entry(*hash).or_insert(0);
            if *count == 0 {
                stored.push(index);
                if len_u64(index) < held {
                    // The anonymous block it filled is the cached one now.
                    self.anonymous = self.anonymous.saturating_sub(1);
                }
            } else if len_u64(index) < held {
                self.anonymous = self.anonymous.saturating_sub(1);
            }
            *count = count.saturating_add(1);
        }
        self.anonymous = self.anonymous.saturating_add(anonymous);
        self.record_stored(holder, &stored);
        Some(Hold {
            blocks: want,
            cached: full,
        })
    }

    /// Releases every block a request holds: cached ones tail first (so a prompt's tail is evicted
    /// before its head), anonymous ones freed.
    pub fn release(&mut self, hashes: &[u64], hold: Hold) {
        let cached = usize::try_from(hold.cached).unwrap_or(usize::MAX);
        for hash in hashes.get(..cached).unwrap_or(hashes).iter().rev() {
            if let Some(count) = self.refs.get_mut(hash) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.lru.insert(*hash);
                }
            }
        }
        self.anonymous = self
            .anonymous
            .saturating_sub(hold.blocks.saturating_sub(hold.cached));
        self.trim();
    }

    /// A new capacity; evicts unpinned blocks down to it.
    pub fn set_capacity(&mut self, capacity: NonZeroU32) {
        self.capacity = u64::from(capacity.get());
        self.trim();
    }

    /// Drops every cached block nobody pins; false (and nothing dropped) while any is pinned.
    pub fn reset(&mut self) -> bool {
        if self.pinned() > 0 {
            return false;
        }
        self.refs.clear();
        self.lru.clear();
        if let Some(events) = &mut self.events {
            events.push(CacheEvent::AllCleared);
        }
        true
    }

    fn trim(&mut self) {
        while self.used() > self.capacity && self.evict_one() {}
    }

    fn evict_one(&mut self) -> bool {
        let Some(hash) = self.lru.pop_front() else {
            return false;
        };
        self.refs.remove(&hash);
        self.evicted = self.evicted.saturating_add(1);
        if let Some(events) = &mut self.events {
            match events.last_mut() {
                Some(CacheEvent::Removed { hashes }) => hashes.push(hash),
                _ => events.push(CacheEvent::Removed { hashes: vec![hash] }),
            }
        }
        true
    }

    /// One `Stored` per run of consecutive newly cached blocks (`stored` ascending indices).
    fn record_stored(&mut self, holder: &Holder<'_>, stored: &[usize]) {
        let Some(events) = &mut self.events else {
            return;
        };
        let size = usize::try_from(self.block_size.get()).unwrap_or(usize::MAX);
        let mut rest = stored;
        while let Some((&start, _)) = rest.split_first() {
            let run = rest
                .iter()
                .enumerate()
                .take_while(|(offset, index)| **index == start.saturating_add(*offset))
                .count();
            let end = start.saturating_add(run);
            events.push(CacheEvent::Stored {
                hashes: holder.hashes.get(start..end).unwrap_or_default().to_vec(),
                parent: start
                    .checked_sub(1)
                    .and_then(|before| holder.hashes.get(before))
                    .copied(),
                tokens: holder
                    .tokens
                    .get(start.saturating_mul(size)..end.saturating_mul(size))
                    .unwrap_or_default()
                    .to_vec(),
            });
            rest = rest.get(run..).unwrap_or_default();
        }
    }

    #[cfg(test)]
    pub fn check(&self) {
        let zero = self.refs.values().filter(|count| **count == 0).count();
        assert_eq!(zero, self.lru.len());
        for hash in self.lru.iter() {
            assert_eq!(self.refs.get(hash), Some(&0));
        }
        assert!(self.pinned() <= self.capacity.max(self.pinned()));
    }

    #[cfg(test)]
    pub fn pins(&self) -> u64 {
        self.refs.values().map(|count| u64::from(*count)).sum()
    }

    #[cfg(test)]
    pub fn anonymous(&self) -> u64 {
        self.anonymous
    }

    /// Requests pinning the cached block `hash`; `None` when it is not cached.
    #[cfg(test)]
    pub fn refcount(&self, hash: u64) -> Option<u32> {
        self.refs.get(&hash).copied()
    }

    /// Every cached block's hash.
    #[cfg(test)]
    pub fn cached(&self) -> impl Iterator<Item = u64> + '_ {
        self.refs.keys().copied()
    }
}

pub(crate) fn len_u64(len: usize) -> u64 {
    u64::try_from(len).unwrap_or(u64::MAX)
}

//! One worker's blocks in recency order for the owner index: a slab of 16-byte nodes in a circular
//! list (see `index`'s module docs for the memory budget this keeps), and the engine's own hash of
//! each block when the index learns from KV events.

use std::hash::BuildHasher;
use std::num::NonZeroU32;

use hashbrown::HashTable;

use super::keyed::KeyedHash;

/// The most blocks one worker can hold: slots are `u32` and slot 0 is the list's sentinel, and one
/// more block than the capacity exists briefly before its eviction.
pub(super) const MAX_BLOCKS_PER_WORKER: usize = u32::MAX as usize - 2;

/// One worker's blocks in recency order, bounded by its capacity.
///
/// A slab of nodes linked into a circular list through `u32` slots: `nodes[0]` is the sentinel,
/// whose `next` is the most recent block and whose `prev` the least recent. Freed slots are chained
/// through `next` from `free` and reused before the slab grows.
pub(super) struct Lru {
    nodes: Vec<Node>,
    /// First free slot, 0 when none.
    free: u32,
    pub(super) len: usize,
    pub(super) capacity: usize,
    /// The engine's hash of each block, in an index built [`super::OwnerIndex::with_engine_keys`].
    pub(super) engine: Option<EngineKeys>,
}

/// A worker's engine hashes: which slot holds the block an engine hash names.
///
/// `of_slot` runs parallel to the LRU's slab (8 bytes a block) and the table holds one `u32` slot
/// per tag, hashed by the engine hash read back through `of_slot`, so an engine key costs about 13
/// bytes beyond the block's own 16 instead of a map entry of its own.
pub(super) struct EngineKeys {
    of_slot: Vec<u64>,
    table: HashTable<u32>,
    hasher: KeyedHash,
}

impl EngineKeys {
    pub(super) fn new() -> Self {
        EngineKeys {
            of_slot: Vec::new(),
            table: HashTable::new(),
            hasher: KeyedHash::new(),
        }
    }

    /// How many blocks carry an engine hash.
    pub(super) fn tagged(&self) -> usize {
        self.table.len()
    }

    /// The tagged slot of `engine`.
    pub(super) fn find(&self, engine: u64) -> Option<u32> {
        let of_slot = &self.of_slot;
        self.table
            .find(self.hasher.hash_one(engine), |&slot| {
                of_slot.get(slot as usize) == Some(&engine)
            })
            .copied()
    }

    pub(super) fn tag(&mut self, slot: u32, engine: u64) {
        self.untag(slot);
        if let Some(other) = self.find(engine) {
            self.untag(other);
        }
        let at = slot as usize;
        if self.of_slot.len() <= at {
            self.of_slot.resize(at + 1, 0);
        }
        if let Some(entry) = self.of_slot.get_mut(at) {
            *entry = engine;
        }
        let Self {
            of_slot,
            table,
            hasher,
        } = self;
        table.insert_unique(hasher.hash_one(engine), slot, |&slot| {
            hasher.hash_one(of_slot.get(slot as usize).copied().unwrap_or(0))
        });
    }

    fn untag(&mut self, slot: u32) {
        let Some(&engine) = self.of_slot.get(slot as usize) else {
            return;
        };
        if let Ok(entry) = self
            .table
            .find_entry(self.hasher.hash_one(engine), |&tagged| tagged == slot)
        {
            entry.remove();
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct Node {
    pub(super) hash: u64,
    prev: u32,
    next: u32,
}

// The memory budget rests on these sizes (see the module docs).
const _: () = assert!(size_of::<Node>() == 16);

const SENTINEL: u32 = 0;

impl Lru {
    pub(super) fn new(capacity: usize) -> Self {
        Lru {
            nodes: vec![Node {
                hash: 0,
                prev: SENTINEL,
                next: SENTINEL,
            }],
            free: SENTINEL,
            len: 0,
            capacity: capacity.min(MAX_BLOCKS_PER_WORKER),
            engine: None,
        }
    }

    /// Tags `slot` with the engine hash `engine`.
    pub(super) fn tag(&mut self, slot: u32, engine: u64) {
        let reserved = self.nodes.capacity();
        if let Some(keys) = &mut self.engine {
            // Sized like the slab, so the tags cost 8 bytes a block rather than a doubling's waste.
            if keys.of_slot.capacity() < reserved {
                keys.of_slot
                    .reserve_exact(reserved.saturating_sub(keys.of_slot.len()));
            }
            keys.tag(slot, engine);
        }
    }

    /// Removes the block in `slot`, wherever it is in the order.
    pub(super) fn remove(&mut self, slot: u32) {
        if slot == SENTINEL || self.node(slot).is_none() {
            return;
        }
        self.unlink(slot);
        self.release_slot(slot);
    }

    /// Puts an unlinked `slot` on the free list and drops its tag.
    fn release_slot(&mut self, slot: u32) {
        if let Some(keys) = &mut self.engine {
            keys.untag(slot);
        }
        let free = self.free;
        if let Some(node) = self.nodes.get_mut(slot as usize) {
            node.next = free;
        }
        self.free = slot;
        self.len = self.len.saturating_sub(1);
    }

    /// Adds `hash` as the most recent block and returns its slot.
    pub(super) fn push(&mut self, hash: u64) -> Option<NonZeroU32> {
        let slot = if self.free != SENTINEL {
            let slot = self.free;
            let node = self.nodes.get_mut(slot as usize)?;
            self.free = node.next;
            node.hash = hash;
            slot
        } else {
            let slot = u32::try_from(self.nodes.len()).ok()?;
            self.reserve_one();
            self.nodes.push(Node {
                hash,
                prev: SENTINEL,
                next: SENTINEL,
            });
            slot
        };
        self.link_front(slot);
        self.len += 1;
        NonZeroU32::new(slot)
    }

    /// Makes the block in `slot` the most recent.
    pub(super) fn touch(&mut self, slot: NonZeroU32) {
        self.unlink(slot.get());
        self.link_front(slot.get());
    }

    /// Removes the least recent block and returns its hash.
    pub(super) fn pop_oldest(&mut self) -> Option<u64> {
        let slot = self.node(SENTINEL)?.prev;
        if slot == SENTINEL {
            return None;
        }
        self.unlink(slot);
        let hash = self.node(slot)?.hash;
        self.release_slot(slot);
        Some(hash)
    }

    /// Grows the slab geometrically, but never past what the capacity can use, so that a full
    /// worker's list costs 16 bytes per block rather than up to twice that.
    fn reserve_one(&mut self) {
        let len = self.nodes.len();
        if len < self.nodes.capacity() {
            return;
        }
        // The sentinel, the capacity, and one block about to be evicted.
        let limit = self.capacity.saturating_add(2);
        let target = len.saturating_mul(2).max(16).min(limit).max(len + 1);
        self.nodes.reserve_exact(target - len);
    }

    fn link_front(&mut self, slot: u32) {
        let Some(first) = self.node(SENTINEL).map(|sentinel| sentinel.next) else {
            return;
        };
        if let Some(node) = self.nodes.get_mut(slot as usize) {
            node.prev = SENTINEL;
            node.next = first;
        }
        if let Some(first) = self.nodes.get_mut(first as usize) {
            first.prev = slot;
        }
        if let Some(sentinel) = self.nodes.get_mut(SENTINEL as usize) {
            sentinel.next = slot;
        }
    }

    fn unlink(&mut self, slot: u32) {
        let Some(&Node { prev, next, .. }) = self.node(slot) else {
            return;
        };
        if let Some(prev) = self.nodes.get_mut(prev as usize) {
            prev.next = next;
        }
        if let Some(next) = self.nodes.get_mut(next as usize) {
            next.prev = prev;
        }
    }

    pub(super) fn node(&self, slot: u32) -> Option<&Node> {
        self.nodes.get(slot as usize)
    }

    /// Every block's hash, least recent first: the order a sibling replays them in to rebuild the
    /// same list (`OwnerIndex::adopt`).
    pub(super) fn oldest_first(&self) -> Vec<u64> {
        let mut order = Vec::with_capacity(self.len);
        let mut slot = self
            .node(SENTINEL)
            .map_or(SENTINEL, |sentinel| sentinel.prev);
        // Bounded by the slab, so a corrupt link cannot loop.
        while slot != SENTINEL && order.len() < self.nodes.len() {
            let Some(node) = self.node(slot) else {
                break;
            };
            order.push(node.hash);
            slot = node.prev;
        }
        order
    }
}

#[cfg(test)]
impl Lru {
    /// `(slot, hash)` of every block, most recent first: what the index's consistency checks walk.
    pub(super) fn in_order(&self) -> Vec<(u32, u64)> {
        let mut order = Vec::new();
        let mut slot = self
            .node(SENTINEL)
            .map_or(SENTINEL, |sentinel| sentinel.next);
        while slot != SENTINEL && order.len() < self.nodes.len() {
            let node = self.node(slot).copied().unwrap();
            order.push((slot, node.hash));
            slot = node.next;
        }
        order
    }

    /// The slab's slots in use (the sentinel included) and allocated.
    pub(super) fn slab(&self) -> (usize, usize) {
        (self.nodes.len(), self.nodes.capacity())
    }
}

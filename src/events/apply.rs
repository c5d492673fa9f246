//! A decoded batch → the pool's [`EventIndex`], for one stream.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::stream::{ResetReason, Stream};
use super::{EventBatch, KvEvent, Medium};
use crate::prefix::{EventIndex, Slot, prefix_seed};

/// Applies one stream's batches to its slot of the pool's index.
pub struct Applier {
    index: Arc<EventIndex>,
    slot: Slot,
    /// The model a prompt's first block is chained under when the event names no adapter: the
    /// pool's, exactly as a request to the pool is chained.
    model: String,
    stream: Arc<Stream>,
}

impl Applier {
    pub fn new(index: Arc<EventIndex>, slot: Slot, model: String, stream: Arc<Stream>) -> Self {
        Applier {
            index,
            slot,
            model,
            stream,
        }
    }

    pub fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// Applies every event of `batch`, in order.
    pub fn apply(&self, batch: &EventBatch) {
        let stream = &self.stream;
        stream.batches.fetch_add(1, Ordering::Relaxed);
        stream
            .events
            .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
        stream
            .unknown_events
            .fetch_add(batch.unknown_events.into(), Ordering::Relaxed);
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    let count = stored.hashes.len() as u64;
                    if stored.block_size > 0 {
                        stream
                            .engine_block_size
                            .store(stored.block_size, Ordering::Relaxed);
                    }
                    stream.add_tier(stored.medium, count as i64);
                    if stored.medium != Medium::Gpu {
                        continue;
                    }
                    if stored.opaque_extra_keys {
                        stream.opaque.fetch_add(count, Ordering::Relaxed);
                        continue;
                    }
                    let model = stored.lora_name.as_deref().unwrap_or(&self.model);
                    let seed = prefix_seed(model, stored.cache_salt.as_deref());
                    // `block_size` tokens a block; the decoder guarantees a positive size.
                    let size = usize::try_from(stored.block_size.max(1)).unwrap_or(usize::MAX);
                    let blocks = stored
                        .hashes
                        .iter()
                        .copied()
                        .zip(stored.tokens.chunks(size));
                    let outcome = self.index.store(self.slot, seed, stored.parent, blocks);
                    stream
                        .blocks_stored
                        .fetch_add(outcome.blocks, Ordering::Relaxed);
                    stream.orphans.fetch_add(outcome.orphans, Ordering::Relaxed);
                    stream
                        .over_bound
                        .fetch_add(outcome.over_bound, Ordering::Relaxed);
                }
                KvEvent::BlockRemoved { hashes, medium } => {
                    stream.add_tier(*medium, -(hashes.len() as i64));
                    if *medium == Medium::Gpu {
                        let known = self.index.remove(self.slot, hashes);
                        stream.blocks_removed.fetch_add(known, Ordering::Relaxed);
                    }
                }
                KvEvent::AllBlocksCleared => self.reset(ResetReason::Cleared),
            }
        }
    }

    /// Forgets everything the stream's rank held.
    pub fn reset(&self, reason: ResetReason) {
        self.index.clear(self.slot);
        self.stream.count_reset(reason);
    }
}

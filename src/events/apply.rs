//! A decoded batch → the pool's [`EventIndex`], for one stream.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use super::stream::{ResetReason, Stream};
use super::{EventBatch, KvEvent, Medium};
use crate::load::PoolLoad;
use crate::prefix::{EventIndex, Slot, prefix_seed};
use crate::worker::WorkerId;

/// Applies one stream's batches to its slot of the pool's index.
pub struct Applier {
    index: Arc<EventIndex>,
    slot: Slot,
    /// The model a prompt's first block is chained under when the event names no adapter: the
    /// pool's, exactly as a request to the pool is chained.
    model: String,
    stream: Arc<Stream>,
    /// Where a restart the stream sees is reported, once the pool's scraper runs (the scraper marks
    /// the worker `restarted` as it does for a restart seen in a scrape), and every batch as a sign of
    /// the worker's life (a scrape that times out meanwhile is late, not unanswered).
    load: Option<(Arc<OnceLock<Arc<PoolLoad>>>, WorkerId)>,
}

impl Applier {
    pub fn new(index: Arc<EventIndex>, slot: Slot, model: String, stream: Arc<Stream>) -> Self {
        Applier {
            index,
            slot,
            model,
            stream,
            load: None,
        }
    }

    /// Reports a restart of `worker`, and each batch as a sign of its life, to the pool load `load`
    /// holds (when it holds one).
    pub fn reporting_to(mut self, load: Arc<OnceLock<Arc<PoolLoad>>>, worker: WorkerId) -> Self {
        self.load = Some((load, worker));
        self
    }

    fn pool_load(&self) -> Option<(&PoolLoad, WorkerId)> {
        let (load, worker) = self.load.as_ref()?;
        Some((load.get()?, *worker))
    }

    pub fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// Applies every event of `batch`, in order.
    pub fn apply(&self, batch: &EventBatch) {
        if let Some((load, worker)) = self.pool_load() {
            load.heard_from(worker, std::time::Instant::now());
        }
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

    /// Stops (or resumes) crediting the rank with what it held; see `EventIndex::suspend`.
    pub fn suspend(&self, suspended: bool) {
        self.index.suspend(self.slot, suspended);
    }

    /// Forgets everything the stream's rank held.
    pub fn reset(&self, reason: ResetReason) {
        self.index.clear(self.slot);
        self.stream.count_reset(reason);
        if reason == ResetReason::Restart
            && let Some((load, worker)) = self.pool_load()
        {
            load.report_restart(worker);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::events::{BlockStored, EventBatch};
    use crate::prefix::block_hashes;
    use crate::worker::WorkerId;

    fn applier() -> (Applier, Arc<EventIndex>) {
        let index = Arc::new(EventIndex::new(
            &[1],
            &[100],
            NonZeroU32::new(4).unwrap(),
            Duration::ZERO,
        ));
        let slot = index.slot(WorkerId(0), 0).unwrap();
        let stream = Arc::new(Stream::new(
            WorkerId(0),
            0,
            "127.0.0.1:5557".parse().unwrap(),
            None,
        ));
        (
            Applier::new(Arc::clone(&index), slot, "m".to_owned(), stream),
            index,
        )
    }

    fn stored(tokens: &[u32]) -> BlockStored {
        BlockStored {
            hashes: (0..tokens.len().div_ceil(4) as u64).collect(),
            parent: None,
            tokens: tokens.to_vec(),
            block_size: 4,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            opaque_extra_keys: false,
        }
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            rank: Some(0),
            unknown_events: 0,
        }
    }

    /// Tokens the index credits worker 0 with for `tokens` under `model` and `salt`.
    fn depth(index: &EventIndex, model: &str, salt: Option<&str>, tokens: &[u32]) -> u64 {
        let hashes = block_hashes(
            prefix_seed(model, salt),
            tokens,
            NonZeroU32::new(4).unwrap(),
        );
        index
            .matches(&hashes, Instant::now())
            .first()
            .map_or(0, |found| found.matched_tokens)
    }

    const TOKENS: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    #[test]
    fn a_salted_or_adapter_chain_matches_only_requests_with_that_salt_or_adapter() {
        let (applier, index) = applier();
        let mut salted = stored(&TOKENS);
        salted.cache_salt = Some("tenant".to_owned());
        let mut adapter = stored(&[9, 9, 9, 9]);
        adapter.hashes = vec![50];
        adapter.lora_name = Some("sql-lora".to_owned());
        applier.apply(&batch(vec![
            KvEvent::BlockStored(salted),
            KvEvent::BlockStored(adapter),
        ]));
        assert_eq!(depth(&index, "m", Some("tenant"), &TOKENS), 8);
        assert_eq!(depth(&index, "m", None, &TOKENS), 0);
        assert_eq!(depth(&index, "sql-lora", None, &[9, 9, 9, 9]), 4);
        assert_eq!(depth(&index, "m", None, &[9, 9, 9, 9]), 0);
    }

    #[test]
    fn only_gpu_blocks_make_an_owner_and_every_tier_is_counted() {
        let (applier, index) = applier();
        let mut cpu = stored(&TOKENS);
        cpu.medium = Medium::Cpu;
        let mut opaque = stored(&[7, 7, 7, 7]);
        opaque.opaque_extra_keys = true;
        applier.apply(&batch(vec![
            KvEvent::BlockStored(cpu),
            KvEvent::BlockStored(opaque),
        ]));
        assert_eq!(depth(&index, "m", None, &TOKENS), 0);
        assert_eq!(depth(&index, "m", None, &[7, 7, 7, 7]), 0);
        let view = applier.stream().view(Instant::now());
        assert_eq!(view.tiers[0], (Medium::Gpu, 1));
        assert_eq!(view.tiers[1], (Medium::Cpu, 2));
        assert_eq!(view.opaque, 1);
        applier.apply(&batch(vec![KvEvent::BlockRemoved {
            hashes: vec![0, 1, 2],
            medium: Medium::Cpu,
        }]));
        // There is no negative cache: a removal of blocks stored before the subscription stops at 0.
        assert_eq!(
            applier.stream().view(Instant::now()).tiers[1],
            (Medium::Cpu, 0)
        );
    }

    #[test]
    fn all_blocks_cleared_forgets_the_rank_and_counts_a_reset() {
        let (applier, index) = applier();
        applier.apply(&batch(vec![KvEvent::BlockStored(stored(&TOKENS))]));
        assert_eq!(depth(&index, "m", None, &TOKENS), 8);
        applier.apply(&batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(depth(&index, "m", None, &TOKENS), 0);
        let view = applier.stream().view(Instant::now());
        assert_eq!(view.resets[2], (ResetReason::Cleared, 1));
        assert_eq!((view.batches, view.events, view.blocks_stored), (2, 2, 2));
    }
}

//! A worker's latest sample of each data-parallel rank, and what they add up to: one reading, stamped
//! with its oldest rank's time, and the capacity the ranks report.

use std::sync::Arc;
use std::time::Instant;

use super::engine::RankLoad;
use super::snapshot::{Capacity, EngineLoad, Reading};

/// The latest sample of each rank, with when it was requested; `None` for a rank never reported.
pub(super) struct RankSamples(Vec<Option<(Instant, RankLoad)>>);

impl RankSamples {
    pub(super) fn new(dp_size: u32) -> Self {
        RankSamples(vec![None; dp_size as usize])
    }

    /// Forgets every sample: they describe an engine run that is gone.
    pub(super) fn clear(&mut self) {
        self.0.iter_mut().for_each(|rank| *rank = None);
    }

    /// Keeps the ranks a response requested at `sent` covered; the others keep their older samples.
    pub(super) fn record(&mut self, ranks: Vec<Option<RankLoad>>, sent: Instant) {
        for (slot, rank) in self.0.iter_mut().zip(ranks) {
            if let Some(rank) = rank {
                *slot = Some((sent, rank));
            }
        }
    }

    /// Which ranks the response requested at `sent` lacked (no sample at all, or an older one), for
    /// operators.
    pub(super) fn missing(&self, sent: Instant) -> Option<Arc<str>> {
        let missing: Vec<String> = self
            .0
            .iter()
            .enumerate()
            .filter(|(_, rank)| rank.is_none_or(|(at, _)| at < sent))
            .map(|(index, _)| index.to_string())
            .collect();
        (!missing.is_empty()).then(|| {
            Arc::from(format!(
                "rank {} missing from the last response",
                missing.join(", ")
            ))
        })
    }

    /// Sums the ranks into one reading, stamped with the oldest rank's time. Complete only when every
    /// rank has a sample; an optional measure is summed only when every present rank has it.
    pub(super) fn reading(&self) -> Option<Reading> {
        let present = || self.0.iter().flatten();
        let captured_at = present().map(|(at, _)| *at).min()?;
        let sum_all = |field: fn(&RankLoad) -> Option<u64>| -> Option<u64> {
            present().try_fold(0_u64, |sum, (_, rank)| {
                field(rank).map(|value| sum.saturating_add(value))
            })
        };
        Some(Reading {
            captured_at,
            complete: present().count() == self.0.len(),
            load: EngineLoad {
                waiting: present().fold(0, |sum, (_, rank)| sum.saturating_add(rank.waiting)),
                running: present().fold(0, |sum, (_, rank)| sum.saturating_add(rank.running)),
                waiting_uncached_tokens: sum_all(|rank| rank.waiting_uncached_tokens),
                used_tokens: sum_all(|rank| rank.used_tokens),
            },
        })
    }

    /// Capacity summed over ranks when every rank reported it; configuration overrides the engine.
    pub(super) fn capacity(&self, configured: Capacity) -> Capacity {
        let sum_every = |field: fn(&RankLoad) -> Option<u64>| -> Option<u64> {
            self.0.iter().try_fold(0_u64, |sum, rank| {
                rank.as_ref()
                    .and_then(|(_, rank)| field(rank))
                    .map(|value| sum.saturating_add(value))
            })
        };
        Capacity {
            max_running: configured
                .max_running
                .or_else(|| sum_every(|rank| rank.max_running)),
            max_total_tokens: configured
                .max_total_tokens
                .or_else(|| sum_every(|rank| rank.max_total_tokens)),
            // Every rank runs the same cache configuration. Where the engine and the configuration
            // disagree, the larger block is the one that never credits tokens the engine recomputes.
            engine_block: self
                .0
                .iter()
                .flatten()
                .filter_map(|(_, rank)| rank.block_size)
                .chain(configured.engine_block)
                .max(),
        }
    }
}

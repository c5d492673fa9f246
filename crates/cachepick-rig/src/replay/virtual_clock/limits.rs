//! The limits a table's rows are read against, from the workload and the fleet alone (no router):
//!
//! - **the hit ceiling with unlimited cache**: every prompt block seen before is a hit;
//! - **the hit ceiling under optimal offline eviction**: one cache of the fleet's pooled KV capacity,
//!   evicting the block whose next use is furthest away (Belady's rule, which is optimal for a cache of
//!   single blocks; with prefix hits it is the classic bound, not a proof of optimality). No real fleet
//!   reaches it: it pools every worker's cache into one and never pins blocks for running requests;
//! - **the compute bound on load**: the highest `--load` at which the fleet's GPUs could do the
//!   workload's work at that ceiling at all — each uncached prompt token priced at a full cold step's
//!   rate and each output token at a full decode batch's, the cheapest either can be on the profile.
//!   Above it every router's queue grows without bound; it is a bound, not a prediction.
//!
//! Blocks are the engines' (the simulator's own hashing), so a hit here is a hit an engine could count.

use std::collections::BTreeSet;

use rustc_hash::{FxHashMap, FxHashSet};

use serde::Serialize;

use cachepick_sim::SimConfig;
use cachepick_sim::cache::block_hashes;
use cachepick_sim::step::StepWork;

use super::Workload;

/// The workload's limits on one seed.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Limits {
    pub unlimited_hit_rate: f64,
    pub belady_hit_rate: f64,
    /// The load (arrivals at trace time ÷ load) at which the fleet's work at the Belady ceiling
    /// equals its GPU time.
    pub compute_bound_load: f64,
}

/// The limits of `workload` (arrivals at `load`) on `sim`'s fleet.
pub fn of(workload: &Workload, sim: &SimConfig, load: f64) -> Limits {
    let block = sim.block_size;
    let prompts: Vec<Vec<u64>> = (0..workload.requests.len())
        .map(|index| block_hashes(&workload.prompt(index).1, block).collect())
        .collect();
    // At least one token is always computed: a lookup takes at most (len − 1) / block blocks.
    let caps: Vec<usize> = workload
        .requests
        .iter()
        .zip(&prompts)
        .map(|(request, hashes)| {
            ((request.prompt_len.saturating_sub(1) / block.get()) as usize).min(hashes.len())
        })
        .collect();
    let capacity = sim.workers.get() as usize
        * sim.dp_size.get() as usize
        * sim.params.kv_blocks.get() as usize;
    let unlimited = unlimited_hits(&prompts, &caps);
    let belady = hits(&prompts, &caps, capacity);
    let size = u64::from(block.get());
    let prompt_tokens: u64 = workload
        .requests
        .iter()
        .map(|r| u64::from(r.prompt_len))
        .sum();
    let ratio = |blocks: &[u64]| {
        let hit: u64 = blocks.iter().map(|b| b * size).sum();
        if prompt_tokens == 0 {
            0.0
        } else {
            hit as f64 / prompt_tokens as f64
        }
    };
    let uncached: u64 = workload
        .requests
        .iter()
        .zip(&belady)
        .map(|(request, hit)| u64::from(request.prompt_len).saturating_sub(hit * size))
        .sum();
    let outputs: u64 = workload
        .requests
        .iter()
        .map(|r| u64::from(r.max_tokens))
        .sum();
    Limits {
        unlimited_hit_rate: ratio(&unlimited),
        belady_hit_rate: ratio(&belady),
        compute_bound_load: compute_bound(workload, sim, uncached, outputs, load),
    }
}

/// Leading blocks each prompt finds cached with nothing ever evicted.
fn unlimited_hits(prompts: &[Vec<u64>], caps: &[usize]) -> Vec<u64> {
    let mut seen: FxHashSet<u64> = FxHashSet::default();
    prompts
        .iter()
        .zip(caps)
        .map(|(hashes, cap)| {
            let hit = hashes
                .iter()
                .take(*cap)
                .take_while(|hash| seen.contains(hash))
                .count();
            seen.extend(hashes.iter().copied());
            hit as u64
        })
        .collect()
}

/// Leading blocks each prompt finds cached, in arrival order, in one cache of `capacity` blocks
/// under Belady's rule.
fn hits(prompts: &[Vec<u64>], caps: &[usize], capacity: usize) -> Vec<u64> {
    // Each block reference's next use: the index of the next prompt holding the block.
    let mut next_use: Vec<Vec<usize>> = Vec::with_capacity(prompts.len());
    let mut seen: FxHashMap<u64, usize> = FxHashMap::default();
    for (index, hashes) in prompts.iter().enumerate().rev() {
        next_use.push(
            hashes
                .iter()
                .map(|hash| seen.get(hash).copied().unwrap_or(usize::MAX))
                .collect(),
        );
        for hash in hashes {
            seen.insert(*hash, index);
        }
    }
    next_use.reverse();
    let mut cached: FxHashMap<u64, usize> = FxHashMap::default();
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut found = Vec::with_capacity(prompts.len());
    for ((hashes, uses), cap) in prompts.iter().zip(&next_use).zip(caps) {
        let hit = hashes
            .iter()
            .take(*cap)
            .take_while(|hash| cached.contains_key(hash))
            .count();
        found.push(hit as u64);
        for (hash, next) in hashes.iter().zip(uses) {
            if let Some(old) = cached.insert(*hash, *next) {
                by_next.remove(&(old, *hash));
            }
            by_next.insert((*next, *hash));
        }
        while cached.len() > capacity {
            let Some((_, hash)) = by_next.pop_last() else {
                break;
            };
            cached.remove(&hash);
        }
    }
    found
}

/// The load at which `uncached` prompt tokens and `outputs` output tokens, at the profile's best
/// rates, fill the fleet's GPU time over the workload's arrival window.
fn compute_bound(
    workload: &Workload,
    sim: &SimConfig,
    uncached: u64,
    outputs: u64,
    load: f64,
) -> f64 {
    let profile = &sim.params.profile;
    let batch = u64::from(sim.params.batch_tokens.get());
    let mut cold = StepWork::default();
    cold.chunk(batch, 0);
    let prefill_per_token = profile.step_time(&cold) / batch as f64;
    let requests = workload.requests.len().max(1) as u64;
    let mean_context = workload
        .requests
        .iter()
        .map(|r| u64::from(r.prompt_len) + u64::from(r.max_tokens) / 2)
        .sum::<u64>()
        / requests;
    let running = u64::from(sim.params.max_running.get()).min(batch).max(1);
    let mut decode = StepWork::default();
    for _ in 0..running {
        decode.decode(mean_context);
    }
    let decode_per_token = profile.step_time(&decode) / running as f64;
    let work = uncached as f64 * prefill_per_token + outputs as f64 * decode_per_token;
    let (first, last) = match (workload.requests.first(), workload.requests.last()) {
        (Some(first), Some(last)) => (first.at, last.at),
        _ => return 0.0,
    };
    // The window at `load` stretched back to trace time: at load L it is L times shorter.
    let window_at_one = (last - first) * load;
    let gpus = f64::from(sim.workers.get()) * f64::from(sim.dp_size.get());
    if work > 0.0 {
        gpus * window_at_one / work
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_keeps_what_comes_back_soonest_and_unlimited_keeps_everything() {
        // Prompts of one block each: a, b, a, c, b with room for one block.
        let prompts: Vec<Vec<u64>> = [1, 2, 1, 3, 2].iter().map(|h| vec![*h]).collect();
        let caps = vec![1; prompts.len()];
        assert_eq!(hits(&prompts, &caps, usize::MAX), [0, 0, 1, 0, 1]);
        assert_eq!(unlimited_hits(&prompts, &caps), [0, 0, 1, 0, 1]);
        // Room for one: b (next used at 4) goes before a (next used at 2), then c (never again).
        assert_eq!(hits(&prompts, &caps, 1), [0, 0, 1, 0, 0]);
        // Two blocks: a and b both fit until c arrives, which is never used again and goes first.
        assert_eq!(hits(&prompts, &caps, 2), [0, 0, 1, 0, 1]);
        // A prefix hit stops at the first missing block, and at the lookup cap.
        let prompts = vec![vec![1, 2, 3], vec![1, 9, 3], vec![1, 2, 3]];
        assert_eq!(hits(&prompts, &[3, 3, 2], usize::MAX), [0, 1, 2]);
        assert_eq!(unlimited_hits(&prompts, &[3, 3, 2]), [0, 1, 2]);
    }
}

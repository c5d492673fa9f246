//! The in-process arms that are not cachepick: the oracle and the re-implemented peers, in virtual
//! time. Their rules are the wall-clock replay's ([`crate::replay::oracle`], [`crate::replay::peers`]);
//! only where they read the fleet differs: here the [`OfflineWorker`]s' true state.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use std::collections::HashMap;

use cachepick_sim::SimConfig;
use cachepick_sim::cache::PromptBlocks;
use cachepick_sim::offline::OfflineWorker;

use super::engine::{Cx, Routed, Router};
use crate::replay::peers::{Calibration, Candidate, Load, PeerRule, chained_blocks, select};

/// The routing limit: every request where the step model predicts the soonest first token, from the
/// true state, counting the requests it sent that are still in their worker's front (received, not
/// yet queued). Ties go to the worker holding more of the prompt, then the lower index.
#[derive(Default)]
pub(super) struct OracleRouter {
    /// The prompts of requests it routed, hashed once, until their first token (by then they have
    /// left their worker's front).
    hashed: HashMap<usize, PromptBlocks>,
}

impl Router for OracleRouter {
    fn route(&mut self, request: usize, cx: &mut Cx<'_>) -> Option<Routed> {
        let first = cx.workers.first()?;
        let prompt = first.prompt_blocks(cx.tokens(request));
        let mut best: Option<(f64, u32, usize)> = None;
        for (index, worker) in cx.workers.iter().enumerate() {
            let front = cx.fronts.get(index).map(Vec::as_slice).unwrap_or_default();
            let in_flight: Vec<&PromptBlocks> = front
                .iter()
                .filter_map(|queued| self.hashed.get(queued))
                .collect();
            let Some((seconds, cached)) = worker.outlook(&prompt, &in_flight) else {
                continue;
            };
            let better = best.is_none_or(|(best_s, best_cached, _)| {
                seconds < best_s || (seconds == best_s && cached > best_cached)
            });
            if better {
                best = Some((seconds, cached, index));
            }
        }
        self.hashed.insert(request, prompt);
        best.map(|(_, _, worker)| Routed {
            worker,
            reason: "oracle",
            belief: None,
            replica: 0,
        })
    }

    fn first_token(&mut self, request: usize, _worker: usize, _cx: &mut Cx<'_>) {
        self.hashed.remove(&request);
    }

    fn finished(&mut self, request: usize, _worker: usize, _cx: &mut Cx<'_>) {
        self.hashed.remove(&request);
    }
}

/// What a peer holds for one routed request until it ends.
struct Held {
    replica: usize,
    worker: usize,
    prefill_tokens: u64,
    blocks: Vec<u64>,
}

/// A re-implemented peer with `replicas` router replicas, each counting only its own requests; the
/// next replica takes each request.
pub(super) struct PeerRouter {
    rule: PeerRule,
    calibration: Calibration,
    replicas: Vec<Vec<Load>>,
    next: usize,
    rng: SmallRng,
    held: Vec<Option<Held>>,
}

impl PeerRouter {
    pub fn new(
        rule: PeerRule,
        sim: &SimConfig,
        replicas: usize,
        requests: usize,
        seed: u64,
    ) -> PeerRouter {
        let workers = sim.workers.get() as usize;
        PeerRouter {
            rule,
            calibration: Calibration::of(sim),
            replicas: vec![vec![Load::default(); workers]; replicas.max(1)],
            next: 0,
            rng: SmallRng::seed_from_u64(seed),
            held: (0..requests).map(|_| None).collect(),
        }
    }
}

impl Router for PeerRouter {
    fn route(&mut self, request: usize, cx: &mut Cx<'_>) -> Option<Routed> {
        let tokens = cx.tokens(request);
        let prompt_tokens = tokens.len() as u64;
        let replica = self.next % self.replicas.len();
        self.next = self.next.wrapping_add(1);
        let blocks = match self.rule {
            PeerRule::DynamoKv => chained_blocks(tokens, self.calibration.block),
            PeerRule::LlmdSticky => Vec::new(),
        };
        let local = self.replicas.get_mut(replica)?;
        let prompt = cx.workers.first()?.prompt_blocks(tokens);
        let cached: Vec<u64> = cx
            .workers
            .iter()
            .map(|worker: &OfflineWorker| u64::from(worker.cached_tokens(&prompt)))
            .collect();
        let candidates: Vec<Candidate> = local
            .iter()
            .zip(&cached)
            .map(|(load, cached)| Candidate {
                cached_tokens: *cached,
                prefill_tokens: load.prefill_tokens(),
                active_blocks: load.blocks_with(&blocks),
            })
            .collect();
        let rng = &mut self.rng;
        let worker = select(
            self.rule,
            &candidates,
            prompt_tokens,
            &self.calibration,
            &mut |n| rng.random_range(0..n.max(1)),
        )?;
        let prefill_tokens = prompt_tokens.saturating_sub(*cached.get(worker)?);
        local.get_mut(worker)?.add(prefill_tokens, &blocks);
        if let Some(slot) = self.held.get_mut(request) {
            *slot = Some(Held {
                replica,
                worker,
                prefill_tokens,
                blocks,
            });
        }
        Some(Routed {
            worker,
            reason: self.rule.label(),
            belief: None,
            replica,
        })
    }

    fn first_token(&mut self, request: usize, _worker: usize, _cx: &mut Cx<'_>) {
        let Some(Some(held)) = self.held.get_mut(request) else {
            return;
        };
        let tokens = std::mem::take(&mut held.prefill_tokens);
        if let Some(load) = self
            .replicas
            .get_mut(held.replica)
            .and_then(|local| local.get_mut(held.worker))
        {
            load.release(tokens, &[]);
        }
    }

    fn finished(&mut self, request: usize, _worker: usize, _cx: &mut Cx<'_>) {
        let Some(held) = self.held.get_mut(request).and_then(Option::take) else {
            return;
        };
        if let Some(load) = self
            .replicas
            .get_mut(held.replica)
            .and_then(|local| local.get_mut(held.worker))
        {
            load.release(held.prefill_tokens, &held.blocks);
        }
    }
}

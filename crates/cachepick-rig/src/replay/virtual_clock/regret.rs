//! `--regret`: what each decision cost against the soonest worker, as the oracle sees it.
//!
//! At every decision, before the chosen worker receives the request, the step model predicts each
//! worker's first token for it from the true state, counting the requests still in each worker's front
//! (as [`super::routers::OracleRouter`] does); the decision's regret is the chosen worker's prediction
//! minus the soonest. It is greedy — later arrivals are not counted — so it says which decisions were
//! slow when made, by the router's reason, not what the run would have been without them. The oracle's
//! regret is zero by construction (the test below holds it), so any other arm's is the part of its TTFT
//! its decisions chose.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use cachepick_sim::cache::PromptBlocks;
use cachepick_sim::offline::OfflineWorker;

use super::engine::Routed;
use crate::replay::report::percentile;

/// The decisions' regrets of one run, by reason.
#[derive(Default)]
pub(super) struct Regret {
    /// The prompts of the requests routed and not yet submitted, hashed once: a worker's front.
    hashed: HashMap<usize, PromptBlocks>,
    /// Per reason, each decision's (regret ms, whether the chosen worker held the most of the prompt).
    by_reason: BTreeMap<&'static str, Vec<(f64, bool)>>,
}

/// One reason's decisions: how many, their regret, and how often the soonest was elsewhere.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReasonRegret {
    pub decisions: usize,
    pub mean_ms: f64,
    pub p90_ms: Option<f64>,
    /// Regret summed over the decisions, model seconds.
    pub total_s: f64,
    /// Decisions whose regret was over 1 ms.
    pub slower: usize,
    /// Decisions sent to a worker holding the most of the prompt of any.
    pub to_most_cached: usize,
}

/// A run's regret: every decision's, and by reason.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RegretFigures {
    pub all: ReasonRegret,
    pub by_reason: BTreeMap<String, ReasonRegret>,
}

impl Regret {
    /// Request `request` of `tokens` was routed as `routed`, into `workers` whose fronts are `fronts`.
    pub(super) fn routed(
        &mut self,
        request: usize,
        tokens: &[u32],
        routed: Routed,
        workers: &[OfflineWorker],
        fronts: &[Vec<usize>],
    ) {
        let Some(first) = workers.first() else {
            return;
        };
        let prompt = first.prompt_blocks(tokens);
        let outlooks: Vec<Option<(f64, u32)>> = workers
            .iter()
            .zip(fronts)
            .map(|(worker, front)| {
                let in_flight: Vec<&PromptBlocks> = front
                    .iter()
                    .filter_map(|queued| self.hashed.get(queued))
                    .collect();
                worker.outlook(&prompt, &in_flight)
            })
            .collect();
        let soonest = outlooks
            .iter()
            .flatten()
            .map(|(seconds, _)| *seconds)
            .min_by(f64::total_cmp);
        let most = outlooks.iter().flatten().map(|(_, cached)| *cached).max();
        if let (Some(soonest), Some(Some((chosen, cached)))) =
            (soonest, outlooks.get(routed.worker))
        {
            let regret_ms = ((chosen - soonest) * 1e3).max(0.0);
            self.by_reason
                .entry(routed.reason)
                .or_default()
                .push((regret_ms, Some(*cached) == most));
        }
        self.hashed.insert(request, prompt);
    }

    /// Request `request` left its worker's front.
    pub(super) fn submitted(&mut self, request: usize) {
        self.hashed.remove(&request);
    }

    pub(super) fn figures(&self) -> RegretFigures {
        let all: Vec<(f64, bool)> = self.by_reason.values().flatten().copied().collect();
        RegretFigures {
            all: summary(all),
            by_reason: self
                .by_reason
                .iter()
                .map(|(reason, decisions)| ((*reason).to_owned(), summary(decisions.clone())))
                .collect(),
        }
    }
}

fn summary(mut decisions: Vec<(f64, bool)>) -> ReasonRegret {
    decisions.sort_by(|a, b| a.0.total_cmp(&b.0));
    let regrets: Vec<f64> = decisions.iter().map(|(ms, _)| *ms).collect();
    let total_ms: f64 = regrets.iter().sum();
    ReasonRegret {
        decisions: decisions.len(),
        mean_ms: if decisions.is_empty() {
            0.0
        } else {
            total_ms / decisions.len() as f64
        },
        p90_ms: percentile(&regrets, 0.9),
        total_s: total_ms / 1e3,
        slower: regrets.iter().filter(|ms| **ms > 1.0).count(),
        to_most_cached: decisions.iter().filter(|(_, most)| *most).count(),
    }
}

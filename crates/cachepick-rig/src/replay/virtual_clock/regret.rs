//! `--regret`: what each decision cost against the soonest worker, as the oracle sees it.
//!
//! At every decision, before the chosen worker receives the request, the step model predicts each
//! worker's first token for it from the true state, counting the requests still in each worker's front
//! (as [`super::routers::OracleRouter`] does); the decision's regret is the chosen worker's prediction
//! minus the soonest. It is greedy — later arrivals are not counted — so it says which decisions were
//! slow when made, by the router's reason, not what the run would have been without them. The oracle's
//! regret is zero by construction (the test below holds it), so any other arm's is the part of its TTFT
//! its decisions chose.
//!
//! Where the router says what it believed of the chosen worker (cachepick's arms: the prompt tokens it
//! credited the worker with, the first token it predicted), the same moment's truth measures the
//! picture: credited minus the tokens the worker's soonest rank holds, and predicted minus the true
//! first token less the front (the picker's prediction is the engine's queue and prefill).

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use cachepick_sim::cache::PromptBlocks;
use cachepick_sim::offline::OfflineWorker;

use super::engine::{Belief, Routed};
use crate::replay::report::percentile;

/// The decisions' regrets of one run, by reason.
pub(super) struct Regret {
    /// The profile's front, model seconds: in the truth's first token, not in the picker's prediction.
    front_s: f64,
    /// The prompts of the requests routed and not yet submitted, hashed once: a worker's front.
    hashed: HashMap<usize, PromptBlocks>,
    by_reason: BTreeMap<&'static str, Vec<Decision>>,
    /// The decisions that credited tokens and await their request's admission: where each is kept,
    /// and what it credited.
    awaiting: HashMap<usize, (&'static str, usize, u64)>,
}

/// One decision against the truth.
#[derive(Clone, Copy, Debug)]
struct Decision {
    regret_ms: f64,
    /// The chosen worker held the most of the prompt of any.
    to_most_cached: bool,
    /// Credited minus held, tokens, where the router said what it credited.
    credit_error: Option<i64>,
    /// Predicted minus true first token, ms, where the router predicted one.
    prediction_error_ms: Option<f64>,
    /// Credited minus what the engine found cached when it admitted the request: a prefix that was
    /// still queued at the decision is held by then, an evicted one is not.
    admitted_error: Option<i64>,
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
    /// Over the decisions whose router said what it credited: the mean of credited minus held
    /// tokens, and how many credited more than the worker held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit_error_tokens: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overcredited: Option<usize>,
    /// The same against what the engine found cached when it admitted the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit_error_at_admission_tokens: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overcredited_at_admission: Option<usize>,
    /// Over the decisions whose router predicted a first token: the mean of predicted minus true, and
    /// of its absolute value, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction_error_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction_abs_error_ms: Option<f64>,
}

/// A run's regret: every decision's, and by reason.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RegretFigures {
    pub all: ReasonRegret,
    pub by_reason: BTreeMap<String, ReasonRegret>,
}

impl Regret {
    /// For a fleet whose profile's front is `front_s` model seconds.
    pub(super) fn new(front_s: f64) -> Regret {
        Regret {
            front_s,
            hashed: HashMap::new(),
            by_reason: BTreeMap::new(),
            awaiting: HashMap::new(),
        }
    }

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
            let belief = routed.belief;
            let decision = Decision {
                regret_ms: ((chosen - soonest) * 1e3).max(0.0),
                to_most_cached: Some(*cached) == most,
                credit_error: belief.map(
                    |Belief {
                         credited_tokens, ..
                     }| {
                        i64::try_from(credited_tokens).unwrap_or(i64::MAX) - i64::from(*cached)
                    },
                ),
                prediction_error_ms: belief
                    .and_then(|belief| belief.predicted_s)
                    .map(|predicted| (predicted - (chosen - self.front_s)) * 1e3),
                admitted_error: None,
            };
            let decisions = self.by_reason.entry(routed.reason).or_default();
            if let Some(belief) = belief {
                self.awaiting.insert(
                    request,
                    (routed.reason, decisions.len(), belief.credited_tokens),
                );
            }
            decisions.push(decision);
        }
        self.hashed.insert(request, prompt);
    }

    /// Request `request`'s engine admitted it (its first token came) with `cached` prompt tokens found.
    pub(super) fn admitted(&mut self, request: usize, cached: u32) {
        let Some((reason, at, credited)) = self.awaiting.remove(&request) else {
            return;
        };
        if let Some(decision) = self
            .by_reason
            .get_mut(reason)
            .and_then(|decisions| decisions.get_mut(at))
        {
            decision.admitted_error =
                Some(i64::try_from(credited).unwrap_or(i64::MAX) - i64::from(cached));
        }
    }

    /// Request `request` left its worker's front.
    pub(super) fn submitted(&mut self, request: usize) {
        self.hashed.remove(&request);
    }

    pub(super) fn figures(&self) -> RegretFigures {
        let all: Vec<Decision> = self.by_reason.values().flatten().copied().collect();
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

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

fn summary(decisions: Vec<Decision>) -> ReasonRegret {
    let mut regrets: Vec<f64> = decisions.iter().map(|d| d.regret_ms).collect();
    regrets.sort_by(f64::total_cmp);
    let total_ms: f64 = regrets.iter().sum();
    let credit: Vec<i64> = decisions.iter().filter_map(|d| d.credit_error).collect();
    let credit_f: Vec<f64> = credit.iter().map(|&e| e as f64).collect();
    let prediction: Vec<f64> = decisions
        .iter()
        .filter_map(|d| d.prediction_error_ms)
        .collect();
    let absolute: Vec<f64> = prediction.iter().map(|e| e.abs()).collect();
    let admitted: Vec<i64> = decisions.iter().filter_map(|d| d.admitted_error).collect();
    let admitted_f: Vec<f64> = admitted.iter().map(|&e| e as f64).collect();
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
        to_most_cached: decisions.iter().filter(|d| d.to_most_cached).count(),
        credit_error_tokens: mean(&credit_f),
        overcredited: (!credit.is_empty()).then(|| credit.iter().filter(|&&e| e > 0).count()),
        credit_error_at_admission_tokens: mean(&admitted_f),
        overcredited_at_admission: (!admitted.is_empty())
            .then(|| admitted.iter().filter(|&&e| e > 0).count()),
        prediction_error_ms: mean(&prediction),
        prediction_abs_error_ms: mean(&absolute),
    }
}

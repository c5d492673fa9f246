//! What one run measured, and the mean and 95% confidence interval of each figure over seeds.

use std::collections::BTreeMap;

use serde::Serialize;

use super::regret::RegretFigures;
use super::{Request, Workload};
use crate::replay::report::percentile;

/// What happened to one request of a run.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Outcome {
    pub worker: Option<usize>,
    pub reason: Option<&'static str>,
    pub first_token: Option<f64>,
    pub finished: Option<f64>,
    /// Prompt tokens the engine found cached at its admission.
    pub cached: u32,
    /// The engine refused it (its queue was full, it could never fit).
    pub refused: bool,
    /// The router replica that decided.
    pub replica: usize,
}

/// One arm's run on one seed.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunFigures {
    pub requests: usize,
    /// Requests that got their first token.
    pub served: usize,
    /// Requests no router or engine took.
    pub refused: usize,
    /// Σ cached ÷ Σ prompt tokens over the served requests, as the engines count them.
    pub hit_rate: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    /// GPU-busy share of the fleet over the arrival window.
    pub busy_share: Option<f64>,
    /// Busiest worker's requests ÷ the mean over workers.
    pub worker_share: Option<f64>,
    /// Decisions by the router's reason.
    pub reasons: BTreeMap<String, u64>,
    /// Model seconds from the first arrival to the last request's end.
    pub simulated_s: f64,
    /// GPU-seconds simulated: the span times the fleet's GPUs.
    pub gpu_seconds: f64,
    /// The decisions' regret against the soonest worker (`--regret`); absent unless measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regret: Option<RegretFigures>,
    /// What followed a replica's joining (`--join-at`); absent unless one joined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub joined: Option<JoinFigures>,
}

/// The windows after a replica joined: how soon the fleet, and the new replica's own decisions, did
/// as well as before.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct JoinFigures {
    /// Model seconds after the first arrival.
    pub at_s: f64,
    /// The arrivals before the join, as one window, then [`JOIN_WINDOWS`] equal windows from the
    /// join to the last arrival.
    pub windows: Vec<WindowFigures>,
}

/// Windows the time after a join is cut into.
pub const JOIN_WINDOWS: usize = 8;

/// The requests that arrived in one window.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WindowFigures {
    /// From and to, model seconds after the first arrival.
    pub from_s: f64,
    pub to_s: f64,
    pub requests: usize,
    /// Σ cached ÷ Σ prompt tokens of the window's served requests.
    pub hit_rate: Option<f64>,
    /// The same over the requests the joining replica (the last) decided, and over the others'.
    pub joiner_hit_rate: Option<f64>,
    pub others_hit_rate: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
}

impl JoinFigures {
    /// The windows of `outcomes` around replica `joiner`'s join at `at` (model seconds after the
    /// first arrival).
    pub(super) fn of(
        workload: &Workload,
        outcomes: &[Outcome],
        (at, joiner): (f64, usize),
    ) -> JoinFigures {
        let first = workload.requests.first().map_or(0.0, |request| request.at);
        let last = workload
            .requests
            .iter()
            .map(|request| request.at - first)
            .fold(at, f64::max);
        let step = (last - at) / JOIN_WINDOWS as f64;
        let mut bounds = vec![(0.0, at)];
        bounds
            .extend((0..JOIN_WINDOWS).map(|n| (at + step * n as f64, at + step * (n + 1) as f64)));
        let windows = bounds
            .iter()
            .enumerate()
            .map(|(nth, &(from, to))| {
                let within = |request: &Request| {
                    let since = request.at - first;
                    // The last window holds the last arrival.
                    since >= from && (since < to || (nth == bounds.len() - 1 && since <= to))
                };
                WindowFigures::of(workload, outcomes, (from, to), joiner, within)
            })
            .collect();
        JoinFigures { at_s: at, windows }
    }
}

impl WindowFigures {
    fn of(
        workload: &Workload,
        outcomes: &[Outcome],
        (from_s, to_s): (f64, f64),
        joiner: usize,
        within: impl Fn(&Request) -> bool,
    ) -> WindowFigures {
        let mut ttft = Vec::new();
        // (prompt, cached) over all, the joiner's and the others'.
        let mut sums = [(0_u64, 0_u64); 3];
        for (request, outcome) in workload.requests.iter().zip(outcomes) {
            if !within(request) {
                continue;
            }
            let Some(first_token) = outcome.first_token else {
                continue;
            };
            ttft.push((first_token - request.at) * 1e3);
            let whose = if outcome.replica == joiner { 1 } else { 2 };
            for at in [0, whose] {
                if let Some(sum) = sums.get_mut(at) {
                    sum.0 += u64::from(request.prompt_len);
                    sum.1 += u64::from(outcome.cached);
                }
            }
        }
        ttft.sort_by(f64::total_cmp);
        let rate =
            |(prompt, cached): (u64, u64)| (prompt > 0).then(|| cached as f64 / prompt as f64);
        WindowFigures {
            from_s,
            to_s,
            requests: workload
                .requests
                .iter()
                .filter(|request| within(request))
                .count(),
            hit_rate: rate(sums[0]),
            joiner_hit_rate: rate(sums[1]),
            others_hit_rate: rate(sums[2]),
            ttft_p90_ms: percentile(&ttft, 0.9),
        }
    }
}

impl RunFigures {
    pub(super) fn of(
        workload: &Workload,
        outcomes: &[Outcome],
        busy_share: Option<f64>,
        ranks: f64,
    ) -> RunFigures {
        let mut ttft = Vec::new();
        let mut e2e = Vec::new();
        let (mut prompt, mut cached) = (0_u64, 0_u64);
        let mut reasons = BTreeMap::new();
        let mut per_worker: BTreeMap<usize, u64> = BTreeMap::new();
        let mut last = 0.0_f64;
        let first = workload.requests.first().map_or(0.0, |request| request.at);
        let mut refused = 0;
        for (request, outcome) in workload.requests.iter().zip(outcomes) {
            if let Some(reason) = outcome.reason {
                *reasons.entry(reason.to_owned()).or_insert(0) += 1;
            }
            if let Some(worker) = outcome.worker {
                *per_worker.entry(worker).or_insert(0) += 1;
            }
            if outcome.refused || outcome.worker.is_none() {
                refused += 1;
            }
            if let Some(first_token) = outcome.first_token {
                ttft.push((first_token - request.at) * 1e3);
                prompt += u64::from(request.prompt_len);
                cached += u64::from(outcome.cached);
            }
            if let Some(finished) = outcome.finished {
                e2e.push((finished - request.at) * 1e3);
                last = last.max(finished);
            }
        }
        ttft.sort_by(f64::total_cmp);
        e2e.sort_by(f64::total_cmp);
        let workers = per_worker.len().max(1) as f64;
        let total: u64 = per_worker.values().sum();
        let busiest = per_worker.values().copied().max().unwrap_or(0);
        let simulated_s = (last - first).max(0.0);
        RunFigures {
            requests: workload.requests.len(),
            served: ttft.len(),
            refused,
            hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p90_ms: percentile(&ttft, 0.9),
            ttft_p99_ms: percentile(&ttft, 0.99),
            e2e_p50_ms: percentile(&e2e, 0.5),
            busy_share,
            worker_share: (total > 0).then(|| busiest as f64 / (total as f64 / workers)),
            reasons,
            simulated_s,
            gpu_seconds: simulated_s * ranks,
            regret: None,
            joined: None,
        }
    }
}

/// A figure over seeds: its mean and the half-width of its 95% confidence interval (Student's t).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Estimate {
    pub mean: f64,
    /// The interval is `mean ± half_width`; 0 with a single seed (unknown, not zero).
    pub half_width: f64,
    pub seeds: usize,
}

impl Estimate {
    /// Over the values present; `None` when no seed had one.
    pub fn of(values: impl IntoIterator<Item = Option<f64>>) -> Option<Estimate> {
        let values: Vec<f64> = values.into_iter().flatten().collect();
        let n = values.len();
        if n == 0 {
            return None;
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let half_width = if n > 1 {
            let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            t95(n - 1) * (variance / n as f64).sqrt()
        } else {
            0.0
        };
        Some(Estimate {
            mean,
            half_width,
            seeds: n,
        })
    }

    pub fn low(&self) -> f64 {
        self.mean - self.half_width
    }

    pub fn high(&self) -> f64 {
        self.mean + self.half_width
    }
}

/// Student's t at 97.5% for `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    const Z: f64 = 1.959_964;
    match df {
        0 => f64::INFINITY,
        df => TABLE.get(df - 1).copied().unwrap_or_else(|| {
            // Beyond the table, the Cornish–Fisher expansion around the normal quantile.
            let v = df as f64;
            Z + (Z.powi(3) + Z) / (4.0 * v)
                + (5.0 * Z.powi(5) + 16.0 * Z.powi(3) + 3.0 * Z) / (96.0 * v * v)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_is_students_t_over_the_seeds() {
        let a = Estimate::of([Some(10.0), Some(12.0), Some(11.0), None]).unwrap();
        assert_eq!(a.seeds, 3);
        assert!((a.mean - 11.0).abs() < 1e-12);
        // s = 1, n = 3: 4.303 / √3.
        assert!((a.half_width - 4.303 / 3f64.sqrt()).abs() < 1e-9);
        assert!((a.low() - (11.0 - a.half_width)).abs() < 1e-12);
        let one = Estimate::of([Some(1.0)]).unwrap();
        assert_eq!((one.mean, one.half_width, one.seeds), (1.0, 0.0, 1));
        let many = Estimate::of((0..40).map(|n| Some(f64::from(n % 2)))).unwrap();
        // Beyond the table: t(39) = 2.0227 to four places; s² = 10 / 39.
        let s = (10.0 / 39.0_f64).sqrt();
        assert!((many.half_width / (s / 40f64.sqrt()) - 2.0227).abs() < 5e-4);
        assert!(Estimate::of([None, None]).is_none());
    }
}

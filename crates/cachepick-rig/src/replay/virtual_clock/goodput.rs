//! Goodput at an SLO: for each arm and seed, the highest load at which TTFT p90 stays within the SLO,
//! found by bisection (`cachepick replay --clock virtual --goodput`).
//!
//! The SLO is stated per workload: by default twice the p90 of the workload's lone TTFTs — each
//! request's time to first token alone on an idle worker with a cold cache (its front and its whole
//! prefill, nothing queued) — so the p90 an idle fleet without a cache would give, doubled. The
//! median prompt's lone TTFT would be the simpler yardstick, but on a heavy-tailed workload such as
//! Mooncake (prompts to 125k tokens) the p90 is set by the long prompts, whose prefill alone exceeds
//! twice the median's at any load. A load is met when every request got its first token and the
//! run's TTFT p90 is within the SLO. The search is geometric between the compute bound (no router can
//! do better: [`super::limits`]) and 1/[`RANGE`] of it, [`STEPS`] halvings, so a goodput is known to
//! within a factor of `RANGE^(1/2^STEPS)` (2.4%); a load met at the bound is reported as the bound, one
//! failed at the bottom of the range as 0. A probe stops as soon as its verdict is certain
//! ([`engine::within_slo`]), and the bottom is probed last, only when nothing above it was met.

use std::fmt::Write as _;

use serde::Serialize;

use cachepick_sim::SimConfig;
use cachepick_sim::offline::{Happened, OfflineWorker};

use super::figures::Estimate;
use super::{
    Arm, VirtualOptions, Workload, arms, each_arm, engine, fleet, limits, router_of, shown,
    workload,
};
use crate::replay::ReplayError;

/// The search's range below the compute bound.
pub const RANGE: f64 = 20.0;
/// Halvings of the range.
pub const STEPS: u32 = 7;

/// What `--goodput` asks for.
#[derive(Clone, Copy, Debug)]
pub struct GoodputOptions {
    /// The SLO on TTFT p90, model milliseconds; `None`: twice the p90 of the workload's lone TTFTs.
    pub slo_ms: Option<f64>,
}

/// One arm's goodput over the seeds.
#[derive(Clone, Debug, Serialize)]
pub struct ArmGoodput {
    pub arm: String,
    pub replicas: usize,
    pub baseline: bool,
    /// The highest load met, seed by seed.
    pub loads: Vec<f64>,
    pub goodput: Option<Estimate>,
    /// ÷ cachepick's default at the same replica count, seed by seed.
    pub vs_default: Option<Estimate>,
    /// ÷ the compute bound, seed by seed.
    pub vs_bound: Option<Estimate>,
}

/// The goodput search over every arm and seed.
#[derive(Clone, Debug, Serialize)]
pub struct GoodputReport {
    pub scenario: String,
    pub workers: u32,
    pub seeds: Vec<u64>,
    pub requests: usize,
    /// The SLO of each seed, model milliseconds, and how it was set.
    pub slo_ms: Vec<f64>,
    pub slo_basis: String,
    pub compute_bound_load: Option<Estimate>,
    pub arms: Vec<ArmGoodput>,
    pub table: String,
}

/// Model milliseconds from a lone request of `prompt_len` tokens arriving at an idle worker of `sim`
/// to its first token.
pub fn lone_ttft_ms(sim: &SimConfig, prompt_len: usize) -> f64 {
    let mut worker = OfflineWorker::new(sim, 0);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|token| u32::try_from(token % 50_000).unwrap_or(0) + 1)
        .collect();
    let ready = worker.accept(0.0, prompt.len());
    let Ok(Some((rank, mut end))) = worker.submit(ready, 0, &prompt, 1, 0.0) else {
        return 0.0;
    };
    loop {
        let (happened, next) = worker.step_ended(rank, end);
        if happened
            .iter()
            .any(|event| matches!(event, Happened::FirstToken { .. }))
        {
            return end * 1e3;
        }
        let Some(next) = next else {
            return end * 1e3;
        };
        end = next;
    }
}

/// The p90 of the workload's lone TTFTs (each prompt length's lone TTFT, worked out once).
fn lone_p90_ms(sim: &SimConfig, workload: &Workload) -> f64 {
    let mut known: std::collections::BTreeMap<u32, f64> = std::collections::BTreeMap::new();
    let mut lone: Vec<f64> = workload
        .requests
        .iter()
        .map(|request| {
            *known
                .entry(request.prompt_len)
                .or_insert_with(|| lone_ttft_ms(sim, request.prompt_len as usize))
        })
        .collect();
    lone.sort_by(f64::total_cmp);
    crate::replay::report::percentile(&lone, 0.9).unwrap_or(0.0)
}

/// Whether `arm` meets the SLO with `workload` at `load`.
fn meets(
    arm: &Arm,
    sim: &SimConfig,
    workload: &Workload,
    options: &VirtualOptions,
    seed: u64,
    load: f64,
    slo_ms: f64,
) -> Result<bool, ReplayError> {
    let workload = workload.at_load(load);
    let mut router = router_of(arm, sim, workload.requests.len(), options, seed)?;
    Ok(engine::within_slo(sim, &workload, router.as_mut(), slo_ms))
}

/// The highest load in the range `arm` meets on one seed.
fn search(
    arm: &Arm,
    sim: &SimConfig,
    workload: &Workload,
    options: &VirtualOptions,
    seed: u64,
    (bound, slo_ms): (f64, f64),
) -> Result<f64, ReplayError> {
    if meets(arm, sim, workload, options, seed, bound, slo_ms)? {
        return Ok(bound);
    }
    let bottom = bound / RANGE;
    let (mut low, mut high) = (bottom, bound);
    for _ in 0..STEPS {
        let middle = (low * high).sqrt();
        if meets(arm, sim, workload, options, seed, middle, slo_ms)? {
            low = middle;
        } else {
            high = middle;
        }
    }
    // The range's bottom is the slowest run of all (the longest span of scrapes and ticks), so it is
    // run only when no load above it was met, to tell a goodput there from none.
    if low == bottom && !meets(arm, sim, workload, options, seed, bottom, slo_ms)? {
        return Ok(0.0);
    }
    Ok(low)
}

/// Runs the search for every arm on every seed, arms in parallel.
pub fn run(
    options: &VirtualOptions,
    goodput: GoodputOptions,
) -> Result<GoodputReport, ReplayError> {
    if options.seeds == 0 {
        return Err(ReplayError::Virtual("--seeds must be at least 1".into()));
    }
    let at_one = VirtualOptions {
        load: 1.0,
        ..options.clone()
    };
    let seeds: Vec<u64> = (0..options.seeds as u64)
        .map(|n| options.seed.wrapping_add(n))
        .collect();
    let first = fleet(&at_one, options.seed)?;
    let arms = arms(&at_one, &first)?;
    let threads = options
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .clamp(1, arms.len().max(1));
    let mut loads: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    let (mut slos, mut bounds) = (Vec::new(), Vec::new());
    let mut requests = 0;
    for (nth, &seed) in seeds.iter().enumerate() {
        let sim = fleet(&at_one, seed)?;
        let workload = workload(&at_one, &sim, seed, (nth, seeds.len()))?;
        requests = workload.requests.len();
        let slo_ms = goodput
            .slo_ms
            .unwrap_or_else(|| 2.0 * lone_p90_ms(&sim, &workload));
        let bound = limits::of(&workload, &sim, 1.0).compute_bound_load;
        let bound = if bound.is_finite() { bound } else { RANGE };
        let found = each_arm(&arms, threads, |arm| {
            search(arm, &sim, &workload, &at_one, seed, (bound, slo_ms))
                .map_err(|error| error.to_string())
        });
        for (at, load) in found {
            let load = load.map_err(ReplayError::Virtual)?;
            if let Some(arm) = loads.get_mut(at) {
                arm.push(load);
            }
        }
        slos.push(slo_ms);
        bounds.push(bound);
    }
    let mut report = GoodputReport {
        scenario: options.scenario.name(),
        workers: first.workers.get(),
        seeds,
        requests,
        slo_basis: match goodput.slo_ms {
            Some(_) => "given (--slo-ms)".to_owned(),
            None => "twice the p90 of the workload's lone, cold TTFTs".to_owned(),
        },
        slo_ms: slos,
        compute_bound_load: Estimate::of(bounds.iter().copied().map(Some)),
        arms: Vec::new(),
        table: String::new(),
    };
    report.arms = goodputs(&arms, &loads, &bounds);
    report.table = table(&report);
    Ok(report)
}

/// Each arm's goodput, and its ratios to the default's and the bound, seed by seed.
fn goodputs(arms: &[Arm], loads: &[Vec<f64>], bounds: &[f64]) -> Vec<ArmGoodput> {
    let ratio = |a: &[f64], b: &[f64]| {
        Estimate::of(a.iter().zip(b).map(|(a, b)| (*b > 0.0).then(|| a / b)))
    };
    arms.iter()
        .zip(loads)
        .map(|(arm, own)| {
            let default = arms
                .iter()
                .zip(loads)
                .find(|(other, _)| other.baseline && other.replicas == arm.replicas)
                .map(|(_, loads)| loads.as_slice());
            ArmGoodput {
                arm: arm.label.clone(),
                replicas: arm.replicas,
                baseline: arm.baseline,
                loads: own.clone(),
                goodput: Estimate::of(own.iter().copied().map(Some)),
                vs_default: default
                    .filter(|_| !arm.baseline)
                    .and_then(|default| ratio(own, default)),
                vs_bound: ratio(own, bounds),
            }
        })
        .collect()
}

fn table(report: &GoodputReport) -> String {
    let mut out = String::new();
    let slo = Estimate::of(report.slo_ms.iter().copied().map(Some));
    let _ = writeln!(
        out,
        "SLO: TTFT p90 ≤ {} ms ({}); compute bound at load {}.\n",
        shown(slo.as_ref(), 1.0, 0),
        report.slo_basis,
        shown(report.compute_bound_load.as_ref(), 1.0, 2),
    );
    let _ = writeln!(
        out,
        "| arm | goodput (load) | ÷ default | ÷ compute bound | vs default |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|---|");
    for arm in &report.arms {
        let versus = match arm.vs_default {
            _ if arm.baseline => "—",
            Some(ratio) if ratio.seeds > 1 && ratio.low() > 1.0 => "wins",
            Some(ratio) if ratio.seeds > 1 && ratio.high() < 1.0 => "loses",
            Some(_) => "tie",
            None => "–",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            arm.arm,
            shown(arm.goodput.as_ref(), 1.0, 2),
            shown(arm.vs_default.as_ref(), 1.0, 2),
            shown(arm.vs_bound.as_ref(), 1.0, 2),
            versus,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::Scenario;
    use crate::replay::virtual_clock::run_arm;

    #[test]
    fn a_lone_request_waits_its_front_and_its_cold_prefill_and_longer_prompts_wait_longer() {
        let mut sim = SimConfig::new(cachepick_sim::Engine::Vllm, std::num::NonZeroU32::MIN);
        sim.params.time_scale = 1.0;
        let short = lone_ttft_ms(&sim, 1_000);
        let long = lone_ttft_ms(&sim, 20_000);
        assert!(short >= sim.params.profile.front * 1e3, "{short}");
        // 20k tokens take three budgets of 8,192 at least.
        assert!(long > 2.0 * short, "{short} {long}");
    }

    fn burst() -> VirtualOptions {
        VirtualOptions {
            scenario: Scenario::Burst,
            sim_config: None,
            workers: None,
            policies: vec!["default".to_owned(), "round_robin".to_owned()],
            peers: Vec::new(),
            oracle: false,
            replicas: Vec::new(),
            index_modes: Vec::new(),
            replica_sync: false,
            seed: 7,
            seeds: 1,
            limit: Some(150),
            load: 1.0,
            duration_scale: 1.0,
            scrape_interval: None,
            jobs: Some(1),
            regret: false,
            join_at: None,
            out: std::path::PathBuf::new(),
        }
    }

    /// A probe stops early only when its verdict is certain: at an SLO equal to a full run's p90 it
    /// is met, just below it it is not, at every load from idle to overloaded and for a cache-aware
    /// arm and round robin alike.
    #[test]
    fn a_probe_gives_the_verdict_of_the_whole_run_at_the_edge_of_the_slo() {
        let options = burst();
        let sim = fleet(&options, options.seed).unwrap();
        let base = workload(&options, &sim, options.seed, (0, 1)).unwrap();
        let arms = arms(&options, &sim).unwrap();
        let mut checked = 0;
        for arm in &arms {
            for load in [2.0, 11.0, 40.0] {
                let at_load = base.at_load(load);
                let figures = run_arm(arm, &sim, &at_load, &options, options.seed).unwrap();
                assert_eq!(figures.served, figures.requests, "{} at {load}", arm.label);
                let p90 = figures.ttft_p90_ms.unwrap();
                let probe = |slo: f64| meets(arm, &sim, &base, &options, options.seed, load, slo);
                assert!(probe(p90).unwrap(), "{} at {load}: p90 {p90}", arm.label);
                assert!(
                    !probe(p90 * (1.0 - 1e-9)).unwrap(),
                    "{} at {load}",
                    arm.label
                );
                assert!(!probe(p90 / 4.0).unwrap(), "{} at {load}", arm.label);
                checked += 1;
            }
        }
        assert_eq!(checked, 6);
    }
}

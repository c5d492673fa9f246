//! What a virtual replay reports: each arm's runs and their estimates, the ratios paired by seed, the
//! limits, the Markdown table and the files.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;

use super::figures::{Estimate, RunFigures, WindowFigures};
use super::{Arm, ArmKind};
use crate::replay::ReplayError;

/// One arm over every seed.
#[derive(Clone, Debug, Serialize)]
pub struct ArmReport {
    pub arm: String,
    pub replicas: usize,
    /// cachepick's default as it ships: the arm the others at its replica count are paired with.
    pub baseline: bool,
    /// The `policy:` section (cachepick's arms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_yaml: Option<String>,
    pub runs: Vec<RunFigures>,
    pub hit_rate: Option<Estimate>,
    pub ttft_p50_ms: Option<Estimate>,
    pub ttft_p90_ms: Option<Estimate>,
    pub ttft_p99_ms: Option<Estimate>,
    pub busy_share: Option<Estimate>,
    /// TTFT p90 ÷ the oracle's, seed by seed (paired: both ran the same workload).
    pub p90_vs_oracle: Option<Estimate>,
    /// TTFT p90 ÷ cachepick's default at the same replica count, seed by seed.
    pub p90_vs_default: Option<Estimate>,
    /// Hit rate ÷ the Belady ceiling, seed by seed.
    pub hit_vs_ceiling: Option<Estimate>,
    /// The mean regret of a decision, model ms (`--regret`; each run's by reason is in `runs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regret_ms: Option<Estimate>,
}

/// The whole virtual replay: deterministic for its options, so it carries no wall-clock figure.
#[derive(Clone, Debug, Serialize)]
pub struct VirtualReport {
    pub scenario: String,
    pub clock: &'static str,
    pub workers: u32,
    pub dp_size: u32,
    pub load: f64,
    pub seeds: Vec<u64>,
    pub requests: usize,
    pub ideal_hit_rate: Option<Estimate>,
    /// The limits ([`limits`]), over seeds.
    pub unlimited_hit_rate: Option<Estimate>,
    pub belady_hit_rate: Option<Estimate>,
    pub compute_bound_load: Option<Estimate>,
    pub arms: Vec<ArmReport>,
    pub table: String,
}

/// How fast the replay ran: printed, never in the report (it is the machine's, not the model's).
#[derive(Clone, Debug)]
pub struct Speed {
    pub wall_s: f64,
    pub gpu_seconds: f64,
    pub runs: usize,
}

impl Speed {
    /// Simulated GPU-seconds per wall-second.
    pub fn ratio(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.gpu_seconds / self.wall_s
        } else {
            0.0
        }
    }
}

/// Each arm's TTFT p90 as a ratio to the oracle's and to the default's, seed by seed. Pairing on the
/// seed removes what the seeds' workloads differ by (a window of a trace is busier than another), so
/// a difference between arms shows where their separate intervals would hide it.
pub(super) fn pair(reports: &mut [ArmReport]) {
    let p90s = |arm: &ArmReport| -> Vec<Option<f64>> {
        arm.runs.iter().map(|run| run.ttft_p90_ms).collect()
    };
    let ratio = |a: &[Option<f64>], b: &[Option<f64>]| {
        Estimate::of(a.iter().zip(b).map(|(a, b)| match (a, b) {
            (Some(a), Some(b)) if *b > 0.0 => Some(a / b),
            _ => None,
        }))
    };
    let oracle = reports
        .iter()
        .find(|arm| arm.arm == crate::replay::oracle::LABEL)
        .map(p90s);
    let defaults: Vec<(usize, Vec<Option<f64>>)> = reports
        .iter()
        .filter(|arm| arm.baseline)
        .map(|arm| (arm.replicas, p90s(arm)))
        .collect();
    for arm in reports.iter_mut() {
        let own = p90s(arm);
        arm.p90_vs_oracle = oracle.as_deref().and_then(|oracle| ratio(&own, oracle));
        arm.p90_vs_default = defaults
            .iter()
            .find(|(replicas, _)| *replicas == arm.replicas)
            .filter(|_| !arm.baseline)
            .and_then(|(_, default)| ratio(&own, default));
    }
}

pub(super) fn arm_report(arm: &Arm, runs: Vec<RunFigures>) -> ArmReport {
    ArmReport {
        arm: arm.label.clone(),
        replicas: arm.replicas,
        baseline: arm.baseline,
        policy_yaml: match &arm.kind {
            ArmKind::Picker { yaml, .. } => Some(yaml.clone()),
            _ => None,
        },
        hit_rate: Estimate::of(runs.iter().map(|run| run.hit_rate)),
        ttft_p50_ms: Estimate::of(runs.iter().map(|run| run.ttft_p50_ms)),
        ttft_p90_ms: Estimate::of(runs.iter().map(|run| run.ttft_p90_ms)),
        ttft_p99_ms: Estimate::of(runs.iter().map(|run| run.ttft_p99_ms)),
        busy_share: Estimate::of(runs.iter().map(|run| run.busy_share)),
        p90_vs_oracle: None,
        p90_vs_default: None,
        hit_vs_ceiling: None,
        regret_ms: Estimate::of(
            runs.iter()
                .map(|run| run.regret.as_ref().map(|regret| regret.all.mean_ms)),
        ),
        runs,
    }
}

/// `mean ± half-width`, or `–`.
pub(super) fn shown(estimate: Option<&Estimate>, scale: f64, digits: usize) -> String {
    estimate.map_or_else(
        || "–".to_owned(),
        |e| {
            format!(
                "{:.digits$} ± {:.digits$}",
                e.mean * scale,
                e.half_width * scale
            )
        },
    )
}

/// The Markdown table: each arm's figures with their 95% intervals over seeds; its TTFT p90 as a
/// ratio to the oracle's and to cachepick's default (same replicas), paired by seed, with the ratio's
/// interval; and the verdict against the default, a win or a loss only where that interval excludes 1.
pub(super) fn table(report: &VirtualReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Limits: hit ceiling {} % with unlimited cache, {} % under Belady over the pooled KV; \
         compute bound at load {} (this run: {}).\n",
        shown(report.unlimited_hit_rate.as_ref(), 100.0, 1),
        shown(report.belady_hit_rate.as_ref(), 100.0, 1),
        shown(report.compute_bound_load.as_ref(), 1.0, 2),
        report.load,
    );
    let _ = writeln!(
        out,
        "| arm | hit rate % | hit ÷ ceiling | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | busy % | p90 ÷ oracle | p90 ÷ default | vs default |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|");
    for arm in &report.arms {
        let versus = match arm.p90_vs_default {
            _ if arm.baseline => "—",
            Some(ratio) if ratio.seeds > 1 && ratio.high() < 1.0 => "wins",
            Some(ratio) if ratio.seeds > 1 && ratio.low() > 1.0 => "loses",
            Some(_) => "tie",
            None => "–",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            arm.arm,
            shown(arm.hit_rate.as_ref(), 100.0, 1),
            shown(arm.hit_vs_ceiling.as_ref(), 1.0, 2),
            shown(arm.ttft_p50_ms.as_ref(), 1.0, 0),
            shown(arm.ttft_p90_ms.as_ref(), 1.0, 0),
            shown(arm.ttft_p99_ms.as_ref(), 1.0, 0),
            shown(arm.busy_share.as_ref(), 100.0, 0),
            shown(arm.p90_vs_oracle.as_ref(), 1.0, 2),
            shown(arm.p90_vs_default.as_ref(), 1.0, 2),
            versus,
        );
    }
    for arm in &report.arms {
        join_table(&mut out, arm, &report.arms);
    }
    out
}

/// For an arm a replica joined (`--join-at`), its figures window by window; for a joining arm, also
/// the difference to the same arm with that replica there from the start, paired by seed.
fn join_table(out: &mut String, arm: &ArmReport, arms: &[ArmReport]) {
    let windows = |arm: &ArmReport| -> Vec<Vec<WindowFigures>> {
        arm.runs
            .iter()
            .map(|run| {
                run.joined
                    .as_ref()
                    .map(|joined| joined.windows.clone())
                    .unwrap_or_default()
            })
            .collect()
    };
    let own = windows(arm);
    let Some(first) = arm.runs.first().and_then(|run| run.joined.as_ref()) else {
        return;
    };
    // Held to the same arm with its last replica there from the start: the same requests reach
    // that replica after the join in both.
    let present = ["/join+warm", "/join"]
        .iter()
        .find_map(|suffix| arm.arm.strip_suffix(suffix))
        .and_then(|base| {
            let label = format!("{base}/present");
            arms.iter().find(|other| other.arm == label)
        })
        .map(windows);
    let _ = writeln!(
        out,
        "\n{}: the last replica joins {:.0} s after the first arrival (window times from the first \
         run; hit rates in %).\n\n\
         | window, s | requests | hit | joiner's hit | the others' hit | TTFT p90 ms | joiner's hit − present's, points | p90 ÷ present's |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|",
        arm.arm, first.at_s
    );
    for (nth, window) in first.windows.iter().enumerate() {
        let at = |runs: &[Vec<WindowFigures>], figure: fn(&WindowFigures) -> Option<f64>| {
            runs.iter()
                .map(|windows| windows.get(nth).and_then(figure))
                .collect::<Vec<_>>()
        };
        let hit = at(&own, |w| w.hit_rate);
        let p90 = at(&own, |w| w.ttft_p90_ms);
        let paired =
            |cold: &[Option<f64>], mine: &[Option<f64>], f: fn(f64, f64) -> Option<f64>| {
                Estimate::of(
                    mine.iter()
                        .zip(cold)
                        .map(|(mine, cold)| f((*mine)?, (*cold)?)),
                )
            };
        let joiner = at(&own, |w| w.joiner_hit_rate);
        let (hit_delta, p90_ratio) = present.as_ref().map_or((None, None), |present| {
            (
                paired(
                    &at(present, |w| w.joiner_hit_rate),
                    &joiner,
                    |mine, present| Some(mine - present),
                ),
                paired(&at(present, |w| w.ttft_p90_ms), &p90, |mine, present| {
                    (present > 0.0).then(|| mine / present)
                }),
            )
        });
        let _ = writeln!(
            out,
            "| {:.0}–{:.0} | {} | {} | {} | {} | {} | {} | {} |",
            window.from_s,
            window.to_s,
            window.requests,
            shown(Estimate::of(hit.iter().copied()).as_ref(), 100.0, 1),
            shown(Estimate::of(joiner.iter().copied()).as_ref(), 100.0, 1),
            shown(
                Estimate::of(at(&own, |w| w.others_hit_rate)).as_ref(),
                100.0,
                1
            ),
            shown(Estimate::of(p90.iter().copied()).as_ref(), 1.0, 0),
            shown(hit_delta.as_ref(), 100.0, 1),
            shown(p90_ratio.as_ref(), 1.0, 2),
        );
    }
}

/// Writes `report.json` and `table.md` under the output directory.
pub fn write(report: &VirtualReport, out: &std::path::Path) -> Result<(), ReplayError> {
    let failed = |path: PathBuf| {
        move |source| ReplayError::Write {
            path: path.clone(),
            source,
        }
    };
    std::fs::create_dir_all(out).map_err(failed(out.to_path_buf()))?;
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    let path = out.join("report.json");
    std::fs::write(&path, json).map_err(failed(path.clone()))?;
    let path = out.join("table.md");
    std::fs::write(&path, &report.table).map_err(failed(path.clone()))?;
    Ok(())
}

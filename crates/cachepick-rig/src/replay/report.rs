//! Per-arm figures computed from the samples, the printed table and the JSON report. An *arm* is one
//! policy run with one index mode and one number of picker replicas; with the defaults (approximate
//! index, one replica) an arm is named after its policy alone.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::drive::{End, Sample};
use super::fault::FaultReport;
use super::rates::RateReport;
use super::utilisation::Utilisation;

/// Percentiles in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Percentiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

/// One time bucket of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Bucket {
    /// Start of the bucket, seconds of replay time from the first arrival.
    pub start_s: f64,
    pub requests: usize,
    pub hit_rate: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
}

/// The figures of one workload phase (the burst scenario has three).
#[derive(Clone, Debug, Serialize)]
pub struct PhaseFigures {
    pub phase: String,
    pub requests: usize,
    pub failed: usize,
    pub hit_rate: Option<f64>,
    pub ttft_ms: Percentiles,
}

/// One arm's run: a policy, an index mode, a number of picker replicas.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    /// The arm's label in the table and the charts: the policy, then `/<index mode>` and `/x<replicas>`
    /// when the run compares those (`gate_floor/events/x3`).
    pub arm: String,
    pub policy: String,
    /// The owner index's mode (`pools[].index.mode`): `approximate` (learned from the picker's own
    /// decisions) or `events` (the engines' KV cache events).
    pub index_mode: String,
    /// Picker replicas behind the one Envoy, round-robined per request.
    pub replicas: usize,
    /// Decisions each replica made (`cachepick_decisions_total` summed, from its `/metrics`), in
    /// replica order; `None` for a replica whose metrics could not be read.
    pub replica_decisions: Vec<Option<u64>>,
    /// Each replica's `cachepick_pool_dispatch_share` at the end (the largest over its pools), in
    /// replica order; `None` where it could not be read.
    pub replica_shares: Vec<Option<f64>>,
    /// The arm's replicas ran `replica_sync`.
    #[serde(default)]
    pub replica_sync: bool,
    /// The peers' announcements each replica accepted (`replica_sync`), in replica order; `None`
    /// without the sync or where its metrics could not be read.
    #[serde(default)]
    pub replica_synced: Vec<Option<u64>>,
    /// The fault arm's stale credits, when the run crashed a worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultReport>,
    /// The `policy:` section the picker ran with (empty for a front).
    pub policy_yaml: String,
    /// The `load:` section the picker ran with: scrape timing and the prefill-rate window, the product's
    /// defaults in model time (absent for a front and the in-process arms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_yaml: Option<String>,
    /// The pickers' scrapes of the engines by outcome, summed over replicas (empty for a front): how
    /// often the load picture was refreshed, and how often it failed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub scrapes: BTreeMap<String, u64>,
    /// The other router this arm ran instead of cachepick: its command template or URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub front: Option<String>,
    /// The front's own routing counters after the run (its `/metrics`, when the template put it on
    /// `{metrics_port}`): what it says it decided, beside what the workers saw.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub front_counters: Vec<String>,
    /// How busy the fleet was over the arrival window, read from the engines.
    pub utilisation: Option<Utilisation>,
    /// What the picker learned of its workers' prefill rates, and when (cachepick's arms only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_rates: Option<RateReport>,
    pub requests: usize,
    /// Requests whose answer came through Envoy (it carries Envoy's `x-envoy-upstream-service-time`):
    /// with `--via envoy`, every arm's, the in-process routers' too.
    pub through_envoy: usize,
    pub ok: usize,
    pub errors: usize,
    pub refusals: usize,
    pub dropped: usize,
    /// Σ cached tokens ÷ Σ prompt tokens, from the workers' usage.
    pub hit_rate: Option<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Requests each worker served, by endpoint.
    pub worker_requests: BTreeMap<String, u64>,
    /// Busiest worker's requests ÷ the mean over workers (1 is perfectly even).
    pub worker_share: Option<f64>,
    /// Decision reasons as the workers saw them, and rejection reasons.
    pub reasons: BTreeMap<String, u64>,
    pub phases: Vec<PhaseFigures>,
    pub timeline: Vec<Bucket>,
    /// Every successful request's TTFT in ms, sorted (the CDF).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    /// Wall time of the run, seconds.
    pub wall_s: f64,
}

/// A policy that could not run (for example a mode this build does not know).
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub policy: String,
    pub error: String,
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The value at `share` (0 to 1) of `sorted`, nearest rank; `None` when empty.
pub fn percentile(sorted: &[f64], share: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    sorted.get(percentile_index(sorted.len(), share)).copied()
}

/// The index [`percentile`] takes in `len` sorted values (the nearest rank); 0 for none.
pub fn percentile_index(len: usize, share: f64) -> usize {
    (len.saturating_sub(1) as f64 * share).round() as usize
}

fn percentiles(mut values: Vec<f64>) -> (Percentiles, Vec<f64>) {
    values.sort_by(f64::total_cmp);
    (
        Percentiles {
            p50: percentile(&values, 0.5),
            p90: percentile(&values, 0.9),
            p99: percentile(&values, 0.99),
        },
        values,
    )
}

fn hit_rate(samples: &[&Sample]) -> Option<f64> {
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

impl PolicyReport {
    /// The one line a run prints as the arm ends.
    pub fn summary(&self) -> String {
        let lagged = self
            .utilisation
            .filter(|u| u.lagged_s > 0.0)
            .map_or_else(String::new, |u| {
                format!(
                    ", the simulator fell {:.2} s behind (timings suspect)",
                    u.lagged_s
                )
            });
        format!(
            "{} requests in {:.0} s: hit {}, TTFT p50 {} ms, p90 {} ms, errors {}, rejected {}, dropped {}, busy {}{lagged}",
            self.requests,
            self.wall_s,
            pct(self.hit_rate),
            millis(self.ttft_ms.p50),
            millis(self.ttft_ms.p90),
            self.errors,
            self.refusals,
            self.dropped,
            pct(self.utilisation.map(|u| u.busy.unwrap_or(u.slots))),
        )
    }

    /// `phases`: the names of the workload's phases; `bucket`: the timeline's bucket width.
    pub fn new(
        policy: &str,
        policy_yaml: &str,
        samples: &[Sample],
        workers: Vec<(String, u64)>,
        phases: &[&str],
        bucket: Duration,
        wall: Duration,
    ) -> PolicyReport {
        let all: Vec<&Sample> = samples.iter().collect();
        let count = |end: End| samples.iter().filter(|s| s.end == end).count();
        let (ttft_ms, ttft_sorted_ms) = percentiles(
            samples
                .iter()
                .filter(|s| s.end == End::Ok)
                .filter_map(|s| s.ttft.map(ms))
                .collect(),
        );
        let (e2e_ms, _) = percentiles(
            samples
                .iter()
                .filter(|s| s.end == End::Ok)
                .filter_map(|s| s.e2e.map(ms))
                .collect(),
        );
        let mut reasons = BTreeMap::new();
        for sample in samples {
            let reason = match sample.end {
                End::Dropped => "(dropped: in-flight bound)".to_owned(),
                End::Refused => format!("refused:{}", sample.reason),
                _ if sample.reason.is_empty() => "(no answer)".to_owned(),
                _ => sample.reason.clone(),
            };
            *reasons.entry(reason).or_insert(0) += 1;
        }
        let total: u64 = workers.iter().map(|(_, n)| n).sum();
        let max = workers.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let worker_share = (total > 0 && !workers.is_empty())
            .then(|| max as f64 / (total as f64 / workers.len() as f64));
        let phases = phases
            .iter()
            .enumerate()
            .map(|(index, name)| {
                let rows: Vec<&Sample> = samples.iter().filter(|s| s.phase == index).collect();
                let (ttft, _) = percentiles(
                    rows.iter()
                        .filter(|s| s.end == End::Ok)
                        .filter_map(|s| s.ttft.map(ms))
                        .collect(),
                );
                PhaseFigures {
                    phase: (*name).to_owned(),
                    requests: rows.len(),
                    failed: rows.iter().filter(|s| s.end != End::Ok).count(),
                    hit_rate: hit_rate(&rows),
                    ttft_ms: ttft,
                }
            })
            .collect();
        PolicyReport {
            arm: policy.to_owned(),
            policy: policy.to_owned(),
            index_mode: "approximate".to_owned(),
            replicas: 1,
            replica_decisions: Vec::new(),
            replica_shares: Vec::new(),
            replica_sync: false,
            replica_synced: Vec::new(),
            fault: None,
            policy_yaml: policy_yaml.to_owned(),
            load_yaml: None,
            scrapes: BTreeMap::new(),
            front: None,
            front_counters: Vec::new(),
            utilisation: None,
            prefill_rates: None,
            requests: samples.len(),
            through_envoy: samples.iter().filter(|s| s.through_envoy).count(),
            ok: count(End::Ok),
            errors: count(End::Error),
            refusals: count(End::Refused),
            dropped: count(End::Dropped),
            hit_rate: hit_rate(&all),
            prompt_tokens: samples.iter().map(|s| s.prompt_tokens).sum(),
            cached_tokens: samples.iter().map(|s| s.cached_tokens).sum(),
            ttft_ms,
            e2e_ms,
            worker_requests: workers.into_iter().collect(),
            worker_share,
            reasons,
            phases,
            timeline: timeline(samples, bucket),
            ttft_sorted_ms,
            wall_s: wall.as_secs_f64(),
        }
    }
}

/// Hit rate and TTFT p50 per `bucket` of send time.
fn timeline(samples: &[Sample], bucket: Duration) -> Vec<Bucket> {
    let width = bucket.as_secs_f64().max(1e-3);
    let last = samples
        .iter()
        .map(|s| s.at.as_secs_f64())
        .fold(0.0, f64::max);
    let buckets = (last / width).floor() as usize + 1;
    (0..buckets)
        .map(|index| {
            let start = index as f64 * width;
            let rows: Vec<&Sample> = samples
                .iter()
                .filter(|s| {
                    let at = s.at.as_secs_f64();
                    at >= start && at < start + width
                })
                .collect();
            let (ttft, _) = percentiles(
                rows.iter()
                    .filter(|s| s.end == End::Ok)
                    .filter_map(|s| s.ttft.map(ms))
                    .collect(),
            );
            Bucket {
                start_s: start,
                requests: rows.len(),
                hit_rate: hit_rate(&rows),
                ttft_p50_ms: ttft.p50,
            }
        })
        .collect()
}

/// `policy`, or `arm` when some arm is more than its policy (another index mode, several replicas).
fn first_column(reports: &[PolicyReport]) -> &'static str {
    if reports.iter().all(|r| r.arm == r.policy) {
        "policy"
    } else {
        "arm"
    }
}

fn pct(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

fn millis(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

/// The comparison table, one row per arm, as Markdown (readable in a terminal too). `busy` is the
/// share of the window the engines spent in steps (the step model) or of their running slots in use
/// (the slots model); with an oracle row, every row's TTFT p90 is also given as a multiple of the
/// oracle's.
pub fn table(reports: &[PolicyReport]) -> String {
    let oracle = reports
        .iter()
        .find(|report| report.arm == super::oracle::LABEL)
        .and_then(|report| report.ttft_ms.p90);
    let mut out = String::new();
    let _ = write!(
        out,
        "| {} | requests | errors | refused | dropped | prefix hit | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 | worker share | busy | queued |",
        first_column(reports)
    );
    out.push_str(if oracle.is_some() {
        " TTFT p90 ÷ oracle |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"
    } else {
        "\n|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"
    });
    for r in reports {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.arm,
            r.requests,
            r.errors,
            r.refusals,
            r.dropped,
            pct(r.hit_rate),
            millis(r.ttft_ms.p50),
            millis(r.ttft_ms.p90),
            millis(r.ttft_ms.p99),
            millis(r.e2e_ms.p50),
            millis(r.e2e_ms.p99),
            r.worker_share
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
            pct(r.utilisation.map(|u| u.busy.unwrap_or(u.slots))),
            pct(r.utilisation.map(|u| u.queued)),
        );
        if let Some(oracle) = oracle {
            let ratio = r
                .ttft_ms
                .p90
                .filter(|_| oracle > 0.0)
                .map_or_else(|| "-".to_owned(), |p90| format!("{:.2}", p90 / oracle));
            let _ = write!(out, " {ratio} |");
        }
        out.push('\n');
    }
    out
}

/// Per-phase hit rate and TTFT, one row per policy (only when the workload has several phases).
pub fn phase_table(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let Some(first) = reports.first() else {
        return out;
    };
    if first.phases.len() < 2 {
        return out;
    }
    let mut header = format!("| {} |", first_column(reports));
    let mut rule = "|---|".to_owned();
    for phase in &first.phases {
        let _ = write!(
            header,
            " {0} hit | {0} TTFT p50 | {0} TTFT p99 |",
            phase.phase
        );
        rule.push_str("--:|--:|--:|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    for r in reports {
        let mut line = format!("| {} |", r.arm);
        for phase in &r.phases {
            let _ = write!(
                line,
                " {} | {} | {} |",
                pct(phase.hit_rate),
                millis(phase.ttft_ms.p50),
                millis(phase.ttft_ms.p99)
            );
        }
        let _ = writeln!(out, "{line}");
    }
    out
}

/// Decision-reason counts, one line per policy.
pub fn reasons(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    for r in reports {
        let mut reasons: Vec<(&String, &u64)> = r.reasons.iter().collect();
        reasons.sort_by_key(|(_, count)| std::cmp::Reverse(**count));
        let text: Vec<String> = reasons
            .iter()
            .map(|(reason, count)| format!("{reason} {count}"))
            .collect();
        let _ = writeln!(out, "- {}: {}", r.arm, text.join(", "));
    }
    out
}

/// Each front's own routing counters, one line per front arm that has some.
pub fn front_counters(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    for r in reports.iter().filter(|r| !r.front_counters.is_empty()) {
        let _ = writeln!(out, "- {}: {}", r.arm, r.front_counters.join("; "));
    }
    out
}

/// Decisions per picker replica, one line per arm (only arms with more than one replica).
pub fn replica_decisions(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    for r in reports.iter().filter(|r| r.replicas > 1) {
        let counts: Vec<String> = r
            .replica_decisions
            .iter()
            .enumerate()
            .map(|(index, count)| {
                let count = count.map_or_else(|| "?".to_owned(), |n| n.to_string());
                let share = r
                    .replica_shares
                    .get(index)
                    .copied()
                    .flatten()
                    .map_or_else(String::new, |share| format!(" (dispatch share {share:.2})"));
                let synced = r
                    .replica_synced
                    .get(index)
                    .copied()
                    .flatten()
                    .map_or_else(String::new, |n| format!(" (accepted {n} from its peers)"));
                format!("replica {index} {count}{share}{synced}")
            })
            .collect();
        let _ = writeln!(out, "- {}: {}", r.arm, counts.join(", "));
    }
    out
}

/// When each cachepick arm's picker learned its workers' prefill rates, one line per arm that read
/// them.
pub fn learned_rates(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let seconds = |s: Option<f64>| s.map_or_else(|| "never".to_owned(), |s| format!("{s:.1} s"));
    for r in reports {
        let Some(rates) = &r.prefill_rates else {
            continue;
        };
        let median = rates
            .final_median
            .map_or_else(|| "none".to_owned(), |m| format!("{m:.0}"));
        let _ = writeln!(
            out,
            "- {}: first worker {}, every worker {}, median within {:.0}% from {}, final median {median}",
            r.arm,
            seconds(rates.first_s),
            seconds(rates.all_s),
            super::rates::SETTLED_WITHIN * 100.0,
            seconds(rates.settled_s),
        );
    }
    out
}

/// The fault arm's stale credits, one line per arm (only when the run crashed a worker).
pub fn stale_credits(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    for r in reports {
        if let Some(fault) = &r.fault {
            let _ = writeln!(out, "- {}: {}", r.arm, fault.summary());
        }
    }
    out
}

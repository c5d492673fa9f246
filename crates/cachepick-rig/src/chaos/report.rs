//! What a chaos or soak run reports: the good requests' account, each failure with its cause, the
//! malformed and slow clients, the picker's decision latency and memory, Envoy's counters, and the
//! Markdown summary of it all. Pure: the runner in `super` fills it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::classify::{Cause, Logged, Observed, Timeline};
use super::hostile::Slow;
use super::schedule::{Fault, Malformed, Step};
use super::{Mode, seconds};

/// One good request that did not end served.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    pub id: String,
    /// `stream` (the steady traffic) or `trickle` (a slow body).
    pub kind: &'static str,
    #[serde(rename = "sent_s", serialize_with = "seconds")]
    pub sent: Duration,
    #[serde(rename = "ended_s", serialize_with = "seconds")]
    pub ended: Duration,
    #[serde(flatten)]
    pub cause: Cause,
    /// Whether a live worker could have served it.
    pub servable: bool,
    /// Envoy's details and flags for it, when it logged it.
    pub envoy: Option<String>,
}

impl ChaosReport {
    /// Why the run failed, if it did: a good request lost that a live worker could have served.
    pub fn failure(&self) -> Option<String> {
        Tally::failure(&self.good)
    }
}

impl Tally {
    fn failure(&self) -> Option<String> {
        (self.lost_servable > 0).then(|| {
            format!(
                "{} request(s) lost that a live worker could have served (see `failures` in the report)",
                self.lost_servable
            )
        })
    }
}

/// The good requests' account.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Tally {
    /// Due in the schedule.
    pub due: usize,
    /// Not sent: the in-flight bound was reached.
    pub not_sent: usize,
    pub sent: usize,
    pub served: usize,
    pub failed: usize,
    /// Failures a live worker could have served: the figure that must be 0.
    pub lost_servable: usize,
    /// Failures by cause.
    pub by_cause: BTreeMap<String, usize>,
    /// Sent while the picker was down (killed, or restarting and not yet ready), and of those served.
    pub during_picker_down: usize,
    pub served_during_picker_down: usize,
    /// Requests in flight when a worker they were on died.
    pub lost_with_a_worker: usize,
}

/// How one malformed client was answered.
#[derive(Clone, Debug, Serialize)]
pub struct MalformedOutcome {
    pub kind: Malformed,
    pub id: String,
    #[serde(rename = "sent_s", serialize_with = "seconds")]
    pub sent: Duration,
    pub status: Option<u16>,
    /// Who refused it and why: `picker <reason>`, `envoy <details>`, `worker` (the picker was down and
    /// Envoy failed open, so the engine refused it), or `not refused: …`.
    pub refused_by: String,
    /// Whether it was refused with a 4xx and a reason: by the picker's header, or Envoy's details.
    pub refused_as_expected: bool,
    /// Whether the picker was down at some point while it was in flight.
    pub picker_down: bool,
}

/// What a fault did.
#[derive(Clone, Debug, Serialize)]
pub struct Fired {
    #[serde(flatten)]
    pub step: Step,
    /// `None`: carried out; else why not.
    pub error: Option<String>,
}

/// Quantiles of the picker's `cachepick_decision_seconds`, as the upper bounds of their buckets.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub decisions: u64,
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub p999_ms: Option<f64>,
}

/// The picker's resident memory over the run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Rss {
    /// `(seconds from the start, KiB)`, one per sample.
    pub samples: Vec<(f64, u64)>,
    pub first_kib: Option<u64>,
    pub max_kib: Option<u64>,
    /// Median of the samples in the 10 s after the warm-up.
    pub after_warmup_kib: Option<u64>,
    /// Median of the last 10 s of samples.
    pub end_kib: Option<u64>,
    /// `end / after_warmup - 1`, percent.
    pub growth_after_warmup_pct: Option<f64>,
}

/// Everything one run produced.
#[derive(Clone, Debug, Serialize)]
pub struct ChaosReport {
    pub mode: Mode,
    /// Envoy's ext_proc body mode (`buffered`, `duplex`, `streamed`).
    pub body_mode: String,
    #[serde(rename = "length_s", serialize_with = "seconds")]
    pub length: Duration,
    pub rate: f64,
    pub seed: u64,
    pub workers: u32,
    pub schedule: Vec<Fired>,
    pub timeline: Timeline,
    pub good: Tally,
    pub failures: Vec<Failure>,
    pub malformed: Vec<MalformedOutcome>,
    pub slow: Vec<Slow>,
    /// Picker processes started (1 + restarts).
    pub picker_starts: u32,
    /// The last picker process's decision latency.
    pub decision_latency: Latency,
    pub rss: Rss,
    pub envoy_counters: BTreeMap<String, u64>,
    /// The printed summary (Markdown).
    pub table: String,
    pub out_dir: PathBuf,
}

impl ChaosReport {
    /// Malformed clients not refused with a 4xx and a reason while the picker was up.
    pub fn malformed_unrefused(&self) -> Vec<&MalformedOutcome> {
        self.malformed
            .iter()
            .filter(|outcome| !outcome.refused_as_expected && !outcome.picker_down)
            .collect()
    }
}

pub(super) fn describe(fault: &Fault) -> String {
    match fault {
        Fault::CrashWorker { worker, down_for } => {
            format!(
                "worker {worker} crashes, back in {:.1} s",
                down_for.as_secs_f64()
            )
        }
        Fault::Metrics {
            worker,
            mode,
            lasting,
        } => format!(
            "worker {worker}'s /metrics turn {} for {:.1} s",
            mode.mode(),
            lasting.as_secs_f64()
        ),
        Fault::KillPicker { down_for } => format!(
            "picker SIGKILLed, restarted after {:.1} s",
            down_for.as_secs_f64()
        ),
        Fault::Slowloris { connections } => format!("{connections} slowloris connections"),
        Fault::BodyTrickle { clients, over } => {
            format!("{clients} bodies trickled over {:.1} s", over.as_secs_f64())
        }
        Fault::StalledBody { clients } => format!("{clients} bodies that stall"),
        Fault::Malformed { kind } => format!("malformed client: {}", kind.as_str()),
    }
}

/// How a malformed client was answered, and whether that is the refusal it should get: a 4xx with the
/// picker's reason header, or Envoy's own 4xx for what it refuses before the picker sees it.
pub(super) fn judge_malformed(
    kind: Malformed,
    id: String,
    seen: &Observed,
    logged: Option<&Logged>,
    timeline: &Timeline,
) -> MalformedOutcome {
    let picker_down = timeline.picker_down_during(seen.sent, seen.ended);
    let client_error = seen
        .status
        .is_some_and(|status| (400..500).contains(&status));
    let envoy_details = logged
        .map(|logged| logged.details.clone())
        .filter(|details| !details.is_empty() && details != "via_upstream");
    let (refused_by, expected) = match (&seen.refusal, &envoy_details) {
        (Some(reason), _) => (format!("picker {reason}"), client_error),
        (None, Some(details)) => (format!("envoy {details}"), client_error),
        // Envoy's HTTP codec refuses bytes that are not HTTP before any filter or access-log id.
        (None, None) if kind == Malformed::GarbageBytes && client_error => {
            ("envoy http codec".to_owned(), true)
        }
        (None, None) if client_error => ("worker".to_owned(), false),
        (None, None) => (
            format!(
                "not refused: {}",
                seen.status.map_or_else(
                    || format!("{:?}", seen.failure),
                    |status| status.to_string()
                )
            ),
            false,
        ),
    };
    MalformedOutcome {
        kind,
        id,
        sent: seen.sent,
        status: seen.status,
        refused_by,
        refused_as_expected: expected,
        picker_down,
    }
}

fn median(mut values: Vec<u64>) -> Option<u64> {
    values.sort_unstable();
    values.get(values.len() / 2).copied()
}

/// The RSS figures: first, max, the median of the 10 s after `warmup`, the median of the last 10 s.
pub(super) fn rss_summary(samples: Vec<(f64, u64)>, warmup: Duration) -> Rss {
    let warm = warmup.as_secs_f64();
    let last = samples.last().map_or(0.0, |(at, _)| *at);
    let after_warmup = median(
        samples
            .iter()
            .filter(|(at, _)| *at >= warm && *at < warm + 10.0)
            .map(|(_, kib)| *kib)
            .collect(),
    );
    let end = median(
        samples
            .iter()
            .filter(|(at, _)| *at > last - 10.0)
            .map(|(_, kib)| *kib)
            .collect(),
    );
    let growth = match (after_warmup, end) {
        (Some(before), Some(after)) if before > 0 && last >= warm + 10.0 => {
            Some(((after as f64 / before as f64) - 1.0) * 100.0)
        }
        _ => None,
    };
    Rss {
        first_kib: samples.first().map(|(_, kib)| *kib),
        max_kib: samples.iter().map(|(_, kib)| *kib).max(),
        after_warmup_kib: after_warmup,
        end_kib: end,
        growth_after_warmup_pct: growth,
        samples,
    }
}

/// Quantiles of histogram `name` in a Prometheus exposition, summed over its label sets, each the upper
/// bound (ms) of the first bucket whose cumulative count reaches it.
pub fn histogram_quantiles(exposition: &str, name: &str) -> Latency {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new(); // bound bits → (bound, count)
    for line in exposition.lines().filter(|line| line.starts_with(&prefix)) {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(bound) = labels
            .split("le=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
        else {
            continue;
        };
        let bound = if bound == "+Inf" {
            f64::INFINITY
        } else {
            bound.parse().unwrap_or(f64::NAN)
        };
        let Ok(count) = value.parse::<f64>() else {
            continue;
        };
        if bound.is_nan() {
            continue;
        }
        // Ordered by bound: positive floats order as their bits do.
        buckets.entry(bound.to_bits()).or_insert((bound, 0.0)).1 += count;
    }
    let total = buckets.values().last().map_or(0.0, |(_, count)| *count);
    let quantile = |q: f64| -> Option<f64> {
        if total <= 0.0 {
            return None;
        }
        buckets
            .values()
            .find(|(_, count)| *count >= q * total)
            .map(|(bound, _)| *bound * 1000.0)
            .filter(|ms| ms.is_finite())
    };
    Latency {
        decisions: total as u64,
        p50_ms: quantile(0.50),
        p90_ms: quantile(0.90),
        p99_ms: quantile(0.99),
        p999_ms: quantile(0.999),
    }
}

fn ms(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |ms| format!("≤ {ms:.3} ms"))
}

fn kib(value: Option<u64>) -> String {
    value.map_or_else(
        || "-".to_owned(),
        |kib| format!("{:.1} MiB", kib as f64 / 1024.0),
    )
}

/// The Markdown summary.
///
/// Over 100 lines: the table's sections in the order they print, each a few rows.
pub fn table(report: &ChaosReport) -> String {
    let good = &report.good;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cachepick chaos ({:?}, Envoy {}): {:.0} s at {} requests/s, {} workers, seed {}\n",
        report.mode,
        report.body_mode,
        report.length.as_secs_f64(),
        report.rate,
        report.workers,
        report.seed
    );
    let _ = writeln!(out, "| good requests | count |\n|---|---:|");
    let _ = writeln!(out, "| due | {} |", good.due);
    let _ = writeln!(out, "| not sent (in-flight bound) | {} |", good.not_sent);
    let _ = writeln!(out, "| sent | {} |", good.sent);
    let _ = writeln!(out, "| served | {} |", good.served);
    let _ = writeln!(out, "| failed | {} |", good.failed);
    let _ = writeln!(
        out,
        "| of those, in flight on a worker that died | {} |",
        good.lost_with_a_worker
    );
    let _ = writeln!(
        out,
        "| **lost that a live worker could have served** | **{}** |",
        good.lost_servable
    );
    let _ = writeln!(
        out,
        "| sent while the picker was down / of those served | {} / {} |",
        good.during_picker_down, good.served_during_picker_down
    );
    if !good.by_cause.is_empty() {
        let _ = writeln!(out, "\n| failure cause | count |\n|---|---:|");
        for (cause, count) in &good.by_cause {
            let _ = writeln!(out, "| {cause} | {count} |");
        }
    }
    if !report.malformed.is_empty() {
        let _ = writeln!(
            out,
            "\n| malformed client | sent at | status | refused by | picker down |\n|---|---:|---:|---|---|"
        );
        for outcome in &report.malformed {
            let _ = writeln!(
                out,
                "| {} | {:.1} s | {} | {} | {} |",
                outcome.kind.as_str(),
                outcome.sent.as_secs_f64(),
                outcome
                    .status
                    .map_or_else(|| "-".to_owned(), |status| status.to_string()),
                outcome.refused_by,
                if outcome.picker_down { "yes" } else { "no" }
            );
        }
    }
    if !report.slow.is_empty() {
        let _ = writeln!(
            out,
            "\n| slow client | connections | closed by Envoy | after (max) | statuses |\n|---|---:|---:|---:|---|"
        );
        for kind in ["slowloris", "stalled_body"] {
            let of_kind: Vec<&Slow> = report
                .slow
                .iter()
                .filter(|slow| slow.kind == kind)
                .collect();
            if of_kind.is_empty() {
                continue;
            }
            let closed: Vec<Duration> = of_kind
                .iter()
                .filter_map(|slow| slow.closed_after)
                .collect();
            let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
            for slow in &of_kind {
                let status = slow
                    .status
                    .map_or_else(|| "none".to_owned(), |status| status.to_string());
                *statuses.entry(status).or_default() += 1;
            }
            let statuses: Vec<String> = statuses
                .iter()
                .map(|(status, count)| format!("{status}×{count}"))
                .collect();
            let _ = writeln!(
                out,
                "| {kind} | {} | {} | {} | {} |",
                of_kind.len(),
                closed.len(),
                closed.iter().max().map_or_else(
                    || "-".to_owned(),
                    |max| format!("{:.1} s", max.as_secs_f64())
                ),
                statuses.join(", ")
            );
        }
    }
    let failed: Vec<&Fired> = report
        .schedule
        .iter()
        .filter(|fired| fired.error.is_some())
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(out, "\nfaults that could not be carried out:");
        for fired in failed {
            let _ = writeln!(
                out,
                "- {:.1} s {}: {}",
                fired.step.at.as_secs_f64(),
                describe(&fired.step.fault),
                fired.error.as_deref().unwrap_or_default()
            );
        }
    }
    let latency = &report.decision_latency;
    let _ = writeln!(
        out,
        "\npicker: {} process(es); last one's {} decisions: p50 {}, p90 {}, p99 {}, p99.9 {}",
        report.picker_starts,
        latency.decisions,
        ms(latency.p50_ms),
        ms(latency.p90_ms),
        ms(latency.p99_ms),
        ms(latency.p999_ms)
    );
    let rss = &report.rss;
    let _ = writeln!(
        out,
        "picker RSS{}: first {}, after warm-up {}, end {}, max {}, growth after warm-up {}",
        if report.picker_starts > 1 {
            " (over every process; growth only for one)"
        } else {
            ""
        },
        kib(rss.first_kib),
        kib(rss.after_warmup_kib),
        kib(rss.end_kib),
        kib(rss.max_kib),
        rss.growth_after_warmup_pct
            .map_or_else(|| "-".to_owned(), |pct| format!("{pct:+.1}%"))
    );
    if !report.envoy_counters.is_empty() {
        let _ = writeln!(out, "\nEnvoy counters (non-zero):");
        for (name, value) in report
            .envoy_counters
            .iter()
            .filter(|(_, value)| **value > 0)
        {
            let _ = writeln!(out, "- {name}: {value}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_run_fails_on_a_servable_request_lost_and_on_nothing_else() {
        let mut good = Tally {
            failed: 3,
            ..Tally::default()
        };
        assert_eq!(good.failure(), None, "failures no live worker could serve");
        good.lost_servable = 1;
        assert_eq!(
            good.failure().as_deref(),
            Some(
                "1 request(s) lost that a live worker could have served (see `failures` in the report)"
            )
        );
    }

    use super::*;

    #[test]
    fn histogram_quantiles_sum_label_sets_and_take_bucket_bounds() {
        let exposition = "\
cachepick_decision_seconds_bucket{pool=\"a\",le=\"0.001\"} 50
cachepick_decision_seconds_bucket{pool=\"a\",le=\"0.002\"} 90
cachepick_decision_seconds_bucket{pool=\"a\",le=\"+Inf\"} 100
cachepick_decision_seconds_bucket{pool=\"b\",le=\"0.001\"} 50
cachepick_decision_seconds_bucket{pool=\"b\",le=\"0.002\"} 99
cachepick_decision_seconds_bucket{pool=\"b\",le=\"+Inf\"} 100
cachepick_decision_seconds_sum 1
";
        let latency = histogram_quantiles(exposition, "cachepick_decision_seconds");
        assert_eq!(latency.decisions, 200);
        assert_eq!(latency.p50_ms, Some(1.0));
        assert_eq!(latency.p90_ms, Some(2.0));
        // Past the last finite bound: unknown, not infinite.
        assert_eq!(latency.p99_ms, None);
        assert_eq!(histogram_quantiles("", "x").decisions, 0);
    }

    #[test]
    fn rss_growth_compares_the_end_with_the_warm_up_not_the_start() {
        let samples: Vec<(f64, u64)> = (0..100)
            .map(|second| {
                let kib = if second < 20 {
                    10_000 + second * 1_000
                } else {
                    30_000 + second * 10
                };
                (second as f64, kib)
            })
            .collect();
        let rss = rss_summary(samples, Duration::from_secs(20));
        assert_eq!(rss.first_kib, Some(10_000));
        assert_eq!(rss.after_warmup_kib, Some(30_250));
        assert_eq!(rss.end_kib, Some(30_950));
        let growth = rss.growth_after_warmup_pct.expect("a growth");
        assert!((growth - 2.31).abs() < 0.01, "{growth}");
        // A run shorter than the warm-up has no growth figure.
        let short = rss_summary(vec![(0.0, 1), (1.0, 2)], Duration::from_secs(20));
        assert_eq!(short.growth_after_warmup_pct, None);
    }

    #[test]
    fn a_malformed_client_is_judged_by_who_refused_it() {
        let timeline = Timeline::default();
        let seen = |status: u16, refusal: Option<&str>| Observed {
            status: Some(status),
            refusal: refusal.map(str::to_owned),
            ..Observed::default()
        };
        let picker = judge_malformed(
            Malformed::InvalidJson,
            "m1".to_owned(),
            &seen(400, Some("invalid_json")),
            None,
            &timeline,
        );
        assert!(picker.refused_as_expected);
        assert_eq!(picker.refused_by, "picker invalid_json");
        let too_large = Logged {
            code: 413,
            details: "request_payload_too_large".to_owned(),
            ..Logged::default()
        };
        let envoy = judge_malformed(
            Malformed::Oversized,
            "m2".to_owned(),
            &seen(413, None),
            Some(&too_large),
            &timeline,
        );
        assert!(envoy.refused_as_expected);
        let worker = judge_malformed(
            Malformed::WrongType,
            "m3".to_owned(),
            &seen(400, None),
            None,
            &timeline,
        );
        assert!(
            !worker.refused_as_expected,
            "no reason: the picker did not see it"
        );
        let served = judge_malformed(
            Malformed::UnknownModel,
            "m4".to_owned(),
            &seen(200, None),
            None,
            &timeline,
        );
        assert!(!served.refused_as_expected);
        assert_eq!(served.refused_by, "not refused: 200");
    }
}

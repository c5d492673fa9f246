//! How fast a picker learns its workers' prefill rates: the first replica's
//! `cachepick_worker_prefill_tokens_per_second` read from its `/metrics` while an arm runs, in the
//! modelled GPU's tokens per second (the picker learns wall-clock rates; a fleet running at time scale
//! *s* computes a model second's tokens in *s* wall seconds).
//!
//! What the picker learns is what the engines' counters say (`load::rate`), so this measures the
//! estimator against the workload as a deployment would meet it: how long until the first and the last
//! worker have a rate, and how long until the fleet's median rate stays within [`SETTLED_WITHIN`] of
//! where it ends.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

/// The share of the final median a settled median stays within.
pub const SETTLED_WITHIN: f64 = 0.10;

const GAUGE: &str = "cachepick_worker_prefill_tokens_per_second{";

/// One reading of the picker's learned rates.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RatePoint {
    /// Model seconds since the arm's first arrival.
    pub at_s: f64,
    /// Workers with a learned rate.
    pub workers: usize,
    /// Their median rate, model tokens per second; `None` while no worker has one.
    pub median: Option<f64>,
}

/// What one arm's picker learned, and when.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RateReport {
    /// Model seconds until the first worker had a learned rate.
    pub first_s: Option<f64>,
    /// Model seconds until every worker of the fleet had one.
    pub all_s: Option<f64>,
    /// Model seconds from which the median stays within [`SETTLED_WITHIN`] of its last value.
    pub settled_s: Option<f64>,
    /// The median at the last reading, model tokens per second.
    pub final_median: Option<f64>,
    /// Every reading, in order.
    pub timeline: Vec<RatePoint>,
}

impl RateReport {
    /// The summary of `timeline` for a fleet of `workers`.
    pub fn of(timeline: Vec<RatePoint>, workers: usize) -> RateReport {
        let first_s = timeline.iter().find(|p| p.workers > 0).map(|p| p.at_s);
        let all_s = timeline
            .iter()
            .find(|p| workers > 0 && p.workers >= workers)
            .map(|p| p.at_s);
        let final_median = timeline.last().and_then(|p| p.median);
        // The earliest reading after which no reading strays: scanned from the end.
        let settled_s = final_median.and_then(|last| {
            let within = |p: &RatePoint| {
                p.median
                    .is_some_and(|m| (m - last).abs() <= SETTLED_WITHIN * last)
            };
            let strays = timeline.iter().rposition(|p| !within(p));
            let from = strays.map_or(0, |i| i + 1);
            timeline.get(from).map(|p| p.at_s)
        });
        RateReport {
            first_s,
            all_s,
            settled_s,
            final_median,
            timeline,
        }
    }
}

/// The learned rates in a Prometheus exposition, wall tokens per second, one per worker.
pub fn learned(exposition: &str) -> Vec<f64> {
    exposition
        .lines()
        .filter(|line| line.starts_with(GAUGE))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .filter(|rate| rate.is_finite() && *rate > 0.0)
        .collect()
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let upper = values.get(n / 2).copied()?;
    if n % 2 == 1 {
        return Some(upper);
    }
    values.get(n / 2 - 1).map(|lower| (lower + upper) / 2.0)
}

/// Reads `metrics` every `every` for `window` (wall time) and reports what the picker learned about a
/// fleet of `workers` running at `time_scale` wall seconds per model second.
pub async fn watch(
    metrics: SocketAddr,
    window: Duration,
    every: Duration,
    time_scale: f64,
    workers: usize,
) -> RateReport {
    let scale = if time_scale > 0.0 { time_scale } else { 1.0 };
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut timeline = Vec::new();
    loop {
        tick.tick().await;
        let elapsed = started.elapsed();
        if let Some(text) = crate::scrape_metrics(metrics, every.max(Duration::from_secs(1))).await
        {
            let rates: Vec<f64> = learned(&text).into_iter().map(|r| r * scale).collect();
            timeline.push(RatePoint {
                at_s: elapsed.as_secs_f64() / scale,
                workers: rates.len(),
                median: median(rates),
            });
        }
        if started.elapsed() >= window {
            break;
        }
    }
    RateReport::of(timeline, workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(at_s: f64, workers: usize, median: Option<f64>) -> RatePoint {
        RatePoint {
            at_s,
            workers,
            median,
        }
    }

    #[test]
    fn the_gauge_is_read_per_worker_and_absent_workers_are_not_counted() {
        let text = "# HELP cachepick_worker_prefill_tokens_per_second x\n\
            cachepick_worker_prefill_tokens_per_second{pool=\"m\",worker=\"a\"} 365000\n\
            cachepick_worker_prefill_tokens_per_second{pool=\"m\",worker=\"b\"} 0\n\
            cachepick_worker_uncached_tokens_per_request{pool=\"m\",worker=\"a\"} 900\n";
        assert_eq!(learned(text), [365_000.0]);
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), Some(2.5));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn the_summary_names_the_first_the_last_and_the_settling_reading() {
        let timeline = vec![
            point(1.0, 0, None),
            point(2.0, 1, Some(20_000.0)),
            point(3.0, 3, Some(40_000.0)),
            point(4.0, 4, Some(50_000.0)),
            point(5.0, 4, Some(44_000.0)),
            point(6.0, 4, Some(46_000.0)),
            point(7.0, 4, Some(45_000.0)),
        ];
        let report = RateReport::of(timeline, 4);
        assert_eq!(report.first_s, Some(2.0));
        assert_eq!(report.all_s, Some(4.0));
        // 50k is 11% off the final 45k; everything from 5 s on is within 10%.
        assert_eq!(report.settled_s, Some(5.0));
        assert_eq!(report.final_median, Some(45_000.0));
    }

    #[test]
    fn nothing_learned_reports_nothing() {
        let report = RateReport::of(vec![point(1.0, 0, None), point(2.0, 0, None)], 4);
        assert_eq!(
            (report.first_s, report.all_s, report.settled_s),
            (None, None, None)
        );
    }
}

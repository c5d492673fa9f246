//! The overhead bench's figures: per cell (size × arm × mode) the requests and their latency
//! percentiles, per size × mode the differences between consecutive arms, and both as Markdown.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::harness::{Arm, Cell, Sample};
use super::noop::{ROUTE_LABEL, Received};

/// Latency percentiles of one cell, in milliseconds (nearest rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    pub fn of(latencies: &[Duration]) -> Percentiles {
        let mut sorted: Vec<Duration> = latencies.to_vec();
        sorted.sort_unstable();
        let at = |quantile: f64| -> f64 {
            if sorted.is_empty() {
                return 0.0;
            }
            let rank = ((quantile * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            sorted
                .get(rank - 1)
                .map_or(0.0, |latency| latency.as_secs_f64() * 1_000.0)
        };
        Percentiles {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }

    fn minus(self, other: Percentiles) -> Percentiles {
        Percentiles {
            p50: self.p50 - other.p50,
            p90: self.p90 - other.p90,
            p99: self.p99 - other.p99,
        }
    }
}

/// One arm in one mode at one body size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CellReport {
    pub size: usize,
    pub arm: Arm,
    /// `buffered` or `duplex` for the ext_proc arms; none for (a) and (b).
    pub mode: Option<String>,
    /// Measured requests (warm-up excluded).
    pub requests: usize,
    /// Of those, answered 200.
    pub ok: usize,
    /// Of those, carrying cachepick's decision as the worker received it.
    pub decided: usize,
    /// Of those, carrying the decision arm (c′) made in advance ([`ROUTE_LABEL`]).
    pub routed_in_advance: usize,
    pub latency_ms: Percentiles,
}

impl CellReport {
    pub fn new(size: usize, cell: Cell, samples: &[Sample]) -> CellReport {
        let latencies: Vec<Duration> = samples.iter().map(|sample| sample.latency).collect();
        CellReport {
            size,
            arm: cell.arm,
            mode: cell.mode.map(|mode| mode.to_string()),
            requests: samples.len(),
            ok: samples.iter().filter(|sample| sample.status == 200).count(),
            decided: samples
                .iter()
                .filter(|sample| {
                    sample
                        .decision
                        .as_deref()
                        .is_some_and(|label| label != ROUTE_LABEL)
                })
                .count(),
            routed_in_advance: samples
                .iter()
                .filter(|sample| sample.decision.as_deref() == Some(ROUTE_LABEL))
                .count(),
            latency_ms: Percentiles::of(&latencies),
        }
    }
}

/// The arms of one size and mode side by side, and what each step adds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    pub size: usize,
    pub mode: String,
    pub direct: Percentiles,
    pub envoy: Percentiles,
    pub noop: Percentiles,
    /// (c′), where the run had it (not in the round-trip variants).
    pub routing: Option<Percentiles>,
    pub cachepick: Percentiles,
    /// (b) − (a): Envoy itself.
    pub envoy_minus_direct: Percentiles,
    /// (c) − (b): the ext_proc protocol.
    pub noop_minus_envoy: Percentiles,
    /// (d) − (c): cachepick's own work.
    pub cachepick_minus_noop: Percentiles,
    /// (c′) − (c): Envoy applying a routing answer (and the headers answer held until the body is whole).
    pub routing_minus_noop: Option<Percentiles>,
    /// (d) − (c′): cachepick's computing.
    pub cachepick_minus_routing: Option<Percentiles>,
    /// The target for (d) − (c) at p50 at this size, where there is one (ms).
    pub target_p50_ms: Option<f64>,
}

/// The (d) − (c) p50 target at `size`: 0.1 ms at 4 KB, 1 ms at 200 KB (issue 15).
pub fn target_p50_ms(size: usize) -> Option<f64> {
    match size {
        4_096 => Some(0.1),
        204_800 => Some(1.0),
        _ => None,
    }
}

/// Each mode's row from the cells of one size (`None` if one of the four arms is missing).
pub fn compare(size: usize, mode: &str, cells: &[CellReport]) -> Option<Comparison> {
    let find = |arm: Arm| {
        cells
            .iter()
            .find(|cell| {
                cell.size == size
                    && cell.arm == arm
                    && (!arm.has_mode() || cell.mode.as_deref() == Some(mode))
            })
            .map(|cell| cell.latency_ms)
    };
    let (direct, envoy, noop, cachepick) = (
        find(Arm::Direct)?,
        find(Arm::Envoy)?,
        find(Arm::Noop)?,
        find(Arm::Cachepick)?,
    );
    let routing = find(Arm::Routing);
    Some(Comparison {
        size,
        mode: mode.to_owned(),
        direct,
        envoy,
        noop,
        routing,
        cachepick,
        envoy_minus_direct: envoy.minus(direct),
        noop_minus_envoy: noop.minus(envoy),
        cachepick_minus_noop: cachepick.minus(noop),
        routing_minus_noop: routing.map(|routing| routing.minus(noop)),
        cachepick_minus_routing: routing.map(|routing| cachepick.minus(routing)),
        target_p50_ms: target_p50_ms(size),
    })
}

/// What the no-op server received per mode over the whole run (warm-up and readiness probes included).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NoopReceived {
    pub buffered: Received,
    pub duplex: Received,
    /// STREAMED streams (the `streamed-no-wait` variant only).
    pub streamed: Received,
}

/// `1 KB`, `45 KB`, `200 KB`, or bytes.
pub fn size_label(size: usize) -> String {
    if size.is_multiple_of(1_024) {
        format!("{} KB", size / 1_024)
    } else {
        format!("{size} B")
    }
}

/// The cells as a Markdown table: requests, p50, p90, p99.
pub fn cells_table(cells: &[CellReport]) -> String {
    let mut out = String::from(
        "| size | arm | mode | requests | 200 | decided | routed in advance | p50 ms | p90 ms | p99 ms |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for cell in cells {
        let _ = writeln!(
            out,
            "| {} | ({}) {} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
            size_label(cell.size),
            cell.arm.letter(),
            cell.arm.label(),
            cell.mode.as_deref().unwrap_or("—"),
            cell.requests,
            cell.ok,
            cell.decided,
            cell.routed_in_advance,
            cell.latency_ms.p50,
            cell.latency_ms.p90,
            cell.latency_ms.p99,
        );
    }
    out
}

/// The comparisons as a Markdown table: p50 / p99 per arm, then the differences.
pub fn comparison_table(rows: &[Comparison]) -> String {
    let pair = |p: Percentiles| format!("{:.3} / {:.3}", p.p50, p.p99);
    let diff = |p: Percentiles| format!("{:+.3} / {:+.3}", p.p50, p.p99);
    let maybe = |p: Option<Percentiles>, show: &dyn Fn(Percentiles) -> String| {
        p.map_or_else(|| "—".to_owned(), show)
    };
    let mut out = String::from(
        "| size | mode | (a) direct | (b) Envoy | (c) + no-op | (c′) + no-op that routes | (d) + cachepick | b − a | c − b | c′ − c | d − c′ | **d − c** | d − c p50 target |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for row in rows {
        let target = match row.target_p50_ms {
            Some(target) if row.cachepick_minus_noop.p50 <= target => format!("≤ {target} ms: met"),
            Some(target) => format!("≤ {target} ms: **missed**"),
            None => "—".to_owned(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | **{}** | {} |",
            size_label(row.size),
            row.mode,
            pair(row.direct),
            pair(row.envoy),
            pair(row.noop),
            maybe(row.routing, &pair),
            pair(row.cachepick),
            diff(row.envoy_minus_direct),
            diff(row.noop_minus_envoy),
            maybe(row.routing_minus_noop, &diff),
            maybe(row.cachepick_minus_routing, &diff),
            diff(row.cachepick_minus_noop),
            target,
        );
    }
    out.push_str(
        "\nLatencies in ms, p50 / p99, from sending the request to the answer's last byte.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let latencies: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let p = Percentiles::of(&latencies);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        let one = Percentiles::of(&[Duration::from_micros(1_500)]);
        assert_eq!((one.p50, one.p99), (1.5, 1.5));
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
    }

    #[test]
    fn a_comparison_subtracts_consecutive_arms_and_checks_the_target() {
        let cell = |arm: Arm, mode: Option<&str>, ms: u64| CellReport {
            size: 4_096,
            arm,
            mode: mode.map(str::to_owned),
            requests: 1,
            ok: 1,
            decided: 0,
            routed_in_advance: 0,
            latency_ms: Percentiles::of(&[Duration::from_millis(ms)]),
        };
        let cells = [
            cell(Arm::Direct, None, 1),
            cell(Arm::Envoy, None, 3),
            cell(Arm::Noop, Some("buffered"), 6),
            cell(Arm::Routing, Some("buffered"), 7),
            cell(Arm::Cachepick, Some("buffered"), 10),
            cell(Arm::Noop, Some("duplex"), 100),
            cell(Arm::Noop, Some("streamed"), 5),
            cell(Arm::Cachepick, Some("streamed"), 8),
        ];
        let row = compare(4_096, "buffered", &cells).expect("every arm");
        assert_eq!(row.envoy_minus_direct.p50, 2.0);
        assert_eq!(row.noop_minus_envoy.p50, 3.0);
        assert_eq!(row.cachepick_minus_noop.p99, 4.0);
        assert_eq!(row.routing_minus_noop.map(|p| p.p50), Some(1.0));
        assert_eq!(row.cachepick_minus_routing.map(|p| p.p50), Some(3.0));
        assert_eq!(row.target_p50_ms, Some(0.1));
        let table = comparison_table(&[row]);
        assert!(
            table.contains("**missed**") && table.contains("+3.000 / +3.000"),
            "{table}"
        );
        assert!(compare(4_096, "duplex", &cells).is_none());
        // Without (c′) (the round-trip variants) the row stands, its (c′) columns empty.
        let without = compare(4_096, "streamed", &cells).expect("the four arms");
        assert_eq!(without.routing_minus_noop, None);
        assert!(comparison_table(&[without]).contains("| — | — |"));
        assert_eq!(size_label(204_800), "200 KB");
    }
}

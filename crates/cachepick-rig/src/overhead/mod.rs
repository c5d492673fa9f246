//! `cachepick overhead`: what a request pays to go through Envoy and cachepick, measured side by side
//! in one run. The same client sends the same kind of request to the same worker five ways:
//!
//! - (a) the worker directly;
//! - (b) Envoy alone (the generated bootstrap without its ext_proc filter);
//! - (c) Envoy + a no-op ext_proc server that answers every message with CONTINUE
//!   ([`noop`]), in the same process style as cachepick;
//! - (c′) Envoy + the no-op server answering as cachepick answers, with a decision made in advance
//!   (the same headers and metadata, held as long): what Envoy does with a routing answer;
//! - (d) Envoy + cachepick (`cachepick envoy-config`'s bootstrap),
//!
//! (c), (c′) and (d) in each body mode (BUFFERED, FULL_DUPLEX_STREAMED, STREAMED without waiting for the
//! headers answer), at each body size. The client is
//! sequential (one request at a time, so no queueing enters a latency), and the cells take turns, a
//! batch of requests each, so that whatever else the machine does falls on every arm alike. Warm-up
//! requests are not counted. The figure that matters is (d) − (c): cachepick's own work beyond the
//! ext_proc protocol, which (c′) splits into Envoy applying a routing answer (c′ − c) and cachepick's
//! computing (d − c′).
//!
//! The harness ([`harness::Rig`]) is what `tests/overhead.rs` and `benches/overhead.rs` use too.

pub mod bodies;
pub mod harness;
pub mod noop;
pub mod report;
pub mod worker;

use std::path::PathBuf;

use serde::Serialize;

use cachepick::envoy_config::BodyMode;

use crate::stage::StageError;
pub use bodies::Bodies;
pub use harness::{Arm, Cell, MODEL, Rig, Sample, Variant};
pub use report::{CellReport, Comparison, NoopReceived, Percentiles};

#[derive(Debug, thiserror::Error)]
pub enum OverheadError {
    #[error(
        "Envoy is not installed: give --envoy, set CACHEPICK_ENVOY, or run scripts/provision-envoy"
    )]
    EnvoyMissing,
    #[error("Envoy at {path}: {message}")]
    Envoy { path: String, message: String },
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("{0}")]
    Io(std::io::Error),
    #[error("the bench measures the buffered, duplex and streamed modes, not {0}")]
    Mode(BodyMode),
    #[error("this run has no cell {0}")]
    NoSuchCell(String),
    #[error("a request failed: {0}")]
    Request(String),
    #[error("{cell} did not answer 200 within 15 s (the last answer: {last})")]
    NotAnswering { cell: String, last: String },
    #[error("--requests, --batch and --sizes must be positive")]
    Empty,
    #[error("cannot write the report to {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct OverheadOptions {
    /// Body sizes in bytes.
    pub sizes: Vec<usize>,
    pub modes: Vec<BodyMode>,
    /// Measured requests per cell (per size, arm and mode).
    pub requests: usize,
    /// Requests per cell sent first and not counted.
    pub warmup: usize,
    /// Requests a cell sends before the next cell's turn.
    pub batch: usize,
    /// The Envoy binary (else `find_envoy`'s search).
    pub envoy: Option<PathBuf>,
    pub variant: Variant,
    /// Seeds the bodies' prose.
    pub seed: u64,
    /// Where `report.json` and `table.md` go; `None` writes nothing.
    pub out: Option<PathBuf>,
}

impl OverheadOptions {
    /// 1 KB, 4 KB, 45 KB and 200 KB.
    pub const SIZES: [usize; 4] = [1_024, 4_096, 45 * 1_024, 200 * 1_024];

    pub fn new() -> OverheadOptions {
        OverheadOptions {
            sizes: Self::SIZES.to_vec(),
            modes: vec![BodyMode::Buffered, BodyMode::Duplex, BodyMode::Streamed],
            requests: 1_000,
            warmup: 100,
            batch: 10,
            envoy: None,
            variant: Variant::Generated,
            seed: 1,
            out: None,
        }
    }
}

impl Default for OverheadOptions {
    fn default() -> Self {
        OverheadOptions::new()
    }
}

/// A run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct OverheadReport {
    pub variant: Variant,
    pub requests: usize,
    pub warmup: usize,
    pub batch: usize,
    /// `/proc/loadavg` before and after the run (what else the machine was doing).
    pub load_before: String,
    pub load_after: String,
    pub cells: Vec<CellReport>,
    pub comparisons: Vec<Comparison>,
    pub noop_received: NoopReceived,
    /// What arm (c′)'s server received (the generated bootstrap only).
    pub routing_received: Option<NoopReceived>,
    /// Generation requests the worker answered (every arm, warm-up and probes included).
    pub worker_served: u64,
    /// Each ext_proc arm's Envoy's own account of its filter (`http.ingress_http.ext_proc.*`, non-zero
    /// counters), at the end of the run.
    pub ext_proc_stats: Vec<ExtProcStats>,
    /// The picker's `cachepick_decisions_total` and `cachepick_refusals_total` series and the sum and
    /// count of `cachepick_decision_seconds` (body received → answer sent) at the end of the run (every
    /// mode, warm-up and probes included).
    pub picker_decisions: Vec<String>,
    #[serde(skip)]
    pub table: String,
}

/// Starts the rig, measures every cell, stops it; writes `report.json` and `table.md` to `out`.
pub async fn run(options: &OverheadOptions) -> Result<OverheadReport, OverheadError> {
    if options.requests == 0 || options.batch == 0 || options.sizes.is_empty() {
        return Err(OverheadError::Empty);
    }
    let envoy = crate::find_envoy(options.envoy.as_deref()).ok_or(OverheadError::EnvoyMissing)?;
    let load_before = loadavg();
    let rig = Rig::start(&envoy, &options.modes, options.variant).await?;
    let measured = measure(&rig, options).await;
    let noop_received = NoopReceived {
        buffered: rig.noop_received(BodyMode::Buffered),
        duplex: rig.noop_received(BodyMode::Duplex),
        streamed: rig.noop_received_streamed(),
    };
    let routing_received = rig
        .routing_received(BodyMode::Buffered)
        .map(|buffered| NoopReceived {
            buffered,
            duplex: rig.routing_received(BodyMode::Duplex).unwrap_or_default(),
            streamed: rig.routing_received(BodyMode::Streamed).unwrap_or_default(),
        });
    let worker_served = rig.worker_served();
    let ext_proc_stats = ext_proc_stats(&rig).await;
    let picker_decisions = rig.picker_decisions().await;
    let stopped = rig.stop().await;
    let cells = measured?;
    stopped?;
    let mut comparisons = Vec::new();
    for size in &options.sizes {
        for mode in &options.modes {
            comparisons.extend(report::compare(*size, mode.as_str(), &cells));
        }
    }
    let table = format!(
        "{}\n{}",
        report::comparison_table(&comparisons),
        report::cells_table(&cells)
    );
    let report = OverheadReport {
        variant: options.variant,
        requests: options.requests,
        warmup: options.warmup,
        batch: options.batch,
        load_before,
        load_after: loadavg(),
        cells,
        comparisons,
        noop_received,
        routing_received,
        worker_served,
        ext_proc_stats,
        picker_decisions,
        table,
    };
    if let Some(out) = &options.out {
        write(out, &report)?;
    }
    Ok(report)
}

/// Every cell at every size: warm-up, then turns of `batch` requests per cell. Each cell gets bodies
/// of its own (the same shapes, different last messages), so cachepick never sees a body twice.
pub async fn measure(
    rig: &Rig,
    options: &OverheadOptions,
) -> Result<Vec<CellReport>, OverheadError> {
    let cells = rig.cells();
    let mut reports = Vec::new();
    for &size in &options.sizes {
        let bodies = Bodies::new(MODEL, size, options.seed);
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cells.len()];
        let mut sent = vec![0u64; cells.len()];
        let body_of = |cell: usize, sent: &mut Vec<u64>| {
            let slot = sent.get_mut(cell).map_or(0, |count| {
                *count += 1;
                *count
            });
            bodies.body(cell as u64 * 10_000_000 + slot)
        };
        for (index, cell) in cells.iter().enumerate() {
            for _ in 0..options.warmup {
                rig.send(*cell, body_of(index, &mut sent)).await?;
            }
        }
        let mut left = options.requests;
        while left > 0 {
            let turn = options.batch.min(left);
            for (index, cell) in cells.iter().enumerate() {
                for _ in 0..turn {
                    let sample = rig.send(*cell, body_of(index, &mut sent)).await?;
                    if let Some(samples) = samples.get_mut(index) {
                        samples.push(sample);
                    }
                }
            }
            left -= turn;
        }
        for (cell, samples) in cells.iter().zip(&samples) {
            reports.push(CellReport::new(size, *cell, samples));
        }
    }
    Ok(reports)
}

/// One Envoy's ext_proc counters.
#[derive(Clone, Debug, Serialize)]
pub struct ExtProcStats {
    pub cell: String,
    pub counters: Vec<(String, u64)>,
}

async fn ext_proc_stats(rig: &Rig) -> Vec<ExtProcStats> {
    let mut all = Vec::new();
    for cell in rig.cells().into_iter().filter(|cell| cell.arm.has_mode()) {
        let Some(envoy) = rig.envoy(cell) else {
            continue;
        };
        let counters = envoy
            .stats(&["http.ingress_http.ext_proc."])
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, value)| *value > 0)
            .collect();
        all.push(ExtProcStats {
            cell: cell.name(),
            counters,
        });
    }
    all
}

fn write(out: &std::path::Path, report: &OverheadReport) -> Result<(), OverheadError> {
    let failed = |path: PathBuf| move |source| OverheadError::Write { path, source };
    std::fs::create_dir_all(out).map_err(failed(out.to_owned()))?;
    let json = serde_json::to_string_pretty(report).map_err(|error| OverheadError::Write {
        path: out.join("report.json"),
        source: std::io::Error::other(error),
    })?;
    std::fs::write(out.join("report.json"), json).map_err(failed(out.join("report.json")))?;
    std::fs::write(out.join("table.md"), &report.table).map_err(failed(out.join("table.md")))?;
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.trim().to_owned())
        .unwrap_or_default()
}

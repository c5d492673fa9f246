//! What a replay leaves behind: `report.json`, `table.md`, the TTFT CDF and, for the burst, its
//! timelines.

use std::fmt::Write as _;
use std::path::Path;

use super::arms::DEFAULT_BURST_POLICIES;
use super::report::PolicyReport;
use super::{IndexMode, Replay, ReplayError, svg, trace};

fn write(path: &Path, contents: &str) -> Result<(), ReplayError> {
    std::fs::write(path, contents).map_err(|source| ReplayError::Write {
        path: path.to_owned(),
        source,
    })
}

/// Writes `report.json`, `table.md` and the charts into the replay's output directory.
pub(super) fn write_outputs(replay: &Replay, burst: bool, scale: f64) -> Result<(), ReplayError> {
    let dir = &replay.out_dir;
    std::fs::create_dir_all(dir).map_err(|source| ReplayError::Write {
        path: dir.clone(),
        source,
    })?;
    let json = serde_json::to_string_pretty(replay).unwrap_or_default();
    write(&dir.join("report.json"), &json)?;
    let mut caption = format!(
        "cachepick replay {} via {:?}, {} requests, speed-up {}, {} workers × {} running, {} KV blocks",
        replay.scenario,
        replay.via,
        replay.requests,
        replay.speedup,
        replay.fleet.workers,
        replay.fleet.max_running,
        replay.fleet.kv_blocks
    );
    if replay.index_modes != [IndexMode::Approximate] {
        let modes: Vec<&str> = replay.index_modes.iter().map(|m| m.as_str()).collect();
        let _ = write!(caption, ", index {}", modes.join("/"));
    }
    if replay.replicas != [1] {
        let counts: Vec<String> = replay.replicas.iter().map(ToString::to_string).collect();
        let _ = write!(caption, ", picker replicas {}", counts.join("/"));
    }
    if let Some(crash) = &replay.crash {
        let _ = write!(
            caption,
            ", worker {} crashed at {:.1} s",
            crash.worker,
            crash.at.as_secs_f64()
        );
    }
    write(
        &dir.join("ttft_cdf.svg"),
        &svg::ttft_cdf(&replay.policies, &caption),
    )?;
    if burst {
        let bounds = trace::burst_phase_bounds(scale);
        let window = bounds.get(1).map_or((0.0, 0.0), |(_, start, end)| {
            (
                start / 1000.0 / replay.speedup,
                end / 1000.0 / replay.speedup,
            )
        });
        // Every arm of the named policies, in the policies' order.
        let pick = |names: &[&str]| -> Vec<&PolicyReport> {
            names
                .iter()
                .flat_map(|name| replay.policies.iter().filter(|r| r.policy == *name))
                .collect()
        };
        let main = pick(&["gate", "gate_floor"]);
        let main = if main.is_empty() {
            replay.policies.iter().collect()
        } else {
            main
        };
        write(
            &dir.join("burst_timeline.svg"),
            &svg::timeline(&main, window, &caption),
        )?;
        let variants = pick(&DEFAULT_BURST_POLICIES);
        if variants.len() > 2 {
            write(
                &dir.join("burst_timeline_variants.svg"),
                &svg::timeline(&variants, window, &caption),
            )?;
        }
    }
    let mut text = String::new();
    let _ = writeln!(text, "{}", replay.table);
    write(&dir.join("table.md"), &text)?;
    Ok(())
}

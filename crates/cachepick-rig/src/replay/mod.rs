//! `cachepick replay`: routing quality measured on a workload — a Mooncake JSONL trace or the synthetic
//! burst scenario — replayed open-loop against a simulated fleet, once per routing policy, every request
//! through the real picker (over ext_proc, or through a real Envoy). Reports per policy the prefix-hit
//! rate the workers report, TTFT and end-to-end latency, worker balance and decision reasons, as a table,
//! JSON and SVG charts.
//!
//! A *policy* is a named `policy:` section applied to the cachepick configuration generated for the
//! fleet ([`POLICIES`]); each policy runs on a freshly started fleet with the same seed.

pub mod drive;
pub mod report;
pub mod svg;
pub mod trace;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use cachepick::config::{self, Config};
use cachepick_sim::{Engine, SimConfig, SimOverrides};

use crate::client::Client as PickerClient;
use crate::nz;
use crate::stage::{Stage, StageError, on_free_ports};
use drive::Route;
use report::{PolicyReport, Skipped};
use trace::{Item, PromptBuilder};

/// The workload.
#[derive(Clone, Debug)]
pub enum Scenario {
    /// A Mooncake JSONL trace.
    Trace(PathBuf),
    /// The synthetic burst: steady near capacity, a burst well above it, steady again.
    Burst,
}

/// How requests reach the picker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// Through a real Envoy with the generated configuration.
    Envoy,
    /// Over the picker's ext_proc gRPC interface (the messages Envoy sends), then to the chosen worker.
    Direct,
}

/// What `cachepick replay` runs.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    pub scenario: Scenario,
    /// Simulator configuration of the fleet (as `cachepick sim --config`); `None` is the default fleet.
    pub sim_config: Option<PathBuf>,
    /// Policy names from [`POLICIES`]; empty runs the scenario's default list.
    pub policies: Vec<String>,
    /// Arrival times are divided by this; `None` is the scenario's default. The default fleet runs its
    /// model `speedup` times faster (`time_scale = 1 / speedup`), so the load it sees is the trace's.
    pub speedup: Option<f64>,
    /// Replay only the first N requests.
    pub limit: Option<usize>,
    pub via: Via,
    /// The Envoy binary for `Via::Envoy` (default: `CACHEPICK_ENVOY`, the provisioned copy, `PATH`).
    pub envoy: Option<PathBuf>,
    /// Where `report.json` and the SVG charts go.
    pub out: PathBuf,
    pub seed: u64,
    /// Burst scenario: multiplies every phase's length.
    pub duration_scale: f64,
    /// Requests in flight at most; one due beyond it is dropped and counted.
    pub max_in_flight: usize,
    /// Print progress lines.
    pub verbose: bool,
}

impl ReplayOptions {
    pub fn new(scenario: Scenario) -> ReplayOptions {
        let out = PathBuf::from("target/replay").join(match &scenario {
            Scenario::Trace(path) => path
                .file_stem()
                .map_or_else(|| "trace".to_owned(), |s| s.to_string_lossy().into_owned()),
            Scenario::Burst => "burst".to_owned(),
        });
        ReplayOptions {
            scenario,
            sim_config: None,
            policies: Vec::new(),
            speedup: None,
            limit: None,
            via: Via::Direct,
            envoy: None,
            out,
            seed: 1,
            duration_scale: 1.0,
            max_in_flight: 2_000,
            verbose: true,
        }
    }
}

/// Every policy the tool knows, by name: the `policy:` section it applies. `{limit}`, `{floor}` and
/// `{block}` are filled from the fleet: a quarter and an eighth of `max_running` (as
/// `cachepick sim --emit-config` sizes them) and the KV block size in tokens.
pub const POLICIES: [(&str, &str); 8] = [
    ("round_robin", "mode: round_robin"),
    ("least_load", "mode: least_load"),
    ("balance_threshold", "mode: balance_threshold"),
    // Pure prefix affinity: the cache-aware mode without a queue gate.
    ("affinity", "mode: cache_aware"),
    ("gate", "worker_queue_limit: {limit}"),
    (
        "gate_floor",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}",
    ),
    (
        "gate_floor_pressure_only",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}\npin_depth_ratio: 0",
    ),
    (
        "gate_floor_min_match_1block",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}\nmin_match_tokens: {block}",
    ),
];

/// What `--policies` runs when empty.
pub const DEFAULT_TRACE_POLICIES: [&str; 8] = [
    "round_robin",
    "least_load",
    "balance_threshold",
    "affinity",
    "gate",
    "gate_floor",
    "gate_floor_pressure_only",
    "gate_floor_min_match_1block",
];
pub const DEFAULT_BURST_POLICIES: [&str; 4] = [
    "gate",
    "gate_floor",
    "gate_floor_pressure_only",
    "gate_floor_min_match_1block",
];

/// The `policy:` section of `name` for `sim`'s fleet, or `None` for an unknown name.
pub fn policy_yaml(name: &str, sim: &SimConfig) -> Option<String> {
    let (_, template) = POLICIES.iter().find(|(known, _)| *known == name)?;
    let running = sim.params.max_running.get();
    Some(
        template
            .replace("{limit}", &(running / 4).max(1).to_string())
            .replace("{floor}", &(running / 8).max(1).to_string())
            .replace("{block}", &sim.block_size.to_string()),
    )
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("unknown policy `{0}`; known: {1}")]
    UnknownPolicy(String, String),
    #[error("--speedup must be a positive number, got {0}")]
    Speedup(f64),
    #[error("the picker did not become ready: {0}")]
    Picker(String),
    #[error("Envoy: {0}")]
    Envoy(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no policy could run: {0}")]
    NothingRan(String),
}

/// The fleet as the report describes it.
#[derive(Clone, Debug, Serialize)]
pub struct FleetSummary {
    pub engine: String,
    pub workers: u32,
    pub block_size: u32,
    pub tokenizer: String,
    pub kv_blocks: u32,
    pub max_running: u32,
    pub prefill_overhead_ms: f64,
    pub prefill_per_token_us: f64,
    pub inter_token_latency_ms: f64,
    pub load_slowdown: f64,
    pub time_scale: f64,
    pub seed: u64,
}

/// Everything one `cachepick replay` produced.
#[derive(Clone, Debug, Serialize)]
pub struct Replay {
    pub scenario: String,
    pub via: Via,
    pub speedup: f64,
    pub requests: usize,
    /// Trace time the workload spans, seconds.
    pub trace_span_s: f64,
    pub fleet: FleetSummary,
    pub policies: Vec<PolicyReport>,
    pub skipped: Vec<Skipped>,
    /// The printed table (Markdown).
    pub table: String,
    pub out_dir: PathBuf,
}

/// The fleet replays run on when no `--config` is given: 4 vLLM workers of 8 running slots, the `bytes`
/// tokenizer (exact token counts, cheap), and a KV cache sized so caching matters for the workload.
pub fn default_fleet(scenario: &Scenario, speedup: f64) -> SimConfig {
    let mut sim = SimConfig::new(Engine::Vllm, nz(4));
    sim.tokenizer = cachepick_sim::config::TokenizerConfig::Bytes;
    sim.params.max_model_len = nz(262_144);
    match scenario {
        Scenario::Trace(_) => {
            // Mooncake's ~190 output tokens at 20 ms dominate a slot: 16 slots per worker serve its
            // ~3.7 requests/s near, not beyond, capacity.
            sim.params.max_running = nz(16);
            // 2M tokens per worker, about 150 of Mooncake's ~13k-token prompts: a few minutes of trace,
            // so a conversation's next turn can still find its prefix, but not everything fits.
            sim.params.kv_blocks = nz(131_072);
        }
        Scenario::Burst => {
            sim.params.max_running = nz(8);
            // 65k tokens: a quarter of the 32 groups' 4k-token prefixes fits with room to run; half
            // of them at most, so a fleet where every worker holds every prefix evicts.
            sim.params.kv_blocks = nz(4_096);
        }
    }
    sim.params.time_scale = 1.0 / speedup;
    sim
}

/// Applies the `policy:` section `policy` to the generated cachepick configuration `generated`, on fresh
/// loopback ports, and validates the result.
pub fn apply_policy(generated: &str, policy: &str) -> Result<Config, StageError> {
    let invalid = |what: &str, error: serde_yaml::Error| {
        StageError::Compose(format!("{what} is not YAML: {error}"))
    };
    let mut root: serde_yaml::Value = serde_yaml::from_str(generated)
        .map_err(|error| invalid("the generated configuration", error))?;
    let section: serde_yaml::Value =
        serde_yaml::from_str(policy).map_err(|error| invalid("the policy section", error))?;
    if let serde_yaml::Value::Mapping(map) = &mut root {
        map.insert("policy".into(), section);
    }
    let text = serde_yaml::to_string(&root).map_err(|error| invalid("the configuration", error))?;
    on_free_ports(
        &text,
        "the replay configuration",
        config::Overrides::default(),
    )
}

/// Runs the replay: every policy in turn on a fresh fleet, then writes the report and the charts.
pub async fn run(options: &ReplayOptions) -> Result<Replay, ReplayError> {
    let burst = matches!(options.scenario, Scenario::Burst);
    let speedup = options.speedup.unwrap_or(if burst { 4.0 } else { 8.0 });
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(ReplayError::Speedup(speedup));
    }
    let sim = match &options.sim_config {
        Some(path) => cachepick_sim::decode::load(path, &SimOverrides::default())?,
        None => {
            let mut sim = default_fleet(&options.scenario, speedup);
            sim.seed = options.seed;
            sim
        }
    };
    let mut items: Vec<Item> = match &options.scenario {
        Scenario::Trace(path) => trace::load_mooncake(path, options.limit)?,
        Scenario::Burst => trace::burst(options.seed, options.duration_scale),
    };
    if let Some(limit) = options.limit {
        items.truncate(limit);
    }
    let names: Vec<String> = if options.policies.is_empty() {
        let defaults: &[&str] = if burst {
            &DEFAULT_BURST_POLICIES
        } else {
            &DEFAULT_TRACE_POLICIES
        };
        defaults.iter().map(|name| (*name).to_owned()).collect()
    } else {
        options.policies.clone()
    };
    for name in &names {
        if policy_yaml(name, &sim).is_none() {
            let known: Vec<&str> = POLICIES.iter().map(|(name, _)| *name).collect();
            return Err(ReplayError::UnknownPolicy(name.clone(), known.join(", ")));
        }
    }
    let envoy_path = match options.via {
        Via::Envoy => Some(
            crate::envoy::find_envoy(options.envoy.as_deref()).ok_or_else(|| {
                ReplayError::Envoy(
                    "not found (pass --envoy, set CACHEPICK_ENVOY, or run scripts/provision-envoy)"
                        .to_owned(),
                )
            })?,
        ),
        Via::Direct => None,
    };
    let first = items.first().map_or(0, |item| item.timestamp_ms);
    let span_ms = items.last().map_or(0, |item| item.timestamp_ms) - first;
    let replay_s = span_ms as f64 / 1000.0 / speedup;
    // About 40 buckets over the run, at least a second each.
    let bucket = Duration::from_secs_f64((replay_s / 40.0).max(1.0).round());
    let phase_names: Vec<&str> = if burst {
        trace::BURST_PHASES.iter().map(|phase| phase.name).collect()
    } else {
        vec!["all"]
    };
    let prompts = PromptBuilder::new(&sim.tokenizer, options.seed);
    let scenario_name = match &options.scenario {
        Scenario::Trace(path) => path.display().to_string(),
        Scenario::Burst => "burst".to_owned(),
    };
    if options.verbose {
        println!(
            "replay {scenario_name}: {} requests over {:.0} s of trace time, speed-up {speedup} \
             ({replay_s:.0} s per policy), via {:?}; fleet: {} {} workers, {} KV blocks of {} tokens and {} \
             running each, time scale {}",
            items.len(),
            span_ms as f64 / 1000.0,
            options.via,
            sim.workers,
            sim.engine.as_str(),
            sim.params.kv_blocks,
            sim.block_size,
            sim.params.max_running,
            sim.params.time_scale,
        );
    }

    let mut reports = Vec::new();
    let mut skipped = Vec::new();
    for name in &names {
        let yaml = policy_yaml(name, &sim).unwrap_or_default();
        match run_policy(
            options,
            &sim,
            &items,
            &prompts,
            speedup,
            name,
            &yaml,
            envoy_path.as_deref(),
            &phase_names,
            bucket,
        )
        .await
        {
            Ok(report) => {
                if options.verbose {
                    println!(
                        "  {name:<28} {} requests in {:.0} s: hit {}, TTFT p50 {} ms, errors {}, rejected {}, dropped {}",
                        report.requests,
                        report.wall_s,
                        report
                            .hit_rate
                            .map_or("-".to_owned(), |h| format!("{:.1}%", h * 100.0)),
                        report
                            .ttft_ms
                            .p50
                            .map_or("-".to_owned(), |t| format!("{t:.0}")),
                        report.errors,
                        report.rejections,
                        report.dropped,
                    );
                }
                reports.push(report);
            }
            Err(error) => {
                if options.verbose {
                    println!("  {name:<28} skipped: {error}");
                }
                skipped.push(Skipped {
                    policy: name.clone(),
                    error: error.to_string(),
                });
            }
        }
    }
    if reports.is_empty() {
        let errors: Vec<String> = skipped
            .iter()
            .map(|s| format!("{}: {}", s.policy, s.error))
            .collect();
        return Err(ReplayError::NothingRan(errors.join("; ")));
    }

    let mut table = report::table(&reports);
    let phases = report::phase_table(&reports);
    if !phases.is_empty() {
        table.push('\n');
        table.push_str(&phases);
    }
    table.push_str("\ndecision reasons:\n");
    table.push_str(&report::reasons(&reports));
    let replay = Replay {
        scenario: scenario_name,
        via: options.via,
        speedup,
        requests: items.len(),
        trace_span_s: span_ms as f64 / 1000.0,
        fleet: FleetSummary {
            engine: sim.engine.as_str().to_owned(),
            workers: sim.workers.get(),
            block_size: sim.block_size.get(),
            tokenizer: sim.tokenizer.label(),
            kv_blocks: sim.params.kv_blocks.get(),
            max_running: sim.params.max_running.get(),
            prefill_overhead_ms: sim.params.prefill_overhead.as_secs_f64() * 1e3,
            prefill_per_token_us: sim.params.prefill_per_token.as_secs_f64() * 1e6,
            inter_token_latency_ms: sim.params.inter_token_latency.as_secs_f64() * 1e3,
            load_slowdown: sim.params.load_slowdown,
            time_scale: sim.params.time_scale,
            seed: sim.seed,
        },
        policies: reports,
        skipped,
        table,
        out_dir: options.out.clone(),
    };
    write_outputs(&replay, burst, options.duration_scale)?;
    Ok(replay)
}

#[allow(clippy::too_many_arguments)]
async fn run_policy(
    options: &ReplayOptions,
    sim: &SimConfig,
    items: &[Item],
    prompts: &PromptBuilder,
    speedup: f64,
    name: &str,
    yaml: &str,
    envoy_path: Option<&Path>,
    phases: &[&str],
    bucket: Duration,
) -> Result<PolicyReport, ReplayError> {
    let mut stage = Stage::start(sim, |generated| apply_policy(generated, yaml)).await?;
    if let Some(path) = envoy_path {
        stage = stage.with_envoy(path).await?;
    }
    let route = match &stage.envoy {
        Some(envoy) => Route::Envoy(envoy.listen),
        None => Route::Direct(
            PickerClient::connect(stage.picker.listen())
                .await
                .map_err(|error| ReplayError::Picker(error.to_string()))?,
        ),
    };
    let started = Instant::now();
    let samples = drive::drive(
        &route,
        items,
        prompts,
        &sim.model,
        speedup,
        options.max_in_flight,
    )
    .await;
    let wall = started.elapsed();
    let workers = drive::per_worker(&samples, &stage.fleet.endpoints());
    stage.stop().await?;
    Ok(PolicyReport::new(
        name, yaml, &samples, workers, phases, bucket, wall,
    ))
}

fn write(path: &Path, contents: &str) -> Result<(), ReplayError> {
    std::fs::write(path, contents).map_err(|source| ReplayError::Write {
        path: path.to_owned(),
        source,
    })
}

fn write_outputs(replay: &Replay, burst: bool, scale: f64) -> Result<(), ReplayError> {
    let dir = &replay.out_dir;
    std::fs::create_dir_all(dir).map_err(|source| ReplayError::Write {
        path: dir.clone(),
        source,
    })?;
    let json = serde_json::to_string_pretty(replay).unwrap_or_default();
    write(&dir.join("report.json"), &json)?;
    let caption = format!(
        "cachepick replay {} via {:?}, {} requests, speed-up {}, {} workers × {} running, {} KV blocks",
        replay.scenario,
        replay.via,
        replay.requests,
        replay.speedup,
        replay.fleet.workers,
        replay.fleet.max_running,
        replay.fleet.kv_blocks
    );
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
        let pick = |names: &[&str]| -> Vec<&PolicyReport> {
            names
                .iter()
                .filter_map(|name| replay.policies.iter().find(|r| r.policy == *name))
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

//! `cachepick replay`: routing quality measured on a workload — a Mooncake JSONL trace or the synthetic
//! burst scenario — replayed open-loop against a simulated fleet, once per routing policy, every request
//! through the real picker (over ext_proc, or through a real Envoy). Reports per policy the prefix-hit
//! rate the workers report, TTFT and end-to-end latency, worker balance and decision reasons, as a table,
//! JSON and SVG charts.
//!
//! A *policy* is a named `policy:` section applied to the cachepick configuration generated for the
//! fleet ([`POLICIES`]); each policy runs on a freshly started fleet with the same seed, once per *arm*:
//! per owner-index mode ([`IndexMode`], `--index`) and per number of picker replicas (`--replicas`,
//! several pickers behind one Envoy that round-robins them, each learning its own index). A run can
//! also crash a worker mid-replay ([`fault`]) and count the picker's stale credits after the restart.
//!
//! A *front* arm puts another router in front of the same fresh fleet instead of cachepick ([`front`]:
//! `smg`, vllm-router, …), measured the same way, so the router an operator runs today has a row in the
//! same table. `--load X` runs the fleet X times slower than the trace assumes, arrivals unchanged, and
//! every arm reports how busy the fleet was ([`utilisation`]).

pub mod drive;
pub mod fault;
pub mod front;
pub mod report;
pub mod svg;
pub mod trace;
pub mod utilisation;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use cachepick::config::{self, Config};
use cachepick_sim::{Engine, KvEventsConfig, KvEventsFormat, SimConfig, SimOverrides};

use crate::client::Client as PickerClient;
use crate::nz;
use crate::stage::{Stage, StageError, on_free_ports};
use drive::Route;
use fault::{Crash, FaultReport};
use front::{Front, FrontError};
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

pub use cachepick::config::IndexMode;

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
    /// Picker replicas per arm, one arm per entry (default `[1]`); more than one needs `Via::Envoy`,
    /// which round-robins the replicas.
    pub replicas: Vec<usize>,
    /// Owner-index modes, one arm per entry (default `[Approximate]`).
    pub index_modes: Vec<IndexMode>,
    /// Crash a worker mid-replay in every arm and report stale credits.
    pub crash: Option<Crash>,
    /// Other routers, one arm each after the policies' arms ([`front`]).
    pub fronts: Vec<Front>,
    /// The fleet runs this many times slower than the trace assumes (its time scale is multiplied by
    /// it); arrivals are unchanged. Above 1 the same trace offers the fleet more load.
    pub load: f64,
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
            replicas: vec![1],
            index_modes: vec![IndexMode::Approximate],
            crash: None,
            fronts: Vec::new(),
            load: 1.0,
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
    // Pure prefix affinity: the cache-aware mode with its queue gate turned off.
    ("affinity", "mode: cache_aware\nworker_queue_limit: null"),
    (
        "gate",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: null",
    ),
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
/// What `--policies` runs when empty and other routers are compared ([`ReplayOptions::fronts`]):
/// cachepick with the gate and floor, with the gate alone, and with pure affinity.
pub const DEFAULT_FRONT_POLICIES: [&str; 3] = ["gate_floor", "gate", "affinity"];
/// In `--policies`, runs no cachepick arm: only the fronts.
pub const NO_POLICIES: &str = "none";
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
    #[error("--load must be a positive number, got {0}")]
    Load(f64),
    #[error(transparent)]
    Front(#[from] FrontError),
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
    #[error(
        "--replicas {0} needs --via envoy: the replicas sit behind one Envoy, which round-robins each \
         request's ext_proc stream to one of them (direct mode asks a single picker)"
    )]
    ReplicasNeedEnvoy(usize),
    #[error("--replicas must be at least 1")]
    NoReplicas,
    #[error("--crash-worker {index}: the fleet has {workers} workers (0 to {last})", last = .workers.saturating_sub(1))]
    CrashWorker { index: usize, workers: usize },
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
    /// `--load`: how many times slower than the trace assumes the fleet runs.
    pub load: f64,
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
    /// Owner-index modes the arms ran with.
    pub index_modes: Vec<IndexMode>,
    /// Picker replica counts the arms ran with.
    pub replicas: Vec<usize>,
    /// The worker crash every arm had, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crash: Option<Crash>,
    /// One report per arm.
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
    apply_arm(generated, policy, IndexMode::Approximate)
}

/// [`apply_policy`], with every pool's owner index in `mode`: `index: {mode: <mode>}` in each pool,
/// written only when the mode is not `approximate` (the default, and until the product knows the key,
/// an unknown one that validation refuses).
pub fn apply_arm(generated: &str, policy: &str, mode: IndexMode) -> Result<Config, StageError> {
    on_free_ports(
        &arm_text(generated, policy, mode)?,
        "the replay configuration",
        config::Overrides::default(),
    )
}

/// The text [`apply_arm`] validates: `generated` with the `policy:` section and every pool's index mode.
pub fn arm_text(generated: &str, policy: &str, mode: IndexMode) -> Result<String, StageError> {
    let invalid = |what: &str, error: serde_yaml::Error| {
        StageError::Compose(format!("{what} is not YAML: {error}"))
    };
    let mut root: serde_yaml::Value = serde_yaml::from_str(generated)
        .map_err(|error| invalid("the generated configuration", error))?;
    let section: serde_yaml::Value =
        serde_yaml::from_str(policy).map_err(|error| invalid("the policy section", error))?;
    if let serde_yaml::Value::Mapping(map) = &mut root {
        map.insert("policy".into(), section);
        if mode != IndexMode::Approximate
            && let Some(serde_yaml::Value::Sequence(pools)) = map.get_mut("pools")
        {
            for pool in pools {
                if let serde_yaml::Value::Mapping(pool) = pool {
                    let mut index = serde_yaml::Mapping::new();
                    index.insert("mode".into(), mode.as_str().into());
                    pool.insert("index".into(), index.into());
                }
            }
        }
    }
    serde_yaml::to_string(&root).map_err(|error| invalid("the configuration", error))
}

/// THE one place that turns the simulator's KV event publisher on, for an `events` arm's fleet.
///
/// The workers publish in their engine's current format (a fleet configuration that chose one keeps
/// it), and `Fleet::cachepick_config()` then names every worker's `kv_events:` sockets itself.
pub fn enable_sim_events(sim: &mut SimConfig) {
    if sim.kv_events.is_none() {
        sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::default_for(sim.engine)));
    }
}

/// One arm of the run: a policy with an index mode and a number of picker replicas.
#[derive(Clone, Debug)]
struct Arm {
    label: String,
    policy: String,
    yaml: String,
    index_mode: IndexMode,
    replicas: usize,
    /// Another router instead of cachepick; `policy`, `yaml`, `index_mode` and `replicas` then do
    /// not apply.
    front: Option<Front>,
}

/// Every arm, policy by policy: the policy's name, then `/<mode>` when the run compares modes or uses a
/// non-default one, then `/x<n>` when it uses more than one replica anywhere.
fn arms(names: &[String], sim: &SimConfig, modes: &[IndexMode], replicas: &[usize]) -> Vec<Arm> {
    let show_mode = modes != [IndexMode::Approximate];
    let show_replicas = replicas != [1];
    let mut arms = Vec::new();
    for name in names {
        let yaml = policy_yaml(name, sim).unwrap_or_default();
        for &index_mode in modes {
            for &count in replicas {
                let mut label = name.clone();
                if show_mode {
                    label.push('/');
                    label.push_str(index_mode.as_str());
                }
                if show_replicas {
                    let _ = write!(label, "/x{count}");
                }
                arms.push(Arm {
                    label,
                    policy: name.clone(),
                    yaml: yaml.clone(),
                    index_mode,
                    replicas: count,
                    front: None,
                });
            }
        }
    }
    arms
}

/// Runs the replay: every policy in turn on a fresh fleet, then writes the report and the charts.
pub async fn run(options: &ReplayOptions) -> Result<Replay, ReplayError> {
    let burst = matches!(options.scenario, Scenario::Burst);
    let speedup = options.speedup.unwrap_or(if burst { 4.0 } else { 8.0 });
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(ReplayError::Speedup(speedup));
    }
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(ReplayError::Load(options.load));
    }
    let mut sim = match &options.sim_config {
        Some(path) => cachepick_sim::decode::load(path, &SimOverrides::default())?,
        None => {
            let mut sim = default_fleet(&options.scenario, speedup);
            sim.seed = options.seed;
            sim
        }
    };
    sim.params.time_scale *= options.load;
    let fixed_ports = sim.base_port.is_some();
    if !fixed_ports
        && options
            .fronts
            .iter()
            .any(|front| matches!(front.target, front::Target::Url(_)))
    {
        return Err(FrontError::UrlNeedsFixedPorts.into());
    }
    let mut items: Vec<Item> = match &options.scenario {
        Scenario::Trace(path) => trace::load_mooncake(path, options.limit)?,
        Scenario::Burst => trace::burst(options.seed, options.duration_scale),
    };
    if let Some(limit) = options.limit {
        items.truncate(limit);
    }
    let names: Vec<String> = if options.policies.iter().any(|name| name == NO_POLICIES) {
        Vec::new()
    } else if options.policies.is_empty() {
        let defaults: &[&str] = if !options.fronts.is_empty() {
            &DEFAULT_FRONT_POLICIES
        } else if burst {
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
    let replicas = if options.replicas.is_empty() {
        vec![1]
    } else {
        options.replicas.clone()
    };
    if replicas.contains(&0) {
        return Err(ReplayError::NoReplicas);
    }
    let most = replicas.iter().copied().max().unwrap_or(1);
    if most > 1 && options.via != Via::Envoy {
        return Err(ReplayError::ReplicasNeedEnvoy(most));
    }
    let modes = if options.index_modes.is_empty() {
        vec![IndexMode::Approximate]
    } else {
        options.index_modes.clone()
    };
    if let Some(crash) = &options.crash {
        let workers = sim.workers.get() as usize;
        if crash.worker >= workers {
            return Err(ReplayError::CrashWorker {
                index: crash.worker,
                workers,
            });
        }
    }
    let mut arms = arms(&names, &sim, &modes, &replicas);
    arms.extend(options.fronts.iter().map(|front| Arm {
        label: front.label.clone(),
        policy: front.label.clone(),
        yaml: String::new(),
        index_mode: IndexMode::Approximate,
        replicas: 1,
        front: Some(front.clone()),
    }));
    let envoy_path = match options.via {
        Via::Envoy if !names.is_empty() => Some(
            crate::envoy::find_envoy(options.envoy.as_deref()).ok_or_else(|| {
                ReplayError::Envoy(
                    "not found (pass --envoy, set CACHEPICK_ENVOY, or run scripts/provision-envoy)"
                        .to_owned(),
                )
            })?,
        ),
        Via::Envoy | Via::Direct => None,
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
             ({replay_s:.0} s per arm), load {}, via {:?}; fleet: {} {} workers, {} KV blocks of {} tokens \
             and {} running each, time scale {}",
            items.len(),
            span_ms as f64 / 1000.0,
            options.load,
            options.via,
            sim.workers,
            sim.engine.as_str(),
            sim.params.kv_blocks,
            sim.block_size,
            sim.params.max_running,
            sim.params.time_scale,
        );
    }

    if options.verbose && (modes != [IndexMode::Approximate] || replicas != [1]) {
        let modes: Vec<&str> = modes.iter().map(|mode| mode.as_str()).collect();
        let counts: Vec<String> = replicas.iter().map(ToString::to_string).collect();
        println!(
            "arms: every policy with index mode {} and {} picker replica(s)",
            modes.join(", "),
            counts.join(", ")
        );
    }
    if options.verbose
        && let Some(crash) = &options.crash
    {
        println!(
            "fault: worker {} crashes at {:.1} s of every arm and restarts {:.1} s later",
            crash.worker,
            crash.at.as_secs_f64(),
            crash.restart_after.as_secs_f64()
        );
    }

    let mut reports = Vec::new();
    let mut skipped = Vec::new();
    for arm in &arms {
        let name = &arm.label;
        match run_arm(
            options,
            &sim,
            &items,
            &prompts,
            speedup,
            arm,
            envoy_path.as_deref(),
            &phase_names,
            bucket,
        )
        .await
        {
            Ok(report) => {
                if options.verbose {
                    println!(
                        "  {name:<28} {} requests in {:.0} s: hit {}, TTFT p50 {} ms, errors {}, rejected {}, dropped {}, slots busy {}",
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
                        report
                            .utilisation
                            .map_or("-".to_owned(), |u| format!("{:.0}%", u.slots * 100.0)),
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
    let counters = report::front_counters(&reports);
    if !counters.is_empty() {
        table.push_str(
            "\nthe other routers' own routing counters (their /metrics after the run):\n",
        );
        table.push_str(&counters);
    }
    let per_replica = report::replica_decisions(&reports);
    if !per_replica.is_empty() {
        table.push_str("\ndecisions per picker replica:\n");
        table.push_str(&per_replica);
    }
    let stale = report::stale_credits(&reports);
    if !stale.is_empty() {
        table.push_str(
            "\nstale credits (requests the picker sent to the restarted worker for a prefix it credited it \
             with, served with 0 cached tokens, of those credited):\n",
        );
        table.push_str(&stale);
    }
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
            load: options.load,
            seed: sim.seed,
        },
        index_modes: modes,
        replicas,
        crash: options.crash,
        policies: reports,
        skipped,
        table,
        out_dir: options.out.clone(),
    };
    write_outputs(&replay, burst, options.duration_scale)?;
    Ok(replay)
}

#[allow(clippy::too_many_arguments)]
async fn run_arm(
    options: &ReplayOptions,
    sim: &SimConfig,
    items: &[Item],
    prompts: &PromptBuilder,
    speedup: f64,
    arm: &Arm,
    envoy_path: Option<&Path>,
    phases: &[&str],
    bucket: Duration,
) -> Result<PolicyReport, ReplayError> {
    // The arrival window, over which the fleet's load is read.
    let first = items.first().map_or(0, |item| item.timestamp_ms);
    let last = items.last().map_or(0, |item| item.timestamp_ms);
    let window = Duration::from_secs_f64((last - first) as f64 / 1000.0 / speedup);
    if let Some(front) = &arm.front {
        return run_front(
            options, sim, items, prompts, speedup, arm, front, phases, bucket, window,
        )
        .await;
    }
    let mut sim = sim.clone();
    if arm.index_mode == IndexMode::Events {
        enable_sim_events(&mut sim);
    }
    let mut stage = Stage::start(&sim, |generated| {
        apply_arm(generated, &arm.yaml, arm.index_mode)
    })
    .await?
    .with_replicas(arm.replicas)
    .await?;
    if let Some(path) = envoy_path {
        stage = stage.with_envoy(path).await?;
    }
    let route = match &stage.envoy {
        Some(envoy) => Route::Proxy(envoy.listen),
        None => Route::Direct(
            PickerClient::connect(stage.picker.listen())
                .await
                .map_err(|error| ReplayError::Picker(error.to_string()))?,
        ),
    };
    let started = Instant::now();
    let start = tokio::time::Instant::now();
    let crashing = async {
        match &options.crash {
            Some(crash) => Some(fault::crash(&stage.fleet, crash, start).await),
            None => None,
        }
    };
    let (samples, crashed, utilisation) = tokio::join!(
        drive::drive(
            &route,
            items,
            prompts,
            &sim.model,
            speedup,
            options.max_in_flight,
        ),
        crashing,
        utilisation::watch(&stage.fleet, window, READ_LOAD_EVERY),
    );
    let wall = started.elapsed();
    let workers = drive::per_worker(&samples, &stage.fleet.endpoints());
    let mut replica_decisions = Vec::new();
    for picker in stage.pickers() {
        replica_decisions.push(decisions(picker.metrics_listen()).await);
    }
    let fault = options.crash.as_ref().zip(crashed).map(|(crash, crashed)| {
        let worker = stage
            .fleet
            .worker(crash.worker)
            .map_or_else(String::new, |worker| worker.addr().to_string());
        match crashed {
            Ok(times) => FaultReport::new(crash, worker, times, &samples),
            Err(error) => FaultReport::failed(crash, worker, error),
        }
    });
    stage.stop().await?;
    let mut report = PolicyReport::new(
        &arm.policy,
        &arm.yaml,
        &samples,
        workers,
        phases,
        bucket,
        wall,
    );
    report.arm = arm.label.clone();
    report.index_mode = arm.index_mode.as_str().to_owned();
    report.replicas = arm.replicas;
    report.replica_decisions = replica_decisions;
    report.fault = fault;
    report.utilisation = utilisation;
    Ok(report)
}

/// How often the fleet's slots and queues are read during an arm.
const READ_LOAD_EVERY: Duration = Duration::from_millis(100);

/// A front arm: a fresh fleet, the other router in front of it, the same workload.
#[allow(clippy::too_many_arguments)]
async fn run_front(
    options: &ReplayOptions,
    sim: &SimConfig,
    items: &[Item],
    prompts: &PromptBuilder,
    speedup: f64,
    arm: &Arm,
    front: &Front,
    phases: &[&str],
    bucket: Duration,
    window: Duration,
) -> Result<PolicyReport, ReplayError> {
    let fleet = cachepick_sim::fleet::Fleet::start(sim)
        .await
        .map_err(StageError::from)?;
    let running =
        front::Running::start(front, &fleet.endpoints(), &sim.model, &options.out).await?;
    let route = Route::Proxy(running.addr);
    let started = Instant::now();
    let (samples, utilisation) = tokio::join!(
        drive::drive(
            &route,
            items,
            prompts,
            &sim.model,
            speedup,
            options.max_in_flight,
        ),
        utilisation::watch(&fleet, window, READ_LOAD_EVERY),
    );
    let wall = started.elapsed();
    let workers = drive::per_worker(&samples, &fleet.endpoints());
    let counters = running.routing_counters().await;
    drop(running);
    drop(fleet);
    let command = match &front.target {
        front::Target::Command(template) => template.clone(),
        front::Target::Url(addr) => format!("http://{addr}"),
    };
    let mut report = PolicyReport::new(&arm.policy, "", &samples, workers, phases, bucket, wall);
    report.arm = arm.label.clone();
    report.index_mode = "-".to_owned();
    report.front = Some(command);
    report.front_counters = counters;
    report.utilisation = utilisation;
    Ok(report)
}

/// The decisions a picker made: `cachepick_decisions_total` over every pool and reason, from its
/// `/metrics`; `None` when they cannot be read.
async fn decisions(metrics: std::net::SocketAddr) -> Option<u64> {
    let (status, text) = crate::http_exchange(
        http::Method::GET,
        metrics,
        "/metrics",
        "",
        Duration::from_secs(5),
    )
    .await?;
    (status == 200).then(|| decision_total(&text))
}

/// Σ `cachepick_decisions_total{…}` in a Prometheus exposition.
fn decision_total(exposition: &str) -> u64 {
    exposition
        .lines()
        .filter(|line| line.starts_with("cachepick_decisions_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64)
        .sum()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sim() -> SimConfig {
        default_fleet(&Scenario::Burst, 4.0)
    }

    fn labels(modes: &[IndexMode], replicas: &[usize]) -> Vec<String> {
        let names = ["gate".to_owned(), "gate_floor".to_owned()];
        arms(&names, &sim(), modes, replicas)
            .into_iter()
            .map(|arm| arm.label)
            .collect()
    }

    #[test]
    fn arms_are_named_after_their_policy_unless_the_run_compares_more() {
        use IndexMode::{Approximate, Events};
        assert_eq!(labels(&[Approximate], &[1]), ["gate", "gate_floor"]);
        assert_eq!(
            labels(&[Approximate, Events], &[3]),
            [
                "gate/approximate/x3",
                "gate/events/x3",
                "gate_floor/approximate/x3",
                "gate_floor/events/x3"
            ]
        );
        assert_eq!(
            labels(&[Approximate], &[1, 2]),
            ["gate/x1", "gate/x2", "gate_floor/x1", "gate_floor/x2"]
        );
        assert_eq!(
            labels(&[Events], &[1]),
            ["gate/events", "gate_floor/events"]
        );
        assert_eq!("events".parse(), Ok(Events));
        assert!("exact".parse::<IndexMode>().is_err());
    }

    const GENERATED: &str = "listen: 127.0.0.1:9002\npools:\n  - model: a\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:8001\n  - model: b\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:8002\n";

    #[test]
    fn the_index_mode_is_written_into_every_pool_only_when_not_approximate() {
        let pools = |mode| -> Vec<serde_yaml::Value> {
            let text = arm_text(GENERATED, "mode: round_robin", mode).expect("composed");
            let root: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
            assert_eq!(root["policy"]["mode"].as_str(), Some("round_robin"));
            root["pools"].as_sequence().cloned().expect("pools")
        };
        let events = pools(IndexMode::Events);
        assert_eq!(events.len(), 2);
        for pool in &events {
            assert_eq!(pool["index"]["mode"].as_str(), Some("events"), "{pool:?}");
        }
        for pool in &pools(IndexMode::Approximate) {
            assert!(pool.get("index").is_none(), "{pool:?}");
        }
        let approximate = apply_arm(GENERATED, "mode: round_robin", IndexMode::Approximate);
        assert!(approximate.is_ok(), "{approximate:?}");
        // Until the product knows `pools[].index`, the key is an unknown one, and says where it is.
        match apply_arm(GENERATED, "mode: round_robin", IndexMode::Events) {
            Ok(config) => assert_eq!(config.pools.len(), 2),
            Err(error) => assert!(error.to_string().contains("index"), "{error}"),
        }
    }

    #[test]
    fn events_mode_turns_on_the_engines_own_event_format() {
        let mut vllm = sim();
        enable_sim_events(&mut vllm);
        assert_eq!(
            vllm.kv_events.map(|events| events.format),
            Some(KvEventsFormat::default_for(Engine::Vllm))
        );
    }

    #[test]
    fn a_pickers_decisions_are_summed_over_pools_and_reasons() {
        let exposition = "# HELP cachepick_decisions_total decisions\n\
            cachepick_decisions_total{pool=\"a\",reason=\"cache_hit\"} 7\n\
            cachepick_decisions_total{pool=\"a\",reason=\"cache_miss\"} 3\n\
            cachepick_decisions_total{pool=\"b\",reason=\"cache_hit\"} 0\n\
            cachepick_rejections_total{pool=\"a\",reason=\"no_workers\"} 5\n";
        assert_eq!(decision_total(exposition), 10);
    }
}

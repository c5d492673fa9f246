//! `cachepick replay`: routing quality measured on a workload — a Mooncake JSONL trace, the synthetic
//! burst scenario or the prefill-heavy agent workload ([`agents`]) — replayed open-loop against a
//! simulated fleet, once per routing policy, every request through the real picker (over ext_proc, or
//! through a real Envoy). Reports per policy the prefix-hit rate the workers report, TTFT and
//! end-to-end latency, worker balance and decision reasons, as a table, JSON and SVG charts, beside the
//! workload's ideal hit rate and, under the step model, the [`oracle`]'s row: the limit every other row
//! is a ratio to.
//!
//! A *policy* is a named `policy:` section applied to the cachepick configuration generated for the
//! fleet ([`POLICIES`], [`arms`]); each policy runs on a freshly started fleet with the same seed, once per *arm*:
//! per owner-index mode ([`IndexMode`], `--index`) and per number of picker replicas (`--replicas`,
//! several pickers behind one Envoy that round-robins them, each learning its own index). A run can
//! also crash a worker mid-replay ([`fault`]) and count the picker's stale credits after the restart.
//!
//! A *front* arm puts another router in front of the same fresh fleet instead of cachepick ([`front`]:
//! `smg`, vllm-router, …), measured the same way, so the router an operator runs today has a row in the
//! same table. Routers that decide but do not forward run behind the replay's own ext_proc server:
//! the re-implemented peers ([`peers`]), the oracle, and NVIDIA Dynamo's own selection service
//! ([`dynamo`]). `--load X` runs the fleet X times slower than the trace assumes, arrivals unchanged,
//! and every arm reports how busy the fleet was ([`utilisation`]).

pub mod agents;
pub mod arms;
pub mod behind;
pub mod chat;
pub mod documents;
pub mod drive;
pub mod dynamo;
pub mod fault;
pub mod front;
pub mod oracle;
mod output;
pub mod peers;
pub mod rates;
pub mod report;
mod runner;
mod scenario;
pub mod svg;
pub mod trace;
pub mod utilisation;
pub mod virtual_clock;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use cachepick::config;
use cachepick_sim::{Engine, SimConfig, SimOverrides, Timing};

use crate::stage::StageError;
use arms::{Arm, arms};
use fault::Crash;
use front::{Front, FrontError};
use report::{PolicyReport, Skipped};
use trace::{Item, PromptBuilder};

pub use scenario::{SCENARIO_NAMES, Scenario, default_fleet};

pub use arms::{
    DEFAULT_BURST_POLICIES, DEFAULT_FRONT_POLICIES, DEFAULT_TRACE_POLICIES, NO_POLICIES, POLICIES,
    apply_arm, apply_policy, arm_text, enable_sim_events, gate_limits, load_yaml, policy_yaml,
};

/// How requests reach the picker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// Through a real Envoy with the generated configuration.
    Envoy,
    /// Over the picker's ext_proc gRPC interface (the messages Envoy sends), then to the chosen worker.
    Direct,
}

impl Via {
    /// The route of a replay asked for `explicit` (`envoy` or `direct`, from `--via`) with picker
    /// `replicas` per arm. Unasked, more than one replica means Envoy, since the replicas sit behind
    /// it; an explicit `direct` with replicas stays direct, and [`run`] refuses it saying why.
    pub fn chosen(explicit: Option<Via>, replicas: &[usize]) -> Via {
        match explicit {
            Some(via) => via,
            None if replicas.iter().any(|&n| n > 1) => Via::Envoy,
            None => Via::Direct,
        }
    }
}

impl std::str::FromStr for Via {
    type Err = String;

    fn from_str(text: &str) -> Result<Via, String> {
        match text {
            "envoy" => Ok(Via::Envoy),
            "direct" => Ok(Via::Direct),
            other => Err(format!("expected envoy or direct, got `{other}`")),
        }
    }
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
    /// The default fleet's timing model (a `--config` file names its own).
    pub timing: Timing,
    /// Re-implemented peers ([`peers`]), one arm per replica count each, after the fronts.
    pub peers: Vec<peers::PeerRule>,
    /// Dynamo's own selection service ([`dynamo`]): one arm per command template (`{port}` its HTTP
    /// port), after the re-implemented peers.
    pub dynamo_selectors: Vec<String>,
    /// Run the oracle's arm after the others (the step model only).
    pub oracle: bool,
    /// cachepick's scrape interval in model time (`None`: the product's default), to measure how the
    /// drift between replicas grows with it.
    pub scrape_interval: Option<Duration>,
    /// Each arm of more than one replica also runs with `replica_sync` between its replicas.
    pub replica_sync: bool,
    /// A prefill/decode fleet: the first N workers prefill, the rest decode; every cachepick arm's pool
    /// gets `pd: {}` (vLLM fleets, through Envoy only). `None`: aggregated.
    pub pd_prefill: Option<usize>,
    /// With `pd_prefill`: the cachepick arms' `pd.local_prefill_tokens` (0: every request's prefill is
    /// remote); `None` keeps the default.
    pub pd_local_prefill_tokens: Option<u64>,
    /// Print progress lines.
    pub verbose: bool,
}

impl ReplayOptions {
    pub fn new(scenario: Scenario) -> ReplayOptions {
        let out = PathBuf::from("target/replay").join(match &scenario {
            Scenario::Trace(path) => path
                .file_stem()
                .map_or_else(|| "trace".to_owned(), |s| s.to_string_lossy().into_owned()),
            synthetic => synthetic.name(),
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
            timing: Timing::Step,
            peers: Vec::new(),
            dynamo_selectors: Vec::new(),
            oracle: true,
            scrape_interval: None,
            replica_sync: false,
            pd_prefill: None,
            pd_local_prefill_tokens: None,
            verbose: true,
        }
    }
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
    #[error(transparent)]
    Selector(#[from] dynamo::SelectorError),
    #[error("the picker did not become ready: {0}")]
    Picker(String),
    #[error("Envoy: {0}")]
    Envoy(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Virtual(String),
    #[error("no policy could run: {0}")]
    NothingRan(String),
    #[error(
        "--replicas {0} needs --via envoy: the replicas sit behind one Envoy, which round-robins each \
         request's ext_proc stream to one of them (direct mode asks a single picker)"
    )]
    ReplicasNeedEnvoy(usize),
    #[error("--replicas must be at least 1")]
    NoReplicas,
    #[error(
        "--pd {prefill}: a PD replay needs a fleet of more than {prefill} workers, at least one prefilling, --via envoy (the decode leg's body is Envoy's to send), and a simulator file whose prefill_workers, if it names them, are the same {prefill}"
    )]
    PdFleet { prefill: usize },
    #[error("--crash-worker {index}: the fleet has {workers} workers (0 to {last})", last = .workers.saturating_sub(1))]
    CrashWorker { index: usize, workers: usize },
    #[error("unknown scenario `{0}`; known: {known} (a trace is given with --trace instead)", known = SCENARIO_NAMES.join(", "))]
    UnknownScenario(String),
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
    /// `step` or `slots`.
    pub timing: String,
    /// Step model: the GPU profile and the tokens per step.
    pub profile: String,
    pub batch_tokens: u32,
    /// Slots model: its per-request knobs.
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
    /// The hit rate of a perfect router with an unbounded cache ([`trace::ideal_hit_rate`]).
    pub ideal_hit_rate: f64,
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

impl Replay {
    /// Why the replay failed as a comparison, if it did: an arm that could not run is a failed
    /// comparison, not a smaller one.
    pub fn failure(&self) -> Option<String> {
        failure_of(&self.skipped)
    }
}

fn failure_of(skipped: &[Skipped]) -> Option<String> {
    (!skipped.is_empty()).then(|| {
        let arms: Vec<&str> = skipped
            .iter()
            .map(|skipped| skipped.policy.as_str())
            .collect();
        format!("{} arm(s) could not run: {}", arms.len(), arms.join(", "))
    })
}

/// Runs the replay: every policy in turn on a fresh fleet, then the other routers and the oracle, then
/// writes the report and the charts.
///
/// Over 100 lines: the options checked, the arms built and run, the report assembled, in order;
/// each step reads most of the ones before.
pub async fn run(options: &ReplayOptions) -> Result<Replay, ReplayError> {
    let burst = matches!(options.scenario, Scenario::Burst);
    let speedup = options
        .speedup
        .unwrap_or_else(|| options.scenario.default_speedup());
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(ReplayError::Speedup(speedup));
    }
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(ReplayError::Load(options.load));
    }
    let mut sim = match &options.sim_config {
        Some(path) => cachepick_sim::decode::load(path, &SimOverrides::default())?,
        None => {
            let mut sim = default_fleet(&options.scenario, speedup, options.timing);
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
    let mut items: Vec<Item> =
        options
            .scenario
            .requests(options.seed, options.duration_scale, |path| {
                Ok(trace::load_mooncake(path, options.limit)?)
            })?;
    if let Some(limit) = options.limit {
        items.truncate(limit);
    }
    let names = policy_names(options, burst, &sim)?;
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
    if let Some(prefill) = options.pd_prefill {
        let workers = sim.workers.get() as usize;
        let named = sim.prefill_workers.map(|named| named as usize);
        if prefill == 0
            || prefill >= workers
            || options.via != Via::Envoy
            || named.is_some_and(|named| named != prefill)
        {
            return Err(ReplayError::PdFleet { prefill });
        }
        // SGLang's workers must know their roles (a decode worker refuses a request without a room);
        // vLLM's serve either leg as the request asks.
        if sim.engine == Engine::Sglang {
            sim.prefill_workers = u32::try_from(prefill).ok();
        }
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
    let mut arms = arms(&names, &sim, &modes, &replicas, options.replica_sync);
    arms.extend(options.fronts.iter().map(Arm::front));
    // The in-process peers route aggregated: no PD form of them exists. The oracle has one.
    let aggregated = options.pd_prefill.is_none();
    for rule in options.peers.iter().filter(|_| aggregated) {
        arms.extend(Arm::peers(*rule, &replicas));
    }
    for (nth, template) in options.dynamo_selectors.iter().enumerate() {
        dynamo::check_template(template)?;
        if !aggregated {
            return Err(dynamo::SelectorError::Disaggregated.into());
        }
        arms.push(Arm::dynamo(template, nth));
    }
    if options.oracle && sim.timing == Timing::Step {
        arms.push(Arm::oracle());
    }
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
    let scenario_name = options.scenario.name();
    let ideal = trace::ideal_hit_rate(&items);
    if options.verbose {
        announce(
            options, &sim, &items, span_ms, speedup, ideal, &modes, &replicas,
        );
    }

    let workload = runner::Workload {
        options,
        sim: &sim,
        items: &items,
        prompts: &prompts,
        speedup,
        envoy: envoy_path.as_deref(),
        phases: &phase_names,
        bucket,
    };
    let mut reports = Vec::new();
    let mut skipped = Vec::new();
    for arm in &arms {
        let name = &arm.label;
        match workload.run(arm).await {
            Ok(report) => {
                if options.verbose {
                    println!("  {name:<28} {}", report.summary());
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
    let _ = writeln!(
        table,
        "\nideal prefix-hit rate (every block seen before hits): {:.1}%",
        ideal * 100.0
    );
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
    let rates = report::learned_rates(&reports);
    if !rates.is_empty() {
        table.push_str(
            "\nprefill rates the picker learned (model time; median over workers, model tokens/s):\n",
        );
        table.push_str(&rates);
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
        ideal_hit_rate: ideal,
        fleet: FleetSummary::of(&sim, options.load),
        index_modes: modes,
        replicas,
        crash: options.crash,
        policies: reports,
        skipped,
        table,
        out_dir: options.out.clone(),
    };
    output::write_outputs(&replay, burst, options.duration_scale)?;
    Ok(replay)
}

/// The cachepick policies to run: `--policies`, or the scenario's defaults; `none` runs none.
fn policy_names(
    options: &ReplayOptions,
    burst: bool,
    sim: &SimConfig,
) -> Result<Vec<String>, ReplayError> {
    let names: Vec<String> = if options.policies.iter().any(|name| name == NO_POLICIES) {
        Vec::new()
    } else if options.policies.is_empty() {
        let others = !options.fronts.is_empty()
            || !options.peers.is_empty()
            || !options.dynamo_selectors.is_empty();
        let defaults: &[&str] = if others {
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
        if policy_yaml(name, sim).is_none() {
            let known: Vec<&str> = POLICIES.iter().map(|(name, _)| *name).collect();
            return Err(ReplayError::UnknownPolicy(name.clone(), known.join(", ")));
        }
    }
    Ok(names)
}

impl FleetSummary {
    fn of(sim: &SimConfig, load: f64) -> FleetSummary {
        FleetSummary {
            engine: sim.engine.as_str().to_owned(),
            workers: sim.workers.get(),
            block_size: sim.block_size.get(),
            tokenizer: sim.tokenizer.label(),
            kv_blocks: sim.params.kv_blocks.get(),
            max_running: sim.params.max_running.get(),
            timing: sim.timing.as_str().to_owned(),
            profile: sim.params.profile.name.clone(),
            batch_tokens: sim.params.batch_tokens.get(),
            prefill_overhead_ms: sim.params.prefill_overhead.as_secs_f64() * 1e3,
            prefill_per_token_us: sim.params.prefill_per_token.as_secs_f64() * 1e6,
            inter_token_latency_ms: sim.params.inter_token_latency.as_secs_f64() * 1e3,
            load_slowdown: sim.params.load_slowdown,
            time_scale: sim.params.time_scale,
            load,
            seed: sim.seed,
        }
    }
}

/// The run's opening lines: the workload, the fleet, the arms, the fault.
#[allow(clippy::too_many_arguments)]
fn announce(
    options: &ReplayOptions,
    sim: &SimConfig,
    items: &[Item],
    span_ms: u64,
    speedup: f64,
    ideal: f64,
    modes: &[IndexMode],
    replicas: &[usize],
) {
    let model = match sim.timing {
        Timing::Step => format!(
            "step model on {} ({} tokens a step)",
            sim.params.profile.name, sim.params.batch_tokens
        ),
        Timing::Slots => "slots model".to_owned(),
    };
    println!(
        "replay {}: {} requests over {:.0} s of trace time (ideal hit rate {:.1}%), speed-up {speedup} \
         ({:.0} s per arm), load {}, via {:?}; fleet: {} {} workers, {model}, {} KV blocks of {} tokens \
         and {} running each, time scale {}",
        options.scenario.name(),
        items.len(),
        span_ms as f64 / 1000.0,
        ideal * 100.0,
        span_ms as f64 / 1000.0 / speedup,
        options.load,
        options.via,
        sim.workers,
        sim.engine.as_str(),
        sim.params.kv_blocks,
        sim.block_size,
        sim.params.max_running,
        sim.params.time_scale,
    );
    if modes != [IndexMode::Approximate] || replicas != [1] {
        let modes: Vec<&str> = modes.iter().map(|mode| mode.as_str()).collect();
        let counts: Vec<String> = replicas.iter().map(ToString::to_string).collect();
        println!(
            "arms: every policy with index mode {} and {} picker replica(s)",
            modes.join(", "),
            counts.join(", ")
        );
    }
    if let Some(crash) = &options.crash {
        println!(
            "fault: worker {} crashes at {:.1} s of every arm and restarts {:.1} s later",
            crash.worker,
            crash.at.as_secs_f64(),
            crash.restart_after.as_secs_f64()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_wins_over_a_scenario_and_burst_is_the_default() {
        let trace = PathBuf::from("mooncake.jsonl");
        assert_eq!(
            Scenario::chosen(Some(trace.clone()), Some("agents")).ok(),
            Some(Scenario::Trace(trace))
        );
        assert_eq!(Scenario::chosen(None, None).ok(), Some(Scenario::Burst));
        for name in SCENARIO_NAMES {
            let scenario = Scenario::chosen(None, Some(name)).expect("a known name");
            assert_eq!(scenario.name(), name);
        }
        assert_eq!(
            Scenario::chosen(None, Some("documents")).ok(),
            Some(Scenario::Documents)
        );
        assert!(matches!(
            Scenario::chosen(None, Some("storm")),
            Err(ReplayError::UnknownScenario(name)) if name == "storm"
        ));
    }

    #[test]
    fn replicas_imply_envoy_unless_the_route_is_asked_for() {
        assert_eq!(Via::chosen(None, &[1]), Via::Direct);
        assert_eq!(Via::chosen(None, &[]), Via::Direct);
        assert_eq!(Via::chosen(None, &[1, 3]), Via::Envoy);
        assert_eq!(Via::chosen(Some(Via::Direct), &[3]), Via::Direct);
        assert_eq!(Via::chosen(Some(Via::Envoy), &[1]), Via::Envoy);
        assert_eq!("envoy".parse(), Ok(Via::Envoy));
        assert_eq!("direct".parse(), Ok(Via::Direct));
        assert!("grpc".parse::<Via>().is_err());
    }

    #[test]
    fn a_replay_with_an_arm_that_could_not_run_failed() {
        assert_eq!(failure_of(&[]), None);
        let skipped = |policy: &str| Skipped {
            policy: policy.to_owned(),
            error: "the front did not start".to_owned(),
        };
        assert_eq!(
            failure_of(&[skipped("smg"), skipped("vllm-router")]).as_deref(),
            Some("2 arm(s) could not run: smg, vllm-router")
        );
    }
}

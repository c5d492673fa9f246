//! `cachepick replay --clock virtual`: the replay as a discrete-event simulation in one process, on a
//! virtual clock, so that a cell is a function of its inputs and runs as fast as the CPU allows.
//!
//! The fleet is [`OfflineWorker`](cachepick_sim::offline::OfflineWorker)s: the step model's ranks, the
//! API loop and the engine's `/metrics`, advanced by their step durations ([`engine`]). cachepick's
//! arms run the product's own request pipeline, roster and index in process with the time passed in
//! ([`picker`]); the oracle and the re-implemented peers read the workers' true state ([`routers`]).
//! Every arm of a seed sees the same workload and the same fleet; seeds change the jitter draws, the
//! routers' tie-breaks, the synthetic scenarios and how copies of a trace are shifted. Same seed, same
//! report, byte for byte: nothing on the path reads a clock or an unseeded generator.
//!
//! What it does not model, and the wall-clock replay does: Envoy and the network (a decision and a
//! delivery take no time; replicas are round-robined per request), the picker's own CPU time, the
//! scraper's concurrency cap, a real tokenizer's time (the profile's front stands for it), restarts
//! and crashes, prefill/decode fleets, the slots model, and the `events` index (refused here for now).

mod engine;
pub mod figures;
pub mod goodput;
pub mod limits;
mod picker;
mod routers;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use cachepick::config::IndexMode;
use cachepick_sim::offline::WorkerTokenizer;
use cachepick_sim::{SimConfig, SimOverrides, Timing};

use super::arms::policy_yaml;
use super::peers::PeerRule;
use super::trace::{self, Item, PromptBuilder};
use super::{ReplayError, Scenario, agents, default_fleet};
use engine::{Router, simulate};
use figures::{Estimate, RunFigures};

/// Model seconds before the first arrival: the pickers' first scrape rounds, as the wall-clock replay
/// waits for its pickers to be ready.
pub const WARM_UP_S: f64 = 1.0;

/// Each copy of a workload merged into a larger fleet's starts up to this many trace seconds late.
pub const COPY_SHIFT_S: f64 = 60.0;

/// The fleet one copy of a workload is made for: the default fleet's 4 workers.
pub const WORKERS_PER_COPY: u32 = 4;

/// The arms `--clock virtual` runs unless told: cachepick's default and its named policies that an
/// operator chooses between (`time_floor_all` is the default's rule, so it is not run twice), round
/// robin among them.
pub const DEFAULT_POLICIES: [&str; 6] = [
    "default",
    "round_robin",
    "least_load",
    "affinity",
    "gate_floor",
    "time_floor",
];

/// What `cachepick replay --clock virtual` runs.
#[derive(Clone, Debug)]
pub struct VirtualOptions {
    pub scenario: Scenario,
    /// Simulator configuration of the fleet (as `cachepick sim --config`); `None` is the default fleet.
    pub sim_config: Option<PathBuf>,
    /// Workers in the fleet (`None`: the configuration's); a workload is scaled to it by merging
    /// copies, one per [`WORKERS_PER_COPY`] workers.
    pub workers: Option<u32>,
    /// cachepick policies by name ([`super::POLICIES`], or `default` for the product's defaults);
    /// empty runs [`DEFAULT_POLICIES`].
    pub policies: Vec<String>,
    pub peers: Vec<PeerRule>,
    pub oracle: bool,
    /// Picker (and peer router) replicas, one arm per entry.
    pub replicas: Vec<usize>,
    /// cachepick's owner-index modes, one arm per entry (default: approximate).
    pub index_modes: Vec<IndexMode>,
    /// Every cachepick arm of more than one replica also runs with `replica_sync`.
    pub replica_sync: bool,
    /// The first seed and how many.
    pub seed: u64,
    pub seeds: usize,
    pub limit: Option<usize>,
    /// The fleet runs this many times slower than the trace assumes: arrivals at trace time ÷ load.
    pub load: f64,
    /// Burst and agents: multiplies the scenario's length.
    pub duration_scale: f64,
    pub scrape_interval: Option<Duration>,
    /// Jobs run at once (`None`: the machine's cores).
    pub jobs: Option<usize>,
    pub out: PathBuf,
}

/// One request of a workload. Its prompt's text and tokens are made again when a run needs them
/// ([`Workload::prompt`]) rather than held: a 64-worker Mooncake workload's prompts
/// are gigabytes, and a run holds only those in flight.
#[derive(Clone, Debug)]
pub struct Request {
    /// Model seconds.
    pub at: f64,
    /// The prompt's tokens as the workers count them.
    pub prompt_len: u32,
    pub max_tokens: u32,
    item: Item,
}

/// A prompt's text and its tokens.
pub type Prompt = (Arc<str>, Arc<[u32]>);

/// Prompts are held, made once per seed, while they take at most this many bytes; a larger workload's
/// are made again whenever a run needs one.
pub const HELD_PROMPT_BYTES: usize = 1 << 30;

/// A seed's workload.
pub struct Workload {
    pub requests: Vec<Request>,
    pub ideal_hit_rate: f64,
    /// Every request's prompt, when they fit in [`HELD_PROMPT_BYTES`].
    held: Option<Arc<Vec<Prompt>>>,
    prompts: PromptBuilder,
    tokenizer: Arc<WorkerTokenizer>,
    model: String,
}

impl Workload {
    /// Request `index`'s prompt and its tokens as the workers tokenize them (built when the workload
    /// was, so tokenizing cannot fail here; an empty prompt if it somehow does).
    pub fn prompt(&self, index: usize) -> Prompt {
        if let Some(held) = self.held.as_ref().and_then(|held| held.get(index)) {
            return held.clone();
        }
        let text: Arc<str> = self
            .requests
            .get(index)
            .map(|request| self.prompts.prompt(&request.item))
            .unwrap_or_default()
            .into();
        let tokens = self.tokenizer.tokens(&text).unwrap_or_default().into();
        (text, tokens)
    }

    /// The same requests arriving `load` times faster than at load 1 (after the same warm-up): what a
    /// goodput search replays at each load it tries.
    pub fn at_load(&self, load: f64) -> Workload {
        let requests = self
            .requests
            .iter()
            .map(|request| Request {
                at: WARM_UP_S + (request.at - WARM_UP_S) / load,
                ..request.clone()
            })
            .collect();
        Workload {
            requests,
            ideal_hit_rate: self.ideal_hit_rate,
            held: self.held.clone(),
            prompts: self.prompts.clone(),
            tokenizer: Arc::clone(&self.tokenizer),
            model: self.model.clone(),
        }
    }

    /// The body of request `index` with prompt `text`: the completion the wall-clock replay sends.
    pub fn body(&self, index: usize, text: &str) -> Vec<u8> {
        let max_tokens = self
            .requests
            .get(index)
            .map_or(1, |request| request.max_tokens);
        serde_json::json!({
            "model": self.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
        .into_bytes()
    }
}

/// One arm: a router and its replicas.
#[derive(Clone, Debug)]
enum ArmKind {
    Picker {
        yaml: String,
        mode: IndexMode,
        sync: bool,
    },
    Peer(PeerRule),
    Oracle,
}

#[derive(Clone, Debug)]
struct Arm {
    label: String,
    kind: ArmKind,
    replicas: usize,
    /// cachepick's default as it ships (approximate index, no `replica_sync`): what the others at
    /// the same replica count are paired with.
    baseline: bool,
}

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

/// The fleet of the run: the configured or default one, at model time, resized to `workers`.
fn fleet(options: &VirtualOptions, seed: u64) -> Result<SimConfig, ReplayError> {
    let mut sim = match &options.sim_config {
        Some(path) => cachepick_sim::decode::load(path, &SimOverrides::default())?,
        None => default_fleet(&options.scenario, 1.0, Timing::Step),
    };
    if sim.timing != Timing::Step {
        return Err(ReplayError::Virtual(
            "--clock virtual runs the step model only (the fleet asks for `timing: slots`)".into(),
        ));
    }
    sim.seed = seed;
    // Virtual time is model time.
    sim.params.time_scale = 1.0;
    if let Some(workers) = options.workers {
        sim.workers = std::num::NonZeroU32::new(workers)
            .filter(|n| n.get() <= SimConfig::MAX_WORKERS)
            .ok_or_else(|| {
                ReplayError::Virtual(format!(
                    "--workers must be 1 to {}, got {workers}",
                    SimConfig::MAX_WORKERS
                ))
            })?;
    }
    Ok(sim)
}

/// Seed `nth` of `of`'s workload: one copy per [`WORKERS_PER_COPY`] workers, each copy's prefixes its
/// own (block ids offset) and its start shifted by a seeded draw of up to [`COPY_SHIFT_S`], merged in
/// arrival order; arrivals at trace time ÷ load after [`WARM_UP_S`]. A trace cut to `--limit`
/// requests gives each seed its own window of them ([`window`]); the synthetic scenarios are drawn
/// from the seed.
fn workload(
    options: &VirtualOptions,
    sim: &SimConfig,
    seed: u64,
    (nth, of): (usize, usize),
) -> Result<Workload, ReplayError> {
    let copies = sim.workers.get().div_ceil(WORKERS_PER_COPY).max(1);
    let mut items: Vec<Item> = Vec::new();
    let mut shift_rng = SplitMix(seed ^ 0x5EED_C0DE);
    for copy in 0..copies {
        let copy_seed = seed.wrapping_add(u64::from(copy).wrapping_mul(1_000_003));
        let mut one: Vec<Item> = match &options.scenario {
            Scenario::Trace(path) => {
                window(trace::load_mooncake(path, None)?, options.limit, nth, of)
            }
            Scenario::Burst => trace::burst(copy_seed, options.duration_scale),
            Scenario::Agents => agents::agents(copy_seed, options.duration_scale),
        };
        if let Some(limit) = options.limit {
            one.truncate(limit);
        }
        let shift_ms = if copy == 0 {
            0
        } else {
            (shift_rng.unit() * COPY_SHIFT_S * 1000.0) as u64
        };
        let offset = u64::from(copy) << 40;
        for mut item in one {
            item.timestamp_ms += shift_ms;
            for id in &mut item.hash_ids {
                *id = id.wrapping_add(offset);
            }
            items.push(item);
        }
    }
    items.sort_by_key(|item| item.timestamp_ms);
    let ideal_hit_rate = trace::ideal_hit_rate(&items);
    let tokenizer = WorkerTokenizer::load(sim).map_err(ReplayError::Virtual)?;
    let prompts = PromptBuilder::new(&sim.tokenizer, seed);
    let first = items.first().map_or(0, |item| item.timestamp_ms);
    let mut requests = Vec::with_capacity(items.len());
    let mut held = Vec::new();
    let mut bytes = 0_usize;
    for item in items {
        let text = prompts.prompt(&item);
        let tokens = tokenizer.tokens(&text).map_err(ReplayError::Virtual)?;
        requests.push(Request {
            at: WARM_UP_S + (item.timestamp_ms - first) as f64 / 1000.0 / options.load,
            prompt_len: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            max_tokens: item.output_length,
            item,
        });
        bytes = bytes.saturating_add(text.len() + tokens.len() * 4);
        if bytes <= HELD_PROMPT_BYTES {
            held.push((Arc::<str>::from(text), Arc::<[u32]>::from(tokens)));
        }
    }
    Ok(Workload {
        held: (bytes <= HELD_PROMPT_BYTES).then(|| Arc::new(held)),
        requests,
        ideal_hit_rate,
        prompts,
        tokenizer: Arc::new(tokenizer),
        model: sim.model.clone(),
    })
}

/// Window `nth` of `of` of a trace cut to `limit` requests: the windows' starts are spread evenly over
/// the trace, the first at its start (the wall-clock replay's `--limit` cell), so that seeds see
/// different traffic of the same trace. Each window's times are made relative to its first request.
fn window(items: Vec<Item>, limit: Option<usize>, nth: usize, of: usize) -> Vec<Item> {
    let Some(limit) = limit.filter(|limit| *limit < items.len()) else {
        return items;
    };
    let room = items.len() - limit;
    let start = if of > 1 { room * nth / (of - 1) } else { 0 };
    let mut cut: Vec<Item> = items.into_iter().skip(start).take(limit).collect();
    let first = cut.first().map_or(0, |item| item.timestamp_ms);
    for item in &mut cut {
        item.timestamp_ms -= first;
    }
    cut
}

/// A seeded generator of the workload's shifts (SplitMix64): the rig's own, so a dependency's
/// algorithm change cannot move a workload.
struct SplitMix(u64);

impl SplitMix {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Every arm the options ask for, in table order: cachepick's, then the peers', then the oracle.
fn arms(options: &VirtualOptions, sim: &SimConfig) -> Result<Vec<Arm>, ReplayError> {
    let names: Vec<String> = if options.policies.is_empty() {
        DEFAULT_POLICIES
            .iter()
            .map(|name| (*name).to_owned())
            .collect()
    } else {
        options.policies.clone()
    };
    let replicas = if options.replicas.is_empty() {
        vec![1]
    } else {
        options.replicas.clone()
    };
    if replicas.contains(&0) {
        return Err(ReplayError::NoReplicas);
    }
    let suffix = |n: usize| {
        if replicas.len() > 1 || n > 1 {
            format!("/x{n}")
        } else {
            String::new()
        }
    };
    let mut arms = Vec::new();
    let modes = if options.index_modes.is_empty() {
        vec![IndexMode::Approximate]
    } else {
        options.index_modes.clone()
    };
    let mode_suffix = |mode: IndexMode| match mode {
        IndexMode::Approximate if modes.len() == 1 => String::new(),
        mode => format!("/{}", mode.as_str()),
    };
    for name in &names {
        let yaml = if name == "default" {
            "{}".to_owned()
        } else {
            policy_yaml(name, sim).ok_or_else(|| {
                let known: Vec<&str> = super::POLICIES.iter().map(|(name, _)| *name).collect();
                ReplayError::UnknownPolicy(name.clone(), format!("default, {}", known.join(", ")))
            })?
        };
        // Only the cache-aware mode reads an owner index or the peers' dispatches.
        let cache_aware =
            !["round_robin", "least_load", "balance_threshold"].contains(&name.as_str());
        let modes: &[IndexMode] = if cache_aware {
            &modes
        } else {
            &[IndexMode::Approximate]
        };
        for &mode in modes {
            for &n in &replicas {
                let label = format!("{name}{}{}", mode_suffix(mode), suffix(n));
                arms.push(Arm {
                    label: label.clone(),
                    kind: ArmKind::Picker {
                        yaml: yaml.clone(),
                        mode,
                        sync: false,
                    },
                    replicas: n,
                    baseline: name == "default" && mode == IndexMode::Approximate,
                });
                if options.replica_sync && n > 1 && cache_aware {
                    arms.push(Arm {
                        label: format!("{label}/sync"),
                        kind: ArmKind::Picker {
                            yaml: yaml.clone(),
                            mode,
                            sync: true,
                        },
                        replicas: n,
                        baseline: false,
                    });
                }
            }
        }
    }
    for rule in &options.peers {
        for &n in &replicas {
            arms.push(Arm {
                label: format!("{}{}", rule.label(), suffix(n)),
                kind: ArmKind::Peer(*rule),
                replicas: n,
                baseline: false,
            });
        }
    }
    if options.oracle {
        arms.push(Arm {
            label: super::oracle::LABEL.to_owned(),
            kind: ArmKind::Oracle,
            replicas: 1,
            baseline: false,
        });
    }
    Ok(arms)
}

/// One arm on one seed's workload.
fn run_arm(
    arm: &Arm,
    sim: &SimConfig,
    workload: &Workload,
    options: &VirtualOptions,
    seed: u64,
) -> Result<RunFigures, ReplayError> {
    let requests = workload.requests.len();
    let router_seed = seed ^ 0xC0FF_EE00;
    let mut router: Box<dyn Router> = match &arm.kind {
        ArmKind::Picker { yaml, mode, sync } => {
            let config = picker::configuration(sim, yaml, *mode, options.scrape_interval)?;
            Box::new(picker::PickerRouter::new(
                &config,
                sim,
                arm.replicas,
                *sync,
                requests,
                router_seed,
            )?)
        }
        ArmKind::Peer(rule) => Box::new(routers::PeerRouter::new(
            *rule,
            sim,
            arm.replicas,
            requests,
            router_seed,
        )),
        ArmKind::Oracle => Box::new(routers::OracleRouter),
    };
    Ok(simulate(sim, workload, router.as_mut()))
}

/// Runs every arm on every seed, `jobs` at a time; the report and how fast it ran.
pub fn run(options: &VirtualOptions) -> Result<(VirtualReport, Speed), ReplayError> {
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(ReplayError::Load(options.load));
    }
    if options.seeds == 0 {
        return Err(ReplayError::Virtual("--seeds must be at least 1".into()));
    }
    let started = std::time::Instant::now();
    let seeds: Vec<u64> = (0..options.seeds as u64)
        .map(|n| options.seed.wrapping_add(n))
        .collect();
    let first = fleet(options, options.seed)?;
    let arms = arms(options, &first)?;
    // Seed by seed: its fleet and workload are built once and shared by its arms, which run `jobs`
    // at a time; only one seed's workload is held at once.
    let threads = options
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .clamp(1, arms.len().max(1));
    let mut results: BTreeMap<(usize, usize), RunFigures> = BTreeMap::new();
    let mut bounds = Vec::with_capacity(seeds.len());
    let mut ideals = Vec::with_capacity(seeds.len());
    let mut requests = 0;
    for (nth, &seed) in seeds.iter().enumerate() {
        let sim = fleet(options, seed)?;
        let workload = workload(options, &sim, seed, (nth, seeds.len()))?;
        requests = workload.requests.len();
        let (runs, bound) = std::thread::scope(|scope| {
            // The limits need no arm: worked out beside them.
            let bound = scope.spawn(|| limits::of(&workload, &sim, options.load));
            let runs = run_seed(&arms, &sim, &workload, options, seed, threads);
            (runs, bound.join())
        });
        let bound = bound.map_err(|_| ReplayError::Virtual("the limits' thread failed".into()))?;
        for (arm, figures) in runs {
            let figures = figures.map_err(|error| {
                ReplayError::Virtual(format!(
                    "arm {}: {error}",
                    arms.get(arm).map_or("?", |a| a.label.as_str())
                ))
            })?;
            results.insert((nth, arm), figures);
        }
        bounds.push(bound);
        ideals.push(workload.ideal_hit_rate);
    }
    let mut reports = Vec::new();
    let mut gpu_seconds = 0.0;
    for (index, arm) in arms.iter().enumerate() {
        let runs: Vec<RunFigures> = (0..seeds.len())
            .filter_map(|nth| results.get(&(nth, index)).cloned())
            .collect();
        gpu_seconds += runs.iter().map(|run| run.gpu_seconds).sum::<f64>();
        reports.push(arm_report(arm, runs));
    }
    pair(&mut reports);
    for arm in &mut reports {
        arm.hit_vs_ceiling = Estimate::of(arm.runs.iter().zip(&bounds).map(|(run, bound)| {
            run.hit_rate
                .filter(|_| bound.belady_hit_rate > 0.0)
                .map(|hit| hit / bound.belady_hit_rate)
        }));
    }
    let ideal = Estimate::of(ideals.iter().copied().map(Some));
    let mut report = VirtualReport {
        scenario: options.scenario.name(),
        clock: "virtual",
        workers: first.workers.get(),
        dp_size: first.dp_size.get(),
        load: options.load,
        seeds,
        requests,
        ideal_hit_rate: ideal,
        unlimited_hit_rate: Estimate::of(bounds.iter().map(|b| Some(b.unlimited_hit_rate))),
        belady_hit_rate: Estimate::of(bounds.iter().map(|b| Some(b.belady_hit_rate))),
        compute_bound_load: Estimate::of(bounds.iter().map(|b| Some(b.compute_bound_load))),
        arms: reports,
        table: String::new(),
    };
    report.table = table(&report);
    let speed = Speed {
        wall_s: started.elapsed().as_secs_f64(),
        gpu_seconds,
        runs: report.seeds.len() * arms.len(),
    };
    Ok((report, speed))
}

/// Every arm on one seed's workload, `threads` at a time; each arm's figures or why it failed.
fn run_seed(
    arms: &[Arm],
    sim: &SimConfig,
    workload: &Workload,
    options: &VirtualOptions,
    seed: u64,
    threads: usize,
) -> Vec<(usize, Result<RunFigures, String>)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::with_capacity(arms.len()));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let at = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(arm) = arms.get(at) else {
                        break;
                    };
                    let figures = run_arm(arm, sim, workload, options, seed)
                        .map_err(|error| error.to_string());
                    done.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((at, figures));
                }
            });
        }
    });
    let mut done = done
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    done.sort_by_key(|(arm, _)| *arm);
    done
}

/// Each arm's TTFT p90 as a ratio to the oracle's and to the default's, seed by seed. Pairing on the
/// seed removes what the seeds' workloads differ by (a window of a trace is busier than another), so
/// a difference between arms shows where their separate intervals would hide it.
fn pair(reports: &mut [ArmReport]) {
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
        .find(|arm| arm.arm == super::oracle::LABEL)
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

fn arm_report(arm: &Arm, runs: Vec<RunFigures>) -> ArmReport {
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
        runs,
    }
}

/// `mean ± half-width`, or `–`.
fn shown(estimate: Option<&Estimate>, scale: f64, digits: usize) -> String {
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
fn table(report: &VirtualReport) -> String {
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
    out
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

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
//! and crashes, prefill/decode fleets and the slots model. KV events arrive whole and in order.
//!
//! The files: [`workload`] the requests of a seed, [`report`] what is reported, [`limits`] the
//! workload's limits, [`goodput`] the search for each arm's highest load within an SLO.

mod engine;
pub mod figures;
pub mod goodput;
pub mod limits;
mod picker;
pub mod regret;
mod report;
mod routers;
mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use cachepick::config::IndexMode;
use cachepick_sim::{SimConfig, SimOverrides, Timing};

use super::arms::policy_yaml;
use super::peers::PeerRule;
use super::{ReplayError, Scenario, default_fleet};
use engine::{Router, simulate};
use figures::{Estimate, RunFigures};
use picker::JoinStart;
pub use report::{ArmReport, Speed, VirtualReport, write};
use report::{arm_report, pair, shown, table};
use workload::workload;
pub use workload::{
    COPY_SHIFT_S, HELD_PROMPT_BYTES, Prompt, Request, WARM_UP_S, WORKERS_PER_COPY, Workload,
};

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
    /// Every run also measures its decisions' regret against the soonest worker ([`regret`]).
    pub regret: bool,
    /// Every cachepick arm of more than one replica runs twice with its last replica joining this
    /// many model seconds after the first arrival: cold, and with its siblings' owner indexes
    /// adopted (`picker::Join`); the figures then hold the windows after the join.
    pub join_at: Option<f64>,
    pub out: PathBuf,
}

/// One arm: a router and its replicas.
#[derive(Clone, Debug)]
enum ArmKind {
    Picker {
        yaml: String,
        mode: IndexMode,
        sync: bool,
        join: Option<picker::Join>,
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
                        join: None,
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
                            join: None,
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
    Ok(match options.join_at {
        Some(at) => arms.into_iter().flat_map(|arm| joining(arm, at)).collect(),
        None => arms,
    })
}

/// A cachepick arm of several replicas as three whose figures are cut at `at`: its last replica
/// there from the start (`/present`), joining at `at` cold (`/join`) and warm (`/join+warm`). Other
/// arms stay as they are.
fn joining(arm: Arm, at: f64) -> Vec<Arm> {
    let ArmKind::Picker {
        yaml, mode, sync, ..
    } = &arm.kind
    else {
        return vec![arm];
    };
    if arm.replicas < 2 {
        return vec![arm];
    }
    [
        (JoinStart::Present, "present"),
        (JoinStart::Cold, "join"),
        (JoinStart::Warm, "join+warm"),
    ]
    .into_iter()
    .map(|(start, name)| Arm {
        label: format!("{}/{name}", arm.label),
        kind: ArmKind::Picker {
            yaml: yaml.clone(),
            mode: *mode,
            sync: *sync,
            join: Some(picker::Join { at, start }),
        },
        replicas: arm.replicas,
        baseline: false,
    })
    .collect()
}

/// One arm on one seed's workload.
fn run_arm(
    arm: &Arm,
    sim: &SimConfig,
    workload: &Workload,
    options: &VirtualOptions,
    seed: u64,
) -> Result<RunFigures, ReplayError> {
    let mut router = router_of(arm, sim, workload.requests.len(), options, seed)?;
    let regret = options
        .regret
        .then(|| regret::Regret::new(sim.params.profile.front));
    let joined = match &arm.kind {
        ArmKind::Picker {
            join: Some(join), ..
        } => Some((join.at, arm.replicas - 1)),
        _ => None,
    };
    Ok(simulate(sim, workload, router.as_mut(), regret, joined))
}

/// A fresh router for `arm`, for a run of `requests` requests on `seed`.
fn router_of(
    arm: &Arm,
    sim: &SimConfig,
    requests: usize,
    options: &VirtualOptions,
    seed: u64,
) -> Result<Box<dyn Router>, ReplayError> {
    let router_seed = seed ^ 0xC0FF_EE00;
    Ok(match &arm.kind {
        ArmKind::Picker {
            yaml,
            mode,
            sync,
            join,
        } => {
            let config = picker::configuration(sim, yaml, *mode, options.scrape_interval)?;
            Box::new(picker::PickerRouter::new(
                &config,
                sim,
                (arm.replicas, *sync, *join),
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
        ArmKind::Oracle => Box::new(routers::OracleRouter::default()),
    })
}

/// Runs every arm on every seed, `jobs` at a time; the report and how fast it ran.
pub fn run(options: &VirtualOptions) -> Result<(VirtualReport, Speed), ReplayError> {
    if !(options.load.is_finite() && options.load > 0.0) {
        return Err(ReplayError::Load(options.load));
    }
    if options.seeds == 0 {
        return Err(ReplayError::Virtual("--seeds must be at least 1".into()));
    }
    if let Some(at) = options.join_at
        && (!(at.is_finite() && at >= 0.0) || options.replicas.iter().all(|n| *n < 2))
    {
        return Err(ReplayError::Virtual(format!(
            "--join-at needs a time of 0 s or more and --replicas of 2 or more, got {at} s"
        )));
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
    each_arm(arms, threads, |arm| {
        run_arm(arm, sim, workload, options, seed).map_err(|error| error.to_string())
    })
}

/// `work` on every arm, `threads` arms at a time; the results in arm order, with each arm's index.
fn each_arm<T: Send>(
    arms: &[Arm],
    threads: usize,
    work: impl Fn(&Arm) -> T + Sync,
) -> Vec<(usize, T)> {
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
                    let result = work(arm);
                    done.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((at, result));
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

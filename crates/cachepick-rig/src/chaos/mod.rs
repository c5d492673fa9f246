//! `cachepick chaos`: the picker under faults, through a real Envoy, with the losses counted and
//! explained — and, with `--soak`, the same stage at a steady rate for minutes with the picker's
//! resident memory sampled.
//!
//! The stage: a simulated fleet, the real `cachepick serve` binary as a child process (so it can be
//! SIGKILLed and started again on the same ports: [`child`]), and Envoy with the bootstrap
//! `cachepick envoy-config` generates (buffered mode unless `--mode` says otherwise; `failure_mode_allow: true`, the picker's gRPC
//! health check, the workers from the picker's EDS) plus a JSON access log. Good traffic — a seeded
//! conversation mix ([`traffic`]) — flows at a steady rate while a schedule of faults fires
//! ([`schedule`]): workers crash and restart, their metrics hang or turn to garbage, the picker is killed
//! and restarted, and slow and malformed clients ([`hostile`]) arrive beside the good ones.
//!
//! Every request's end is classified ([`classify`]) from what its client saw, the line Envoy logged
//! for it, and the timeline of what was down when; the report counts requests sent, served and failed,
//! each failure's cause, and the ones a live worker could have served: the target is none.
//!
//! Bounded: every client has a deadline, the run a length, the hostile crowd a size; only loopback.

pub mod child;
pub mod classify;
pub mod hostile;
mod options;
pub mod report;
pub mod schedule;
pub mod traffic;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use cachepick::config::{self, Config, Overrides};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};

use crate::envoy::Envoy;
use crate::nz;
use crate::replay::fault::{self, Crash};
use crate::replay::trace::PromptBuilder;
use child::ChildPicker;
use classify::{Cause, Logged, Observed, Spell, Timeline};
use hostile::{Slow, Target};
pub use options::{ChaosError, ChaosOptions, Mode};
pub use report::{
    ChaosReport, Failure, Fired, Latency, MalformedOutcome, Rss, Tally, histogram_quantiles, table,
};
use report::{describe, judge_malformed, rss_summary};
use schedule::{Fault, Malformed, Step};

/// How long the picker may take to become ready (its first scrape round), at start and after a kill.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// The picker's `max_body_bytes` on the stage: small enough that an oversized client is cheap.
const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Envoy flushes its access log every 200 ms (`Envoy::start_logged`); wait this long for the last lines.
const LOG_FLUSH: Duration = Duration::from_millis(800);
/// Envoy counters the report keeps. The requests the picker did not answer take the bootstrap's
/// fail-open route, whose aggregate counts their retries.
const ENVOY_COUNTERS: [&str; 9] = [
    "http.ingress_http.ext_proc.",
    "http.ingress_http.downstream_rq_",
    "cluster.workers.upstream_rq_retry",
    "cluster.workers_fail_open.upstream_rq_retry",
    "cluster.workers.upstream_cx_connect_fail",
    "cluster.workers.outlier_detection.ejections_enforced_total",
    "cluster.cachepick.health_check.",
    "cluster.cachepick.upstream_cx_connect_fail",
    "cluster.workers.upstream_rq_5xx",
];

fn seconds<S: serde::Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64((duration.as_secs_f64() * 1000.0).round() / 1000.0)
}

fn seconds_opt<S: serde::Serializer>(
    duration: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match duration {
        Some(duration) => seconds(duration, serializer),
        None => serializer.serialize_none(),
    }
}

/// The shared state the fault tasks write.
struct Shared {
    fleet: Fleet,
    picker: Mutex<ChildPicker>,
    listen: SocketAddr,
    timeline: Mutex<Timeline>,
    rss: Mutex<Vec<(f64, u64)>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The fleet a chaos run stands on: `workers` vLLM workers with the byte tokenizer (exact, cheap), 16
/// running slots each, the model at half its real-time durations (a request takes about half a second).
pub fn fleet_config(workers: u32, seed: u64) -> SimConfig {
    let mut sim = SimConfig::new(Engine::Vllm, nz(workers));
    sim.tokenizer = cachepick_sim::config::TokenizerConfig::Bytes;
    sim.params.max_running = nz(16);
    sim.params.time_scale = 0.5;
    sim.seed = seed;
    sim
}

/// The picker's configuration file for `fleet`: its generated one on `listen` and `metrics`, with a
/// 1 MiB body limit.
pub fn picker_config(
    generated: &str,
    listen: SocketAddr,
    metrics: SocketAddr,
) -> Result<(String, Config), ChaosError> {
    let mut root: serde_yaml::Value = serde_yaml::from_str(generated)
        .map_err(|error| ChaosError::Config(format!("the generated file is not YAML: {error}")))?;
    if let serde_yaml::Value::Mapping(map) = &mut root {
        map.insert("listen".into(), listen.to_string().into());
        map.insert("metrics_listen".into(), metrics.to_string().into());
        map.insert("max_body_bytes".into(), (MAX_BODY_BYTES as u64).into());
    }
    let text =
        serde_yaml::to_string(&root).map_err(|error| ChaosError::Config(error.to_string()))?;
    let config = config::parse(&text, "the chaos configuration", &Overrides::default())
        .map_err(|error| ChaosError::Config(error.to_string()))?;
    Ok((text, config))
}

/// Runs the stage, the traffic and (in chaos mode) the schedule; classifies every end; writes
/// `report.json` and `table.md` to `options.out`.
///
/// Over 100 lines: the stage, the run and the account in the order they happen (marked below), all
/// holding the stage's handles; pieces would pass a dozen of them between each other.
pub async fn run(options: &ChaosOptions) -> Result<ChaosReport, ChaosError> {
    if !(options.rate.is_finite() && options.rate > 0.0) {
        return Err(ChaosError::Rate(options.rate));
    }
    if options.workers < 2 {
        return Err(ChaosError::Workers(options.workers));
    }
    let envoy_path =
        crate::envoy::find_envoy(options.envoy.as_deref()).ok_or(ChaosError::NoEnvoy)?;
    std::fs::create_dir_all(&options.out).map_err(|source| ChaosError::Write {
        path: options.out.clone(),
        source,
    })?;
    let out = std::path::absolute(&options.out).unwrap_or_else(|_| options.out.clone());

    // The stage.
    let sim = fleet_config(options.workers, options.seed);
    let fleet = Fleet::start(&sim).await?;
    let listen = crate::free_port().map_err(ChaosError::Port)?;
    let metrics = crate::free_port().map_err(ChaosError::Port)?;
    let (text, config) = picker_config(&fleet.cachepick_config(), listen, metrics)?;
    let config_path = out.join("cachepick.yaml");
    write(&config_path, &text)?;
    let picker_log = out.join("picker.log");
    let _ = std::fs::remove_file(&picker_log);
    let mut picker = ChildPicker::spawn(&options.picker, &config_path, listen, &picker_log)?;
    picker.ready(READY_WITHIN).await?;
    let access_log = out.join("envoy-access.log");
    let _ = std::fs::remove_file(&access_log);
    let pickers = [cachepick::envoy_config::picker_address(listen)];
    let envoy = Envoy::start_logged(
        &envoy_path,
        &config,
        &pickers,
        options.body_mode,
        &access_log,
    )
    .await
    .map_err(|message| ChaosError::Envoy {
        path: envoy_path.display().to_string(),
        message,
    })?;
    let workers: Vec<String> = fleet.endpoints().iter().map(ToString::to_string).collect();
    let shared = Arc::new(Shared {
        fleet,
        picker: Mutex::new(picker),
        listen,
        timeline: Mutex::new(Timeline {
            workers,
            ..Timeline::default()
        }),
        rss: Mutex::new(Vec::new()),
    });
    if options.verbose {
        println!(
            "chaos ({:?}): {} workers, picker {} (pid {:?}), Envoy ({}) on {}; {:.0} s at {} requests/s, seed {}",
            options.mode,
            options.workers,
            listen,
            lock(&shared.picker).pid(),
            options.body_mode,
            envoy.listen,
            options.length.as_secs_f64(),
            options.rate,
            options.seed
        );
    }

    // The run.
    let start = Instant::now();
    let steps = match options.mode {
        Mode::Chaos => schedule::schedule(
            options.length,
            options.workers as usize,
            options.crowd,
            options.seed,
        ),
        Mode::Soak => Vec::new(),
    };
    let good = traffic::conversations(options.length, options.rate, options.seed);
    let prompts = PromptBuilder::new(&sim.tokenizer, options.seed);
    let target = Target {
        envoy: envoy.listen,
        model: sim.model.clone(),
        max_body: MAX_BODY_BYTES,
        start,
        deadline: options.deadline,
    };
    // Slow connections are let go a little after the good traffic's last request could have ended.
    let slow_until = start + options.length + Duration::from_secs(2);
    let sampling = tokio::spawn(sample_rss(
        Arc::clone(&shared),
        start,
        options.rss_every,
        start + options.length + options.deadline,
    ));
    let mut fault_tasks = Vec::new();
    for (index, step) in steps.iter().enumerate() {
        let shared = Arc::clone(&shared);
        let step = step.clone();
        let target = target.clone();
        let prompts = prompts.clone();
        let verbose = options.verbose;
        let seed = options.seed.wrapping_add(index as u64);
        fault_tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + step.at).await;
            if verbose {
                println!(
                    "  {:>6.1} s  {}",
                    start.elapsed().as_secs_f64(),
                    describe(&step.fault)
                );
            }
            let done = fire(&shared, &step, &target, &prompts, index, seed, slow_until).await;
            (step, done)
        }));
    }
    let (sent, not_sent) = traffic::drive(
        envoy.listen,
        &good,
        &prompts,
        &sim.model,
        start,
        options.deadline,
        options.max_in_flight,
    )
    .await;
    let mut fired = Vec::new();
    let mut malformed = Vec::new();
    let mut slow = Vec::new();
    let mut trickled = Vec::new();
    for task in fault_tasks {
        let Ok((step, done)) = task.await else {
            continue;
        };
        let error = match done {
            Done::Nothing => None,
            Done::Failed(error) => Some(error),
            Done::Malformed(outcome) => {
                malformed.push(*outcome);
                None
            }
            Done::Slow(list) => {
                slow.extend(list);
                None
            }
            Done::Trickled(list) => {
                trickled.extend(list);
                None
            }
        };
        fired.push(Fired { step, error });
    }
    sampling.abort();
    tokio::time::sleep(LOG_FLUSH).await;

    // The account.
    let logged = read_access_log(&access_log);
    let timeline = lock(&shared.timeline).clone();
    let mut tally = Tally {
        due: good.len() + trickled.len(),
        not_sent,
        ..Tally::default()
    };
    let mut failures = Vec::new();
    let everything = sent
        .iter()
        .map(|one| ("stream", one.id.clone(), &one.seen))
        .chain(
            trickled
                .iter()
                .map(|(id, seen)| ("trickle", id.clone(), seen)),
        );
    for (kind, id, seen) in everything {
        tally.sent += 1;
        let log = logged.get(&id);
        let cause = classify::classify(seen, log, &timeline);
        let picker_down = timeline.picker_down_during(seen.sent, seen.ended);
        if picker_down {
            tally.during_picker_down += 1;
        }
        if cause == Cause::Served {
            tally.served += 1;
            if picker_down {
                tally.served_during_picker_down += 1;
            }
            continue;
        }
        tally.failed += 1;
        let servable = cause.servable_loss();
        if servable {
            tally.lost_servable += 1;
        }
        if matches!(cause, Cause::WorkerDied { .. }) {
            tally.lost_with_a_worker += 1;
        }
        *tally.by_cause.entry(cause.label()).or_default() += 1;
        failures.push(Failure {
            id,
            kind,
            sent: seen.sent,
            ended: seen.ended,
            cause,
            servable,
            envoy: log.map(|log| format!("{} {} {}", log.code, log.details, log.flags)),
        });
    }
    let malformed: Vec<MalformedOutcome> = malformed
        .into_iter()
        .map(|(kind, id, seen)| {
            let log = logged.get(&id);
            judge_malformed(kind, id.clone(), &seen, log, &timeline)
        })
        .collect();
    let envoy_counters: BTreeMap<String, u64> = envoy
        .stats(&ENVOY_COUNTERS)
        .await
        .unwrap_or_default()
        .into_iter()
        .collect();
    let decision_latency = decision_latency(metrics).await;
    let samples = lock(&shared.rss).clone();
    let picker_starts = lock(&shared.picker).starts();
    let mut rss = rss_summary(samples, options.warmup);
    if picker_starts > 1 {
        // The samples span several processes: a growth from one to another means nothing.
        rss.growth_after_warmup_pct = None;
    }
    drop(envoy);
    lock(&shared.picker).kill();
    drop(shared);

    let mut report = ChaosReport {
        mode: options.mode,
        body_mode: options.body_mode.to_string(),
        length: options.length,
        rate: options.rate,
        seed: options.seed,
        workers: options.workers,
        schedule: fired,
        timeline,
        good: tally,
        failures,
        malformed,
        slow,
        picker_starts,
        decision_latency,
        rss,
        envoy_counters,
        table: String::new(),
        out_dir: out.clone(),
    };
    report.table = table(&report);
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    write(&out.join("report.json"), &json)?;
    write(&out.join("table.md"), &report.table)?;
    Ok(report)
}

/// What a fault task hands back.
enum Done {
    Nothing,
    Failed(String),
    /// `(kind, id, what its client saw)`.
    Malformed(Box<(Malformed, String, Observed)>),
    Slow(Vec<Slow>),
    /// Slow bodies that were whole: good requests.
    Trickled(Vec<(String, Observed)>),
}

// Over 100 lines: one arm per kind of fault, each a few steps against the stage.
#[allow(clippy::too_many_arguments)]
async fn fire(
    shared: &Arc<Shared>,
    step: &Step,
    target: &Target,
    prompts: &PromptBuilder,
    index: usize,
    seed: u64,
    slow_until: Instant,
) -> Done {
    let start = target.start;
    match &step.fault {
        Fault::CrashWorker { worker, down_for } => {
            let crash = Crash {
                worker: *worker,
                at: step.at,
                restart_after: *down_for,
            };
            let endpoint = shared
                .fleet
                .worker(*worker)
                .map_or_else(String::new, |worker| worker.addr().to_string());
            match fault::crash(&shared.fleet, &crash, start).await {
                Ok(times) => {
                    lock(&shared.timeline).workers_down.push(Spell {
                        what: endpoint,
                        from: times.crashed,
                        to: Some(times.restarted),
                        dead: Some(times.died),
                    });
                    Done::Nothing
                }
                Err(error) => {
                    // Down, but not seen back: the spell stays open.
                    lock(&shared.timeline).workers_down.push(Spell {
                        what: endpoint,
                        from: step.at,
                        to: None,
                        dead: None,
                    });
                    Done::Failed(error)
                }
            }
        }
        Fault::Metrics {
            worker,
            mode,
            lasting,
        } => {
            let Some(addr) = shared.fleet.worker(*worker).map(|worker| worker.addr()) else {
                return Done::Failed(format!("no worker {worker}"));
            };
            if let Err(error) = metrics_mode(addr, mode.mode()).await {
                return Done::Failed(error);
            }
            tokio::time::sleep(*lasting).await;
            // The worker may be down now (another fault crashed it): its controls outlive a crash, so
            // keep asking until it is back to answer.
            let give_up = Instant::now() + Duration::from_secs(15);
            loop {
                match metrics_mode(addr, "live").await {
                    Ok(()) => return Done::Nothing,
                    Err(error) if Instant::now() >= give_up => return Done::Failed(error),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        Fault::KillPicker { down_for } => {
            lock(&shared.picker).kill();
            let from = start.elapsed();
            lock(&shared.timeline).picker_down.push(Spell {
                what: "picker".to_owned(),
                from,
                to: None,
                dead: None,
            });
            tokio::time::sleep(*down_for).await;
            if let Err(error) = lock(&shared.picker).start() {
                return Done::Failed(error.to_string());
            }
            let ready = crate::client::wait_ready(shared.listen, READY_WITHIN).await;
            let back = start.elapsed();
            let mut timeline = lock(&shared.timeline);
            if let Some(spell) = timeline
                .picker_down
                .iter_mut()
                .find(|spell| spell.from == from)
            {
                spell.to = ready.is_ok().then_some(back);
            }
            match ready {
                Ok(()) => Done::Nothing,
                Err(error) => Done::Failed(format!("the restarted picker is not ready: {error}")),
            }
        }
        Fault::Slowloris { connections } => {
            let tasks: Vec<_> = (0..*connections)
                .map(|_| {
                    let target = target.clone();
                    tokio::spawn(async move { hostile::slow(&target, false, slow_until).await })
                })
                .collect();
            Done::Slow(joined(tasks).await)
        }
        Fault::StalledBody { clients } => {
            let tasks: Vec<_> = (0..*clients)
                .map(|_| {
                    let target = target.clone();
                    tokio::spawn(async move { hostile::slow(&target, true, slow_until).await })
                })
                .collect();
            Done::Slow(joined(tasks).await)
        }
        Fault::BodyTrickle { clients, over } => {
            let requests = traffic::conversations(Duration::from_secs(60), 1.0, seed);
            let tasks: Vec<_> = requests
                .into_iter()
                .take(*clients)
                .enumerate()
                .map(|(n, request)| {
                    let target = target.clone();
                    let over = *over;
                    let body = traffic::body(prompts, &target.model, &request.item, false);
                    let id = format!("t{index}-{n}");
                    tokio::spawn(async move {
                        let seen = hostile::trickle(&target, &id, body, over).await;
                        (id, seen)
                    })
                })
                .collect();
            Done::Trickled(joined(tasks).await)
        }
        Fault::Malformed { kind } => {
            let id = format!("m{index}");
            let (seen, _) = hostile::malformed(target, *kind, &id, seed).await;
            Done::Malformed(Box::new((*kind, id, seen)))
        }
    }
}

async fn joined<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        if let Ok(one) = task.await {
            out.push(one);
        }
    }
    out
}

/// `POST /admin/metrics {"mode": mode}` to the worker at `addr`.
async fn metrics_mode(addr: SocketAddr, mode: &str) -> Result<(), String> {
    let body = format!("{{\"mode\": \"{mode}\"}}");
    match crate::http_exchange(
        http::Method::POST,
        addr,
        "/admin/metrics",
        &body,
        Duration::from_secs(2),
    )
    .await
    {
        Some((200, _)) => Ok(()),
        Some((status, text)) => Err(format!("/admin/metrics answered {status}: {text}")),
        // A crashed worker does not answer its admin either; its controls outlive the crash.
        None => Err(format!("{addr} /admin/metrics did not answer")),
    }
}

/// Envoy's access log: each request's line by its `x-chaos-id`.
fn read_access_log(path: &Path) -> BTreeMap<String, Logged> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(Logged::parse)
        .collect()
}

/// Samples the picker's RSS every `every` until `until`.
async fn sample_rss(shared: Arc<Shared>, start: Instant, every: Duration, until: Instant) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while Instant::now() < until {
        tick.tick().await;
        let rss = lock(&shared.picker).rss_kib();
        if let Some(kib) = rss {
            lock(&shared.rss).push((start.elapsed().as_secs_f64(), kib));
        }
    }
}

/// The picker's decision latency from its `/metrics`.
async fn decision_latency(metrics: SocketAddr) -> Latency {
    let text = crate::scrape_metrics(metrics, Duration::from_secs(5))
        .await
        .unwrap_or_default();
    histogram_quantiles(&text, "cachepick_decision_seconds")
}

fn write(path: &Path, contents: &str) -> Result<(), ChaosError> {
    std::fs::write(path, contents).map_err(|source| ChaosError::Write {
        path: path.to_owned(),
        source,
    })
}

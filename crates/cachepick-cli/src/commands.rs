//! What each command does once its flags are parsed: the runners `main` dispatches to, apart from the
//! command line's definitions (`main.rs`).

use anyhow::Context;

use cachepick::config::{self, Config, Overrides};

use super::{ChaosArgs, DemoArgs, OverheadArgs, ReplayArgs, SimArgs, shutdown_signal};

/// What `check` says after the effective configuration, as YAML comments: where the debug endpoints
/// are served (the file may leave it to the listeners' addresses), and a one-line verdict.
pub(super) fn check_verdict(config: &Config) -> String {
    let on_off = |on: bool| if on { "on" } else { "off" };
    let workers: usize = config.pools.iter().map(|pool| pool.workers.len()).sum();
    let given = match config.debug_endpoints {
        Some(true) => "debug_endpoints: true",
        Some(false) => "debug_endpoints: false",
        None => "debug_endpoints unset: on where the listener is bound to loopback",
    };
    format!(
        "# effective debug endpoints ({given}): listen {} {}, metrics_listen {} {}\n\
         # ok: valid ({} pool(s), {workers} listed worker(s)); `cachepick serve` starts with it\n",
        config.listen,
        on_off(config.debug_on_listen()),
        config.metrics_listen,
        on_off(config.debug_on_metrics()),
        config.pools.len(),
    )
}

pub(super) async fn sim(config: cachepick_sim::SimConfig, args: &SimArgs) -> anyhow::Result<()> {
    // The simulator writes cachepick's configuration as text; cachepick's own parser checks it.
    let validate = |text: &str| {
        config::parse(text, "the generated configuration", &Overrides::default())
            .map(drop)
            .map_err(|error| error.to_string())
    };
    let emit = args
        .emit_config
        .clone()
        .map(|path| cachepick_sim::fleet::EmitConfig {
            path,
            listen: args.picker_listen,
            metrics_listen: args.picker_metrics_listen,
        });
    cachepick_sim::fleet::run(config, emit, validate, args.control, shutdown_signal()).await?;
    Ok(())
}

pub(super) async fn demo(args: &DemoArgs) -> anyhow::Result<()> {
    let options = cachepick_rig::demo::DemoOptions {
        workers: args.workers,
        engine: args.engine,
        envoy: args.envoy.clone(),
        no_envoy: args.no_envoy,
        hold: args.hold,
        seed: args.seed,
        duration_scale: args.duration_scale,
        ports: cachepick_rig::demo::DemoPorts {
            listen: args.listen,
            metrics_listen: args.metrics_listen,
            envoy_listen: args.envoy_listen,
            envoy_admin: args.envoy_admin,
        },
    };
    cachepick_rig::demo::run(options).await?;
    Ok(())
}

pub(super) async fn replay(args: &ReplayArgs) -> anyhow::Result<()> {
    if args.clock == "virtual" {
        return replay_virtual(args);
    }
    if args.regret {
        anyhow::bail!(
            "--regret needs --clock virtual: only the virtual replay holds every worker's true state"
        );
    }
    let scenario =
        cachepick_rig::replay::Scenario::chosen(args.trace.clone(), args.scenario.as_deref())?;
    let mut options = cachepick_rig::replay::ReplayOptions::new(scenario);
    options.sim_config = args.config.clone();
    options.policies = args
        .policies
        .iter()
        .filter(|p| !p.is_empty())
        .cloned()
        .collect();
    options.speedup = args.speedup;
    options.limit = args.limit;
    options.load = args.load;
    for template in &args.front {
        let taken = labels(&options.fronts);
        options
            .fronts
            .push(cachepick_rig::replay::front::Front::command(
                template, &taken,
            )?);
    }
    for url in &args.front_url {
        let taken = labels(&options.fronts);
        options
            .fronts
            .push(cachepick_rig::replay::front::Front::url(url, &taken)?);
    }
    let explicit = args
        .via
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|error: String| anyhow::anyhow!("--via: {error}"))?;
    options.via = cachepick_rig::replay::Via::chosen(explicit, &args.replicas);
    options.replicas = args.replicas.clone();
    options.index_modes = args.index.clone();
    if let (Some(worker), Some(at)) = (args.crash_worker, args.crash_at) {
        let seconds = |value: f64, flag: &str| {
            std::time::Duration::try_from_secs_f64(value)
                .map_err(|_| anyhow::anyhow!("{flag} must be a non-negative number of seconds"))
        };
        options.crash = Some(cachepick_rig::replay::fault::Crash {
            worker,
            at: seconds(at, "--crash-at")?,
            restart_after: seconds(args.restart_after, "--restart-after")?,
        });
    }
    options.envoy = args.envoy.clone();
    if let Some(out) = &args.out {
        options.out = out.clone();
    }
    options.seed = args.seed;
    options.duration_scale = args.duration_scale;
    options.timing = args.timing;
    options.peers = args.peer.clone();
    options.dynamo_selectors = args.dynamo_selector.clone();
    options.oracle = !args.no_oracle;
    options.pd_prefill = args.pd;
    options.pd_local_prefill_tokens = args.pd_local_prefill_tokens;
    options.scrape_interval = args.scrape_interval;
    options.replica_sync = args.replica_sync;
    let replay = cachepick_rig::replay::run(&options).await?;
    println!("\n{}", replay.table);
    for skipped in &replay.skipped {
        println!("skipped {}: {}", skipped.policy, skipped.error);
    }
    println!("report: {}", replay.out_dir.join("report.json").display());
    match replay.failure() {
        Some(failure) => anyhow::bail!(failure),
        None => Ok(()),
    }
}

/// `cachepick replay --clock virtual`: every wall-only flag refused by name, then the run, the table,
/// the report files and the replay's own speed.
fn replay_virtual(args: &ReplayArgs) -> anyhow::Result<()> {
    use cachepick_rig::replay::virtual_clock::{VirtualOptions, run, write};
    let mut wall_only = Vec::new();
    let mut refuse = |asked: bool, flag: &str| {
        if asked {
            wall_only.push(flag.to_owned());
        }
    };
    refuse(!args.front.is_empty(), "--front");
    refuse(!args.front_url.is_empty(), "--front-url");
    refuse(!args.dynamo_selector.is_empty(), "--dynamo-selector");
    refuse(args.via.is_some(), "--via");
    refuse(args.envoy.is_some(), "--envoy");
    refuse(args.speedup.is_some(), "--speedup");
    refuse(args.crash_worker.is_some(), "--crash-worker");
    refuse(args.pd.is_some(), "--pd");
    refuse(args.timing != cachepick_sim::Timing::Step, "--timing slots");
    if !wall_only.is_empty() {
        anyhow::bail!(
            "--clock virtual does not model {}: the wall-clock replay does",
            wall_only.join(", ")
        );
    }
    let scenario =
        cachepick_rig::replay::Scenario::chosen(args.trace.clone(), args.scenario.as_deref())?;
    let out = args.out.clone().unwrap_or_else(|| {
        let name = match &scenario {
            cachepick_rig::replay::Scenario::Trace(path) => path.file_stem().map_or_else(
                || "trace".to_owned(),
                |stem| stem.to_string_lossy().into_owned(),
            ),
            other => other.name(),
        };
        std::path::PathBuf::from("target/replay-virtual").join(name)
    });
    let options = VirtualOptions {
        scenario,
        sim_config: args.config.clone(),
        workers: args.workers,
        policies: args
            .policies
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect(),
        peers: args.peer.clone(),
        oracle: !args.no_oracle,
        replicas: args.replicas.clone(),
        index_modes: args.index.clone(),
        replica_sync: args.replica_sync,
        seed: args.seed,
        seeds: args.seeds,
        limit: args.limit,
        load: args.load,
        duration_scale: args.duration_scale,
        scrape_interval: args.scrape_interval,
        jobs: args.jobs,
        regret: args.regret,
        join_at: args.join_at,
        out: out.clone(),
    };
    if args.goodput {
        let started = std::time::Instant::now();
        let slo_ms = args.slo_ms;
        let report = cachepick_rig::replay::virtual_clock::goodput::run(
            &options,
            cachepick_rig::replay::virtual_clock::goodput::GoodputOptions { slo_ms },
        )?;
        std::fs::create_dir_all(&out)?;
        std::fs::write(
            out.join("goodput.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        std::fs::write(out.join("goodput.md"), &report.table)?;
        println!("\n{}", report.table);
        println!(
            "searched in {:.1} s of wall time; report: {}",
            started.elapsed().as_secs_f64(),
            out.join("goodput.json").display()
        );
        return Ok(());
    }
    let (report, speed) = run(&options)?;
    write(&report, &out)?;
    println!("\n{}", report.table);
    println!(
        "{} runs in {:.1} s of wall time: {:.0} simulated GPU-seconds per wall-second",
        speed.runs,
        speed.wall_s,
        speed.ratio()
    );
    println!("report: {}", out.join("report.json").display());
    Ok(())
}

fn labels(fronts: &[cachepick_rig::replay::front::Front]) -> Vec<String> {
    fronts.iter().map(|front| front.label.clone()).collect()
}

pub(super) async fn chaos(args: &ChaosArgs) -> anyhow::Result<()> {
    use cachepick_rig::chaos::{ChaosOptions, Mode};
    let seconds = |value: f64, name: &str| {
        std::time::Duration::try_from_secs_f64(value)
            .with_context(|| format!("--{name} must be a non-negative number of seconds"))
    };
    let mode = if args.soak { Mode::Soak } else { Mode::Chaos };
    // The picker is this very binary, run as `cachepick serve` in a child process.
    let picker = std::env::current_exe().context("cannot find the cachepick binary")?;
    let mut options =
        ChaosOptions::new(mode, seconds(args.duration, "duration")?, args.rate, picker);
    options.workers = args.workers;
    options.seed = args.seed;
    options.envoy = args.envoy.clone();
    options.crowd.slowloris = args.slowloris;
    options.body_mode = args.mode;
    options.warmup = seconds(args.warmup, "warmup")?;
    if let Some(out) = &args.out {
        options.out = out.clone();
    }
    options.verbose = true;
    let report = cachepick_rig::chaos::run(&options).await?;
    println!("\n{}", report.table);
    println!("report: {}", report.out_dir.join("report.json").display());
    match report.failure() {
        Some(failure) => anyhow::bail!(failure),
        None => Ok(()),
    }
}

pub(super) async fn overhead(args: &OverheadArgs) -> anyhow::Result<()> {
    let options = cachepick_rig::overhead::OverheadOptions {
        sizes: args
            .sizes
            .iter()
            .map(|kib| kib.saturating_mul(1024))
            .collect(),
        modes: args.modes.clone(),
        requests: args.requests,
        warmup: args.warmup,
        batch: args.batch,
        envoy: args.envoy.clone(),
        variant: args.variant,
        seed: args.seed,
        out: Some(args.out.clone()),
    };
    let report = cachepick_rig::overhead::run(&options).await?;
    println!("{}", report.table);
    println!(
        "load average before: {}; after: {}",
        report.load_before, report.load_after
    );
    println!("report: {}", args.out.join("report.json").display());
    Ok(())
}

/// `cachepick snapshot`'s exit status when some pool has no worker with a fresh reading: distinct from
/// 1 (the command failed) and 2 (a bad configuration), so a probe or a script can tell "the fleet is
/// down" from "the check is broken".
pub(super) const SNAPSHOT_UNSERVED: u8 = 3;

/// Prints the snapshot; returns the pools with no worker whose reading is fresh.
pub(super) async fn snapshot(
    config: Config,
    rounds: u32,
    json: bool,
) -> anyhow::Result<Vec<String>> {
    let pools = cachepick::app::snapshot(&config, rounds.max(1)).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&pools)?);
    } else {
        print!("{}", cachepick::render::snapshot(&pools));
    }
    Ok(pools
        .iter()
        .filter(|pool| !pool.view.workers.iter().any(|worker| worker.fresh))
        .map(|pool| pool.view.pool.clone())
        .collect())
}

pub(super) async fn explain(
    config: Config,
    input: cachepick::route::ExplainInput<Vec<u8>>,
    json: bool,
) -> anyhow::Result<()> {
    match cachepick::app::explain(&config, &input).await? {
        Ok(explanation) if json => println!("{}", serde_json::to_string_pretty(&explanation)?),
        Ok(explanation) => print!("{}", cachepick::render::explanation(&explanation)),
        Err(refusal) => anyhow::bail!("the request would be refused: {refusal}"),
    }
    Ok(())
}

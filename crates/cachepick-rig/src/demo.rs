//! `cachepick demo`: the whole product on one machine in one command — a simulated fleet, the picker,
//! and a real Envoy in front when one is installed — driven by the burst workload's conversations of
//! `cachepick replay` (sharing long prefixes) through four phases that reach every rung of the ladder:
//! steady, one hot prefix whose owner queues (the gate diverts), a flood that queues the whole fleet
//! (the floor pins), steady again. The product's default policy runs (the gate and the floor in
//! predicted prefill time, its durations in the simulator's wall time); then a short report with the
//! decision reasons and Envoy's per-reason counters, and where to look.
//!
//! It is one replay run with one policy and a shorter report: the same [`Stage`], driver and figures.
//! Without Envoy the demo drives the picker over its ext_proc gRPC interface (the same messages Envoy
//! sends) and calls the chosen worker itself, so every request still goes through the real picker.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cachepick::config::Config;
use cachepick_sim::Engine;

use crate::client::Client as PickerClient;
use crate::envoy::Envoy;
use crate::replay::arms::{apply_policy, policy_yaml};
use crate::replay::drive::{self, Route};
use crate::replay::report::{PhaseFigures, PolicyReport};
use crate::replay::trace::{self, BURST_GROUPS, Phase, PromptBuilder};
use crate::replay::{Scenario, default_fleet};
use crate::stage::{Stage, StageError};
use crate::{find_envoy, nz};

/// What `cachepick demo` runs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub workers: u32,
    pub engine: Engine,
    /// The Envoy binary; `None` looks in `CACHEPICK_ENVOY`, `target/envoy-1.40.0/bin/envoy` and `PATH`.
    pub envoy: Option<PathBuf>,
    /// Drive the picker directly even if Envoy is available.
    pub no_envoy: bool,
    /// Keep everything running after the report until Ctrl-C, to look around.
    pub hold: bool,
    pub seed: u64,
    /// Multiplies the length of every phase (rates are unchanged); 1 is the full 14 s workload.
    pub duration_scale: f64,
    /// Fixed addresses for what a person points a client or a browser at (`--hold`): the picker's
    /// ext_proc and metrics listeners, Envoy's listener and admin; fresh loopback ports where `None`.
    pub ports: DemoPorts,
}

/// [`DemoOptions::ports`].
#[derive(Clone, Copy, Debug, Default)]
pub struct DemoPorts {
    pub listen: Option<std::net::SocketAddr>,
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub envoy_listen: Option<std::net::SocketAddr>,
    pub envoy_admin: Option<std::net::SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("cannot connect to the picker: {0}")]
    Client(#[from] crate::client::ClientError),
}

/// The burst scenario's trace time is divided by this, as `cachepick replay --scenario burst` does.
const SPEEDUP: f64 = 4.0;
/// The demo's share of its phases' trace time (95 s): 53 s, 13 s at [`SPEEDUP`].
const SCALE: f64 = 0.56;
/// The demo's phases, in trace time: steady load near the fleet's capacity on conversations that share
/// long prefixes; one conversation's prefix drawing the traffic, whose owner queues while the others
/// do not, so the gate diverts (`cache_worker_queued`); a flood of requests each with its own long
/// suffix, which queues every worker at once, so the floor pins requests to their owners rather than
/// divert them (`saturation_pin`); steady again, as the backlog drains.
const PHASES: [Phase; 4] = [
    Phase {
        name: "steady",
        rate: 8.0,
        length_ms: 30_000,
        suffix_tokens: 256,
        groups: BURST_GROUPS,
    },
    Phase {
        name: "hot",
        rate: 24.0,
        length_ms: 10_000,
        suffix_tokens: 1_024,
        groups: 1,
    },
    Phase {
        name: "flood",
        rate: 96.0,
        length_ms: 5_000,
        suffix_tokens: 4_096,
        groups: BURST_GROUPS,
    },
    Phase {
        name: "recovery",
        rate: 8.0,
        length_ms: 50_000,
        suffix_tokens: 256,
        groups: BURST_GROUPS,
    },
];
const MAX_IN_FLIGHT: usize = 2_000;
/// The policy the demo runs: the product's default, as the replay names it.
const POLICY: &str = "time_floor_all";

/// Runs the demo and prints its report to stdout.
pub async fn run(options: DemoOptions) -> Result<(), DemoError> {
    let mut sim = default_fleet(&Scenario::Burst, SPEEDUP, cachepick_sim::Timing::Step);
    sim.engine = options.engine;
    sim.workers = nz(options.workers.max(1));
    sim.seed = options.seed;
    let scale = if options.duration_scale.is_finite() && options.duration_scale > 0.0 {
        SCALE * options.duration_scale
    } else {
        SCALE
    };
    let items = trace::phased(options.seed, scale, &PHASES);
    let prompts = PromptBuilder::new(&sim.tokenizer, options.seed);

    let policy = policy_yaml(POLICY, &sim)
        .ok_or_else(|| StageError::Compose(format!("no policy named {POLICY}")))?;
    let ports = options.ports;
    let mut stage = Stage::start(&sim, |generated| {
        let mut config = apply_policy(generated, &policy)?;
        config.listen = ports.listen.unwrap_or(config.listen);
        config.metrics_listen = ports.metrics_listen.unwrap_or(config.metrics_listen);
        Ok(config)
    })
    .await?;
    let endpoints: Vec<String> = stage
        .fleet
        .endpoints()
        .iter()
        .map(ToString::to_string)
        .collect();
    println!(
        "fleet: {} simulated {} workers ({})",
        endpoints.len(),
        options.engine.as_str(),
        endpoints.join(", ")
    );
    println!(
        "picker: ext_proc on {}, metrics on http://{}/metrics",
        stage.picker.listen(),
        stage.picker.metrics_listen()
    );
    if !options.no_envoy {
        match find_envoy(options.envoy.as_deref()) {
            Some(path) => {
                stage = stage
                    .with_envoy_at(&path, ports.envoy_listen, ports.envoy_admin)
                    .await?;
            }
            None => println!(
                "envoy: not found (set CACHEPICK_ENVOY, or run `scripts/provision-envoy`); driving the \
                 picker directly over ext_proc, the same messages Envoy sends"
            ),
        }
    }
    let route = match &stage.envoy {
        Some(envoy) => {
            println!(
                "envoy: listener http://{}, admin http://{}",
                envoy.listen, envoy.admin
            );
            Route::Proxy(envoy.listen)
        }
        None => Route::Direct(PickerClient::connect(stage.picker.listen()).await?),
    };

    println!();
    for phase in PHASES {
        println!(
            "phase {}: {} requests/s for {:.1}s",
            phase.name,
            phase.rate * SPEEDUP,
            phase.length_ms as f64 * scale / SPEEDUP / 1000.0
        );
    }
    let started = Instant::now();
    let samples = drive::drive(&route, &items, &prompts, &sim.model, SPEEDUP, MAX_IN_FLIGHT).await;
    let names: Vec<&str> = PHASES.iter().map(|phase| phase.name).collect();
    let figures = PolicyReport::new(
        POLICY,
        "",
        &samples,
        drive::per_worker(&samples, &stage.fleet.endpoints()),
        &names,
        Duration::from_secs(1),
        started.elapsed(),
    );
    print!(
        "{}",
        report(&figures, stage.config(), stage.envoy.as_ref()).await
    );

    if options.hold {
        println!("\nholding: everything keeps running until Ctrl-C");
        let _ = tokio::signal::ctrl_c().await;
    }
    stage.stop().await?;
    Ok(())
}

fn millis(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.0} ms"))
}

fn row(figures: &PhaseFigures) -> String {
    format!(
        "{:<10} {:>8} {:>7} {:>10} {:>10} {:>10}",
        figures.phase,
        figures.requests,
        figures.failed,
        figures
            .hit_rate
            .map_or_else(|| "-".to_owned(), |hit| format!("{:.1}%", hit * 100.0)),
        millis(figures.ttft_ms.p50),
        millis(figures.ttft_ms.p99),
    )
}

/// The short report: per phase and overall, requests, failures, prefix-hit rate and TTFT; the decision
/// reasons as the workers saw them; where to look, and Envoy's own counters when it ran.
async fn report(figures: &PolicyReport, config: &Config, envoy: Option<&Envoy>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<10} {:>8} {:>7} {:>10} {:>10} {:>10}",
        "phase", "requests", "errors", "prefix hit", "TTFT p50", "TTFT p99"
    );
    for phase in &figures.phases {
        let _ = writeln!(out, "{}", row(phase));
    }
    let all = PhaseFigures {
        phase: "all".to_owned(),
        requests: figures.requests,
        failed: figures.requests - figures.ok,
        hit_rate: figures.hit_rate,
        ttft_ms: figures.ttft_ms.clone(),
    };
    let _ = writeln!(out, "{}", row(&all));

    let mut reasons: Vec<(&String, &u64)> = figures.reasons.iter().collect();
    reasons.sort_by_key(|(_, count)| std::cmp::Reverse(**count));
    let _ = writeln!(out, "\ndecision reasons (as the workers saw them):");
    for (reason, count) in reasons {
        let _ = writeln!(out, "  {reason:<22} {count:>6}");
    }
    let metrics = config.metrics_listen;
    let _ = writeln!(
        out,
        "\nwhere to look:\n  cachepick metrics   curl -s http://{metrics}/metrics | grep -E 'cachepick_(decisions|refusals)_total'\n  \
         last decision trace curl -s -X POST 'http://{metrics}/debug/explain?path=/v1/completions' -d @body.json\n  \
         load snapshot       curl -s http://{metrics}/debug/snapshot",
    );
    if let Some(envoy) = envoy {
        let _ = writeln!(
            out,
            "  Envoy per reason    curl -s 'http://{}/stats?filter=vcluster' (and /stats/prometheus)",
            envoy.admin
        );
        if let Some(stats) = envoy.vcluster_totals().await {
            let _ = writeln!(
                out,
                "\nEnvoy admin, requests per decision reason (virtual clusters):"
            );
            for line in stats {
                let _ = writeln!(out, "  {line}");
            }
        }
    }
    out
}

//! `cachepick demo`: the whole product on one machine in one command — a simulated fleet, the picker,
//! and a real Envoy in front when one is installed — driven by a bursty shared-prefix workload, then a
//! table of what happened and where to look.
//!
//! Without Envoy the demo drives the picker over its ext_proc gRPC interface (the same messages Envoy
//! sends) and calls the chosen worker itself, so every request still goes through the real picker.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{Semaphore, watch};

use cachepick::config::{self, Config};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};

use crate::client::{Client as PickerClient, Verdict};
use crate::envoy::Envoy;
use crate::{find_envoy, free_port, nz};

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
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Fleet(#[from] cachepick_sim::fleet::FleetError),
    #[error("the generated configuration is invalid: {0}")]
    Config(#[from] config::ConfigError),
    #[error("cannot find a free loopback port: {0}")]
    Port(std::io::Error),
    #[error("the picker did not become ready: {0}")]
    Picker(String),
    #[error("Envoy at {path}: {message}")]
    Envoy { path: PathBuf, message: String },
}

/// One request's outcome as the client saw it.
#[derive(Clone, Debug, Default)]
struct Sample {
    phase: usize,
    ok: bool,
    status: u16,
    reason: String,
    ttft: Option<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// The workload: conversations in groups sharing a long system prompt, at a steady rate near what the
/// fleet serves, then a burst well above it, then steady again.
const PHASES: [(&str, f64, Duration); 3] = [
    ("steady", 12.0, Duration::from_secs(5)),
    ("burst", 60.0, Duration::from_secs(4)),
    ("recovery", 12.0, Duration::from_secs(5)),
];
const GROUPS: usize = 12;
/// Words of each group's shared system prompt (about 2,000 tokens).
const SYSTEM_WORDS: usize = 1_600;
const OUTPUT_TOKENS: u32 = 48;
const MAX_IN_FLIGHT: usize = 400;

/// Runs the demo and prints its report to stdout.
pub async fn run(options: DemoOptions) -> Result<(), DemoError> {
    let mut sim = SimConfig::new(
        options.engine,
        std::num::NonZeroU32::new(options.workers.max(1)).unwrap_or(std::num::NonZeroU32::MIN),
    );
    sim.seed = options.seed;
    sim.tokenizer = cachepick_sim::config::TokenizerConfig::default();
    sim.params.max_running = nz(6);
    sim.params.kv_blocks = nz(1_024);
    sim.params.prefill_overhead = Duration::from_millis(20);
    sim.params.prefill_per_token = Duration::from_micros(250);
    sim.params.inter_token_latency = Duration::from_millis(25);
    sim.params.time_scale = 0.2;
    let fleet = Fleet::start(&sim).await?;
    println!(
        "fleet: {} simulated {} workers ({})",
        options.workers,
        options.engine.as_str(),
        endpoints(&fleet)
    );

    let mut config = config::parse(
        &fleet.cachepick_config(),
        "the demo configuration",
        &config::Overrides::default(),
    )?;
    config.listen = free_port().map_err(DemoError::Port)?;
    config.metrics_listen = free_port().map_err(DemoError::Port)?;
    let (stop, stopped) = watch::channel(false);
    let picker = {
        let config = config.clone();
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            cachepick::app::run(&config, shutdown).await
        })
    };
    crate::client::wait_ready(config.listen, Duration::from_secs(15))
        .await
        .map_err(|error| DemoError::Picker(error.to_string()))?;
    println!(
        "picker: ext_proc on {}, metrics on http://{}/metrics",
        config.listen, config.metrics_listen
    );

    let envoy = if options.no_envoy {
        None
    } else {
        match find_envoy(options.envoy.as_deref()) {
            Some(path) => Some(
                Envoy::start(&path, &config)
                    .await
                    .map_err(|message| DemoError::Envoy { path, message })?,
            ),
            None => {
                println!(
                    "envoy: not found (set CACHEPICK_ENVOY, or run `scripts/provision-envoy`); driving the \
                     picker directly over ext_proc, the same messages Envoy sends"
                );
                None
            }
        }
    };
    let route = match &envoy {
        Some(envoy) => {
            println!(
                "envoy: listener http://{}, admin http://{}",
                envoy.listen, envoy.admin
            );
            Route::Envoy(envoy.listen)
        }
        None => Route::Direct(
            PickerClient::connect(config.listen)
                .await
                .map_err(|error| DemoError::Picker(error.to_string()))?,
        ),
    };

    println!();
    let samples = drive(&route, &sim.model, options.seed, options.duration_scale).await;
    let report = report(&samples, &config, envoy.as_ref()).await;
    print!("{report}");

    if options.hold {
        println!("\nholding: everything keeps running until Ctrl-C");
        let _ = tokio::signal::ctrl_c().await;
    }
    let _ = stop.send(true);
    let _ = picker.await;
    drop(envoy);
    drop(fleet);
    Ok(())
}

fn endpoints(fleet: &Fleet) -> String {
    let endpoints: Vec<String> = fleet.endpoints().iter().map(ToString::to_string).collect();
    endpoints.join(", ")
}

enum Route {
    Envoy(SocketAddr),
    Direct(PickerClient),
}

/// Deterministic filler text: `count` words drawn from a small vocabulary by a seeded sequence.
fn words(seed: u64, count: usize) -> String {
    const VOCABULARY: [&str; 24] = [
        "cache", "prefix", "token", "worker", "queue", "route", "envoy", "model", "batch",
        "latency", "prompt", "block", "owner", "fleet", "burst", "floor", "limit", "stream",
        "engine", "reason", "decode", "prefill", "memory", "signal",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    for _ in 0..count {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let word = VOCABULARY
            .get((state % VOCABULARY.len() as u64) as usize)
            .copied()
            .unwrap_or("token");
        out.push_str(word);
        out.push(' ');
    }
    out
}

async fn drive(route: &Route, model: &str, seed: u64, scale: f64) -> Vec<Sample> {
    let http: HttpClient<HttpConnector, Full<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let systems: Vec<Arc<String>> = (0..GROUPS)
        .map(|group| Arc::new(words(seed ^ group as u64, SYSTEM_WORDS)))
        .collect();
    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut tasks = Vec::new();
    let mut counter = 0_u64;
    let scale = if scale.is_finite() && scale > 0.0 {
        scale
    } else {
        1.0
    };
    for (phase, (name, rate, length)) in PHASES.iter().enumerate() {
        let length = &length.mul_f64(scale);
        println!(
            "phase {name}: {rate} requests/s for {:.1}s",
            length.as_secs_f64()
        );
        let started = Instant::now();
        let gap = Duration::from_secs_f64(1.0 / rate);
        let mut next = started;
        while started.elapsed() < *length {
            tokio::time::sleep_until(next.into()).await;
            next += gap;
            counter += 1;
            let group = (counter.wrapping_mul(7) % GROUPS as u64) as usize;
            let system = systems.get(group).cloned().unwrap_or_default();
            let question = words(seed ^ counter.rotate_left(20), 12);
            let body = serde_json::json!({
                "model": model,
                "messages": [
                    {"role": "system", "content": system.as_str()},
                    {"role": "user", "content": question},
                ],
                "max_tokens": OUTPUT_TOKENS,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
            .to_string();
            let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
                break;
            };
            let http = http.clone();
            let target = match route {
                Route::Envoy(addr) => Target::Envoy(*addr),
                Route::Direct(client) => Target::Direct(client.clone()),
            };
            tasks.push(tokio::spawn(async move {
                let sample = one(&http, target, phase, body).await;
                drop(permit);
                sample
            }));
        }
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for task in tasks {
        if let Ok(sample) = task.await {
            samples.push(sample);
        }
    }
    samples
}

enum Target {
    Envoy(SocketAddr),
    Direct(PickerClient),
}

/// How long one demo request may take, from sending it to the end of its streamed answer.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);

/// Sends one streaming chat request and reads it to the end, within [`REQUEST_DEADLINE`].
async fn one(
    http: &HttpClient<HttpConnector, Full<Bytes>>,
    target: Target,
    phase: usize,
    body: String,
) -> Sample {
    let mut sample = Sample {
        phase,
        ..Sample::default()
    };
    const PATH: &str = "/v1/chat/completions";
    let (addr, headers) = match target {
        Target::Envoy(addr) => (addr, Vec::new()),
        Target::Direct(client) => match client.decide(PATH, body.as_bytes()).await {
            Ok(Verdict::Route {
                endpoints,
                reason,
                prefix_tokens,
            }) => {
                let Some(first) = endpoints.first().copied() else {
                    return sample;
                };
                let destination: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
                (
                    first,
                    vec![
                        ("x-gateway-destination-endpoint", destination.join(",")),
                        ("x-cachepick-decision", reason),
                        ("x-cachepick-prefix-tokens", prefix_tokens.to_string()),
                    ],
                )
            }
            Ok(Verdict::Refuse { status, reason, .. }) => {
                sample.status = status;
                sample.reason = reason;
                return sample;
            }
            Err(_) => return sample,
        },
    };
    let mut request =
        Request::post(format!("http://{addr}{PATH}")).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let Ok(request) = request.body(Full::new(Bytes::from(body))) else {
        return sample;
    };
    let started = Instant::now();
    // One deadline for the whole exchange, the streamed body included: a worker that stops sending
    // mid-stream costs the demo one failed sample, not a hang.
    let deadline = tokio::time::Instant::now() + REQUEST_DEADLINE;
    let Ok(Ok(response)) = tokio::time::timeout_at(deadline, http.request(request)).await else {
        return sample;
    };
    sample.status = response.status().as_u16();
    sample.reason = response
        .headers()
        .get("x-sim-echo-x-cachepick-decision")
        .or_else(|| response.headers().get("x-cachepick-reject-reason"))
        .and_then(|value| value.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    let mut body = response.into_body();
    let mut tail = Vec::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(None | Some(Err(_))) => break,
            // Cut off: whatever arrived is not a complete answer.
            Err(_) => return sample,
        };
        if let Some(data) = frame.data_ref() {
            if sample.ttft.is_none() && data.windows(6).any(|window| window == b"data: ") {
                sample.ttft = Some(started.elapsed());
            }
            tail.extend_from_slice(data);
            if tail.len() > 16 * 1024 {
                tail.drain(..tail.len() - 4 * 1024);
            }
        }
    }
    let text = String::from_utf8_lossy(&tail);
    let usage = text
        .rsplit("data: ")
        .filter_map(|event| serde_json::from_str::<serde_json::Value>(event.trim()).ok())
        .find_map(|event| event.get("usage").cloned());
    if let Some(usage) = usage {
        sample.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
        sample.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        sample.ok = sample.status == 200;
    }
    sample
}

fn percentile(values: &mut [Duration], share: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    values.sort();
    let index = ((values.len() - 1) as f64 * share).round() as usize;
    values.get(index).copied()
}

fn millis(duration: Option<Duration>) -> String {
    duration.map_or_else(
        || "-".to_owned(),
        |d| format!("{:.0} ms", d.as_secs_f64() * 1000.0),
    )
}

async fn report(samples: &[Sample], config: &Config, envoy: Option<&Envoy>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<10} {:>8} {:>7} {:>10} {:>10} {:>10}",
        "phase", "requests", "errors", "prefix hit", "TTFT p50", "TTFT p99"
    );
    for (phase, (name, ..)) in PHASES.iter().enumerate() {
        let rows: Vec<&Sample> = samples.iter().filter(|s| s.phase == phase).collect();
        let _ = writeln!(out, "{}", row(name, &rows));
    }
    let all: Vec<&Sample> = samples.iter().collect();
    let _ = writeln!(out, "{}", row("all", &all));

    let mut reasons: Vec<(String, usize)> = Vec::new();
    for sample in samples {
        match reasons
            .iter_mut()
            .find(|(reason, _)| *reason == sample.reason)
        {
            Some((_, count)) => *count += 1,
            None => reasons.push((sample.reason.clone(), 1)),
        }
    }
    reasons.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    let _ = writeln!(out, "\ndecision reasons (as the workers saw them):");
    for (reason, count) in reasons {
        let _ = writeln!(out, "  {reason:<22} {count:>6}");
    }
    let _ = writeln!(
        out,
        "\nwhere to look:\n  cachepick metrics   curl -s http://{}/metrics | grep -E 'cachepick_(decisions|rejections)_total'\n  \
         last decision trace curl -s -X POST 'http://{}/debug/explain?path=/v1/chat/completions' -d @body.json\n  \
         load snapshot       curl -s http://{}/debug/snapshot",
        config.metrics_listen, config.metrics_listen, config.metrics_listen
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

fn row(name: &str, rows: &[&Sample]) -> String {
    let errors = rows.iter().filter(|s| !s.ok).count();
    let prompt: u64 = rows.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = rows.iter().map(|s| s.cached_tokens).sum();
    let mut ttft: Vec<Duration> = rows.iter().filter_map(|s| s.ttft).collect();
    let hit = if prompt == 0 {
        "-".to_owned()
    } else {
        format!("{:.1}%", cached as f64 * 100.0 / prompt as f64)
    };
    format!(
        "{:<10} {:>8} {:>7} {:>10} {:>10} {:>10}",
        name,
        rows.len(),
        errors,
        hit,
        millis(percentile(&mut ttft, 0.5)),
        millis(percentile(&mut ttft, 0.99)),
    )
}

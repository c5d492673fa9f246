//! Pathological prompts (issue 23, item 1): bodies of 1–8 MB that are one pre-token each — a repeated
//! letter, a repeated digit, a run of spaces, one long word of mixed letters, a repeated two-byte
//! letter — sent straight to the real `cachepick serve`'s ext_proc port, while victims go through a real
//! Envoy 1.40 to a simulated fleet.
//!
//! Asserted, with bounds stated below: every victim is routed by cachepick (the worker sees cachepick's
//! decision header; nothing is failed open) within [`VICTIM_LATENCY`]; no decision slot stays busy more
//! than [`OVERRUN`] past its deadline (`cachepick_decision_overrun_seconds`); the picker's peak resident
//! memory (VmHWM) stays within its baseline plus [`MEMORY_MULTIPLE`] times `max_buffered_bytes`.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use http::header::CONTENT_TYPE;

use cachepick::config::{self, Overrides};
use cachepick::envoy_config::{self, BodyMode, EnvoyOptions};
use cachepick::extproc::DECISION_HEADER;
use cachepick_rig::client::{Client as ExtProc, Verdict};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig, SimParams, Timing};

use crate::envoy::{self, Envoy};
use crate::sim_client::{self, CHAT, COMPLETIONS, Client, MODEL, metric_sum};
use crate::support::serve::Server;

/// How long the attack runs.
const ATTACK: Duration = Duration::from_secs(8);
/// Attackers, each sending one pathological body after another: as many as the picker has slots on a
/// 2-core machine.
const ATTACKERS: usize = 4;
/// `overload.max_buffered_bytes` of the run.
const BUDGET: usize = 128 << 20;
/// The stated bound on a victim's whole request through Envoy (the decision deadline is 1.75 s; a
/// failed-open victim waits for it).
const VICTIM_LATENCY: Duration = Duration::from_millis(1000);
/// The stated bound on how long past its deadline a slot stays busy: the longest step between two
/// questions to the deadline (parsing an 8 MiB body, then a 64 KiB window of tokenizing) in a debug
/// build, as the tests run it, on a loaded 2-core machine, with room to spare: measured at most 0.5 s
/// there.
const OVERRUN: f64 = 1.0;
/// Peak resident memory stays under the baseline (tokenizer tables, caches, the runtime) plus this many
/// times `max_buffered_bytes`: bodies and tokenizing are both charged to it.
const MEMORY_MULTIPLE: f64 = 1.5;

/// The fleet on a thread and runtime of its own, stopped on drop.
struct FleetThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FleetThread {
    fn start(sim: SimConfig) -> (FleetThread, String) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (config, generated) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("fleet")
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let fleet = Fleet::start(&sim).await.expect("the fleet starts");
                config.send(fleet.cachepick_config()).unwrap();
                let _ = stopped.await;
                drop(fleet);
            });
        });
        let text = generated
            .recv_timeout(Duration::from_secs(30))
            .expect("the fleet's configuration");
        (
            FleetThread {
                stop: Some(stop),
                thread: Some(thread),
            },
            text,
        )
    }
}

impl Drop for FleetThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A completion whose prompt is `prompt`.
fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL, "prompt": prompt, "max_tokens": 1,
    }))
    .unwrap()
}

/// The attack's bodies, 1 to 8 MB, each one pre-token (or one whitespace run) under `o200k_base`.
fn attack_bodies() -> Vec<(&'static str, Vec<u8>)> {
    const MB: usize = 1 << 20;
    let mut state = 11_u64;
    let mixed: String = (0..2 * MB)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            char::from(b'a' + ((state >> 33) % 26) as u8)
        })
        .collect();
    vec![
        ("letter 8 MB", completion(&"a".repeat(8 * MB - 64))),
        ("letter 1 MB", completion(&"a".repeat(MB))),
        ("digit 4 MB", completion(&"7".repeat(4 * MB))),
        (
            "spaces 2 MB",
            completion(&format!("x{}x", " ".repeat(2 * MB))),
        ),
        ("mixed word 2 MB", completion(&mixed)),
        ("two-byte letter 4 MB", completion(&"é".repeat(2 * MB))),
    ]
}

/// `/proc/<pid>/status`'s `name` line, in bytes.
fn status_bytes(pid: u32, name: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|value| value.parse().ok())
        .unwrap();
    kib * 1024
}

/// Starts `cachepick serve` on `yaml` and waits until it routes.
async fn serve(yaml: &str, dir: &tempfile::TempDir, listen: SocketAddr) -> (Server, ExtProc) {
    let path = dir.path().join("cachepick.yaml");
    std::fs::write(&path, yaml).unwrap();
    let log = std::fs::File::create(dir.path().join("cachepick.log")).unwrap();
    let child = Command::new(cachepick_rig::cachepick_binary())
        .args(["serve", "--config", path.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("serve starts");
    let server = Server(child);
    let started = Instant::now();
    loop {
        if let Ok(client) = ExtProc::connect(listen).await
            && let Ok(Verdict::Route { .. }) =
                client.decide(CHAT, &crate::picker::chat(1, 200)).await
        {
            return (server, client);
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the picker did not route within 60 s:\n{}",
            std::fs::read_to_string(dir.path().join("cachepick.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pathological_prompts_cannot_take_routing_from_other_requests() {
    let mut sim = SimConfig::new(Engine::Vllm, NonZeroU32::new(2).unwrap());
    sim.timing = Timing::Slots;
    sim.params = SimParams::slots();
    sim.params.jitter = 0.0;
    sim.params.time_scale = 0.001;
    let (fleet, generated) = FleetThread::start(sim);
    let listen: SocketAddr = ([127, 0, 0, 1], envoy::free_port()).into();
    let metrics_listen: SocketAddr = ([127, 0, 0, 1], envoy::free_port()).into();
    // The real tokenizer (the generated pool's o200k_base), 8 MiB bodies, the default deadlines; the
    // simulated workers share the machine with the attack, so their readings may come late.
    let yaml = format!(
        "max_body_bytes: 8MiB\noverload: {{max_buffered_bytes: {BUDGET}}}\n{}",
        generated
            .replace("listen: 127.0.0.1:9002", &format!("listen: {listen}"))
            .replace(
                "metrics_listen: 127.0.0.1:9090",
                &format!("metrics_listen: {metrics_listen}")
            )
            .replace("scrape_timeout: 150ms", "scrape_timeout: 200ms")
            .replace("freshness: 1s", "freshness: 10s")
    );
    let config = config::parse(&yaml, "hostile tok", &Overrides::default())
        .unwrap_or_else(|error| panic!("{error}\n{yaml}"));
    let dir = tempfile::tempdir().unwrap();
    let (server, probe) = serve(&yaml, &dir, listen).await;
    let pid = server.0.id();
    let gateway: SocketAddr = ([127, 0, 0, 1], envoy::free_port()).into();
    let options = EnvoyOptions {
        mode: BodyMode::Buffered,
        listen: gateway,
        admin: ([127, 0, 0, 1], envoy::free_port()).into(),
        ..EnvoyOptions::for_config(&config)
    };
    let envoy = Envoy::start(&envoy_config::render(&config, &options)).await;
    let client = Client::new();
    let chat = |seed| {
        let client = client.clone();
        async move {
            let started = Instant::now();
            let reply = sim_client::read_whole(
                client
                    .send_raw(
                        Method::POST,
                        gateway,
                        CHAT,
                        &[(CONTENT_TYPE.as_str(), "application/json")],
                        crate::picker::chat(seed, 2000),
                    )
                    .await,
            )
            .await;
            (started.elapsed(), reply)
        }
    };
    // Warm: the victims' path works before the attack.
    for seed in 0..5 {
        let (_, reply) = chat(seed).await;
        assert_eq!(reply.unwrap().status.as_u16(), 200);
    }
    let baseline = status_bytes(pid, "VmRSS:");

    let bodies = Arc::new(attack_bodies());
    let until = Instant::now() + ATTACK;
    let mut attackers = Vec::new();
    for attacker in 0..ATTACKERS {
        let bodies = Arc::clone(&bodies);
        let ext_proc = probe.clone();
        attackers.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut turn = attacker;
            while Instant::now() < until {
                let (name, body) = &bodies[turn % bodies.len()];
                turn += 1;
                let started = Instant::now();
                let verdict = ext_proc.decide(COMPLETIONS, body).await;
                let outcome = match verdict {
                    Ok(Verdict::Route { reason, .. }) => format!("routed ({reason})"),
                    Ok(other) => format!("{other:?}"),
                    Err(error) => format!("shed: {error}"),
                };
                sent.push(format!("{name}: {outcome} in {:?}", started.elapsed()));
            }
            sent
        }));
    }
    let mut victims = Vec::new();
    let mut seed = 100;
    while Instant::now() < until {
        seed += 1;
        victims.push(tokio::spawn(chat(seed)));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut slow = Vec::new();
    let mut failed = Vec::new();
    let mut worst = Duration::ZERO;
    let victim_count = victims.len();
    for victim in victims {
        let (took, reply) = victim.await.unwrap();
        worst = worst.max(took);
        match reply {
            Ok(reply) if reply.status.as_u16() == 200 => {
                if reply
                    .header(&format!("x-sim-echo-{DECISION_HEADER}"))
                    .is_none()
                {
                    failed.push(format!("served without cachepick's decision in {took:?}"));
                } else if took > VICTIM_LATENCY {
                    slow.push(took);
                }
            }
            Ok(reply) => failed.push(format!("{}: {}", reply.status, reply.text())),
            Err(error) => failed.push(error),
        }
    }
    let mut attacks = Vec::new();
    for attacker in attackers {
        attacks.extend(attacker.await.unwrap());
    }
    let peak = status_bytes(pid, "VmHWM:");
    let text = sim_client::Client::new()
        .get(metrics_listen, "/metrics")
        .await
        .text();
    // Summed, so that the same test run against a build without these metrics still reports.
    let overruns = metric_sum(&text, "cachepick_decision_overrun_seconds_count", &[]);
    let within = metric_sum(
        &text,
        "cachepick_decision_overrun_seconds_bucket",
        &[("le", &OVERRUN.to_string())],
    );
    let interrupted = metric_sum(&text, "cachepick_tokenize_interrupted_total", &[]);
    let overrun_buckets: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("cachepick_decision_overrun_seconds_bucket"))
        .collect();
    eprintln!("{}", overrun_buckets.join("\n  "));
    let over_budget = metric_sum(&text, "cachepick_tokenize_over_budget_total", &[]);
    let failed_open = envoy
        .stats()
        .await
        .lines()
        .filter_map(|line| line.split_once(": "))
        .filter(|(name, _)| name.contains("ext_proc") && name.ends_with(".failure_mode_allowed"))
        .filter_map(|(_, value)| value.trim().parse::<u64>().ok())
        .sum::<u64>();
    eprintln!(
        "{} attacks:\n  {}\n{victim_count} victims, worst {worst:?}; slots overrun {overruns} (within \
         {OVERRUN} s: {within}); tokenizing interrupted {interrupted}, over budget {over_budget}; \
         Envoy failed open {failed_open}; RSS baseline {} MiB, peak {} MiB (budget {} MiB)",
        attacks.len(),
        attacks.join("\n  "),
        baseline >> 20,
        peak >> 20,
        BUDGET >> 20,
    );
    assert!(attacks.len() >= ATTACKERS, "the attack ran");
    assert!(
        failed.is_empty(),
        "victims not routed by cachepick: {failed:#?}"
    );
    assert!(slow.is_empty(), "victims over {VICTIM_LATENCY:?}: {slow:?}");
    assert_eq!(failed_open, 0, "Envoy failed open");
    assert_eq!(
        within, overruns,
        "a slot stayed busy more than {OVERRUN} s past its deadline"
    );
    let allowed = baseline as f64 + MEMORY_MULTIPLE * BUDGET as f64;
    assert!(
        (peak as f64) < allowed,
        "peak RSS {} MiB over the baseline {} MiB + {MEMORY_MULTIPLE} x the {} MiB budget",
        peak >> 20,
        baseline >> 20,
        BUDGET >> 20
    );
    drop(envoy);
    drop(server);
    drop(fleet);
}

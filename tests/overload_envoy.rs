//! Overload and failures through a real Envoy 1.40 with the generated bootstrap (`failure_mode_allow:
//! true`): a decision that panics, and three times the picker's measured capacity, cost the client
//! nothing — what cachepick gives up, Envoy routes by its own load balancing.
//!
//! The panic is injected with the test-only `fault-injection` feature (`x-fault-injection: panic`);
//! the tests check first that the build has it.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod picker;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, picker, sim_client};

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::Method;
use http::header::CONTENT_TYPE;

use cachepick::config::{Config, Overrides};
use cachepick::envoy_config::{self, BodyMode, EnvoyOptions};
use cachepick::extproc::DECISION_HEADER;
use cachepick_rig::client::Verdict;
use cachepick_rig::stage::{Picker, READY_WITHIN, on_free_ports};
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig, SimParams, Timing};
use picker::{CHAT, DEADLINE, bounded, chat};
use sim_client::{Client, Reply, metric, metric_sum};

use picker::{FAULT, require_fault_injection};

/// The simulated fleet and cachepick, each on a runtime of its own (two worker threads, as a process
/// has on this machine), so the load this test generates on its own runtime delays neither the picker's
/// answers nor the workers' metrics (stale readings would withdraw the picker's readiness).
struct Isolated {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Isolated {
    /// Starts the fleet `sim` describes, then cachepick with `configure` of its generated configuration.
    async fn spawn(
        sim: SimConfig,
        configure: impl FnOnce(&str) -> Config + Send + 'static,
    ) -> (Isolated, Config) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready, is_ready) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || {
            let runtime = |name: &str| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(name)
                    .enable_all()
                    .build()
                    .unwrap()
            };
            let fleet_runtime = runtime("fleet");
            let fleet = fleet_runtime
                .block_on(Fleet::start(&sim))
                .expect("the fleet starts");
            let config = configure(&fleet.cachepick_config());
            runtime("picker").block_on(async move {
                let mut picker = Picker::spawn(config.clone());
                let readiness = picker.ready(READY_WITHIN).await;
                let _ = ready.send(
                    readiness
                        .map(|()| config)
                        .map_err(|error| error.to_string()),
                );
                let _ = stopped.await;
                picker.stop().await.expect("the picker stops cleanly");
            });
            drop(fleet);
            drop(fleet_runtime);
        });
        let config = is_ready
            .await
            .expect("the picker's thread runs")
            .expect("the picker is ready");
        (Isolated { stop, thread }, config)
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join().expect("the picker's thread"))
            .await
            .unwrap();
    }
}

/// Simulated workers, cachepick with `head` over the fleet's configuration, and Envoy in `mode`.
struct Stack {
    config: Config,
    picker: Option<Isolated>,
    envoy: envoy::Envoy,
    gateway: SocketAddr,
    client: Client,
}

impl Stack {
    async fn start(mode: BodyMode, head: &str, tokenizer: TokenizerConfig) -> Stack {
        // The workers are not what this measures: the slots model at a thousand times real time serves
        // hundreds of requests at once at the cost of a timer each, where the step model would run a
        // step every few microseconds for them.
        let mut sim = SimConfig::new(Engine::Vllm, NonZeroU32::new(2).unwrap());
        sim.timing = Timing::Slots;
        sim.params = SimParams::slots();
        sim.tokenizer = tokenizer;
        sim.params.jitter = 0.0;
        sim.params.time_scale = 0.001;
        sim.params.max_running = NonZeroU32::new(512).unwrap();
        let head = head.to_owned();
        let (picker, config) = Isolated::spawn(sim, move |generated| {
            let yaml = format!("{head}\n{generated}");
            let mut config = on_free_ports(&yaml, "overload test", Overrides::default())
                .unwrap_or_else(|error| panic!("{error}\n{yaml}"));
            // The simulated workers share this 2-core machine with the load: their metrics may answer
            // late, and readings that go stale would (rightly) withdraw the picker's readiness, which is
            // not what this test measures.
            config.load.scrape_timeout = config.load.scrape_interval;
            config.load.freshness = Duration::from_secs(10);
            config
        })
        .await;
        let gateway: SocketAddr = ([127, 0, 0, 1], envoy::free_port()).into();
        let options = EnvoyOptions {
            mode,
            listen: gateway,
            admin: ([127, 0, 0, 1], envoy::free_port()).into(),
            ..EnvoyOptions::for_config(&config)
        };
        let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
        Stack {
            config,
            picker: Some(picker),
            envoy,
            gateway,
            client: Client::new(),
        }
    }

    /// One chat request through Envoy, read whole; the transport error as text.
    async fn chat(&self, body: Vec<u8>, headers: &[(&str, &str)]) -> Result<Reply, String> {
        let mut all = vec![(CONTENT_TYPE.as_str(), "application/json")];
        all.extend_from_slice(headers);
        let response = self
            .client
            .send_raw(Method::POST, self.gateway, CHAT, &all, body);
        sim_client::read_whole(response.await).await
    }

    async fn picker_metrics(&self) -> String {
        let reply = self
            .client
            .get(self.config.metrics_listen, "/metrics")
            .await;
        reply.text()
    }

    /// The sum of Envoy's ext_proc counters whose name ends with `.ext_proc.<suffix>`.
    async fn ext_proc_stat(&self, suffix: &str) -> u64 {
        let stats = self.envoy.stats().await;
        let wanted = format!(".{suffix}");
        stats
            .lines()
            .filter_map(|line| line.split_once(": "))
            .filter(|(name, _)| name.contains("ext_proc") && name.ends_with(&wanted))
            .filter_map(|(_, value)| value.trim().parse::<u64>().ok())
            .sum()
    }

    async fn stop(mut self) {
        let picker = self.picker.take().expect("running");
        drop(self.envoy);
        bounded("the picker stops", DEADLINE, picker.stop()).await;
    }
}

/// A panic in a decision, through Envoy in `mode`: the client gets a worker's 200, not a 5xx.
async fn panic_is_served_by_the_fallback(mode: BodyMode) {
    require_fault_injection();
    // The injected panic must reach the picker's handler within the decision's deadline. The default
    // hook under RUST_BACKTRACE symbolises the debug binary first, which on a loaded machine outlasts
    // Envoy's message timeout (Envoy then fails open itself and the panic is never counted); this hook
    // prints the message alone.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::panic::set_hook(Box::new(|info| eprintln!("{info}"))));
    let stack = Stack::start(mode, "", TokenizerConfig::Bytes).await;
    let reply = bounded(
        "a request whose decision panics",
        DEADLINE,
        stack.chat(chat(1, 2000), &[(FAULT, "panic")]),
    )
    .await
    .expect("a response");
    assert_eq!(
        reply.status.as_u16(),
        200,
        "{mode:?}: {}\n{}",
        reply.text(),
        stack.envoy.log_tail()
    );
    // A worker answered, without cachepick's decision.
    assert!(reply.json()["choices"].is_array(), "{}", reply.text());
    assert!(reply.header("x-cachepick-refusal-reason").is_none());
    let text = stack.picker_metrics().await;
    assert_eq!(
        metric(&text, "cachepick_shed_total", &[("reason", "internal")]),
        1.0,
        "{mode:?}"
    );
    assert_eq!(metric_sum(&text, "cachepick_decisions_total", &[]), 0.0);
    // Buffered: a gRPC error, which Envoy fails open on. Duplex: Envoy has streamed the body to
    // cachepick and would answer a gRPC error with a 500, so cachepick continues the request without a
    // destination instead (and Envoy sees no error at all). Streamed: cachepick owes the headers answer,
    // so it continues the request the same way, letting the chunks through.
    let failed_open = match mode {
        BodyMode::Duplex | BodyMode::Streamed => 0,
        _ => 1,
    };
    assert_eq!(
        stack.ext_proc_stat("failure_mode_allowed").await,
        failed_open,
        "{mode:?}"
    );
    // The picker decides the next request as usual.
    let reply = stack.chat(chat(2, 2000), &[]).await.expect("a response");
    assert_eq!(reply.status.as_u16(), 200, "{}", reply.text());
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_decision_is_served_by_envoys_fallback_buffered() {
    panic_is_served_by_the_fallback(BodyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_decision_is_served_by_envoys_fallback_duplex() {
    panic_is_served_by_the_fallback(BodyMode::Duplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_decision_is_served_by_envoys_fallback_streamed() {
    panic_is_served_by_the_fallback(BodyMode::Streamed).await;
}

/// The decision deadline of the overload run: Envoy's `message_timeout` is 1 s.
const DECISION_DEADLINE: Duration = Duration::from_millis(500);

/// The run's knobs, from the environment for the longer runs RELIABILITY.md reports:
/// `OVERLOAD_PROMPT_BYTES` (each prompt's size), `OVERLOAD_SLEEP_MS` (a slow decision injected into every
/// request; 0 leaves decisions as slow as the tokenizer makes them), `OVERLOAD_SECONDS`.
fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// The smallest bucket bound below which `quantile` of `cachepick_answer_seconds{outcome}` fell.
fn quantile_bound(text: &str, outcome: &str, quantile: f64) -> (f64, f64) {
    let count = metric(
        text,
        "cachepick_answer_seconds_count",
        &[("outcome", outcome)],
    );
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter(|line| {
            line.starts_with("cachepick_answer_seconds_bucket")
                && line.contains(&format!("outcome=\"{outcome}\""))
        })
        .filter_map(|line| {
            let le = line.split("le=\"").nth(1)?.split('"').next()?;
            let value: f64 = line.rsplit(' ').next()?.parse().ok()?;
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((bound, value))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let bound = buckets
        .iter()
        .find(|(_, cumulative)| *cumulative >= quantile * count)
        .map_or(f64::INFINITY, |(bound, _)| *bound);
    (bound, count)
}

/// Decisions a second the picker completes, asked directly over gRPC by `concurrency` callers for
/// `window`, with prompts of `bytes`, each decision slowed by `fault` when given.
async fn capacity(
    listen: SocketAddr,
    bytes: usize,
    fault: Option<String>,
    concurrency: usize,
    window: Duration,
) -> f64 {
    let client = Arc::new(
        cachepick_rig::client::Client::connect(listen)
            .await
            .expect("the ext_proc client connects"),
    );
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + window;
    let mut callers = Vec::new();
    for caller in 0..concurrency {
        let client = Arc::clone(&client);
        let done = Arc::clone(&done);
        let fault = fault.clone();
        callers.push(tokio::spawn(async move {
            let mut seed = 1_000_000 * (caller as u64 + 1);
            while Instant::now() < until {
                seed += 1;
                let headers: Vec<(&str, &str)> =
                    fault.iter().map(|fault| (FAULT, fault.as_str())).collect();
                let decided = client.decide_with(CHAT, &chat(seed, bytes), &headers).await;
                if matches!(decided, Ok(Verdict::Route { .. })) {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for caller in callers {
        caller.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / window.as_secs_f64()
}

/// Three times the picker's measured capacity through Envoy: decisions answered stay within the
/// deadline, the rest are shed and served by Envoy's fallback, and nothing arrives after Envoy gave up.
///
/// By default every decision is slowed by an injected 40 ms (`sleep=40`): capacity is then the slots'
/// and not the CPU's, so the test overloads the picker, not the 2-core machine Envoy and the clients
/// share with it. RELIABILITY.md reports runs with real, CPU-bound decisions on large prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_the_capacity_sheds_and_every_request_is_served() {
    overload_run(BodyMode::Buffered).await;
}

/// The same in streamed mode (`cachepick envoy-config --mode streamed`), where Envoy's message timeout
/// runs from the headers to cachepick's answer: a shed request is continued without a destination
/// (cachepick owes the headers answer) rather than failed open, and is served all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_the_capacity_sheds_and_every_request_is_served_streamed() {
    overload_run(BodyMode::Streamed).await;
}

/// Held for the whole of an overload run. Each run measures the picker's capacity on this machine and
/// then offers three times it, so two runs at once would each measure, and overload, a machine the other
/// is loading: the 2 cores, not the picker, would be what is overloaded, which the test does not claim
/// to survive (Envoy then counts message timeouts, and the simulated workers fall behind on accepts).
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn overload_run(mode: BodyMode) {
    require_fault_injection();
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let bytes = usize::try_from(knob("OVERLOAD_PROMPT_BYTES", 4 << 10)).unwrap();
    let sleep = knob("OVERLOAD_SLEEP_MS", 40);
    let seconds = knob("OVERLOAD_SECONDS", 3);
    let fault = (sleep > 0).then(|| format!("sleep={sleep}"));
    let head = format!(
        "max_body_bytes: 8MiB\noverload: {{message_timeout: 1s, decision_deadline: {}ms}}",
        DECISION_DEADLINE.as_millis()
    );
    // The real tokenizer: deciding a large prompt is CPU work, as in production.
    let stack = Stack::start(mode, &head, TokenizerConfig::default()).await;
    let slots = {
        let reply = stack
            .client
            .get(stack.config.metrics_listen, "/debug/snapshot")
            .await;
        reply.json()["admission"]["decision_slots"]
            .as_u64()
            .unwrap() as usize
    };
    let capacity = capacity(
        stack.config.listen,
        bytes,
        fault.clone(),
        slots * 2,
        Duration::from_secs(1),
    )
    .await;
    assert!(capacity > 0.0, "the picker decided nothing");
    let before = stack.picker_metrics().await;
    let offered = 3.0 * capacity;
    let total = (offered * seconds as f64).ceil() as u64;
    let interval = Duration::from_secs_f64(1.0 / offered);
    eprintln!(
        "{mode:?}: capacity {capacity:.0} decisions/s ({slots} slots, {bytes}-byte prompts, injected \
         sleep {sleep} ms); offering {offered:.0}/s for {seconds} s: {total} requests"
    );
    let stack = Arc::new(stack);
    let started = Instant::now();
    let mut requests = Vec::new();
    for index in 0..total {
        tokio::time::sleep_until((started + interval.mul_f64(index as f64)).into()).await;
        let stack = Arc::clone(&stack);
        let fault = fault.clone();
        requests.push(tokio::spawn(async move {
            let body = chat(2_000_000 + index, bytes);
            let headers: Vec<(&str, &str)> =
                fault.iter().map(|fault| (FAULT, fault.as_str())).collect();
            bounded(
                "a request through Envoy",
                DEADLINE * 2,
                stack.chat(body, &headers),
            )
            .await
        }));
    }
    let offered_for = started.elapsed();
    let mut failed = Vec::new();
    let mut undecided = 0_u64;
    for request in requests {
        match request.await.unwrap() {
            Ok(reply) if reply.status.as_u16() == 200 => {
                if reply
                    .header(&format!("x-sim-echo-{DECISION_HEADER}"))
                    .is_none()
                {
                    undecided += 1;
                }
            }
            Ok(reply) => failed.push(format!("{}: {}", reply.status, reply.text())),
            Err(error) => failed.push(error),
        }
    }
    let served_in = started.elapsed();
    let text = stack.picker_metrics().await;
    let shed = |reason| {
        metric(&text, "cachepick_shed_total", &[("reason", reason)])
            - metric(&before, "cachepick_shed_total", &[("reason", reason)])
    };
    let (shed_deadline, shed_full) = (shed("deadline"), shed("queue_full"));
    let routed = metric_sum(&text, "cachepick_decisions_total", &[])
        - metric_sum(&before, "cachepick_decisions_total", &[]);
    let refused_late = metric(
        &text,
        "cachepick_commits_refused_total",
        &[("reason", "deadline")],
    );
    let (p99, answered) = quantile_bound(&text, "routed", 0.99);
    let (p50, _) = quantile_bound(&text, "routed", 0.50);
    let failed_open = stack.ext_proc_stat("failure_mode_allowed").await;
    let timeouts = stack.ext_proc_stat("message_timeouts").await;
    eprintln!(
        "offered {total} in {offered_for:?}, all answered in {served_in:?}: {} failed; routed {routed}, \
         shed deadline {shed_deadline} queue_full {shed_full}; commits refused late {refused_late}; \
         answered decisions p50 <= {p50} s, p99 <= {p99} s (of {answered}); Envoy failed open \
         {failed_open}, message timeouts {timeouts}; served without a decision {undecided}",
        failed.len()
    );
    let closed: Vec<String> = ["answered", "reset", "error", "shed"]
        .iter()
        .map(|outcome| {
            format!(
                "{outcome} {}",
                metric(
                    &text,
                    "cachepick_extproc_streams_closed_total",
                    &[("outcome", outcome)]
                )
            )
        })
        .collect();
    eprintln!(
        "streams closed: {}; shed: {}",
        closed.join(", "),
        text.lines()
            .filter(|line| line.starts_with("cachepick_shed_total{"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert!(failed.is_empty(), "requests not served: {failed:?}");
    assert!(
        shed_deadline + shed_full > 0.0,
        "3x the capacity shed nothing"
    );
    assert!(
        p99 <= DECISION_DEADLINE.as_secs_f64(),
        "the p99 of answered decisions ({p99} s) is over the deadline"
    );
    // Every shed request was served by Envoy's fallback — failed open on cachepick's gRPC error
    // (buffered), or continued without a destination (streamed) — and no answer came after Envoy
    // stopped waiting (a routed answer after that would have been a commit for a request sent
    // elsewhere).
    let shed = shed_deadline + shed_full;
    assert!(
        undecided as f64 >= shed,
        "{undecided} served undecided, {shed} shed"
    );
    match mode {
        BodyMode::Buffered => assert!(failed_open as f64 >= shed),
        _ => assert_eq!(failed_open, 0, "{mode:?}: a shed is not an error"),
    }
    assert_eq!(timeouts, 0, "Envoy timed out waiting for cachepick");
    let stack = Arc::into_inner(stack).expect("every request finished");
    stack.stop().await;
}

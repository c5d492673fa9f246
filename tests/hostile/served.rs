//! Requests the engine refuses, or never runs, must not take the owner index from everyone else: the
//! real `cachepick serve`, a real Envoy 1.40 with the generated bootstrap (feedback on, so Envoy reports
//! each response's status and upstream host), and a simulated vLLM fleet.
//!
//! - A flood of 131,000-token completions the engine refuses with 400 (their requested output takes
//!   them past the engine's context) leaves the index as it was, and a live conversation's next turn
//!   still hits its owner: refused requests credit nobody (retracted on the report, or never committed
//!   when the picker can tell from `max_model_len`).
//! - A request Envoy retries elsewhere (the chosen worker refuses connections) credits the worker that
//!   served it, so the conversation's next turn goes there.
//! - GET and DELETE with chat bodies are routed by load and never learned; OPTIONS and HEAD pass through.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use super::sim_fleet;
use super::{envoy, sim_client};

use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use http::Method;
use serde_json::{Value, json};

use cachepick::config::{self, Config};
use cachepick::envoy_config::{self, BodyMode};
use cachepick_rig::nz;
use cachepick_sim::Engine;
use cachepick_sim::fleet::Fleet;
use sim_client::{CHAT, COMPLETIONS, Client, DEADLINE, MODEL, Reply, bounded, metric, metric_sum};

const ECHO_SELECTED: &str = "x-sim-echo-x-cachepick-endpoint";
const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";
const SERVED_BY: &str = "x-served-by";
/// How long the stack has to route its first request (picker ready, Envoy's EDS filled).
const READY_WITHIN: Duration = Duration::from_secs(20);

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port)
}

/// `cachepick serve`, killed on drop.
struct Serve {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two simulated workers, the real binary over `config`, and Envoy in `mode`.
struct Stack {
    _fleet: Fleet,
    _serve: Serve,
    envoy: envoy::Envoy,
    metrics: SocketAddr,
    gateway: SocketAddr,
    client: Client,
}

impl Stack {
    /// The fleet's configuration on free ports, changed by `edit`, served by the real binary.
    async fn start(mode: BodyMode, edit: impl FnOnce(&mut Config, &Fleet)) -> Stack {
        let sim = sim_fleet::config(Engine::Vllm, 2);
        let fleet = sim_fleet::start(&sim).await;
        let overrides = envoy::free_listeners();
        let mut config = config::parse(&fleet.cachepick_config(), "fleet", &overrides).unwrap();
        for policy in config.policies_mut() {
            policy.cache_aware_mut().unwrap().min_match_tokens = 64;
        }
        assert!(config.feedback.enabled, "feedback is on by default");
        edit(&mut config, &fleet);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cachepick.yaml");
        std::fs::write(&file, config.to_yaml()).unwrap();
        let child = Command::new(cachepick_rig::cachepick_binary())
            .args(["serve", "--config", file.to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cachepick serve starts");
        let serve = Serve { child, _dir: dir };
        let options = envoy::free_options(&config, mode);
        let gateway = options.listen;
        let bootstrap = envoy_config::render(&config, &options);
        assert!(
            bootstrap.contains("response_header_mode: SEND")
                && bootstrap.contains("response_attributes: [upstream.address, response.code]")
                && bootstrap
                    .contains("initial_metadata: [{key: x-cachepick-feedback, value: served}]"),
            "the generated filter asks for the response report"
        );
        let envoy = envoy::Envoy::start(&bootstrap).await;
        Stack {
            _fleet: fleet,
            _serve: serve,
            envoy,
            metrics: config.metrics_listen,
            gateway,
            client: Client::new(),
        }
    }

    async fn send(&self, method: Method, path: &str, body: &Value) -> Reply {
        let what = format!("{method} {path} through Envoy");
        bounded(
            &what,
            DEADLINE,
            self.client
                .try_exchange(method, self.gateway, path, Some(body)),
        )
        .await
        .unwrap_or_else(|error| panic!("{what}: {error}"))
    }

    /// A first request routed by cachepick (the picker is ready and Envoy has its roster).
    async fn wait_routed(&self) {
        let started = Instant::now();
        loop {
            let reply = self
                .client
                .try_exchange(Method::POST, self.gateway, CHAT, Some(&chat(&["warm-up"])))
                .await;
            if let Ok(reply) = &reply
                && reply.status == 200
                && reply.header(ECHO_DECISION).is_some()
            {
                return;
            }
            assert!(
                started.elapsed() < READY_WITHIN,
                "nothing routed by cachepick within {READY_WITHIN:?}: {reply:?}\n{}",
                self.envoy.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn metrics(&self) -> String {
        let reply = self
            .client
            .try_exchange(Method::GET, self.metrics, "/metrics", None)
            .await
            .expect("the picker's /metrics");
        reply.text()
    }

    async fn entries(&self) -> f64 {
        metric(
            &self.metrics().await,
            "cachepick_index_entries",
            &[("pool", MODEL)],
        )
    }

    /// `cachepick_feedback_total{outcome}`, once it reaches at least `least` (reports settle just after
    /// the response is on its way), within a generous 5 s.
    async fn feedback_reaches(&self, outcome: &str, least: f64) -> f64 {
        let started = Instant::now();
        loop {
            let count = metric_sum(
                &self.metrics().await,
                "cachepick_feedback_total",
                &[("outcome", outcome)],
            );
            if count >= least || started.elapsed() > Duration::from_secs(5) {
                return count;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A chat whose messages are `turns`, alternating user and assistant, after a long system prompt.
fn chat(turns: &[&str]) -> Value {
    chat_in("You answer about caches, briefly. ", turns)
}

/// [`chat`] with a system prompt of `system` repeated: conversations with different ones share no
/// prefix.
fn chat_in(system: &str, turns: &[&str]) -> Value {
    let system = json!({"role": "system", "content": system.repeat(40)});
    let mut messages = vec![system];
    for (i, turn) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": turn}));
    }
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

/// 131,000 token ids (all of them below 256, the byte tokenizer's vocabulary), different per `seed`.
fn huge_prompt(seed: u64, max_tokens: u64) -> Value {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let ids: Vec<u64> = (0..131_000)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % 255 + 1
        })
        .collect();
    json!({"model": MODEL, "prompt": ids, "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_do_not_flush_the_owner_index() {
    // The picker's context is far above the engine's (131,072), so it cannot tell the refusal coming
    // for the first flood: only Envoy's report of the 400 keeps the index clean.
    let stack = Stack::start(BodyMode::Buffered, |config: &mut Config, _: &Fleet| {
        config.pools[0].max_model_len = nz(1_000_000_000).into();
    })
    .await;
    stack.wait_routed().await;
    let first = stack
        .send(Method::POST, CHAT, &chat(&["What is a cache?"]))
        .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let owner = first.header(SERVED_BY).unwrap().to_owned();
    stack.feedback_reaches("confirmed", 2.0).await;
    let before = stack.entries().await;
    assert!(before > 0.0, "the conversation is in the index");

    // Prompt + requested output beyond the engine's context: the engine answers 400 at once.
    for seed in 0..6 {
        let reply = stack
            .send(Method::POST, COMPLETIONS, &huge_prompt(seed, 100_000))
            .await;
        assert_eq!(reply.status, 400, "the engine refuses it: {}", reply.text());
    }
    let retracted = stack.feedback_reaches("retracted", 6.0).await;
    assert_eq!(
        retracted, 6.0,
        "every refused request's credit is taken back"
    );
    // The same flood with an output beyond even the picker's max_model_len is never committed.
    for seed in 6..12 {
        let reply = stack
            .send(Method::POST, COMPLETIONS, &huge_prompt(seed, 1_000_000_000))
            .await;
        assert_eq!(reply.status, 400, "{}", reply.text());
    }
    // The bound: nothing of either flood stays (each credit is at most index.commit_share, a quarter,
    // of a worker's capacity while its response is on its way).
    let after = stack.entries().await;
    assert!(
        after <= before,
        "the refused flood grew the index from {before} to {after} entries"
    );

    // GET and DELETE with a chat body: routed by load, never learned.
    let passthrough = |text: &str| metric(text, "cachepick_passthrough_total", &[("pool", MODEL)]);
    let passed = passthrough(&stack.metrics().await);
    for method in [Method::GET, Method::DELETE] {
        let reply = stack
            .send(method.clone(), CHAT, &chat(&["a body no engine runs", "x"]))
            .await;
        assert_eq!(reply.header(ECHO_DECISION), Some("passthrough"), "{method}");
    }
    // A CORS preflight and a HEAD carry no body: passed through by load, never refused.
    for method in [Method::OPTIONS, Method::HEAD] {
        let what = format!("{method} {CHAT} through Envoy");
        let reply = bounded(
            &what,
            DEADLINE,
            stack
                .client
                .try_exchange(method.clone(), stack.gateway, CHAT, None),
        )
        .await
        .unwrap_or_else(|error| panic!("{what}: {error}"));
        assert_ne!(reply.status, 400, "{what} was refused");
        assert_eq!(reply.header(ECHO_DECISION), Some("passthrough"), "{what}");
    }
    let text = stack.metrics().await;
    assert_eq!(passthrough(&text), passed + 4.0);
    assert!(
        stack.entries().await <= before,
        "GET/DELETE bodies were learned"
    );

    // The live conversation's next turn still finds its owner.
    let next = stack
        .send(
            Method::POST,
            CHAT,
            &chat(&["What is a cache?", "A store.", "And then?"]),
        )
        .await;
    assert_eq!(next.status, 200);
    assert_eq!(next.header(ECHO_DECISION), Some("cache_hit"));
    assert_eq!(next.header(SERVED_BY), Some(owner.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_envoy_retried_elsewhere_credits_the_worker_that_served_it() {
    // Worker 1's slot goes to an address that refuses connections but reports worker 1's metrics: to
    // the picker a healthy, idle worker; to Envoy a connect failure, retried on the next listed worker.
    let refusing = loopback(envoy::free_port());
    // Duplex: the response phase works with the body streamed through cachepick as well.
    let stack = Stack::start(BodyMode::Duplex, |config, _| {
        config.pools[0].workers[1].endpoint = refusing;
    })
    .await;
    stack.wait_routed().await;
    let live = stack
        .send(Method::POST, CHAT, &chat(&["which worker?"]))
        .await;
    let live = live.header(SERVED_BY).unwrap().to_owned();
    assert_ne!(live, refusing.to_string());
    // The picker chooses between the two by load: try conversations until it chose the refusing one.
    let mut retried = 0;
    for conversation in 0..40 {
        let system = format!("Conversation {conversation} of the retry test. ");
        let opening = "tell me about retries.";
        let first = stack
            .send(Method::POST, CHAT, &chat_in(&system, &[opening]))
            .await;
        assert_eq!(first.status, 200, "{}", first.text());
        assert_eq!(first.header(SERVED_BY), Some(live.as_str()));
        if first.header(ECHO_SELECTED) != Some(refusing.to_string().as_str()) {
            continue;
        }
        retried += 1;
        let moved = stack.feedback_reaches("moved", f64::from(retried)).await;
        assert_eq!(moved, f64::from(retried), "the credit moved to {live}");
        let next = stack
            .send(
                Method::POST,
                CHAT,
                &chat_in(&system, &[opening, "Retries.", "More?"]),
            )
            .await;
        assert_eq!(next.status, 200);
        assert_eq!(
            next.header(ECHO_SELECTED),
            Some(live.as_str()),
            "the next turn goes to the worker that served the first"
        );
        assert_eq!(next.header(ECHO_DECISION), Some("cache_hit"));
        if retried == 3 {
            break;
        }
    }
    assert!(
        retried > 0,
        "the picker never chose the refusing worker in 40 conversations"
    );
}

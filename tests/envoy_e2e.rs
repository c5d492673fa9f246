//! The whole product end to end: a simulated vLLM fleet, cachepick started in process through
//! `app::run`, and a real Envoy 1.40 running the bootstrap `envoy_config::render` generates, with the
//! client talking HTTP to Envoy only.
//!
//! What only this level can show: that a decision takes effect (the worker that served a request is the
//! one cachepick named, and the simulator's own cache agrees it held the prefix), that a client cannot
//! steer with the routing headers, that Envoy's per-reason virtual-cluster counters and cachepick's
//! decision counters agree with a scripted scenario exactly, that SSE streams through unbuffered, that
//! big bodies work in duplex mode and are refused quickly in buffered mode, that Envoy fails open when
//! the picker is gone, and that refusals are cachepick's JSON answers that never reach a worker.
//!
//! Every stack binds ephemeral loopback ports and every wait is bounded, so a broken piece fails the
//! test instead of hanging it. Envoy is never skipped: `envoy::binary()` provisions it or panics.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, sim_client, sim_fleet};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use http::header::CONTENT_TYPE;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode, EnvoyOptions};
use cachepick::policy::Reason;
use cachepick::protocol::{
    DECISION_HEADER, DESTINATION, PASSTHROUGH, PREFIX_TOKENS_HEADER, REFUSAL_HEADER,
};
use cachepick_rig::nz;
use cachepick_rig::stage::{Picker, READY_WITHIN};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};
use sim_client::{CHAT, COMPLETIONS, Client, DEADLINE, MODEL, Reply, Usage, bounded, metric_sum};

/// The queue gate of every stack: an owner with 2 or more waiting is passed over, and the fleet is
/// saturated when no fresh reading is below 1.
const QUEUE_LIMIT: u64 = 2;
const QUEUE_FLOOR: u64 = 1;
/// Low enough that a 2 KB prompt (about 500 byte-tokens) makes its worker an owner.
const MIN_MATCH_TOKENS: u64 = 64;
const SCRAPE_INTERVAL: Duration = Duration::from_millis(100);
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(80);
const FRESHNESS: Duration = Duration::from_millis(500);
/// The headers a worker echoes back as `x-sim-echo-<name>`.
const ECHO_DESTINATION: &str = "x-sim-echo-x-gateway-destination-endpoint";
const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";
const ECHO_PREFIX_TOKENS: &str = "x-sim-echo-x-cachepick-prefix-tokens";

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

// === the stack ===

/// What differs between stacks.
struct Setup {
    mode: BodyMode,
    /// cachepick's `max_body_bytes` (the generated Envoy buffer limits follow it); `None` keeps the default.
    max_body_bytes: Option<usize>,
    /// Applied to the simulator's configuration before the fleet starts.
    tune: fn(&mut SimConfig),
    /// Envoy dials the picker by this DNS name (`--picker NAME:PORT`) rather than by its address.
    picker_name: Option<&'static str>,
}

impl Setup {
    fn new(mode: BodyMode) -> Setup {
        Setup {
            mode,
            max_body_bytes: None,
            tune: |_| {},
            picker_name: None,
        }
    }
}

/// Fleet + cachepick + Envoy. Dropping it stops cachepick, kills Envoy and stops the workers.
struct Stack {
    fleet: Fleet,
    config: Config,
    envoy: envoy::Envoy,
    /// The bootstrap Envoy runs.
    yaml: String,
    /// Envoy's HTTP listener: where clients send LLM requests.
    gateway: SocketAddr,
    /// The simulator client, for Envoy's listener, the workers' admin routes and cachepick's metrics
    /// listener.
    sim: Client,
    /// Stopped through its shutdown when the stack is dropped, or by `stop_picker`.
    picker: Option<Picker>,
}

impl Stack {
    async fn start(setup: Setup) -> Stack {
        // (a) three simulated vLLM workers: exact byte tokenizer, 16-token blocks, no jitter, fast clock.
        let mut sim = sim_fleet::config(Engine::Vllm, 3);
        sim.params.max_running = nz(4);
        (setup.tune)(&mut sim);
        let fleet = sim_fleet::start(&sim).await;

        // (b) cachepick with the fleet's generated configuration, on free ports, with a fast scrape.
        let generated = fleet.cachepick_config();
        let overrides = Overrides {
            worker_queue_limit: Some(QUEUE_LIMIT),
            saturation_queue_floor: Some(QUEUE_FLOOR),
            ..envoy::free_listeners()
        };
        let mut config = config::parse(&generated, "the e2e configuration", &overrides)
            .unwrap_or_else(|error| panic!("{error}\n{generated}"));
        let gate = config
            .policy
            .gate()
            .expect("the overrides set a queue gate");
        assert_eq!(
            (gate.limit(), gate.floor()),
            (QUEUE_LIMIT, Some(QUEUE_FLOOR))
        );
        for policy in config.policies_mut() {
            let knobs = policy
                .cache_aware_mut()
                .expect("the fleet's config is cache_aware");
            knobs.min_match_tokens = MIN_MATCH_TOKENS;
        }
        config.load.scrape_interval = SCRAPE_INTERVAL;
        config.load.scrape_timeout = SCRAPE_TIMEOUT;
        config.load.freshness = FRESHNESS;
        if let Some(bytes) = setup.max_body_bytes {
            config.max_body_bytes = NonZeroUsize::new(bytes).expect("a positive body limit");
        }
        // The edits bypassed validation: round-trip the effective configuration through it.
        let effective = config.to_yaml();
        let config = config::parse(
            &effective,
            "the edited e2e configuration",
            &Overrides::default(),
        )
        .unwrap_or_else(|error| panic!("{error}\n{effective}"));
        assert_eq!(config.load.freshness, FRESHNESS, "{effective}");
        let mut picker = Picker::spawn(config.clone());
        if let Err(error) = picker.ready(READY_WITHIN).await {
            panic!("cachepick on {} is not ready: {error}", config.listen);
        }

        // (c) a real Envoy running the bootstrap generated from the same configuration.
        let gateway = loopback(envoy::free_port());
        let mut options = EnvoyOptions {
            mode: setup.mode,
            listen: gateway,
            admin: loopback(envoy::free_port()),
            ..EnvoyOptions::for_config(&config)
        };
        if let Some(name) = setup.picker_name {
            options.pickers = vec![
                format!("{name}:{}", config.listen.port())
                    .parse()
                    .expect("a picker name"),
            ];
        }
        let yaml = envoy_config::render(&config, &options);
        let envoy = envoy::Envoy::start(&yaml).await;

        Stack {
            fleet,
            config,
            envoy,
            yaml,
            gateway,
            sim: Client::new(),
            picker: Some(picker),
        }
    }

    fn endpoints(&self) -> Vec<SocketAddr> {
        self.fleet.endpoints()
    }

    fn endpoint_strings(&self) -> Vec<String> {
        self.endpoints().iter().map(ToString::to_string).collect()
    }

    /// One request through Envoy, read whole; the transport error as text.
    async fn try_send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<Reply, String> {
        let mut headers = headers.to_vec();
        if !body.is_empty() {
            headers.insert(0, (CONTENT_TYPE.as_str(), "application/json"));
        }
        let response = self
            .sim
            .send_raw(method, self.gateway, path, &headers, body);
        sim_client::read_whole(response.await).await
    }

    /// One request through Envoy within `DEADLINE`; panics on a transport error.
    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Reply {
        let what = format!("{method} {path} through Envoy");
        bounded(
            &what,
            DEADLINE,
            self.try_send(method.clone(), path, headers, body),
        )
        .await
        .unwrap_or_else(|error| panic!("{what}: {error}"))
    }

    /// A non-streaming chat of one user message through Envoy, with extra client headers.
    async fn chat(&self, prompt: &str, headers: &[(&str, &str)]) -> Reply {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
        });
        self.send(
            Method::POST,
            CHAT,
            headers,
            serde_json::to_vec(&body).unwrap(),
        )
        .await
    }

    /// A non-streaming completion `body` (see [`completion`]) through Envoy.
    async fn complete(&self, body: Vec<u8>) -> Reply {
        self.send(Method::POST, COMPLETIONS, &[], body).await
    }

    /// Envoy's count of requests upstream in the virtual cluster of decision `reason` (0 until it has one).
    async fn vcluster_requests(&self, reason: &str) -> u64 {
        let name = format!("vhost.llm.vcluster.{reason}.upstream_rq_total");
        self.envoy.stat(&name).await.unwrap_or(0)
    }

    /// cachepick's `/metrics`.
    async fn picker_metrics(&self) -> String {
        let reply = self.sim.get(self.config.metrics_listen, "/metrics").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.text()
    }

    /// cachepick's `/debug/snapshot`: each worker's reading, by endpoint, as `(fresh, waiting)`.
    async fn readings(&self) -> BTreeMap<String, (bool, Option<u64>)> {
        let reply = self
            .sim
            .get(self.config.metrics_listen, "/debug/snapshot")
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let pools = reply.json();
        pools["pools"][0]["workers"]
            .as_array()
            .unwrap_or_else(|| panic!("no workers in the snapshot: {pools}"))
            .iter()
            .map(|worker| {
                (
                    worker["endpoint"].as_str().unwrap_or_default().to_owned(),
                    (
                        worker["fresh"].as_bool().unwrap_or(false),
                        worker["waiting"].as_u64(),
                    ),
                )
            })
            .collect()
    }

    /// Makes worker `addr` report `waiting` requests waiting on every rank (`None` clears the fake).
    async fn fake_waiting(&self, addr: SocketAddr, waiting: Option<u64>) {
        let fake = waiting.map_or(Value::Null, |waiting| json!({"waiting": waiting}));
        self.sim
            .admin(addr, "/admin/metrics", &json!({"fake": fake}))
            .await;
    }

    /// Waits until cachepick's snapshot shows every worker fresh with the `expected` waiting count.
    async fn wait_readings(&self, expected: &BTreeMap<String, u64>) {
        let start = Instant::now();
        loop {
            let readings = self.readings().await;
            let seen: BTreeMap<String, u64> = readings
                .iter()
                .filter(|(_, (fresh, _))| *fresh)
                .filter_map(|(endpoint, (_, waiting))| Some((endpoint.clone(), (*waiting)?)))
                .collect();
            if &seen == expected {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "cachepick's snapshot never showed {expected:?} (fresh readings); last: {readings:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until Envoy's health check has marked the picker down (`cluster.cachepick.membership_healthy`
    /// 0); panics after 5 s.
    async fn wait_picker_unhealthy(&self) {
        const NAME: &str = "cluster.cachepick.membership_healthy";
        let start = Instant::now();
        loop {
            let healthy = self.envoy.stat(NAME).await;
            if healthy == Some(0) {
                return;
            }
            if start.elapsed() > Duration::from_secs(5) {
                let stats = self.envoy.stats().await;
                let picker: Vec<&str> = stats
                    .lines()
                    .filter(|line| {
                        line.starts_with("cluster.cachepick.health_check")
                            || line.starts_with("cluster.cachepick.membership")
                    })
                    .collect();
                panic!(
                    "Envoy never marked the stopped picker unhealthy ({NAME} = {healthy:?} after 5 s): \
                     without an active health check on the `cachepick` cluster, a duplex-mode request \
                     cannot fail open when the picker is gone. Stats:\n{}",
                    picker.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops cachepick through its shutdown future; `app::run` must return `Ok` in time.
    async fn stop_picker(&mut self) {
        let picker = self.picker.take().expect("the picker runs");
        bounded("cachepick stops", DEADLINE, picker.stop())
            .await
            .expect("cachepick stops cleanly");
    }
}

// === reading replies ===

/// Deterministic text of exactly `bytes` bytes, unique to `tag` from its first byte on, so two tags
/// share no prefix block.
fn text(tag: &str, bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 32);
    let mut index = 0_u64;
    while out.len() < bytes {
        out.push_str(&format!("{tag}:{index} "));
        index += 1;
    }
    out.truncate(bytes);
    out
}

/// A non-streaming completion body: `prompt`, two tokens out.
fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})).unwrap()
}

/// Every value of header `name`.
fn all(reply: &Reply, name: &str) -> Vec<String> {
    reply
        .headers
        .get_all(name)
        .iter()
        .map(|value| value.to_str().unwrap_or("<not text>").to_owned())
        .collect()
}

/// The single value of header `name`; panics when absent or repeated.
fn one(reply: &Reply, name: &str) -> String {
    match all(reply, name).as_slice() {
        [value] => value.clone(),
        other => panic!(
            "expected exactly one {name}, got {other:?}; headers {:?}; body {}",
            reply.headers,
            reply.text()
        ),
    }
}

/// Asserts the reply's status, showing its headers and body otherwise.
fn assert_status(reply: &Reply, status: StatusCode) {
    assert_eq!(
        reply.status,
        status,
        "headers {:?}; body {}",
        reply.headers,
        reply.text()
    );
}

/// Asserts the reply's status and that no worker answered (none named itself in `x-served-by`).
fn assert_not_served(reply: &Reply, status: StatusCode) {
    assert_status(reply, status);
    assert!(
        all(reply, "x-served-by").is_empty(),
        "a worker answered: {:?}",
        reply.headers
    );
}

/// Asserts that a routed completion of `prompt_bytes` bytes was a miss and reached its worker whole.
fn assert_served_whole(stack: &Stack, reply: &Reply, prompt_bytes: usize) {
    let landed = routed(stack, reply);
    assert_eq!(landed.decision, "cache_miss", "{landed:?}");
    // The byte tokenizer packs 4 bytes per token: the worker counted every byte of the prompt.
    assert_eq!(reply.usage().prompt_tokens, (prompt_bytes / 4) as u64);
}

/// Whether a bootstrap sets a listener's per-connection buffer (the generated one keeps Envoy's default).
fn sets_a_connection_buffer(yaml: &str) -> bool {
    yaml.lines().any(|line| {
        line.trim_start()
            .starts_with("per_connection_buffer_limit_bytes:")
    })
}

/// Room for a prompt of millions of bytes, and a prefill that does not take minutes.
fn room_for_huge_prompts(sim: &mut SimConfig) {
    sim.params.max_model_len = nz(2_000_000);
    sim.params.kv_blocks = nz(100_000);
    sim.params.time_scale = 0.001;
}

/// What the worker that served a routed request reports about it.
#[derive(Debug)]
struct Routed {
    served_by: String,
    /// The destination list cachepick set (selected worker first), as the worker received it.
    destination: Vec<String>,
    decision: String,
    cached_tokens: u64,
}

/// Checks the invariants of every routed reply and returns what it says: 200, served by a fleet
/// worker, which is the first entry of the destination header cachepick set (one header, one list of
/// distinct fleet members), and a known decision reason.
fn routed(stack: &Stack, reply: &Reply) -> Routed {
    assert_status(reply, StatusCode::OK);
    let fleet = stack.endpoint_strings();
    let served_by = one(reply, "x-served-by");
    assert!(
        fleet.contains(&served_by),
        "served by {served_by}, not a fleet worker {fleet:?}"
    );
    let destination: Vec<String> = one(reply, ECHO_DESTINATION)
        .split(',')
        .map(|entry| entry.trim().to_owned())
        .collect();
    assert_eq!(
        destination.first(),
        Some(&served_by),
        "the request was not served where cachepick sent it: destination {destination:?}"
    );
    for (index, entry) in destination.iter().enumerate() {
        assert!(
            fleet.contains(entry),
            "{entry} in {destination:?} is not a fleet worker"
        );
        assert!(
            !destination[..index].contains(entry),
            "{entry} repeated in {destination:?}"
        );
    }
    let decision = one(reply, ECHO_DECISION);
    assert!(
        Reason::ALL.iter().any(|reason| reason.as_str() == decision),
        "unknown decision reason {decision:?}"
    );
    let cached_tokens = one(reply, "x-cached-tokens")
        .parse()
        .expect("x-cached-tokens is a number");
    Routed {
        served_by,
        destination,
        decision,
        cached_tokens,
    }
}

/// Runs the scenario `$scenario(mode)` as three tests, `$scenario::buffered`, `$scenario::duplex` and
/// `$scenario::streamed`.
macro_rules! in_both_body_modes {
    ($scenario:ident) => {
        mod $scenario {
            use super::BodyMode;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn buffered() {
                super::$scenario(BodyMode::Buffered).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn duplex() {
                super::$scenario(BodyMode::Duplex).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn streamed() {
                super::$scenario(BodyMode::Streamed).await;
            }
        }
    };
}

// === 1. requests land where the picker says ===

async fn requests_land_where_the_picker_says(mode: BodyMode) {
    land_where_the_picker_says(&Stack::start(Setup::new(mode)).await).await;
}

in_both_body_modes!(requests_land_where_the_picker_says);

/// `--picker NAME:PORT` (a Kubernetes Service, say): Envoy resolves the name itself, and the picker it
/// reaches decides as one named by address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picker_named_by_dns_decides_as_one_named_by_address() {
    let stack = Stack::start(Setup {
        picker_name: Some("localhost"),
        ..Setup::new(BodyMode::Buffered)
    })
    .await;
    assert!(
        stack.yaml.contains("envoy.cluster.dns") && stack.yaml.contains("\"localhost\""),
        "{}",
        stack.yaml
    );
    land_where_the_picker_says(&stack).await;
}

async fn land_where_the_picker_says(stack: &Stack) {
    let prompts: Vec<String> = (0..5).map(|i| text(&format!("land-{i}"), 2048)).collect();
    let mut owners = Vec::new();
    for prompt in &prompts {
        let first = routed(stack, &stack.chat(prompt, &[]).await);
        assert_eq!(first.decision, "cache_miss", "a new prompt: {first:?}");
        assert_eq!(
            first.cached_tokens, 0,
            "nobody has seen this prompt: {first:?}"
        );
        owners.push(first.served_by);
    }
    for (prompt, owner) in prompts.iter().zip(&owners) {
        let reply = stack.chat(prompt, &[]).await;
        let again = routed(stack, &reply);
        assert_eq!(again.decision, "cache_hit", "a repeated prompt: {again:?}");
        assert_eq!(
            &again.served_by, owner,
            "a repeat goes to the prompt's owner"
        );
        // The simulator keeps its own cache: it found the prefix, so the picker sent it to the owner.
        assert!(
            again.cached_tokens > 0,
            "the owner's cache did not hold the prompt: {again:?}"
        );
        assert_eq!(reply.usage().cached_tokens, again.cached_tokens);
        let credited: u64 = one(&reply, ECHO_PREFIX_TOKENS).parse().unwrap();
        assert!(credited >= MIN_MATCH_TOKENS, "prefix tokens {credited}");
    }
}

// === 2. a client cannot steer ===

async fn spoofed_routing_headers_cannot_steer(mode: BodyMode) {
    let stack = Stack::start(Setup::new(mode)).await;
    let endpoints = stack.endpoint_strings();
    let prompt = text("spoof", 2048);

    // A new prompt with a forged decision and destination: the worker sees cachepick's values only.
    let forged = endpoints[0].clone();
    let first = routed(
        &stack,
        &stack
            .chat(
                &prompt,
                &[(DESTINATION, &forged), (DECISION_HEADER, "cache_hit")],
            )
            .await,
    );
    assert_eq!(first.decision, "cache_miss", "{first:?}");
    assert_eq!(
        first.destination.len(),
        1 + stack.config.policy.max_fallbacks,
        "cachepick's list (selected worker and fallbacks), not the client's: {first:?}"
    );
    let owner = first.served_by;

    // Its owner is A: a forged destination C (another fleet worker), forged decision, forged prefix
    // credit and a made-up x-cachepick-* header change nothing and never reach the worker.
    let other = endpoints
        .iter()
        .find(|endpoint| **endpoint != owner)
        .unwrap()
        .clone();
    let reply = stack
        .chat(
            &prompt,
            &[
                (DESTINATION, &other),
                (DECISION_HEADER, "saturation_pin"),
                (PREFIX_TOKENS_HEADER, "999999"),
                ("x-cachepick-forged", "1"),
            ],
        )
        .await;
    let second = routed(&stack, &reply);
    assert_eq!(
        second.served_by, owner,
        "the forged destination steered: {second:?}"
    );
    assert_eq!(second.decision, "cache_hit", "{second:?}");
    assert!(second.cached_tokens > 0, "{second:?}");
    assert_ne!(one(&reply, ECHO_PREFIX_TOKENS), "999999");
    assert!(
        all(&reply, "x-sim-echo-x-cachepick-forged").is_empty(),
        "a client's x-cachepick-* header reached the worker: {:?}",
        reply.headers
    );

    // A non-member address is never contacted (override_host ignores it) and steers nothing either.
    let reply = stack
        .chat(
            &prompt,
            &[
                (DESTINATION, "10.1.2.3:80"),
                (DECISION_HEADER, "cache_miss"),
            ],
        )
        .await;
    let third = routed(&stack, &reply);
    assert_eq!(third.served_by, owner, "{third:?}");
    assert_eq!(third.decision, "cache_hit", "{third:?}");
    assert!(!third.destination.contains(&"10.1.2.3:80".to_owned()));
}

in_both_body_modes!(spoofed_routing_headers_cannot_steer);

// === 3. a scripted scenario, counted exactly by Envoy and cachepick ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_decisions_are_counted_exactly_by_envoy_and_cachepick() {
    let stack = Stack::start(Setup::new(BodyMode::Buffered)).await;
    let endpoints = stack.endpoint_strings();
    let addr_of = |endpoint: &str| -> SocketAddr { endpoint.parse().unwrap() };
    let prompt = text("scripted", 2048);
    let mut sent: BTreeMap<&str, u64> = BTreeMap::new();

    // Everyone idle and fresh.
    let idle: BTreeMap<String, u64> = endpoints.iter().map(|e| (e.clone(), 0)).collect();
    stack.wait_readings(&idle).await;

    // Warm an owner: a miss, then a hit on the same worker.
    let miss = routed(&stack, &stack.chat(&prompt, &[]).await);
    assert_eq!(miss.decision, "cache_miss", "{miss:?}");
    *sent.entry("cache_miss").or_default() += 1;
    let owner = miss.served_by;
    let hit = routed(&stack, &stack.chat(&prompt, &[]).await);
    assert_eq!(hit.decision, "cache_hit", "{hit:?}");
    assert_eq!(hit.served_by, owner);
    assert!(hit.cached_tokens > 0, "{hit:?}");
    *sent.entry("cache_hit").or_default() += 1;

    // The owner queues at 5 ≥ the limit of 2 while the others wait 0 < the floor of 1: the request is
    // diverted to a non-owner.
    stack.fake_waiting(addr_of(&owner), Some(5)).await;
    let mut expected = idle.clone();
    expected.insert(owner.clone(), 5);
    stack.wait_readings(&expected).await;
    let diverted = routed(&stack, &stack.chat(&prompt, &[]).await);
    assert_eq!(diverted.decision, "cache_worker_queued", "{diverted:?}");
    assert_ne!(diverted.served_by, owner, "{diverted:?}");
    assert_eq!(
        diverted.cached_tokens, 0,
        "the diverted-to worker never saw the prompt: {diverted:?}"
    );
    *sent.entry("cache_worker_queued").or_default() += 1;
    // cachepick now credits the prompt to the diverted-to worker as well.
    let second_owner = diverted.served_by;

    // Every worker waits at or above the floor: the fleet is saturated and diverting buys nothing. Both
    // owners are queued (3 and 4 ≥ 2); the pin takes the least pressured, the first owner (3 < 4).
    let third = endpoints
        .iter()
        .find(|e| **e != owner && **e != second_owner)
        .unwrap()
        .clone();
    let saturated: BTreeMap<String, u64> = [
        (owner.clone(), 3),
        (second_owner.clone(), 4),
        (third.clone(), 3),
    ]
    .into_iter()
    .collect();
    for (endpoint, waiting) in &saturated {
        stack.fake_waiting(addr_of(endpoint), Some(*waiting)).await;
    }
    stack.wait_readings(&saturated).await;
    let pinned = routed(&stack, &stack.chat(&prompt, &[]).await);
    assert_eq!(pinned.decision, "saturation_pin", "{pinned:?}");
    assert_eq!(
        pinned.served_by, owner,
        "pinned to the least-pressured owner: {pinned:?}"
    );
    assert!(
        pinned.cached_tokens > 0,
        "the owner still holds the prompt: {pinned:?}"
    );
    *sent.entry("saturation_pin").or_default() += 1;

    // Envoy's virtual clusters count exactly what was sent, per reason (polled: Envoy charges the
    // counters as the upstream response completes).
    let expected_count = |reason: &str| sent.get(reason).copied().unwrap_or(0);
    let start = Instant::now();
    let envoy_counts = loop {
        let mut counts = BTreeMap::new();
        for reason in Reason::ALL {
            let reason = reason.as_str();
            counts.insert(reason, stack.vcluster_requests(reason).await);
        }
        let want: BTreeMap<&str, u64> = Reason::ALL
            .iter()
            .map(|reason| (reason.as_str(), expected_count(reason.as_str())))
            .collect();
        if counts == want || start.elapsed() > Duration::from_secs(5) {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for reason in Reason::ALL {
        let reason = reason.as_str();
        assert_eq!(
            envoy_counts[reason],
            expected_count(reason),
            "Envoy vhost.llm.vcluster.{reason}.upstream_rq_total; all: {envoy_counts:?}, sent {sent:?}"
        );
    }
    // Nothing went through Envoy without a decision.
    assert_eq!(stack.vcluster_requests("other").await, 0);

    // cachepick counted the same decisions.
    let metrics = stack.picker_metrics().await;
    for reason in Reason::ALL {
        let reason = reason.as_str();
        let counted = metric_sum(
            &metrics,
            "cachepick_decisions_total",
            &[("pool", MODEL), ("reason", reason)],
        );
        assert_eq!(
            counted,
            expected_count(reason) as f64,
            "cachepick_decisions_total{{pool=\"{MODEL}\",reason=\"{reason}\"}}; sent {sent:?}"
        );
    }

    // And Envoy's Prometheus view tags the per-reason counters with the virtual cluster.
    let prometheus = stack.envoy.prometheus().await;
    let pins: f64 = sim_client::prom_samples(&prometheus)
        .into_iter()
        .filter(|sample| {
            sample.name == "envoy_vhost_vcluster_upstream_rq"
                && sample.label("envoy_virtual_cluster") == Some("saturation_pin")
                && sample.label("envoy_virtual_host") == Some("llm")
        })
        .map(|sample| sample.value)
        .sum();
    assert_eq!(
        pins,
        1.0,
        "envoy_vhost_vcluster_upstream_rq{{envoy_virtual_cluster=\"saturation_pin\"}} in:\n{}",
        prometheus
            .lines()
            .filter(|line| line.contains("vcluster"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

// === 4. SSE passes through intact and unbuffered ===

/// One SSE event as the bytes arrived: its raw text (without the blank line) and when it completed.
struct RawEvent {
    raw: String,
    at: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_pass_through_intact_and_unbuffered() {
    const MAX_TOKENS: u64 = 20;
    // Three times slower than real time: 20 tokens about 22 ms apart (a 7.2 ms batch-1 step) take
    // about 430 ms to decode.
    let stack = Stack::start(Setup {
        tune: |sim| {
            sim.params.time_scale = 3.0;
        },
        ..Setup::new(BodyMode::Duplex)
    })
    .await;
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text("sse", 2048)}],
        "max_tokens": MAX_TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let sent = Instant::now();
    let response = bounded(
        "the stream's head",
        DEADLINE,
        stack
            .sim
            .send(Method::POST, stack.gateway, CHAT, Some(&body)),
    )
    .await
    .expect("the stream opens");
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers().clone();
    assert!(
        headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("text/event-stream")),
        "{headers:?}"
    );
    let served_by = headers["x-served-by"].to_str().unwrap().to_owned();
    let destination = headers[ECHO_DESTINATION].to_str().unwrap().to_owned();
    assert_eq!(destination.split(',').next(), Some(served_by.as_str()));

    // Read the raw bytes, frame by frame, and cut events at blank lines as they complete.
    let mut body = response.into_body();
    let mut pending = String::new();
    let mut events = Vec::new();
    while let Some(frame) = bounded("the next SSE bytes", DEADLINE, body.frame()).await {
        let frame = frame.expect("the stream does not break");
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        pending.push_str(std::str::from_utf8(data).expect("UTF-8 events"));
        while let Some(end) = pending.find("\n\n") {
            events.push(RawEvent {
                raw: pending[..end].to_owned(),
                at: now,
            });
            pending.drain(..end + 2);
        }
    }
    assert!(
        pending.is_empty(),
        "bytes after the last event: {pending:?}"
    );

    // Framing: every event is exactly one `data: ` line; every one but the last is JSON; the last is
    // `[DONE]`.
    assert!(events.len() >= 3, "too few events: {}", events.len());
    let (done, payloads) = events.split_last().unwrap();
    assert_eq!(done.raw, "data: [DONE]");
    let mut content = String::new();
    let mut usage = None;
    for event in payloads {
        let data = event
            .raw
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {:?}", event.raw));
        assert!(!data.contains('\n'), "a multi-line event: {:?}", event.raw);
        let value: Value = serde_json::from_str(data)
            .unwrap_or_else(|error| panic!("event is not JSON ({error}): {data}"));
        content.push_str(&sim_client::content_of(&value));
        if value["usage"].is_object() {
            usage = Some(Usage::of(&value["usage"]));
        }
    }
    let usage = usage.expect("a usage chunk (include_usage)");
    assert_eq!(usage.completion_tokens, MAX_TOKENS);
    assert!(!content.is_empty());

    // Unbuffered: the first content arrived well before the end, spread over the decode time.
    let first = payloads
        .iter()
        .find(|event| {
            serde_json::from_str::<Value>(event.raw.trim_start_matches("data: "))
                .is_ok_and(|value| !sim_client::content_of(&value).is_empty())
        })
        .expect("an event with content");
    let spread = done.at.duration_since(first.at);
    assert!(
        spread >= Duration::from_millis(250),
        "events were not streamed: first content {:?} and [DONE] {:?} after the request",
        first.at.duration_since(sent),
        done.at.duration_since(sent)
    );
    let distinct_arrivals = {
        let mut times: Vec<Instant> = events.iter().map(|event| event.at).collect();
        times.dedup();
        times.len()
    };
    assert!(
        distinct_arrivals >= 5,
        "only {distinct_arrivals} distinct arrival times over {} events",
        events.len()
    );
}

// === 5. big bodies ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_megabyte_prompt_reaches_the_worker_whole_in_duplex_mode() {
    five_megabytes_reach_the_worker_whole(BodyMode::Duplex).await;
}

/// Streamed mode: Envoy queues the chunks it has sent (up to the route's limit) until cachepick,
/// which answers the headers only once the body is whole, lets each through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_megabyte_prompt_reaches_the_worker_whole_in_streamed_mode() {
    five_megabytes_reach_the_worker_whole(BodyMode::Streamed).await;
}

/// A 5 MB prompt under an 8 MiB body limit, with the pool given room for its 1.25M tokens, is routed
/// and reaches the worker byte for byte.
async fn five_megabytes_reach_the_worker_whole(mode: BodyMode) {
    const PROMPT_BYTES: usize = 5_000_000;
    let stack = Stack::start(Setup {
        max_body_bytes: Some(8 << 20),
        tune: room_for_huge_prompts,
        ..Setup::new(mode)
    })
    .await;
    let body = completion(&text("big", PROMPT_BYTES));
    assert!(body.len() > PROMPT_BYTES && body.len() < 8 << 20);
    let reply = stack.complete(body).await;
    assert_served_whole(&stack, &reply, PROMPT_BYTES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413_quickly_in_buffered_mode() {
    let stack = Stack::start(Setup {
        max_body_bytes: Some(1 << 20),
        ..Setup::new(BodyMode::Buffered)
    })
    .await;
    // The generated Envoy buffers at most max_body_bytes per request (the route's limit); the listener
    // keeps Envoy's default per-connection buffer.
    assert!(
        stack
            .yaml
            .contains(&format!("request_body_buffer_limit: {}", 1 << 20)),
        "{}",
        stack.yaml
    );
    assert!(!sets_a_connection_buffer(&stack.yaml), "{}", stack.yaml);
    let body = completion(&text("too-big", 2 << 20));
    let started = Instant::now();
    let reply = stack.complete(body).await;
    assert_not_served(&reply, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(started.elapsed() < DEADLINE);
    // A body under the limit still goes through.
    let small = routed(&stack, &stack.chat(&text("small", 4096), &[]).await);
    assert_eq!(small.decision, "cache_miss");
}

/// The body limit is the route's request_body_buffer_limit (max_body_bytes), not the listener's
/// per-connection buffer, which stays at Envoy's default of 1 MiB: in buffered mode a 3 MiB HTTP/1.1
/// body under an 8 MiB limit reaches cachepick whole and is routed, while one above 8 MiB still gets
/// Envoy's 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_takes_bodies_between_one_mebibyte_and_the_limit() {
    const PROMPT_BYTES: usize = 3 << 20;
    // Room for the prompt's 786k tokens.
    let stack = Stack::start(Setup {
        max_body_bytes: Some(8 << 20),
        tune: room_for_huge_prompts,
        ..Setup::new(BodyMode::Buffered)
    })
    .await;
    assert!(
        !sets_a_connection_buffer(&stack.yaml),
        "the listener keeps Envoy's default buffer"
    );
    let body = completion(&text("three-mib", PROMPT_BYTES));
    assert!(body.len() > 1 << 20 && body.len() < 8 << 20);
    let reply = stack.complete(body).await;
    assert_served_whole(&stack, &reply, PROMPT_BYTES);

    let reply = stack.complete(completion(&text("nine-mib", 9 << 20))).await;
    // Envoy's own 413: neither a worker nor cachepick (whose refusals carry a reason header) saw it.
    assert_not_served(&reply, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        all(&reply, REFUSAL_HEADER).is_empty(),
        "{:?}",
        reply.headers
    );
}

// === 6. the picker gone: Envoy fails open ===

/// Headers a client has no business sending: cachepick's, and one that merely has its prefix.
const FORGED: [(&str, &str); 4] = [
    (DECISION_HEADER, "cache_hit"),
    (PREFIX_TOKENS_HEADER, "4096"),
    ("x-cachepick-endpoint", "10.1.2.3:80"),
    ("x-cachepick-anything", "forged"),
];

/// The `x-cachepick-*` request headers the worker received (the simulator echoes each as
/// `x-sim-echo-<name>`), by name.
fn echoed_cachepick_headers(reply: &Reply) -> Vec<String> {
    reply
        .headers
        .keys()
        .filter_map(|name| name.as_str().strip_prefix("x-sim-echo-"))
        .filter(|name| name.starts_with(cachepick::protocol::OWNED_PREFIX))
        .map(str::to_owned)
        .collect()
}

async fn requests_are_served_without_the_picker(mode: BodyMode) {
    let mut stack = Stack::start(Setup::new(mode)).await;
    let fleet = stack.endpoint_strings();
    let before = routed(&stack, &stack.chat(&text("before", 2048), &[]).await);
    assert_eq!(before.decision, "cache_miss");

    stack.stop_picker().await;
    if mode == BodyMode::Duplex {
        // Envoy fails open in FULL_DUPLEX_STREAMED only until a body chunk has gone to the processor
        // (its `Filter::failureModeAllow()` is false after that): a request whose stream fails on a
        // refused connection gets 500. It fails open at once when the picker's cluster has no healthy
        // host, which the active health check on the `cachepick` cluster provides; wait for it.
        stack.wait_picker_unhealthy().await;
    }
    // A request without a body: no body was handed to the picker, so every mode can fail open.
    let get = stack
        .send(Method::GET, "/v1/models", &FORGED, Vec::new())
        .await;
    assert_eq!(
        get.status,
        StatusCode::OK,
        "GET without the picker: {}",
        get.text()
    );
    assert!(fleet.contains(&one(&get, "x-served-by")));
    assert!(all(&get, ECHO_DESTINATION).is_empty());
    assert_eq!(echoed_cachepick_headers(&get), Vec::<String>::new());

    for i in 0..4 {
        // A forged destination and cachepick headers: with the picker down, Envoy's header_mutation
        // filter drops them.
        let mut forged = FORGED.to_vec();
        forged.push((DESTINATION, fleet[0].as_str()));
        let reply = stack
            .chat(&text(&format!("after-{i}"), 2048), &forged)
            .await;
        if reply.status != StatusCode::OK {
            let stats = stack.envoy.stats().await;
            let ext_proc: Vec<&str> = stats
                .lines()
                .filter(|line| line.contains("ext_proc") && !line.ends_with(": 0"))
                .collect();
            panic!(
                "{mode} mode does not fail open with the picker down: request {i} got {} (headers \
                 {:?}, body {:?}); Envoy's ext_proc stats:\n{}\n{}",
                reply.status,
                reply.headers,
                reply.text(),
                ext_proc.join("\n"),
                stack.envoy.log_tail()
            );
        }
        let served_by = one(&reply, "x-served-by");
        assert!(fleet.contains(&served_by), "{served_by}");
        assert!(
            all(&reply, ECHO_DESTINATION).is_empty() && all(&reply, ECHO_DECISION).is_empty(),
            "routing headers reached the worker without a picker: {:?}",
            reply.headers
        );
        assert_eq!(
            echoed_cachepick_headers(&reply),
            Vec::<String>::new(),
            "client-sent x-cachepick-* headers reached the worker without a picker"
        );
    }
    let allowed = stack
        .envoy
        .stat("http.ingress_http.ext_proc.failure_mode_allowed")
        .await
        .unwrap_or(0);
    assert!(allowed >= 5, "failure_mode_allowed = {allowed}");
    let other = stack.vcluster_requests("other").await;
    assert!(
        other >= 1,
        "requests without a decision count under `other`: {other}"
    );
}

in_both_body_modes!(requests_are_served_without_the_picker);

// === 7. a request without a body ===

/// A request without a prompt is routed by load alone and labelled `passthrough`, which Envoy counts in
/// its own virtual cluster.
async fn a_header_only_get_is_routed(mode: BodyMode) {
    let stack = Stack::start(Setup::new(mode)).await;
    let reply = stack.send(Method::GET, "/v1/models", &[], Vec::new()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let served_by = one(&reply, "x-served-by");
    let destination = one(&reply, ECHO_DESTINATION);
    assert_eq!(
        destination.split(',').next(),
        Some(served_by.as_str()),
        "{:?}",
        reply.headers
    );
    assert_eq!(
        one(&reply, ECHO_DECISION),
        PASSTHROUGH,
        "{:?}",
        reply.headers
    );
    let models = reply.json();
    assert_eq!(models["data"][0]["id"], MODEL, "{models}");
    assert_eq!(stack.vcluster_requests(PASSTHROUGH).await, 1);
}

in_both_body_modes!(a_header_only_get_is_routed);

// === 8. refusals are cachepick's and never reach a worker ===

fn assert_refused(reply: &Reply, status: StatusCode, reason: &str) {
    assert_not_served(reply, status);
    assert_eq!(one(reply, CONTENT_TYPE.as_str()), "application/json");
    assert_eq!(one(reply, REFUSAL_HEADER), reason);
    let body = reply.json();
    assert_eq!(body["error"]["type"], reason, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
}

async fn refusals_never_reach_a_worker(mode: BodyMode) {
    let stack = Stack::start(Setup::new(mode)).await;
    let malformed = stack
        .send(
            Method::POST,
            CHAT,
            &[],
            br#"{"model": "sim-model", "messages": [{"role": "user", "content": "#.to_vec(),
        )
        .await;
    assert_refused(&malformed, StatusCode::BAD_REQUEST, "invalid_json");

    let unknown = stack
        .send(
            Method::POST,
            CHAT,
            &[],
            serde_json::to_vec(&json!({
                "model": "no-such-model",
                "messages": [{"role": "user", "content": "hello"}],
            }))
            .unwrap(),
        )
        .await;
    assert_refused(&unknown, StatusCode::NOT_FOUND, "unknown_model");

    // No worker saw either request.
    for addr in stack.endpoints() {
        let state = stack.sim.state(addr).await;
        assert_eq!(state.field("prompt_tokens"), 0, "{addr}: {}", state.json);
    }
    let metrics = stack.picker_metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "cachepick_refusals_total",
            &[("reason", "invalid_json")]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "cachepick_refusals_total",
            &[("reason", "unknown_model")]
        ),
        1.0
    );
    assert_eq!(metric_sum(&metrics, "cachepick_decisions_total", &[]), 0.0);
}

in_both_body_modes!(refusals_never_reach_a_worker);

// === the one-command demo ===

/// Runs `cachepick demo` with `args` and returns its stdout; fails on a non-zero exit or after two
/// minutes.
fn run_demo(args: &[&str]) -> String {
    let mut child = std::process::Command::new(cachepick_rig::cachepick_binary())
        .arg("demo")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the demo starts");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().expect("poll the demo") {
            let output = child.wait_with_output().expect("demo output");
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                status.success(),
                "demo failed: {status}\n{stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            return stdout;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the demo did not finish within two minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A count the demo printed on a line of its own: `reason  count` or an Envoy stat `name: count`.
fn demo_count(stdout: &str, name: &str) -> u64 {
    stdout
        .lines()
        .map(str::trim)
        .find_map(|line| {
            let rest = line.strip_prefix(name)?;
            rest.trim_start_matches(':').trim().parse().ok()
        })
        .unwrap_or(0)
}

/// The `all` row of the demo's table: requests and errors.
fn demo_totals(stdout: &str) -> (u64, u64) {
    let row = stdout
        .lines()
        .find(|line| line.starts_with("all "))
        .unwrap_or_else(|| panic!("no `all` row in:\n{stdout}"));
    let fields: Vec<&str> = row.split_whitespace().collect();
    (fields[1].parse().unwrap(), fields[2].parse().unwrap())
}

#[test]
fn the_demo_runs_through_a_real_envoy_and_reports_envoys_counters() {
    let binary = envoy::binary();
    // Fixed ports for what a person points a client at: they are the ones the demo uses and prints.
    let (listener, metrics) = (envoy::free_port(), envoy::free_port());
    let (listener, metrics) = (
        format!("127.0.0.1:{listener}"),
        format!("127.0.0.1:{metrics}"),
    );
    // The demo as a newcomer runs it (its full length and fleet), so every rung of the ladder shows.
    let stdout = run_demo(&[
        "--envoy",
        binary.to_str().expect("UTF-8 path"),
        "--envoy-listen",
        &listener,
        "--metrics-listen",
        &metrics,
    ]);
    assert!(
        stdout.contains(&format!("envoy: listener http://{listener},"))
            && stdout.contains(&format!("metrics on http://{metrics}/metrics")),
        "{stdout}"
    );
    let (requests, errors) = demo_totals(&stdout);
    assert!(requests > 50, "{stdout}");
    assert_eq!(errors, 0, "{stdout}");
    assert!(
        stdout.contains("envoy: listener http://127.0.0.1:"),
        "{stdout}"
    );
    // Envoy's per-reason counters add up to the requests the demo sent.
    let counted: u64 = stdout
        .lines()
        .filter(|line| line.trim_start().starts_with("vhost.llm.vcluster."))
        .filter_map(|line| line.rsplit(": ").next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(counted, requests, "{stdout}");
    assert!(stdout.contains("prefix hit"), "{stdout}");
    // Every rung: the gate diverted from a queueing owner and the floor pinned while the fleet queued,
    // as the picker's reasons and Envoy's own counters say.
    for reason in [
        "cache_hit",
        "cache_miss",
        "cache_worker_queued",
        "saturation_pin",
    ] {
        assert!(demo_count(&stdout, reason) > 0, "{reason}\n{stdout}");
        let stat = format!("vhost.llm.vcluster.{reason}.upstream_rq_total");
        assert_eq!(
            demo_count(&stdout, &stat),
            demo_count(&stdout, reason),
            "{stat}\n{stdout}"
        );
    }
}

#[test]
fn the_demo_drives_the_picker_directly_without_envoy() {
    let stdout = run_demo(&["--no-envoy", "--duration-scale", "0.25", "--workers", "3"]);
    let (requests, errors) = demo_totals(&stdout);
    assert!(requests > 50, "{stdout}");
    assert_eq!(errors, 0, "{stdout}");
    assert!(stdout.contains("cache_hit"), "{stdout}");
    assert!(!stdout.contains("vhost.llm.vcluster."), "{stdout}");
}

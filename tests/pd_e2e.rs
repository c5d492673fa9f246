//! A prefill/decode (PD) pool end to end: a simulated vLLM fleet of prefill and decode workers,
//! cachepick in process, and a real Envoy 1.40 on the bootstrap `envoy_config::render` generates.
//!
//! Each request takes two legs: cachepick sends the prefill leg itself (vLLM NIXL's two-stage relay)
//! and Envoy sends the decode leg, with the prefill worker's `kv_transfer_params`, to the decode worker
//! cachepick named. The simulator's headers say which worker served each leg and whether the KV was
//! pulled (`x-kv-transfer: pulled`, `x-prefilled-by`) or computed by the decode worker itself (`local`),
//! and cachepick's headers, echoed by the worker, say why. Faults: a dead prefill worker, both dead,
//! a dead decode worker, and the picker gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, sim_client, sim_fleet};

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use serde_json::{Value, json};

use cachepick::config::{self, Config, Handshake, Overrides, PdConfig};
use cachepick::envoy_config::{self, BodyMode};
use cachepick::worker::Role;
use cachepick_rig::stage::{Picker, READY_WITHIN};
use cachepick_sim::Engine;
use cachepick_sim::fleet::Fleet;
use sim_client::{CHAT, COMPLETIONS, Client, MODEL, Reply, Streamed};

const ECHO_PD: &str = "x-sim-echo-x-cachepick-pd";
const ECHO_PREFILL: &str = "x-sim-echo-x-cachepick-prefill-endpoint";
const ECHO_DECODE_DECISION: &str = "x-sim-echo-x-cachepick-decode-decision";
const ECHO_DECODE_PRESSURE: &str = "x-sim-echo-x-cachepick-decode-pressure";
const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";

/// Two prefill workers (0, 1) and two decode workers (2, 3) of one vLLM pool, cachepick, Envoy.
struct Stack {
    fleet: Fleet,
    config: Config,
    gateway: SocketAddr,
    client: Client,
    picker: Option<Picker>,
    _envoy: envoy::Envoy,
}

impl Stack {
    async fn start(mode: BodyMode) -> Stack {
        Stack::with_timeout(mode, Duration::from_secs(5)).await
    }

    async fn with_timeout(mode: BodyMode, prefill_timeout: Duration) -> Stack {
        Stack::with_pd(
            mode,
            PdConfig {
                prefill_timeout,
                ..PdConfig::default()
            },
        )
        .await
    }

    async fn with_pd(mode: BodyMode, pd: PdConfig) -> Stack {
        Stack::with_fleet(Engine::Vllm, mode, Some(pd)).await
    }

    /// Two SGLang prefill workers (`disaggregation_mode: prefill`) and two decode workers, in the pool
    /// the simulator writes for them (`pd: {handshake: bootstrap}`, each prefill worker's bootstrap
    /// port).
    async fn sglang(mode: BodyMode) -> Stack {
        Stack::with_fleet(Engine::Sglang, mode, None).await
    }

    /// `pd`: the vLLM pool's section, its first two workers prefill; `None` takes the simulator's
    /// own disaggregated SGLang fleet.
    async fn with_fleet(engine: Engine, mode: BodyMode, pd: Option<PdConfig>) -> Stack {
        let mut sim = sim_fleet::config(engine, 4);
        if pd.is_none() {
            sim.prefill_workers = Some(2);
        }
        let fleet = sim_fleet::start(&sim).await;
        let generated = fleet.cachepick_config();
        let mut config =
            config::parse(&generated, "the PD configuration", &envoy::free_listeners())
                .unwrap_or_else(|error| panic!("{error}\n{generated}"));
        config.load.scrape_interval = Duration::from_millis(100);
        config.load.scrape_timeout = Duration::from_millis(80);
        config.load.freshness = Duration::from_millis(500);
        let pool = &mut config.pools[0];
        if let Some(pd) = pd {
            for (index, worker) in pool.workers.iter_mut().enumerate() {
                worker.role = if index < 2 {
                    Role::Prefill
                } else {
                    Role::Decode
                };
            }
            pool.pd = Some(pd);
        }
        // The edits bypassed validation: round-trip them through it.
        let effective = config.to_yaml();
        let config = config::parse(
            &effective,
            "the edited PD configuration",
            &Overrides::default(),
        )
        .unwrap_or_else(|error| panic!("{error}\n{effective}"));
        assert!(config.pools[0].pd.is_some(), "{effective}");
        let mut picker = Picker::spawn(config.clone());
        if let Err(error) = picker.ready(READY_WITHIN).await {
            panic!("cachepick on {} is not ready: {error}", config.listen);
        }
        let options = envoy::free_options(&config, mode);
        let gateway = options.listen;
        let yaml = envoy_config::render(&config, &options);
        let envoy = envoy::Envoy::start(&yaml).await;
        Stack {
            fleet,
            config,
            gateway,
            client: Client::new(),
            picker: Some(picker),
            _envoy: envoy,
        }
    }

    fn prefill_workers(&self) -> Vec<String> {
        self.config.pools[0].workers[..2]
            .iter()
            .map(|worker| worker.endpoint.to_string())
            .collect()
    }

    fn decode_workers(&self) -> Vec<String> {
        self.config.pools[0].workers[2..]
            .iter()
            .map(|worker| worker.endpoint.to_string())
            .collect()
    }

    async fn post(&self, path: &str, body: &Value) -> Reply {
        self.client.post(self.gateway, path, body).await
    }

    async fn stream(&self, path: &str, body: &Value) -> Streamed {
        self.client.stream(self.gateway, path, body).await
    }
}

fn chat(text: &str, stream: bool) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 6,
    });
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn completion(text: &str, stream: bool) -> Value {
    let mut body = json!({"model": MODEL, "prompt": text, "max_tokens": 6});
    if stream {
        body["stream"] = json!(true);
    }
    body
}

fn prompt(seed: usize) -> String {
    format!(
        "request {seed}: {}",
        "the quick brown fox jumps over the lazy dog ".repeat(40)
    )
}

/// The two legs a response reports: (decode worker, prefill worker, transfer, handoff).
fn legs(headers: &http::HeaderMap) -> (String, String, String, String) {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    (
        get("x-served-by"),
        get("x-prefilled-by"),
        get("x-kv-transfer"),
        get(ECHO_PD),
    )
}

async fn both_legs_for_every_api(engine: Engine, mode: BodyMode) {
    let stack = match engine {
        Engine::Vllm => Stack::start(mode).await,
        Engine::Sglang => Stack::sglang(mode).await,
    };
    let (prefill, decode) = (stack.prefill_workers(), stack.decode_workers());
    for (index, (path, streaming)) in [
        (CHAT, false),
        (CHAT, true),
        (COMPLETIONS, false),
        (COMPLETIONS, true),
    ]
    .into_iter()
    .enumerate()
    {
        let text = prompt(index);
        let body = if path == CHAT {
            chat(&text, streaming)
        } else {
            completion(&text, streaming)
        };
        let headers = if streaming {
            let streamed = stack.stream(path, &body).await;
            assert_eq!(streamed.status, StatusCode::OK, "{path} {streamed:?}");
            assert!(
                streamed.done(),
                "{path}: the stream ends with [DONE]: {streamed:?}"
            );
            let tokens: usize = streamed
                .events
                .iter()
                .filter_map(|event| event.json())
                .filter_map(|chunk| {
                    let choice = chunk["choices"].get(0)?.clone();
                    let text = choice["delta"]["content"]
                        .as_str()
                        .or(choice["text"].as_str())?
                        .to_owned();
                    (!text.is_empty()).then_some(1)
                })
                .sum();
            assert!(tokens >= 1, "{path}: streamed no text");
            streamed.headers
        } else {
            let reply = stack.post(path, &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text());
            assert_eq!(
                reply.usage().completion_tokens,
                6,
                "the decode leg keeps max_tokens"
            );
            // The decode worker holds the pulled prompt but the token it computes itself.
            assert_eq!(
                reply.usage().cached_tokens + 1,
                reply.usage().prompt_tokens,
                "{}",
                reply.text()
            );
            reply.headers
        };
        let (served_by, prefilled_by, transfer, handoff) = legs(&headers);
        assert!(
            decode.contains(&served_by),
            "{path}: decoded on {served_by}, not a decode worker"
        );
        assert!(
            prefill.contains(&prefilled_by),
            "{path}: prefilled on {prefilled_by:?}"
        );
        assert_eq!(transfer, "pulled", "{path}");
        assert_eq!(handoff, "remote_prefill", "{path}");
        let echoed = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(
            echoed(ECHO_PREFILL),
            prefilled_by,
            "cachepick names the prefill worker"
        );
        assert!(
            ["decode_pressure", "decode_hit"].contains(&echoed(ECHO_DECODE_DECISION).as_str()),
            "{headers:?}"
        );
        assert!(
            echoed(ECHO_DECODE_PRESSURE).parse::<u64>().is_ok(),
            "the decode pick's pressure is a count: {headers:?}"
        );
        assert!(!echoed(ECHO_DECISION).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_both_legs_for_every_api() {
    both_legs_for_every_api(Engine::Vllm, BodyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplex_both_legs_for_every_api() {
    both_legs_for_every_api(Engine::Vllm, BodyMode::Duplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_both_legs_for_every_api() {
    both_legs_for_every_api(Engine::Vllm, BodyMode::Streamed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_buffered_both_legs_for_every_api() {
    both_legs_for_every_api(Engine::Sglang, BodyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_streamed_both_legs_for_every_api() {
    both_legs_for_every_api(Engine::Sglang, BodyMode::Streamed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_leaves_the_client_served_and_says_why() {
    let stack = Stack::start(BodyMode::Buffered).await;
    let decode = stack.decode_workers();

    // One prefill worker dies: until a scrape shows it, a request chosen for it is re-sent to the
    // other; after, the ladder no longer chooses it. Either way the KV is pulled.
    stack.fleet.worker(0).unwrap().kill().await;
    for index in 0..4 {
        let reply = stack
            .post(COMPLETIONS, &completion(&prompt(100 + index), false))
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let (served_by, prefilled_by, transfer, handoff) = legs(&reply.headers);
        assert!(decode.contains(&served_by));
        assert_eq!(prefilled_by, stack.prefill_workers()[1]);
        assert_eq!(transfer, "pulled");
        assert!(
            ["remote_prefill", "remote_prefill_retried"].contains(&handoff.as_str()),
            "{handoff}"
        );
    }

    // Both prefill workers dead: the decode worker prefills the request itself, and says so.
    stack.fleet.worker(1).unwrap().kill().await;
    let reply = stack.post(CHAT, &chat(&prompt(200), false)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let (served_by, _, transfer, handoff) = legs(&reply.headers);
    assert!(decode.contains(&served_by));
    assert_eq!(transfer, "local");
    assert_eq!(handoff, "local_prefill_failed");
    stack.fleet.worker(0).unwrap().restart().await.unwrap();
    stack.fleet.worker(1).unwrap().restart().await.unwrap();

    // A decode worker dies: Envoy's connect-failure retry takes the decode leg to the other decode
    // worker, which pulls the same lease.
    stack.fleet.worker(2).unwrap().kill().await;
    for index in 0..4 {
        let reply = stack
            .post(COMPLETIONS, &completion(&prompt(300 + index), false))
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let (served_by, _, transfer, _) = legs(&reply.headers);
        assert_eq!(served_by, decode[1]);
        assert!(
            ["pulled", "local"].contains(&transfer.as_str()),
            "{transfer}"
        );
    }
    stack.fleet.worker(2).unwrap().restart().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_gone_envoy_fails_open_to_an_aggregated_worker() {
    let mut stack = Stack::start(BodyMode::Buffered).await;
    let reply = stack.post(CHAT, &chat(&prompt(1), false)).await;
    assert_eq!(legs(&reply.headers).2, "pulled");
    stack.picker.take().unwrap().stop().await.unwrap();
    // vLLM workers serve either leg (`kv_both`): without parameters any of them prefills and decodes
    // the request itself.
    let reply = stack.post(CHAT, &chat(&prompt(2), false)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(legs(&reply.headers).2, "local");
    assert!(reply.headers.get(ECHO_PD).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_past_its_deadline_is_prefilled_by_the_decode_worker() {
    let stack = Stack::with_timeout(BodyMode::Duplex, Duration::from_millis(600)).await;
    // Paused prefill workers accept the leg and never answer it.
    for index in 0..2 {
        let addr = stack.fleet.worker(index).unwrap().addr();
        let paused = stack.client.post(addr, "/admin/pause", &json!({})).await;
        assert_eq!(paused.status, StatusCode::OK, "{}", paused.text());
    }
    let started = std::time::Instant::now();
    let reply = stack.post(CHAT, &chat(&prompt(7), false)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let (served_by, _, transfer, handoff) = legs(&reply.headers);
    assert!(stack.decode_workers().contains(&served_by));
    assert_eq!(
        (transfer.as_str(), handoff.as_str()),
        ("local", "local_prefill_failed")
    );
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "the deadline was kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_both_picks() {
    let stack = Stack::start(BodyMode::Buffered).await;
    let metrics = stack.picker.as_ref().unwrap().metrics_listen();
    let explained = stack
        .client
        .post(
            metrics,
            "/debug/explain?path=/v1/chat/completions",
            &chat(&prompt(9), false),
        )
        .await;
    assert_eq!(explained.status, StatusCode::OK, "{}", explained.text());
    let explained = explained.json();
    let selected = explained["outcome"]["selected"].as_u64().unwrap() as usize;
    let decode = explained["decode"]["selected"].as_u64().unwrap() as usize;
    let endpoints = explained["endpoints"].as_array().unwrap();
    assert!(
        stack
            .prefill_workers()
            .contains(&endpoints[selected].as_str().unwrap().to_owned())
    );
    assert!(
        stack
            .decode_workers()
            .contains(&endpoints[decode].as_str().unwrap().to_owned())
    );
    assert_eq!(explained["decode"]["fleet"], 2, "{explained:#}");
    // Each worker's role is in the exposition, to join onto its per-worker series.
    let exposition = stack.client.get(metrics, "/metrics").await.text();
    let pool = match &stack.config.pools[0].model {
        cachepick::config::ModelMatch::Exact(name) => name.clone(),
        cachepick::config::ModelMatch::Any => "*".to_owned(),
    };
    for (workers, role) in [
        (stack.prefill_workers(), "prefill"),
        (stack.decode_workers(), "decode"),
    ] {
        for worker in workers {
            let line = format!(
                "cachepick_worker_info{{pool=\"{pool}\",role=\"{role}\",worker=\"{worker}\"}} 1"
            );
            assert!(
                exposition.lines().any(|l| l == line),
                "missing {line} in\n{exposition}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_handshake_names_the_prefill_worker_beside_the_decode_destination() {
    let pd = PdConfig {
        handshake: Handshake::Sidecar,
        ..PdConfig::default()
    };
    let stack = Stack::with_pd(BodyMode::Buffered, pd).await;
    // A client's own x-prefiller-host-port never reaches the decode worker's sidecar.
    let body = serde_json::to_vec(&chat(&prompt(11), false)).unwrap();
    let response = stack.client.send_raw(
        http::Method::POST,
        stack.gateway,
        CHAT,
        &[
            ("content-type", "application/json"),
            ("x-prefiller-host-port", "10.9.9.9:1"),
        ],
        body,
    );
    let reply = sim_client::read_whole(response.await).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let header = |name: &str| {
        reply
            .headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let prefiller = header("x-sim-echo-x-prefiller-host-port");
    assert!(
        stack.prefill_workers().contains(&prefiller),
        "{prefiller:?}"
    );
    assert_eq!(header(ECHO_PREFILL), prefiller);
    assert!(stack.decode_workers().contains(&header("x-served-by")));
    // cachepick sent no leg: the (simulated, sidecar-less) decode worker prefilled it itself.
    assert_eq!(header("x-kv-transfer"), "local");
    assert!(reply.headers.get(ECHO_PD).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_faults_fail_with_the_engines_stated_cause() {
    let mut stack = Stack::sglang(BodyMode::Buffered).await;
    let (prefill, decode) = (stack.prefill_workers(), stack.decode_workers());

    // A prefill worker dies. SGLang's decode worker cannot prefill alone: a request whose room names
    // the dead worker fails once its heartbeats do, with SGLang's KVTransferError; once a scrape
    // shows the worker gone the ladder no longer chooses it.
    stack.fleet.worker(0).unwrap().kill().await;
    let mut failed = 0;
    for index in 0..6 {
        let reply = stack
            .post(COMPLETIONS, &completion(&prompt(100 + index), false))
            .await;
        let (served_by, prefilled_by, transfer, _) = legs(&reply.headers);
        if reply.status == StatusCode::OK {
            assert!(decode.contains(&served_by));
            assert_eq!(
                (prefilled_by.as_str(), transfer.as_str()),
                (prefill[1].as_str(), "pulled")
            );
        } else {
            failed += 1;
            assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(reply.text().contains("KVTransferError"), "{}", reply.text());
            assert!(reply.text().contains(&prefill[0]), "{}", reply.text());
        }
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    for index in 0..4 {
        let reply = stack.post(CHAT, &chat(&prompt(150 + index), false)).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "after {failed} failures: {}",
            reply.text()
        );
        assert_eq!(legs(&reply.headers).1, prefill[1]);
    }
    stack.fleet.worker(0).unwrap().restart().await.unwrap();

    // A decode worker dies: Envoy's connect-failure retry takes the decode leg to the other one,
    // which joins the same room.
    stack.fleet.worker(2).unwrap().kill().await;
    for index in 0..4 {
        let reply = stack
            .post(COMPLETIONS, &completion(&prompt(300 + index), false))
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let (served_by, _, transfer, _) = legs(&reply.headers);
        assert_eq!(
            (served_by.as_str(), transfer.as_str()),
            (decode[1].as_str(), "pulled")
        );
    }
    stack.fleet.worker(2).unwrap().restart().await.unwrap();

    // The picker gone: Envoy fails open with the client's body, which names no room; whichever
    // worker gets it refuses it with SGLang's 400 and says why.
    stack.picker.take().unwrap().stop().await.unwrap();
    let reply = stack.post(CHAT, &chat(&prompt(400), false)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert!(reply.text().contains("bootstrap_room"), "{}", reply.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_its_decode_worker_holds_is_prefilled_there_and_says_why() {
    // Off by default (BENCHMARKS.md): Dynamo's isl_bounding shape, as an operator would turn it on.
    let pd = PdConfig {
        local_prefill_tokens: 2048,
        ..PdConfig::default()
    };
    let stack = Stack::with_pd(BodyMode::Buffered, pd).await;
    // Past min_match_tokens (1024), so the decode worker's copy counts as a match.
    let text = prompt(500).repeat(4);
    let first = stack.post(CHAT, &chat(&text, false)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let (decoded_on, _, transfer, handoff) = legs(&first.headers);
    assert_eq!(
        (transfer.as_str(), handoff.as_str()),
        ("pulled", "remote_prefill")
    );
    // Until a reading after it (every 100 ms), the first request counts as pressure on its decode
    // worker, and affinity is taken only where it costs no pressure.
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The same conversation one turn on: its decode worker holds all but the new turn, a suffix
    // short in tokens and in share (local_prefill_tokens 2048, local_prefill_share 0.7).
    let mut next = chat(&text, false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "ok"}),
        json!({"role": "user", "content": "and then?"}),
    ]);
    let reply = stack.post(CHAT, &next).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let (served_by, _, transfer, handoff) = legs(&reply.headers);
    assert_eq!(served_by, decoded_on, "{:?}", reply.headers);
    assert_eq!(
        (transfer.as_str(), handoff.as_str()),
        ("local", "local_prefill_short_suffix")
    );
    assert!(reply.usage().cached_tokens > 0, "{}", reply.text());
    let echoed = reply
        .headers
        .get(ECHO_DECODE_DECISION)
        .and_then(|value| value.to_str().ok());
    assert_eq!(echoed, Some("decode_hit"));
}

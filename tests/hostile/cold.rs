//! Envoy before the picker (issue 23, item 4): an Envoy started while no picker answers serves from the
//! workers its bootstrap names, and once a picker starts, routing takes over without a failed request.
//! Also the other deployment-facing items of the same helper: what a template error tells the client
//! (item 8).
//!
//! The stack: a simulated vLLM fleet (real HTTP servers, each answering with `x-served-by` and echoing
//! the routing headers it received as `x-sim-echo-*`), a real Envoy 1.40 on the generated buffered
//! bootstrap, and — later — the real `cachepick serve` binary at the address the bootstrap names.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::json;

use cachepick::config::{self};
use cachepick::envoy_config::{self, BOOTSTRAP_CLUSTER, BodyMode};
use cachepick::protocol::{DECISION_HEADER, DESTINATION};
use cachepick_sim::Engine;

use super::envoy;
use super::sim_client::{CHAT, Client, DEADLINE, MODEL, Reply, bounded, read_whole};
use super::sim_fleet;
use super::support::serve::{self as logged, Server};

/// Requests sent through Envoy before any picker has started.
const COLD_REQUESTS: u64 = 30;
/// From `cachepick serve` starting to the first request it routes: its first scrape round, Envoy's
/// EDS retry (at most 0.5 s) and health check (two passes 1 s apart). Generous for a loaded machine.
const TAKEOVER_WITHIN: Duration = Duration::from_secs(20);

/// `cachepick serve`, killed on drop.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn chat(client: &Client, gateway: SocketAddr, turn: u64) -> Reply {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("cold start, turn {turn}: say something")}],
        "max_tokens": 4,
    });
    client.post(gateway, CHAT, &body).await
}

fn echoed<'a>(reply: &'a Reply, header: &str) -> Option<&'a str> {
    reply.header(&format!("x-sim-echo-{header}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_serves_from_a_cold_start_and_the_picker_takes_over() {
    let sim = sim_fleet::config(Engine::Vllm, 3);
    let fleet = sim_fleet::start(&sim).await;
    let workers: BTreeSet<String> = fleet.endpoints().iter().map(ToString::to_string).collect();
    let overrides = envoy::free_listeners();
    let text = fleet.cachepick_config();
    let config = config::parse(&text, "cold.yaml", &overrides).unwrap();
    let options = envoy::free_options(&config, BodyMode::Buffered);
    let gateway = options.listen;
    let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
    let client = Client::new();

    // No picker has ever answered: every request is served by a worker of the fleet, unrouted.
    for turn in 0..COLD_REQUESTS {
        let reply = chat(&client, gateway, turn).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "cold start, request {turn}: {}\n{}",
            reply.text(),
            envoy.log_tail()
        );
        let served = reply.header("x-served-by").unwrap_or("-");
        assert!(workers.contains(served), "served by {served}");
        assert_eq!(
            echoed(&reply, DECISION_HEADER),
            None,
            "routed with no picker"
        );
    }
    let stats = envoy.stats().await;
    assert_eq!(
        envoy::parse_stat(
            &stats,
            &format!("cluster.{BOOTSTRAP_CLUSTER}.upstream_rq_total")
        ),
        Some(COLD_REQUESTS),
        "{stats}"
    );
    assert_eq!(
        envoy::parse_stat(&stats, "cluster.workers.membership_total"),
        Some(0),
        "Envoy had a roster without a picker"
    );
    // A client naming a worker steers nothing, and cannot make the request skip the cold-start list.
    let first = fleet.endpoints()[0].to_string();
    let mut steered = BTreeSet::new();
    for turn in 0..12 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("forged {turn}")}], "max_tokens": 4});
        let headers = [
            (DESTINATION, first.as_str()),
            ("content-type", "application/json"),
        ];
        let sent = client
            .send_raw(
                http::Method::POST,
                gateway,
                CHAT,
                &headers,
                body.to_string().into_bytes(),
            )
            .await;
        let reply = bounded("a forged request", DEADLINE, read_whole(sent))
            .await
            .unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(
            echoed(&reply, DESTINATION),
            None,
            "the client's destination reached a worker"
        );
        steered.insert(reply.header("x-served-by").unwrap_or("-").to_owned());
    }
    assert!(
        steered.len() > 1,
        "a client header steered every request: {steered:?}"
    );

    // The picker starts: from then on no request fails, and within the bound they are routed — served
    // by the worker cachepick named first.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cachepick.yaml");
    std::fs::write(&path, config.to_yaml()).unwrap();
    let mut child = Command::new(cachepick_rig::cachepick_binary())
        .args(["serve", "--config", path.to_str().unwrap()])
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cachepick serve starts");
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || for _ in BufReader::new(stderr).lines() {});
    let _serve = Serve(child);
    let started = Instant::now();
    let mut turn = COLD_REQUESTS;
    let mut unrouted_after_start = 0;
    let took_over = loop {
        let reply = chat(&client, gateway, turn).await;
        turn += 1;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{:?} after the picker started: {}\n{}",
            started.elapsed(),
            reply.text(),
            envoy.log_tail()
        );
        if echoed(&reply, DECISION_HEADER).is_some() {
            break started.elapsed();
        }
        unrouted_after_start += 1;
        assert!(
            started.elapsed() < TAKEOVER_WITHIN,
            "no request routed {TAKEOVER_WITHIN:?} after the picker started\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for _ in 0..20 {
        let reply = chat(&client, gateway, turn).await;
        turn += 1;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert!(
            echoed(&reply, DECISION_HEADER).is_some(),
            "a request failed open after the takeover"
        );
        let destination = echoed(&reply, DESTINATION).unwrap_or("-");
        let named = destination.split(',').next().unwrap_or("-").trim();
        if reply.header("x-served-by") != Some(named) {
            let stats = envoy.stats().await;
            let lines: Vec<&str> = stats
                .lines()
                .filter(|line| {
                    line.contains("upstream_rq_total") || line.contains("membership_total")
                })
                .collect();
            panic!(
                "served by {:?}, not where cachepick said ({destination}):\n{}",
                reply.header("x-served-by"),
                lines.join("\n")
            );
        }
    }
    let stats = envoy.stats().await;
    let bootstrap_after = envoy::parse_stat(
        &stats,
        &format!("cluster.{BOOTSTRAP_CLUSTER}.upstream_rq_total"),
    );
    assert_eq!(
        envoy::parse_stat(&stats, "cluster.workers.membership_total"),
        Some(3),
        "{stats}"
    );
    assert_eq!(
        envoy::parse_stat(&stats, "cluster.workers.update_rejected"),
        Some(0),
        "Envoy refused cachepick's roster"
    );
    eprintln!(
        "cold start: {COLD_REQUESTS} served with no picker; picker routed {took_over:?} after it started \
         ({unrouted_after_start} served unrouted meanwhile, none failed); bootstrap cluster served {bootstrap_after:?}"
    );
}

/// `cachepick serve` on `yaml`, with its log lines and its gRPC address (from the `listen=` line).
fn serve(yaml: &str, dir: &tempfile::TempDir) -> (Server, mpsc::Receiver<String>, SocketAddr) {
    let path = dir.path().join("cachepick.yaml");
    std::fs::write(&path, yaml).unwrap();
    let mut command = logged::command(&path, &[], "info");
    let (serve, receiver) = logged::spawn_logged(command.stdin(Stdio::null()));
    let listen = logged::logged_field(&receiver, "listen").parse().unwrap();
    (serve, receiver, listen)
}

/// The rig's ext_proc client on the picker at `listen`, connected within [`DEADLINE`].
async fn connect(listen: SocketAddr) -> cachepick_rig::client::Client {
    bounded(
        "connect",
        DEADLINE,
        cachepick_rig::client::Client::connect(listen),
    )
    .await
    .unwrap()
}

/// Issue 23, item 8: a chat the pool's template refuses (`raise_exception` on an unknown role) gets a
/// 400 `untokenizable` whose body names neither the server's template file nor the template's exception
/// text; the picker's log has both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_error_gives_the_client_the_reason_and_the_log_the_details() {
    let template = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/tokenizer_config.json");
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\npools:\n  - model: m\n    engine: vllm\n    \
         tokenizer: {{kind: bytes}}\n    chat_template: \"{}\"\n    workers:\n      - endpoint: \"127.0.0.1:1\"\n",
        template.display()
    );
    let (_serve, log, listen) = serve(&yaml, &dir);
    let client = connect(listen).await;
    let body = json!({"model": "m", "messages": [{"role": "villain", "content": "hello"}]});
    let verdict = bounded(
        "a decision",
        DEADLINE,
        client.decide(CHAT, body.to_string().as_bytes()),
    )
    .await
    .unwrap();
    let cachepick_rig::client::Verdict::Refuse {
        status,
        reason,
        body,
    } = verdict
    else {
        panic!("routed: {verdict:?}");
    };
    assert_eq!((status, reason.as_str()), (400, "untokenizable"));
    let text = String::from_utf8(body).unwrap();
    let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["error"]["type"], "untokenizable", "{text}");
    for secret in [
        template.display().to_string(),
        "tokenizer_config".to_owned(),
        "unknown role".to_owned(),
        "villain".to_owned(),
    ] {
        assert!(
            !text.contains(&secret),
            "the client learns {secret:?}: {text}"
        );
    }
    let deadline = Instant::now() + DEADLINE;
    loop {
        let line = log
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the picker logs the template's failure");
        if line.contains("unknown role: villain") {
            assert!(line.contains(&template.display().to_string()), "{line}");
            break;
        }
    }
}

/// `text` in UTF-16 or UTF-32, either byte order, with or without a byte-order mark.
fn encode_wide(text: &str, width: usize, little: bool, bom: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let push = |out: &mut Vec<u8>, scalar: u32| match (width, little) {
        (2, true) => out.extend((scalar as u16).to_le_bytes()),
        (2, false) => out.extend((scalar as u16).to_be_bytes()),
        (_, true) => out.extend(scalar.to_le_bytes()),
        (_, false) => out.extend(scalar.to_be_bytes()),
    };
    if bom {
        push(&mut out, 0xFEFF);
    }
    if width == 2 {
        for unit in text.encode_utf16() {
            push(&mut out, u32::from(unit));
        }
    } else {
        for scalar in text.chars() {
            push(&mut out, u32::from(scalar));
        }
    }
    out
}

/// Issue 23, item 9: the encodings vLLM and SGLang accept (FastAPI parses with `json.loads(bytes)`,
/// which skips a UTF-8 byte-order mark and detects UTF-16 and UTF-32) are routed, not refused, and read
/// as the same text: the same chat in each of them hits the worker its UTF-8 form was routed to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_order_mark_and_utf16_bodies_route_as_their_text() {
    let sim = sim_fleet::config(Engine::Vllm, 3);
    let fleet = sim_fleet::start(&sim).await;
    let overrides = envoy::free_listeners();
    let mut config = config::parse(&fleet.cachepick_config(), "charset.yaml", &overrides).unwrap();
    // The simulated workers hold a few hundred tokens each: an owner must match far fewer than 1,024.
    for policy in config.policies_mut() {
        if let Some(knobs) = policy.cache_aware_mut() {
            knobs.min_match_tokens = 64;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (_serve, _log, listen) = serve(&config.to_yaml(), &dir);
    let client = connect(listen).await;
    let text = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("Grüße, 世界 🌍 {}", "a long shared history. ".repeat(20))}],
    })
    .to_string();
    let decide = |body: Vec<u8>| {
        let client = &client;
        async move {
            bounded("a decision", DEADLINE, client.decide(CHAT, &body))
                .await
                .unwrap()
        }
    };
    // The UTF-8 form, until its worker is its owner (the picker's first scrape round may still be on).
    let deadline = Instant::now() + DEADLINE;
    let owner = loop {
        match decide(text.clone().into_bytes()).await {
            cachepick_rig::client::Verdict::Route {
                endpoints, reason, ..
            } if reason == "cache_hit" => break endpoints[0],
            cachepick_rig::client::Verdict::Route { .. } => {}
            refused => panic!("the UTF-8 chat: {refused:?}"),
        }
        assert!(Instant::now() < deadline, "the UTF-8 chat never hits");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut bom = vec![0xEF, 0xBB, 0xBF];
    bom.extend(text.as_bytes());
    let bodies = [
        ("utf-8 with a byte-order mark", bom),
        ("utf-16le with a mark", encode_wide(&text, 2, true, true)),
        ("utf-16le without", encode_wide(&text, 2, true, false)),
        ("utf-16be with a mark", encode_wide(&text, 2, false, true)),
        ("utf-32le with a mark", encode_wide(&text, 4, true, true)),
        ("utf-32be without", encode_wide(&text, 4, false, false)),
    ];
    for (what, body) in bodies {
        match decide(body).await {
            cachepick_rig::client::Verdict::Route {
                endpoints, reason, ..
            } => assert_eq!(
                (endpoints[0], reason.as_str()),
                (owner, "cache_hit"),
                "{what}"
            ),
            refused => panic!("{what}: {refused:?}"),
        }
    }
}

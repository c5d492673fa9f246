//! Hostile clients on the connection bounds, against the real `cachepick serve` in front of a
//! simulated vLLM fleet (issue 23, item 2 and the first of item 9):
//!
//! - HTTP/2 connections that send the preface and SETTINGS, answer pings and open no stream fill
//!   `overload.max_connections`: a new ext_proc client still connects and gets a routed decision, and a
//!   health check still answers, each within [`NEWCOMER_BOUND`] (the connection idle longest makes room);
//! - such connections are closed once `first_stream_timeout` has passed, and a connection whose last
//!   stream ended is closed once `idle_timeout` has (measured from that end, within [`CLOSE_SLACK`]);
//! - a real Envoy 1.40, started (so connecting) while the cap is full and kept full, receives its roster
//!   and routes every request, and the connections open never exceed the cap plus those closing;
//! - 64 slowloris connections on `metrics_listen` (the default cap), reconnecting whenever closed, leave
//!   every one of 40 scrapes of `/metrics`, and `/readyz`, answered.
//!
//! The bounds are generous against what they bound (a decision takes milliseconds; the timeouts are
//! seconds): they fail when a client waits for a place that never comes, not when the machine is slow.
//! The lock-out tests use no new configuration key, so `CACHEPICK_BIN` can point them at an older build
//! to measure what it did (RELIABILITY.md's "before").

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use cachepick::envoy_config::{self, EnvoyOptions};
use cachepick::extproc::{CLOSE_GRACE, READINESS};

use cachepick_rig::client::{Client, Verdict};
use cachepick_sim::Engine;
use cachepick_sim::fleet::Fleet;

use super::sim_fleet;
use super::{envoy, sim_client};

use self::sim_client::{CHAT, DEADLINE, MODEL, bounded, metric};

/// A newcomer at a full cap connects and is answered within this (a decision takes milliseconds).
const NEWCOMER_BOUND: Duration = Duration::from_secs(2);
/// A close decided by a timer reaches the client within this after the timer: the GOAWAY round and
/// [`CLOSE_GRACE`] (1 s) for a peer that does not finish it, with 1.5 s to spare.
const CLOSE_SLACK: Duration = Duration::from_millis(2500);
const _: () = assert!(CLOSE_SLACK.as_millis() > CLOSE_GRACE.as_millis());

/// `cachepick serve`, killed when the test ends however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The fleet and a `cachepick serve` process on free loopback ports.
struct Picker {
    fleet: Fleet,
    listen: SocketAddr,
    metrics_listen: SocketAddr,
    /// The configuration it serves, for Envoy's bootstrap.
    yaml: String,
    _server: Server,
    _dir: tempfile::TempDir,
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Picker {
    /// Starts two simulated workers and `cachepick serve` with their configuration plus `head` (top-level
    /// YAML), and waits for readiness.
    async fn start(head: &str) -> Picker {
        let sim = sim_fleet::config(Engine::Vllm, 2);
        let fleet = sim_fleet::start(&sim).await;
        let listen = loopback(envoy::free_port());
        let metrics_listen = loopback(envoy::free_port());
        let generated = fleet
            .cachepick_config()
            .replace("listen: 127.0.0.1:9002", &format!("listen: {listen}"))
            .replace(
                "metrics_listen: 127.0.0.1:9090",
                &format!("metrics_listen: {metrics_listen}"),
            );
        let yaml = format!("{head}\n{generated}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cachepick.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let child = std::process::Command::new(cachepick_rig::cachepick_binary())
            .args(["serve", "--config", path.to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("cachepick serve starts");
        let server = Server(child);
        cachepick_rig::client::wait_ready(listen, DEADLINE)
            .await
            .unwrap_or_else(|error| panic!("cachepick is not ready: {error}\n{yaml}"));
        Picker {
            fleet,
            listen,
            metrics_listen,
            yaml,
            _server: server,
            _dir: dir,
        }
    }

    /// `/metrics`, over a connection of its own.
    async fn metrics(&self) -> String {
        let reply = bounded(
            "a scrape of /metrics",
            DEADLINE,
            sim_client::Client::new().get(self.metrics_listen, "/metrics"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        reply.text()
    }

    async fn open_grpc_connections(&self) -> f64 {
        metric(&self.metrics().await, "cachepick_grpc_connections", &[])
    }

    async fn closed(&self, reason: &str) -> f64 {
        metric(
            &self.metrics().await,
            "cachepick_grpc_connections_closed_total",
            &[("reason", reason)],
        )
    }

    /// Waits until `cachepick_grpc_connections` is `count`.
    async fn until_open_connections(&self, count: usize) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let open = self.open_grpc_connections().await;
            if open == count as f64 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{open} gRPC connections open, expected {count}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An HTTP/2 connection that sent the preface and SETTINGS and answers the server's pings (hyper's
/// connection task does), and opens no stream unless the test sends one on `sender`.
struct Idle {
    sender: SendRequest<Full<Bytes>>,
    /// Ends when the server closed the connection.
    closed: JoinHandle<()>,
}

async fn idle_connection(addr: SocketAddr) -> Idle {
    let stream = TcpStream::connect(addr).await.expect("TCP connect");
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(stream))
        .await
        .expect("the HTTP/2 preface is written");
    let closed = tokio::spawn(async move {
        let _ = connection.await;
    });
    Idle { sender, closed }
}

/// gRPC `Health/Check` for the overall status, sent by hand on `idle`'s connection (one stream).
async fn raw_health_check(idle: &mut Idle, addr: SocketAddr) -> Result<(), String> {
    let request = Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        // An empty HealthCheckRequest: no compression flag, a zero length.
        .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .unwrap();
    idle.sender
        .ready()
        .await
        .map_err(|error| error.to_string())?;
    let response = idle
        .sender
        .send_request(request)
        .await
        .map_err(|error| error.to_string())?;
    let collected = response
        .into_body()
        .collect()
        .await
        .map_err(|error| error.to_string())?;
    let status = collected
        .trailers()
        .and_then(|trailers| trailers.get("grpc-status"))
        .map(|value| value.to_str().unwrap_or_default().to_owned());
    if status.as_deref() == Some("0") {
        Ok(())
    } else {
        Err(format!("grpc-status {status:?}"))
    }
}

/// A health check on a new connection, bounded; the connection, kept open by the caller.
async fn health_on_a_new_connection(
    addr: SocketAddr,
    within: Duration,
) -> Result<tonic::transport::Channel, String> {
    let attempt = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .map_err(|error| error.to_string())?;
        let reply = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: READINESS.to_owned(),
            })
            .await
            .map_err(|status| status.to_string())?;
        if reply.into_inner().status == ServingStatus::Serving as i32 {
            Ok(channel)
        } else {
            Err("readiness is not SERVING".to_owned())
        }
    };
    tokio::time::timeout(within, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {within:?}")))
}

fn chat_body(seed: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("conversation {seed}: {}", "words ".repeat(200))}],
        "max_tokens": 4,
    }))
    .unwrap()
}

/// A new ext_proc client connects and gets a routed decision, bounded; the client, kept open by the
/// caller.
async fn decision_on_a_new_connection(
    addr: SocketAddr,
    seed: u64,
    within: Duration,
) -> Result<Client, String> {
    let attempt = async {
        let client = Client::connect(addr)
            .await
            .map_err(|error| error.to_string())?;
        match client.decide_within(CHAT, &chat_body(seed), within).await {
            Ok(Verdict::Route { .. }) => Ok(client),
            Ok(other) => Err(format!("not routed: {other:?}")),
            Err(error) => Err(error.to_string()),
        }
    };
    tokio::time::timeout(within, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no decision within {within:?}")))
}

/// Keeps `count` idle connections open to `addr`, opening a new one whenever the server closes one,
/// until `stop` is set.
fn hold_idle_connections(
    addr: SocketAddr,
    count: usize,
    stop: Arc<AtomicBool>,
) -> Vec<JoinHandle<()>> {
    (0..count)
        .map(|_| {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let idle = idle_connection(addr).await;
                    let mut closed = idle.closed;
                    loop {
                        tokio::select! {
                            _ = &mut closed => break,
                            () = tokio::time::sleep(Duration::from_millis(50)) => {
                                if stop.load(Ordering::Relaxed) {
                                    return;
                                }
                            }
                        }
                    }
                    drop(idle.sender);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_full_of_idle_http2_connections_locks_out_no_new_client() {
    const CAP: usize = 32;
    let picker = Picker::start(&format!("overload: {{max_connections: {CAP}}}")).await;
    // wait_ready's connection has closed (its channel is dropped): the cap is empty.
    picker.until_open_connections(0).await;
    let mut idle = Vec::new();
    for _ in 0..CAP {
        idle.push(idle_connection(picker.listen).await);
    }
    picker.until_open_connections(CAP).await;

    // A health check and an ext_proc client, each on a new connection, while every place is taken by a
    // connection that never asks: each gets in at once. The newcomers stay open, so each one after the
    // first finds the cap full too.
    let mut newcomers = Vec::new();
    const ROUNDS: u64 = 3;
    for round in 0..ROUNDS {
        let started = Instant::now();
        let health = health_on_a_new_connection(picker.listen, NEWCOMER_BOUND)
            .await
            .unwrap_or_else(|error| {
                panic!("health check {round} at a cap full of idle connections: {error}")
            });
        let health_took = started.elapsed();
        let client = decision_on_a_new_connection(picker.listen, round, NEWCOMER_BOUND)
            .await
            .unwrap_or_else(|error| {
                panic!("decision {round} at a cap full of idle connections: {error}")
            });
        eprintln!(
            "round {round}: health in {health_took:?}, health and a routed decision in {:?}",
            started.elapsed()
        );
        newcomers.push((health, client));
    }
    // Each newcomer took the place of an idle connection, the one idle longest (an attacker's: the
    // newcomers each had a stream since); the cap held throughout.
    let newcomer_count = 2 * ROUNDS as usize;
    let deadline = Instant::now() + CLOSE_SLACK;
    while idle.iter().filter(|idle| idle.closed.is_finished()).count() < newcomer_count {
        assert!(
            Instant::now() < deadline,
            "the idle connections that made room were not closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    picker.until_open_connections(CAP).await;
    let text = picker.metrics().await;
    assert_eq!(
        metric(
            &text,
            "cachepick_grpc_connections_closed_total",
            &[("reason", "evicted")],
        ),
        newcomer_count as f64
    );
    assert_eq!(
        idle.iter().filter(|idle| idle.closed.is_finished()).count(),
        newcomer_count,
        "exactly one idle connection closed per newcomer"
    );
    drop(newcomers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_a_stream_are_closed_after_the_configured_times() {
    const IDLE: Duration = Duration::from_secs(4);
    const FIRST_STREAM: Duration = Duration::from_secs(2);
    let picker = Picker::start(&format!(
        "overload: {{max_connections: 16, idle_timeout: {}ms, first_stream_timeout: {}ms}}",
        IDLE.as_millis(),
        FIRST_STREAM.as_millis()
    ))
    .await;
    picker.until_open_connections(0).await;
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(idle_connection(picker.listen).await);
    }
    // One connection asks once, then goes quiet: it is idle from the end of its stream.
    let mut asked = idle_connection(picker.listen).await;
    raw_health_check(&mut asked, picker.listen)
        .await
        .expect("a health check on the connection");
    let answered = Instant::now();

    // The silent ones go at the first-stream timeout, not before.
    for (index, connection) in silent.into_iter().enumerate() {
        bounded(
            "a connection that never opened a stream is closed",
            FIRST_STREAM + CLOSE_SLACK,
            connection.closed,
        )
        .await
        .unwrap();
        assert!(
            opened.elapsed() >= FIRST_STREAM - Duration::from_millis(100),
            "silent connection {index} closed after {:?}, before the first-stream timeout",
            opened.elapsed()
        );
    }
    // The one that asked stays open until its idle timeout, counted from its stream's end.
    bounded(
        "a connection without a stream since its last is closed",
        IDLE + CLOSE_SLACK,
        &mut asked.closed,
    )
    .await
    .unwrap();
    let idle_for = answered.elapsed();
    assert!(
        idle_for >= IDLE - Duration::from_millis(100),
        "closed {idle_for:?} after its last stream, before the idle timeout"
    );
    eprintln!(
        "first-stream closes by {:?}; the idle close {idle_for:?} after its stream",
        FIRST_STREAM
    );
    assert_eq!(picker.closed("first_stream").await, 8.0);
    assert_eq!(picker.closed("idle").await, 1.0);
    picker.until_open_connections(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_connecting_to_a_full_cap_gets_its_roster_and_routes() {
    const CAP: usize = 12;
    let picker = Picker::start(&format!("overload: {{max_connections: {CAP}}}")).await;
    picker.until_open_connections(0).await;
    let stop = Arc::new(AtomicBool::new(false));
    let attackers = hold_idle_connections(picker.listen, CAP, Arc::clone(&stop));
    picker.until_open_connections(CAP).await;

    // Envoy starts now: its EDS, health-check and ext_proc connections all arrive at a full cap, and the
    // attackers take places back whenever one of theirs is closed.
    let config = cachepick::config::parse(&picker.yaml, "conn test", &Default::default()).unwrap();
    let gateway = loopback(envoy::free_port());
    let options = EnvoyOptions {
        listen: gateway,
        admin: loopback(envoy::free_port()),
        ..EnvoyOptions::for_config(&config)
    };
    let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
    let deadline = Instant::now() + DEADLINE;
    while envoy
        .stat("cluster.workers.membership_total")
        .await
        .unwrap_or(0)
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "Envoy received no roster over EDS within {DEADLINE:?} while the cap was full:\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let client = sim_client::Client::new();
    let workers: Vec<String> = picker
        .fleet
        .endpoints()
        .iter()
        .map(ToString::to_string)
        .collect();
    let mut routed = 0;
    for seed in 0..10 {
        let reply = bounded(
            "a chat through Envoy",
            DEADLINE,
            client.send_raw(
                Method::POST,
                gateway,
                CHAT,
                &[("content-type", "application/json")],
                chat_body(100 + seed),
            ),
        )
        .await;
        let reply = sim_client::read_whole(reply).await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let decision = reply.header("x-sim-echo-x-cachepick-decision");
        let destination = reply.header("x-sim-echo-x-gateway-destination-endpoint");
        let served_by = reply.header("x-served-by").unwrap_or_default().to_owned();
        if decision.is_some()
            && destination.is_some_and(|destination| destination.starts_with(&served_by))
            && workers.contains(&served_by)
        {
            routed += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = picker.metrics().await;
    let open = metric(&text, "cachepick_grpc_connections", &[]);
    stop.store(true, Ordering::Relaxed);
    assert_eq!(
        routed, 10,
        "requests routed by cachepick through Envoy at a full cap"
    );
    // Those being closed to make room are counted until they end: at most as many again.
    assert!(
        open <= 2.0 * CAP as f64,
        "{open} connections open over a cap of {CAP} and as many closing"
    );
    for attacker in attackers {
        bounded("an attacker stops", DEADLINE, attacker)
            .await
            .unwrap();
    }
    drop(envoy);
}

/// Holds a slowloris connection to `addr`: the start of a request whose headers never end, a header
/// line every 100 ms, a new connection as soon as the server closes one; until `stop`.
fn slowloris(addr: SocketAddr, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut buffer = [0_u8; 256];
        while !stop.load(Ordering::Relaxed) {
            let Ok(mut stream) = TcpStream::connect(addr).await else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            if stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: cachepick\r\n")
                .await
                .is_ok()
            {
                while !stop.load(Ordering::Relaxed) {
                    if stream.write_all(b"X-Slow: a\r\n").await.is_err() {
                        break;
                    }
                    let read =
                        tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buffer))
                            .await;
                    if let Ok(Ok(0) | Err(_)) = read {
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// One `GET path` on a new connection; its status, or why there was none.
async fn get_once(addr: SocketAddr, path: &str, within: Duration) -> Result<StatusCode, String> {
    let attempt = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|error| error.to_string())?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| error.to_string())?;
        tokio::spawn(connection);
        let request = Request::get(path)
            .header("host", "cachepick")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = sender
            .send_request(request)
            .await
            .map_err(|error| error.to_string())?;
        let status = response.status();
        response
            .into_body()
            .collect()
            .await
            .map_err(|error| error.to_string())?;
        Ok(status)
    };
    tokio::time::timeout(within, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {within:?}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_and_probes_get_through_64_slowloris_connections() {
    const SLOW: usize = 64;
    const SCRAPES: usize = 40;
    // metrics_http's defaults: 64 connections, 5 s to send the headers.
    let picker = Picker::start("").await;
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..SLOW)
        .map(|_| slowloris(picker.metrics_listen, Arc::clone(&stop)))
        .collect();
    // Every place taken: the attackers connect within milliseconds; give them a second.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut answered = 0;
    let mut failures = Vec::new();
    for _ in 0..SCRAPES {
        match get_once(picker.metrics_listen, "/metrics", NEWCOMER_BOUND).await {
            Ok(StatusCode::OK) => answered += 1,
            Ok(status) => failures.push(status.to_string()),
            Err(error) => failures.push(error),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ready = get_once(picker.metrics_listen, "/readyz", NEWCOMER_BOUND).await;
    let live = get_once(picker.metrics_listen, "/livez", NEWCOMER_BOUND).await;
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        bounded("a slowloris client stops", DEADLINE, attacker)
            .await
            .unwrap();
    }
    eprintln!("{answered}/{SCRAPES} scrapes answered under {SLOW} slowloris connections");
    assert_eq!(
        answered, SCRAPES,
        "scrapes answered under {SLOW} slowloris connections; failures: {failures:?}"
    );
    assert_eq!(ready, Ok(StatusCode::OK), "/readyz under slowloris");
    assert_eq!(live, Ok(StatusCode::OK), "/livez under slowloris");
    let text = picker.metrics().await;
    let evicted = metric(
        &text,
        "cachepick_metrics_http_refused_total",
        &[("reason", "evicted")],
    );
    assert!(
        evicted >= SCRAPES as f64,
        "each scrape at the full cap took a slow connection's place ({evicted} evicted)"
    );
}

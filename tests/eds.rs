//! cachepick's EDS against the real Envoy 1.40: the generated bootstrap subscribes its workers cluster to
//! `cachepick::extproc::eds`, served here on a loopback tonic server from a hand-driven roster, in front
//! of three loopback HTTP workers. Envoy's `/clusters` lists exactly the roster; an added worker appears
//! within a bounded time and `override_host` steers to it; a removed one disappears and can no longer be
//! steered to; when the roster's source goes away (a picker shutting down) Envoy keeps what it has. A
//! second test starts Envoy before any picker is up: it starts within
//! `initial_fetch_timeout` with no workers and fills the cluster once the picker answers.
//!
//! The test plays the picker's ext_proc part by sending `x-gateway-destination-endpoint` itself: the
//! bootstrap's filter that drops that client header is removed, and ext_proc fails open (this server
//! serves no ext_proc, so Envoy's health check marks it down).
//!
//! None of these tests skips: without Envoy they fail, saying why.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
}

use support::envoy;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode, EnvoyOptions, WORKERS_CLUSTER};
use cachepick::extproc::eds::{self, Assignments};
use cachepick::load::PoolLoad;
use cachepick::protocol::DESTINATION;

/// How long Envoy may take to apply a pushed roster.
const APPLY_DEADLINE: Duration = Duration::from_secs(10);

/// A worker stand-in that says who it is.
async fn worker() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = service_fn(move |request: Request<Incoming>| async move {
                let _ = request.into_body().collect().await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .header("x-served-by", addr.to_string())
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .unwrap(),
                )
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// cachepick's EDS service alone, on `listener`, serving what `roster` holds.
fn serve_eds(listener: TcpListener, roster: watch::Receiver<Assignments>) {
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(eds::server(roster))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
}

fn assignments(endpoints: &[SocketAddr]) -> Assignments {
    let mut endpoints = endpoints.to_vec();
    endpoints.sort_unstable();
    Assignments::from([(eds::WORKERS_CLUSTER.to_owned(), endpoints)])
}

/// A static pool of `workers` with cachepick listening at `picker`, parsed by cachepick's loader.
fn config(picker: SocketAddr, workers: &[SocketAddr]) -> Config {
    let mut yaml =
        format!("listen: \"{picker}\"\npools:\n  - model: m\n    engine: vllm\n    workers:\n");
    for worker in workers {
        yaml.push_str(&format!("      - {{endpoint: \"{worker}\"}}\n"));
    }
    config::parse(&yaml, "eds-test.yaml", &Overrides::default()).unwrap()
}

/// The generated buffered bootstrap on fresh loopback ports, minus the filter line that drops a
/// client's destination header (the test steers with it, as the picker would), and with the route of
/// unanswered requests sent to the workers cluster too (that route's aggregate cannot steer; here every
/// request is unanswered, since no picker answers ext_proc).
fn bootstrap(config: &Config) -> String {
    let options = EnvoyOptions {
        mode: BodyMode::Buffered,
        listen: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        admin: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        ..EnvoyOptions::for_config(config)
    };
    let yaml = envoy_config::render(config, &options);
    let strip = format!("                - remove: {DESTINATION}\n");
    assert!(yaml.contains(&strip), "the bootstrap drops {DESTINATION}");
    assert!(yaml.contains("type: EDS\n"), "the workers cluster is EDS");
    let fail_open = format!("cluster: {}\n", envoy_config::FAIL_OPEN_CLUSTER);
    assert!(
        yaml.contains(&fail_open),
        "the route of unanswered requests"
    );
    yaml.replace(&strip, "")
        .replace(&fail_open, &format!("cluster: {WORKERS_CLUSTER}\n"))
}

/// The hosts Envoy's workers cluster holds, from admin `/clusters` (`workers::ip:port::stat::value`).
async fn envoy_hosts(envoy: &envoy::Envoy) -> BTreeSet<SocketAddr> {
    let (status, text) = envoy::get(envoy.admin_addr(), "/clusters").await.unwrap();
    assert_eq!(status, StatusCode::OK);
    text.lines()
        .filter_map(|line| line.strip_prefix(&format!("{WORKERS_CLUSTER}::")))
        .filter_map(|rest| rest.split("::").next())
        .filter_map(|host| host.parse().ok())
        .collect()
}

/// Waits until Envoy's workers cluster holds exactly `expected`; panics after [`APPLY_DEADLINE`].
async fn wait_for_hosts(envoy: &envoy::Envoy, expected: &[SocketAddr]) {
    let expected: BTreeSet<SocketAddr> = expected.iter().copied().collect();
    let deadline = Instant::now() + APPLY_DEADLINE;
    loop {
        let hosts = envoy_hosts(envoy).await;
        if hosts == expected {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "Envoy's workers cluster holds {hosts:?}, not {expected:?}, after {APPLY_DEADLINE:?}\n{}",
                envoy.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// POSTs a chat request through Envoy naming `destination`; returns the worker that served it.
async fn served_by(envoy: &envoy::Envoy, destination: SocketAddr) -> String {
    let request = Request::post(format!(
        "http://{}/v1/chat/completions",
        envoy.listener_addr()
    ))
    .header("content-type", "application/json")
    .header(DESTINATION, destination.to_string())
    .body(Full::new(Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )))
    .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), envoy::client().request(request))
        .await
        .expect("Envoy answers within 10 s")
        .unwrap_or_else(|error| panic!("request failed: {error}\n{}", envoy.log_tail()));
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "through Envoy to {destination}\n{}",
        envoy.log_tail()
    );
    response
        .headers()
        .get("x-served-by")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_the_roster_cachepick_pushes() {
    let (a, b, c) = (worker().await, worker().await, worker().await);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let picker = listener.local_addr().unwrap();
    let (roster, watched) = watch::channel(assignments(&[a, b]));
    serve_eds(listener, watched);
    let envoy = envoy::Envoy::start(&bootstrap(&config(picker, &[a, b]))).await;

    // The first answer arrives while Envoy starts (its listener waits for it): exactly the roster.
    assert_eq!(
        envoy_hosts(&envoy).await,
        BTreeSet::from([a, b]),
        "{}",
        envoy.log_tail()
    );
    assert_eq!(served_by(&envoy, b).await, b.to_string());

    // A worker joins: Envoy holds it within the deadline, and override_host steers to it.
    roster.send(assignments(&[a, b, c])).unwrap();
    wait_for_hosts(&envoy, &[a, b, c]).await;
    for _ in 0..5 {
        assert_eq!(served_by(&envoy, c).await, c.to_string());
    }

    // A worker leaves: Envoy drops it, and a destination naming it no longer reaches it (override_host
    // ignores addresses outside the cluster; least-request serves the request from the rest).
    roster.send(assignments(&[a, c])).unwrap();
    wait_for_hosts(&envoy, &[a, c]).await;
    for _ in 0..10 {
        let served = served_by(&envoy, b).await;
        assert!(
            served == a.to_string() || served == c.to_string(),
            "served by {served}"
        );
    }

    // Every push was accepted (no NACK), and Envoy counted each as an update.
    let stats = envoy.stats().await;
    assert_eq!(
        envoy::parse_stat(&stats, "cluster.workers.update_rejected"),
        Some(0),
        "{stats}"
    );
    assert!(
        envoy::parse_stat(&stats, "cluster.workers.update_success").unwrap_or(0) >= 3,
        "{stats}"
    );
    // The same roster again changes nothing and is not pushed again.
    let before = envoy::parse_stat(&stats, "cluster.workers.update_success");
    roster.send(assignments(&[c, a])).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(envoy.stat("cluster.workers.update_success").await, before);

    // The roster's source goes away (a picker shutting down): the stream ends, and Envoy keeps the
    // roster it has and goes on serving from it.
    drop(roster);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(envoy_hosts(&envoy).await, BTreeSet::from([a, c]));
    assert_eq!(served_by(&envoy, c).await, c.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_starts_without_a_picker_and_fills_the_cluster_when_one_answers() {
    let a = worker().await;
    let picker: SocketAddr = format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap();
    let started = Instant::now();
    let envoy = envoy::Envoy::start(&bootstrap(&config(picker, &[a]))).await;
    // Envoy waited for the first answer at most initial_fetch_timeout, then started with no workers:
    // the timeout fired once (Envoy's own count, which does not depend on how loaded the machine is),
    // and the start took at least that long.
    assert_eq!(
        envoy.stat("cluster.workers.init_fetch_timeout").await,
        Some(1),
        "{}",
        envoy.stats().await
    );
    assert!(
        started.elapsed() >= envoy_config::EDS_INITIAL_FETCH_TIMEOUT,
        "Envoy started after {:?}, before the initial fetch timed out",
        started.elapsed()
    );
    assert!(envoy_hosts(&envoy).await.is_empty());

    let (_roster, watched) = watch::channel(assignments(&[a]));
    serve_eds(TcpListener::bind(picker).await.unwrap(), watched);
    // The subscription retries within 5 s (max_interval of its back-off).
    wait_for_hosts(&envoy, &[a]).await;
    assert_eq!(served_by(&envoy, a).await, a.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_follows_the_pools_rosters_minus_decode_only_workers() {
    let yaml = "pools:\n  - model: a\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8002\"}\n      - {endpoint: \"127.0.0.1:8001\"}\n      - {endpoint: \"127.0.0.1:8003\", role: decode}\n  - model: b\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8004\", role: prefill}\n";
    let config = config::parse(yaml, "eds-test.yaml", &Overrides::default()).unwrap();
    let (assignments, _follower) = eds::follow(PoolLoad::for_pools(&config));
    let expected: Vec<SocketAddr> = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8004"]
        .iter()
        .map(|addr| addr.parse().unwrap())
        .collect();
    assert_eq!(
        *assignments.borrow(),
        Assignments::from([(WORKERS_CLUSTER.to_owned(), expected)])
    );
    assert_eq!(eds::WORKERS_CLUSTER, WORKERS_CLUSTER);
}

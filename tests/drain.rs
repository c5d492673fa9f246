//! Readiness that means something, and the graceful drain, with the real `cachepick serve`:
//! readiness (and the ext_proc service's health, which Envoy's health check asks) is NOT_SERVING while
//! no worker has a fresh reading and SERVING again once one has; SIGTERM withdraws readiness at once,
//! the picker keeps deciding for `overload.shutdown_grace`, then exits cleanly.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
    pub mod serve;
}

use std::net::SocketAddr;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use cachepick::protocol::{EXT_PROC_SERVICE, LIVENESS, READINESS};
use cachepick_rig::client::{Client, Verdict};
use support::engine::{FakeEngine, Mode, vllm_metrics};
use support::serve::{self, Server};

/// Starts `cachepick serve` on `text` and returns it with its log lines and its gRPC address.
fn start(text: &str, dir: &tempfile::TempDir) -> (Server, mpsc::Receiver<String>, SocketAddr) {
    let path = dir.path().join("cachepick.yaml");
    std::fs::write(&path, text).unwrap();
    let (server, receiver) = serve::spawn_logged(&mut serve::command(&path, &[], "info"));
    let listen = serve::logged_field(&receiver, "listen").parse().unwrap();
    (server, receiver, listen)
}

fn config(worker: SocketAddr, grace: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n\
         load: {{scrape_interval: 100ms, scrape_timeout: 80ms, freshness: 400ms, silent_after: 1s}}\n\
         overload: {{shutdown_grace: {grace}}}\n\
         pools:\n  - model: m\n    engine: vllm\n    tokenizer: {{kind: bytes}}\n    workers:\n      \
         - endpoint: \"{worker}\"\n"
    )
}

async fn health(listen: SocketAddr, service: &str) -> Result<ServingStatus, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .map_err(|error| error.to_string())?;
    let reply = tokio::time::timeout(
        Duration::from_secs(2),
        HealthClient::new(channel).check(HealthCheckRequest {
            service: service.to_owned(),
        }),
    )
    .await
    .map_err(|_| "health check timed out".to_owned())?
    .map_err(|status| status.to_string())?;
    Ok(ServingStatus::try_from(reply.into_inner().status).unwrap())
}

/// Waits until readiness and the ext_proc service are both `wanted`, for at most `within`.
async fn until_ready_is(listen: SocketAddr, wanted: ServingStatus, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let readiness = health(listen, READINESS).await;
        let ext_proc = health(listen, EXT_PROC_SERVICE).await;
        if readiness == Ok(wanted) && ext_proc == Ok(wanted) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "readiness {readiness:?}, ext_proc {ext_proc:?}: not {wanted:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn healthy() -> Mode {
    Mode::Body("text/plain", vllm_metrics(&[(0, 0, 0, 0.1)]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_whether_any_worker_answers_with_a_recent_reading() {
    let worker = FakeEngine::start(Mode::Status(500)).await;
    let dir = tempfile::tempdir().unwrap();
    let (server, _lines, listen) = start(&config(worker.addr, "0s"), &dir);
    // Scrapes fail from the start: alive, but never ready.
    until_ready_is(listen, ServingStatus::NotServing, Duration::from_secs(10)).await;
    assert_eq!(health(listen, LIVENESS).await, Ok(ServingStatus::Serving));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        health(listen, READINESS).await,
        Ok(ServingStatus::NotServing)
    );

    worker.set(healthy());
    until_ready_is(listen, ServingStatus::Serving, Duration::from_secs(5)).await;

    // Every reading goes stale (the engine's metrics fail): still ready while the last reading is
    // younger than silent_after, NOT_SERVING after it, and back.
    worker.set(Mode::Status(500));
    let after = until_ready_is(listen, ServingStatus::NotServing, Duration::from_secs(5)).await;
    assert!(
        after >= Duration::from_millis(800),
        "withdrawn {after:?} after the last reading, before silent_after"
    );
    worker.set(healthy());
    until_ready_is(listen, ServingStatus::Serving, Duration::from_secs(5)).await;
    assert_eq!(health(listen, LIVENESS).await, Ok(ServingStatus::Serving));
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_withdraws_readiness_answers_through_the_grace_then_exits() {
    let worker = FakeEngine::start(healthy()).await;
    let dir = tempfile::tempdir().unwrap();
    let grace = Duration::from_millis(1500);
    let (mut server, lines, listen) = start(&config(worker.addr, "1500ms"), &dir);
    until_ready_is(listen, ServingStatus::Serving, Duration::from_secs(10)).await;
    let client = Client::connect(listen).await.unwrap();
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
    assert!(matches!(
        client.decide("/v1/chat/completions", body).await.unwrap(),
        Verdict::Route { .. }
    ));

    let signalled = Instant::now();
    let pid = server.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    // Readiness goes first, at once; liveness stays.
    let withdrawn = until_ready_is(listen, ServingStatus::NotServing, grace).await;
    assert!(withdrawn < Duration::from_millis(1000), "{withdrawn:?}");
    assert_eq!(health(listen, LIVENESS).await, Ok(ServingStatus::Serving));
    // Still answering inside the grace, on an open connection and on a new one.
    assert!(matches!(
        client.decide("/v1/chat/completions", body).await.unwrap(),
        Verdict::Route { .. }
    ));
    let fresh = Client::connect(listen).await.unwrap();
    assert!(matches!(
        fresh.decide("/v1/chat/completions", body).await.unwrap(),
        Verdict::Route { .. }
    ));
    assert!(
        signalled.elapsed() < grace,
        "the checks took the whole grace"
    );
    assert!(
        server.0.try_wait().unwrap().is_none(),
        "exited inside the grace"
    );
    drop((client, fresh));
    // Then it stops, cleanly, once the grace is over.
    let status = tokio::task::spawn_blocking(move || {
        let status = server.0.wait().unwrap();
        (status, server)
    })
    .await
    .unwrap()
    .0;
    let stopped = signalled.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        stopped >= grace,
        "stopped after {stopped:?}, before the grace"
    );
    assert!(stopped < grace + Duration::from_secs(5), "{stopped:?}");
    let log: Vec<String> = lines.try_iter().collect();
    assert!(
        log.iter().any(|line| line.contains("draining")),
        "{}",
        log.join("\n")
    );
}

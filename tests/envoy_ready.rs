//! Envoy's start-up readiness (`--envoy-ready`) against the real Envoy 1.40 and a picker started after
//! it, the order of one pod whose containers start together: Envoy's admin `/ready` says `LIVE` while
//! it counts no picker healthy, and the `ready` listener does not say ready until it does; the first
//! request after it does is decided. With no picker healthy again, it says so again.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, sim_client, sim_fleet};

use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::json;

use cachepick::config::{self, Overrides};
use cachepick::envoy_config::{self, BodyMode, READY_PATH};
use cachepick::protocol::PASSTHROUGH;
use cachepick_rig::stage::Picker;
use cachepick_sim::Engine;
use sim_client::{CHAT, Client, MODEL};

const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";
/// Longer than the picker's first scrape round and Envoy's health check interval (1 s) together, on a
/// loaded two-core machine.
const WITHIN: Duration = Duration::from_secs(20);

/// The `ready` listener's status and Envoy's admin `/ready` body.
async fn readiness(
    ready: std::net::SocketAddr,
    admin: std::net::SocketAddr,
) -> (StatusCode, String) {
    let (status, _) = envoy::get(ready, READY_PATH).await.unwrap();
    let (_, live) = envoy::get(admin, "/ready").await.unwrap();
    (status, live.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_is_not_ready_until_it_counts_a_picker_healthy_and_the_first_request_after_is_decided()
 {
    let fleet = sim_fleet::start(&sim_fleet::config(Engine::Vllm, 2)).await;
    let config =
        config::parse(&fleet.cachepick_config(), "fleet", &envoy::free_listeners()).unwrap();
    let config = config::parse(&config.to_yaml(), "fleet", &Overrides::default()).unwrap();
    let options = envoy::free_options(&config, BodyMode::Buffered);
    let ready = options
        .ready
        .expect("free_options asks for a ready listener");
    let bootstrap = envoy_config::render(&config, &options);
    let envoy = envoy::Envoy::start(&bootstrap).await;

    // No picker yet: Envoy has finished initialising (its first health check round failed) and says so.
    assert_eq!(
        readiness(ready, options.admin).await,
        (StatusCode::SERVICE_UNAVAILABLE, "LIVE".to_owned()),
        "admin /ready is LIVE with no picker, the ready listener is not"
    );
    assert_eq!(
        envoy::get(ready, "/other").await.unwrap().0,
        StatusCode::NOT_FOUND
    );

    // The picker starts; the probe waits for Envoy, not for the picker's own readiness.
    let started = Instant::now();
    let picker = Picker::spawn(config.clone());
    envoy::until_ready(ready, WITHIN).await;
    println!("ready {:?} after the picker started", started.elapsed());
    let client = Client::new();
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "the first request after ready. ".repeat(20)}],
        "max_tokens": 4,
    });
    let reply = client.post(options.listen, CHAT, &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let decision = reply.header(ECHO_DECISION);
    assert!(
        decision.is_some_and(|decision| decision != PASSTHROUGH),
        "the first request after ready went out undecided: {decision:?}\n{}",
        envoy.log_tail()
    );

    // The picker stops: two failed checks later Envoy counts none healthy, and the listener says so.
    picker.stop().await.unwrap();
    let deadline = Instant::now() + WITHIN;
    while envoy::get(ready, READY_PATH).await.unwrap().0 != StatusCode::SERVICE_UNAVAILABLE {
        assert!(
            Instant::now() < deadline,
            "still ready with the picker stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

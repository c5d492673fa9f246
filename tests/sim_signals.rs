//! What the picker reads of simulated engines that behave as the real vLLM did (issue 45), through a
//! real Envoy: the prefill rate from the engines' prefill histograms, a `/metrics` made late by the
//! API server's loop, and an idle fleet spreading new prefixes. `tests/vllm.rs` holds the same against
//! the real engine; `tests/vllm/conformance.rs` holds the simulator's formats to it.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod gateway;
    pub mod learned;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use cachepick::envoy_config::BodyMode;
use support::gateway::Gateway;
use support::learned::assert_learned_like_measured;
use support::sim_client::{CHAT, COMPLETIONS, Client, MODEL, metric_sum};

/// A prompt of about `tokens` byte-tokens that shares nothing with another seed's.
fn prompt(seed: u64, tokens: usize) -> String {
    let mut text = format!("{seed:08} ");
    while text.len() < tokens * 4 {
        text.push_str(&format!(
            "{:x} ",
            seed.wrapping_mul(0x9E37_79B9)
                .wrapping_add(text.len() as u64)
        ));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_sequential_new_prefixes_on_an_idle_fleet_of_four_land_on_at_least_three() {
    let gateway = Gateway::start(4, |_| {}, Some(BodyMode::Buffered)).await;
    let mut served = BTreeSet::new();
    for seed in 0..10 {
        let reply = gateway.chat(&prompt(seed, 2_000)).await;
        assert!(reply.status.is_success(), "{}", reply.text());
        served.insert(reply.header("x-served-by").unwrap().to_owned());
    }
    assert!(served.len() >= 3, "ten new prefixes went to {served:?}");
}

/// The rate the picker learns of each simulated worker is within 2× of the one the worker's own
/// prefill histograms give over the same traffic, and two identical workers agree within 25%. (The
/// speed of a prefill run alone is printed beside them: under traffic prefills share steps.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learned_prefill_rate_is_the_simulated_engines_prefill_speed() {
    let gateway = Gateway::start(
        2,
        |sim| sim.params.time_scale = 0.1,
        Some(BodyMode::Buffered),
    )
    .await;
    let client = Client::new();
    // Alone: cold prompts one at a time straight to each worker, its histograms read before and after.
    let mut alone = Vec::new();
    for (index, worker) in gateway.fleet.workers().iter().enumerate() {
        let before = client.get(worker.addr(), "/metrics").await.text();
        for seed in 0..4 {
            let body = json!({"model": MODEL, "prompt": prompt(100 + 10 * index as u64 + seed, 4_000), "max_tokens": 1});
            let reply = client.post(worker.addr(), COMPLETIONS, &body).await;
            assert!(reply.status.is_success(), "{}", reply.text());
        }
        let after = client.get(worker.addr(), "/metrics").await.text();
        let grown = |name: &str| metric_sum(&after, name, &[]) - metric_sum(&before, name, &[]);
        alone.push(
            grown("vllm:request_prefill_kv_computed_tokens_sum")
                / grown("vllm:request_prefill_time_seconds_sum"),
        );
    }
    // Traffic through Envoy, eight at a time, for 10 s, with the workers' own histograms around it.
    let mut before = Vec::new();
    for worker in gateway.fleet.workers() {
        before.push(client.get(worker.addr(), "/metrics").await.text());
    }
    let started = Instant::now();
    let mut seed = 1_000;
    while started.elapsed() < Duration::from_secs(10) {
        let wave = (0..8).map(|i| {
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(seed + i - (seed + i) % 3, 1_000 + 500 * (i as usize % 4))}], "max_tokens": 8});
            let client = Client::new();
            let gateway = gateway.gateway();
            async move { client.post(gateway, CHAT, &body).await }
        });
        for reply in futures_util::future::join_all(wave).await {
            assert!(reply.status.is_success(), "{}", reply.text());
        }
        seed += 8;
    }
    let mut measured = Vec::new();
    for (worker, before) in gateway.fleet.workers().iter().zip(&before) {
        let after = client.get(worker.addr(), "/metrics").await.text();
        let grown = |name: &str| metric_sum(&after, name, &[]) - metric_sum(before, name, &[]);
        measured.push(
            grown("vllm:request_prefill_kv_computed_tokens_sum")
                / grown("vllm:request_prefill_time_seconds_sum"),
        );
    }
    let metrics = gateway.picker_metrics().await;
    let learned: Vec<f64> = gateway
        .fleet
        .workers()
        .iter()
        .map(|worker| {
            metric_sum(
                &metrics,
                "cachepick_worker_prefill_tokens_per_second",
                &[("worker", &worker.addr().to_string())],
            )
        })
        .collect();
    eprintln!(
        "sim learning: alone {alone:.0?} tokens/s; under the traffic the workers measured {measured:.0?}, the picker learned {learned:.0?}"
    );
    assert_learned_like_measured(&learned, &measured, "workers");
}

/// The simulator's API server loop, at the speed the real engine's showed on a starved machine (issue
/// 45: `/metrics` p90 0.46–0.61 s behind 40 prompts of 1.6k tokens, about 8 µs of the loop per prompt
/// token), behind a burst of 160 prompts of 6k tokens: `/metrics` takes over a second, yet the picker
/// decides every request and stays ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_that_makes_the_simulated_metrics_late_loses_no_decision_and_readiness_holds() {
    let gateway = Gateway::start(
        4,
        |sim| {
            sim.params.time_scale = 1.0;
            sim.params.profile.api_token = 8e-6;
        },
        Some(BodyMode::Buffered),
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let probe = |addr, path: &'static str| {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let client = Client::new();
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let status = client
                    .try_exchange(http::Method::GET, addr, path, None)
                    .await
                    .map_or(0, |reply| reply.status.as_u16());
                seen.push((status, started.elapsed()));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            seen
        })
    };
    let scrapes: Vec<_> = gateway
        .fleet
        .workers()
        .iter()
        .map(|worker| probe(worker.addr(), "/metrics"))
        .collect();
    let readiness = probe(gateway.config.metrics_listen, "/readyz");
    let burst = (0..160).map(|i| {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(5_000 + i, 6_000)}], "max_tokens": 8});
        let client = Client::new();
        let gateway = gateway.gateway();
        async move { client.post(gateway, CHAT, &body).await }
    });
    for reply in futures_util::future::join_all(burst).await {
        assert!(reply.status.is_success(), "{}", reply.text());
        let decision = reply
            .header("x-sim-echo-x-cachepick-decision")
            .unwrap_or("-");
        assert_ne!(decision, "-", "a request went without a decision");
    }
    stop.store(true, Ordering::Relaxed);
    let mut slowest = Duration::ZERO;
    for scrape in scrapes {
        for (_, took) in scrape.await.unwrap() {
            slowest = slowest.max(took);
        }
    }
    eprintln!("sim burst: the slowest /metrics took {slowest:?}");
    assert!(
        slowest > Duration::from_secs(1),
        "the burst never made /metrics late: {slowest:?}"
    );
    let probes = readiness.await.unwrap();
    assert!(
        probes.iter().all(|(status, _)| *status == 200),
        "readiness flapped: {probes:?}"
    );
    let metrics = gateway.picker_metrics().await;
    assert_eq!(
        metric_sum(&metrics, "cachepick_shed_total", &[]),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "cachepick_workers", &[("state", "unreachable")]),
        0.0,
        "{metrics}"
    );
}

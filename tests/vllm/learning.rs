//! What cachepick learns of the real engines: their prefill speed from their own prefill histograms,
//! their KV block from `cache_config_info`, their restarts, and what they cached before it started (the
//! replay of their KV events); and an idle fleet spreads new prefixes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::engines;
use crate::stack::{Index, Stack, selected};
use crate::support::learned::assert_learned_like_measured;
use crate::support::vllm::{self, ENGINE_BLOCK, Engine, Fleet, MODEL, prose, sum_of};

/// The prefill speed an engine measured itself, alone: cold prompts one at a time, its own
/// histograms' computed tokens over prefill seconds.
async fn measured_alone(engine: &Engine, seed: u64) -> f64 {
    let (before, _) = engine.metrics().await;
    for i in 0..4 {
        let body = json!({"model": MODEL, "prompt": prose(seed + i, 1000), "max_tokens": 1});
        vllm::complete_directly(engine.http, &body).await;
    }
    let (after, _) = engine.metrics().await;
    let grown = |name: &str| sum_of(&after, name).unwrap() - sum_of(&before, name).unwrap();
    grown("vllm:request_prefill_kv_computed_tokens_sum")
        / grown("vllm:request_prefill_time_seconds_sum")
}

/// The picker's learned prefill rate of `endpoint`, if any.
fn learned(metrics: &str, endpoint: std::net::SocketAddr) -> Option<f64> {
    let key = format!("worker=\"{endpoint}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with("cachepick_worker_prefill_tokens_per_second{"))
        .find(|line| line.contains(&key))
        .and_then(|line| line.rsplit_once(' ')?.1.parse().ok())
}

/// Within 30 s of traffic the picker learns each engine's prefill speed from the engine's prefill
/// histograms, within 2× of what those histograms say over the same traffic, and the two identical
/// engines within 25% of each other; explain says which signal priced each prediction. (The speed of
/// a prefill alone is printed beside them: under traffic prefills share the engine's steps.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learned_prefill_rate_is_the_engines_prefill_speed() {
    let fleet = Fleet::lock(&engines()).await;
    let alone: Vec<f64> = futures_util::future::join_all(
        fleet
            .engines
            .iter()
            .enumerate()
            .map(|(i, engine)| measured_alone(engine, 7_000 + 10 * i as u64)),
    )
    .await;
    let stack = Stack::start(&fleet, Index::Events, "").await;
    let mut before = Vec::new();
    for engine in &fleet.engines {
        before.push(engine.metrics().await.0);
    }
    // 30 s of traffic, eight at a time: new prompts and repeats, short and long.
    let started = Instant::now();
    let mut sent = 0_u64;
    while started.elapsed() < Duration::from_secs(30) {
        let wave = (0..8).map(|i| {
            let seed = 8_000 + sent + i;
            let words = 300 + 200 * (seed % 5) as usize;
            let body =
                json!({"model": MODEL, "prompt": prose(seed - seed % 3, words), "max_tokens": 8});
            let id = format!("learn-{seed}");
            let gateway = stack.gateway;
            async move { crate::stack::send(gateway, "/v1/completions", &body, &id).await }
        });
        for reply in futures_util::future::join_all(wave).await {
            assert_eq!(reply.status, 200, "{:?}", reply.body);
        }
        sent += 8;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut measured = Vec::new();
    for (engine, before) in fleet.engines.iter().zip(&before) {
        let after = engine.metrics().await.0;
        let grown = |name: &str| sum_of(&after, name).unwrap() - sum_of(before, name).unwrap();
        measured.push(
            grown("vllm:request_prefill_kv_computed_tokens_sum")
                / grown("vllm:request_prefill_time_seconds_sum"),
        );
    }
    let metrics = stack.picker_metrics().await;
    let rates: Vec<f64> = fleet
        .engines
        .iter()
        .map(|engine| {
            learned(&metrics, engine.http)
                .unwrap_or_else(|| panic!("no prefill rate learned for {} after 30 s", engine.http))
        })
        .collect();
    eprintln!(
        "learning: {sent} requests; alone the engines measured {alone:.0?} tokens/s, under the traffic {measured:.0?}, the picker learned {rates:.0?}"
    );
    assert_learned_like_measured(&rates, &measured, "engines");
    // Explain prices the own prefill at the measured rate, and says so.
    let explained = stack
        .explain(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prose(9_999, 800), "max_tokens": 1}),
        )
        .await;
    let predictions = explained["outcome"]["trace"]["predictions"]
        .as_array()
        .unwrap();
    assert_eq!(predictions.len(), 2, "{explained}");
    for prediction in predictions {
        assert_eq!(prediction["rate_source"], "measured", "{explained}");
    }
    for worker in explained["workers"].as_array().unwrap() {
        assert!(
            worker["prefill"]["prefill_tokens_per_second"]
                .as_u64()
                .is_some(),
            "{worker}"
        );
        assert_eq!(
            worker["engine_block"], ENGINE_BLOCK,
            "the engine's block, read from the engine: {worker}"
        );
    }
}

/// On an idle fleet, new prefixes one after another go to both engines, not all to the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_new_prefixes_on_an_idle_fleet_spread() {
    let fleet = Fleet::lock(&engines()).await;
    let stack = Stack::start(&fleet, Index::Events, "").await;
    let mut chosen = BTreeSet::new();
    for i in 0..6 {
        let id = format!("spread-{i}");
        let body = json!({"model": MODEL, "prompt": prose(11_000 + i, 600), "max_tokens": 1});
        let reply = stack.send("/v1/completions", &body, &id).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let entry = stack.access(&id).await;
        assert_eq!(entry["decision"], "cache_miss", "{entry}");
        chosen.insert(selected(&entry).unwrap());
    }
    assert_eq!(chosen.len(), 2, "six new prefixes went to {chosen:?} only");
}

/// A picker started after an engine cached a prompt learns it from the engine's replay socket; an
/// engine that restarts is forgotten at once (its cache is empty) and relearned from its new events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_teaches_what_was_cached_before_and_a_restart_is_forgotten_then_relearned() {
    let mut fleet = Fleet::lock(&engines()).await;
    let prompt = prose(12_000, 1000);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let engine = fleet.engines[1].http;
    vllm::complete_directly(engine, &body).await;
    // Started now: the engine's events of that request were published before it subscribed.
    let stack = Stack::start(&fleet, Index::Events, "").await;
    let owner = |explained: &serde_json::Value| {
        explained["prepared"]["owners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|owner| owner["matched_tokens"].as_u64().unwrap_or(0) >= 1024)
            .map(|owner| explained["endpoints"][owner["worker"].as_u64().unwrap() as usize].clone())
    };
    let explained = wait_for(&stack, &body, |explained| owner(explained).is_some()).await;
    assert_eq!(
        owner(&explained).unwrap(),
        engine.to_string(),
        "{explained}"
    );
    let metrics = stack.picker_metrics().await;
    assert!(
        sum_of(&metrics, "cachepick_kv_events_replays_total").unwrap_or(0.0) >= 1.0,
        "{metrics}"
    );
    assert_eq!(
        sum_of(&metrics, "cachepick_kv_events_decode_errors_total").unwrap_or(0.0),
        0.0
    );

    // Restarted: its cache is empty, and the picker must not send the prompt there for it. The
    // picker sees the new run at its next scrape (a new process start time) or from the new run's
    // events (a sequence that starts over).
    fleet.engines[1].restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let worker = stack.worker(engine).await;
        if worker["restarts"].as_u64().unwrap() >= 1 && worker["fresh"] == true {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restart was not seen: {worker}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let explained = stack.explain("/v1/completions", &body).await;
    assert!(owner(&explained).is_none(), "{explained}");
    assert_eq!(explained["decision"], "cache_miss", "{explained}");
    // Sent again, directly: relearned from the new run's events.
    vllm::complete_directly(engine, &body).await;
    let explained = wait_for(&stack, &body, |explained| owner(explained).is_some()).await;
    assert_eq!(
        owner(&explained).unwrap(),
        engine.to_string(),
        "{explained}"
    );
}

/// Explains `body` until `done` holds (within 90 s: a restart takes about a minute).
async fn wait_for(
    stack: &Stack,
    body: &serde_json::Value,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let explained = stack.explain("/v1/completions", body).await;
        if done(&explained) {
            return explained;
        }
        assert!(Instant::now() < deadline, "never came to pass: {explained}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

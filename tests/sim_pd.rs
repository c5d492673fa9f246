//! The simulator's vLLM NixlConnector, through its real HTTP interface: a prefill leg leases its KV and
//! answers the parameters vLLM answers, a decode leg pulls the KV once and keeps it in its prefix
//! cache, and a pull that cannot happen fails or recomputes as `kv_load_failure_policy` says.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod sim_client;
}

use std::net::SocketAddr;

use http::StatusCode;
use serde_json::{Value, json};

use cachepick_rig::nz;
use cachepick_sim::config::{LoadFailure, TokenizerConfig};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};
use support::sim_client::{Client, Reply};

const MODEL: &str = SimConfig::DEFAULT_MODEL;

async fn fleet(workers: u32, load_failure: LoadFailure) -> Fleet {
    let mut config = SimConfig::new(Engine::Vllm, nz(workers));
    config.tokenizer = TokenizerConfig::Bytes;
    config.params.jitter = 0.0;
    config.params.time_scale = 0.01;
    config.params.pd.load_failure = load_failure;
    Fleet::start(&config).await.expect("the fleet starts")
}

fn addr(fleet: &Fleet, index: usize) -> SocketAddr {
    fleet.worker(index).expect("the worker exists").addr()
}

fn prompt() -> Vec<u32> {
    (0..640).collect()
}

async fn prefill_leg(client: &Client, prefill: SocketAddr) -> Value {
    let body = json!({
        "model": MODEL,
        "prompt": prompt(),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false},
    });
    let reply = client.post(prefill, "/v1/completions", &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.header("x-kv-transfer"), Some("leased"));
    reply.json()["kv_transfer_params"].clone()
}

async fn decode_leg(client: &Client, decode: SocketAddr, params: &Value) -> Reply {
    let body = json!({
        "model": MODEL,
        "prompt": prompt(),
        "max_tokens": 8,
        "kv_transfer_params": params,
    });
    client.post(decode, "/v1/completions", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_leases_its_kv_and_one_decode_leg_pulls_it() {
    let fleet = fleet(2, LoadFailure::Fail).await;
    let (prefill, decode) = (addr(&fleet, 0), addr(&fleet, 1));
    let client = Client::new();

    let params = prefill_leg(&client, prefill).await;
    assert_eq!(params["do_remote_prefill"], json!(true));
    assert_eq!(params["do_remote_decode"], json!(false));
    assert_eq!(params["remote_host"], json!("127.0.0.1"));
    assert_eq!(params["remote_port"], json!(prefill.port()));
    assert_eq!(params["remote_num_tokens"], json!(640));
    assert!(
        params["remote_engine_id"]
            .as_str()
            .unwrap()
            .starts_with(&prefill.to_string())
    );
    assert!(params["remote_request_id"].is_string());
    // 640 tokens in blocks of the simulator's default size.
    assert!(!params["remote_block_ids"].as_array().unwrap().is_empty());

    let reply = decode_leg(&client, decode, &params).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.header("x-kv-transfer"), Some("pulled"));
    assert_eq!(
        reply.header("x-prefilled-by"),
        Some(prefill.to_string().as_str())
    );
    assert_eq!(reply.header("x-kv-pulled-tokens"), Some("640"));
    assert_eq!(reply.header("x-kv-moved-tokens"), Some("640"));
    // The pulled prompt is held, all but the token the decode worker computes itself.
    assert_eq!(reply.usage().cached_tokens, 639);
    assert_eq!(reply.usage().completion_tokens, 8);

    // The lease is handed over once.
    let again = decode_leg(&client, decode, &params).await;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(again.text().contains("no KV lease"), "{}", again.text());

    // The pulled blocks entered the decode worker's prefix cache: an aggregated request for the same
    // prompt finds them, and a second pull moves only what it lacks.
    let plain = client
        .post(
            decode,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt(), "max_tokens": 1}),
        )
        .await;
    assert_eq!(plain.header("x-kv-transfer"), Some("local"));
    assert!(plain.usage().cached_tokens >= 576, "{:?}", plain.usage());
    let params = prefill_leg(&client, prefill).await;
    let reply = decode_leg(&client, decode, &params).await;
    assert_eq!(reply.header("x-kv-transfer"), Some("pulled"));
    let moved: u32 = reply.header("x-kv-moved-tokens").unwrap().parse().unwrap();
    assert!(moved <= 64, "moved {moved} tokens the decode worker held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_from_a_dead_or_restarted_prefill_worker_fails_or_recomputes_by_policy() {
    let fleet = fleet(2, LoadFailure::Fail).await;
    let (prefill, decode) = (addr(&fleet, 0), addr(&fleet, 1));
    let client = Client::new();
    let params = prefill_leg(&client, prefill).await;
    // A restart loses the lease, and the old engine id no longer matches.
    fleet.worker(0).unwrap().restart().await.unwrap();
    let reply = decode_leg(&client, decode, &params).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        reply.text().contains("unknown engine id"),
        "{}",
        reply.text()
    );
    // A dead prefill worker: the handshake is refused at once.
    let params = prefill_leg(&client, prefill).await;
    fleet.worker(0).unwrap().kill().await;
    let reply = decode_leg(&client, decode, &params).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(reply.text().contains("unreachable"), "{}", reply.text());

    let recompute = self::fleet(2, LoadFailure::Recompute).await;
    let (prefill, decode) = (addr(&recompute, 0), addr(&recompute, 1));
    let params = prefill_leg(&client, prefill).await;
    recompute.worker(0).unwrap().kill().await;
    let reply = decode_leg(&client, decode, &params).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.header("x-kv-transfer"), Some("recomputed"));
    assert_eq!(reply.usage().cached_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_leg_without_the_prefill_fields_is_refused() {
    let fleet = fleet(1, LoadFailure::Fail).await;
    let client = Client::new();
    let reply = decode_leg(
        &client,
        addr(&fleet, 0),
        &json!({"do_remote_prefill": true, "remote_engine_id": "e"}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.text().contains("remote_port"), "{}", reply.text());
}

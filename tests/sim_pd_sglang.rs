//! The simulator's SGLang disaggregation, through its real HTTP interface: the roles as `/server_info`
//! reports them, the bootstrap rendezvous joined in either arrival order, SGLang's 400 for a leg
//! without a room, and its `KVTransferError` when the prefill worker is gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod sim_client;
}

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use serde_json::{Value, json};

use cachepick_rig::nz;
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};
use support::sim_client::Client;

const MODEL: &str = SimConfig::DEFAULT_MODEL;

/// Worker 0 prefills, worker 1 decodes.
async fn fleet() -> Fleet {
    let mut config = SimConfig::new(Engine::Sglang, nz(2));
    config.tokenizer = TokenizerConfig::Bytes;
    config.params.jitter = 0.0;
    config.params.time_scale = 0.01;
    config.prefill_workers = Some(1);
    Fleet::start(&config).await.expect("the fleet starts")
}

fn addr(fleet: &Fleet, index: usize) -> SocketAddr {
    fleet.worker(index).expect("the worker exists").addr()
}

fn body(prefill: SocketAddr, room: u64) -> Value {
    json!({
        "model": MODEL,
        "prompt": "a prompt the two legs share ".repeat(40),
        "max_tokens": 8,
        "bootstrap_host": prefill.ip().to_string(),
        "bootstrap_port": prefill.port(),
        "bootstrap_room": room,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_roles_are_reported_as_sglang_reports_them() {
    let fleet = fleet().await;
    let client = Client::new();
    for (index, mode) in [(0, "prefill"), (1, "decode")] {
        let info = client.get(addr(&fleet, index), "/server_info").await.json();
        assert_eq!(info["disaggregation_mode"], mode);
        assert_eq!(
            info["disaggregation_bootstrap_port"],
            addr(&fleet, index).port()
        );
    }
    let written = fleet.cachepick_config();
    assert!(written.contains("pd: {handshake: bootstrap}"), "{written}");
    assert!(written.contains(&format!("bootstrap_port: {}", addr(&fleet, 0).port())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_legs_meet_in_either_order_and_the_decode_worker_pulls_the_prompt() {
    let fleet = fleet().await;
    let client = Client::new();
    let (prefill, decode) = (addr(&fleet, 0), addr(&fleet, 1));
    for (room, decode_first) in [(11_u64, false), (12, true)] {
        let request = body(prefill, room);
        let (prefill_reply, decode_reply) = if decode_first {
            let decoding = {
                let (client, request) = (client.clone(), request.clone());
                tokio::spawn(async move { client.post(decode, "/v1/completions", &request).await })
            };
            // The decode worker waits in the room until the prefill arrives.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let prefilled = client.post(prefill, "/v1/completions", &request).await;
            (prefilled, decoding.await.unwrap())
        } else {
            tokio::join!(
                client.post(prefill, "/v1/completions", &request),
                client.post(decode, "/v1/completions", &request)
            )
        };
        assert_eq!(
            prefill_reply.status,
            StatusCode::OK,
            "{}",
            prefill_reply.text()
        );
        assert_eq!(prefill_reply.header("x-kv-transfer"), Some("leased"));
        assert_eq!(prefill_reply.usage().completion_tokens, 1);
        assert_eq!(
            decode_reply.status,
            StatusCode::OK,
            "{}",
            decode_reply.text()
        );
        assert_eq!(decode_reply.header("x-kv-transfer"), Some("pulled"));
        assert_eq!(
            decode_reply.header("x-prefilled-by"),
            Some(prefill.to_string().as_str())
        );
        assert_eq!(decode_reply.usage().completion_tokens, 8);
        let pulled: u64 = decode_reply
            .header("x-kv-pulled-tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(pulled, prefill_reply.usage().prompt_tokens);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leg_without_a_room_or_with_a_dead_prefill_worker_fails_as_sglang_does() {
    let fleet = fleet().await;
    let client = Client::new();
    let (prefill, decode) = (addr(&fleet, 0), addr(&fleet, 1));
    let mut plain = body(prefill, 1);
    for key in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        plain.as_object_mut().unwrap().remove(key);
    }
    for worker in [prefill, decode] {
        let reply = client.post(worker, "/v1/completions", &plain).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
        assert!(reply.text().contains("bootstrap_room"), "{}", reply.text());
    }
    fleet.worker(0).unwrap().kill().await;
    let reply = client
        .post(decode, "/v1/completions", &body(prefill, 2))
        .await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(reply.text().contains("KVTransferError"), "{}", reply.text());
    assert!(reply.text().contains("might be dead"), "{}", reply.text());
}

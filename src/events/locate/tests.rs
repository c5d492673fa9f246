use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::{LocateError, sglang, socket, vllm};
use crate::config::KvEventEndpoints;

const WORKER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));

fn at(port: u16) -> SocketAddr {
    SocketAddr::new(WORKER, port)
}

#[test]
fn wildcards_and_the_workers_own_ip_are_the_worker_and_other_hosts_are_refused() {
    for taken in [
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://[::]:5557",
        "tcp://10.0.0.7:5557",
        "tcp://[::ffff:10.0.0.7]:5557",
    ] {
        assert_eq!(socket(taken, WORKER), Ok(at(5557)), "{taken}");
    }
    for refused in [
        "tcp://10.0.0.8:5557",
        "tcp://collector.example:5557",
        "tcp://[::1]:5557",
        "ipc:///tmp/kv",
        "inproc://cache",
        "tcp://*:0",
        "tcp://*:65536",
        "tcp://*",
        "",
    ] {
        assert!(
            matches!(socket(refused, WORKER), Err(LocateError::Refused { .. })),
            "{refused}: {:?}",
            socket(refused, WORKER)
        );
    }
    // A worker addressed by its IPv4-mapped form is the same worker.
    let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
    assert_eq!(socket("tcp://10.0.0.7:5557", mapped), Ok(at(5557)));
}

/// vLLM 0.32's answer, as its API server serialises `KVEventsConfig` per rank.
fn vllm_source(endpoint: &str, replay: Option<&str>) -> serde_json::Value {
    serde_json::json!({
        "enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint,
        "replay_endpoint": replay, "buffer_steps": 10000, "hwm": 100000,
        "max_queue_size": 100000, "topic": "kv-events",
    })
}

#[test]
fn vllm_names_each_rank_and_a_rank_it_does_not_name_stays_unnamed() {
    let body = serde_json::json!({
        "0": vllm_source("tcp://*:5557", Some("tcp://*:5558")),
        "1": vllm_source("tcp://10.0.0.7:41234", None),
        "7": vllm_source("tcp://*:6000", None),
    });
    let sockets = vllm(body.to_string().as_bytes(), WORKER, 3).unwrap();
    assert_eq!(
        sockets,
        vec![
            Some(KvEventEndpoints {
                live: at(5557),
                replay: Some(at(5558)),
            }),
            Some(KvEventEndpoints {
                live: at(41234),
                replay: None,
            }),
            None,
        ]
    );
}

#[test]
fn vllm_without_a_publisher_and_bad_answers_say_so() {
    assert_eq!(vllm(b"{}", WORKER, 1), Err(LocateError::NotPublishing));
    let null = serde_json::json!({"0": {"publisher": "null", "endpoint": "tcp://*:5557"}});
    assert_eq!(
        vllm(null.to_string().as_bytes(), WORKER, 1),
        Err(LocateError::NotPublishing)
    );
    for (body, kind) in [
        ("[]", "malformed"),
        ("not json", "malformed"),
        (r#"{"zero": {}}"#, "malformed"),
        (r#"{"0": {"publisher": "zmq"}}"#, "malformed"),
        (
            r#"{"0": {"publisher": "zmq", "endpoint": "tcp://10.9.9.9:5557"}}"#,
            "refused",
        ),
    ] {
        let error = vllm(body.as_bytes(), WORKER, 1).unwrap_err();
        assert_eq!(error.kind(), kind, "{body}: {error}");
        assert!(error.is_answer(), "{body}");
    }
}

#[test]
fn sglang_names_rank_r_at_the_base_port_plus_r() {
    let body = serde_json::json!({
        "model_path": "x", "kv_events_config": "{...}",
        "kv_events": {
            "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "kv",
            "block_size": 64, "dp_size": 2,
            "replay_endpoint_host": "0.0.0.0", "replay_endpoint_port_base": 6557,
        },
    });
    let sockets = sglang(body.to_string().as_bytes(), WORKER, 2).unwrap();
    let rank = |r: u16| {
        Some(KvEventEndpoints {
            live: at(5557 + r),
            replay: Some(at(6557 + r)),
        })
    };
    assert_eq!(sockets, vec![rank(0), rank(1)]);

    let ipv6 = serde_json::json!({"kv_events": {
        "publisher": "zmq", "endpoint_host": "::", "endpoint_port_base": 5557}});
    assert_eq!(
        sglang(ipv6.to_string().as_bytes(), WORKER, 1).unwrap(),
        vec![Some(KvEventEndpoints {
            live: at(5557),
            replay: None
        })]
    );
}

#[test]
fn sglang_without_the_block_with_it_null_or_pointing_away_says_so() {
    assert_eq!(
        sglang(br#"{"model_path": "x"}"#, WORKER, 1),
        Err(LocateError::NotAdvertised)
    );
    assert_eq!(
        sglang(br#"{"kv_events": null}"#, WORKER, 1),
        Err(LocateError::NotPublishing)
    );
    let away = serde_json::json!({"kv_events": {
        "publisher": "zmq", "endpoint_host": "10.0.0.9", "endpoint_port_base": 5557}});
    assert_eq!(
        sglang(away.to_string().as_bytes(), WORKER, 1)
            .unwrap_err()
            .kind(),
        "refused"
    );
    // The last rank's port past 65535 is not a port.
    let high = serde_json::json!({"kv_events": {
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 65535}});
    assert_eq!(
        sglang(high.to_string().as_bytes(), WORKER, 2)
            .unwrap_err()
            .kind(),
        "refused"
    );
}

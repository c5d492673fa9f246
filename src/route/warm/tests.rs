//! A replica that adopts a sibling's snapshot routes the sibling's conversations to their owners as
//! hits, as the sibling would; bytes that are not a whole snapshot are refused without a panic.

use std::sync::Arc;

use super::{Adopted, IndexSnapshot, PoolBlocks, SnapshotError};
use crate::config::Overrides;
use crate::load::PoolLoad;
use crate::metrics::Metrics;
use crate::route::{Answer, Commit, CommitGate, Inbound, Moment, Picker, Routing, Service};

const CONFIG: &str = "\
policy: {min_match_tokens: 4}
pools:
  - model: chat
    engine: vllm
    tokenizer: {kind: bytes}
    workers:
      - endpoint: 127.0.0.1:1
      - endpoint: 127.0.0.1:2
      - endpoint: 127.0.0.1:3
      - endpoint: 127.0.0.1:4
  - model: events
    engine: vllm
    tokenizer: {kind: bytes}
    index: {mode: events}
    workers:
      - endpoint: 127.0.0.1:5
";

fn service(yaml: &str) -> Arc<Service> {
    let config = crate::config::parse(yaml, "t", &Overrides::default()).unwrap();
    let loads = PoolLoad::for_pools(&config);
    let picker = Picker::new(&config, &loads).unwrap();
    Service::new(picker, Arc::new(Metrics::new().unwrap()))
}

fn conversation(turn: usize, who: usize) -> Vec<u8> {
    let content = format!("conversation {who} says hello ").repeat(20 + turn);
    serde_json::to_vec(&serde_json::json!({
        "model": "chat",
        "messages": [{"role": "user", "content": content}],
    }))
    .unwrap()
}

fn route(service: &Service, body: &[u8]) -> Routing {
    let inbound = Inbound {
        method: Some("POST"),
        ..Inbound::new("/v1/chat/completions", Some(body))
    };
    service.route(&inbound, Commit::Live(&CommitGate::open()), Moment::now())
}

fn worker(routing: &Routing) -> std::net::SocketAddr {
    match &routing.answer {
        Answer::Route(routed) => routed.endpoints[0],
        other => panic!("not routed: {other:?}"),
    }
}

#[test]
fn a_replica_that_adopts_a_siblings_snapshot_finds_its_conversations_where_the_sibling_put_them() {
    let sibling = service(CONFIG);
    let owners: Vec<_> = (0..6)
        .map(|who| worker(&route(&sibling, &conversation(0, who))))
        .collect();
    let snapshot = sibling.picker().index_snapshot();
    // The `events` pool takes no part: its engines replay their caches to every replica.
    assert_eq!(snapshot.pools.len(), 1);
    assert!(snapshot.blocks() > 0);

    let cold = service(CONFIG);
    let warm = service(CONFIG);
    let decoded = IndexSnapshot::decode(&snapshot.encode()).unwrap();
    assert_eq!(decoded, snapshot);
    let adopted = warm.picker().adopt(&decoded);
    assert_eq!(
        adopted,
        Adopted {
            workers: snapshot.pools[0].workers.len(),
            blocks: snapshot.blocks(),
            unknown_workers: 0,
            unmatched_pools: 0,
        }
    );
    assert_eq!(warm.picker().index_snapshot(), snapshot);
    for (who, owner) in owners.iter().enumerate() {
        let next = conversation(1, who);
        let routed = route(&warm, &next);
        assert_eq!(routed.label(), "cache_hit", "conversation {who}");
        assert_eq!(worker(&routed), *owner, "conversation {who}");
        // The control: without the snapshot the same turn is a new conversation.
        assert_eq!(
            route(&cold, &next).label(),
            "cache_miss",
            "conversation {who}"
        );
    }
}

#[test]
fn a_snapshot_of_another_shape_adopts_only_what_matches() {
    let sibling = service(CONFIG);
    route(&sibling, &conversation(0, 0));
    let mut snapshot = sibling.picker().index_snapshot();
    let blocks = snapshot.pools[0].workers[0].1.clone();
    snapshot.pools[0]
        .workers
        .push(("127.0.0.1:9".parse().unwrap(), blocks.clone()));
    snapshot.pools.push(PoolBlocks {
        label: "chat".to_owned(),
        block_size: 32,
        workers: vec![("127.0.0.1:1".parse().unwrap(), blocks.clone())],
    });
    snapshot.pools.push(PoolBlocks {
        label: "events".to_owned(),
        block_size: 16,
        workers: vec![("127.0.0.1:5".parse().unwrap(), blocks)],
    });
    let adopted = service(CONFIG).picker().adopt(&snapshot);
    assert_eq!(adopted.workers, 1);
    assert_eq!(adopted.unknown_workers, 1, "a worker this replica has not");
    assert_eq!(
        adopted.unmatched_pools, 2,
        "another block size; an events pool"
    );
}

#[test]
fn bytes_that_are_not_a_whole_snapshot_are_refused() {
    let sibling = service(CONFIG);
    for who in 0..3 {
        route(&sibling, &conversation(0, who));
    }
    let bytes = sibling.picker().index_snapshot().encode();
    for len in 0..bytes.len() {
        assert!(
            IndexSnapshot::decode(&bytes[..len]).is_err(),
            "a snapshot cut at {len} of {}",
            bytes.len()
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(
        IndexSnapshot::decode(&longer),
        Err(SnapshotError::Truncated)
    );
    let mut version = bytes.clone();
    version[4] = 2;
    assert_eq!(IndexSnapshot::decode(&version), Err(SnapshotError::Format));
    // A count of four billion blocks in a few bytes is refused before anything is allocated for it.
    let mut hostile = b"CPIX\x01\x01\x00\x04chat\x10\x00\x00\x00\x01\x00\x00\x00".to_vec();
    hostile.push(11);
    hostile.extend_from_slice(b"127.0.0.1:1");
    hostile.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        IndexSnapshot::decode(&hostile),
        Err(SnapshotError::Truncated)
    );
    let mut name = b"CPIX\x01\x01\x00\x02\xff\xfe".to_vec();
    name.extend_from_slice(&[0; 8]);
    assert_eq!(IndexSnapshot::decode(&name), Err(SnapshotError::Name));
}

//! `replica_sync:` decoded: off without the section, its keys and default, the emitted form, and every
//! problem of a bad section reported at once.

use std::net::SocketAddr;
use std::num::NonZeroU32;

use super::super::*;

const POOL: &str =
    "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";

fn config(head: &str) -> Config {
    super::accepted(&format!("{head}{POOL}"), &Overrides::default())
}

fn messages(head: &str) -> Vec<String> {
    super::messages(&format!("{head}{POOL}"), &Overrides::default())
}

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

#[test]
fn without_the_section_replicas_share_nothing() {
    assert_eq!(config("").replica_sync, None);
}

#[test]
fn the_section_names_where_to_listen_and_every_peer() {
    let sync = config(
        "replica_sync:\n  listen: 0.0.0.0:9104\n  peers: [10.0.0.7:9104, 10.0.0.8:9104]\n  \
                key_file: /etc/cachepick/sync.key\n",
    )
    .replica_sync
    .expect("on");
    assert_eq!(
        sync,
        ReplicaSyncConfig {
            listen: addr("0.0.0.0:9104"),
            peers: vec![
                PeerAddress::Socket(addr("10.0.0.7:9104")),
                PeerAddress::Socket(addr("10.0.0.8:9104"))
            ],
            key_file: Some("/etc/cachepick/sync.key".into()),
            max_datagrams_per_second: NonZeroU32::new(
                ReplicaSyncConfig::DEFAULT_MAX_DATAGRAMS_PER_SECOND
            )
            .unwrap(),
            resolve_interval: ReplicaSyncConfig::DEFAULT_RESOLVE_INTERVAL,
        }
    );
    let budget = config(
        "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [127.0.0.1:9105]\n  \
         max_datagrams_per_second: 500\n",
    );
    assert_eq!(
        budget
            .replica_sync
            .map(|sync| sync.max_datagrams_per_second.get()),
        Some(500)
    );
}

#[test]
fn a_peer_is_an_address_or_a_name_with_a_port() {
    assert_eq!(
        PeerAddress::parse("[fd00::7]:9104"),
        Some(PeerAddress::Socket(addr("[fd00::7]:9104")))
    );
    assert_eq!(
        PeerAddress::parse("cachepick-peers.llm.svc.cluster.local:9104"),
        Some(PeerAddress::Name {
            host: "cachepick-peers.llm.svc.cluster.local".to_owned(),
            port: 9104
        })
    );
    for bad in [
        "cachepick",
        "peer:0",
        "peer:70000",
        ":9104",
        "a..b:1",
        "white space:1",
        "x_y:1",
    ] {
        assert_eq!(PeerAddress::parse(bad), None, "{bad}");
    }
}

#[test]
fn the_emitted_form_reads_back_the_same() {
    let given = config(
        "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [127.0.0.1:9104, cachepick-peers.llm.svc:9104]\n  \
         resolve_interval: 2s\n  key_file: /k\n",
    );
    let yaml = given.to_yaml();
    assert!(yaml.contains("replica_sync:"), "{yaml}");
    let again = parse(&yaml, "emitted", &Overrides::default()).unwrap();
    assert_eq!(again.replica_sync, given.replica_sync);
}

#[test]
fn every_problem_of_the_section_is_listed_at_once() {
    let problems = messages(
        "replica_sync:\n  peers: [10.0.0.7:9104, not an address, 10.0.0.7:9104]\n  \
         max_datagrams_per_second: 0\n  gossip: true\n",
    );
    let expected = [
        "replica_sync.gossip (line 4)",
        "replica_sync.listen",
        "replica_sync.peers[1] (line 2)",
        "replica_sync.peers[2] (line 2)",
        "replica_sync.max_datagrams_per_second (line 3)",
    ];
    for part in expected {
        assert!(
            problems.iter().any(|problem| problem.starts_with(part)),
            "{part} missing from {problems:#?}"
        );
    }
    assert!(
        problems
            .iter()
            .any(|problem| problem.contains("listed twice")),
        "{problems:#?}"
    );
    let empty = messages("replica_sync:\n  listen: 127.0.0.1:9104\n  peers: []\n");
    assert!(
        empty
            .iter()
            .any(|problem| problem.contains("at least one peer address is required")),
        "{empty:#?}"
    );
}

#[test]
fn a_key_is_required_unless_every_address_is_loopback() {
    for head in [
        "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [127.0.0.1:9105, '[::1]:9107']\n",
        "replica_sync:\n  listen: '[::1]:9104'\n  peers: [127.0.0.2:9105]\n",
    ] {
        let sync = config(head).replica_sync.expect("on");
        assert_eq!(sync.key_file, None, "{head}");
    }
    for (head, named) in [
        (
            "replica_sync:\n  listen: 0.0.0.0:9104\n  peers: [127.0.0.1:9105]\n",
            "0.0.0.0:9104 is",
        ),
        (
            "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [127.0.0.1:9105, 10.0.0.7:9104]\n",
            "10.0.0.7:9104 is",
        ),
        (
            "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [localhost:9105]\n",
            "localhost:9105 is",
        ),
        (
            "replica_sync:\n  listen: 127.0.0.1:9104\n  peers: [peers.llm.svc:9104, 10.0.0.8:9104]\n",
            "peers.llm.svc:9104 (and more) is",
        ),
    ] {
        let problems = messages(head);
        assert!(
            problems
                .iter()
                .any(|problem| problem.starts_with("replica_sync (line 1)")
                    && problem.contains("replica_sync.key_file is required")
                    && problem.contains(named)),
            "{head}: {problems:#?}"
        );
    }
}

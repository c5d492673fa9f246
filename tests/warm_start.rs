//! Warm start with the real `cachepick serve` (issue 48 item 5): a replica that starts beside a
//! sibling that has routed for a while adopts the sibling's owner index before it says it is ready,
//! and sends the sibling's conversations to their owners from its first decision; a replica with no
//! sibling to ask (the control) sends the same turns as new conversations. What is not the sibling's
//! key, or not a request at all, gets nothing from it.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod picker;
    pub mod serve;
    pub mod sim_client;
    pub mod sim_fleet;
}

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cachepick_rig::client::{Client, Verdict};
use cachepick_sim::Engine;
use cachepick_sim::fleet::Fleet;
use support::picker::{CHAT, DEADLINE, bounded, chat};
use support::serve::{self, Server};
use support::sim_client::metric;

const KEY: &str = "9c1e5a7b3d2f4e6a8b0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a";
/// Conversations the first replica places before the second starts.
const CONVERSATIONS: usize = 8;

/// A replica: the process, its log lines, its ext_proc, metrics and `replica_sync` addresses.
struct Replica {
    _server: Server,
    lines: mpsc::Receiver<String>,
    listen: SocketAddr,
    metrics: String,
    sync: SocketAddr,
}

/// A peer address where nothing listens: a replica listing only it has no sibling to ask (the sync
/// screens askers by address, so listing 127.0.0.1 admits the others here).
const NOBODY: &str = "127.0.0.1:9";

/// Starts a replica whose `replica_sync` listens on a port the system chooses (its datagrams and
/// its snapshots alike), listing `peers`.
fn start(fleet: &Fleet, dir: &tempfile::TempDir, name: &str, peers: &[SocketAddr]) -> Replica {
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let key_file = dir.path().join("sync.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let peers: Vec<String> = peers.iter().map(ToString::to_string).collect();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let text = format!(
        "replica_sync:\n  listen: {listen}\n  peers: [{}]\n  key_file: {}\n{}",
        peers.join(", "),
        key_file.display(),
        fleet.cachepick_config_at(any, any)
    );
    let path = dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, text).unwrap();
    let (server, lines) = serve::spawn_logged(&mut serve::command(&path, &[], "info"));
    let mut replica = Replica {
        _server: server,
        lines,
        listen: any,
        metrics: String::new(),
        sync: any,
    };
    // The sync logs its own `listen=` first, the listeners theirs in the start line.
    let log = replica.lines_until("cachepick started");
    let field = |wanted: &str, name: &str| {
        let line = log.iter().find(|line| line.contains(wanted)).unwrap();
        let rest = line.split(&format!(" {name}=")).nth(1).unwrap();
        rest.split_whitespace().next().unwrap().to_owned()
    };
    replica.listen = field("cachepick started", "listen").parse().unwrap();
    replica.metrics = field("cachepick started", "metrics_listen");
    replica.sync = field("replica sync on", "listen").parse().unwrap();
    replica
}

impl Replica {
    /// The log lines up to the first that contains `wanted`, which must come within `DEADLINE`.
    fn lines_until(&self, wanted: &str) -> Vec<String> {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("no `{wanted}` in the log: {seen:#?}"));
            let found = line.contains(wanted);
            seen.push(line);
            if found {
                return seen;
            }
        }
    }

    fn metrics(&self) -> String {
        let response = serve::http_get(&self.metrics, "/metrics");
        let (_, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        body.to_owned()
    }

    async fn client(&self) -> Client {
        bounded(
            "the ext_proc client connects",
            DEADLINE,
            Client::connect(self.listen),
        )
        .await
        .expect("the ext_proc client connects")
    }
}

fn turn(who: usize, turn: usize) -> Vec<u8> {
    chat(40 + who as u64, 6_000 + 1_000 * turn)
}

async fn route(client: &Client, body: &[u8]) -> (SocketAddr, String) {
    match bounded("a decision", DEADLINE, client.decide(CHAT, body))
        .await
        .expect("the ext_proc stream works")
    {
        Verdict::Route {
            endpoints, reason, ..
        } => (endpoints[0], reason),
        Verdict::Refuse { status, reason, .. } => panic!("refused {status} {reason}"),
    }
}

fn warm(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        "cachepick_replica_sync_warm_start_total",
        &[("outcome", outcome)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_beside_a_warm_sibling_routes_its_conversations_to_their_owners() {
    let fleet = support::sim_fleet::start(&support::sim_fleet::config(Engine::Vllm, 4)).await;
    let dir = tempfile::tempdir().unwrap();
    let nobody: SocketAddr = NOBODY.parse().unwrap();

    let first = start(&fleet, &dir, "first", &[nobody]);
    // Its only peer is nobody: it asks, finds nobody, and starts cold, then ready.
    let log = first.lines_until("ready:");
    assert!(
        log.iter().any(|line| line.contains("starting cold")),
        "{log:#?}"
    );
    let client = first.client().await;
    let mut owners = Vec::new();
    for who in 0..CONVERSATIONS {
        let (owner, reason) = route(&client, &turn(who, 0)).await;
        assert_eq!(reason, "cache_miss", "conversation {who}'s first turn");
        owners.push(owner);
    }

    // What is not a sibling's request gets nothing, and is counted.
    let mut stranger = std::net::TcpStream::connect(first.sync).unwrap();
    stranger.write_all(&[0u8; 64]).unwrap();
    let mut answer = Vec::new();
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = stranger.read_to_end(&mut answer);
    assert!(answer.is_empty(), "a stranger got {} bytes", answer.len());

    let second = start(&fleet, &dir, "second", &[first.sync]);
    // Warm before ready: the adoption is logged before readiness.
    let log = second.lines_until("ready:");
    assert!(
        log.iter()
            .any(|line| line.contains("adopted the siblings' owner indexes")),
        "{log:#?}"
    );
    let text = second.metrics();
    assert_eq!(warm(&text, "adopted"), 1.0, "{text}");
    assert!(metric(&text, "cachepick_replica_sync_warm_blocks", &[]) > 0.0);
    let served = first.metrics();
    for (outcome, count) in [("answered", 1.0), ("malformed", 1.0)] {
        let counted = metric(
            &served,
            "cachepick_replica_sync_snapshots_served_total",
            &[("outcome", outcome)],
        );
        assert_eq!(counted, count, "{outcome}");
    }

    let client = second.client().await;
    for (who, owner) in owners.iter().enumerate() {
        let (worker, reason) = route(&client, &turn(who, 1)).await;
        assert_eq!(
            (worker, reason.as_str()),
            (*owner, "cache_hit"),
            "conversation {who}'s next turn, from the warm replica"
        );
    }

    // The control: a replica with no sibling to ask routes the same turns as new conversations.
    let alone = start(&fleet, &dir, "alone", &[nobody]);
    alone.lines_until("ready:");
    assert_eq!(warm(&alone.metrics(), "adopted"), 0.0);
    let client = alone.client().await;
    let mut cold = 0;
    for who in 0..CONVERSATIONS {
        let (_, reason) = route(&client, &turn(who, 1)).await;
        cold += usize::from(reason == "cache_miss");
    }
    assert_eq!(cold, CONVERSATIONS, "the cold replica knew a conversation");
}

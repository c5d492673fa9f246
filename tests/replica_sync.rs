//! `replica_sync` against an attacker on the peers' network (issue 48's red team): a picker with a key
//! file, in front of a simulated fleet, listing an idle peer address the attacker sends from. What the
//! attacker can send without the key — the previous release's format, datagrams under a key of its own,
//! genuine ones altered, replayed or sent late — moves no conversation off its prefix owner; the same
//! announcements signed with the key do, so the test would see the attack if it got through.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod picker;
    pub mod sim_client;
    pub mod sim_fleet;
}

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cachepick::load::{Announcement, SyncKeys};
use cachepick_rig::client::{Client, Verdict};
use http::{Method, StatusCode};
use support::picker::{CHAT, DEADLINE, Harness, MODEL, bounded, chat, http};
use support::sim_client::metric;

const KEY: &str = "5f0c3b9a1e7d42c68a0b2f4e6d8c1a3b5f7e9d0c2b4a6f8e1d3c5b7a9f0e2d4c";
const ATTACKER_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
/// What the red team claimed per datagram: 131,072 tokens, about 6.5 s of predicted queue at a real
/// engine's speed.
const CLAIM: u64 = 131_072;
/// Claims of each kind sent before a turn: the simulated fleet prefills about 3M tokens a second (its
/// clock runs 100 times fast), so 24 claims predict a queue of about a second, past the 500 ms
/// `divert_margin`, where the red team's 4 a second sufficed at a real engine's speed.
const COPIES: u64 = 24;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn keys(dir: &std::path::Path, name: &str, secret: &str) -> SyncKeys {
    let path = dir.join(name);
    std::fs::write(&path, secret).unwrap();
    SyncKeys::from_file(&path).unwrap()
}

/// The announcement of `CLAIM` tokens for `worker`, from a sender that is not the picker.
fn claim(worker: SocketAddr, sequence: u64, sent_at_ms: u64) -> Announcement<'static> {
    Announcement {
        origin: 0xa77a_c4e5,
        sequence,
        sent_at_ms,
        pool: MODEL,
        worker,
        uncached_tokens: CLAIM,
        checkpoints: Vec::new(),
    }
}

/// The previous release's datagram (`CPS1`, no MAC), which its receivers took from any listed source.
fn unsigned_v1(worker: SocketAddr) -> Vec<u8> {
    let SocketAddr::V4(v4) = worker else {
        panic!("a loopback IPv4 worker")
    };
    let mut out = b"CPS1".to_vec();
    out.extend_from_slice(&7u64.to_be_bytes());
    out.extend_from_slice(&CLAIM.to_be_bytes());
    out.extend_from_slice(&v4.port().to_be_bytes());
    out.push(4);
    out.extend_from_slice(&v4.ip().octets());
    out.push(MODEL.len() as u8);
    out.extend_from_slice(MODEL.as_bytes());
    out
}

/// Turn `turn` of one conversation: each turn's prompt extends the last one's (from 8 KB, twice
/// `min_match_tokens` of the byte tokenizer).
fn turn(turn: usize) -> Vec<u8> {
    chat(48, 8_000 + 1_000 * turn)
}

/// Routes `body` and has the chosen worker serve it, so that it holds the prompt as Envoy would have
/// made it.
async fn route(client: &Client, body: &[u8]) -> (SocketAddr, String) {
    let (worker, reason) = match bounded("a decision", DEADLINE, client.decide(CHAT, body))
        .await
        .expect("the ext_proc stream works")
    {
        Verdict::Route {
            endpoints, reason, ..
        } => (endpoints[0], reason),
        Verdict::Refuse { status, reason, .. } => panic!("refused {status} {reason}"),
    };
    let json = [("content-type", "application/json")];
    let reply = http(Method::POST, worker, CHAT, &json, body.to_vec()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    (worker, reason)
}

fn received(text: &str, outcome: &str) -> u64 {
    metric(
        text,
        "cachepick_replica_sync_received_total",
        &[("outcome", outcome)],
    ) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_forged_altered_replayed_or_late_move_no_conversation_and_signed_ones_do() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("sync.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let key = keys(dir.path(), "copy", KEY);
    let foreign = keys(dir.path(), "attacker", ATTACKER_KEY);
    // The attacker holds a listed peer address that no replica uses.
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    let listen = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let head = format!(
        "replica_sync:\n  listen: {listen}\n  peers: [{listen}, {}]\n  key_file: {}\n",
        attacker.local_addr().unwrap(),
        key_file.display()
    );
    let harness = Harness::start_default_policy(4, &head).await;
    let client = harness.client().await;
    let (owner, first) = route(&client, &turn(0)).await;
    assert_eq!(first, "cache_miss");

    let mut stayed = 0;
    for at in 1..=6 {
        // A genuine announcement for the owner, taken once; its window is forgotten with the owner's
        // next reading (every 200 ms), and its copies are all the attacker has of it.
        let captured = claim(owner, at, unix_ms()).seal(&key).unwrap();
        attacker.send_to(&captured, listen).unwrap();
        harness
            .wait_metrics("the genuine announcement", |text| {
                received(text, "accepted") == at
            })
            .await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        for copy in 0..COPIES {
            let sequence = 100 * at + copy;
            let mut altered = claim(owner, sequence, unix_ms()).seal(&key).unwrap();
            altered[30] ^= 0x40;
            let forged = [
                unsigned_v1(owner),
                claim(owner, sequence, unix_ms()).seal(&foreign).unwrap(),
                altered,
                claim(owner, sequence, unix_ms() - 60_000)
                    .seal(&key)
                    .unwrap(),
                captured.clone(),
            ];
            for datagram in &forged {
                attacker.send_to(datagram, listen).unwrap();
            }
        }
        let expected = at * (1 + 5 * COPIES);
        harness
            .wait_metrics("the forged datagrams", |text| {
                [
                    "accepted",
                    "malformed",
                    "unauthenticated",
                    "stale",
                    "replayed",
                ]
                .iter()
                .map(|outcome| received(text, outcome))
                .sum::<u64>()
                    == expected
            })
            .await;
        let (worker, reason) = route(&client, &turn(at as usize)).await;
        assert_eq!(worker, owner, "turn {at} went {reason} elsewhere");
        stayed += 1;
    }
    let text = harness.metrics().await;
    let counts: Vec<u64> = [
        "accepted",
        "malformed",
        "unauthenticated",
        "stale",
        "replayed",
    ]
    .iter()
    .map(|outcome| received(&text, outcome))
    .collect();
    let kind = 6 * COPIES;
    assert_eq!(
        counts,
        [6, kind, 2 * kind, kind, kind],
        "accepted, malformed, unauthenticated, stale, replayed"
    );
    assert_eq!(stayed, 6);

    // The control: the same claims signed with the key and fresh, as a peer would send them, are
    // taken and divert the next turn, so what stayed above stayed because the forgeries were refused.
    // A reading of the owner completed between the claims and the decision forgets them (every
    // 200 ms here, so about one try in fifteen); a fresh burst tries again.
    let mut sequence = 10_000;
    let mut diverted = None;
    for _ in 0..3 {
        let accepted = received(&harness.metrics().await, "accepted");
        for _ in 0..COPIES {
            let datagram = claim(owner, sequence, unix_ms()).seal(&key).unwrap();
            attacker.send_to(&datagram, listen).unwrap();
            sequence += 1;
        }
        harness
            .wait_metrics("the signed claims", |text| {
                received(text, "accepted") == accepted + COPIES
            })
            .await;
        let (worker, reason) = route(&client, &turn(7)).await;
        if worker != owner {
            diverted = Some(reason);
            break;
        }
    }
    assert_eq!(diverted.as_deref(), Some("cache_worker_queued"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_on_a_rotated_key_is_heard_once_the_key_file_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("sync.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let next = keys(dir.path(), "next", ATTACKER_KEY);
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    let listen = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let head = format!(
        "replica_sync:\n  listen: {listen}\n  peers: [{}]\n  key_file: {}\n  resolve_interval: 100ms\n",
        peer.local_addr().unwrap(),
        key_file.display()
    );
    let harness = Harness::start(2, &head).await;
    let worker = harness.endpoints()[0];
    let send = |sequence| {
        let datagram = Announcement {
            uncached_tokens: 16,
            ..claim(worker, sequence, unix_ms())
        }
        .seal(&next)
        .unwrap();
        peer.send_to(&datagram, listen).unwrap();
    };
    send(1);
    harness
        .wait_metrics("a datagram on a key not in force", |text| {
            received(text, "unauthenticated") == 1
        })
        .await;
    // The rotation's first step: the next key accepted beside the current one, read within 100 ms.
    std::fs::write(&key_file, format!("{KEY}\n{ATTACKER_KEY}\n")).unwrap();
    harness
        .wait_metrics("the key file read again", |text| {
            metric(
                text,
                "cachepick_replica_sync_key_reloads_total",
                &[("outcome", "applied")],
            ) == 1.0
        })
        .await;
    send(2);
    harness
        .wait_metrics("the rotated peer heard", |text| {
            received(text, "accepted") == 1
        })
        .await;
}

//! The snapshot exchange on real loopback sockets: a sibling on the same key answers; a stranger's
//! key, a replayed or late request, an altered answer and an unlisted address get nothing.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::super::{PeerAddress, SyncStats};
use super::*;

const KEY: &str = "0123456789abcdef0123456789abcdef";
const OTHER_KEY: &str = "fedcba9876543210fedcba9876543210";

fn keys(secret: &str) -> SyncKeys {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    std::fs::write(&path, secret).unwrap();
    SyncKeys::from_file(&path).unwrap()
}

/// A replica on a loopback socket listing `peers`, on `secret`.
fn replica(peers: &[SocketAddr], secret: &str) -> Arc<ReplicaSync> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let listed = peers.iter().copied().map(PeerAddress::Socket).collect();
    Arc::new(ReplicaSync::on(socket, listed, keys(secret), 100).unwrap())
}

/// A sibling serving `body` on a TCP listener, listing a peer on 127.0.0.1; its address.
async fn sibling(body: Vec<u8>, secret: &str, peer_ip: &str) -> (Arc<ReplicaSync>, SocketAddr) {
    let peer: SocketAddr = format!("{peer_ip}:9").parse().unwrap();
    let serving = replica(&[peer], secret);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let source: SnapshotSource = Arc::new(move || body.clone());
    tokio::spawn(Arc::clone(&serving).serve_snapshots(listener, source, std::future::pending()));
    (serving, addr)
}

async fn served(stats: &SyncStats, outcome: Served, count: u64) {
    for _ in 0..500 {
        if stats.served(outcome) == count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{} connections {}, not {count}",
        stats.served(outcome),
        outcome.as_str()
    );
}

/// Sends `request` raw and reads whatever comes back before the sibling closes.
async fn raw(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    answer
}

#[tokio::test]
async fn a_sibling_on_the_same_key_gets_the_snapshot_and_nobody_else_does() {
    let body: Vec<u8> = (0..100_000u32).flat_map(u32::to_le_bytes).collect();
    let (serving, addr) = sibling(body.clone(), KEY, "127.0.0.1").await;
    let stats = serving.stats();

    let asker = replica(&[addr], KEY);
    assert_eq!(asker.ask(addr).await, Ok(body.clone()));
    served(&stats, Served::Answered, 1).await;

    // Another key: the sibling refuses the request, and the asker would refuse its answer.
    let stranger = replica(&[addr], OTHER_KEY);
    assert_eq!(stranger.ask(addr).await, Err(Unanswered::Failed));
    served(&stats, Served::Unauthenticated, 1).await;

    // A captured request, sent again: answered once only.
    let key = keys(KEY);
    let request = seal_request(key.signing(), &[7; NONCE], unix_ms());
    assert!(raw(addr, &request).await.len() > body.len());
    assert!(raw(addr, &request).await.is_empty());
    served(&stats, Served::Replayed, 1).await;

    // Sent a minute ago, or a bit altered, or not whole: nothing.
    let late = seal_request(key.signing(), &[8; NONCE], unix_ms() - 60_000);
    assert!(raw(addr, &late).await.is_empty());
    served(&stats, Served::Stale, 1).await;
    let mut altered = seal_request(key.signing(), &[9; NONCE], unix_ms());
    altered[10] ^= 1;
    assert!(raw(addr, &altered).await.is_empty());
    served(&stats, Served::Unauthenticated, 2).await;
    assert!(raw(addr, &request[..20]).await.is_empty());
    served(&stats, Served::Malformed, 1).await;
}

#[tokio::test]
async fn an_answer_to_another_question_or_altered_on_the_way_is_refused() {
    let key = keys(KEY);
    let body = b"the snapshot".to_vec();
    // A fake sibling that answers every question with one recorded answer: it was to another nonce.
    let recorded = {
        let (head, tag) = seal_answer(key.signing(), &[1; NONCE], &body);
        [head, body.clone(), tag.as_ref().to_vec()].concat()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answers = [recorded.clone(), {
        let mut altered = recorded;
        altered[ANSWER_HEAD] ^= 1;
        altered
    }];
    tokio::spawn(async move {
        for answer in answers {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = [0u8; REQUEST];
            stream.read_exact(&mut request).await.unwrap();
            stream.write_all(&answer).await.unwrap();
        }
    });
    let asker = replica(&[addr], KEY);
    assert_eq!(asker.ask(addr).await, Err(Unanswered::Unauthenticated));
    assert_eq!(asker.ask(addr).await, Err(Unanswered::Unauthenticated));
}

#[tokio::test]
async fn an_address_that_is_not_a_listed_peers_is_closed_unread() {
    let (serving, addr) = sibling(b"x".to_vec(), KEY, "127.0.0.2").await;
    let asker = replica(&[addr], KEY);
    assert_eq!(asker.ask(addr).await, Err(Unanswered::Failed));
    served(&serving.stats(), Served::UnknownSource, 1).await;
    assert_eq!(serving.stats().served(Served::Answered), 0);
}

#[test]
fn a_nonce_is_taken_once_and_the_list_is_bounded() {
    let mut nonces = Nonces::default();
    assert!(nonces.take([1; NONCE], 1_000));
    assert!(!nonces.take([1; NONCE], 2_000));
    // Forgotten once older than `FRESH_WITHIN`: a request that old is stale anyway.
    assert!(nonces.take([1; NONCE], 1_000 + millis(FRESH_WITHIN) + 1));
    for n in 0..NONCES {
        nonces.take((n as u128 + 2).to_le_bytes(), 20_000);
    }
    assert!(!nonces.take([0xee; NONCE], 20_000), "full of fresh nonces");
}

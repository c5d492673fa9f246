//! The sync on real loopback sockets: what gets into a worker's peer window, and what does not.

use super::*;

const KEY: &str = "0123456789abcdef0123456789abcdef";
const OTHER_KEY: &str = "fedcba9876543210fedcba9876543210";

fn keys(secret: &str) -> SyncKeys {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    std::fs::write(&path, secret).unwrap();
    SyncKeys::from_file(&path).unwrap()
}

/// A replica on `socket` whose peers are `peers`, on `KEY`, with `budget` datagrams a second.
fn replica(socket: std::net::UdpSocket, peers: &[SocketAddr], budget: u32) -> Arc<ReplicaSync> {
    let listed = peers.iter().copied().map(PeerAddress::Socket).collect();
    Arc::new(ReplicaSync::on(socket, listed, keys(KEY), budget).unwrap())
}

fn loopback() -> (std::net::UdpSocket, SocketAddr) {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, addr)
}

/// One pool `m` with a worker at 10.0.0.1:8000 (slot 0).
fn pool() -> Arc<PoolLoad> {
    let yaml =
        "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";
    let config = crate::config::parse(yaml, "test.yaml", &crate::config::Overrides::default())
        .expect("valid");
    PoolLoad::for_pools(&config).remove(0)
}

/// A sender and a receiver that list each other, the receiver taking `budget` datagrams a second;
/// the receiver's address and its pool.
fn pair(
    budget: u32,
) -> (
    Arc<ReplicaSync>,
    Arc<ReplicaSync>,
    SocketAddr,
    Arc<PoolLoad>,
) {
    let (a_socket, a) = loopback();
    let (b_socket, b) = loopback();
    let sender = replica(a_socket, &[b], 100);
    let receiver = replica(b_socket, &[a], budget);
    (sender, receiver, b, pool())
}

/// Waits until `stats` counts `total` received datagrams (UDP on loopback delivers, but not at once).
async fn received(stats: &SyncStats, total: u64) {
    let all = || {
        Received::ALL
            .iter()
            .map(|o| stats.received(*o))
            .sum::<u64>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while all() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(all(), total, "datagrams received");
}

/// Runs `receiver`'s receive task over `load` until the returned sender fires.
fn receiving(
    receiver: &Arc<ReplicaSync>,
    load: &Arc<PoolLoad>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(Arc::clone(receiver).receive(
        vec![(Arc::clone(load), 50_000)],
        async move {
            let _ = stopped.await;
        },
    ));
    (stop, task)
}

fn worker() -> SocketAddr {
    "10.0.0.1:8000".parse().unwrap()
}

/// An announcement of 7 tokens for the worker, from `origin`, sent now.
fn from(origin: u64, sequence: u64) -> Announcement<'static> {
    Announcement {
        origin,
        sequence,
        sent_at_ms: unix_ms(),
        pool: "m",
        worker: worker(),
        uncached_tokens: 7,
        checkpoints: Vec::new(),
    }
}

#[tokio::test]
async fn a_peer_s_dispatch_lands_in_the_worker_s_peer_window_and_nothing_else_gets_in() {
    let (a_socket, a) = loopback();
    let (b_socket, b) = loopback();
    let (stranger, _) = loopback();
    let sender = replica(a_socket, &[a, b], 100);
    let receiver = replica(b_socket, &[a, b], 100);
    let load = pool();
    let (stop, task) = receiving(&receiver, &load);
    sender.announce("m", worker(), 1_000, &[]);
    // A peer cannot claim more than one request can bring.
    sender.announce("m", worker(), 1 << 40, &[]);
    sender.announce("m", "10.0.0.9:8000".parse().unwrap(), 1_000, &[]);
    sender.announce("other-pool", worker(), 1_000, &[]);
    let key = keys(KEY);
    let valid = from(9, 1).seal(&key).unwrap();
    stranger.send_to(&valid, b).unwrap();
    sender.socket.send_to(b"CPS1 not really", b).await.unwrap();
    // What an attacker without the key can send from a listed address: forged under another key, or
    // a genuine datagram altered.
    let forged = from(9, 2).seal(&keys(OTHER_KEY)).unwrap();
    sender.socket.send_to(&forged, b).await.unwrap();
    let mut altered = from(9, 3).seal(&key).unwrap();
    altered[40] ^= 0xff;
    sender.socket.send_to(&altered, b).await.unwrap();
    // What it can do with a genuine one it captured: send it again, or later.
    let genuine = from(9, 4).seal(&key).unwrap();
    for _ in 0..3 {
        sender.socket.send_to(&genuine, b).await.unwrap();
    }
    let old = Announcement {
        sent_at_ms: unix_ms() - 60_000,
        ..from(9, 5)
    };
    sender
        .socket
        .send_to(&old.seal(&key).unwrap(), b)
        .await
        .unwrap();
    // The receiver's own origin, even under the key, is its own.
    let own = from(receiver.origin, 1).seal(&key).unwrap();
    sender.socket.send_to(&own, b).await.unwrap();
    let stats = receiver.stats();
    received(&stats, 13).await;
    let counts: Vec<(&str, u64)> = Received::ALL
        .iter()
        .map(|outcome| (outcome.as_str(), stats.received(*outcome)))
        .collect();
    assert_eq!(
        counts,
        [
            ("accepted", 3),
            ("own", 1),
            ("unknown_source", 1),
            ("malformed", 1),
            ("unauthenticated", 2),
            ("stale", 1),
            ("replayed", 2),
            ("unknown_worker", 2),
            ("over_budget", 0),
        ]
    );
    // Each announcement went to the one other listed peer: a replica never sends to itself.
    assert_eq!(sender.stats().sent(), (4, 0));
    let window = load.dispatches().window(crate::worker::WorkerId(0));
    assert_eq!(
        window,
        super::super::Window {
            count: 0,
            tokens: 0,
            peer_count: 3,
            peer_tokens: 51_007,
            mark: 3,
        }
    );
    let _ = stop.send(());
    task.await.unwrap();
}

/// What the pool's index would be told of the peers' guesses.
#[derive(Debug, Default)]
struct Guesses(std::sync::Mutex<Vec<(crate::worker::WorkerId, Vec<u64>)>>);

impl crate::load::PeerGuesses for Guesses {
    fn guess(&self, worker: crate::worker::WorkerId, checkpoints: &[u64], _now: Instant) {
        self.0.lock().unwrap().push((worker, checkpoints.to_vec()));
    }
}

#[tokio::test]
async fn a_peer_s_checkpoints_reach_the_pool_s_guesses() {
    let (sender, receiver, _, load) = pair(100);
    let guesses = Arc::new(Guesses::default());
    load.take_guesses_through(Arc::clone(&guesses) as Arc<dyn crate::load::PeerGuesses>);
    let (stop, task) = receiving(&receiver, &load);
    let checkpoints: Vec<u64> = (1..=22).collect();
    sender.announce("m", worker(), 1_600, &checkpoints);
    // An approximate pool's sender shares no chain: nothing to guess.
    sender.announce("m", worker(), 1_600, &[]);
    received(&receiver.stats(), 2).await;
    assert_eq!(
        *guesses.0.lock().unwrap(),
        [(crate::worker::WorkerId(0), checkpoints)]
    );
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn a_datagram_from_the_replica_s_own_address_is_its_own_whatever_it_says() {
    let (a_socket, a) = loopback();
    let (b_socket, b) = loopback();
    let receiver = replica(b_socket, &[a, b], 100);
    drop(a_socket);
    // What a raw socket faking the receiver's source address delivers: screened by the address
    // before its bytes are read, even with a valid MAC and another origin.
    assert_eq!(receiver.screen(b), Some(Received::Own));
    assert_eq!(receiver.screen(a), None);
    assert_eq!(
        receiver.screen("127.0.0.1:9".parse().unwrap()),
        Some(Received::UnknownSource)
    );
}

#[tokio::test]
async fn a_rotated_key_takes_over_from_the_file_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    std::fs::write(&path, format!("{KEY}\n")).unwrap();
    let (socket, _) = loopback();
    let mut sync =
        ReplicaSync::on(socket, Vec::new(), SyncKeys::from_file(&path).unwrap(), 100).unwrap();
    sync.key_file = Some(path.clone());
    let now = unix_ms();
    let mut seen = Seen::default();
    let mut open = |sync: &ReplicaSync, sealed: &SyncKeys, sequence: u64| {
        let datagram = from(9, sequence).seal(sealed).unwrap();
        sync.open(&datagram, &mut seen, now).map(|_| ()).err()
    };
    let (old, new) = (keys(KEY), keys(OTHER_KEY));
    assert_eq!(open(&sync, &new, 1), Some(Received::Unauthenticated));
    // Step 1: the new key accepted beside the old one.
    std::fs::write(&path, format!("{KEY}\n{OTHER_KEY}\n")).unwrap();
    sync.reload_keys();
    assert_eq!(open(&sync, &old, 2), None);
    assert_eq!(open(&sync, &new, 3), None);
    // Step 2: signing with the new one.
    std::fs::write(&path, format!("{OTHER_KEY}\n{KEY}\n")).unwrap();
    sync.reload_keys();
    assert_eq!(sync.keys.load().signing().id(), new.signing().id());
    // A file broken half-way through an edit keeps the keys in force.
    std::fs::write(&path, "short\n").unwrap();
    sync.reload_keys();
    assert_eq!(open(&sync, &old, 4), None);
    // Step 3: the old key dropped.
    std::fs::write(&path, format!("{OTHER_KEY}\n")).unwrap();
    sync.reload_keys();
    sync.reload_keys();
    assert_eq!(open(&sync, &old, 5), Some(Received::Unauthenticated));
    assert_eq!(open(&sync, &new, 6), None);
    assert_eq!(sync.stats.key_reloads(), (3, 1));
}

#[tokio::test]
async fn a_peer_named_by_dns_is_sent_to_once_the_name_resolves() {
    let (a_socket, a) = loopback();
    let (b_socket, b) = loopback();
    let named = PeerAddress::parse(&format!("localhost:{}", b.port())).unwrap();
    let mut sender = ReplicaSync::on(a_socket, vec![named], keys(KEY), 100).unwrap();
    sender.resolve_interval = Duration::from_millis(50);
    let sender = Arc::new(sender);
    assert!(
        sender.peers.load().is_empty(),
        "nothing before the name resolves"
    );
    let receiver = replica(b_socket, &[a], 100);
    let load = pool();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let resolving = tokio::spawn(Arc::clone(&sender).refresh(until(stopped.clone())));
    let receiving = tokio::spawn(
        Arc::clone(&receiver).receive(vec![(Arc::clone(&load), 50_000)], until(stopped)),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sender.peers.load().contains(&b) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        sender.peers.load().contains(&b),
        "{:?}",
        sender.peers.load()
    );
    sender.announce("m", worker(), 10, &[]);
    received(&receiver.stats(), 1).await;
    assert_eq!(receiver.stats().received(Received::Accepted), 1);
    let _ = stop.send(true);
    resolving.await.unwrap();
    receiving.await.unwrap();
}

#[tokio::test]
async fn datagrams_beyond_the_budget_are_dropped_and_counted() {
    let (sender, receiver, _, load) = pair(2);
    let (stop, task) = receiving(&receiver, &load);
    for _ in 0..5 {
        sender.announce("m", worker(), 10, &[]);
    }
    let stats = receiver.stats();
    received(&stats, 5).await;
    // Five sent within far less than a second: the budget's two are taken, three dropped.
    assert_eq!(stats.received(Received::Accepted), 2);
    assert_eq!(stats.received(Received::OverBudget), 3);
    assert_eq!(
        load.dispatches()
            .window(crate::worker::WorkerId(0))
            .peer_tokens,
        20
    );
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn forgeries_from_a_peer_s_address_leave_the_peers_budget_alone() {
    let (sender, receiver, b, load) = pair(2);
    let (stop, task) = receiving(&receiver, &load);
    // Six forgeries from the peer's own address (as a spoofed source would arrive), then its two
    // genuine announcements: the forgeries are refused within their own budget (four times two).
    let forged = from(9, 1).seal(&keys(OTHER_KEY)).unwrap();
    for _ in 0..6 {
        sender.socket.send_to(&forged, b).await.unwrap();
    }
    sender.announce("m", worker(), 10, &[]);
    sender.announce("m", worker(), 10, &[]);
    // Beyond eight refused in the second, nothing more is opened.
    for _ in 0..4 {
        sender.socket.send_to(&forged, b).await.unwrap();
    }
    let stats = receiver.stats();
    received(&stats, 12).await;
    assert_eq!(stats.received(Received::Unauthenticated), 8);
    assert_eq!(stats.received(Received::Accepted), 2);
    assert_eq!(stats.received(Received::OverBudget), 2);
    let _ = stop.send(());
    task.await.unwrap();
}

#[test]
fn the_budget_admits_its_limit_each_second() {
    let start = Instant::now();
    let mut budget = Budget::new(3);
    let admitted = (0..5).filter(|_| budget.admit(start)).count();
    assert_eq!(admitted, 3);
    assert!(!budget.admit(start + Duration::from_millis(999)));
    assert!(budget.admit(start + Duration::from_secs(1)));
}

//! `replica_sync`: picker replicas announce each dispatch to one another, so that between two scrapes
//! of a worker every replica prices what all of them sent there, not only its own share.
//!
//! Each decision sends one datagram to every peer (a non-blocking send: a full socket buffer drops
//! the announcement and counts it, the request never waits). A receiver adds an announcement to the
//! worker's peer window in its [`DispatchTable`], which the worker's next complete reading requested
//! after it forgets, exactly as the replica's own dispatches are forgotten. What is lost is priced as
//! before: the pool's dispatch share (`share.rs`) measures what neither this replica sent nor its
//! peers announced.
//!
//! A peer is trusted with load estimates only, never with where a request goes: an announcement can
//! raise a worker's predicted queue and nothing else, it is accepted only from a listed peer address,
//! its tokens are clamped to what one request can bring, and datagrams beyond a per-second budget are
//! dropped and counted, so a misbehaving peer costs one bounded task.
//!
//! The datagram, big-endian: `CPS1`, the sender's origin (random per process, so a replica drops its
//! own), the uncached tokens (u64), the worker's port (u16), its address family (4 or 6) and address,
//! the pool label's length (u8) and the label.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio::net::UdpSocket;

use super::pool::{Announce, PoolLoad};
use crate::config::{PeerAddress, ReplicaSyncConfig};

const MAGIC: &[u8; 4] = b"CPS1";
/// The largest datagram: the fixed part, an IPv6 address and a 255-byte label.
const MAX_DATAGRAM: usize = 4 + 8 + 8 + 2 + 1 + 16 + 1 + 255;

/// One replica's announcement of one dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement<'a> {
    pub origin: u64,
    pub pool: &'a str,
    pub worker: SocketAddr,
    pub uncached_tokens: u64,
}

impl Announcement<'_> {
    /// The datagram; `None` when the pool label is longer than 255 bytes.
    pub fn encode(&self) -> Option<Vec<u8>> {
        let label = u8::try_from(self.pool.len()).ok()?;
        let mut out = Vec::with_capacity(MAX_DATAGRAM);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.origin.to_be_bytes());
        out.extend_from_slice(&self.uncached_tokens.to_be_bytes());
        out.extend_from_slice(&self.worker.port().to_be_bytes());
        match self.worker.ip() {
            IpAddr::V4(ip) => {
                out.push(4);
                out.extend_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                out.push(6);
                out.extend_from_slice(&ip.octets());
            }
        }
        out.push(label);
        out.extend_from_slice(self.pool.as_bytes());
        Some(out)
    }

    /// Reads a datagram; `None` for anything that is not exactly one well-formed announcement.
    pub fn decode(datagram: &[u8]) -> Option<Announcement<'_>> {
        let mut rest = datagram.strip_prefix(MAGIC)?;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, tail) = rest.split_at_checked(n)?;
            rest = tail;
            Some(head)
        };
        let origin = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let uncached_tokens = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let port = u16::from_be_bytes(take(2)?.try_into().ok()?);
        let ip = match take(1)? {
            [4] => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(take(4)?).ok()?)),
            [6] => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(take(16)?).ok()?)),
            _ => return None,
        };
        let label = usize::from(*take(1)?.first()?);
        let pool = std::str::from_utf8(take(label)?).ok()?;
        if !rest.is_empty() {
            return None;
        }
        Some(Announcement {
            origin,
            pool,
            worker: SocketAddr::new(ip, port),
            uncached_tokens,
        })
    }
}

/// What became of a received datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// Added to the worker's peer window.
    Accepted,
    /// This replica's own announcement, come back through a peer list that names it.
    Own,
    /// From an address that is not a listed peer.
    UnknownSource,
    /// Not a well-formed announcement.
    Malformed,
    /// A pool or worker this replica does not know (yet, or any more).
    UnknownWorker,
    /// Beyond `max_datagrams_per_second`.
    OverBudget,
}

impl Received {
    pub const ALL: [Received; 6] = [
        Received::Accepted,
        Received::Own,
        Received::UnknownSource,
        Received::Malformed,
        Received::UnknownWorker,
        Received::OverBudget,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Received::Accepted => "accepted",
            Received::Own => "own",
            Received::UnknownSource => "unknown_source",
            Received::Malformed => "malformed",
            Received::UnknownWorker => "unknown_worker",
            Received::OverBudget => "over_budget",
        }
    }
}

/// The sync's counters, read by the metrics at render.
#[derive(Debug, Default)]
pub struct SyncStats {
    sent: AtomicU64,
    send_failed: AtomicU64,
    received: [AtomicU64; Received::ALL.len()],
}

impl SyncStats {
    /// Announcements sent (one per peer), and those the socket refused.
    pub fn sent(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.send_failed.load(Ordering::Relaxed),
        )
    }

    /// Datagrams received with `outcome`.
    pub fn received(&self, outcome: Received) -> u64 {
        Received::ALL
            .iter()
            .position(|o| *o == outcome)
            .and_then(|at| self.received.get(at))
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    fn count(&self, outcome: Received) {
        if let Some(count) = Received::ALL
            .iter()
            .position(|o| *o == outcome)
            .and_then(|at| self.received.get(at))
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// This replica's end of the sync: the socket it sends from and receives on.
#[derive(Debug)]
pub struct ReplicaSync {
    /// Receives; registered with the runtime.
    socket: UdpSocket,
    /// The same socket, for sending from the request path: a plain non-blocking send, with no
    /// readiness the runtime must have observed first.
    sender: std::net::UdpSocket,
    /// The peers as configured: addresses, and names resolved every `resolve_interval`.
    listed: Vec<PeerAddress>,
    resolve_interval: Duration,
    /// The peers' addresses now: the listed ones and what the names last resolved to.
    peers: ArcSwap<Vec<SocketAddr>>,
    origin: u64,
    budget: u32,
    stats: Arc<SyncStats>,
}

impl ReplicaSync {
    /// Binds `config.listen`; sending from the same socket makes each datagram's source the
    /// sender's listed address.
    pub fn bind(config: &ReplicaSyncConfig) -> std::io::Result<Arc<ReplicaSync>> {
        let socket = std::net::UdpSocket::bind(config.listen)?;
        let mut sync = ReplicaSync::on(
            socket,
            config.peers.clone(),
            rand::random(),
            config.max_datagrams_per_second.get(),
        )?;
        sync.resolve_interval = config.resolve_interval;
        Ok(Arc::new(sync))
    }

    /// The sync on a bound `socket`; needs the runtime.
    fn on(
        socket: std::net::UdpSocket,
        listed: Vec<PeerAddress>,
        origin: u64,
        budget: u32,
    ) -> std::io::Result<ReplicaSync> {
        socket.set_nonblocking(true)?;
        let sender = socket.try_clone()?;
        let literal = listed
            .iter()
            .filter_map(|peer| match peer {
                PeerAddress::Socket(address) => Some(*address),
                PeerAddress::Name { .. } => None,
            })
            .collect();
        Ok(ReplicaSync {
            socket: UdpSocket::from_std(socket)?,
            sender,
            listed,
            resolve_interval: ReplicaSyncConfig::DEFAULT_RESOLVE_INTERVAL,
            peers: ArcSwap::from_pointee(literal),
            origin,
            budget,
            stats: Arc::default(),
        })
    }

    /// The bound address (the configured one, with the port the system chose for port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    pub fn stats(&self) -> Arc<SyncStats> {
        Arc::clone(&self.stats)
    }

    /// Receives the peers' announcements into `pools`' dispatch tables until `shutdown` resolves.
    /// `pools` pairs each pool with the most uncached tokens one of its requests can bring.
    pub async fn receive(
        self: Arc<Self>,
        pools: Vec<(Arc<PoolLoad>, u64)>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut buffer = [0u8; MAX_DATAGRAM + 1];
        let mut window = Budget::new(self.budget);
        tokio::pin!(shutdown);
        loop {
            let (len, from) = tokio::select! {
                () = &mut shutdown => return,
                received = self.socket.recv_from(&mut buffer) => match received {
                    Ok(received) => received,
                    // An ICMP error from an earlier send (a peer not up yet) surfaces here on some
                    // systems; the socket stays usable.
                    Err(_) => continue,
                },
            };
            let outcome = if !window.admit(Instant::now()) {
                Received::OverBudget
            } else {
                let datagram = buffer.get(..len).unwrap_or_default();
                self.apply(datagram, from, &pools)
            };
            self.stats.count(outcome);
        }
    }

    /// Resolves the listed names at once, then every `resolve_interval`, until `shutdown` resolves;
    /// a name that fails to resolve keeps its last addresses. Returns at once when no name is listed.
    pub async fn resolve(self: Arc<Self>, shutdown: impl Future<Output = ()>) {
        let names: Vec<(String, u16)> = self
            .listed
            .iter()
            .filter_map(|peer| match peer {
                PeerAddress::Name { host, port } => Some((host.clone(), *port)),
                PeerAddress::Socket(_) => None,
            })
            .collect();
        if names.is_empty() {
            return;
        }
        let mut last: Vec<Vec<SocketAddr>> = vec![Vec::new(); names.len()];
        let mut ticker = tokio::time::interval(self.resolve_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timeout = self.resolve_interval.min(Duration::from_secs(5));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = ticker.tick() => {}
            }
            for ((host, port), addresses) in names.iter().zip(&mut last) {
                let lookup = tokio::net::lookup_host((host.as_str(), *port));
                let resolved = tokio::select! {
                    () = &mut shutdown => return,
                    resolved = tokio::time::timeout(timeout, lookup) => resolved,
                };
                match resolved {
                    Ok(Ok(found)) => {
                        let mut found: Vec<SocketAddr> = found.collect();
                        found.sort_unstable();
                        found.dedup();
                        *addresses = found;
                    }
                    Ok(Err(error)) => {
                        tracing::debug!(%error, name = %host, "replica sync: keeping the peer's last addresses");
                    }
                    Err(_) => {
                        tracing::debug!(name = %host, "replica sync: resolving the peer timed out");
                    }
                }
            }
            let mut peers: Vec<SocketAddr> = self
                .listed
                .iter()
                .filter_map(|peer| match peer {
                    PeerAddress::Socket(address) => Some(*address),
                    PeerAddress::Name { .. } => None,
                })
                .chain(last.iter().flatten().copied())
                .collect();
            peers.sort_unstable();
            peers.dedup();
            if **self.peers.load() != peers {
                tracing::info!(peers = peers.len(), "replica sync: the peers changed");
                self.peers.store(Arc::new(peers));
            }
        }
    }

    fn apply(&self, datagram: &[u8], from: SocketAddr, pools: &[(Arc<PoolLoad>, u64)]) -> Received {
        if !self.peers.load().contains(&from) {
            return Received::UnknownSource;
        }
        let Some(announcement) = Announcement::decode(datagram) else {
            return Received::Malformed;
        };
        if announcement.origin == self.origin {
            return Received::Own;
        }
        take_announcement(&announcement, pools)
    }
}

/// A peer's announcement, already authenticated as a peer's and not this replica's own, added to its
/// worker's peer window with its tokens clamped to the pool's `max_model_len` (`pools` pairs each pool
/// with it). The receive task's last step; a replay in virtual time delivers announcements here.
pub fn take_announcement(
    announcement: &Announcement<'_>,
    pools: &[(Arc<PoolLoad>, u64)],
) -> Received {
    let Some((load, most)) = pools
        .iter()
        .find(|(load, _)| load.label() == announcement.pool)
    else {
        return Received::UnknownWorker;
    };
    let snapshot = load.snapshot();
    let Some(worker) = snapshot
        .workers()
        .iter()
        .find(|worker| worker.endpoint == announcement.worker)
    else {
        return Received::UnknownWorker;
    };
    load.dispatches()
        .record_peer(worker.id, announcement.uncached_tokens.min(*most));
    Received::Accepted
}

impl Announce for ReplicaSync {
    /// Tells every peer that this replica sent `uncached_tokens` to `worker` of `pool`. Never blocks.
    fn announce(&self, pool: &str, worker: SocketAddr, uncached_tokens: u64) {
        let announcement = Announcement {
            origin: self.origin,
            pool,
            worker,
            uncached_tokens,
        };
        let Some(datagram) = announcement.encode() else {
            return;
        };
        for peer in self.peers.load().iter() {
            let counter = match self.sender.send_to(&datagram, *peer) {
                Ok(_) => &self.stats.sent,
                Err(_) => &self.stats.send_failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// At most `limit` datagrams per second, counted in whole seconds.
struct Budget {
    limit: u32,
    started: Option<Instant>,
    used: u32,
}

impl Budget {
    fn new(limit: u32) -> Budget {
        Budget {
            limit,
            started: None,
            used: 0,
        }
    }

    fn admit(&mut self, now: Instant) -> bool {
        if self
            .started
            .is_none_or(|started| now.saturating_duration_since(started) >= Duration::from_secs(1))
        {
            self.started = Some(now);
            self.used = 0;
        }
        if self.used >= self.limit {
            return false;
        }
        self.used += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announcement(pool: &str, worker: &str) -> Announcement<'static> {
        Announcement {
            origin: 7,
            pool: Box::leak(pool.to_owned().into_boxed_str()),
            worker: worker.parse().unwrap(),
            uncached_tokens: 40_960,
        }
    }

    #[test]
    fn an_announcement_survives_the_wire_for_both_families() {
        for worker in ["10.1.2.3:8000", "[fd00::17]:8000"] {
            let sent = announcement("llama-3.1-8b", worker);
            let datagram = sent.encode().unwrap();
            assert!(datagram.len() <= MAX_DATAGRAM);
            assert_eq!(Announcement::decode(&datagram), Some(sent));
        }
    }

    #[test]
    fn anything_but_one_whole_announcement_is_refused() {
        let datagram = announcement("m", "10.0.0.1:80").encode().unwrap();
        for cut in 0..datagram.len() {
            assert_eq!(Announcement::decode(&datagram[..cut]), None, "cut at {cut}");
        }
        let mut long = datagram.clone();
        long.push(0);
        assert_eq!(Announcement::decode(&long), None);
        let mut family = datagram.clone();
        family[22] = 5;
        assert_eq!(Announcement::decode(&family), None);
        let mut magic = datagram;
        magic[0] = b'X';
        assert_eq!(Announcement::decode(&magic), None);
        let too_long = "x".repeat(256);
        assert_eq!(announcement(&too_long, "10.0.0.1:80").encode(), None);
    }

    /// A replica on `socket` whose peers are `peers`, with `budget` datagrams a second.
    fn replica(
        socket: std::net::UdpSocket,
        peers: &[SocketAddr],
        origin: u64,
        budget: u32,
    ) -> Arc<ReplicaSync> {
        let listed = peers.iter().copied().map(PeerAddress::Socket).collect();
        Arc::new(ReplicaSync::on(socket, listed, origin, budget).unwrap())
    }

    async fn loopback() -> (std::net::UdpSocket, SocketAddr) {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        (socket, addr)
    }

    /// One pool `m` with a worker at 10.0.0.1:8000 (slot 0).
    fn pool() -> Arc<PoolLoad> {
        let yaml = "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";
        let config = crate::config::parse(yaml, "test.yaml", &crate::config::Overrides::default())
            .expect("valid");
        PoolLoad::for_pools(&config).remove(0)
    }

    /// Waits until `stats` counts `total` received datagrams (UDP on loopback delivers, but not at
    /// once).
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

    #[tokio::test]
    async fn a_peer_s_dispatch_lands_in_the_worker_s_peer_window_and_nothing_else_gets_in() {
        let (a_socket, a) = loopback().await;
        let (b_socket, b) = loopback().await;
        let (stranger, _) = loopback().await;
        let sender = replica(a_socket, &[a, b], 1, 100);
        let receiver = replica(b_socket, &[a, b], 2, 100);
        let load = pool();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(Arc::clone(&receiver).receive(
            vec![(Arc::clone(&load), 50_000)],
            async move {
                let _ = stopped.await;
            },
        ));
        let worker: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        sender.announce("m", worker, 1_000);
        // A peer cannot claim more than one request can bring.
        sender.announce("m", worker, 1 << 40);
        sender.announce("m", "10.0.0.9:8000".parse().unwrap(), 1_000);
        sender.announce("other-pool", worker, 1_000);
        let valid = Announcement {
            origin: 9,
            pool: "m",
            worker,
            uncached_tokens: 7,
        }
        .encode()
        .unwrap();
        stranger.send_to(&valid, b).unwrap();
        sender.socket.send_to(b"CPS1 not really", b).await.unwrap();
        let own = Announcement {
            origin: 2,
            ..valid_announcement(worker)
        }
        .encode()
        .unwrap();
        sender.socket.send_to(&own, b).await.unwrap();
        let stats = receiver.stats();
        received(&stats, 7).await;
        assert_eq!(stats.received(Received::Accepted), 2);
        assert_eq!(stats.received(Received::UnknownWorker), 2);
        assert_eq!(stats.received(Received::UnknownSource), 1);
        assert_eq!(stats.received(Received::Malformed), 1);
        assert_eq!(stats.received(Received::Own), 1);
        // Each announcement went to both listed peers, the sender itself included.
        assert_eq!(sender.stats().sent(), (8, 0));
        let window = load.dispatches().window(crate::worker::WorkerId(0));
        assert_eq!(
            window,
            super::super::Window {
                count: 0,
                tokens: 0,
                peer_count: 2,
                peer_tokens: 51_000,
                mark: 2,
            }
        );
        let metrics = crate::metrics::Metrics::new().unwrap();
        metrics.watch_replica_sync(stats);
        let text = metrics.render();
        assert!(
            text.contains("cachepick_replica_sync_received_total{outcome=\"accepted\"} 2"),
            "{text}"
        );
        let _ = stop.send(());
        task.await.unwrap();
    }

    fn valid_announcement(worker: SocketAddr) -> Announcement<'static> {
        Announcement {
            origin: 9,
            pool: "m",
            worker,
            uncached_tokens: 7,
        }
    }

    #[tokio::test]
    async fn a_peer_named_by_dns_is_sent_to_once_the_name_resolves() {
        let (a_socket, a) = loopback().await;
        let (b_socket, b) = loopback().await;
        let named = PeerAddress::parse(&format!("localhost:{}", b.port())).unwrap();
        let mut sender = ReplicaSync::on(a_socket, vec![named], 1, 100).unwrap();
        sender.resolve_interval = Duration::from_millis(50);
        let sender = Arc::new(sender);
        assert!(
            sender.peers.load().is_empty(),
            "nothing before the name resolves"
        );
        let receiver = replica(b_socket, &[a], 2, 100);
        let load = pool();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let until = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        };
        let resolving = tokio::spawn(Arc::clone(&sender).resolve(until(stopped.clone())));
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
        sender.announce("m", "10.0.0.1:8000".parse().unwrap(), 10);
        received(&receiver.stats(), 1).await;
        assert_eq!(receiver.stats().received(Received::Accepted), 1);
        let _ = stop.send(true);
        resolving.await.unwrap();
        receiving.await.unwrap();
    }

    #[tokio::test]
    async fn datagrams_beyond_the_budget_are_dropped_and_counted() {
        let (a_socket, a) = loopback().await;
        let (b_socket, b) = loopback().await;
        let sender = replica(a_socket, &[b], 1, 100);
        let receiver = replica(b_socket, &[a], 2, 2);
        let load = pool();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(Arc::clone(&receiver).receive(
            vec![(Arc::clone(&load), 50_000)],
            async move {
                let _ = stopped.await;
            },
        ));
        for _ in 0..5 {
            sender.announce("m", "10.0.0.1:8000".parse().unwrap(), 10);
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

    #[test]
    fn the_budget_admits_its_limit_each_second() {
        let start = Instant::now();
        let mut budget = Budget::new(3);
        let admitted = (0..5).filter(|_| budget.admit(start)).count();
        assert_eq!(admitted, 3);
        assert!(!budget.admit(start + Duration::from_millis(999)));
        assert!(budget.admit(start + Duration::from_secs(1)));
    }
}

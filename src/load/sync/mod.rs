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
//! The datagram (`wire.rs`) carries a MAC under the shared key (`keys.rs`, rotated by editing the key
//! file), its sender's sequence number and send time (`fresh.rs`: each is taken once, within 10 s), so
//! a forged, altered or replayed datagram raises nothing. This replica's own datagrams are known by
//! what it holds, not by what a datagram says: it sends none to its own address, drops any that
//! arrives from it, and knows its origin as a random number only its datagrams carry under the key.

mod fresh;
mod keys;
mod warm;
mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use tokio::net::UdpSocket;

pub use fresh::FRESH_WITHIN;
use fresh::{Seen, Unfresh};
pub use keys::{KeyError, MIN_KEY_BYTES, SyncKeys};
pub use warm::{
    ASK_EACH_WITHIN, MAX_SNAPSHOT_BYTES, Served, SnapshotSource, Unanswered, WARM_WITHIN, Warmed,
};
use wire::MAX_DATAGRAM;
pub use wire::{Announcement, MAX_CHECKPOINTS, Unopened};

use super::pool::{Announce, PoolLoad};
use crate::config::{PeerAddress, ReplicaSyncConfig};

/// What became of a received datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// Added to the worker's peer window.
    Accepted,
    /// This replica's own: from the address it is bound to (when not a wildcard), or carrying its
    /// origin under the key.
    Own,
    /// From an address that is not a listed peer.
    UnknownSource,
    /// Not a datagram of this format (an older release's, or noise).
    Malformed,
    /// Signed with no key this replica holds, or its MAC does not match: forged, altered, or from a
    /// peer on another key.
    Unauthenticated,
    /// Sent further than `FRESH_WITHIN` from this replica's clock, or before this process started.
    Stale,
    /// Its sender's sequence number was taken already.
    Replayed,
    /// A pool or worker this replica does not know (yet, or any more).
    UnknownWorker,
    /// Beyond `max_datagrams_per_second` (taken), or four times that (refused), or from a new sender
    /// while a thousand others are remembered.
    OverBudget,
}

impl Received {
    pub const ALL: [Received; 9] = [
        Received::Accepted,
        Received::Own,
        Received::UnknownSource,
        Received::Malformed,
        Received::Unauthenticated,
        Received::Stale,
        Received::Replayed,
        Received::UnknownWorker,
        Received::OverBudget,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Received::Accepted => "accepted",
            Received::Own => "own",
            Received::UnknownSource => "unknown_source",
            Received::Malformed => "malformed",
            Received::Unauthenticated => "unauthenticated",
            Received::Stale => "stale",
            Received::Replayed => "replayed",
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
    /// Key file reads that changed the keys, and those that failed (the last keys stay).
    keys_applied: AtomicU64,
    keys_failed: AtomicU64,
    /// Snapshot connections by [`Served`] outcome, and this replica's own warm start by [`Warmed`].
    served: [AtomicU64; Served::ALL.len()],
    warmed: [AtomicU64; Warmed::ALL.len()],
    /// The blocks this replica's indexes held after its warm start adopted a sibling's.
    warm_blocks: AtomicU64,
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
        self.slot(outcome)
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    /// Key file changes applied, and reads of it that failed.
    pub fn key_reloads(&self) -> (u64, u64) {
        (
            self.keys_applied.load(Ordering::Relaxed),
            self.keys_failed.load(Ordering::Relaxed),
        )
    }

    /// Snapshot connections to this replica that ended with `outcome`.
    pub fn served(&self, outcome: Served) -> u64 {
        position(&Served::ALL, outcome)
            .and_then(|at| self.served.get(at))
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    pub(super) fn count_served(&self, outcome: Served) {
        if let Some(count) = position(&Served::ALL, outcome).and_then(|at| self.served.get(at)) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Siblings asked at this replica's start whose answer ended with `outcome`.
    pub fn warmed(&self, outcome: Warmed) -> u64 {
        position(&Warmed::ALL, outcome)
            .and_then(|at| self.warmed.get(at))
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    /// Counts one sibling asked at start.
    pub fn count_warmed(&self, outcome: Warmed) {
        if let Some(count) = position(&Warmed::ALL, outcome).and_then(|at| self.warmed.get(at)) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The blocks the indexes held after adopting a sibling's snapshot (0 until one is adopted).
    pub fn warm_blocks(&self) -> u64 {
        self.warm_blocks.load(Ordering::Relaxed)
    }

    pub fn set_warm_blocks(&self, blocks: u64) {
        self.warm_blocks.store(blocks, Ordering::Relaxed);
    }

    fn slot(&self, outcome: Received) -> Option<&AtomicU64> {
        Received::ALL
            .iter()
            .position(|o| *o == outcome)
            .and_then(|at| self.received.get(at))
    }

    fn count(&self, outcome: Received) {
        if let Some(count) = self.slot(outcome) {
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
    /// The bound address: nothing from it is a peer's, and nothing is sent to it. A wildcard (`0.0.0.0`)
    /// matches no address; the replica's own datagrams are then known by their origin.
    local: SocketAddr,
    /// The peers as configured: addresses, and names resolved every `resolve_interval`.
    listed: Vec<PeerAddress>,
    resolve_interval: Duration,
    /// The peers' addresses now: the listed ones and what the names last resolved to.
    peers: ArcSwap<Vec<SocketAddr>>,
    /// This process's origin, random at start; only its own datagrams carry it under the key.
    origin: u64,
    /// The last sequence number sent.
    sequence: AtomicU64,
    /// The keys in force, and the file they are read again from (none between loopback peers).
    keys: ArcSwap<SyncKeys>,
    key_file: Option<PathBuf>,
    budget: u32,
    stats: Arc<SyncStats>,
    /// When the socket was bound, in ms since the Unix epoch.
    bound_ms: u64,
}

impl ReplicaSync {
    /// Binds `config.listen` with `keys` (read from `config.key_file` by start-up's checks); sending
    /// from the same socket makes each datagram's source the sender's listed address.
    ///
    /// Returns with it the TCP listener on the same address and port, where the siblings' warm-start
    /// requests are answered (`warm.rs`): a port the system chooses (port 0) is chosen for both, a few
    /// tries at most, since another process may hold the TCP port of the datagrams' free one.
    pub fn bind(
        config: &ReplicaSyncConfig,
        keys: SyncKeys,
    ) -> std::io::Result<(Arc<ReplicaSync>, std::net::TcpListener)> {
        let (socket, listener) = bind_pair(config.listen)?;
        let mut sync = ReplicaSync::on(
            socket,
            config.peers.clone(),
            keys,
            config.max_datagrams_per_second.get(),
        )?;
        sync.resolve_interval = config.resolve_interval;
        sync.key_file.clone_from(&config.key_file);
        Ok((Arc::new(sync), listener))
    }

    /// The sync on a bound `socket`; needs the runtime.
    fn on(
        socket: std::net::UdpSocket,
        listed: Vec<PeerAddress>,
        keys: SyncKeys,
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
            local: socket.local_addr()?,
            socket: UdpSocket::from_std(socket)?,
            sender,
            listed,
            resolve_interval: ReplicaSyncConfig::DEFAULT_RESOLVE_INTERVAL,
            peers: ArcSwap::from_pointee(literal),
            origin: rand::random(),
            sequence: AtomicU64::new(0),
            keys: ArcSwap::from_pointee(keys),
            key_file: None,
            budget,
            stats: Arc::default(),
            bound_ms: unix_ms(),
        })
    }

    /// The bound address (the configured one, with the port the system chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
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
        // Refused datagrams get a budget of their own, so forgeries from a spoofed peer address do
        // not use up the peers' (an attacker needs four times the budget in forgeries a second to
        // silence them), and the MACs a flood costs stay bounded.
        let mut taken = Budget::new(self.budget);
        let mut refused = Budget::new(self.budget.saturating_mul(REFUSED_PER_TAKEN));
        // Nothing sent before this replica bound its socket is taken: its predecessor may have.
        let mut seen = Seen::since(self.bound_ms);
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
            // A dual-stack socket reports IPv4 peers as IPv4-mapped IPv6 addresses.
            let from = SocketAddr::new(from.ip().to_canonical(), from.port());
            let outcome = self.screen(from).unwrap_or_else(|| {
                let now = Instant::now();
                if refused.spent(now) {
                    return Received::OverBudget;
                }
                let datagram = buffer.get(..len).unwrap_or_default();
                match self.open(datagram, &mut seen, unix_ms()) {
                    Ok(announcement) if taken.admit(now) => {
                        // A guess counts from when the peer made it, not from when it arrived.
                        let age = Duration::from_millis(
                            unix_ms().saturating_sub(announcement.sent_at_ms),
                        )
                        .min(FRESH_WITHIN);
                        let sent = now.checked_sub(age).unwrap_or(now);
                        take_announcement(&announcement, &pools, sent)
                    }
                    Ok(_) => Received::OverBudget,
                    Err(outcome) => {
                        refused.admit(now);
                        outcome
                    }
                }
            });
            self.stats.count(outcome);
        }
    }

    /// Resolves the listed names and reads the key file again, at once and then every
    /// `resolve_interval`, until `shutdown` resolves. A name that fails to resolve keeps its last
    /// addresses; a key file that cannot be read or holds no valid key keeps the last keys. Returns
    /// at once when there is neither a name nor a key file.
    pub async fn refresh(self: Arc<Self>, shutdown: impl Future<Output = ()>) {
        let mut names = Names::new(&self.listed);
        if names.is_empty() && self.key_file.is_none() {
            return;
        }
        let mut ticker = tokio::time::interval(self.resolve_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timeout = self.resolve_interval.min(Duration::from_secs(5));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = ticker.tick() => {}
            }
            self.reload_keys();
            if names.is_empty() {
                continue;
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = names.resolve(timeout) => {}
            }
            let peers = names.with(&self.listed);
            if **self.peers.load() != peers {
                tracing::info!(peers = peers.len(), "replica sync: the peers changed");
                self.peers.store(Arc::new(peers));
            }
        }
    }

    /// Reads the key file again; a changed file's keys take over, a bad one leaves the last in force.
    fn reload_keys(&self) {
        let Some(path) = &self.key_file else {
            return;
        };
        match self.keys.load().reread(path) {
            Ok(None) => {}
            Ok(Some(keys)) => {
                tracing::info!(
                    keys = keys.count(),
                    "replica sync: the key file changed; its keys are in force"
                );
                self.keys.store(Arc::new(keys));
                self.stats.keys_applied.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => {
                tracing::warn!(%error, "replica sync: keeping the last keys");
                self.stats.keys_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// What the source address alone decides: a datagram from this replica's own address is its own
    /// whatever it says, one from an unlisted address is no peer's.
    fn screen(&self, from: SocketAddr) -> Option<Received> {
        if from == self.local {
            return Some(Received::Own);
        }
        (!self.peers.load().contains(&from)).then_some(Received::UnknownSource)
    }

    /// The announcement `datagram` carries, if its MAC holds under a key in force, it is not this
    /// replica's own, and it is fresh at `now_ms` and not taken before.
    fn open<'d>(
        &self,
        datagram: &'d [u8],
        seen: &mut Seen,
        now_ms: u64,
    ) -> Result<Announcement<'d>, Received> {
        let announcement =
            Announcement::open(datagram, &self.keys.load()).map_err(|unopened| match unopened {
                Unopened::Malformed => Received::Malformed,
                Unopened::Unauthenticated => Received::Unauthenticated,
            })?;
        if announcement.origin == self.origin {
            return Err(Received::Own);
        }
        seen.take(
            announcement.origin,
            announcement.sequence,
            announcement.sent_at_ms,
            now_ms,
        )
        .map_err(|unfresh| match unfresh {
            Unfresh::Stale => Received::Stale,
            Unfresh::Replayed => Received::Replayed,
            Unfresh::TooManySenders => Received::OverBudget,
        })?;
        Ok(announcement)
    }
}

/// The listed peers' names and what each last resolved to.
struct Names {
    names: Vec<(String, u16)>,
    last: Vec<Vec<SocketAddr>>,
}

impl Names {
    fn new(listed: &[PeerAddress]) -> Names {
        let names: Vec<(String, u16)> = listed
            .iter()
            .filter_map(|peer| match peer {
                PeerAddress::Name { host, port } => Some((host.clone(), *port)),
                PeerAddress::Socket(_) => None,
            })
            .collect();
        let last = vec![Vec::new(); names.len()];
        Names { names, last }
    }

    fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Resolves every name, each within `timeout`.
    async fn resolve(&mut self, timeout: Duration) {
        for ((host, port), addresses) in self.names.iter().zip(&mut self.last) {
            let lookup = tokio::net::lookup_host((host.as_str(), *port));
            match tokio::time::timeout(timeout, lookup).await {
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
    }

    /// The listed addresses and what the names last resolved to, sorted, once each.
    fn with(&self, listed: &[PeerAddress]) -> Vec<SocketAddr> {
        let mut peers: Vec<SocketAddr> = listed
            .iter()
            .filter_map(|peer| match peer {
                PeerAddress::Socket(address) => Some(*address),
                PeerAddress::Name { .. } => None,
            })
            .chain(self.last.iter().flatten().copied())
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }
}

/// Now by the wall clock, in milliseconds since the Unix epoch: the time datagrams carry.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// A peer's announcement, already authenticated as a peer's and not this replica's own, added to its
/// worker's peer window with its tokens clamped to the pool's `max_model_len` (`pools` pairs each pool
/// with it), and its checkpoints to the pool's guesses of where prefixes are (made at `sent`, on this
/// replica's clock). The receive task's last step; a replay in virtual time delivers announcements
/// here.
pub fn take_announcement(
    announcement: &Announcement<'_>,
    pools: &[(Arc<PoolLoad>, u64)],
    sent: Instant,
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
    load.peer_guess(worker.id, &announcement.checkpoints, sent);
    Received::Accepted
}

impl Announce for ReplicaSync {
    /// Tells every peer that this replica sent `uncached_tokens` to `worker` of `pool`, and the
    /// prompt's chain at the checkpoint depths. Never blocks.
    fn announce(&self, pool: &str, worker: SocketAddr, uncached_tokens: u64, checkpoints: &[u64]) {
        let announcement = Announcement {
            origin: self.origin,
            sequence: self.sequence.fetch_add(1, Ordering::Relaxed) + 1,
            sent_at_ms: unix_ms(),
            pool,
            worker,
            uncached_tokens,
            checkpoints: checkpoints.to_vec(),
        };
        let Some(datagram) = announcement.seal(&self.keys.load()) else {
            return;
        };
        for peer in self.peers.load().iter().filter(|peer| **peer != self.local) {
            let counter = match self.sender.send_to(&datagram, *peer) {
                Ok(_) => &self.stats.sent,
                Err(_) => &self.stats.send_failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A UDP socket and a TCP listener on `listen`, on the same port.
fn bind_pair(listen: SocketAddr) -> std::io::Result<(std::net::UdpSocket, std::net::TcpListener)> {
    const TRIES: usize = 8;
    let mut last = None;
    for _ in 0..TRIES {
        let socket = std::net::UdpSocket::bind(listen)?;
        match std::net::TcpListener::bind(socket.local_addr()?) {
            Ok(listener) => return Ok((socket, listener)),
            // A fixed port is the operator's: its TCP half taken is an error to report.
            Err(error) if listen.port() != 0 => return Err(error),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no port free for both UDP and TCP")))
}

fn position<T: PartialEq>(all: &[T], outcome: T) -> Option<usize> {
    all.iter().position(|each| *each == outcome)
}

/// Refused datagrams opened per second, per datagram the budget takes.
const REFUSED_PER_TAKEN: u32 = 4;

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

    /// Counts one more at `now`, if this second has room for it.
    fn admit(&mut self, now: Instant) -> bool {
        if self.spent(now) {
            return false;
        }
        self.used += 1;
        true
    }

    /// Whether this second's budget is used up at `now`.
    fn spent(&mut self, now: Instant) -> bool {
        if self
            .started
            .is_none_or(|started| now.saturating_duration_since(started) >= Duration::from_secs(1))
        {
            self.started = Some(now);
            self.used = 0;
        }
        self.used >= self.limit
    }
}

#[cfg(test)]
mod tests;

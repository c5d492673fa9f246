//! `replica_sync:`: picker replicas that tell one another what they dispatch.

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

/// `replica_sync:`: every replica sends each of its dispatches (pool, worker, uncached tokens) to the
/// listed peers as a datagram, and prices the ones it receives as its own until the worker's next
/// reading covers them. Without it each replica sees only its own dispatches between two scrapes of a
/// worker, and replicas that read the same engines pick the same idle worker (BENCHMARKS.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaSyncConfig {
    /// The UDP address this replica receives its peers' dispatches on.
    pub listen: SocketAddr,
    /// Every replica's `listen` address, or a name resolving to them (a headless Service); the same
    /// list may be given to all, since a replica recognises and drops its own datagrams. Datagrams
    /// from any other source address are dropped.
    pub peers: Vec<PeerAddress>,
    /// The shared key every datagram is signed and checked with (one key per line; the first signs,
    /// all verify, so a key rotates by editing the file, read again every `resolve_interval`).
    /// Required unless `listen` and every peer are loopback addresses.
    pub key_file: Option<PathBuf>,
    /// How often the peers' names are resolved and the key file read again.
    pub resolve_interval: Duration,
    /// Datagrams accepted per second from all peers together; the excess is dropped and counted, so
    /// a misbehaving peer costs one bounded task, never the request path.
    pub max_datagrams_per_second: NonZeroU32,
}

impl ReplicaSyncConfig {
    pub const DEFAULT_MAX_DATAGRAMS_PER_SECOND: u32 = 20_000;
    pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(5);
}

/// One entry of `replica_sync.peers`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PeerAddress {
    /// `ip:port`: one replica.
    Socket(SocketAddr),
    /// `name:port`: every address the name resolves to is a replica at `port`.
    Name { host: String, port: u16 },
}

impl PeerAddress {
    /// `ip:port`, `[ipv6]:port` or `name:port` (a DNS name of letters, digits, `-` and `.`, port ≥ 1).
    pub fn parse(text: &str) -> Option<PeerAddress> {
        if let Ok(socket) = text.parse() {
            return Some(PeerAddress::Socket(socket));
        }
        let (host, port) = text.rsplit_once(':')?;
        let port: u16 = port.parse().ok().filter(|port| *port > 0)?;
        let valid = !host.is_empty()
            && host.len() <= 253
            && host
                .split('.')
                .all(|label| !label.is_empty() && label.len() <= 63)
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        valid.then(|| PeerAddress::Name {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for PeerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddress::Socket(socket) => socket.fmt(f),
            PeerAddress::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

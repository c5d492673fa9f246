//! Warm start between replicas: a replica that starts asks a sibling for what its owner indexes
//! hold, over TCP at the sibling's `replica_sync.listen` address (the datagrams' port, TCP), under the
//! sync's keys. The bytes are opaque here (`route::warm` makes and reads them).
//!
//! The exchange: the asker sends one request, `"CPW1" key_id nonce(16) sent_at_ms:u64 mac(32)`, the
//! MAC under the named key over everything before it; the sibling answers `"CPW1" key_id len:u64
//! body mac(32)`, the MAC under the same key over `"CPW1 answer" nonce len sha256(body)`, and closes.
//! So only a holder of a key in force can ask (a request is taken once, within `FRESH_WITHIN` of the
//! sibling's clock) and the asker takes only an answer to its own question from a key holder. The
//! snapshot is not encrypted: it names block hashes and workers, not prompts, as the datagrams do.
//!
//! What one peer or stranger can cost the sibling is bounded: connections from an address that is
//! not a listed peer's are closed at once; at most [`CONNECTIONS`] are answered at a time (more are
//! closed); a request must arrive whole within [`ASK_WITHIN`] and the answer leave within
//! [`SEND_WITHIN`]. The asker reads at most [`MAX_SNAPSHOT_BYTES`] and gives each sibling
//! [`ASK_EACH_WITHIN`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ring::{digest, hmac};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::fresh::FRESH_WITHIN;
use super::keys::{SyncKey, SyncKeys};
use super::{ReplicaSync, unix_ms};

const MAGIC: &[u8; 4] = b"CPW1";
const ANSWER_LABEL: &[u8] = b"CPW1 answer";
const NONCE: usize = 16;
const TAG: usize = 32;
const REQUEST: usize = 4 + 4 + NONCE + 8 + TAG;
const ANSWER_HEAD: usize = 4 + 4 + 8;

/// The largest snapshot an asker reads: about 33 million blocks, several times a 64-worker fleet's.
pub const MAX_SNAPSHOT_BYTES: u64 = 256 << 20;

/// Snapshots answered at a time; more connections are closed at once.
pub const CONNECTIONS: usize = 4;

/// How long a sibling waits for a whole request.
pub const ASK_WITHIN: Duration = Duration::from_secs(2);

/// How long a sibling takes to send its answer before it gives up on the asker.
pub const SEND_WITHIN: Duration = Duration::from_secs(60);

/// How long an asker gives one sibling, from connecting to the last byte.
pub const ASK_EACH_WITHIN: Duration = Duration::from_secs(10);

/// Requests remembered against replay: more than `CONNECTIONS` can bring in `FRESH_WITHIN`.
const NONCES: usize = 1024;

/// What became of a connection to this replica's snapshot listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A request under a key in force was answered with this replica's snapshot.
    Answered,
    /// From an address that is not a listed peer's: closed unread.
    UnknownSource,
    /// Over [`CONNECTIONS`] at once: closed unread.
    Busy,
    /// Not a request of this format, or not whole within [`ASK_WITHIN`].
    Malformed,
    /// Under no key held, or its MAC does not match.
    Unauthenticated,
    /// Sent further than `FRESH_WITHIN` from this replica's clock.
    Stale,
    /// Its nonce was answered already.
    Replayed,
    /// The answer could not be sent whole within [`SEND_WITHIN`].
    Failed,
}

impl Served {
    pub const ALL: [Served; 8] = [
        Served::Answered,
        Served::UnknownSource,
        Served::Busy,
        Served::Malformed,
        Served::Unauthenticated,
        Served::Stale,
        Served::Replayed,
        Served::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Served::Answered => "answered",
            Served::UnknownSource => "unknown_source",
            Served::Busy => "busy",
            Served::Malformed => "malformed",
            Served::Unauthenticated => "unauthenticated",
            Served::Stale => "stale",
            Served::Replayed => "replayed",
            Served::Failed => "failed",
        }
    }
}

/// Why a sibling gave no snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unanswered {
    #[error("the sibling cannot be reached, or closed before answering whole")]
    Failed,
    #[error("the sibling did not answer whole within {ASK_EACH_WITHIN:?}")]
    Timeout,
    #[error("the answer is not of this format, or over {MAX_SNAPSHOT_BYTES} bytes")]
    Malformed,
    #[error("the answer is not under this replica's key, or not to its question")]
    Unauthenticated,
}

/// How long a starting replica asks its siblings, one after another, before it starts cold.
pub const WARM_WITHIN: Duration = Duration::from_secs(20);

/// What became of one sibling asked at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warmed {
    /// Its snapshot was adopted.
    Adopted,
    /// It answered with nothing to adopt (it has learned nothing, or nothing this replica routes).
    Empty,
    /// Its answer is authentic but not a snapshot of this release.
    Unusable,
    /// No answer (`Unanswered`).
    Failed,
    Timeout,
    Malformed,
    Unauthenticated,
}

impl Warmed {
    pub const ALL: [Warmed; 7] = [
        Warmed::Adopted,
        Warmed::Empty,
        Warmed::Unusable,
        Warmed::Failed,
        Warmed::Timeout,
        Warmed::Malformed,
        Warmed::Unauthenticated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Warmed::Adopted => "adopted",
            Warmed::Empty => "empty",
            Warmed::Unusable => "unusable",
            Warmed::Failed => "failed",
            Warmed::Timeout => "timeout",
            Warmed::Malformed => "malformed",
            Warmed::Unauthenticated => "unauthenticated",
        }
    }
}

impl From<Unanswered> for Warmed {
    fn from(unanswered: Unanswered) -> Warmed {
        match unanswered {
            Unanswered::Failed => Warmed::Failed,
            Unanswered::Timeout => Warmed::Timeout,
            Unanswered::Malformed => Warmed::Malformed,
            Unanswered::Unauthenticated => Warmed::Unauthenticated,
        }
    }
}

/// Makes the snapshot a sibling asks for; runs on the blocking pool.
pub type SnapshotSource = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

impl ReplicaSync {
    /// Answers the listed peers' snapshot requests on `listener` (TCP, at the sync's address) with
    /// what `snapshot` makes, until `shutdown` resolves.
    pub async fn serve_snapshots(
        self: Arc<Self>,
        listener: TcpListener,
        snapshot: SnapshotSource,
        shutdown: impl Future<Output = ()>,
    ) {
        let permits = Arc::new(Semaphore::new(CONNECTIONS));
        let nonces = Arc::new(Mutex::new(Nonces::default()));
        tokio::pin!(shutdown);
        loop {
            let (stream, from) = tokio::select! {
                () = &mut shutdown => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    // Out of descriptors, or a connection reset before it was taken: the listener
                    // stays; a pause keeps a persistent error from spinning.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // A peer connects from an ephemeral port: its address, not its socket, is listed.
            let ip = from.ip().to_canonical();
            if !self.peers.load().iter().any(|peer| peer.ip() == ip) {
                self.stats.count_served(Served::UnknownSource);
                continue;
            }
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                self.stats.count_served(Served::Busy);
                continue;
            };
            let this = Arc::clone(&self);
            let snapshot = Arc::clone(&snapshot);
            let nonces = Arc::clone(&nonces);
            tokio::spawn(async move {
                let outcome = this.answer(stream, snapshot, &nonces).await;
                this.stats.count_served(outcome);
                drop(permit);
            });
        }
    }

    /// One connection: the request read and checked, the snapshot made and sent.
    async fn answer(
        &self,
        mut stream: TcpStream,
        snapshot: SnapshotSource,
        nonces: &Mutex<Nonces>,
    ) -> Served {
        let mut request = [0u8; REQUEST];
        match tokio::time::timeout(ASK_WITHIN, stream.read_exact(&mut request)).await {
            Ok(Ok(_)) => {}
            _ => return Served::Malformed,
        }
        let keys = self.keys.load_full();
        let asked = match open_request(&request, &keys) {
            Ok(asked) => asked,
            Err(refused) => return refused,
        };
        let now = unix_ms();
        if asked.sent_at_ms.abs_diff(now) > millis(FRESH_WITHIN) {
            return Served::Stale;
        }
        if !nonces
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(asked.nonce, now)
        {
            return Served::Replayed;
        }
        let Ok(body) = tokio::task::spawn_blocking(move || snapshot()).await else {
            return Served::Failed;
        };
        let (head, tag) = seal_answer(asked.key, &asked.nonce, &body);
        let sent = async {
            stream.write_all(&head).await?;
            stream.write_all(&body).await?;
            stream.write_all(tag.as_ref()).await?;
            stream.shutdown().await
        };
        match tokio::time::timeout(SEND_WITHIN, sent).await {
            Ok(Ok(())) => Served::Answered,
            _ => Served::Failed,
        }
    }

    /// Asks the sibling at `peer` (its `replica_sync.listen`) for its snapshot, within
    /// [`ASK_EACH_WITHIN`].
    pub async fn ask(&self, peer: SocketAddr) -> Result<Vec<u8>, Unanswered> {
        let keys = self.keys.load_full();
        let key = keys.signing();
        let nonce: [u8; NONCE] = rand::random();
        let request = seal_request(key, &nonce, unix_ms());
        let exchange = async {
            let mut stream = TcpStream::connect(peer).await?;
            stream.write_all(&request).await?;
            let mut head = [0u8; ANSWER_HEAD];
            stream.read_exact(&mut head).await?;
            let (magic, rest) = head.split_at(4);
            let (id, len) = rest.split_at(4);
            let len = u64::from_be_bytes(len.try_into().unwrap_or_default());
            if magic != MAGIC || id != key.id() || len > MAX_SNAPSHOT_BYTES {
                return Ok(Err(Unanswered::Malformed));
            }
            let mut body = Vec::new();
            (&mut stream).take(len).read_to_end(&mut body).await?;
            let mut tag = [0u8; TAG];
            stream.read_exact(&mut tag).await?;
            if u64::try_from(body.len()) != Ok(len) {
                return Ok(Err(Unanswered::Failed));
            }
            Ok::<_, std::io::Error>(if key.verify(&answer_mac_input(&nonce, len, &body), &tag) {
                Ok(body)
            } else {
                Err(Unanswered::Unauthenticated)
            })
        };
        match tokio::time::timeout(ASK_EACH_WITHIN, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Unanswered::Failed),
            Err(_) => Err(Unanswered::Timeout),
        }
    }

    /// The peers to ask: the listed ones and what the names resolved to, this replica's own address
    /// left out.
    pub fn siblings(&self) -> Vec<SocketAddr> {
        let local = self.local;
        self.peers
            .load()
            .iter()
            .copied()
            .filter(|peer| *peer != local)
            .collect()
    }
}

/// A request whose MAC holds, as read.
struct Asked<'k> {
    key: &'k SyncKey,
    nonce: [u8; NONCE],
    sent_at_ms: u64,
}

fn seal_request(key: &SyncKey, nonce: &[u8; NONCE], sent_at_ms: u64) -> Vec<u8> {
    let mut request = Vec::with_capacity(REQUEST);
    request.extend_from_slice(MAGIC);
    request.extend_from_slice(&key.id());
    request.extend_from_slice(nonce);
    request.extend_from_slice(&sent_at_ms.to_be_bytes());
    let tag = key.sign(&request);
    request.extend_from_slice(tag.as_ref());
    request
}

fn open_request<'k>(request: &[u8; REQUEST], keys: &'k SyncKeys) -> Result<Asked<'k>, Served> {
    let (signed, tag) = request.split_at(REQUEST - TAG);
    let (magic, rest) = signed.split_at(4);
    let (id, rest) = rest.split_at(4);
    let (nonce, sent_at) = rest.split_at(NONCE);
    if magic != MAGIC {
        return Err(Served::Malformed);
    }
    let id: [u8; 4] = id.try_into().map_err(|_| Served::Malformed)?;
    let key = keys.by_id(id).ok_or(Served::Unauthenticated)?;
    if !key.verify(signed, tag) {
        return Err(Served::Unauthenticated);
    }
    Ok(Asked {
        key,
        nonce: nonce.try_into().map_err(|_| Served::Malformed)?,
        sent_at_ms: u64::from_be_bytes(sent_at.try_into().map_err(|_| Served::Malformed)?),
    })
}

/// The answer's head (magic, key id, length) and its MAC.
fn seal_answer(key: &SyncKey, nonce: &[u8; NONCE], body: &[u8]) -> (Vec<u8>, hmac::Tag) {
    let len = body.len() as u64;
    let mut head = Vec::with_capacity(ANSWER_HEAD);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&key.id());
    head.extend_from_slice(&len.to_be_bytes());
    (head, key.sign(&answer_mac_input(nonce, len, body)))
}

/// What an answer's MAC covers: the label, the asker's nonce, the length and the body's digest, so
/// a body of any size is read once and the MAC is checked in constant time.
fn answer_mac_input(nonce: &[u8; NONCE], len: u64, body: &[u8]) -> Vec<u8> {
    let mut input = Vec::with_capacity(ANSWER_LABEL.len() + NONCE + 8 + 32);
    input.extend_from_slice(ANSWER_LABEL);
    input.extend_from_slice(nonce);
    input.extend_from_slice(&len.to_be_bytes());
    input.extend_from_slice(digest::digest(&digest::SHA256, body).as_ref());
    input
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The nonces answered within `FRESH_WITHIN`, oldest first.
#[derive(Default)]
struct Nonces(VecDeque<([u8; NONCE], u64)>);

impl Nonces {
    /// Whether `nonce` is new at `now_ms` (and now taken). Full of fresh nonces, it takes none: more
    /// requests than [`CONNECTIONS`] can bring are an attack, not a sibling.
    fn take(&mut self, nonce: [u8; NONCE], now_ms: u64) -> bool {
        let fresh = millis(FRESH_WITHIN);
        while self
            .0
            .front()
            .is_some_and(|(_, at)| now_ms.saturating_sub(*at) > fresh)
        {
            self.0.pop_front();
        }
        if self.0.len() >= NONCES || self.0.iter().any(|(seen, _)| *seen == nonce) {
            return false;
        }
        self.0.push_back((nonce, now_ms));
        true
    }
}

#[cfg(test)]
mod tests;

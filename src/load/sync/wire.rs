//! The `replica_sync` datagram: one replica's announcement of one dispatch, sealed with a MAC.
//!
//! Big-endian: `CPS3`; the id of the key that signed it; the sender's origin (random per process), its
//! sequence number (from 1, one per announcement) and its wall clock in milliseconds since the Unix
//! epoch, which together let a receiver refuse a replayed or stale datagram; the uncached tokens (u64);
//! the worker's port (u16), address family (4 or 6) and address; the pool label's length (u8) and the
//! label; the number of checkpoint hashes (u8, at most [`MAX_CHECKPOINTS`]) and the hashes (u64 each:
//! the prompt's chain at the checkpoint depths, `prefix::checkpoint`); last, the HMAC-SHA256 of
//! everything before it under the key.
//!
//! A receiver looks the key up by its id, checks the MAC before it reads a field, and only then
//! parses: a datagram without a valid MAC is never more than bytes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::keys::SyncKeys;

/// The most checkpoint hashes an announcement carries: `prefix::MAX_CHECKPOINTS`, which the route
/// layer cuts a chain to (held equal by `route`'s tests, since neither module may import the other).
pub const MAX_CHECKPOINTS: usize = 64;

/// `CPS3`: the third layout (`CPS1` had no MAC, `CPS2` no checkpoints); a replica of another layout's
/// release hears nothing of this one's (`malformed`), nor this one of its.
const MAGIC: &[u8; 4] = b"CPS3";
const TAG_BYTES: usize = 32;
/// Everything before the worker's address family.
const FIXED: usize = 4 + 4 + 8 + 8 + 8 + 8 + 2;
/// The largest datagram: the fixed part, an IPv6 address, a 255-byte label, every checkpoint and the
/// MAC: 860 bytes, within one Ethernet frame.
pub const MAX_DATAGRAM: usize = FIXED + 1 + 16 + 1 + 255 + 1 + 8 * MAX_CHECKPOINTS + TAG_BYTES;

/// One replica's announcement of one dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement<'a> {
    /// The sender's process, random at its start.
    pub origin: u64,
    /// The sender's count of its announcements, from 1.
    pub sequence: u64,
    /// When the sender sent it, in milliseconds since the Unix epoch by its clock.
    pub sent_at_ms: u64,
    pub pool: &'a str,
    pub worker: SocketAddr,
    pub uncached_tokens: u64,
    /// The prompt's chain at the checkpoint depths, for the peer's guess of where its prefix is (an
    /// `events` pool's; empty for others).
    pub checkpoints: Vec<u64>,
}

/// Why a datagram was not opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unopened {
    /// Not a datagram of this format.
    Malformed,
    /// Signed with no key this replica holds, or its MAC does not match.
    Unauthenticated,
}

impl Announcement<'_> {
    /// The datagram, signed with `keys`' signing key; `None` when the pool label is longer than 255
    /// bytes or there are more than [`MAX_CHECKPOINTS`] checkpoints.
    pub fn seal(&self, keys: &SyncKeys) -> Option<Vec<u8>> {
        let label = u8::try_from(self.pool.len()).ok()?;
        let checkpoints = u8::try_from(self.checkpoints.len())
            .ok()
            .filter(|count| usize::from(*count) <= MAX_CHECKPOINTS)?;
        let key = keys.signing();
        let mut out = Vec::with_capacity(MAX_DATAGRAM);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&key.id());
        for field in [
            self.origin,
            self.sequence,
            self.sent_at_ms,
            self.uncached_tokens,
        ] {
            out.extend_from_slice(&field.to_be_bytes());
        }
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
        out.push(checkpoints);
        for hash in &self.checkpoints {
            out.extend_from_slice(&hash.to_be_bytes());
        }
        let tag = key.sign(&out);
        out.extend_from_slice(tag.as_ref());
        Some(out)
    }

    /// The announcement `datagram` carries, if one of `keys` signed it and it is exactly one
    /// well-formed announcement.
    pub fn open<'d>(datagram: &'d [u8], keys: &SyncKeys) -> Result<Announcement<'d>, Unopened> {
        if datagram.len() > MAX_DATAGRAM || !datagram.starts_with(MAGIC) {
            return Err(Unopened::Malformed);
        }
        let (signed, tag) = datagram
            .split_at_checked(datagram.len().saturating_sub(TAG_BYTES))
            .filter(|(signed, _)| signed.len() >= FIXED)
            .ok_or(Unopened::Malformed)?;
        let id = signed
            .get(4..8)
            .and_then(|id| <[u8; 4]>::try_from(id).ok())
            .ok_or(Unopened::Malformed)?;
        let key = keys.by_id(id).ok_or(Unopened::Unauthenticated)?;
        if !key.verify(signed, tag) {
            return Err(Unopened::Unauthenticated);
        }
        parse(signed.get(8..).unwrap_or_default()).ok_or(Unopened::Malformed)
    }
}

/// The fields after the magic and the key id.
fn parse(mut rest: &[u8]) -> Option<Announcement<'_>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        rest = tail;
        Some(head)
    };
    let mut u64_field = || Some(u64::from_be_bytes(take(8)?.try_into().ok()?));
    let (origin, sequence, sent_at_ms, uncached_tokens) =
        (u64_field()?, u64_field()?, u64_field()?, u64_field()?);
    let port = u16::from_be_bytes(take(2)?.try_into().ok()?);
    let ip = match take(1)? {
        [4] => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(take(4)?).ok()?)),
        [6] => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(take(16)?).ok()?)),
        _ => return None,
    };
    let label = usize::from(*take(1)?.first()?);
    let pool = std::str::from_utf8(take(label)?).ok()?;
    let count = usize::from(*take(1)?.first()?);
    if count > MAX_CHECKPOINTS {
        return None;
    }
    let checkpoints = take(8 * count)?
        .chunks_exact(8)
        .map(|hash| hash.try_into().map(u64::from_be_bytes))
        .collect::<Result<Vec<u64>, _>>()
        .ok()?;
    if !rest.is_empty() {
        return None;
    }
    Some(Announcement {
        origin,
        sequence,
        sent_at_ms,
        pool,
        worker: SocketAddr::new(ip, port),
        uncached_tokens,
        checkpoints,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announcement(pool: &str, worker: &str) -> Announcement<'static> {
        Announcement {
            origin: 7,
            sequence: 3,
            sent_at_ms: 1_780_000_000_000,
            pool: Box::leak(pool.to_owned().into_boxed_str()),
            worker: worker.parse().unwrap(),
            uncached_tokens: 40_960,
            checkpoints: vec![11, 22, u64::MAX],
        }
    }

    fn keys(secret: &str) -> SyncKeys {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, secret).unwrap();
        SyncKeys::from_file(&path).unwrap()
    }

    #[test]
    fn an_announcement_survives_the_wire_for_both_families() {
        let keys = keys("0123456789abcdef0123456789abcdef");
        for worker in ["10.1.2.3:8000", "[fd00::17]:8000"] {
            let sent = announcement("llama-3.1-8b", worker);
            let datagram = sent.seal(&keys).unwrap();
            assert!(datagram.len() <= MAX_DATAGRAM);
            assert_eq!(Announcement::open(&datagram, &keys), Ok(sent));
        }
        let longest = Announcement {
            checkpoints: (0..MAX_CHECKPOINTS as u64).collect(),
            ..announcement(&"x".repeat(255), "[fd00::17]:8000")
        };
        let datagram = longest.seal(&keys).unwrap();
        assert_eq!(datagram.len(), MAX_DATAGRAM);
        assert_eq!(Announcement::open(&datagram, &keys), Ok(longest));
        assert_eq!(
            announcement(&"x".repeat(256), "10.0.0.1:80").seal(&keys),
            None
        );
        let too_many = Announcement {
            checkpoints: vec![0; MAX_CHECKPOINTS + 1],
            ..announcement("m", "10.0.0.1:80")
        };
        assert_eq!(too_many.seal(&keys), None);
    }

    #[test]
    fn only_a_whole_datagram_under_a_held_key_opens() {
        let keys = keys("0123456789abcdef0123456789abcdef");
        let datagram = announcement("m", "10.0.0.1:80").seal(&keys).unwrap();
        for cut in 0..datagram.len() {
            assert!(
                Announcement::open(&datagram[..cut], &keys).is_err(),
                "cut at {cut}"
            );
        }
        let mut long = datagram.clone();
        long.push(0);
        assert!(Announcement::open(&long, &keys).is_err());
        // Every bit of the signed part and the MAC is covered.
        for byte in 4..datagram.len() {
            let mut flipped = datagram.clone();
            flipped[byte] ^= 1;
            assert_eq!(
                Announcement::open(&flipped, &keys),
                Err(Unopened::Unauthenticated),
                "byte {byte}"
            );
        }
        let mut magic = datagram.clone();
        magic[0] = b'X';
        assert_eq!(Announcement::open(&magic, &keys), Err(Unopened::Malformed));
        // Another key, and no key at all, open nothing of it; nor it theirs.
        let other = self::keys("fedcba9876543210fedcba9876543210");
        let loopback = SyncKeys::loopback_only();
        for (sealed, opener) in [(&keys, &other), (&keys, &loopback), (&loopback, &keys)] {
            let datagram = announcement("m", "10.0.0.1:80").seal(sealed).unwrap();
            assert_eq!(
                Announcement::open(&datagram, opener),
                Err(Unopened::Unauthenticated)
            );
        }
        // Signed, but with a family that is neither 4 nor 6: well signed garbage is malformed.
        let mut bad = announcement("m", "10.0.0.1:80").seal(&keys).unwrap();
        bad.truncate(bad.len() - TAG_BYTES);
        bad[FIXED] = 5;
        let tag = keys.signing().sign(&bad);
        bad.extend_from_slice(tag.as_ref());
        assert_eq!(Announcement::open(&bad, &keys), Err(Unopened::Malformed));
    }
}

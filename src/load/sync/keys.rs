//! The keys `replica_sync` signs and checks its datagrams with (`replica_sync.key_file`).
//!
//! The file holds one key per line (surrounding whitespace and blank lines ignored, `#` starts a
//! comment line), each printable ASCII of at least [`MIN_KEY_BYTES`] bytes, such as `openssl rand -hex
//! 32`. The first line signs what this replica sends; every line is accepted on what it receives. So a
//! key rotates without a restart and without a moment two replicas disagree: add the new key as a second
//! line everywhere, then make it the first, then drop the old one, waiting each time until every
//! replica has read the file again (`resolve_interval`; the reload is logged and counted).
//!
//! Each key is named on the wire by a 4-byte id derived from it, so a receiver computes one MAC per
//! datagram whatever the number of keys; the id reveals nothing a MAC under the key would not.
//!
//! Without a key file the sync runs only between loopback addresses (configuration refuses anything
//! else): datagrams then carry a MAC under the empty key, which checks their integrity, not who sent
//! them, and the kernel's refusal of loopback sources from the network does the rest.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use ring::hmac;
use thiserror::Error;

/// Shorter keys are guessable; `openssl rand -hex 32` gives 64.
pub const MIN_KEY_BYTES: usize = 32;

/// At most this many keys: two during a rotation, with room for an operator's slow one.
pub const MAX_KEYS: usize = 4;

/// The largest key file read.
const KEY_FILE_LIMIT: u64 = 64 << 10;

/// The bytes a key's id is the MAC of.
const ID_LABEL: &[u8] = b"cachepick replica_sync key id";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("cannot read replica_sync.key_file {}: {reason}", path.display())]
    Read { path: PathBuf, reason: String },
    #[error("replica_sync.key_file {} holds no key: one line of at least {MIN_KEY_BYTES} bytes is required (openssl rand -hex 32)", path.display())]
    Empty { path: PathBuf },
    #[error("replica_sync.key_file {} line {line}: a key of {length} bytes; at least {MIN_KEY_BYTES} are required", path.display())]
    TooShort {
        path: PathBuf,
        line: usize,
        length: usize,
    },
    #[error("replica_sync.key_file {} line {line}: a key is printable ASCII without spaces", path.display())]
    NotPrintable { path: PathBuf, line: usize },
    #[error("replica_sync.key_file {} holds {count} keys; at most {MAX_KEYS} are accepted", path.display())]
    TooMany { path: PathBuf, count: usize },
    #[error("replica_sync.key_file {} line {line} repeats an earlier key", path.display())]
    Repeated { path: PathBuf, line: usize },
}

/// One key: its wire id and the MAC key. Never printed.
#[derive(Clone)]
pub struct SyncKey {
    id: [u8; 4],
    key: hmac::Key,
}

impl SyncKey {
    fn new(secret: &[u8]) -> SyncKey {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let tag = hmac::sign(&key, ID_LABEL);
        let mut id = [0; 4];
        id.copy_from_slice(tag.as_ref().get(..4).unwrap_or(&[0; 4]));
        SyncKey { id, key }
    }

    pub(super) fn id(&self) -> [u8; 4] {
        self.id
    }

    pub(super) fn sign(&self, bytes: &[u8]) -> hmac::Tag {
        hmac::sign(&self.key, bytes)
    }

    /// Whether `tag` is this key's MAC of `bytes`, in time independent of how much of it is right.
    pub(super) fn verify(&self, bytes: &[u8], tag: &[u8]) -> bool {
        hmac::verify(&self.key, bytes, tag).is_ok()
    }
}

/// The keys in force: the first signs, every one verifies.
#[derive(Clone)]
pub struct SyncKeys {
    signing: SyncKey,
    /// The keys accepted beside the signing one.
    others: Vec<SyncKey>,
    /// What the file held, to tell a changed file from a re-read one.
    source: Vec<u8>,
}

impl fmt::Debug for SyncKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SyncKeys({} keys)", self.count())
    }
}

impl SyncKeys {
    /// No key file: the empty key, for a sync between loopback addresses only.
    pub fn loopback_only() -> SyncKeys {
        SyncKeys {
            signing: SyncKey::new(b""),
            others: Vec::new(),
            source: Vec::new(),
        }
    }

    /// The keys `path` holds, checked.
    pub fn from_file(path: &Path) -> Result<SyncKeys, KeyError> {
        let bytes = read(path)?;
        SyncKeys::parse(bytes, path)
    }

    /// `path` read again: `Ok(None)` when it holds what these keys were read from.
    pub fn reread(&self, path: &Path) -> Result<Option<SyncKeys>, KeyError> {
        let bytes = read(path)?;
        if bytes == self.source {
            return Ok(None);
        }
        SyncKeys::parse(bytes, path).map(Some)
    }

    fn parse(source: Vec<u8>, path: &Path) -> Result<SyncKeys, KeyError> {
        let mut secrets: Vec<&[u8]> = Vec::new();
        for (at, line) in source.split(|byte| *byte == b'\n').enumerate() {
            let (line, secret) = (at + 1, line.trim_ascii());
            if secret.is_empty() || secret.starts_with(b"#") {
                continue;
            }
            let path = path.to_owned();
            if !secret.iter().all(u8::is_ascii_graphic) {
                return Err(KeyError::NotPrintable { path, line });
            }
            if secret.len() < MIN_KEY_BYTES {
                let length = secret.len();
                return Err(KeyError::TooShort { path, line, length });
            }
            if secrets.contains(&secret) {
                return Err(KeyError::Repeated { path, line });
            }
            secrets.push(secret);
        }
        if secrets.len() > MAX_KEYS {
            return Err(KeyError::TooMany {
                path: path.to_owned(),
                count: secrets.len(),
            });
        }
        let mut keys = secrets.into_iter().map(SyncKey::new);
        let Some(signing) = keys.next() else {
            return Err(KeyError::Empty {
                path: path.to_owned(),
            });
        };
        Ok(SyncKeys {
            signing,
            others: keys.collect(),
            source,
        })
    }

    /// The key this replica signs with.
    pub(super) fn signing(&self) -> &SyncKey {
        &self.signing
    }

    /// The key named `id` on the wire, if it is one of these.
    pub(super) fn by_id(&self, id: [u8; 4]) -> Option<&SyncKey> {
        std::iter::once(&self.signing)
            .chain(&self.others)
            .find(|key| key.id == id)
    }

    /// How many keys verify (at least one).
    pub fn count(&self) -> usize {
        1 + self.others.len()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, KeyError> {
    cachepick_decode::file::read_regular(path, KEY_FILE_LIMIT).map_err(|error: io::Error| {
        KeyError::Read {
            path: path.to_owned(),
            reason: error.to_string(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123456789abcdef0123456789abcdef";
    const B: &str = "fedcba9876543210fedcba9876543210ff";

    #[test]
    fn the_first_key_signs_and_every_key_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, format!("# rotating\n{B}\n\n  {A}  \n")).unwrap();
        let keys = SyncKeys::from_file(&path).unwrap();
        assert_eq!(keys.count(), 2);
        let signing = keys.signing();
        let tag = signing.sign(b"datagram");
        assert!(
            keys.by_id(signing.id())
                .unwrap()
                .verify(b"datagram", tag.as_ref())
        );
        assert!(!signing.verify(b"datagrap", tag.as_ref()));
        let old = SyncKey::new(A.as_bytes());
        assert!(keys.by_id(old.id()).is_some(), "the second key verifies");
        assert!(SyncKeys::loopback_only().by_id(old.id()).is_none());
        assert_eq!(format!("{keys:?}"), "SyncKeys(2 keys)");
        assert!(!format!("{:?}", keys).contains(A));
        // Read again unchanged: nothing to apply; changed: the new keys.
        assert!(keys.reread(&path).unwrap().is_none());
        std::fs::write(&path, format!("{A}\n")).unwrap();
        let rotated = keys.reread(&path).unwrap().unwrap();
        assert_eq!(rotated.signing().id(), old.id());
        assert!(
            rotated.by_id(signing.id()).is_none(),
            "the dropped key no longer verifies"
        );
    }

    #[test]
    fn a_key_file_that_cannot_serve_is_refused_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        let five = (0..5).map(|n| format!("{A}{n}\n")).collect::<String>();
        for (text, expected) in [
            ("\n# only a comment\n", "holds no key"),
            ("short\n", "line 1: a key of 5 bytes; at least 32"),
            (
                &format!("{A}\n{A} x\n") as &str,
                "line 2: a key is printable ASCII",
            ),
            (&format!("{A}\n{B}\n{A}\n"), "line 3 repeats an earlier key"),
            (&five, "holds 5 keys; at most 4"),
        ] {
            std::fs::write(&path, text).unwrap();
            let error = SyncKeys::from_file(&path).unwrap_err().to_string();
            assert!(error.contains(expected), "{text:?}: {error}");
            assert!(!error.contains(A), "{error}");
        }
        let error = SyncKeys::from_file(&dir.path().join("absent")).unwrap_err();
        assert!(matches!(error, KeyError::Read { .. }), "{error}");
    }
}

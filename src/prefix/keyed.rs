//! The hasher of the owner index's maps and of the engine keys.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// The maps' hasher: one keyed, folded multiply per key.
///
/// Keys are already xxh3 outputs, so mixing needs little work, but they are outputs over client
/// tokens under a public seed: an unkeyed hash would let a client aim many blocks at one bucket. A
/// per-process random key prevents that at a fraction of SipHash's cost on the `matches` walk.
#[derive(Clone)]
pub(super) struct KeyedHash {
    key: u64,
    multiplier: u64,
}

impl KeyedHash {
    pub(super) fn new() -> Self {
        let random = RandomState::new();
        KeyedHash {
            key: random.hash_one(0_u64),
            multiplier: random.hash_one(1_u64) | 1,
        }
    }
}

impl BuildHasher for KeyedHash {
    type Hasher = KeyedHasher;

    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher {
            key: self.key,
            multiplier: self.multiplier,
            hash: 0,
        }
    }
}

pub(super) struct KeyedHasher {
    key: u64,
    multiplier: u64,
    hash: u64,
}

impl Hasher for KeyedHasher {
    fn write_u64(&mut self, value: u64) {
        let product = u128::from(self.hash ^ value ^ self.key) * u128::from(self.multiplier);
        self.hash = (product as u64) ^ ((product >> 64) as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0_u8; 8];
            word.iter_mut()
                .zip(chunk)
                .for_each(|(dst, src)| *dst = *src);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

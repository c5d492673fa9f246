//! Warm start: what a starting replica adopts of a sibling's owner indexes, and the bytes it travels
//! in (`load::sync::warm` carries them, signed, between the replicas of `replica_sync`).
//!
//! Only `approximate` pools take part. Their index is the replica's own decisions, which no engine
//! can replay, so a replica that starts or restarts would route every conversation as new until its
//! own traffic taught it; an `events` pool's index is rebuilt from each engine's replay instead.
//! A worker is named by its endpoint, which every replica's roster gives it, not by its slot, which
//! is each replica's own; a pool by its label, and only with the same block size, since the blocks'
//! hashes depend on it.
//!
//! The encoding (little-endian; every count is checked against the bytes left before anything is
//! allocated for it, so a hostile snapshot costs no more memory than its own length):
//!
//! ```text
//! "CPIX" version:u8=1 pools:u16
//!   pool: label_len:u8 label block_size:u32 workers:u32
//!     worker: endpoint_len:u8 endpoint(text) blocks:u32 block:u64 × blocks (least recent first)
//! ```

use std::net::SocketAddr;

use super::picker::Picker;
use crate::worker::WorkerId;

const MAGIC: &[u8; 4] = b"CPIX";
const VERSION: u8 = 1;

/// A sibling's `approximate` indexes: per pool, each worker's blocks, least recent first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexSnapshot {
    pub pools: Vec<PoolBlocks>,
}

/// One pool's part of an [`IndexSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolBlocks {
    pub label: String,
    pub block_size: u32,
    pub workers: Vec<(SocketAddr, Vec<u64>)>,
}

/// What adopting a snapshot did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Workers of this replica's rosters found in the snapshot, and the blocks they hold after.
    pub workers: usize,
    pub blocks: usize,
    /// Snapshot workers this replica's roster does not have (yet, or any more): left out.
    pub unknown_workers: usize,
    /// Snapshot pools this replica has not, or not as an `approximate` pool of the same block size.
    pub unmatched_pools: usize,
}

/// Why bytes are not a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("not an index snapshot of this release (magic or version)")]
    Format,
    #[error("the snapshot ends inside a field or has bytes after its last")]
    Truncated,
    #[error("a pool label or endpoint in the snapshot is not valid")]
    Name,
}

impl IndexSnapshot {
    /// Blocks over every pool and worker.
    pub fn blocks(&self) -> usize {
        self.pools
            .iter()
            .flat_map(|pool| &pool.workers)
            .map(|(_, blocks)| blocks.len())
            .sum()
    }

    /// The snapshot's bytes. A label or endpoint over 255 bytes cannot occur (labels are checked at
    /// load, endpoints are socket addresses) and would be cut there.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.blocks() * 8);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        put_len_u16(&mut out, self.pools.len());
        for pool in &self.pools {
            put_name(&mut out, &pool.label);
            out.extend_from_slice(&pool.block_size.to_le_bytes());
            put_len_u32(&mut out, pool.workers.len());
            for (endpoint, blocks) in &pool.workers {
                put_name(&mut out, &endpoint.to_string());
                put_len_u32(&mut out, blocks.len());
                for block in blocks {
                    out.extend_from_slice(&block.to_le_bytes());
                }
            }
        }
        out
    }

    /// Reads a snapshot [`encode`](Self::encode) wrote; anything else is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<IndexSnapshot, SnapshotError> {
        let mut reader = Reader(bytes);
        if reader.take(4)? != MAGIC || reader.u8()? != VERSION {
            return Err(SnapshotError::Format);
        }
        let pools = usize::from(reader.u16()?);
        let mut snapshot = IndexSnapshot::default();
        for _ in 0..pools {
            let label = reader.name()?;
            let block_size = reader.u32()?;
            let workers = reader.count(2 + 4)?;
            let mut pool = PoolBlocks {
                label,
                block_size,
                workers: Vec::with_capacity(workers),
            };
            for _ in 0..workers {
                let endpoint = reader.name()?.parse().map_err(|_| SnapshotError::Name)?;
                let count = reader.count(8)?;
                let blocks = (0..count)
                    .map(|_| reader.u64())
                    .collect::<Result<Vec<u64>, _>>()?;
                pool.workers.push((endpoint, blocks));
            }
            snapshot.pools.push(pool);
        }
        if !reader.0.is_empty() {
            return Err(SnapshotError::Truncated);
        }
        Ok(snapshot)
    }
}

impl Picker {
    /// Every `approximate` pool's index, worker by worker, as a sibling would adopt it.
    pub fn index_snapshot(&self) -> IndexSnapshot {
        let pools = self
            .pools
            .iter()
            .filter_map(|route| {
                let index = route.index.shareable()?;
                let workers = route
                    .load
                    .snapshot()
                    .workers()
                    .iter()
                    .map(|worker| (worker.endpoint, index.blocks_of(worker.id)))
                    .filter(|(_, blocks)| !blocks.is_empty())
                    .collect();
                Some(PoolBlocks {
                    label: route.load.label().to_owned(),
                    block_size: route.config.block_size.get(),
                    workers,
                })
            })
            .collect();
        IndexSnapshot { pools }
    }

    /// Adopts a sibling's `snapshot` into the `approximate` pools of the same label and block size,
    /// each worker by its endpoint in this replica's roster now; a worker that joins later starts
    /// empty, as it would have anyway.
    pub fn adopt(&self, snapshot: &IndexSnapshot) -> Adopted {
        let mut adopted = Adopted::default();
        for part in &snapshot.pools {
            let route = self.pools.iter().find(|route| {
                route.load.label() == part.label && route.config.block_size.get() == part.block_size
            });
            let Some((route, index)) =
                route.and_then(|route| Some((route, route.index.shareable()?)))
            else {
                adopted.unmatched_pools += 1;
                continue;
            };
            let roster = route.load.snapshot();
            for (endpoint, blocks) in &part.workers {
                let slot: Option<WorkerId> = roster
                    .workers()
                    .iter()
                    .find(|worker| worker.endpoint == *endpoint)
                    .map(|worker| worker.id);
                match slot {
                    Some(id) => {
                        adopted.workers += 1;
                        adopted.blocks += index.adopt(id, blocks);
                    }
                    None => adopted.unknown_workers += 1,
                }
            }
        }
        adopted
    }
}

fn put_len_u16(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_le_bytes());
}

fn put_len_u32(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    let bytes = name.as_bytes();
    let bytes = bytes.get(..usize::from(u8::MAX)).unwrap_or(bytes);
    out.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(bytes);
}

/// The bytes not read yet.
struct Reader<'b>(&'b [u8]);

impl<'b> Reader<'b> {
    fn take(&mut self, len: usize) -> Result<&'b [u8], SnapshotError> {
        if self.0.len() < len {
            return Err(SnapshotError::Truncated);
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        self.take(N)?
            .try_into()
            .map_err(|_| SnapshotError::Truncated)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        let [byte] = self.array()?;
        Ok(byte)
    }

    fn u16(&mut self) -> Result<u16, SnapshotError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items at least `each` bytes long, which the bytes left must be able to hold.
    fn count(&mut self, each: usize) -> Result<usize, SnapshotError> {
        let count = usize::try_from(self.u32()?).map_err(|_| SnapshotError::Truncated)?;
        if count.saturating_mul(each) > self.0.len() {
            return Err(SnapshotError::Truncated);
        }
        Ok(count)
    }

    fn name(&mut self) -> Result<String, SnapshotError> {
        let len = usize::from(self.u8()?);
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| SnapshotError::Name)
    }
}

#[cfg(test)]
mod tests;

//! Decoding the engines' msgpack `EventBatch` payloads: one ZeroMQ payload frame → [`EventBatch`].
//!
//! The bytes come from the network, so the decoder is a bounded pull parser over the payload slice:
//! it reads each msgpack header itself, never trusts a declared length further than the bytes that
//! are left, allocates only the output it keeps, and checks each count against the caps below
//! *before* allocating for it. Nothing it skips (unknown keys, positions, events) is materialised.
//! (`rmpv::decode::read_value` would not pre-allocate a declared array either, but it builds a tree of
//! 32–48-byte `Value`s for every 1-byte element, about a hundredfold amplification of a hostile
//! payload, before any check could run; the tests still use `rmpv` to *write* payloads.)
//!
//! # What is accepted
//! - The batch: `[ts, events, rank?]` (vLLM ≤ 0.23 and SGLang; `rank` absent, nil or an int) or a map
//!   `{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}` (vLLM ≥ 0.24). `ts` may be a float or
//!   an int; `ts` and `events` are required, as they are in the engines' structs.
//! - Each event: an array tagged by its element 0 (`["BlockStored", …]`), or a map tagged by its
//!   `"type"` key (msgspec `tag=True`, `omit_defaults=True`: fields at their default are absent).
//!   Positions past the last known one and map keys this release does not know are skipped; missing
//!   trailing positions and absent keys take their defaults (nil, empty, 0).
//! - `BlockStored`, positional: 1 `block_hashes`, 2 `parent_block_hash`, 3 `token_ids`, 4
//!   `block_size`, 5 `lora_id`, 6 `medium`, then vLLM's 7 `lora_name`, 8 `extra_keys`, 9 `group_idx`,
//!   10 `kv_cache_spec_kind` (11 `kv_cache_spec_sliding_window` is skipped); SGLang's position 7 is
//!   instead a map `{"cache_salt": s}` (its `BlockStoredWithMetadata`), told apart by its type. By
//!   name: the same field names, plus `cache_salt` and `metadata` (SGLang's map-tagged events).
//! - `BlockRemoved`: `[tag, block_hashes, medium?, group_idx?]` or the same names. `AllBlocksCleared`:
//!   the tag alone.
//!
//! # Mappings
//! - **Hashes** → `u64`: an unsigned int as is (vLLM's `maybe_convert_block_hash` keeps the digest's
//!   last 8 bytes, sent as msgpack uint64 when ≥ 2^63); a signed int reinterpreted (SGLang's i64);
//!   raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) → their last 8 bytes big-endian,
//!   which is exactly the int vLLM would have sent (a digest shorter than 8 bytes is read whole).
//! - **Tokens**: ints that fit a `u32`. SGLang's EAGLE bigram mode sends each position as a pair
//!   `(token_ids[j], token_ids[j + 1])` (`record_store` in `mem_cache/events.py`): the position's own
//!   token is element 0, element 1 is the next token's lookahead, so element 0 is kept.
//! - **Medium**: `"GPU"` and nil/absent → GPU; `"CPU"`, `"CPU_PINNED"` → CPU; `"DISK"` → disk; any
//!   other string → other (ASCII case ignored).
//! - **Rank**: `data_parallel_rank` / `attn_dp_rank`, nil → `None`.
//!
//! # Salt and extra keys
//! vLLM's `extra_keys` holds one entry per block, nil or a tuple built by
//! `generate_block_hash_extra_keys`: the LoRA name (a string), one `(mm_identifier, offset)` pair per
//! multimodal item overlapping the block (older releases: the identifier string alone), the request's
//! `cache_salt` (a string, only in the block starting at token 0) and a prompt-embeds digest (bytes).
//! The rule:
//! - a string equal to the event's `lora_name` is the adapter, already carried by `lora_name`;
//! - in a *root* block (the event's first block, `parent_block_hash` nil), exactly one remaining string
//!   is the `cache_salt`; two or more leave the salt unknown and set `opaque_extra_keys`;
//! - any other key — a pair, bytes, a number, a string in a non-root block — sets `opaque_extra_keys`.
//!
//! An explicit salt (SGLang's trailing `{"cache_salt": s}` map, or a `cache_salt` field) wins and is
//! removed from the extra keys before the rule runs. A salt or LoRA name that is not UTF-8 or is over
//! [`MAX_STRING_BYTES`] cannot be matched by any request here, so it is dropped and the event is marked
//! `opaque_extra_keys`; likewise an adapter given only by `lora_id` (no `lora_name`). Known limit: an
//! old vLLM that sent a multimodal identifier as a bare string in a root block with no salt has that
//! identifier read as a salt; no request carries it, so those blocks still never match a text prompt.
//!
//! # What is skipped and counted, not an error (`EventBatch::unknown_events`)
//! - an event whose tag this release does not know, or a map event with no `"type"`;
//! - a `BlockStored` whose blocks cannot be laid out as `hashes[i]` ↔ `tokens[i * block_size ..]` with
//!   only the last block short: vLLM's sliding-window, Mamba and other non-full-attention cache groups
//!   (`kv_cache_spec_kind` other than `full_attention`, `mla_attention`, `sink_full_attention`) send
//!   token ranges that span more than their hashes, or no hashes at all; an event with no hashes stores
//!   nothing. `BlockRemoved` carries no spec, so removals of every group pass through (a removal in
//!   a sliding-window group can name a hash a full-attention group still holds: the index then
//!   under-reports, which only costs cache affinity).
//!
//! # Bounds
//! A payload over [`MAX_PAYLOAD_BYTES`] is refused before parsing. Declared counts over
//! [`MAX_EVENTS_PER_BATCH`], [`MAX_HASHES_PER_EVENT`], [`MAX_TOKENS_PER_EVENT`], or running totals over
//! [`MAX_HASHES_PER_BATCH`] / [`MAX_TOKENS_PER_BATCH`], are errors before anything is allocated for
//! them; nesting deeper than [`MAX_DEPTH`] is an error; hash digests over [`MAX_HASH_BYTES`] are
//! errors; strings are borrowed from the payload and copied only when kept (≤ [`MAX_STRING_BYTES`]).
//! So the output is at most a few bytes per payload byte and the work is linear in the payload.

use thiserror::Error;

use super::{BlockStored, EventBatch, KvEvent, Medium};

mod extra_keys;
mod reader;

use extra_keys::{ExtraKeys, read_extra_keys};
use reader::{Head, Reader};

/// The largest payload decoded at all. A busy vLLM step (a 128k-token prefill) is well under 1 MiB.
pub const MAX_PAYLOAD_BYTES: usize = 8 << 20;
/// Events in one batch.
pub const MAX_EVENTS_PER_BATCH: u32 = 1 << 16;
/// Block hashes in one event (`BlockStored` or `BlockRemoved`).
pub const MAX_HASHES_PER_EVENT: u32 = 1 << 16;
/// Token ids in one `BlockStored`.
pub const MAX_TOKENS_PER_EVENT: u32 = 1 << 20;
/// Block hashes across a batch's events.
pub const MAX_HASHES_PER_BATCH: usize = 1 << 20;
/// Token ids across a batch's events.
pub const MAX_TOKENS_PER_BATCH: usize = 1 << 22;
/// A kept string: a LoRA name or a cache salt.
pub const MAX_STRING_BYTES: usize = 4096;
/// A hash sent as raw digest bytes (SHA-256 is 32, xxh3-128 is 16).
pub const MAX_HASH_BYTES: usize = 64;
/// Nesting of any value, skipped ones included (a vLLM multimodal extra key sits at depth 6).
pub const MAX_DEPTH: usize = 32;

/// Why a payload is not an event batch.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("payload of {len} bytes is over the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("payload ends inside a value (at byte {offset})")]
    Truncated { offset: usize },
    #[error("not msgpack at byte {offset}: {what}")]
    Malformed { offset: usize, what: &'static str },
    #[error("{extra} bytes follow the batch")]
    TrailingBytes { extra: usize },
    #[error("values nest deeper than {max} levels")]
    TooDeep { max: usize },
    #[error("{field}: expected {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    #[error("the batch has no {field}")]
    Missing { field: &'static str },
    #[error("{field}: {count} entries, over the limit of {max}")]
    TooMany {
        field: &'static str,
        count: u64,
        max: u64,
    },
    #[error("{field}: {value} is out of range")]
    OutOfRange { field: &'static str, value: i128 },
    #[error("{field}: a hash of {len} bytes (expected 1 to {max})")]
    HashBytes {
        field: &'static str,
        len: usize,
        max: usize,
    },
}

impl DecodeError {
    /// A short stable name for the kind of error, for a metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::Malformed { .. } => "malformed",
            DecodeError::TrailingBytes { .. } => "trailing_bytes",
            DecodeError::TooDeep { .. } => "too_deep",
            DecodeError::WrongType { .. } => "wrong_type",
            DecodeError::Missing { .. } => "missing",
            DecodeError::TooMany { .. } => "too_many",
            DecodeError::OutOfRange { .. } => "out_of_range",
            DecodeError::HashBytes { .. } => "hash_bytes",
        }
    }
}

type Result<T> = std::result::Result<T, DecodeError>;

/// One live or replayed payload → its batch.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            max: MAX_PAYLOAD_BYTES,
        });
    }
    let mut r = Reader::new(payload);
    let mut budget = Budget {
        hashes: MAX_HASHES_PER_BATCH,
        tokens: MAX_TOKENS_PER_BATCH,
    };
    let mut ts = None;
    let mut events = None;
    let mut rank = None;
    let mut unknown = 0u32;
    match r.head()? {
        Head::Array(n) => {
            for position in 0..n {
                match position {
                    0 => ts = Some(read_ts(&mut r)?),
                    1 => events = Some(read_events(&mut r, &mut budget, &mut unknown)?),
                    2 => rank = read_rank(&mut r)?,
                    _ => r.skip(2)?,
                }
            }
        }
        Head::Map(n) => {
            for _ in 0..n {
                match r.key(2)? {
                    Some(b"ts") => ts = Some(read_ts(&mut r)?),
                    Some(b"events") => {
                        events = Some(read_events(&mut r, &mut budget, &mut unknown)?);
                    }
                    Some(b"data_parallel_rank" | b"attn_dp_rank") => rank = read_rank(&mut r)?,
                    _ => r.skip(2)?,
                }
            }
        }
        _ => {
            return Err(DecodeError::WrongType {
                field: "batch",
                expected: "an array or a map",
            });
        }
    }
    let extra = r.left();
    if extra > 0 {
        return Err(DecodeError::TrailingBytes { extra });
    }
    Ok(EventBatch {
        ts: ts.ok_or(DecodeError::Missing { field: "ts" })?,
        events: events.ok_or(DecodeError::Missing { field: "events" })?,
        rank,
        unknown_events: unknown,
    })
}

/// What is left of the batch-wide caps.
struct Budget {
    hashes: usize,
    tokens: usize,
}

impl Budget {
    fn spend(left: &mut usize, n: usize, field: &'static str, max: usize) -> Result<()> {
        match left.checked_sub(n) {
            Some(rest) => {
                *left = rest;
                Ok(())
            }
            None => Err(DecodeError::TooMany {
                field,
                count: (max - *left + n) as u64,
                max: max as u64,
            }),
        }
    }
}

fn read_ts(r: &mut Reader<'_>) -> Result<f64> {
    match r.head()? {
        Head::Float(v) => Ok(v),
        Head::Uint(v) => Ok(v as f64),
        Head::Int(v) => Ok(v as f64),
        _ => Err(DecodeError::WrongType {
            field: "ts",
            expected: "a number",
        }),
    }
}

fn read_rank(r: &mut Reader<'_>) -> Result<Option<u32>> {
    match r.head()? {
        Head::Nil => Ok(None),
        Head::Uint(v) => u32::try_from(v)
            .map(Some)
            .map_err(|_| out_of_range("rank", i128::from(v))),
        Head::Int(v) => u32::try_from(v)
            .map(Some)
            .map_err(|_| out_of_range("rank", i128::from(v))),
        _ => Err(DecodeError::WrongType {
            field: "rank",
            expected: "an int or nil",
        }),
    }
}

fn out_of_range(field: &'static str, value: i128) -> DecodeError {
    DecodeError::OutOfRange { field, value }
}

fn read_events(r: &mut Reader<'_>, budget: &mut Budget, unknown: &mut u32) -> Result<Vec<KvEvent>> {
    let Head::Array(n) = r.head()? else {
        return Err(DecodeError::WrongType {
            field: "events",
            expected: "an array",
        });
    };
    check_count("events", n, MAX_EVENTS_PER_BATCH)?;
    let mut events = Vec::with_capacity(r.cap_for(n));
    for _ in 0..n {
        match read_event(r, budget)? {
            Some(event) => events.push(event),
            None => *unknown = unknown.saturating_add(1),
        }
    }
    Ok(events)
}

fn check_count(field: &'static str, n: u32, max: u32) -> Result<()> {
    if n > max {
        return Err(DecodeError::TooMany {
            field,
            count: u64::from(n),
            max: u64::from(max),
        });
    }
    Ok(())
}

/// Depths: the batch is 1, its fields 2, an event 3, an event's fields 4.
const EVENT_FIELD: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

fn tag_of(name: &[u8]) -> Option<Tag> {
    match name {
        b"BlockStored" => Some(Tag::Stored),
        b"BlockRemoved" => Some(Tag::Removed),
        b"AllBlocksCleared" => Some(Tag::Cleared),
        _ => None,
    }
}

/// One event, or `None` when it is skipped (unknown tag, a store that cannot be laid out).
fn read_event(r: &mut Reader<'_>, budget: &mut Budget) -> Result<Option<KvEvent>> {
    match r.head()? {
        Head::Array(n) => {
            if n == 0 {
                return Ok(None);
            }
            let tag = match r.head()? {
                Head::Str(name) => tag_of(name),
                _ => {
                    return Err(DecodeError::WrongType {
                        field: "event tag",
                        expected: "a string",
                    });
                }
            };
            let Some(tag) = tag else {
                r.skip_n(n - 1, EVENT_FIELD)?;
                return Ok(None);
            };
            let mut fields = Fields::default();
            for position in 1..n {
                fields.positional(r, tag, position, budget)?;
            }
            Ok(fields.finish(tag))
        }
        Head::Map(n) => {
            // Find the tag first (msgspec writes it first, but a map has no order), then decode.
            let mut scan = *r;
            let mut tag = None;
            for _ in 0..n {
                if scan.key(EVENT_FIELD)? == Some(b"type".as_slice()) {
                    match scan.peek()? {
                        Head::Str(name) => {
                            scan.head()?;
                            tag = tag_of(name);
                        }
                        _ => scan.skip(EVENT_FIELD)?,
                    }
                } else {
                    scan.skip(EVENT_FIELD)?;
                }
            }
            let Some(tag) = tag else {
                *r = scan;
                return Ok(None);
            };
            let mut fields = Fields::default();
            for _ in 0..n {
                match r.key(EVENT_FIELD)? {
                    Some(name) => fields.named(r, tag, name, budget)?,
                    None => r.skip(EVENT_FIELD)?,
                }
            }
            Ok(fields.finish(tag))
        }
        _ => Err(DecodeError::WrongType {
            field: "event",
            expected: "an array or a map",
        }),
    }
}

/// An event's fields as read, in either encoding; strings borrow from the payload.
#[derive(Default)]
struct Fields<'a> {
    hashes: Vec<u64>,
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u32,
    lora_id: bool,
    medium: Option<Medium>,
    lora_name: Kept<'a>,
    salt: Kept<'a>,
    keys: ExtraKeys<'a>,
    /// `kv_cache_spec_kind` is present and is not a full-attention layout.
    foreign_layout: bool,
}

/// A string field that is kept when it is usable.
#[derive(Default, Clone, Copy)]
enum Kept<'a> {
    #[default]
    Absent,
    Value(&'a str),
    /// Present but not UTF-8 or over `MAX_STRING_BYTES`: no request can name it.
    Unusable,
}

impl<'a> Kept<'a> {
    fn value(self) -> Option<&'a str> {
        match self {
            Kept::Value(s) => Some(s),
            _ => None,
        }
    }
}

impl<'a> Fields<'a> {
    fn positional(
        &mut self,
        r: &mut Reader<'a>,
        tag: Tag,
        position: u32,
        budget: &mut Budget,
    ) -> Result<()> {
        match (tag, position) {
            (Tag::Stored | Tag::Removed, 1) => self.hashes = read_hashes(r, budget)?,
            (Tag::Stored, 2) => self.parent = read_parent(r)?,
            (Tag::Stored, 3) => self.tokens = read_tokens(r, budget)?,
            (Tag::Stored, 4) => self.block_size = read_block_size(r)?,
            (Tag::Stored, 5) => self.lora_id = read_lora_id(r)?,
            (Tag::Stored, 6) | (Tag::Removed, 2) => self.medium = read_medium(r)?,
            // vLLM's `lora_name`, or SGLang's `BlockStoredWithMetadata` map: told apart by type.
            (Tag::Stored, 7) => match r.peek()? {
                Head::Map(_) => self.salt = read_metadata(r)?,
                _ => self.lora_name = read_kept(r, "lora_name")?,
            },
            (Tag::Stored, 8) => self.keys = read_extra_keys(r)?,
            (Tag::Stored, 10) => self.foreign_layout = read_spec_kind(r)?,
            _ => r.skip(EVENT_FIELD)?,
        }
        Ok(())
    }

    fn named(
        &mut self,
        r: &mut Reader<'a>,
        tag: Tag,
        name: &[u8],
        budget: &mut Budget,
    ) -> Result<()> {
        match (tag, name) {
            (Tag::Stored | Tag::Removed, b"block_hashes") => self.hashes = read_hashes(r, budget)?,
            (Tag::Stored, b"parent_block_hash") => self.parent = read_parent(r)?,
            (Tag::Stored, b"token_ids") => self.tokens = read_tokens(r, budget)?,
            (Tag::Stored, b"block_size") => self.block_size = read_block_size(r)?,
            (Tag::Stored, b"lora_id") => self.lora_id = read_lora_id(r)?,
            (Tag::Stored | Tag::Removed, b"medium") => self.medium = read_medium(r)?,
            (Tag::Stored, b"lora_name") => self.lora_name = read_kept(r, "lora_name")?,
            (Tag::Stored, b"cache_salt") => self.salt = read_kept(r, "cache_salt")?,
            (Tag::Stored, b"metadata") => self.salt = read_metadata(r)?,
            (Tag::Stored, b"extra_keys") => self.keys = read_extra_keys(r)?,
            (Tag::Stored, b"kv_cache_spec_kind") => self.foreign_layout = read_spec_kind(r)?,
            _ => r.skip(EVENT_FIELD)?,
        }
        Ok(())
    }

    fn finish(self, tag: Tag) -> Option<KvEvent> {
        let medium = self.medium.unwrap_or(Medium::Gpu);
        match tag {
            Tag::Cleared => Some(KvEvent::AllBlocksCleared),
            Tag::Removed => Some(KvEvent::BlockRemoved {
                hashes: self.hashes,
                medium,
            }),
            Tag::Stored => {
                if self.foreign_layout
                    || !laid_out(self.hashes.len(), self.tokens.len(), self.block_size)
                {
                    return None;
                }
                let lora_name = self.lora_name.value();
                let explicit_salt = self.salt.value();
                let (key_salt, keys_opaque) =
                    self.keys
                        .classify(lora_name, explicit_salt, self.parent.is_none());
                let unusable = matches!(self.lora_name, Kept::Unusable)
                    || matches!(self.salt, Kept::Unusable)
                    || (self.lora_id && lora_name.is_none());
                Some(KvEvent::BlockStored(BlockStored {
                    hashes: self.hashes,
                    parent: self.parent,
                    tokens: self.tokens,
                    block_size: self.block_size,
                    medium,
                    lora_name: lora_name.map(str::to_owned),
                    cache_salt: explicit_salt.or(key_salt).map(str::to_owned),
                    opaque_extra_keys: keys_opaque || unusable,
                }))
            }
        }
    }
}

/// `hashes[i]` covers `tokens[i * block_size ..][.. block_size]`, every block full but the last.
fn laid_out(blocks: usize, tokens: usize, block_size: u32) -> bool {
    let (blocks, tokens, size) = (blocks as u64, tokens as u64, u64::from(block_size));
    blocks > 0 && size > 0 && tokens > (blocks - 1) * size && tokens <= blocks * size
}

fn read_hashes(r: &mut Reader<'_>, budget: &mut Budget) -> Result<Vec<u64>> {
    let n = match r.head()? {
        Head::Nil => return Ok(Vec::new()),
        Head::Array(n) => n,
        _ => {
            return Err(DecodeError::WrongType {
                field: "block_hashes",
                expected: "an array",
            });
        }
    };
    check_count("block_hashes", n, MAX_HASHES_PER_EVENT)?;
    Budget::spend(
        &mut budget.hashes,
        n as usize,
        "block hashes in the batch",
        MAX_HASHES_PER_BATCH,
    )?;
    let mut hashes = Vec::with_capacity(r.cap_for(n));
    for _ in 0..n {
        hashes.push(read_hash(r, "block_hashes")?);
    }
    Ok(hashes)
}

fn read_parent(r: &mut Reader<'_>) -> Result<Option<u64>> {
    if let Head::Nil = r.peek()? {
        r.head()?;
        return Ok(None);
    }
    read_hash(r, "parent_block_hash").map(Some)
}

fn read_hash(r: &mut Reader<'_>, field: &'static str) -> Result<u64> {
    match r.head()? {
        Head::Uint(v) => Ok(v),
        Head::Int(v) => Ok(v as u64),
        Head::Bin(bytes) => {
            if bytes.is_empty() || bytes.len() > MAX_HASH_BYTES {
                return Err(DecodeError::HashBytes {
                    field,
                    len: bytes.len(),
                    max: MAX_HASH_BYTES,
                });
            }
            let tail = bytes.get(bytes.len().saturating_sub(8)..).unwrap_or(bytes);
            Ok(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
        }
        _ => Err(DecodeError::WrongType {
            field,
            expected: "an int or bytes",
        }),
    }
}

fn read_tokens(r: &mut Reader<'_>, budget: &mut Budget) -> Result<Vec<u32>> {
    let n = match r.head()? {
        Head::Nil => return Ok(Vec::new()),
        Head::Array(n) => n,
        _ => {
            return Err(DecodeError::WrongType {
                field: "token_ids",
                expected: "an array",
            });
        }
    };
    check_count("token_ids", n, MAX_TOKENS_PER_EVENT)?;
    Budget::spend(
        &mut budget.tokens,
        n as usize,
        "token ids in the batch",
        MAX_TOKENS_PER_BATCH,
    )?;
    let mut tokens = Vec::with_capacity(r.cap_for(n));
    for _ in 0..n {
        let token = match r.head()? {
            // SGLang's EAGLE bigram pair: (this position's token, the next one's).
            Head::Array(k) if k > 0 => {
                let token = read_token(r)?;
                r.skip_n(k - 1, EVENT_FIELD + 2)?;
                token
            }
            Head::Uint(v) => {
                u32::try_from(v).map_err(|_| out_of_range("token_ids", i128::from(v)))?
            }
            Head::Int(v) => {
                u32::try_from(v).map_err(|_| out_of_range("token_ids", i128::from(v)))?
            }
            _ => {
                return Err(DecodeError::WrongType {
                    field: "token_ids",
                    expected: "ints or non-empty [token, next] pairs",
                });
            }
        };
        tokens.push(token);
    }
    Ok(tokens)
}

fn read_token(r: &mut Reader<'_>) -> Result<u32> {
    match r.head()? {
        Head::Uint(v) => u32::try_from(v).map_err(|_| out_of_range("token_ids", i128::from(v))),
        Head::Int(v) => u32::try_from(v).map_err(|_| out_of_range("token_ids", i128::from(v))),
        _ => Err(DecodeError::WrongType {
            field: "token_ids",
            expected: "an int as a pair's first element",
        }),
    }
}

fn read_block_size(r: &mut Reader<'_>) -> Result<u32> {
    match r.head()? {
        Head::Nil => Ok(0),
        Head::Uint(v) => u32::try_from(v).map_err(|_| out_of_range("block_size", i128::from(v))),
        Head::Int(v) => u32::try_from(v).map_err(|_| out_of_range("block_size", i128::from(v))),
        _ => Err(DecodeError::WrongType {
            field: "block_size",
            expected: "an int",
        }),
    }
}

/// Whether an adapter id is given; its value names nothing outside the engine.
fn read_lora_id(r: &mut Reader<'_>) -> Result<bool> {
    match r.head()? {
        Head::Nil => Ok(false),
        Head::Uint(_) | Head::Int(_) => Ok(true),
        _ => Err(DecodeError::WrongType {
            field: "lora_id",
            expected: "an int or nil",
        }),
    }
}

fn read_medium(r: &mut Reader<'_>) -> Result<Option<Medium>> {
    match r.head()? {
        Head::Nil => Ok(None),
        Head::Str(name) => Ok(Some(medium_of(name))),
        _ => Err(DecodeError::WrongType {
            field: "medium",
            expected: "a string or nil",
        }),
    }
}

fn medium_of(name: &[u8]) -> Medium {
    if name.eq_ignore_ascii_case(b"GPU") {
        Medium::Gpu
    } else if name.eq_ignore_ascii_case(b"CPU") || name.eq_ignore_ascii_case(b"CPU_PINNED") {
        Medium::Cpu
    } else if name.eq_ignore_ascii_case(b"DISK") {
        Medium::Disk
    } else {
        Medium::Other
    }
}

/// Whether `kv_cache_spec_kind` names a cache group whose events do not follow the full-attention
/// layout of one hash per `block_size` tokens.
fn read_spec_kind(r: &mut Reader<'_>) -> Result<bool> {
    match r.head()? {
        Head::Nil => Ok(false),
        Head::Str(kind) => Ok(!matches!(
            kind,
            b"full_attention" | b"mla_attention" | b"sink_full_attention"
        )),
        _ => Err(DecodeError::WrongType {
            field: "kv_cache_spec_kind",
            expected: "a string or nil",
        }),
    }
}

fn read_kept<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<Kept<'a>> {
    match r.head()? {
        Head::Nil => Ok(Kept::Absent),
        Head::Str(bytes) => Ok(kept(bytes)),
        _ => Err(DecodeError::WrongType {
            field,
            expected: "a string or nil",
        }),
    }
}

fn kept(bytes: &[u8]) -> Kept<'_> {
    match std::str::from_utf8(bytes) {
        Ok(s) if s.len() <= MAX_STRING_BYTES => Kept::Value(s),
        _ => Kept::Unusable,
    }
}

/// SGLang's `BlockStoredMetadata`: `{"cache_salt": s}`; other keys are skipped.
fn read_metadata<'a>(r: &mut Reader<'a>) -> Result<Kept<'a>> {
    let n = match r.head()? {
        Head::Nil => return Ok(Kept::Absent),
        Head::Map(n) => n,
        _ => {
            return Err(DecodeError::WrongType {
                field: "metadata",
                expected: "a map or nil",
            });
        }
    };
    let mut salt = Kept::Absent;
    for _ in 0..n {
        match r.key(EVENT_FIELD + 1)? {
            Some(b"cache_salt") => salt = read_kept(r, "cache_salt")?,
            _ => r.skip(EVENT_FIELD + 1)?,
        }
    }
    Ok(salt)
}

#[cfg(test)]
mod tests;

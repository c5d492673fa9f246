//! One batch of model events → the msgpack `EventBatch` payload of a format (layouts in the module
//! docs above). Written with `rmpv` by hand, not shared with any decoder: these bytes are the
//! simulator's reading of the engines' sources.

use rmpv::Value;

use crate::cache::CacheEvent;
use crate::config::KvEventsFormat;

/// `medium` of every event: the simulator has no offload tiers.
const MEDIUM: &str = "GPU";
/// vLLM's `kv_cache_spec_kind` of a plain decoder's only KV cache group.
const SPEC_KIND: &str = "full_attention";

/// The payload of one batch published by `rank` at `ts` (seconds since the epoch).
pub fn encode_batch(
    format: KvEventsFormat,
    ts: f64,
    rank: u32,
    block_size: u32,
    events: &[CacheEvent],
) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(events.len());
    for event in events {
        match format {
            KvEventsFormat::VllmArray => encoded.push(vllm_array(event, block_size)),
            KvEventsFormat::VllmMap => encoded.push(vllm_map(event, block_size)),
            KvEventsFormat::Sglang => sglang(event, block_size, &mut encoded),
        }
    }
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(encoded),
        Value::from(rank),
    ]);
    let mut bytes = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut bytes, &batch);
    bytes
}

fn str(text: &str) -> Value {
    Value::from(text)
}

fn vllm_hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|hash| Value::from(*hash)).collect())
}

fn tokens(tokens: &[u32]) -> Value {
    Value::Array(tokens.iter().map(|token| Value::from(*token)).collect())
}

/// SGLang hashes are signed: the first 8 bytes of a sha256 read as an `i64`; here the simulator's
/// hash reinterpreted the same way.
fn sglang_hash(hash: u64) -> Value {
    Value::from(i64::from_ne_bytes(hash.to_ne_bytes()))
}

fn vllm_array(event: &CacheEvent, block_size: u32) -> Value {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            tokens: ids,
        } => Value::Array(vec![
            str("BlockStored"),
            vllm_hashes(hashes),
            parent.map_or(Value::Nil, Value::from),
            tokens(ids),
            Value::from(block_size),
            Value::Nil, // lora_id
            str(MEDIUM),
            Value::Nil,        // lora_name
            Value::Nil,        // extra_keys
            Value::from(0u32), // group_idx
            str(SPEC_KIND),
            Value::Nil, // kv_cache_spec_sliding_window
        ]),
        CacheEvent::Removed { hashes } => Value::Array(vec![
            str("BlockRemoved"),
            vllm_hashes(hashes),
            str(MEDIUM),
            Value::from(0u32), // group_idx
        ]),
        CacheEvent::AllCleared => Value::Array(vec![str("AllBlocksCleared")]),
    }
}

fn vllm_map(event: &CacheEvent, block_size: u32) -> Value {
    let entries: Vec<(Value, Value)> = match event {
        CacheEvent::Stored {
            hashes,
            parent,
            tokens: ids,
        } => vec![
            (str("type"), str("BlockStored")),
            (str("block_hashes"), vllm_hashes(hashes)),
            (
                str("parent_block_hash"),
                parent.map_or(Value::Nil, Value::from),
            ),
            (str("token_ids"), tokens(ids)),
            (str("block_size"), Value::from(block_size)),
            // No default in vLLM's struct, so present even when nil.
            (str("lora_id"), Value::Nil),
            (str("medium"), str(MEDIUM)),
            (str("lora_name"), Value::Nil),
            // One entry per block, none for a plain prompt: vLLM 0.32's `to_event_extra_keys`.
            (
                str("extra_keys"),
                Value::Array(vec![Value::Nil; hashes.len()]),
            ),
            // event_version and the sliding window are at their defaults: left out.
            (str("group_idx"), Value::from(0u32)),
            (str("kv_cache_spec_kind"), str(SPEC_KIND)),
        ],
        CacheEvent::Removed { hashes } => vec![
            (str("type"), str("BlockRemoved")),
            (str("block_hashes"), vllm_hashes(hashes)),
            (str("medium"), str(MEDIUM)),
            (str("group_idx"), Value::from(0u32)),
        ],
        CacheEvent::AllCleared => vec![(str("type"), str("AllBlocksCleared"))],
    };
    Value::Map(entries)
}

/// SGLang's radix cache reports each page it inserts as its own `BlockStored`.
fn sglang(event: &CacheEvent, block_size: u32, out: &mut Vec<Value>) {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            tokens: ids,
        } => {
            let size = usize::try_from(block_size).unwrap_or(usize::MAX).max(1);
            let mut parent = *parent;
            for (hash, page) in hashes.iter().zip(ids.chunks(size)) {
                out.push(Value::Array(vec![
                    str("BlockStored"),
                    Value::Array(vec![sglang_hash(*hash)]),
                    parent.map_or(Value::Nil, sglang_hash),
                    tokens(page),
                    Value::from(block_size),
                    Value::Nil, // lora_id
                    str(MEDIUM),
                ]));
                parent = Some(*hash);
            }
        }
        CacheEvent::Removed { hashes } => out.push(Value::Array(vec![
            str("BlockRemoved"),
            Value::Array(hashes.iter().map(|hash| sglang_hash(*hash)).collect()),
            str(MEDIUM),
        ])),
        CacheEvent::AllCleared => out.push(Value::Array(vec![str("AllBlocksCleared")])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> Value {
        let mut reader = bytes;
        let value = rmpv::decode::read_value(&mut reader).unwrap();
        assert!(reader.is_empty(), "trailing bytes");
        value
    }

    fn stored() -> Vec<CacheEvent> {
        vec![
            CacheEvent::Removed {
                hashes: vec![u64::MAX, 7],
            },
            CacheEvent::Stored {
                hashes: vec![10, 0x8000_0000_0000_0001],
                parent: Some(9),
                tokens: vec![1, 2, 3, 4],
            },
            CacheEvent::AllCleared,
        ]
    }

    #[test]
    fn vllm_array_batches_carry_the_full_modern_layout() {
        let batch = decode(&encode_batch(
            KvEventsFormat::VllmArray,
            1.5,
            2,
            2,
            &stored(),
        ));
        let expected = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    str("BlockRemoved"),
                    Value::Array(vec![Value::from(u64::MAX), Value::from(7u64)]),
                    str("GPU"),
                    Value::from(0),
                ]),
                Value::Array(vec![
                    str("BlockStored"),
                    Value::Array(vec![
                        Value::from(10u64),
                        Value::from(0x8000_0000_0000_0001u64),
                    ]),
                    Value::from(9u64),
                    Value::Array((1..=4).map(Value::from).collect()),
                    Value::from(2),
                    Value::Nil,
                    str("GPU"),
                    Value::Nil,
                    Value::Nil,
                    Value::from(0),
                    str("full_attention"),
                    Value::Nil,
                ]),
                Value::Array(vec![str("AllBlocksCleared")]),
            ]),
            Value::from(2),
        ]);
        assert_eq!(batch, expected);
    }

    #[test]
    fn vllm_map_events_leave_their_defaults_out() {
        let batch = decode(&encode_batch(
            KvEventsFormat::VllmMap,
            0.25,
            0,
            2,
            &stored(),
        ));
        let events = batch[1].as_array().unwrap();
        let keys = |event: &Value| -> Vec<String> {
            event
                .as_map()
                .unwrap()
                .iter()
                .map(|(key, _)| key.as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(
            keys(&events[1]),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
        assert_eq!(
            keys(&events[0]),
            ["type", "block_hashes", "medium", "group_idx"]
        );
        assert_eq!(
            events[2],
            Value::Map(vec![(str("type"), str("AllBlocksCleared"))])
        );
        assert_eq!(batch[2], Value::from(0));
    }

    #[test]
    fn sglang_stores_one_event_per_page_with_signed_hashes() {
        let batch = decode(&encode_batch(KvEventsFormat::Sglang, 3.0, 1, 2, &stored()));
        let events = batch[1].as_array().unwrap();
        assert_eq!(events.len(), 4, "{events:?}");
        assert_eq!(
            events[0],
            Value::Array(vec![
                str("BlockRemoved"),
                Value::Array(vec![Value::from(-1i64), Value::from(7i64)]),
                str("GPU"),
            ])
        );
        assert_eq!(
            events[1],
            Value::Array(vec![
                str("BlockStored"),
                Value::Array(vec![Value::from(10i64)]),
                Value::from(9i64),
                Value::Array(vec![Value::from(1), Value::from(2)]),
                Value::from(2),
                Value::Nil,
                str("GPU"),
            ])
        );
        assert_eq!(events[2][1][0].as_i64(), Some(i64::MIN + 1));
        assert_eq!(
            events[2][2].as_i64(),
            Some(10),
            "the previous page is the parent"
        );
        assert_eq!(events[3], Value::Array(vec![str("AllBlocksCleared")]));
    }
}

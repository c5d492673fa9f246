//! Payloads are built with `rmpv::encode` in the engines' shapes (see the module docs for the sources).

use rmpv::Value;

use super::*;

fn enc(value: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, value).unwrap();
    buf
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn a(items: Vec<Value>) -> Value {
    Value::Array(items)
}

fn m(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints<T: Into<Value> + Copy>(values: &[T]) -> Value {
    a(values.iter().map(|v| (*v).into()).collect())
}

const NIL: Value = Value::Nil;

/// An array batch `[ts, events, rank]`.
fn batch(events: Vec<Value>) -> Vec<u8> {
    enc(&a(vec![
        Value::from(1700000000.5),
        a(events),
        Value::from(0),
    ]))
}

fn decode(events: Vec<Value>) -> EventBatch {
    decode_batch(&batch(events)).unwrap()
}

fn stored(event: &KvEvent) -> &BlockStored {
    match event {
        KvEvent::BlockStored(stored) => stored,
        other => panic!("not a BlockStored: {other:?}"),
    }
}

fn one_stored(events: Vec<Value>) -> BlockStored {
    let batch = decode(events);
    assert_eq!(batch.events.len(), 1, "{batch:?}");
    assert_eq!(batch.unknown_events, 0);
    stored(&batch.events[0]).clone()
}

/// vLLM's positional `BlockStored` with every field through `kv_cache_spec_sliding_window`.
#[allow(clippy::too_many_arguments)]
fn vllm_stored(
    hashes: Value,
    parent: Value,
    tokens: &[u32],
    block_size: u32,
    medium: Value,
    lora_name: Value,
    extra_keys: Value,
) -> Value {
    a(vec![
        s("BlockStored"),
        hashes,
        parent,
        ints(tokens),
        Value::from(block_size),
        NIL,
        medium,
        lora_name,
        extra_keys,
        Value::from(0),
        s("full_attention"),
        NIL,
    ])
}

fn range(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

#[test]
fn vllm_array_with_every_position() {
    let batch = decode_batch(&enc(&a(vec![
        Value::from(12.25),
        a(vec![vllm_stored(
            ints(&[u64::MAX, 7]),
            NIL,
            &range(8),
            4,
            s("GPU"),
            NIL,
            a(vec![NIL, NIL]),
        )]),
        Value::from(3),
    ])))
    .unwrap();
    assert_eq!(batch.ts, 12.25);
    assert_eq!(batch.rank, Some(3));
    assert_eq!(batch.unknown_events, 0);
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockStored(BlockStored {
            hashes: vec![u64::MAX, 7],
            parent: None,
            tokens: range(8),
            block_size: 4,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            opaque_extra_keys: false,
        })]
    );
}

#[test]
fn old_vllm_arrays_stop_after_lora_id_and_batches_after_events() {
    let payload = enc(&a(vec![
        Value::from(1),
        a(vec![a(vec![
            s("BlockStored"),
            ints(&[5u64]),
            Value::from(4u64),
            ints(&[9u32, 8, 7, 6]),
            Value::from(4),
            NIL,
        ])]),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.ts, 1.0);
    assert_eq!(batch.rank, None);
    let stored = stored(&batch.events[0]);
    assert_eq!(stored.hashes, vec![5]);
    assert_eq!(stored.parent, Some(4));
    assert_eq!(stored.tokens, vec![9, 8, 7, 6]);
    assert_eq!(stored.medium, Medium::Gpu);
    assert_eq!(stored.lora_name, None);
    assert!(!stored.opaque_extra_keys);
}

#[test]
fn extra_positions_are_skipped() {
    let mut event = vllm_stored(ints(&[1u64]), NIL, &range(2), 2, s("GPU"), NIL, NIL);
    if let Value::Array(items) = &mut event {
        items.push(m(vec![("future", a(vec![a(vec![NIL])]))]));
        items.push(Value::from(99));
    }
    let payload = enc(&a(vec![
        Value::from(1.0),
        a(vec![event, a(vec![s("AllBlocksCleared"), NIL, s("x")])]),
        NIL,
        s("a future batch field"),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.events.len(), 2);
    assert_eq!(batch.events[1], KvEvent::AllBlocksCleared);
}

#[test]
fn vllm_map_form_with_omitted_defaults() {
    let payload = enc(&m(vec![
        ("ts", Value::from(99.5)),
        (
            "events",
            a(vec![
                m(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", ints(&[10u64, 11])),
                    ("parent_block_hash", Value::from(9u64)),
                    ("token_ids", ints(&range(32))),
                    ("block_size", Value::from(16)),
                    ("lora_id", NIL),
                    ("medium", s("CPU")),
                    ("lora_name", NIL),
                ]),
                m(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", ints(&[10u64])),
                    ("medium", s("GPU")),
                ]),
                m(vec![("type", s("AllBlocksCleared"))]),
            ]),
        ),
        ("data_parallel_rank", Value::from(2)),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.ts, 99.5);
    assert_eq!(batch.rank, Some(2));
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                hashes: vec![10, 11],
                parent: Some(9),
                tokens: range(32),
                block_size: 16,
                medium: Medium::Cpu,
                lora_name: None,
                cache_salt: None,
                opaque_extra_keys: false,
            }),
            KvEvent::BlockRemoved {
                hashes: vec![10],
                medium: Medium::Gpu,
            },
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn map_events_take_the_tag_anywhere_and_ignore_unknown_keys() {
    let event = m(vec![
        ("session_id", s("req-1")),
        ("block_hashes", ints(&[3u64])),
        ("token_ids", ints(&[1u32, 2])),
        ("locality", m(vec![("zone", a(vec![Value::from(1)]))])),
        ("block_size", Value::from(2)),
        ("group_idx", Value::from(0)),
        ("type", s("BlockStored")),
    ]);
    let stored = one_stored(vec![event]);
    assert_eq!(stored.hashes, vec![3]);
    assert_eq!(stored.tokens, vec![1, 2]);
    assert_eq!(stored.parent, None);
    assert_eq!(stored.medium, Medium::Gpu);
}

#[test]
fn map_batch_takes_sglang_rank_name() {
    let payload = enc(&m(vec![
        ("attn_dp_rank", Value::from(1)),
        ("events", a(vec![])),
        ("ts", Value::from(5)),
        ("future", m(vec![])),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(
        (batch.ts, batch.rank, batch.events.len()),
        (5.0, Some(1), 0)
    );
}

#[test]
fn hash_forms_map_to_u64() {
    let mut digest = [0u8; 32];
    for (i, b) in digest.iter_mut().enumerate() {
        *b = i as u8;
    }
    let hashes = a(vec![
        Value::from(u64::MAX - 1),
        Value::from(1u64 << 63),
        Value::from(-2i64),
        Value::from(i64::MIN),
        Value::Binary(digest.to_vec()),
        Value::Binary(vec![0x01, 0x02]),
    ]);
    let stored = one_stored(vec![vllm_stored(
        hashes,
        Value::Binary(vec![0xff; 16]),
        &range(6),
        1,
        s("GPU"),
        NIL,
        NIL,
    )]);
    assert_eq!(
        stored.hashes,
        vec![
            u64::MAX - 1,
            1 << 63,
            (-2i64) as u64,
            1 << 63,
            0x18191a1b1c1d1e1f,
            0x0102,
        ]
    );
    assert_eq!(stored.parent, Some(u64::MAX));
}

#[test]
fn hash_bytes_out_of_bounds_are_errors() {
    for len in [0usize, MAX_HASH_BYTES + 1] {
        let event = vllm_stored(
            a(vec![Value::Binary(vec![1; len])]),
            NIL,
            &[1],
            1,
            NIL,
            NIL,
            NIL,
        );
        assert_eq!(
            decode_batch(&batch(vec![event])).unwrap_err(),
            DecodeError::HashBytes {
                field: "block_hashes",
                len,
                max: MAX_HASH_BYTES
            }
        );
    }
    let event = vllm_stored(a(vec![s("abc")]), NIL, &[1], 1, NIL, NIL, NIL);
    assert_eq!(
        decode_batch(&batch(vec![event])).unwrap_err().reason(),
        "wrong_type"
    );
}

#[test]
fn vllm_salt_is_the_one_other_string_of_a_root_block() {
    let keys = a(vec![
        a(vec![s("adapter"), s("tenant-a")]),
        a(vec![s("adapter")]),
    ]);
    let stored = one_stored(vec![vllm_stored(
        ints(&[1u64, 2]),
        NIL,
        &range(4),
        2,
        s("GPU"),
        s("adapter"),
        keys,
    )]);
    assert_eq!(stored.lora_name.as_deref(), Some("adapter"));
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-a"));
    assert!(!stored.opaque_extra_keys);

    // Without an adapter the salt stands alone.
    let keys = a(vec![a(vec![s("tenant-b")]), NIL]);
    let stored = one_stored(vec![vllm_stored(
        ints(&[1u64, 2]),
        NIL,
        &range(4),
        2,
        s("GPU"),
        NIL,
        keys,
    )]);
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-b"));
    assert!(!stored.opaque_extra_keys);
}

#[test]
fn vllm_other_extra_keys_are_opaque() {
    let cases: Vec<(&str, Value, Value, Option<&str>)> = vec![
        // A multimodal (identifier, offset) pair beside the salt.
        (
            "mm pair",
            NIL,
            a(vec![a(vec![
                a(vec![s("img-hash"), Value::from(3)]),
                s("salt"),
            ])]),
            Some("salt"),
        ),
        // A prompt-embeds digest.
        (
            "embeds",
            NIL,
            a(vec![a(vec![Value::Binary(vec![7; 32])])]),
            None,
        ),
        // Two strings that are not the adapter: which one is the salt is unknown.
        ("two strings", NIL, a(vec![a(vec![s("x"), s("y")])]), None),
        // A string in a block that is not a root: salts only ride on a prompt's first block.
        (
            "non-root string",
            Value::from(77u64),
            a(vec![a(vec![s("salt")])]),
            None,
        ),
        (
            "later block string",
            NIL,
            a(vec![NIL, a(vec![s("mm")])]),
            None,
        ),
    ];
    for (name, parent, keys, salt) in cases {
        let stored = one_stored(vec![vllm_stored(
            ints(&[1u64, 2]),
            parent,
            &range(4),
            2,
            s("GPU"),
            NIL,
            keys,
        )]);
        assert!(stored.opaque_extra_keys, "{name}");
        assert_eq!(stored.cache_salt.as_deref(), salt, "{name}");
    }
}

#[test]
fn adapters_that_cannot_be_named_are_opaque() {
    // Old vLLM: a lora_id and no lora_name.
    let mut event = vllm_stored(ints(&[1u64]), NIL, &[1], 1, s("GPU"), NIL, NIL);
    if let Value::Array(items) = &mut event {
        items[5] = Value::from(4);
    }
    assert!(one_stored(vec![event]).opaque_extra_keys);
    // A salt over the string cap is dropped, and the blocks are opaque.
    let long = "s".repeat(MAX_STRING_BYTES + 1);
    let event = a(vec![
        s("BlockStored"),
        ints(&[1u64]),
        NIL,
        ints(&[1u32]),
        Value::from(1),
        NIL,
        s("GPU"),
        m(vec![("cache_salt", s(&long))]),
    ]);
    let stored = one_stored(vec![event]);
    assert_eq!(stored.cache_salt, None);
    assert!(stored.opaque_extra_keys);
}

#[test]
fn sglang_event_with_salt_map_and_medium() {
    let event = a(vec![
        s("BlockStored"),
        ints(&[-5i64]),
        Value::from(-6i64),
        ints(&range(16)),
        Value::from(16),
        NIL,
        s("CPU_PINNED"),
        m(vec![("cache_salt", s("tenant-z"))]),
    ]);
    let payload = enc(&a(vec![Value::from(3.0), a(vec![event]), Value::from(1)]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.rank, Some(1));
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockStored(BlockStored {
            hashes: vec![(-5i64) as u64],
            parent: Some((-6i64) as u64),
            tokens: range(16),
            block_size: 16,
            medium: Medium::Cpu,
            lora_name: None,
            cache_salt: Some("tenant-z".to_owned()),
            opaque_extra_keys: false,
        })]
    );
}

#[test]
fn sglang_map_events_carry_the_salt_as_a_field() {
    let event = m(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1i64])),
        ("parent_block_hash", NIL),
        ("token_ids", ints(&[4u32, 5])),
        ("block_size", Value::from(2)),
        ("lora_id", NIL),
        ("medium", s("DISK")),
        ("cache_salt", s("t")),
        ("session_id", s("sess")),
    ]);
    let stored = one_stored(vec![event]);
    assert_eq!(stored.cache_salt.as_deref(), Some("t"));
    assert_eq!(stored.medium, Medium::Disk);
}

#[test]
fn sglang_old_events_have_no_medium_and_partial_last_pages() {
    // One event per page: the last page of a prompt is short, and says so in its block_size.
    let page = a(vec![
        s("BlockStored"),
        ints(&[42i64]),
        Value::from(41i64),
        ints(&[1u32, 2, 3]),
        Value::from(3),
        NIL,
    ]);
    let stored = one_stored(vec![page]);
    assert_eq!((stored.tokens.len(), stored.block_size), (3, 3));
    assert_eq!(stored.medium, Medium::Gpu);
    // Coalesced pages: full pages of 4, then a last page of 1.
    let pages = a(vec![
        s("BlockStored"),
        ints(&[1i64, 2, 3]),
        NIL,
        ints(&range(9)),
        Value::from(4),
        NIL,
        s("GPU"),
    ]);
    let stored = one_stored(vec![pages]);
    assert_eq!(stored.hashes.len(), 3);
    assert_eq!(stored.tokens, range(9));
}

#[test]
fn sglang_bigram_pairs_keep_each_positions_own_token() {
    let pairs = a(vec![
        ints(&[10u32, 11]),
        ints(&[11u32, 12]),
        ints(&[12u32, 13]),
    ]);
    let event = a(vec![
        s("BlockStored"),
        ints(&[1i64]),
        NIL,
        pairs,
        Value::from(3),
        NIL,
        s("GPU"),
    ]);
    assert_eq!(one_stored(vec![event]).tokens, vec![10, 11, 12]);
    let empty_pair = a(vec![
        s("BlockStored"),
        ints(&[1i64]),
        NIL,
        a(vec![a(vec![])]),
        Value::from(1),
    ]);
    assert_eq!(
        decode_batch(&batch(vec![empty_pair])).unwrap_err().reason(),
        "wrong_type"
    );
}

#[test]
fn media() {
    let cases = [
        (s("GPU"), Medium::Gpu),
        (s("gpu"), Medium::Gpu),
        (NIL, Medium::Gpu),
        (s("CPU"), Medium::Cpu),
        (s("CPU_PINNED"), Medium::Cpu),
        (s("DISK"), Medium::Disk),
        (s("EXTERNAL"), Medium::Other),
        (s("NVME-OF"), Medium::Other),
    ];
    for (wire, medium) in cases {
        let removed = a(vec![
            s("BlockRemoved"),
            ints(&[1u64]),
            wire.clone(),
            Value::from(1),
        ]);
        assert_eq!(
            decode(vec![removed]).events,
            vec![KvEvent::BlockRemoved {
                hashes: vec![1],
                medium
            }],
            "{wire}"
        );
    }
    let removed = a(vec![s("BlockRemoved"), ints(&[1u64])]);
    assert_eq!(
        decode(vec![removed]).events,
        vec![KvEvent::BlockRemoved {
            hashes: vec![1],
            medium: Medium::Gpu
        }]
    );
}

#[test]
fn unknown_events_are_skipped_and_counted() {
    let events = vec![
        a(vec![
            s("BlockPinned"),
            a(vec![a(vec![ints(&[1u32])])]),
            m(vec![]),
        ]),
        m(vec![("type", s("LoadStat")), ("n", Value::from(1))]),
        m(vec![("block_hashes", ints(&[1u64]))]),
        // A tag that is not a string, with a value to skip past.
        m(vec![("type", ints(&[1u32, 2, 3])), ("x", s("y"))]),
        a(vec![]),
        a(vec![s("AllBlocksCleared")]),
    ];
    let batch = decode(events);
    assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(batch.unknown_events, 5);
}

#[test]
fn stores_that_cannot_be_laid_out_are_skipped_and_counted() {
    let sliding = |kind: &str, hashes: Value, tokens: &[u32]| {
        let mut event = vllm_stored(hashes, NIL, tokens, 4, s("GPU"), NIL, NIL);
        if let Value::Array(items) = &mut event {
            items[9] = Value::from(1);
            items[10] = s(kind);
            items[11] = Value::from(128);
        }
        event
    };
    let events = vec![
        // vLLM sliding-window groups: no hashes, or hashes for the window's last blocks only.
        sliding("sliding_window", a(vec![]), &range(8)),
        sliding("sliding_window", ints(&[9u64]), &range(24)),
        // Even when it looks laid out, a sliding-window or Mamba group is not a prefix.
        sliding("mamba", ints(&[9u64]), &range(4)),
        // Tokens for more blocks than hashes; a zero block size; nothing stored.
        vllm_stored(ints(&[1u64]), NIL, &range(5), 4, NIL, NIL, NIL),
        vllm_stored(ints(&[1u64]), NIL, &range(4), 0, NIL, NIL, NIL),
        vllm_stored(a(vec![]), NIL, &[], 4, NIL, NIL, NIL),
        // Kept: a full-attention kind and an MLA one.
        sliding("full_attention", ints(&[9u64]), &range(4)),
        sliding("mla_attention", ints(&[9u64, 10]), &range(5)),
    ];
    let batch = decode(events);
    assert_eq!(batch.unknown_events, 6);
    assert_eq!(batch.events.len(), 2);
}

#[test]
fn malformed_inputs_are_typed_errors() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "truncated"),
        (enc(&Value::from(1)), "wrong_type"),
        (enc(&a(vec![Value::from(1.0)])), "missing"),
        (enc(&m(vec![("events", a(vec![]))])), "missing"),
        (enc(&a(vec![s("now"), a(vec![])])), "wrong_type"),
        (enc(&a(vec![Value::from(1.0), m(vec![])])), "wrong_type"),
        (
            enc(&a(vec![Value::from(1.0), a(vec![Value::from(1)])])),
            "wrong_type",
        ),
        (
            enc(&a(vec![Value::from(1.0), a(vec![a(vec![Value::from(1)])])])),
            "wrong_type",
        ),
        (
            enc(&a(vec![Value::from(1.0), a(vec![]), Value::from(-1)])),
            "out_of_range",
        ),
        (
            enc(&a(vec![
                Value::from(1.0),
                a(vec![]),
                Value::from(1u64 << 32),
            ])),
            "out_of_range",
        ),
        (
            enc(&a(vec![Value::from(1.0), a(vec![]), s("0")])),
            "wrong_type",
        ),
        (vec![0x92, 0xc1, 0x90], "malformed"),
        ([batch(vec![]), vec![0xc0]].concat(), "trailing_bytes"),
    ];
    for (payload, reason) in cases {
        assert_eq!(
            decode_batch(&payload).unwrap_err().reason(),
            reason,
            "{payload:02x?}"
        );
    }
    for token in [Value::from(1u64 << 32), Value::from(-1)] {
        let event = a(vec![
            s("BlockStored"),
            ints(&[1u64]),
            NIL,
            a(vec![token]),
            Value::from(1),
        ]);
        assert_eq!(
            decode_batch(&batch(vec![event])).unwrap_err().reason(),
            "out_of_range"
        );
    }
}

#[test]
fn every_truncation_of_a_valid_payload_is_an_error() {
    let payload = batch(vec![
        vllm_stored(
            ints(&[u64::MAX, 1 << 40]),
            Value::Binary(vec![3; 32]),
            &[70_000, 1, 2, 300],
            2,
            s("CPU"),
            s("lora"),
            a(vec![
                a(vec![s("lora"), a(vec![s("mm"), Value::from(0)])]),
                NIL,
            ]),
        ),
        a(vec![s("BlockRemoved"), ints(&[-1i64]), s("GPU")]),
        a(vec![s("AllBlocksCleared")]),
    ]);
    decode_batch(&payload).unwrap();
    for len in 0..payload.len() {
        let err = decode_batch(&payload[..len]).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
}

/// A header declaring `n` elements of an array (0xdd) or bytes of a string (0xdb).
fn header32(marker: u8, n: u32) -> Vec<u8> {
    let mut out = vec![marker];
    out.extend_from_slice(&n.to_be_bytes());
    out
}

#[test]
fn absurd_declared_lengths_fail_before_allocating() {
    // [1.0, <4 billion events>] in 10 bytes.
    let events = [vec![0x92, 0x01], header32(0xdd, u32::MAX)].concat();
    assert_eq!(
        decode_batch(&events).unwrap_err(),
        DecodeError::TooMany {
            field: "events",
            count: u64::from(u32::MAX),
            max: u64::from(MAX_EVENTS_PER_BATCH)
        }
    );
    // Under the cap but not there: the reserve is bounded by the bytes left, then it is truncated.
    let events = [vec![0x92, 0x01], header32(0xdd, MAX_EVENTS_PER_BATCH)].concat();
    assert_eq!(decode_batch(&events).unwrap_err().reason(), "truncated");
    // A token array and a hash array over their caps.
    let event = |field: u8, n: u32| {
        let mut out = vec![0x92, 0x01, 0x91, 0x95, 0xab];
        out.extend_from_slice(b"BlockStored");
        if field == 3 {
            out.extend_from_slice(&[0x90, 0xc0]);
        }
        out.extend(header32(0xdd, n));
        out
    };
    assert_eq!(
        decode_batch(&event(3, MAX_TOKENS_PER_EVENT + 1))
            .unwrap_err()
            .reason(),
        "too_many"
    );
    assert_eq!(
        decode_batch(&event(1, MAX_HASHES_PER_EVENT + 1))
            .unwrap_err()
            .reason(),
        "too_many"
    );
    // A 4 GiB string as an unknown map key's value, and as a tag.
    let big_str = [vec![0x82, 0xa1, b'x'], header32(0xdb, u32::MAX)].concat();
    assert_eq!(decode_batch(&big_str).unwrap_err().reason(), "truncated");
    // A map declaring 4 billion pairs.
    let big_map = header32(0xdf, u32::MAX);
    assert_eq!(decode_batch(&big_map).unwrap_err().reason(), "truncated");
}

#[test]
fn batch_wide_token_budget_holds_across_events() {
    // Five events of MAX_TOKENS_PER_EVENT one-byte tokens each: under the per-event cap, over the
    // batch's, and under the payload cap.
    let per_event = MAX_TOKENS_PER_EVENT;
    let events = (MAX_TOKENS_PER_BATCH / per_event as usize) as u8 + 1;
    let mut payload = vec![0x92, 0x01, 0x90 | events];
    for _ in 0..events {
        payload.extend_from_slice(&[0x95, 0xab]);
        payload.extend_from_slice(b"BlockStored");
        payload.extend_from_slice(&[0x90, 0xc0]);
        payload.extend(header32(0xdd, per_event));
        payload.extend(std::iter::repeat_n(0x01, per_event as usize));
        payload.push(0x01);
    }
    assert!(payload.len() <= MAX_PAYLOAD_BYTES);
    assert_eq!(
        decode_batch(&payload).unwrap_err(),
        DecodeError::TooMany {
            field: "token ids in the batch",
            count: (MAX_TOKENS_PER_BATCH + per_event as usize) as u64,
            max: MAX_TOKENS_PER_BATCH as u64
        }
    );
}

#[test]
fn oversized_payloads_and_deep_nesting_are_refused() {
    let huge = vec![0xc0; MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        decode_batch(&huge).unwrap_err(),
        DecodeError::TooLarge {
            len: MAX_PAYLOAD_BYTES + 1,
            max: MAX_PAYLOAD_BYTES
        }
    );
    // An unknown batch field nested 100 levels deep.
    let mut payload = vec![0x94, 0x01, 0x90, 0xc0];
    payload.extend(std::iter::repeat_n(0x91, 100));
    payload.push(0xc0);
    assert_eq!(
        decode_batch(&payload).unwrap_err(),
        DecodeError::TooDeep { max: MAX_DEPTH }
    );
    // The same inside an unknown event, and inside an extra key.
    let mut payload = vec![0x92, 0x01, 0x91, 0x92, 0xa1, b'X'];
    payload.extend(std::iter::repeat_n(0x91, 100));
    payload.push(0xc0);
    assert_eq!(decode_batch(&payload).unwrap_err().reason(), "too_deep");
}

#[test]
fn mutated_payloads_never_panic() {
    let seed = batch(vec![
        vllm_stored(
            ints(&[1u64 << 63, 5]),
            NIL,
            &range(8),
            4,
            s("GPU"),
            s("lora"),
            a(vec![a(vec![s("lora"), s("salt")]), a(vec![s("lora")])]),
        ),
        a(vec![
            s("BlockStored"),
            ints(&[-3i64]),
            NIL,
            a(vec![ints(&[1u32, 2]), ints(&[2u32, 3])]),
            Value::from(2),
            NIL,
            s("CPU_PINNED"),
            m(vec![("cache_salt", s("t"))]),
        ]),
        m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[5u64])),
        ]),
    ]);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..20_000 {
        let mut payload = seed.clone();
        for _ in 0..(next() % 4 + 1) {
            let at = (next() % payload.len() as u64) as usize;
            match next() % 3 {
                0 => payload[at] = next() as u8,
                1 => {
                    payload.remove(at);
                }
                _ => payload.insert(at, next() as u8),
            }
        }
        let _ = decode_batch(&payload);
    }
}

#[test]
fn error_messages_and_reasons() {
    let err = DecodeError::TooMany {
        field: "token_ids",
        count: 5,
        max: 4,
    };
    assert_eq!(err.to_string(), "token_ids: 5 entries, over the limit of 4");
    assert_eq!(err.reason(), "too_many");
    assert_eq!(
        DecodeError::Truncated { offset: 3 }.to_string(),
        "payload ends inside a value (at byte 3)"
    );
}

//! Fuzzes the KV event decoder, `events::decode::decode_batch`, with any bytes, and checks what must
//! hold for any input: no panic; an error is a payload that is over the size cap exactly when it says
//! so; a decoded batch keeps within every cap, and each stored event's blocks are laid out as the type
//! promises (`hashes[i]` ↔ `tokens[i * block_size ..]`, only the last block short).
#![no_main]

use libfuzzer_sys::fuzz_target;

use cachepick::events::KvEvent;
use cachepick::events::decode::{
    DecodeError, MAX_EVENTS_PER_BATCH, MAX_HASHES_PER_BATCH, MAX_PAYLOAD_BYTES,
    MAX_STRING_BYTES, MAX_TOKENS_PER_BATCH, decode_batch,
};

fuzz_target!(|payload: &[u8]| {
    match decode_batch(payload) {
        Ok(batch) => {
            assert!(payload.len() <= MAX_PAYLOAD_BYTES);
            assert!(batch.events.len() <= MAX_EVENTS_PER_BATCH as usize);
            assert!(batch.events.len() + batch.unknown_events as usize <= payload.len());
            let (mut hashes, mut tokens) = (0usize, 0usize);
            for event in &batch.events {
                match event {
                    KvEvent::BlockStored(stored) => {
                        let blocks = stored.hashes.len();
                        let size = stored.block_size as usize;
                        assert!(blocks > 0 && size > 0, "{stored:?}");
                        assert!(stored.tokens.len() > (blocks - 1) * size, "{stored:?}");
                        assert!(stored.tokens.len() <= blocks * size, "{stored:?}");
                        for text in [&stored.lora_name, &stored.cache_salt].into_iter().flatten() {
                            assert!(text.len() <= MAX_STRING_BYTES);
                        }
                        hashes += blocks;
                        tokens += stored.tokens.len();
                    }
                    KvEvent::BlockRemoved { hashes: removed, .. } => hashes += removed.len(),
                    KvEvent::AllBlocksCleared => {}
                }
            }
            assert!(hashes <= MAX_HASHES_PER_BATCH && tokens <= MAX_TOKENS_PER_BATCH);
        }
        Err(error) => {
            assert_eq!(
                matches!(error, DecodeError::TooLarge { .. }),
                payload.len() > MAX_PAYLOAD_BYTES,
                "{error}"
            );
            assert!(!error.to_string().is_empty());
            assert!(!error.reason().is_empty());
        }
    }
});

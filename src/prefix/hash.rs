//! Chained block hashes: the identity of a prompt prefix, shared by every cachepick replica.
//!
//! A prompt's tokens are cut into full blocks of `block_size` tokens; a trailing partial block is
//! never hashed, because an engine caches only full blocks too. Each block's hash covers its own
//! tokens and the hash of the block before it, so equal hashes at position `i` mean equal prompts up
//! to the end of block `i`, and a block hash alone names a whole prefix:
//!
//! ```text
//! seed = xxh3_64("cachepick-prefix-v1\0" ‖ len(model) ‖ model ‖ len(salt) ‖ salt)
//! h[0] = xxh3_64(seed ‖ tokens[0..B])
//! h[i] = xxh3_64(h[i-1] ‖ tokens[iB..(i+1)B])
//! ```
//!
//! Every integer is serialised little-endian with `to_le_bytes` (lengths as `u64`, hashes as `u64`,
//! tokens as `u32`), so the bytes hashed, and therefore the hashes, are the same on every host
//! whatever its endianness. `model` and `salt` are UTF-8; an absent salt and an empty one are the
//! same salt. The lengths make the layout unambiguous even for names containing NUL, which a JSON
//! `model` field may carry. The model name covers LoRA adapters: vLLM serves each adapter under its
//! own `model` name, and an adapter's KV cache is never reusable by the base model or another adapter.
//!
//! These hashes are a compatibility contract. Replicas of different releases route the same fleet and
//! an owner index may outlive a restart, so a hash must be identical across runs, machines and
//! releases. The known-answer vectors in the tests (and `README.md` beside this file, which says how
//! they were produced) pin it; changing one is a breaking change for every running fleet.

use std::num::NonZeroU32;

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// Domain separation and version tag of the seed. A new hashing scheme gets a new tag.
const SEED_TAG: &[u8; 20] = b"cachepick-prefix-v1\0";

/// The chain seed for one model and optional cache salt (tenant isolation, as vLLM's `cache_salt`).
///
/// Requests for different models, or with different salts, share no block hash (barring a 64-bit
/// collision), so one tenant's prefix never routes another's request.
pub fn prefix_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let salt = cache_salt.unwrap_or_default();
    // Streaming gives the same value as hashing the concatenation, without building it.
    let mut hasher = Xxh3Default::new();
    hasher.update(SEED_TAG);
    hasher.update(&(model.len() as u64).to_le_bytes());
    hasher.update(model.as_bytes());
    hasher.update(&(salt.len() as u64).to_le_bytes());
    hasher.update(salt.as_bytes());
    hasher.digest()
}

/// The chained hash of every full block of `tokens`, in prompt order.
pub fn block_hashes(seed: u64, tokens: &[u32], block_size: NonZeroU32) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes_into(seed, tokens, block_size, &mut out);
    out
}

/// [`block_hashes`] into a caller's buffer, which is cleared first, so a request task can reuse it.
pub fn block_hashes_into(seed: u64, tokens: &[u32], block_size: NonZeroU32, out: &mut Vec<u64>) {
    out.clear();
    // A block size beyond the address space cannot fit in memory, so no full block exists.
    let Ok(block) = usize::try_from(block_size.get()) else {
        return;
    };
    let blocks = tokens.chunks_exact(block);
    if blocks.len() == 0 {
        return;
    }
    out.reserve(blocks.len());
    // One buffer per call, refilled per block: the previous hash, then the block's tokens. A full
    // block exists, so its 4 bytes per token fit in memory. One-shot `xxh3_64` over this buffer
    // takes about half the time of the streaming `Xxh3` hasher reset per block (11-15 µs against
    // 26 µs for 32,768 tokens in blocks of 64); the chain is latency-bound either way.
    let mut bytes = vec![0u8; 8 + 4 * block];
    let mut prev = seed;
    for tokens in blocks {
        let Some((head, body)) = bytes.split_first_chunk_mut::<8>() else {
            return;
        };
        *head = prev.to_le_bytes();
        for (dst, token) in body.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        prev = xxh3_64(&bytes);
        out.push(prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    /// Tokens `start..start + len`, the inputs the known-answer vectors use.
    fn tokens(start: u32, len: u32) -> Vec<u32> {
        (start..start + len).collect()
    }

    // Produced by the reference C implementation (the Python `xxhash` 4.1.0 binding, libxxhash
    // 0.8.4) over the byte layout in the module docs; `README.md` has the script. Changing any of
    // these values breaks every running fleet.
    const SEED_LLAMA: u64 = 0xf956_341c_faf9_dd86;
    const SEED_LLAMA_SALTED: u64 = 0x0b7e_a1dd_d398_63a7;
    const SEED_QWEN: u64 = 0x5603_aa89_7785_1f8f;
    /// Tokens `0..70` in blocks of 16: four full blocks, six tokens left over.
    const LLAMA_FOUR_BLOCKS: [u64; 4] = [
        0xdf50_1f21_72d5_bd6d,
        0x2fb4_d294_8065_1fc8,
        0xc33a_fd4d_0095_d943,
        0x64c7_bf58_38b3_5ae6,
    ];
    const LLAMA_SALTED_ONE_BLOCK: u64 = 0x0a25_e8f9_5af8_e05e;
    const QWEN_ONE_BLOCK: u64 = 0xdb32_2fda_70c2_4f1d;
    /// Tokens `100_000..100_128` in blocks of 64, the production block size: xxh3's long-input path.
    const LLAMA_TWO_BLOCKS_OF_64: [u64; 2] = [0xdfa9_add0_3cac_d86e, 0xa76f_a1c2_c5b7_3879];

    #[test]
    fn seeds_match_the_known_answers() {
        assert_eq!(
            prefix_seed("meta-llama/Llama-3.1-8B-Instruct", None),
            SEED_LLAMA
        );
        assert_eq!(
            prefix_seed("meta-llama/Llama-3.1-8B-Instruct", Some("tenant-a")),
            SEED_LLAMA_SALTED
        );
        assert_eq!(prefix_seed("Qwen/Qwen3-8B", None), SEED_QWEN);
    }

    #[test]
    fn block_hashes_match_the_known_answers() {
        let block = size(16);
        assert_eq!(block_hashes(SEED_LLAMA, &[], block), Vec::<u64>::new());
        assert_eq!(
            block_hashes(SEED_LLAMA, &tokens(0, 15), block),
            Vec::<u64>::new()
        );
        assert_eq!(
            block_hashes(SEED_LLAMA, &tokens(0, 16), block),
            LLAMA_FOUR_BLOCKS[..1]
        );
        assert_eq!(
            block_hashes(SEED_LLAMA, &tokens(0, 70), block),
            LLAMA_FOUR_BLOCKS
        );
        assert_eq!(
            block_hashes(SEED_LLAMA_SALTED, &tokens(0, 16), block),
            [LLAMA_SALTED_ONE_BLOCK]
        );
        assert_eq!(
            block_hashes(SEED_QWEN, &tokens(0, 16), block),
            [QWEN_ONE_BLOCK]
        );
        assert_eq!(
            block_hashes(SEED_LLAMA, &tokens(100_000, 128), size(64)),
            LLAMA_TWO_BLOCKS_OF_64
        );
    }

    #[test]
    fn the_hashed_bytes_are_little_endian_on_every_host() {
        // Spelled out byte by byte rather than produced with `to_le_bytes`, so this holds on a
        // big-endian host only if the implementation serialises little-endian.
        let seed = 0x0102_0304_0506_0708_u64;
        let expected = xxh3_64(&[
            0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // seed
            0x04, 0x03, 0x02, 0x01, // token 0x01020304
            0xff, 0x00, 0x00, 0x00, // token 255
        ]);
        assert_eq!(block_hashes(seed, &[0x0102_0304, 255], size(2)), [expected]);
        let mut seed_bytes = Vec::new();
        seed_bytes.extend_from_slice(b"cachepick-prefix-v1\0");
        seed_bytes.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, b'm', 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(prefix_seed("m", None), xxh3_64(&seed_bytes));
    }

    #[test]
    fn each_hash_covers_the_whole_prefix_before_it() {
        let seed = prefix_seed("m", None);
        let a = block_hashes(seed, &[1, 2, 3, 4, 5, 6], size(2));
        let b = block_hashes(seed, &[9, 9, 3, 4, 5, 6], size(2));
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let extended = block_hashes(seed, &[1, 2, 3, 4, 5, 6, 7, 8, 9], size(2));
        assert_eq!(extended[..3], a[..]);
    }

    #[test]
    fn salt_model_and_absent_salt_separate_or_merge_as_documented() {
        assert_ne!(prefix_seed("m", None), prefix_seed("m", Some("s")));
        assert_ne!(prefix_seed("m", None), prefix_seed("n", None));
        assert_eq!(prefix_seed("m", None), prefix_seed("m", Some("")));
        // Without the lengths these two would hash the same bytes.
        assert_ne!(prefix_seed("a\0b", None), prefix_seed("a", Some("b\0")));
    }

    #[test]
    fn the_buffer_variant_replaces_what_it_held() {
        let seed = prefix_seed("m", None);
        let mut out = vec![7, 7, 7, 7, 7];
        block_hashes_into(seed, &[1, 2, 3], size(2), &mut out);
        assert_eq!(out, block_hashes(seed, &[1, 2, 3], size(2)));
        block_hashes_into(seed, &[1], size(2), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_block_larger_than_the_prompt_hashes_nothing() {
        assert!(block_hashes(1, &tokens(0, 100), size(u32::MAX)).is_empty());
    }
}

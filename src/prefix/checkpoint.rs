//! Checkpoints: the depths of a prompt's block chain a replica tells its peers about.
//!
//! A whole chain does not fit a datagram (a 100k-token prompt is 6,250 hashes of 16-token blocks), so
//! a guess travels as the chain's hashes at fixed depths: every depth up to 8 blocks, then four an
//! octave (…, 32, 40, 48, 56, 64, 80, …: the depths whose binary form has no set bit below its top
//! three). Since a block's hash covers every block before it, a peer's hash at depth `d` equal to a
//! request's hash at depth `d` means the two share `d` blocks; a prefix shared to any depth is credited
//! the checkpoint at or below it, at least four fifths of it. A 128k-token context at 16 tokens a block
//! is 40 checkpoints; [`MAX_CHECKPOINTS`] reaches past 2^17 blocks.

/// The most checkpoints a chain is cut to: every depth up to 8, and four an octave to 2^17 blocks.
pub const MAX_CHECKPOINTS: usize = 64;

/// Whether a chain depth (in blocks, from 1) is a checkpoint.
pub fn is_checkpoint(depth: usize) -> bool {
    let bits = usize::BITS - depth.leading_zeros();
    depth > 0 && (bits <= 3 || depth.trailing_zeros() >= bits - 3)
}

/// The checkpoint depths, in order, from 1.
pub fn checkpoint_depths() -> impl Iterator<Item = usize> {
    (1..)
        .filter(|depth| is_checkpoint(*depth))
        .take(MAX_CHECKPOINTS)
}

/// `chain`'s hashes at the checkpoint depths it reaches, in order.
pub fn checkpoints(chain: &[u64]) -> Vec<u64> {
    checkpoint_depths()
        .map_while(|depth| chain.get(depth - 1).copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_depths_an_octave_each_within_a_fifth_of_the_next() {
        let depths: Vec<usize> = checkpoint_depths().take(20).collect();
        assert_eq!(
            depths,
            [
                1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64
            ]
        );
        let all: Vec<usize> = checkpoint_depths().collect();
        assert_eq!(all.len(), MAX_CHECKPOINTS);
        assert!(*all.last().unwrap() >= 1 << 17, "{:?}", all.last());
        for pair in all.windows(2) {
            // A depth just below the next checkpoint is credited at least 4/5 of itself.
            assert!(pair[0] * 5 >= (pair[1] - 1) * 4, "{pair:?}");
        }
        let chain: Vec<u64> = (1..=100).collect();
        assert_eq!(
            checkpoints(&chain),
            [
                1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96
            ]
        );
        assert!(checkpoints(&[]).is_empty());
        assert!(!is_checkpoint(0));
        // The computed sequence is exactly the depths the predicate names.
        let searched: Vec<usize> = (1..)
            .filter(|depth| is_checkpoint(*depth))
            .take(MAX_CHECKPOINTS)
            .collect();
        assert_eq!(all, searched);
    }
}

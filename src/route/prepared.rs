//! The request as the picker prepared it: its pool, its tokens, its blocks and who holds them. The
//! picker makes one, the policy reads it, and `explain` reports it; it sits apart from both so that
//! neither file imports the other for it.

use serde::Serialize;

use crate::prefix::OwnerMatch;

/// Everything the policy needs about one request, computed once.
#[derive(Clone, Debug, Serialize)]
pub struct Prepared {
    /// Index of the pool in the configuration.
    pub pool: usize,
    pub pool_label: String,
    pub model: Option<String>,
    pub prompt_tokens: u64,
    /// The output the request asks for, when it says (`max_tokens` and kin).
    pub max_output_tokens: Option<u64>,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<u64>,
    /// Every worker holding at least one leading block, deepest first.
    pub owners: Vec<OwnerMatch>,
}

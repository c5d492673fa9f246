//! The multi-turn chat workload (`cachepick replay --scenario chat`): users holding long
//! conversations over their own context, with think times between turns. Its shape is vLLM
//! production-stack's multi-round QA benchmark (`benchmarks/multi-round-qa`), the workload the
//! production stack and LMCache publish their multi-turn figures on: every user's first prompt is a
//! shared system prompt (`--shared-system-prompt 1000`) followed by that user's own context
//! (`--user-history-prompt`: 2,000 tokens in the README's example, 30,000 in the long-context
//! "RAG QA" runs), then a question; each later round resends the whole conversation with the answers
//! so far and a new question; answers are about `--answer-len 100` tokens; a user's rounds are
//! `--num-users / --qps` seconds apart (10 users at 0.5 QPS: 20 s).
//!
//! - One system prompt of [`SYSTEM_BLOCKS`] blocks, shared by every conversation.
//! - Users arrive as a Poisson process at [`USER_RATE`] per second of trace time for [`SPAN_MS`].
//!   Each has its own context, of a length drawn log-uniformly between [`MIN_CONTEXT_TOKENS`] and
//!   [`MAX_CONTEXT_TOKENS`] (the benchmark's two published settings) and rounded to whole blocks,
//!   and [`ROUNDS`] rounds an exponential think time apart (mean [`THINK_MS`], the benchmark's 20 s).
//! - A round's new content is the previous answer and the new question: one block (the trace's
//!   blocks are 512 tokens, the smallest unit a synthetic prompt has). The first round's is the
//!   question alone, one block.
//! - Outputs are uniform in [`OUTPUT`] tokens, around the benchmark's 100.
//!
//! Unlike `agents`, the reused prefix is mostly the user's own: only the system prompt is shared, so
//! a router that loses a conversation's worker pays for its whole context again, and the contexts of
//! all users together outgrow a worker's cache.

use std::ops::RangeInclusive;

use super::trace::{
    FreshIds, Item, TRACE_BLOCK_TOKENS, XorShift, duration_scale, session_turn, sessions,
};

/// The shared system prompt, in blocks: the benchmark's 1,000 tokens.
pub const SYSTEM_BLOCKS: u64 = 2;
pub const MIN_CONTEXT_TOKENS: f64 = 2_048.0;
pub const MAX_CONTEXT_TOKENS: f64 = 30_720.0;
/// New users per second of trace time.
pub const USER_RATE: f64 = 0.4;
/// Trace time over which users start.
pub const SPAN_MS: f64 = 300_000.0;
/// Mean time between two rounds of a conversation.
pub const THINK_MS: f64 = 20_000.0;
/// Rounds of a conversation, each count equally likely: around the benchmark's 5 and 10.
pub const ROUNDS: RangeInclusive<u64> = 3..=10;
/// A round's output, in tokens.
pub const OUTPUT: RangeInclusive<u64> = 50..=150;
/// Block ids of users' contexts and rounds start here, after the system prompt's.
const UNIQUE_IDS: u64 = 1_000;

/// The workload for `seed`, in arrival order; `scale` multiplies the span over which users start.
pub fn chat(seed: u64, scale: f64) -> Vec<Item> {
    let scale = duration_scale(scale);
    let mut rng = XorShift::new(seed ^ 0xC4A7_5EED);
    let block = TRACE_BLOCK_TOKENS as f64;
    let mut fresh = FreshIds(UNIQUE_IDS);
    sessions(&mut rng, USER_RATE, SPAN_MS * scale, |rng, start, items| {
        let context_tokens = (MIN_CONTEXT_TOKENS.ln()
            + rng.unit() * (MAX_CONTEXT_TOKENS.ln() - MIN_CONTEXT_TOKENS.ln()))
        .exp();
        let mut conversation: Vec<u64> = (0..SYSTEM_BLOCKS).collect();
        conversation.extend(fresh.take(((context_tokens / block).round() as u64).max(1)));
        let rounds = rng.within(ROUNDS);
        let mut at = start;
        for round in 0..rounds {
            if round > 0 {
                at += rng.exponential(THINK_MS);
            }
            // The first round's question; later, the previous answer and the new question.
            conversation.extend(fresh.take(1));
            let output = rng.within(OUTPUT);
            items.push(session_turn(at, &conversation, output));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::ideal_hit_rate;

    #[test]
    fn conversations_resend_their_context_round_by_round_and_share_only_the_system_prompt() {
        let items = chat(1, 1.0);
        // 0.4 users a second for 300 s, 3–10 rounds each: about 780 requests.
        assert!(
            (500..1100).contains(&items.len()),
            "{} requests",
            items.len()
        );
        assert!(
            items
                .windows(2)
                .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms)
        );
        for item in &items {
            assert_eq!(
                item.input_length as usize,
                item.hash_ids.len() * TRACE_BLOCK_TOKENS
            );
            assert!(OUTPUT.contains(&u64::from(item.output_length)), "{item:?}");
            // The system prompt, a context of 2k–30k tokens, then one block a round.
            assert_eq!(item.hash_ids[..2], [0, 1]);
            let blocks = item.hash_ids.len();
            assert!(
                (2 + 4 + 1..=2 + 60 + 10).contains(&blocks),
                "{blocks} blocks"
            );
        }
        // Every round after the first extends the previous prompt of its conversation by one block.
        let first_rounds = items
            .iter()
            .filter(|item| {
                !items.iter().any(|earlier| {
                    earlier.hash_ids.len() + 1 == item.hash_ids.len()
                        && item.hash_ids.starts_with(&earlier.hash_ids)
                })
            })
            .count();
        let users = items.len() as f64 / 6.5;
        assert!(
            (first_rounds as f64) < users * 1.5 && (first_rounds as f64) > users * 0.5,
            "{first_rounds} first rounds of about {users:.0} users"
        );
        // Contexts are per user: no two conversations share a block beyond the system prompt.
        let context_starts: std::collections::HashSet<u64> =
            items.iter().map(|item| item.hash_ids[2]).collect();
        assert_eq!(context_starts.len(), first_rounds);
        // Most of a prompt was seen before (the conversation so far), not all (each first round).
        let ideal = ideal_hit_rate(&items);
        assert!((0.6..0.95).contains(&ideal), "{ideal}");
        assert_eq!(chat(1, 1.0), items);
        assert_ne!(chat(2, 1.0), items);
        assert!(chat(1, 0.2).len() < items.len() / 3);
    }
}

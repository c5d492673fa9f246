//! The long-document chat workload (`cachepick replay --scenario documents`): people pasting a long
//! document into a chat assistant, asking about it and now and then following up after reading the
//! answer. Prompts are long and mostly new, conversations short: most of the prefill is cold wherever
//! it goes, so at load this workload is about balancing long prefills, while a follow-up still finds
//! its whole conversation cached on the worker that served it. It is the second chat workload beside
//! [`chat`](super::chat), whose long contexts are each reused over many rounds; its shape is the one
//! long-context assistants publish (Kimi's conversation workload in Mooncake's FAST'25 paper: prompts
//! of about 12k tokens on average, one system block shared by every request), with turn counts,
//! answers and think times from the public multi-turn chat statistics cited below. Nothing here is
//! fitted to a trace.
//!
//! - One system prompt of [`SYSTEM_BLOCKS`] block, shared by every request.
//! - Conversations start as a Poisson process at [`CONVERSATION_RATE`] per second of trace time for
//!   [`SPAN_MS`].
//! - A conversation opens with a document of a log-normal length, median [`MEDIAN_DOCUMENT_TOKENS`]
//!   and log spread [`DOCUMENT_SIGMA`] (so a mean of about 1.5 × the median, a tail to the cap),
//!   clamped to [`DOCUMENT_TOKENS`] (a 128k-context model's room for a document and its answers) and
//!   rounded to whole 512-token blocks, then the question: one block.
//! - After each answer the user follows up with probability [`FOLLOW_UP`] (a geometric number of
//!   turns, 1.43 on average; LMSYS-Chat-1M's conversations average 2.0 turns over short prompts, and
//!   a pasted document is more often a one-off question), an exponential think time later (mean
//!   [`THINK_MS`]: reading an answer about a long document). A follow-up resends the conversation and
//!   adds the previous answer and a new question of [`QUESTION_TOKENS`], in whole blocks.
//! - Answers are uniform in [`OUTPUT`] tokens (mean 225, around LMSYS-Chat-1M's 214.5 per response).
//!
//! Its ideal hit rate (a perfect router, an unbounded cache) is about 30%, against about 85% for
//! `chat` and 92% for `agents`.

use std::ops::RangeInclusive;

use super::trace::{
    FreshIds, Item, TRACE_BLOCK_TOKENS, XorShift, duration_scale, session_turn, sessions,
};

/// The shared system prompt, in blocks.
pub const SYSTEM_BLOCKS: u64 = 1;
pub const MEDIAN_DOCUMENT_TOKENS: f64 = 8_192.0;
pub const DOCUMENT_SIGMA: f64 = 0.9;
/// The lengths a document is clamped to, in tokens.
pub const DOCUMENT_TOKENS: RangeInclusive<f64> = 512.0..=98_304.0;
/// New conversations per second of trace time.
pub const CONVERSATION_RATE: f64 = 1.0;
/// Trace time over which conversations start.
pub const SPAN_MS: f64 = 900_000.0;
/// The chance that an answer is followed up.
pub const FOLLOW_UP: f64 = 0.3;
/// Mean time between an answer and its follow-up.
pub const THINK_MS: f64 = 30_000.0;
/// A follow-up question, in tokens.
pub const QUESTION_TOKENS: RangeInclusive<u64> = 16..=256;
/// An answer, in tokens.
pub const OUTPUT: RangeInclusive<u64> = 50..=400;
/// Block ids of documents and turns start here, after the system prompt's.
const UNIQUE_IDS: u64 = 1_000;

/// The workload for `seed`, in arrival order; `scale` multiplies the span over which conversations
/// start.
pub fn documents(seed: u64, scale: f64) -> Vec<Item> {
    let scale = duration_scale(scale);
    let mut rng = XorShift::new(seed ^ 0xD0C5_5EED);
    let block = TRACE_BLOCK_TOKENS as f64;
    let mut fresh = FreshIds(UNIQUE_IDS);
    sessions(
        &mut rng,
        CONVERSATION_RATE,
        SPAN_MS * scale,
        |rng, start, items| {
            let document = rng
                .log_normal(MEDIAN_DOCUMENT_TOKENS, DOCUMENT_SIGMA)
                .clamp(*DOCUMENT_TOKENS.start(), *DOCUMENT_TOKENS.end());
            let mut conversation: Vec<u64> = (0..SYSTEM_BLOCKS).collect();
            conversation.extend(fresh.take(((document / block).round() as u64).max(1)));
            // The first question.
            conversation.extend(fresh.take(1));
            let mut at = start;
            loop {
                let answer = rng.within(OUTPUT);
                items.push(session_turn(at, &conversation, answer));
                if rng.unit() >= FOLLOW_UP {
                    break;
                }
                at += rng.exponential(THINK_MS);
                let new_tokens = answer + rng.within(QUESTION_TOKENS);
                conversation.extend(fresh.take(new_tokens.div_ceil(TRACE_BLOCK_TOKENS as u64)));
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::ideal_hit_rate;

    fn mean(values: impl Iterator<Item = f64>) -> f64 {
        let (sum, count) = values.fold((0.0, 0.0), |(sum, count), v| (sum + v, count + 1.0));
        sum / count
    }

    #[test]
    fn conversations_open_on_long_new_documents_and_few_are_followed_up() {
        let items = documents(1, 1.0);
        // One conversation a second for 900 s, 1.43 turns each: about 1,290 requests.
        assert!(
            (1_000..1_600).contains(&items.len()),
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
            assert_eq!(
                item.hash_ids[0], 0,
                "every request opens on the system block"
            );
            assert!(item.hash_ids[1..].iter().all(|&id| id >= UNIQUE_IDS));
        }
        // A follow-up extends an earlier prompt of its conversation by the answer and a question.
        let follow_ups = items
            .iter()
            .filter(|item| {
                items.iter().any(|earlier| {
                    earlier.hash_ids.len() < item.hash_ids.len()
                        && item.hash_ids.starts_with(&earlier.hash_ids)
                })
            })
            .count();
        let share = follow_ups as f64 / items.len() as f64;
        // A geometric number of turns continuing with 0.3: 0.3 of all requests are follow-ups.
        assert!((0.25..0.35).contains(&share), "{share}");
        // Documents: a median near 8k tokens, a mean near 12k, a tail past 40k.
        let mut firsts: Vec<f64> = items
            .iter()
            .filter(|item| {
                !items.iter().any(|earlier| {
                    earlier.hash_ids.len() < item.hash_ids.len()
                        && item.hash_ids.starts_with(&earlier.hash_ids)
                })
            })
            .map(|item| f64::from(item.input_length))
            .collect();
        firsts.sort_by(f64::total_cmp);
        let median = firsts[firsts.len() / 2];
        assert!((7_000.0..10_000.0).contains(&median), "median {median}");
        let prompt_mean = mean(items.iter().map(|item| f64::from(item.input_length)));
        assert!(
            (10_000.0..15_000.0).contains(&prompt_mean),
            "mean {prompt_mean}"
        );
        assert!(firsts.last().is_some_and(|&longest| longest > 40_000.0));
        // Most prefill is new: a follow-up's conversation, and the system block, are all that repeat.
        let ideal = ideal_hit_rate(&items);
        assert!((0.2..0.4).contains(&ideal), "{ideal}");
        assert_eq!(documents(1, 1.0), items);
        assert_ne!(documents(2, 1.0), items);
        assert!(documents(1, 0.2).len() < items.len() / 3);
    }
}

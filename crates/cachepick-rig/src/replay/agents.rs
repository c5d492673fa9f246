//! The prefill-heavy workload (`cachepick replay --scenario agents`): coding assistants and agents
//! whose long system prompts (tool definitions, repository context) are reused across multi-turn
//! sessions, with short outputs. Most of each request's cost is prefill, and almost all of it is a
//! prefix some worker already holds: the shape on which cache-aware routing matters most.
//!
//! - [`AGENT_PROMPTS`] system prompts, each of a length drawn once per seed, log-uniformly between
//!   [`MIN_SYSTEM_TOKENS`] and [`MAX_SYSTEM_TOKENS`] and rounded to whole 512-token blocks; a session
//!   picks one with Zipf-like popularity (weight `1 / (rank + 1)`).
//! - Sessions arrive as a Poisson process at [`SESSION_RATE`] per second of trace time for
//!   [`SPAN_MS`]. Each has 2–8 turns, arriving an exponential think time apart (mean
//!   [`THINK_MS`]); the order inside a session is kept.
//! - Turn `k`'s prompt is the system prompt, then every earlier turn's new content and answer, then
//!   its own new content: 1–4 blocks of user message or tool output (512–2,048 tokens). An earlier
//!   answer is one block of its own (the engine's words are not the trace's, so the next turn carries
//!   it as new text, which only the worker that served the session has seen from that turn on).
//! - Outputs are uniform in 32–256 tokens.
//!
//! Every prompt is whole blocks, so a session's next turn shares its entire previous prompt.

use std::ops::RangeInclusive;

use super::trace::{
    FreshIds, Item, TRACE_BLOCK_TOKENS, XorShift, duration_scale, session_turn, sessions,
};

/// System prompts the sessions share.
pub const AGENT_PROMPTS: u64 = 24;
pub const MIN_SYSTEM_TOKENS: f64 = 3_072.0;
pub const MAX_SYSTEM_TOKENS: f64 = 102_400.0;
/// New sessions per second of trace time.
pub const SESSION_RATE: f64 = 0.5;
/// Trace time over which sessions start.
pub const SPAN_MS: f64 = 300_000.0;
/// Mean time between two turns of a session.
pub const THINK_MS: f64 = 6_000.0;
/// Turns of a session, each count equally likely.
const TURNS: RangeInclusive<u64> = 2..=8;
/// A turn's new content, in blocks.
const NEW_BLOCKS: RangeInclusive<u64> = 1..=4;
/// A turn's output, in tokens.
const OUTPUT: RangeInclusive<u64> = 32..=256;
/// Block ids of the system prompts start here; ids of session content come after every prompt's.
const UNIQUE_IDS: u64 = 10_000_000;

/// The workload for `seed`, in arrival order; `scale` multiplies the span over which sessions start.
pub fn agents(seed: u64, scale: f64) -> Vec<Item> {
    let scale = duration_scale(scale);
    let mut rng = XorShift::new(seed ^ 0xA6E7_5EED);
    let block = TRACE_BLOCK_TOKENS as f64;
    let prompts: Vec<u64> = (0..AGENT_PROMPTS)
        .map(|_| {
            let tokens = (MIN_SYSTEM_TOKENS.ln()
                + rng.unit() * (MAX_SYSTEM_TOKENS.ln() - MIN_SYSTEM_TOKENS.ln()))
            .exp();
            ((tokens / block).round() as u64).max(1)
        })
        .collect();
    let first_id: Vec<u64> = prompts
        .iter()
        .scan(0, |next, blocks| {
            let first = *next;
            *next += blocks;
            Some(first)
        })
        .collect();
    let mut fresh = FreshIds(UNIQUE_IDS);
    sessions(
        &mut rng,
        SESSION_RATE,
        SPAN_MS * scale,
        |rng, start, items| {
            let agent = rng.weighted_group(AGENT_PROMPTS) as usize;
            let system = prompts.get(agent).copied().unwrap_or(1);
            let base = first_id.get(agent).copied().unwrap_or(0);
            let mut context: Vec<u64> = (base..base + system).collect();
            let turns = rng.within(TURNS);
            let mut at = start;
            for turn in 0..turns {
                if turn > 0 {
                    at += rng.exponential(THINK_MS);
                    // The previous turn's answer, as the next prompt carries it.
                    context.extend(fresh.take(1));
                }
                let new = rng.within(NEW_BLOCKS);
                context.extend(fresh.take(new));
                let output = rng.within(OUTPUT);
                items.push(session_turn(at, &context, output));
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::ideal_hit_rate;

    #[test]
    fn sessions_grow_their_prompt_turn_by_turn_and_outputs_stay_short() {
        let items = agents(1, 1.0);
        assert!(items.len() > 400, "{} requests", items.len());
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
            assert!((32..=256).contains(&item.output_length), "{item:?}");
        }
        // Every prompt starts with a whole system prompt of 3k–100k tokens.
        let system = |item: &Item| {
            item.hash_ids
                .iter()
                .take_while(|id| **id < UNIQUE_IDS)
                .count()
        };
        assert!(items.iter().all(|item| (6..=200).contains(&system(item))));
        // A later turn extends an earlier prompt of its session: some prompt is a strict prefix of
        // another that is not its system prompt alone.
        let extends = items.iter().any(|later| {
            items.iter().any(|earlier| {
                earlier.hash_ids.len() > system(earlier)
                    && later.hash_ids.len() > earlier.hash_ids.len()
                    && later.hash_ids.starts_with(&earlier.hash_ids)
            })
        });
        assert!(extends);
        // Prefill-heavy: the prompt outweighs the output hundreds of times, and nearly all of it was
        // seen before.
        let input: u64 = items.iter().map(|item| u64::from(item.input_length)).sum();
        let output: u64 = items.iter().map(|item| u64::from(item.output_length)).sum();
        assert!(input > 100 * output, "{input} in, {output} out");
        assert!(ideal_hit_rate(&items) > 0.8, "{}", ideal_hit_rate(&items));
        // The same seed, the same workload; another seed, another.
        assert_eq!(agents(1, 1.0), items);
        assert_ne!(agents(2, 1.0), items);
        assert!(agents(1, 0.2).len() < items.len() / 3);
    }
}

//! The workload: Mooncake JSONL traces and the synthetic burst scenario, and the deterministic text each
//! prefix-block id becomes.

use std::ops::RangeInclusive;
use std::path::Path;

use serde::Deserialize;

use cachepick_sim::config::TokenizerConfig;

/// Tokens in one Mooncake hash block.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// Arrival time in trace milliseconds (divided by the speed-up when replayed).
    pub timestamp_ms: u64,
    pub input_length: u32,
    pub output_length: u32,
    /// Prefix-block ids, one per 512-token block of the prompt; the last block may be partial.
    pub hash_ids: Vec<u64>,
    /// Workload phase (0 for a trace; steady, burst, recovery for the burst scenario).
    pub phase: usize,
}

#[derive(Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {message}")]
    Parse {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{0} holds no requests")]
    Empty(String),
}

/// Reads a Mooncake JSONL trace: the first `limit` requests (all when `None`), in timestamp order.
pub fn load_mooncake(path: &Path, limit: Option<usize>) -> Result<Vec<Item>, TraceError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: name.clone(),
        source,
    })?;
    parse_mooncake(&text, &name, limit)
}

/// [`load_mooncake`] on text.
pub fn parse_mooncake(
    text: &str,
    name: &str,
    limit: Option<usize>,
) -> Result<Vec<Item>, TraceError> {
    let mut items = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if limit.is_some_and(|limit| items.len() >= limit) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(line).map_err(|error| TraceError::Parse {
            path: name.to_owned(),
            line: index + 1,
            message: error.to_string(),
        })?;
        items.push(Item {
            timestamp_ms: line.timestamp,
            input_length: line.input_length,
            output_length: line.output_length.max(1),
            hash_ids: line.hash_ids,
            phase: 0,
        });
    }
    if items.is_empty() {
        return Err(TraceError::Empty(name.to_owned()));
    }
    items.sort_by_key(|item| item.timestamp_ms);
    Ok(items)
}

/// One phase of the burst scenario.
#[derive(Clone, Copy, Debug)]
pub struct Phase {
    pub name: &'static str,
    /// Requests per second of trace time.
    pub rate: f64,
    /// Length in trace milliseconds.
    pub length_ms: u64,
    /// Each request's own tokens after its group's shared prefix: what a cache hit still prefills.
    pub suffix_tokens: u32,
    /// The conversation groups requests are drawn from (the first `groups` of [`BURST_GROUPS`], by
    /// the same skewed popularity); 1 sends every request to one shared prefix.
    pub groups: u64,
}

/// The burst scenario's phases, in trace time: steady near the default fleet's capacity, a burst well
/// above it, then steady again for long enough to see whether the prefix placement recovers.
pub const BURST_PHASES: [Phase; 3] = [
    Phase {
        name: "steady",
        rate: 8.0,
        length_ms: 40_000,
        suffix_tokens: BURST_SUFFIX_TOKENS,
        groups: BURST_GROUPS,
    },
    Phase {
        name: "burst",
        rate: 24.0,
        length_ms: 10_000,
        suffix_tokens: BURST_SUFFIX_TOKENS,
        groups: BURST_GROUPS,
    },
    Phase {
        name: "recovery",
        rate: 8.0,
        length_ms: 50_000,
        suffix_tokens: BURST_SUFFIX_TOKENS,
        groups: BURST_GROUPS,
    },
];
/// Conversation groups of the burst scenario; each shares a long prefix.
pub const BURST_GROUPS: u64 = 32;
/// Shared prefix of each group, in trace blocks (8 × 512 = 4,096 tokens).
const BURST_PREFIX_BLOCKS: u64 = 8;
/// Each request's own suffix after the shared prefix, in tokens.
const BURST_SUFFIX_TOKENS: u32 = 256;
const BURST_OUTPUT_TOKENS: u32 = 64;

/// The synthetic burst scenario: many conversations sharing long prefixes (groups with a skewed
/// popularity), steady load near the fleet's capacity, a burst well above it, then steady again.
/// `scale` multiplies every phase's length (rates are unchanged).
pub fn burst(seed: u64, scale: f64) -> Vec<Item> {
    phased(seed, scale, &BURST_PHASES)
}

/// The burst scenario's conversations through other `phases` (the demo's adds one that queues the whole
/// fleet); item `phase` is the index into `phases`.
pub fn phased(seed: u64, scale: f64, phases: &[Phase]) -> Vec<Item> {
    let scale = duration_scale(scale);
    let mut rng = XorShift::new(seed ^ 0xB0B5_7E57);
    let mut items = Vec::new();
    let mut start_ms = 0.0_f64;
    let mut unique = 1_000_000_u64;
    for (phase, spec) in phases.iter().enumerate() {
        let end_ms = start_ms + spec.length_ms as f64 * scale;
        let mut at = start_ms;
        loop {
            // Poisson arrivals.
            at += rng.gap_ms(spec.rate);
            if at >= end_ms {
                break;
            }
            // Zipf-like popularity: group g is chosen with weight 1 / (g + 1).
            let group = rng.weighted_group(spec.groups.clamp(1, BURST_GROUPS));
            let mut hash_ids: Vec<u64> = (0..BURST_PREFIX_BLOCKS)
                .map(|block| group * BURST_PREFIX_BLOCKS + block)
                .collect();
            // The request's own blocks: one a trace block of its suffix (one for the burst's).
            for _ in 0..spec
                .suffix_tokens
                .div_ceil(TRACE_BLOCK_TOKENS as u32)
                .max(1)
            {
                unique += 1;
                hash_ids.push(unique);
            }
            items.push(Item {
                timestamp_ms: at as u64,
                input_length: (BURST_PREFIX_BLOCKS as u32) * TRACE_BLOCK_TOKENS as u32
                    + spec.suffix_tokens,
                output_length: BURST_OUTPUT_TOKENS,
                hash_ids,
                phase,
            });
        }
        start_ms = end_ms;
    }
    items
}

/// A synthetic workload's `--duration-scale`: the factor when it is positive and finite, else 1.
pub(crate) fn duration_scale(scale: f64) -> f64 {
    if scale.is_finite() && scale > 0.0 {
        scale
    } else {
        1.0
    }
}

/// Block ids that no other prompt of a synthetic workload holds, handed out in order.
pub(crate) struct FreshIds(pub u64);

impl FreshIds {
    pub(crate) fn take(&mut self, count: u64) -> Vec<u64> {
        let ids = (self.0..self.0 + count).collect();
        self.0 += count;
        ids
    }
}

/// The sessions of a synthetic workload: they start as a Poisson process at `rate` a second of trace
/// time until `end_ms`, `session` makes each one's requests from its start (drawing from the same
/// generator), and all come back in arrival order, each session's own order kept (a stable sort).
pub(crate) fn sessions(
    rng: &mut XorShift,
    rate: f64,
    end_ms: f64,
    mut session: impl FnMut(&mut XorShift, f64, &mut Vec<Item>),
) -> Vec<Item> {
    let mut items = Vec::new();
    let mut start = 0.0_f64;
    loop {
        start += rng.gap_ms(rate);
        if start >= end_ms {
            break;
        }
        session(rng, start, &mut items);
    }
    items.sort_by_key(|item| item.timestamp_ms);
    items
}

/// A turn of a multi-turn session at `at_ms` whose prompt is `context`, whole trace blocks.
pub(crate) fn session_turn(at_ms: f64, context: &[u64], output_tokens: u64) -> Item {
    Item {
        timestamp_ms: at_ms as u64,
        input_length: (context.len() * TRACE_BLOCK_TOKENS) as u32,
        output_length: output_tokens as u32,
        hash_ids: context.to_vec(),
        phase: 0,
    }
}

/// Phase boundaries of [`burst`] in trace milliseconds: `(name, start, end)`.
pub fn burst_phase_bounds(scale: f64) -> Vec<(&'static str, f64, f64)> {
    phase_bounds(&BURST_PHASES, scale)
}

/// Phase boundaries of [`phased`] in trace milliseconds: `(name, start, end)`.
pub fn phase_bounds(phases: &[Phase], scale: f64) -> Vec<(&'static str, f64, f64)> {
    let scale = duration_scale(scale);
    let mut start = 0.0;
    phases
        .iter()
        .map(|phase| {
            let end = start + phase.length_ms as f64 * scale;
            let bounds = (phase.name, start, end);
            start = end;
            bounds
        })
        .collect()
}

/// Builds prompts from block ids so that equal id prefixes give equal token prefixes.
#[derive(Clone, Debug)]
pub struct PromptBuilder {
    /// `Some(n)`: the `bytes` tokenizer, `n` bytes per token, blocks built byte-exact.
    bytes_per_token: Option<usize>,
    seed: u64,
}

/// Words that are one token each with a leading space under o200k_base and cl100k_base.
const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "cache", "block",
    "model", "token", "worker", "queue", "route", "prefix", "system", "data", "state", "value",
    "water", "light", "house",
];

impl PromptBuilder {
    pub fn new(tokenizer: &TokenizerConfig, seed: u64) -> PromptBuilder {
        PromptBuilder {
            bytes_per_token: matches!(tokenizer, TokenizerConfig::Bytes).then_some(4),
            seed,
        }
    }

    /// The prompt of `item`: its blocks' text joined, trimmed to `input_length` tokens (exactly under
    /// the `bytes` tokenizer, about under word-level tokenizers).
    pub fn prompt(&self, item: &Item) -> String {
        let want = item.input_length as usize;
        let mut out = String::with_capacity(want * self.bytes_per_token.unwrap_or(5));
        let mut tokens = 0;
        for &id in &item.hash_ids {
            if tokens >= want {
                break;
            }
            let take = (want - tokens).min(TRACE_BLOCK_TOKENS);
            self.block(id, take, &mut out);
            tokens += take;
        }
        out
    }

    /// Appends the first `tokens` tokens of block `id`'s text.
    fn block(&self, id: u64, tokens: usize, out: &mut String) {
        let mut rng = XorShift::new(self.seed.wrapping_mul(31).wrapping_add(id).wrapping_add(1));
        match self.bytes_per_token {
            Some(per_token) => {
                // Byte-exact: the block is TRACE_BLOCK_TOKENS × per_token ASCII bytes, so block
                // boundaries fall on token boundaries and a shared id prefix is a shared token prefix.
                let want = tokens * per_token;
                let start = out.len();
                let tag = format!("<{id:x}>");
                out.push_str(&tag);
                while out.len() - start < want {
                    let word = word(rng.next());
                    out.push(' ');
                    out.push_str(word);
                }
                out.truncate(start + want);
            }
            None => {
                for index in 0..tokens {
                    let word = if index == 0 {
                        // A distinct first word per id keeps blocks of different ids apart.
                        word(id)
                    } else {
                        word(rng.next())
                    };
                    out.push(' ');
                    out.push_str(word);
                }
            }
        }
    }
}

/// The hit rate of a perfect router with an unbounded cache on `items`: every block seen in an earlier
/// request hits, as far as the engine may hit (never the last prompt token). Σ hit ÷ Σ prompt tokens.
pub fn ideal_hit_rate(items: &[Item]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for item in items {
        let input = u64::from(item.input_length);
        let mut covered = 0u64;
        let mut prefix = true;
        for &id in &item.hash_ids {
            let tokens = (input - covered.min(input)).min(TRACE_BLOCK_TOKENS as u64);
            // A block's id names its whole prefix, so a block hits only after every earlier one did.
            prefix = prefix && seen.contains(&id);
            if prefix {
                hit += tokens;
            }
            covered += tokens;
        }
        // At least one token is computed.
        if prefix && covered > 0 {
            hit = hit.saturating_sub(1);
        }
        seen.extend(item.hash_ids.iter().copied());
        total += input;
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// A small deterministic generator (xorshift64*).
pub(crate) struct XorShift(u64);

impl XorShift {
    pub(crate) fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform over `range` (the modulo's bias is negligible for the small ranges drawn here).
    pub(crate) fn within(&mut self, range: RangeInclusive<u64>) -> u64 {
        let (low, high) = range.into_inner();
        low + self.next() % (high - low + 1)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1_u64 << 53) as f64
    }

    /// Milliseconds to the next arrival of a Poisson process of `rate` a second.
    pub(crate) fn gap_ms(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate * 1000.0
    }

    /// An exponential draw of mean `mean` (a think time).
    pub(crate) fn exponential(&mut self, mean: f64) -> f64 {
        -(1.0 - self.unit()).ln() * mean
    }

    /// A log-normal draw of median `median` and shape `sigma` (the spread of its logarithm), by
    /// Box–Muller: lengths people write and paste are skewed, a few very long.
    pub(crate) fn log_normal(&mut self, median: f64, sigma: f64) -> f64 {
        let radius = (-2.0 * (1.0 - self.unit()).ln()).sqrt();
        let normal = radius * (std::f64::consts::TAU * self.unit()).cos();
        median * (sigma * normal).exp()
    }

    /// Group `g` of `groups` with weight `1 / (g + 1)`.
    pub(crate) fn weighted_group(&mut self, groups: u64) -> u64 {
        let total: f64 = (1..=groups).map(|g| 1.0 / g as f64).sum();
        let mut left = self.unit() * total;
        for group in 0..groups {
            left -= 1.0 / (group + 1) as f64;
            if left <= 0.0 {
                return group;
            }
        }
        groups - 1
    }
}

/// The word `n` picks, cycling through [`WORDS`].
fn word(n: u64) -> &'static str {
    WORDS
        .get((n % WORDS.len() as u64) as usize)
        .copied()
        .unwrap_or("the")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(ids: &[u64], input: u32) -> Item {
        Item {
            timestamp_ms: 0,
            input_length: input,
            output_length: 1,
            hash_ids: ids.to_vec(),
            phase: 0,
        }
    }

    #[test]
    fn bytes_prompts_are_exact_and_share_prefixes() {
        let builder = PromptBuilder::new(&TokenizerConfig::Bytes, 7);
        let a = builder.prompt(&item(&[1, 2, 3], 1300));
        let b = builder.prompt(&item(&[1, 2, 9], 1100));
        assert_eq!(a.len(), 1300 * 4);
        assert_eq!(b.len(), 1100 * 4);
        assert_eq!(a[..1024 * 4], b[..1024 * 4]);
        assert_ne!(a[1024 * 4..1100 * 4], b[1024 * 4..1100 * 4]);
        assert_ne!(a[..4], builder.prompt(&item(&[5], 10))[..4]);
    }

    #[test]
    fn mooncake_lines_parse() {
        let text = "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [2]}\n";
        let items = parse_mooncake(text, "t", None).expect("parses");
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].timestamp_ms, 1);
        assert_eq!(items[0].output_length, 1);
        assert_eq!(parse_mooncake(text, "t", Some(1)).expect("parses").len(), 1);
    }

    #[test]
    fn the_ideal_hit_rate_counts_every_block_seen_before_in_prefix_order() {
        // Two full blocks seen, then a third request that shares the first only: 512 + 2 × 512 − 1
        // hit of 3 × 1024 + 10.
        let items = [
            item(&[1, 2], 1024),
            item(&[1, 2], 1024),
            item(&[1, 3], 1034),
        ];
        let hit = 1023.0 + 512.0;
        assert!((ideal_hit_rate(&items) - hit / 3082.0).abs() < 1e-12);
        // A block seen after a miss does not hit: its prefix differs.
        let items = [item(&[1, 2], 1024), item(&[9, 2], 1024)];
        assert_eq!(ideal_hit_rate(&items), 0.0);
        assert_eq!(ideal_hit_rate(&[]), 0.0);
        // A line without ids (the parser takes it) hits nothing.
        assert_eq!(ideal_hit_rate(&[item(&[], 10), item(&[], 10)]), 0.0);
    }

    #[test]
    fn a_phase_of_one_group_shares_one_prefix_and_a_long_suffix_brings_its_own_blocks() {
        let phases = [Phase {
            name: "hot",
            rate: 50.0,
            length_ms: 2_000,
            suffix_tokens: 1_100,
            groups: 1,
        }];
        let items = phased(3, 1.0, &phases);
        assert!(items.len() > 50, "{}", items.len());
        let prefix: Vec<u64> = (0..BURST_PREFIX_BLOCKS).collect();
        for item in &items {
            assert_eq!(item.hash_ids[..prefix.len()], prefix[..]);
            // 1,100 tokens are three trace blocks of the request's own.
            assert_eq!(item.hash_ids.len(), prefix.len() + 3);
            assert_eq!(
                item.input_length as usize,
                prefix.len() * TRACE_BLOCK_TOKENS + 1_100
            );
        }
        let own: std::collections::HashSet<u64> = items
            .iter()
            .flat_map(|item| item.hash_ids[prefix.len()..].to_vec())
            .collect();
        assert_eq!(own.len(), 3 * items.len(), "no two requests share a suffix");
    }

    #[test]
    fn burst_has_three_phases_and_a_burst() {
        let items = burst(1, 0.2);
        let count = |phase| items.iter().filter(|item| item.phase == phase).count();
        assert!(count(0) > 0 && count(2) > 0);
        let bounds = burst_phase_bounds(0.2);
        let rate = |phase: usize| {
            let (_, start, end) = bounds[phase];
            count(phase) as f64 / ((end - start) / 1000.0)
        };
        assert!(rate(1) > 2.0 * rate(0), "{} vs {}", rate(1), rate(0));
    }
}

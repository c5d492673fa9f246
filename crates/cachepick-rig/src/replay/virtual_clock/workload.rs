//! A seed's workload in virtual time: the requests and their arrivals, each prompt's text and tokens
//! (held or made again), a trace's window per seed and the copies that scale a workload to a larger
//! fleet.

use std::sync::Arc;

use cachepick_sim::SimConfig;
use cachepick_sim::offline::WorkerTokenizer;

use super::VirtualOptions;
use crate::replay::ReplayError;
use crate::replay::trace::{self, Item, PromptBuilder};

/// Model seconds before the first arrival: the pickers' first scrape rounds, as the wall-clock replay
/// waits for its pickers to be ready.
pub const WARM_UP_S: f64 = 1.0;

/// Each copy of a workload merged into a larger fleet's starts up to this many trace seconds late.
pub const COPY_SHIFT_S: f64 = 60.0;

/// The fleet one copy of a workload is made for: the default fleet's 4 workers.
pub const WORKERS_PER_COPY: u32 = 4;

/// One request of a workload. Its prompt's text and tokens are held while the workload's fit in
/// [`HELD_PROMPT_BYTES`], else made again when a run needs them ([`Workload::prompt`]): a 64-worker
/// Mooncake workload's prompts are gigabytes, and a run then holds only those in flight.
#[derive(Clone, Debug)]
pub struct Request {
    /// Model seconds.
    pub at: f64,
    /// The prompt's tokens as the workers count them.
    pub prompt_len: u32,
    pub max_tokens: u32,
    item: Item,
}

/// A prompt's text and its tokens.
pub type Prompt = (Arc<str>, Arc<[u32]>);

/// Prompts are held, made once per seed, while they take at most this many bytes; a larger workload's
/// are made again whenever a run needs one.
pub const HELD_PROMPT_BYTES: usize = 1 << 30;

/// A seed's workload.
pub struct Workload {
    pub requests: Vec<Request>,
    pub ideal_hit_rate: f64,
    /// Every request's prompt, when they fit in [`HELD_PROMPT_BYTES`].
    held: Option<Arc<Vec<Prompt>>>,
    prompts: PromptBuilder,
    tokenizer: Arc<WorkerTokenizer>,
    model: String,
}

impl Workload {
    /// Request `index`'s prompt and its tokens as the workers tokenize them (built when the workload
    /// was, so tokenizing cannot fail here; an empty prompt if it somehow does).
    pub fn prompt(&self, index: usize) -> Prompt {
        if let Some(held) = self.held.as_ref().and_then(|held| held.get(index)) {
            return held.clone();
        }
        let text: Arc<str> = self
            .requests
            .get(index)
            .map(|request| self.prompts.prompt(&request.item))
            .unwrap_or_default()
            .into();
        let tokens = self.tokenizer.tokens(&text).unwrap_or_default().into();
        (text, tokens)
    }

    /// The same requests arriving `load` times faster than at load 1 (after the same warm-up): what a
    /// goodput search replays at each load it tries.
    pub fn at_load(&self, load: f64) -> Workload {
        let requests = self
            .requests
            .iter()
            .map(|request| Request {
                at: WARM_UP_S + (request.at - WARM_UP_S) / load,
                ..request.clone()
            })
            .collect();
        Workload {
            requests,
            ideal_hit_rate: self.ideal_hit_rate,
            held: self.held.clone(),
            prompts: self.prompts.clone(),
            tokenizer: Arc::clone(&self.tokenizer),
            model: self.model.clone(),
        }
    }

    /// The body of request `index` with prompt `text`: the completion the wall-clock replay sends.
    pub fn body(&self, index: usize, text: &str) -> Vec<u8> {
        let max_tokens = self
            .requests
            .get(index)
            .map_or(1, |request| request.max_tokens);
        serde_json::json!({
            "model": self.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
        .into_bytes()
    }
}

/// Seed `nth` of `of`'s workload: one copy per [`WORKERS_PER_COPY`] workers, each copy's prefixes its
/// own (block ids offset) and its start shifted by a seeded draw of up to [`COPY_SHIFT_S`], merged in
/// arrival order; arrivals at trace time ÷ load after [`WARM_UP_S`]. A trace cut to `--limit`
/// requests gives each seed its own window of them ([`window`]); the synthetic scenarios are drawn
/// from the seed.
pub(super) fn workload(
    options: &VirtualOptions,
    sim: &SimConfig,
    seed: u64,
    (nth, of): (usize, usize),
) -> Result<Workload, ReplayError> {
    let copies = sim.workers.get().div_ceil(WORKERS_PER_COPY).max(1);
    let mut items: Vec<Item> = Vec::new();
    let mut shift_rng = SplitMix(seed ^ 0x5EED_C0DE);
    for copy in 0..copies {
        let copy_seed = seed.wrapping_add(u64::from(copy).wrapping_mul(1_000_003));
        let mut one: Vec<Item> =
            options
                .scenario
                .requests(copy_seed, options.duration_scale, |path| {
                    Ok(window(
                        trace::load_mooncake(path, None)?,
                        options.limit,
                        nth,
                        of,
                    ))
                })?;
        if let Some(limit) = options.limit {
            one.truncate(limit);
        }
        let shift_ms = if copy == 0 {
            0
        } else {
            (shift_rng.unit() * COPY_SHIFT_S * 1000.0) as u64
        };
        let offset = u64::from(copy) << 40;
        for mut item in one {
            item.timestamp_ms += shift_ms;
            for id in &mut item.hash_ids {
                *id = id.wrapping_add(offset);
            }
            items.push(item);
        }
    }
    items.sort_by_key(|item| item.timestamp_ms);
    let ideal_hit_rate = trace::ideal_hit_rate(&items);
    let tokenizer = WorkerTokenizer::load(sim).map_err(ReplayError::Virtual)?;
    let prompts = PromptBuilder::new(&sim.tokenizer, seed);
    let first = items.first().map_or(0, |item| item.timestamp_ms);
    let mut requests = Vec::with_capacity(items.len());
    let mut held = Vec::new();
    let mut bytes = 0_usize;
    for item in items {
        let text = prompts.prompt(&item);
        let tokens = tokenizer.tokens(&text).map_err(ReplayError::Virtual)?;
        requests.push(Request {
            at: WARM_UP_S + (item.timestamp_ms - first) as f64 / 1000.0 / options.load,
            prompt_len: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            max_tokens: item.output_length,
            item,
        });
        bytes = bytes.saturating_add(text.len() + tokens.len() * 4);
        if bytes <= HELD_PROMPT_BYTES {
            held.push((Arc::<str>::from(text), Arc::<[u32]>::from(tokens)));
        }
    }
    Ok(Workload {
        held: (bytes <= HELD_PROMPT_BYTES).then(|| Arc::new(held)),
        requests,
        ideal_hit_rate,
        prompts,
        tokenizer: Arc::new(tokenizer),
        model: sim.model.clone(),
    })
}

/// Window `nth` of `of` of a trace cut to `limit` requests: the windows' starts are spread evenly over
/// the trace, the first at its start (the wall-clock replay's `--limit` cell), so that seeds see
/// different traffic of the same trace. Each window's times are made relative to its first request.
fn window(items: Vec<Item>, limit: Option<usize>, nth: usize, of: usize) -> Vec<Item> {
    let Some(limit) = limit.filter(|limit| *limit < items.len()) else {
        return items;
    };
    let room = items.len() - limit;
    let start = if of > 1 { room * nth / (of - 1) } else { 0 };
    let mut cut: Vec<Item> = items.into_iter().skip(start).take(limit).collect();
    let first = cut.first().map_or(0, |item| item.timestamp_ms);
    for item in &mut cut {
        item.timestamp_ms -= first;
    }
    cut
}

/// A seeded generator of the workload's shifts (SplitMix64): the rig's own, so a dependency's
/// algorithm change cannot move a workload.
struct SplitMix(u64);

impl SplitMix {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

//! What the model predicts a new request's time to first token would be on a rank, from the rank's true
//! state: the routing limit's (`cachepick replay`'s oracle arm) view, which no router in front of a real
//! engine has. It is the step model run forward without new arrivals: the prefill work already ahead (the
//! prefills under way, then the waiting requests' uncached tokens in their order) and then this request's
//! uncached tokens go through the token budget step by step, beside the decodes running (each a token per
//! step in vLLM; none in SGLang's prefill steps), each step priced by the profile. A prompt whose KV
//! does not fit after the work ahead waits for running requests to finish: it is charged their longest
//! remaining decode.

use crate::config::Engine;

use super::profile::{Profile, StepWork};
use super::{Seq, StepRank};
use crate::cache::{PromptBlocks, len_u64};

/// One prefill ahead in the budget: tokens left and where they start.
#[derive(Clone, Copy)]
struct Segment {
    tokens: u64,
    start: u64,
    /// Context the request decodes over once its prompt is done.
    context: u64,
}

/// Steps simulated at most per prediction: past this the rank is hopeless anyway.
const MAX_STEPS: usize = 100_000;

impl StepRank {
    /// Model seconds from now until a request with this prompt would emit its first token here, given
    /// `profile`, behind the prompts `in_flight` to the rank; the front (HTTP, tokenization) and the
    /// step in flight are not included.
    ///
    /// Over 100 lines: one walk of the rank's queue through the same steps the scheduler takes; its
    /// running totals live across them.
    pub fn predict_ttft(&self, prompt: &[u32], in_flight: &[&[u32]], profile: &Profile) -> f64 {
        let blocks = |prompt: &[u32]| PromptBlocks::of(prompt, self.limits.block_size);
        let in_flight: Vec<PromptBlocks> = in_flight.iter().map(|prompt| blocks(prompt)).collect();
        let in_flight: Vec<&PromptBlocks> = in_flight.iter().collect();
        self.predict_ttft_of(&blocks(prompt), &in_flight, profile)
    }

    /// [`StepRank::predict_ttft`] of prompts already hashed, at this rank's block size.
    ///
    /// Over 100 lines: as [`StepRank::predict_ttft`] says.
    pub fn predict_ttft_of(
        &self,
        prompt: &PromptBlocks,
        in_flight: &[&PromptBlocks],
        profile: &Profile,
    ) -> f64 {
        let block = usize::try_from(self.pool.block_size()).unwrap_or(1);
        // Tokens a prompt would find: the cache's, or a prompt sent before it.
        let lookup = |prompt: &PromptBlocks, earlier: &[&[u64]]| -> (u64, u64) {
            debug_assert_eq!(prompt.block_size, self.limits.block_size);
            let hashes = prompt.hashes.as_slice();
            let cap = self.hit_cap(prompt.len, hashes.len());
            let cached = self.pool.hit_blocks(hashes, cap);
            let shared = earlier
                .iter()
                .map(|other| len_u64(other.iter().zip(hashes).take_while(|(a, b)| a == b).count()))
                .max()
                .unwrap_or(0)
                .min(cap);
            (
                cached.max(shared).saturating_mul(len_u64(block)),
                prompt.len,
            )
        };
        let mut earlier: Vec<&[u64]> = Vec::with_capacity(in_flight.len());
        let mut sent: Vec<(u64, u64)> = Vec::with_capacity(in_flight.len());
        for prompt in in_flight {
            sent.push(lookup(prompt, &earlier));
            earlier.push(&prompt.hashes);
        }
        let (cached, prompt_len) = lookup(prompt, &earlier);
        let mut queue: Vec<Segment> = Vec::new();
        let mut decodes = 0u64;
        let mut context = 0u64;
        for seq in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            if seq.decoding() {
                decodes += 1;
                context = context.saturating_add(seq.num_tokens());
            } else {
                queue.push(Segment {
                    tokens: seq.pending(),
                    start: seq.computed,
                    context: seq.num_tokens(),
                });
            }
        }
        let mut ahead_blocks = 0u64;
        for seq in self.waiting.iter().filter_map(|id| self.seqs.get(id)) {
            let hit = self.hit_of(seq);
            let segment = Segment {
                tokens: seq.num_tokens().saturating_sub(hit).max(1),
                start: hit,
                context: seq.num_tokens(),
            };
            ahead_blocks = ahead_blocks.saturating_add(self.pool.blocks_for(segment.tokens));
            queue.push(segment);
        }
        for (hit, len) in sent {
            let segment = Segment {
                tokens: len.saturating_sub(hit).max(1),
                start: hit,
                context: len,
            };
            ahead_blocks = ahead_blocks.saturating_add(self.pool.blocks_for(segment.tokens));
            queue.push(segment);
        }
        let mine = prompt_len.saturating_sub(cached).max(1);
        queue.push(Segment {
            tokens: mine,
            start: cached,
            context: prompt_len,
        });
        let mine_blocks = self.pool.blocks_for(mine);
        let mut seconds = 0.0;
        if ahead_blocks.saturating_add(mine_blocks) > self.pool.free() {
            // Room comes only as running requests finish: wait for the longest of them.
            let longest = self
                .running
                .iter()
                .filter_map(|id| self.seqs.get(id))
                .map(|seq| seq.max_tokens.saturating_sub(seq.generated))
                .max()
                .unwrap_or(0);
            let mut decode = StepWork::default();
            for _ in 0..decodes.max(1) {
                decode.decode(context / decodes.max(1));
            }
            seconds += f64::from(longest) * profile.step_time(&decode);
        }
        let budget = u64::from(self.limits.batch_tokens.get());
        let prefill_only = self.limits.engine == Engine::Sglang;
        let mut front = 0;
        for _ in 0..MAX_STEPS {
            let mut work = StepWork::default();
            let mut left = budget;
            if !prefill_only {
                for _ in 0..decodes {
                    work.decode(context / decodes.max(1));
                }
                left = left.saturating_sub(decodes).max(1);
            }
            let mut finished_mine = false;
            while left > 0 {
                let Some(segment) = queue.get_mut(front) else {
                    break;
                };
                let take = segment.tokens.min(left);
                work.chunk(take, segment.start);
                segment.tokens -= take;
                segment.start = segment.start.saturating_add(take);
                left -= take;
                if segment.tokens == 0 {
                    decodes += 1;
                    context = context.saturating_add(segment.context);
                    front += 1;
                    finished_mine = front == queue.len();
                }
            }
            seconds += profile.step_time(&work);
            if finished_mine || front >= queue.len() {
                return seconds;
            }
        }
        seconds
    }

    fn hit_of(&self, seq: &Seq) -> u64 {
        let cap = self.hit_cap(seq.num_tokens(), seq.hashes.len());
        self.pool
            .hit_blocks(&seq.hashes, cap)
            .saturating_mul(self.pool.block_size())
    }
}

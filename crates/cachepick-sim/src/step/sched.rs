//! The two engines' step schedulers over a [`StepRank`]. Each forms one [`Step`]: the tokens every
//! scheduled request computes, the requests it admitted and the work's shape for the profile.

use crate::config::Engine;
use crate::model::RequestId;

use super::{
    LPM_MAX_WAITING, SGLANG_CLIP_MAX_NEW_TOKENS, SGLANG_INIT_NEW_TOKEN_RATIO,
    SGLANG_MIN_NEW_TOKEN_RATIO, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS,
    SchedulePolicy, Seq, Step, StepRank,
};
use crate::cache::{Hold, len_u64};

/// vLLM V1's `schedule()`: running first, preempting the newest on a KV shortfall, then waiting
/// requests if nothing was preempted.
pub(super) fn vllm(rank: &mut StepRank) -> Step {
    let mut step = Step::default();
    let mut budget = u64::from(rank.limits.batch_tokens.get());
    let mut preempted = false;
    let mut index = 0;
    'running: while budget > 0 {
        let Some(&id) = rank.running.get(index) else {
            break;
        };
        let Some(seq) = rank.seqs.get(&id) else {
            rank.running.remove(index);
            continue;
        };
        let tokens = seq.pending().min(budget);
        let target = seq.computed.saturating_add(tokens);
        loop {
            let Some(seq) = rank.seqs.get(&id) else {
                break 'running;
            };
            if let Some(hold) = rank.pool.grow(&seq.holder(), target) {
                if let Some(seq) = rank.seqs.get_mut(&id) {
                    seq.hold = hold;
                    record(&mut step, id, seq, tokens);
                }
                break;
            }
            let Some(victim) = rank.running.pop() else {
                break 'running;
            };
            preempt(rank, victim);
            preempted = true;
            if victim == id {
                break 'running;
            }
        }
        budget = budget.saturating_sub(tokens);
        index += 1;
    }
    if preempted {
        return step;
    }
    while budget > 0 && rank.running.len() < limit(rank.limits.max_running.get()) {
        let Some(&id) = rank.waiting.front() else {
            break;
        };
        let Some(admitted) = admit(rank, id, budget) else {
            break;
        };
        rank.waiting.pop_front();
        rank.running.push(id);
        if let Some(seq) = rank.seqs.get(&id) {
            record(&mut step, id, seq, admitted.tokens);
        }
        if let Some(cached) = admitted.first_lookup {
            step.admitted.push((id, cached));
        }
        budget = budget.saturating_sub(admitted.tokens);
    }
    step
}

/// SGLang's `get_next_batch_to_run`: a prefill batch when one can be formed, else the decode batch; a
/// decode that retracted every decoder leaves room a prefill can use at once.
pub(super) fn sglang(rank: &mut StepRank) -> Step {
    if rank.running.is_empty() {
        // Idle, SGLang's scheduler resets its estimate (`self_check_during_idle`).
        rank.sglang.new_token_ratio = SGLANG_INIT_NEW_TOKEN_RATIO;
    }
    let step = sglang_prefill(rank);
    if !step.is_empty() {
        return step;
    }
    let (step, retracted) = sglang_decode(rank);
    if step.is_empty() && retracted {
        return sglang_prefill(rank);
    }
    step
}

/// The chunked request continued, then waiting requests (in `fcfs` or `lpm` order) while the chunk
/// budget, `max_prefill_tokens`, the running limit and the KV reservation allow.
///
/// Over 100 lines: SGLang's `PrefillAdder` in one pass, its budgets shared by the chunked request
/// and the waiting ones.
fn sglang_prefill(rank: &mut StepRank) -> Step {
    let mut step = Step::default();
    let block = rank.pool.block_size();
    let mut chunk = u64::from(rank.limits.batch_tokens.get());
    let mut input = u64::from(rank.limits.max_prefill_tokens.get());
    // What the decode batch is assumed to still need, scaled by the ratio (`PrefillAdder`); the chunked
    // request is charged below, as `add_chunked_req` charges it.
    let reserved: f64 = rank
        .running
        .iter()
        .filter_map(|id| rank.seqs.get(id))
        .filter(|seq| seq.decoding())
        .map(|seq| {
            let left = u64::from(seq.max_tokens.saturating_sub(seq.generated));
            left.min(SGLANG_CLIP_MAX_NEW_TOKENS) as f64 * rank.sglang.new_token_ratio
        })
        .sum();
    let mut total = rank.pool.free().saturating_mul(block) as f64 - reserved;
    let mut hit_tokens = 0u64;
    let mut new_tokens = 0u64;

    // The chunked request (a prefill in progress) goes first.
    let continuing: Vec<RequestId> = rank
        .running
        .iter()
        .copied()
        .filter(|id| rank.seqs.get(id).is_some_and(|seq| !seq.decoding()))
        .collect();
    for id in continuing {
        let Some(seq) = rank.seqs.get(&id) else {
            continue;
        };
        let tokens = seq.pending().min(chunk);
        if tokens == 0 {
            break;
        }
        let Some(hold) = rank
            .pool
            .grow(&seq.holder(), seq.computed.saturating_add(tokens))
        else {
            break;
        };
        let mut future = 0;
        if let Some(seq) = rank.seqs.get_mut(&id) {
            seq.hold = hold;
            record(&mut step, id, seq, tokens);
            // Its output counts only once this chunk finishes its prompt.
            if tokens == seq.pending() {
                future = u64::from(seq.max_tokens.saturating_sub(seq.generated))
                    .min(SGLANG_CLIP_MAX_NEW_TOKENS);
            }
        }
        total -= tokens.saturating_add(future) as f64;
        chunk = chunk.saturating_sub(tokens);
        input = input.saturating_sub(tokens);
        new_tokens = new_tokens.saturating_add(tokens);
    }

    for id in sglang_order(rank) {
        if chunk == 0 || rank.running.len() >= limit(rank.limits.max_running.get()) {
            break;
        }
        let Some(seq) = rank.seqs.get(&id) else {
            continue;
        };
        let cached = hit(rank, seq);
        let extend = seq.num_tokens().saturating_sub(cached);
        let future =
            u64::from(seq.max_tokens.saturating_sub(seq.generated)).min(SGLANG_CLIP_MAX_NEW_TOKENS);
        let needs = extend.saturating_add(future) as f64;
        // `NO_TOKEN`: its input and output would not fit what is left; the first request of a batch
        // may exceed `max_prefill_tokens`, later ones may not.
        if needs >= total || (!step.is_empty() && extend > input) {
            break;
        }
        let Some(admitted) = admit(rank, id, chunk) else {
            break;
        };
        rank.waiting.retain(|other| *other != id);
        rank.running.push(id);
        if let Some(seq) = rank.seqs.get(&id) {
            record(&mut step, id, seq, admitted.tokens);
        }
        if let Some(cached) = admitted.first_lookup {
            step.admitted.push((id, cached));
        }
        total -= needs;
        chunk = chunk.saturating_sub(admitted.tokens);
        input = input.saturating_sub(admitted.tokens);
        hit_tokens = hit_tokens.saturating_add(admitted.cached);
        new_tokens = new_tokens.saturating_add(admitted.tokens);
        if admitted.tokens < extend {
            // It became the chunked request: nothing joins after it.
            break;
        }
    }
    let looked_up = hit_tokens.saturating_add(new_tokens);
    if !step.admitted.is_empty() && looked_up > 0 {
        rank.sglang.last_hit_rate = hit_tokens as f64 / looked_up as f64;
    }
    step
}

/// The waiting queue in the order SGLang considers it.
fn sglang_order(rank: &StepRank) -> Vec<RequestId> {
    let mut order: Vec<RequestId> = rank.waiting.iter().copied().collect();
    if rank.limits.policy == SchedulePolicy::Lpm && order.len() <= LPM_MAX_WAITING {
        // Longest cached prefix first; the sort is stable, so ties keep their arrival order.
        order
            .sort_by_key(|id| std::cmp::Reverse(rank.seqs.get(id).map_or(0, |seq| hit(rank, seq))));
    }
    order
}

/// Every decoding request takes one token; when their KV does not fit, the request with the fewest
/// outputs (the longest input among those) is retracted to the queue until it does. Returns the step
/// and whether anything was retracted.
fn sglang_decode(rank: &mut StepRank) -> (Step, bool) {
    let mut step = Step::default();
    let mut retracted = false;
    loop {
        let needed: u64 = rank
            .running
            .iter()
            .filter_map(|id| rank.seqs.get(id))
            .filter(|seq| seq.decoding())
            .map(|seq| {
                rank.pool
                    .blocks_for(seq.computed.saturating_add(1))
                    .saturating_sub(seq.hold.blocks)
            })
            .sum();
        if needed <= rank.pool.free() {
            break;
        }
        let victim = rank
            .running
            .iter()
            .filter_map(|id| rank.seqs.get(id).map(|seq| (*id, seq)))
            .filter(|(_, seq)| seq.decoding())
            .min_by_key(|(_, seq)| (seq.generated, std::cmp::Reverse(seq.prompt_len)))
            .map(|(id, _)| id);
        let Some(victim) = victim else {
            break;
        };
        rank.running.retain(|id| *id != victim);
        preempt(rank, victim);
        retracted = true;
    }
    let decoding: Vec<RequestId> = rank
        .running
        .iter()
        .copied()
        .filter(|id| rank.seqs.get(id).is_some_and(Seq::decoding))
        .collect();
    for id in decoding {
        let Some(seq) = rank.seqs.get(&id) else {
            continue;
        };
        let Some(hold) = rank
            .pool
            .grow(&seq.holder(), seq.computed.saturating_add(1))
        else {
            continue;
        };
        if let Some(seq) = rank.seqs.get_mut(&id) {
            seq.hold = hold;
            record(&mut step, id, seq, 1);
        }
    }
    let ratio = &mut rank.sglang.new_token_ratio;
    if retracted {
        // The post-retraction estimate: what the batch decoded plus a margin, over what it may still ask.
        let (decoded, asked) = rank.running.iter().filter_map(|id| rank.seqs.get(id)).fold(
            (0u64, 0u64),
            |(decoded, asked), seq| {
                (
                    decoded.saturating_add(u64::from(seq.generated)),
                    asked.saturating_add(u64::from(seq.max_tokens)),
                )
            },
        );
        let batch = len_u64(rank.running.len()) as f64;
        *ratio = ((decoded as f64 + SGLANG_RETRACT_DECODE_STEPS * batch) / (asked as f64 + 1.0))
            .min(1.0);
    } else if !step.is_empty() {
        let decay = (SGLANG_INIT_NEW_TOKEN_RATIO - SGLANG_MIN_NEW_TOKEN_RATIO)
            / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS;
        *ratio = (*ratio - decay).max(SGLANG_MIN_NEW_TOKEN_RATIO);
    }
    (step, retracted)
}

/// A request's first chunk started.
struct Admitted {
    /// Tokens it computes this step.
    tokens: u64,
    /// Tokens the cache held.
    cached: u64,
    /// `Some(cached)` on its first admission (not after a preemption).
    first_lookup: Option<u32>,
}

/// Starts waiting request `id` with a chunk of at most `budget` tokens after its cached prefix, if
/// the chunk's KV fits; counts its prefix lookup on its first admission.
fn admit(rank: &mut StepRank, id: RequestId, budget: u64) -> Option<Admitted> {
    let seq = rank.seqs.get(&id)?;
    let local = hit(rank, seq);
    // Transferred tokens are held like cached ones, leaving at least one to compute.
    let cached = local.max(seq.remote.min(seq.num_tokens().saturating_sub(1)));
    let tokens = seq.num_tokens().saturating_sub(cached).min(budget);
    let holder = super::Holder {
        hold: Hold::default(),
        ..seq.holder()
    };
    let hold = rank.pool.grow(&holder, cached.saturating_add(tokens))?;
    let seq = rank.seqs.get_mut(&id)?;
    seq.hold = hold;
    seq.computed = cached;
    let first_lookup = if seq.cached.is_none() {
        let cached = u32::try_from(cached).unwrap_or(u32::MAX);
        seq.cached = Some(cached);
        let counters = &mut rank.counters;
        // SGLang counts a prompt when it is scheduled; vLLM when its prefill completes (`complete`).
        if rank.limits.engine == Engine::Sglang {
            counters.prompt_tokens = counters.prompt_tokens.saturating_add(seq.prompt_len);
        }
        counters.prefix_queried_tokens = counters
            .prefix_queried_tokens
            .saturating_add(seq.prompt_len);
        // The prefix cache's own hits: a transfer is no hit of this rank's cache.
        counters.prefix_hit_tokens = counters.prefix_hit_tokens.saturating_add(local);
        Some(cached)
    } else {
        None
    };
    Some(Admitted {
        tokens,
        cached,
        first_lookup,
    })
}

/// Tokens of `seq`'s prompt the cache holds now, in whole blocks, leaving at least one to compute.
fn hit(rank: &StepRank, seq: &Seq) -> u64 {
    let cap = rank.hit_cap(seq.num_tokens(), seq.hashes.len());
    rank.pool
        .hit_blocks(&seq.hashes, cap)
        .saturating_mul(rank.pool.block_size())
}

/// Recompute preemption (vLLM) or retraction (SGLang): the request loses its KV, keeps its outputs,
/// and waits to compute them again — at the front of the queue in vLLM (`prepend_request`), at its back
/// in SGLang (`_add_request_to_queue`).
fn preempt(rank: &mut StepRank, id: RequestId) {
    let Some(seq) = rank.seqs.get_mut(&id) else {
        return;
    };
    rank.pool.release(&seq.hashes, seq.hold);
    seq.hold = Hold::default();
    seq.computed = 0;
    seq.remote = 0;
    match rank.limits.engine {
        Engine::Vllm => rank.waiting.push_front(id),
        Engine::Sglang => rank.waiting.push_back(id),
    }
    rank.counters.preemptions = rank.counters.preemptions.saturating_add(1);
}

/// Adds a scheduled request's tokens to the step: a decode (one token after its whole context) or a
/// prefill chunk after the tokens it has computed.
fn record(step: &mut Step, id: RequestId, seq: &Seq, tokens: u64) {
    if seq.decoding() {
        step.work.decode(seq.num_tokens());
    } else {
        step.work.chunk(tokens, seq.computed);
    }
    step.scheduled.push((id, tokens));
}

fn limit(value: u32) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

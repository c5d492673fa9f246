//! The step model in virtual time: the calibration checkpoints of `MODEL.md` (C1–C15), the schedulers'
//! rules, and the invariants every step keeps.

use std::collections::HashMap;
use std::num::NonZeroU32;

use proptest::prelude::*;

use super::*;
use crate::cache::Hold;
use crate::config::{SimParams, sglang_max_running};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// The rank an engine runs on `profile`'s GPU with its defaults, block size 16.
fn rank_on(engine: Engine, profile: &Profile) -> StepRank {
    rank_with(engine, profile, |_| {})
}

/// A rank on `profile`'s defaults with the parameters `tune` changes.
fn rank_with(engine: Engine, profile: &Profile, tune: impl FnOnce(&mut SimParams)) -> StepRank {
    let mut params = SimParams::step(engine, profile);
    tune(&mut params);
    StepRank::new(0, limits(engine, &params))
}

fn limits(engine: Engine, params: &SimParams) -> StepLimits {
    StepLimits::of(engine, nz(16), params)
}

/// `len` tokens from `start`, distinct from other ranges.
fn tokens(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

/// One request of a virtual-time run.
struct Arrival {
    at: f64,
    id: RequestId,
    prompt: Vec<u32>,
    output: u32,
}

fn at(at: f64, id: RequestId, prompt: Vec<u32>, output: u32) -> Arrival {
    Arrival {
        at,
        id,
        prompt,
        output,
    }
}

/// What a virtual-time run saw.
#[derive(Default)]
struct Run {
    /// Per request, when each output token came (model seconds from 0).
    tokens: HashMap<RequestId, Vec<f64>>,
    /// Every step's duration and tokens.
    steps: Vec<(f64, u64)>,
    /// When each step started.
    starts: Vec<f64>,
}

impl Run {
    fn ttft(&self, id: RequestId) -> f64 {
        self.tokens[&id][0]
    }
}

/// Runs `rank` on `profile` in virtual time until every request is done, checking the invariants
/// after every step.
fn drive(rank: &mut StepRank, profile: &Profile, mut arrivals: Vec<Arrival>) -> Run {
    arrivals.sort_by(|a, b| a.at.total_cmp(&b.at));
    let mut arrivals = std::collections::VecDeque::from(arrivals);
    let mut now = 0.0;
    let mut run = Run::default();
    let budget = u64::from(rank.limits.batch_tokens.get());
    for _ in 0..1_000_000 {
        while arrivals.front().is_some_and(|a| a.at <= now) {
            let a = arrivals.pop_front().unwrap();
            rank.submit(a.id, &a.prompt, a.output).unwrap();
            run.tokens.entry(a.id).or_default();
        }
        let step = rank.schedule();
        if step.is_empty() {
            match arrivals.front() {
                Some(next) => {
                    now = next.at;
                    continue;
                }
                None => break,
            }
        }
        let scheduled: u64 = step.scheduled.iter().map(|(_, n)| n).sum();
        assert!(
            scheduled <= budget,
            "{scheduled} tokens over the budget {budget}"
        );
        assert_eq!(scheduled, step.work.tokens);
        let seconds = profile.step_time(&step.work);
        run.starts.push(now);
        now += seconds;
        run.steps.push((seconds, scheduled));
        for emission in rank.complete(&step, seconds) {
            if let Emission::Token { id, .. } = emission {
                run.tokens.entry(id).or_default().push(now);
            }
        }
        check(rank);
    }
    assert!(
        rank.seqs.is_empty(),
        "requests left: {:?}",
        rank.seqs.keys()
    );
    run
}

/// The invariants that hold after every step.
fn check(rank: &StepRank) {
    rank.pool.check();
    let held: u64 = rank.seqs.values().map(|seq| seq.hold.blocks).sum();
    let cached_held: u64 = rank.seqs.values().map(|seq| seq.hold.cached).sum();
    assert_eq!(
        rank.pool.pins(),
        cached_held,
        "pins are the requests' cached blocks"
    );
    assert_eq!(rank.pool.anonymous(), held - cached_held);
    assert!(rank.pool.pinned() <= rank.pool.capacity());
    assert_eq!(rank.pool.pinned() + rank.pool.free(), rank.pool.capacity());
    assert!(rank.running.len() <= rank.limits.max_running.get() as usize);
    for id in rank.waiting.iter() {
        assert_eq!(
            rank.seqs[id].hold.blocks, 0,
            "a waiting request holds no blocks"
        );
        assert!(!rank.running.contains(id));
    }
    for seq in rank.seqs.values() {
        assert!(seq.computed <= seq.num_tokens());
        assert!(seq.computed <= seq.hold.blocks * 16);
        assert!(seq.hold.cached <= seq.hold.blocks.min(seq.hashes.len() as u64));
        // Only fully computed blocks are cached (checked between steps, when every chunk is applied).
        assert!(
            seq.hold.cached * 16 <= seq.computed,
            "a half-computed block is cached"
        );
    }
}

/// Within `tolerance` (a fraction) of `expected`.
fn close(what: &str, got: f64, expected: f64, tolerance: f64) {
    let error = (got - expected).abs() / expected;
    assert!(
        error <= tolerance,
        "{what}: {got:.4} against {expected:.4} (off by {:.1}%, tolerance {:.0}%)",
        error * 100.0,
        tolerance * 100.0
    );
}

fn h100() -> Profile {
    Profile::llama31_8b_h100()
}

fn a100() -> Profile {
    Profile::llama31_8b_a100()
}

/// The inter-token latency of `batch` requests decoding together at about `context` tokens: the
/// median step once every one of them decodes (the steps of their prefills are not decode steps).
fn batch_itl(profile: &Profile, batch: u32, context: u32) -> f64 {
    let params = SimParams {
        kv_blocks: nz(200_000),
        ..SimParams::step(Engine::Vllm, profile)
    };
    let mut rank = StepRank::new(0, limits(Engine::Vllm, &params));
    let prefill_steps = (batch * context).div_ceil(params.batch_tokens.get());
    let arrivals = (0..batch)
        .map(|i| {
            at(
                0.0,
                u64::from(i),
                tokens(i * 100_000, context),
                prefill_steps + 40,
            )
        })
        .collect();
    let run = drive(&mut rank, profile, arrivals);
    let mut decode: Vec<f64> = run
        .steps
        .iter()
        .filter(|(_, tokens)| *tokens == u64::from(batch))
        .map(|(seconds, _)| *seconds)
        .collect();
    assert!(decode.len() >= 30, "{} decode steps", decode.len());
    decode.sort_by(f64::total_cmp);
    decode[decode.len() / 2]
}

fn lone_ttft(profile: &Profile, prompt: u32) -> f64 {
    let mut rank = rank_on(Engine::Vllm, profile);
    drive(&mut rank, profile, vec![at(0.0, 1, tokens(0, prompt), 1)]).ttft(1)
}

#[test]
fn c1_c2_batch_one_decode_steps_match_the_measured_tpot() {
    // Lambda, Meta-Llama-3-8B-Instruct bf16: 7.56 ms median TPOT on an H100, 11.3–11.9 ms on an A100.
    close(
        "C1 H100 batch-1 ITL",
        batch_itl(&h100(), 1, 500),
        7.2e-3,
        0.10,
    );
    close(
        "C1 H100 batch-10 ITL",
        batch_itl(&h100(), 10, 500),
        7.2e-3,
        0.10,
    );
    close(
        "C2 A100 batch-1 ITL",
        batch_itl(&a100(), 1, 500),
        11.1e-3,
        0.10,
    );
}

#[test]
fn c3_ten_short_prompts_cost_the_measured_gap_between_the_gpus() {
    let ttft = |profile: &Profile| {
        let mut rank = rank_on(Engine::Vllm, profile);
        let arrivals = (0..10)
            .map(|i| {
                at(
                    0.0,
                    i,
                    tokens(i as u32 * 1000, if i < 9 { 137 } else { 136 }),
                    1,
                )
            })
            .collect();
        let run = drive(&mut rank, profile, arrivals);
        (0..10).map(|i| run.ttft(i)).fold(0.0, f64::max)
    };
    // Lambda's 10-prompt runs: 126.9 ms on the A100 against 62.4 ms on the H100 (the rest is t_front).
    close("C3", ttft(&a100()) - ttft(&h100()), 64.4e-3, 0.15);
}

#[test]
fn c4_to_c6_lone_prompts_prefill_as_derived() {
    close("C4 lone 1k prompt", lone_ttft(&h100(), 1024), 25e-3, 0.20);
    close("C5 lone 8k prompt", lone_ttft(&h100(), 8192), 211e-3, 0.20);
    close("C6 lone 32k prompt", lone_ttft(&h100(), 32_768), 1.27, 0.25);
    // 45% of the 32k prompt is attention: the model without its attention term is 55% as long.
    let flat = Profile {
        attention_pair: 0.0,
        ..h100()
    };
    close(
        "C6 attention share",
        1.0 - lone_ttft(&flat, 32_768) / lone_ttft(&h100(), 32_768),
        0.45,
        0.25,
    );
    // It takes four steps of the 8,192-token budget.
    let mut rank = rank_on(Engine::Vllm, &h100());
    let run = drive(&mut rank, &h100(), vec![at(0.0, 1, tokens(0, 32_768), 1)]);
    assert_eq!(run.steps.len(), 4);
}

#[test]
fn c7_peak_prefill_throughput_is_budget_bound() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    let arrivals = (0..64)
        .map(|i| at(0.0, i, tokens(i as u32 * 10_000, 1024), 1))
        .collect();
    let run = drive(&mut rank, &profile, arrivals);
    let (seconds, tokens): (f64, u64) = run
        .steps
        .iter()
        .fold((0.0, 0), |(s, t), (ds, dt)| (s + ds, t + dt));
    // Eight prompts a step, every step full.
    assert!(run.steps.iter().all(|(_, tokens)| *tokens == 8192));
    close("C7 tokens/s", tokens as f64 / seconds, 45.6e3, 0.20);
}

#[test]
fn c8_to_c10_decode_follows_the_summed_context() {
    close(
        "C8 batch 32 ctx 1k",
        batch_itl(&h100(), 32, 1024),
        9.3e-3,
        0.15,
    );
    close(
        "C9 batch 128 ctx 1k",
        batch_itl(&h100(), 128, 1024),
        16.3e-3,
        0.20,
    );
    close(
        "C9 batch 128 ctx 8k",
        batch_itl(&h100(), 128, 8192),
        68.6e-3,
        0.20,
    );
    close(
        "C10 batch 256 ctx 512",
        batch_itl(&h100(), 256, 512),
        18.7e-3,
        0.25,
    );
}

#[test]
fn c11_a_long_chunk_slows_every_decode_in_its_step() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    let mut arrivals: Vec<Arrival> = (0..64)
        .map(|i| at(0.0, i, tokens(i as u32 * 10_000, 1024), 400))
        .collect();
    // Arrives once the 64 decode: the next step carries it beside them, 8,128 tokens of it.
    arrivals.push(at(2.5, 100, tokens(5_000_000, 8128), 1));
    let run = drive(&mut rank, &profile, arrivals);
    let index = run
        .starts
        .iter()
        .position(|start| *start >= 2.5)
        .expect("a step after the arrival");
    let stalled = run.steps[index];
    assert_eq!(stalled.1, 64 + 8128, "64 decodes and the whole chunk");
    close("C11 step", stalled.0, 214e-3, 0.20);
    // Every decoder's largest gap is that step.
    for id in 0..64 {
        let times = &run.tokens[&id];
        let widest = times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
        close("C11 ITL of a decoder", widest, stalled.0, 1e-9);
    }
}

#[test]
fn c12_c13_a_prefix_hit_skips_its_tokens_but_not_their_attention() {
    let profile = h100();
    let prompt = tokens(0, 8192);
    let mut rank = rank_on(Engine::Vllm, &profile);
    let run = drive(
        &mut rank,
        &profile,
        vec![
            at(0.0, 1, prompt.clone(), 1),
            at(10.0, 2, prompt.clone(), 1),
        ],
    );
    // A block-aligned prompt recomputes its last block: 8,176 cached, 16 computed.
    close("C12 fully cached 8k", run.ttft(2) - 10.0, 7.3e-3, 0.15);
    assert_eq!(rank.counters.prefix_hit_tokens, 8176);
    let mut rank = rank_on(Engine::Vllm, &profile);
    let half: Vec<u32> = prompt[..4096]
        .iter()
        .copied()
        .chain(tokens(900_000, 4096))
        .collect();
    let run = drive(
        &mut rank,
        &profile,
        vec![at(0.0, 1, prompt, 1), at(10.0, 2, half, 1)],
    );
    close("C13 8k with 4k cached", run.ttft(2) - 10.0, 115e-3, 0.20);
}

#[test]
fn c14_simultaneous_misses_queue_on_the_budget_in_arrival_order() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    let arrivals = (0..16)
        .map(|i| at(0.0, i, tokens(i as u32 * 10_000, 8192), 2))
        .collect();
    let run = drive(&mut rank, &profile, arrivals);
    let ttfts: Vec<f64> = (0..16).map(|i| run.ttft(i)).collect();
    assert!(ttfts.windows(2).all(|w| w[0] < w[1]), "FCFS: {ttfts:?}");
    close("C14 first", ttfts[0], 0.211, 0.20);
    close("C14 last", ttfts[15], 3.43, 0.20);
    close("C14 mean", ttfts.iter().sum::<f64>() / 16.0, 1.81, 0.20);
}

#[test]
fn c15_the_a100_profile_uses_its_own_budget() {
    let params = SimParams::step(Engine::Vllm, &a100());
    assert_eq!(params.batch_tokens.get(), 2048);
    assert_eq!(params.max_running.get(), 256);
    close("C15 A100 lone 8k", lone_ttft(&a100(), 8192), 657e-3, 0.25);
    close(
        "C15 A100 batch 256 ctx 512",
        batch_itl(&a100(), 256, 512),
        35.7e-3,
        0.25,
    );
}

#[test]
fn every_named_profile_is_found_by_its_name() {
    for profile in Profile::named() {
        assert_eq!(Profile::by_name(&profile.name), Some(profile.clone()));
    }
    assert_eq!(Profile::default().name, profile::LLAMA31_8B_H100);
    assert_eq!(Profile::by_name("gpt-5"), None);
    // SGLang's default running limit for 467k tokens at a 131k context.
    assert_eq!(sglang_max_running(29_205, 131_072), 2048);
    assert_eq!(
        SimParams::step(Engine::Sglang, &h100()).max_running.get(),
        2048
    );
}

#[test]
fn vllm_preempts_the_newest_request_when_decode_runs_out_of_blocks() {
    let profile = h100();
    let mut rank = rank_with(Engine::Vllm, &profile, |p| {
        p.kv_blocks = nz(20);
    });
    // Two requests of 6 prompt blocks each fit (12 of 20); their outputs grow until the older one
    // needs a block the newer one holds.
    rank.submit(1, &tokens(0, 96), 80).unwrap();
    rank.submit(2, &tokens(1000, 96), 80).unwrap();
    let mut order = Vec::new();
    let mut preempted_at = None;
    for step_index in 0..500 {
        let step = rank.schedule();
        if step.is_empty() {
            break;
        }
        if rank.counters.preemptions > 0 && preempted_at.is_none() {
            preempted_at = Some(step_index);
            // The newest was preempted, to the front of the queue, holding nothing.
            assert_eq!(rank.waiting.front(), Some(&2));
            assert_eq!(rank.seqs[&2].hold.blocks, 0);
            assert_eq!(rank.seqs[&2].computed, 0);
            assert!(rank.seqs[&2].generated > 0, "it keeps its outputs");
        }
        for emission in rank.complete(&step, 0.01) {
            if let Emission::Finished { id } = emission {
                order.push(id);
            }
        }
        check(&rank);
    }
    assert!(preempted_at.is_some(), "no preemption");
    assert_eq!(order, [1, 2], "both finish, the older first");
    // Its re-admission is not a new lookup in the counters.
    assert_eq!(rank.counters.prefix_queried_tokens, 192);
}

#[test]
fn vllm_admits_nothing_new_in_a_step_that_preempted() {
    let profile = h100();
    let mut rank = rank_with(Engine::Vllm, &profile, |p| {
        p.kv_blocks = nz(13);
    });
    rank.submit(1, &tokens(0, 96), 40).unwrap();
    rank.submit(2, &tokens(1000, 96), 40).unwrap();
    for _ in 0..200 {
        let step = rank.schedule();
        if rank.counters.preemptions > 0 {
            assert!(step.admitted.is_empty());
            assert!(step.scheduled.iter().all(|(id, _)| *id == 1));
            return;
        }
        rank.complete(&step, 0.01);
    }
    panic!("no preemption");
}

#[test]
fn sglang_runs_prefill_steps_in_which_decoders_get_no_token() {
    let profile = h100();
    let mut rank = rank_on(Engine::Sglang, &profile);
    let mut arrivals: Vec<Arrival> = (0..8)
        .map(|i| at(0.0, i, tokens(i as u32 * 10_000, 512), 100))
        .collect();
    arrivals.push(at(0.3, 100, tokens(5_000_000, 16_000), 1));
    let run = drive(&mut rank, &profile, arrivals);
    // The 16k prompt took two prefill steps (chunks of 8,192) with no decode in them: the decoders'
    // widest gap spans both.
    let prefill_steps: Vec<f64> = run
        .steps
        .iter()
        .filter(|(_, tokens)| *tokens > 1000)
        .map(|(seconds, _)| *seconds)
        .collect();
    assert!(prefill_steps.len() >= 2, "{:?}", run.steps);
    let widest = run.tokens[&0]
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(0.0, f64::max);
    assert!(
        widest > prefill_steps.iter().take(2).sum::<f64>(),
        "{widest} against {prefill_steps:?}"
    );
    // In vLLM the same decoders get a token in every step, the chunk's included.
    let mut vllm = rank_on(Engine::Vllm, &profile);
    let mut arrivals: Vec<Arrival> = (0..8)
        .map(|i| at(0.0, i, tokens(i as u32 * 10_000, 512), 100))
        .collect();
    arrivals.push(at(0.3, 100, tokens(5_000_000, 16_000), 1));
    let run = drive(&mut vllm, &profile, arrivals);
    let widest_vllm = run.tokens[&0]
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(0.0, f64::max);
    assert!(widest_vllm < widest, "{widest_vllm} against {widest}");
}

#[test]
fn sglang_reserves_future_output_and_retracts_when_decode_runs_dry() {
    let profile = h100();
    let mut rank = rank_with(Engine::Sglang, &profile, |p| {
        p.kv_blocks = nz(64);
    });
    // 1,024 tokens of KV; each request asks 16 prompt + 400 output tokens. A new request reserves its
    // whole output, so two start, not three.
    for id in 0..4 {
        rank.submit(id, &tokens(id as u32 * 1000, 16), 400).unwrap();
    }
    let step = rank.schedule();
    assert_eq!(step.admitted.len(), 2, "{step:?}");
    assert_eq!(rank.waiting(), 2);
    // Running requests reserve their remaining output scaled by the decaying ratio, which lets a third
    // in before the first two are done; their outputs then outgrow the pool: retraction, not a stuck
    // rank, and everyone finishes.
    rank.complete(&step, 0.01);
    drive(&mut rank, &profile, Vec::new());
    assert!(rank.counters.preemptions > 0, "no retraction");
    assert_eq!(rank.counters.finished_length, 4);
}

#[test]
fn sglang_lpm_takes_the_longest_cached_prefix_first() {
    let profile = h100();
    let mut rank = rank_with(Engine::Sglang, &profile, |p| {
        p.schedule_policy = SchedulePolicy::Lpm;
        p.batch_tokens = nz(600);
    });
    let shared = tokens(0, 512);
    drive(&mut rank, &profile, vec![at(0.0, 1, shared.clone(), 1)]);
    let cold = tokens(50_000, 560);
    let warm: Vec<u32> = shared.iter().copied().chain(tokens(90_000, 48)).collect();
    rank.submit(2, &cold, 1).unwrap();
    rank.submit(3, &warm, 1).unwrap();
    let step = rank.schedule();
    assert_eq!(
        step.admitted.first().map(|(id, _)| *id),
        Some(3),
        "{step:?}"
    );
    // Under fcfs the cold one, first in line, goes first.
    let mut fcfs = StepRank::new(
        0,
        limits(Engine::Sglang, &SimParams::step(Engine::Sglang, &profile)),
    );
    drive(&mut fcfs, &profile, vec![at(0.0, 1, shared, 1)]);
    fcfs.submit(2, &cold, 1).unwrap();
    fcfs.submit(3, &warm, 1).unwrap();
    assert_eq!(fcfs.schedule().admitted.first().map(|(id, _)| *id), Some(2));
}

#[test]
fn sglang_reports_the_decode_batch_as_running_and_the_prefill_as_uncached_work() {
    let profile = h100();
    let mut rank = rank_on(Engine::Sglang, &profile);
    rank.submit(1, &tokens(0, 64), 50).unwrap();
    let step = rank.schedule();
    rank.complete(&step, 0.01);
    // A 20k prompt is chunked; while its prefill is under way it is not "running".
    rank.submit(2, &tokens(10_000, 20_000), 1).unwrap();
    let step = rank.schedule();
    assert_eq!(step.admitted.len(), 1);
    rank.complete(&step, 0.1);
    let stats = rank.stats();
    assert_eq!(stats.running, 1, "the decoder only");
    assert_eq!(stats.waiting, 0);
    assert_eq!(stats.waiting_uncached_tokens, 20_000 - 8192);
    // vLLM counts it as running.
    let mut vllm = rank_on(Engine::Vllm, &profile);
    vllm.submit(2, &tokens(10_000, 20_000), 1).unwrap();
    let step = vllm.schedule();
    vllm.complete(&step, 0.1);
    assert_eq!(vllm.stats().running, 1);
    assert_eq!(vllm.stats().waiting_uncached_tokens, 0);
}

#[test]
fn a_request_in_the_same_step_hits_blocks_another_is_computing() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    let prompt = tokens(0, 1024);
    rank.submit(1, &prompt, 1).unwrap();
    rank.submit(2, &prompt, 1).unwrap();
    let step = rank.schedule();
    assert_eq!(step.admitted, vec![(1, 0), (2, 1008)]);
    assert_eq!(step.work.tokens, 1024 + 16);
}

#[test]
fn events_name_the_blocks_a_step_computes_and_the_ones_eviction_drops() {
    let profile = h100();
    let mut rank = rank_with(Engine::Vllm, &profile, |p| {
        p.kv_blocks = nz(8);
    });
    rank.record_events(true);
    let first = tokens(0, 64);
    rank.submit(1, &first, 1).unwrap();
    let step = rank.schedule();
    let events = rank.take_events();
    let hashes: Vec<u64> = block_hashes(&first, nz(16)).collect();
    assert_eq!(
        events,
        vec![CacheEvent::Stored {
            hashes: hashes.clone(),
            parent: None,
            tokens: first.clone(),
        }]
    );
    rank.complete(&step, 0.01);
    // A second prompt of 6 blocks needs two of the first's: the two least recently released (its
    // tail) are evicted.
    rank.submit(2, &tokens(1000, 96), 1).unwrap();
    let step = rank.schedule();
    let events = rank.take_events();
    assert_eq!(
        events.first(),
        Some(&CacheEvent::Removed {
            hashes: vec![hashes[3], hashes[2]]
        })
    );
    assert!(matches!(events.get(1), Some(CacheEvent::Stored { hashes, .. }) if hashes.len() == 6));
    rank.complete(&step, 0.01);
    assert!(rank.reset_prefix_cache());
    assert_eq!(rank.take_events(), vec![CacheEvent::AllCleared]);
}

#[test]
fn a_request_that_could_never_fit_is_refused_and_a_full_queue_too() {
    let profile = h100();
    let mut rank = rank_with(Engine::Vllm, &profile, |p| {
        p.kv_blocks = nz(10);
        p.max_queue = Some(1);
    });
    assert!(matches!(
        rank.submit(1, &tokens(0, 160), 1),
        Err(Refusal::TooLong { .. })
    ));
    rank.submit(2, &tokens(0, 16), 1).unwrap();
    assert_eq!(
        rank.submit(3, &tokens(0, 16), 1),
        Err(Refusal::QueueFull { limit: 1 })
    );
    assert_eq!(rank.counters.rejected, 2);
}

#[test]
fn an_abort_frees_the_request_wherever_it_is() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    rank.submit(1, &tokens(0, 20_000), 10).unwrap();
    rank.submit(2, &tokens(50_000, 100), 10).unwrap();
    let step = rank.schedule();
    rank.complete(&step, 0.1);
    assert!(rank.abort(1), "mid-prefill");
    assert!(rank.abort(2));
    assert!(!rank.abort(2));
    check(&rank);
    assert_eq!(rank.pool.pinned(), 0);
    assert_eq!(rank.counters.aborted, 2);
}

#[test]
fn the_prediction_follows_the_work_ahead_and_the_cache() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    let prompt = tokens(0, 8192);
    // An idle rank: a lone prompt's TTFT, as the model would run it.
    close(
        "idle",
        rank.predict_ttft(&prompt, &[], &profile),
        lone_ttft(&profile, 8192),
        0.01,
    );
    drive(&mut rank, &profile, vec![at(0.0, 1, prompt.clone(), 1)]);
    // Cached: one block's work.
    close(
        "cached",
        rank.predict_ttft(&prompt, &[], &profile),
        7.3e-3,
        0.15,
    );
    // Behind 16 waiting 8k misses: about their TTFTs plus its own.
    for i in 0..16 {
        rank.submit(100 + i, &tokens(1_000_000 + i as u32 * 10_000, 8192), 1)
            .unwrap();
    }
    let behind = rank.predict_ttft(&tokens(3_000_000, 8192), &[], &profile);
    close("behind 16 misses", behind, 17.0 * 0.211, 0.15);
    // Prompts sent and not yet arrived count ahead too, and one that shares this prompt's prefix
    // leaves only the rest to compute: an 8k miss sent before it, then this one with its 8k head.
    let idle = rank_on(Engine::Vllm, &profile);
    let sent = tokens(4_000_000, 8192);
    let extended: Vec<u32> = sent
        .iter()
        .copied()
        .chain(tokens(5_000_000, 1024))
        .collect();
    let alone = idle.predict_ttft(&extended, &[], &profile);
    let after = idle.predict_ttft(&extended, &[&sent], &profile);
    close(
        "after an in-flight 8k miss it extends",
        after,
        0.211 + 0.035,
        0.25,
    );
    assert!(after < alone + 0.1, "{after} against {alone}");
}

#[test]
fn a_block_is_cached_only_once_its_chunk_fills_it() {
    let profile = h100();
    let mut rank = rank_with(Engine::Vllm, &profile, |p| {
        p.batch_tokens = nz(24);
    });
    rank.record_events(true);
    let prompt = tokens(0, 48);
    rank.submit(1, &prompt, 4).unwrap();
    // 24 tokens: the first block full, the second half done and not cached.
    let step = rank.schedule();
    rank.complete(&step, 0.01);
    assert_eq!(
        rank.seqs[&1].hold,
        Hold {
            blocks: 2,
            cached: 1
        }
    );
    let stored: usize = rank
        .take_events()
        .iter()
        .map(|event| match event {
            CacheEvent::Stored { hashes, .. } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored, 1);
    // Cut short by its client: another request with the same prompt finds the one full block.
    assert!(rank.abort(1));
    check(&rank);
    assert_eq!(rank.cached_tokens(&prompt), 16);
    // Run to the end, the first request's blocks fill as its chunks do.
    rank.submit(2, &prompt, 4).unwrap();
    let step = rank.schedule();
    assert_eq!(step.admitted, vec![(2, 16)]);
    rank.complete(&step, 0.01);
    assert_eq!(
        rank.seqs[&2].hold,
        Hold {
            blocks: 3,
            cached: 2
        }
    );
    drive(&mut rank, &profile, Vec::new());
    // A 48-token prompt's hit stops one block short of its end (its last token is computed).
    assert_eq!(rank.cached_tokens(&prompt), 32);
}

#[test]
fn an_abort_counts_the_tokens_produced_once() {
    let profile = h100();
    let mut rank = rank_on(Engine::Vllm, &profile);
    rank.submit(1, &tokens(0, 100), 50).unwrap();
    for _ in 0..5 {
        let step = rank.schedule();
        rank.complete(&step, 0.01);
    }
    assert_eq!(rank.counters.generation_tokens, 5);
    assert!(rank.abort(1));
    assert_eq!(rank.counters.generation_tokens, 5);
}

#[test]
fn sglang_retracts_to_the_back_of_the_queue_and_resets_its_ratio_when_idle() {
    let profile = h100();
    let mut rank = rank_with(Engine::Sglang, &profile, |p| {
        p.kv_blocks = nz(64);
    });
    for id in 0..4 {
        rank.submit(id, &tokens(id as u32 * 1000, 16), 400).unwrap();
    }
    let mut retracted = None;
    let mut lowest = SGLANG_INIT_NEW_TOKEN_RATIO;
    for _ in 0..2000 {
        let before = rank.counters.preemptions;
        let step = rank.schedule();
        lowest = lowest.min(rank.sglang.new_token_ratio);
        if rank.counters.preemptions > before && retracted.is_none() {
            let back = *rank.waiting.back().unwrap();
            assert!(
                rank.seqs[&back].generated > 0,
                "the retracted one is last in line"
            );
            retracted = Some(back);
        }
        if step.is_empty() {
            break;
        }
        rank.complete(&step, 0.01);
    }
    assert!(retracted.is_some());
    assert_eq!(rank.counters.finished_length, 4);
    // Its estimate decayed while it decoded, and is back where it starts once the rank is idle.
    assert!(lowest < SGLANG_INIT_NEW_TOKEN_RATIO, "{lowest}");
    assert_eq!(rank.sglang.new_token_ratio, SGLANG_INIT_NEW_TOKEN_RATIO);
}

#[test]
fn sglang_refuses_what_its_reservation_could_never_admit() {
    let profile = h100();
    let mut rank = rank_with(Engine::Sglang, &profile, |p| {
        p.kv_blocks = nz(10);
    });
    // 160 tokens of KV: 96 prompt + 64 output would fill it exactly, which the reservation refuses.
    assert!(matches!(
        rank.submit(1, &tokens(0, 96), 64),
        Err(Refusal::TooLong { .. })
    ));
    rank.submit(2, &tokens(0, 96), 63).unwrap();
    drive(&mut rank, &profile, Vec::new());
    assert_eq!(rank.counters.finished_length, 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random prompts sharing prefixes, random outputs, a small pool: every request finishes, and
    /// every step keeps the budget and the block accounting (checked by `drive`).
    #[test]
    fn any_workload_keeps_the_invariants_and_finishes(
        sglang in any::<bool>(),
        kv_blocks in 24u32..200,
        budget in 16u32..600,
        requests in proptest::collection::vec((0u32..4, 1u32..300, 0u32..40, 0u32..200), 1..40),
    ) {
        let engine = if sglang { Engine::Sglang } else { Engine::Vllm };
        let profile = h100();
        let mut rank = rank_with(engine, &profile, |p| {
            p.kv_blocks = nz(kv_blocks);
            p.batch_tokens = nz(budget);
            p.max_prefill_tokens = nz(budget);
        });
        let arrivals: Vec<Arrival> = requests
            .iter()
            .enumerate()
            .filter(|(_, (_, len, output, _))| {
                (len + output).div_ceil(16) <= kv_blocks
            })
            .map(|(id, (prefix, len, output, arrive))| {
                let prompt: Vec<u32> = (0..*len).map(|t| prefix * 100_000 + t).collect();
                at(f64::from(*arrive) * 0.01, id as u64, prompt, *output)
            })
            .collect();
        let count = arrivals.len() as u64;
        drive(&mut rank, &profile, arrivals);
        prop_assert_eq!(rank.counters.finished_length, count);
        prop_assert_eq!(rank.pool.pinned(), 0);
    }
}

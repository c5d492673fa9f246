use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::cache::{FNV_OFFSET, Hold, Holder, ROOT_PARENT, fnv1a};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A rank with block size 4.
fn rank(kv_blocks: u32, max_running: u32, max_queue: Option<u32>) -> RankModel {
    RankModel::new(0, nz(4), nz(kv_blocks), nz(max_running), max_queue)
}

/// `len` tokens starting at `start`, distinct from other ranges.
fn tokens(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

fn admitted(result: Result<Submit, Refusal>) -> Admission {
    match result {
        Ok(Submit::Admitted(admission)) => admission,
        other => panic!("expected an admission, got {other:?}"),
    }
}

/// Asserts that a submission waits, at `position` in the queue.
fn queued(result: Result<Submit, Refusal>, position: usize) {
    assert_eq!(result, Ok(Submit::Queued { position }));
}

/// Runs request `id` with no output from admission to completion: its prompt's full blocks end up
/// cached and unpinned.
fn serve(model: &mut RankModel, id: RequestId, prompt: &[u32]) {
    admitted(model.submit(id, prompt, 0));
    model.finish(id, true, 0);
}

fn hashes(prompt: &[u32]) -> Vec<u64> {
    block_hashes(prompt, nz(4)).collect()
}

/// Checks the state invariants that hold after every operation.
fn check_invariants(model: &RankModel) {
    // The LRU holds exactly the unreferenced cached blocks.
    model.pool.check();
    // Reference counts are the running requests' pins; anonymous blocks are theirs too.
    let pins: u64 = model.running.values().map(|a| a.hold.cached).sum();
    assert_eq!(pins, model.pool.pins());
    let anonymous: u64 = model
        .running
        .values()
        .map(|a| a.hold.blocks - a.hold.cached)
        .sum();
    assert_eq!(anonymous, model.pool.anonymous());
    for active in model.running.values() {
        // Every full prompt block is cached while the request runs.
        assert_eq!(active.hold.cached, active.hashes.len() as u64);
        for hash in &active.hashes {
            assert!(model.pool.refcount(*hash).is_some_and(|c| c > 0));
        }
    }
    for (id, pending) in model.queue.iter() {
        assert!(!model.running.contains_key(id));
        assert_eq!(
            pending.hold,
            Hold::default(),
            "a waiting request holds nothing"
        );
    }
    // Over capacity only while everything cached is pinned (after a shrink).
    let stats = model.stats();
    assert!(
        stats.kv_used_blocks <= stats.kv_total_blocks
            || stats.kv_used_blocks == stats.kv_pinned_blocks
    );
    assert!(stats.kv_pinned_blocks <= stats.kv_used_blocks);
    assert_eq!(stats.running, model.running.len() as u64);
    assert_eq!(stats.waiting, model.queue.len() as u64);
    // Work conserving: a head that could start would have started (its blocks exceed the room).
    if let Some((_, head)) = model.queue.front()
        && model.running() < model.running_limit()
    {
        let holder = Holder {
            hashes: &head.hashes,
            tokens: &head.tokens,
            hold: Hold::default(),
        };
        let mut probe = model.pool.clone();
        assert!(probe.grow(&holder, head.prompt_len + head.output).is_none());
    }
}

#[test]
fn block_hashes_are_chained_and_cover_full_blocks_only() {
    let a = hashes(&tokens(0, 11));
    assert_eq!(a.len(), 2);
    let b = hashes(&tokens(0, 8));
    assert_eq!(a, b);
    // Same second block after a different first block: a different hash.
    let mut c = tokens(0, 8);
    c[0] = 99;
    let c = hashes(&c);
    assert_ne!(a[0], c[0]);
    assert_ne!(a[1], c[1]);
    assert!(hashes(&[]).is_empty());
    assert!(hashes(&[1, 2, 3]).is_empty());
}

#[test]
fn repeated_prompt_hits_all_but_the_last_token() {
    let mut model = rank(64, 4, None);
    let prompt = tokens(0, 10);
    let first = admitted(model.submit(1, &prompt, 5));
    assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 10));
    model.finish(1, true, 5);
    assert_eq!(model.cached_tokens(&prompt), 8);
    let second = admitted(model.submit(2, &prompt, 5));
    assert_eq!((second.cached_tokens, second.uncached_tokens), (8, 2));

    // Exactly three full blocks: the last one is always computed.
    let exact = tokens(100, 12);
    serve(&mut model, 3, &exact);
    assert_eq!(model.cached_tokens(&exact), 8);
    let again = admitted(model.submit(4, &exact, 0));
    assert_eq!((again.cached_tokens, again.uncached_tokens), (8, 4));

    let counters = model.stats().counters;
    assert_eq!(counters.prompt_tokens, 44);
    assert_eq!(counters.prefix_queried_tokens, 44);
    assert_eq!(counters.prefix_hit_tokens, 16);
    assert_eq!(counters.generation_tokens, 5);
    assert_eq!(counters.finished_length, 2);
}

#[test]
fn shared_prefix_hits_exactly_the_shared_full_blocks() {
    let mut model = rank(64, 4, None);
    admitted(model.submit(1, &tokens(0, 16), 0));
    // Shares 6 tokens: one full block.
    let mut other = tokens(0, 6);
    other.extend(tokens(500, 10));
    assert_eq!(admitted(model.submit(2, &other, 0)).cached_tokens, 4);
    // Shares 12 tokens: three full blocks, hit while the first request still runs (shared).
    let mut other = tokens(0, 12);
    other.extend(tokens(700, 3));
    assert_eq!(admitted(model.submit(3, &other, 0)).cached_tokens, 12);
    assert_eq!(model.cached_tokens(&[]), 0);
    assert_eq!(admitted(model.submit(4, &[], 0)).cached_tokens, 0);
    check_invariants(&model);
}

#[test]
fn queue_forms_beyond_max_running_and_drains_in_fifo_order() {
    let mut model = rank(64, 2, None);
    admitted(model.submit(1, &tokens(0, 4), 1));
    admitted(model.submit(2, &tokens(10, 4), 1));
    queued(model.submit(3, &tokens(20, 4), 1), 0);
    queued(model.submit(4, &tokens(30, 4), 1), 1);
    assert_eq!((model.running(), model.waiting()), (2, 2));
    let next = model.finish(2, true, 1);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
    let next = model.finish(1, true, 1);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [4]);
    assert_eq!((model.running(), model.waiting()), (2, 0));
    assert!(model.finish(77, true, 1).is_empty());
    check_invariants(&model);
}

#[test]
fn full_queue_refuses() {
    let mut model = rank(64, 1, Some(1));
    admitted(model.submit(1, &tokens(0, 4), 1));
    queued(model.submit(2, &tokens(10, 4), 1), 0);
    assert_eq!(
        model.submit(3, &tokens(20, 4), 1),
        Err(Refusal::QueueFull { limit: 1 })
    );
    assert_eq!(model.stats().counters.rejected, 1);
    model.count_rejected();
    assert_eq!(model.stats().counters.rejected, 2);

    // A request that can start is never refused for a full (zero-length) queue.
    let mut model = rank(64, 1, Some(0));
    admitted(model.submit(1, &tokens(0, 4), 1));
    assert_eq!(
        model.submit(2, &tokens(10, 4), 1),
        Err(Refusal::QueueFull { limit: 0 })
    );
}

#[test]
fn request_longer_than_the_cache_is_refused() {
    let mut model = rank(4, 1, None);
    assert_eq!(
        model.submit(1, &tokens(0, 16), 1),
        Err(Refusal::TooLong {
            needed_blocks: 5,
            capacity: 4
        })
    );
    assert_eq!(model.stats().counters.rejected, 1);
    admitted(model.submit(2, &tokens(0, 16), 0));
    assert_eq!(
        model.submit(2, &tokens(0, 1), 0),
        Err(Refusal::DuplicateId { id: 2 })
    );
    assert_eq!(model.stats().counters.rejected, 2);
    let message = Refusal::TooLong {
        needed_blocks: 5,
        capacity: 4,
    }
    .to_string();
    assert!(message.contains("5 KV blocks") && message.contains("only 4"));
}

#[test]
fn eviction_is_lru_and_tail_first() {
    let mut model = rank(6, 4, None);
    let a = tokens(0, 12);
    let b = tokens(100, 12);
    serve(&mut model, 1, &a);
    serve(&mut model, 2, &b);
    assert_eq!(model.stats().kv_used_blocks, 6);
    // A probe one token longer may hit all three blocks of a prompt.
    let probe = |p: &[u32]| {
        let mut p = p.to_vec();
        p.push(9999);
        p
    };
    assert_eq!(model.cached_tokens(&probe(&a)), 12);
    assert_eq!(model.cached_tokens(&probe(&b)), 12);

    let ha = hashes(&a);
    admitted(model.submit(3, &tokens(200, 4), 0));
    assert!(model.pool.refcount(ha[2]).is_none());
    assert_eq!(model.cached_tokens(&probe(&a)), 8);
    admitted(model.submit(4, &tokens(300, 4), 0));
    assert_eq!(model.cached_tokens(&probe(&a)), 4);
    assert_eq!(model.cached_tokens(&probe(&b)), 12);
    admitted(model.submit(5, &tokens(400, 4), 0));
    assert_eq!(model.cached_tokens(&probe(&a)), 0);
    assert_eq!(model.cached_tokens(&probe(&b)), 12);
    admitted(model.submit(6, &tokens(500, 4), 0));
    assert_eq!(model.cached_tokens(&probe(&b)), 8);
    assert_eq!(model.stats().counters.evicted_blocks, 4);
    check_invariants(&model);
}

#[test]
fn hit_refreshes_recency() {
    let mut model = rank(6, 4, None);
    let a = tokens(0, 12);
    let b = tokens(100, 12);
    serve(&mut model, 1, &a);
    serve(&mut model, 2, &b);
    // Reusing A makes B the least recently used.
    serve(&mut model, 3, &a);
    admitted(model.submit(4, &tokens(200, 4), 0));
    let hb = hashes(&b);
    assert!(model.pool.refcount(hb[2]).is_none());
    assert_eq!(model.cached_tokens(&[a.clone(), vec![1]].concat()), 12);
}

#[test]
fn pinned_blocks_survive_pressure_and_the_head_blocks_the_queue() {
    let mut model = rank(6, 4, None);
    let r = tokens(0, 12);
    // Three cached blocks and one anonymous output block.
    admitted(model.submit(1, &r, 4));
    let stats = model.stats();
    assert_eq!((stats.kv_used_blocks, stats.kv_pinned_blocks), (4, 4));
    // Needs three blocks; two are free and nothing is evictable: waits at the head.
    queued(model.submit(2, &tokens(100, 8), 4), 0);
    // Fits in one block but waits behind the head.
    queued(model.submit(3, &tokens(200, 1), 0), 1);
    for hash in hashes(&r) {
        assert_eq!(model.pool.refcount(hash), Some(1));
    }
    assert_eq!(model.stats().counters.evicted_blocks, 0);
    // A request sharing the pinned prefix would hit it (but it waits: the queue is not empty).
    assert_eq!(model.cached_tokens(&tokens(0, 13)), 12);
    check_invariants(&model);

    let next = model.finish(1, true, 4);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [2, 3]);
    // Request 3 took the one block it needed from R's tail.
    assert_eq!(model.stats().counters.evicted_blocks, 1);
    assert_eq!(model.cached_tokens(&tokens(0, 13)), 8);
    check_invariants(&model);
}

#[test]
fn aborting_a_waiting_request_lets_the_next_one_in() {
    let mut model = rank(6, 4, None);
    admitted(model.submit(1, &tokens(0, 12), 4));
    queued(model.submit(2, &tokens(100, 8), 4), 0);
    queued(model.submit(3, &tokens(200, 1), 0), 1);
    let next = model.finish(2, false, 0);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
    let stats = model.stats();
    assert_eq!((stats.running, stats.waiting), (2, 0));
    assert_eq!(stats.counters.aborted, 1);
    model.finish(1, false, 2);
    let counters = model.stats().counters;
    assert_eq!((counters.aborted, counters.generation_tokens), (2, 2));
    check_invariants(&model);
}

#[test]
fn stats_report_the_state() {
    let mut model = RankModel::new(3, nz(4), nz(10), nz(1), Some(5));
    admitted(model.submit(1, &tokens(0, 10), 3));
    model.finish(1, true, 3);
    // Running: 8 cached tokens hit, blocks [c0 c1] pinned, [partial+output] anonymous = 4-2.
    admitted(model.submit(2, &tokens(0, 10), 3));
    // Waiting: shares 8 tokens with the cache, 14 long.
    let mut waiting = tokens(0, 8);
    waiting.extend(tokens(900, 6));
    queued(model.submit(3, &waiting, 0), 0);
    let stats = model.stats();
    assert_eq!(stats.rank, 3);
    assert_eq!((stats.running, stats.waiting), (1, 1));
    assert_eq!(stats.waiting_uncached_tokens, 6);
    assert_eq!(stats.kv_used_blocks, 4);
    assert_eq!(stats.kv_pinned_blocks, 4);
    assert_eq!(stats.kv_total_blocks, 10);
    assert_eq!(stats.block_size, 4);
    assert_eq!(stats.max_running, 1);
    assert_eq!(stats.ttft, Default::default());
    assert_eq!(stats.counters.prompt_tokens, 20);
    assert_eq!(stats.counters.prefix_hit_tokens, 8);
    assert!((stats.kv_usage() - 0.4).abs() < 1e-9);
    check_invariants(&model);
}

#[test]
fn set_limits_shrinks_and_grows() {
    let mut model = rank(8, 1, None);
    serve(&mut model, 1, &tokens(0, 8));
    admitted(model.submit(2, &tokens(100, 12), 4));
    assert_eq!(model.stats().kv_used_blocks, 6);
    queued(model.submit(3, &tokens(200, 1), 0), 0);
    // Growing max_running admits the head.
    let next = model.set_limits(nz(8), nz(2), None);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
    assert_eq!(model.stats().kv_used_blocks, 7);

    // Shrinking below the pinned blocks evicts everything unpinned and admits nothing.
    assert!(model.set_limits(nz(3), nz(4), None).is_empty());
    let stats = model.stats();
    assert_eq!((stats.kv_used_blocks, stats.kv_pinned_blocks), (5, 5));
    assert_eq!(stats.counters.evicted_blocks, 2);
    queued(model.submit(4, &tokens(300, 1), 0), 0);
    check_invariants(&model);
    // Still over capacity after request 3 leaves: nothing is admitted.
    assert!(model.finish(3, true, 0).is_empty());
    assert_eq!(model.stats().kv_used_blocks, 4);
    // Request 2 leaves: its blocks are trimmed to the capacity and request 4 runs.
    let next = model.finish(2, true, 4);
    assert_eq!(next.iter().map(|a| a.id).collect::<Vec<_>>(), [4]);
    assert!(model.stats().kv_used_blocks <= 3);
    check_invariants(&model);

    // Growing the cache again lets a longer request run.
    assert!(model.submit(5, &tokens(0, 20), 0).is_err());
    model.set_limits(nz(8), nz(4), None);
    admitted(model.submit(5, &tokens(0, 20), 0));
    check_invariants(&model);
}

#[test]
fn huge_prompt_is_cheap_enough() {
    let mut model = RankModel::new(0, nz(16), nz(8192), nz(64), None);
    let prompt = tokens(0, 100_000);
    admitted(model.submit(1, &prompt, 64));
    model.finish(1, true, 64);
    let again = admitted(model.submit(2, &prompt, 64));
    assert_eq!(again.cached_tokens, 99_984);
    assert_eq!(again.uncached_tokens, 16);
}

/// A recording rank with block size 4.
fn recording(kv_blocks: u32) -> RankModel {
    let mut model = rank(kv_blocks, 4, None);
    model.record_events(true);
    model
}

#[test]
fn admission_stores_the_new_full_blocks_with_their_tokens() {
    let mut model = recording(16);
    let prompt = tokens(0, 10);
    admitted(model.submit(1, &prompt, 0));
    let blocks = hashes(&prompt);
    assert_eq!(
        model.take_events(),
        [CacheEvent::Stored {
            hashes: blocks.clone(),
            parent: None,
            tokens: tokens(0, 8),
        }]
    );
    assert!(model.take_events().is_empty(), "taken once");
    model.finish(1, true, 0);
    assert!(
        model.take_events().is_empty(),
        "finishing caches nothing new"
    );

    // An extension stores only its new blocks, chained to the last cached one.
    let longer = tokens(0, 17);
    admitted(model.submit(2, &longer, 0));
    let all = hashes(&longer);
    assert_eq!(
        model.take_events(),
        [CacheEvent::Stored {
            hashes: all[2..].to_vec(),
            parent: Some(blocks[1]),
            tokens: tokens(8, 8),
        }]
    );
}

#[test]
fn a_pure_hit_publishes_nothing() {
    let mut model = recording(16);
    let prompt = tokens(0, 12);
    serve(&mut model, 1, &prompt);
    assert_eq!(model.take_events().len(), 1);
    serve(&mut model, 2, &prompt);
    serve(&mut model, 3, &tokens(0, 9));
    assert!(model.take_events().is_empty());
}

#[test]
fn eviction_publishes_the_removed_blocks_before_the_new_ones() {
    let mut model = recording(4);
    let first = tokens(0, 12);
    serve(&mut model, 1, &first);
    model.take_events();
    // Three new blocks need room: the LRU gives up the first prompt's tail first.
    let second = tokens(100, 12);
    admitted(model.submit(2, &second, 0));
    let old = hashes(&first);
    assert_eq!(
        model.take_events(),
        [
            CacheEvent::Removed {
                hashes: vec![old[2], old[1]],
            },
            CacheEvent::Stored {
                hashes: hashes(&second),
                parent: None,
                tokens: second.clone(),
            },
        ]
    );
    // Shrinking evicts too, once the request is done.
    model.finish(2, true, 0);
    model.set_limits(nz(1), nz(4), None);
    match model.take_events().as_slice() {
        [CacheEvent::Removed { hashes }] => assert_eq!(hashes.len(), 3),
        other => panic!("expected one Removed, got {other:?}"),
    }
}

#[test]
fn resetting_the_prefix_cache_clears_everything_unless_requests_run() {
    let mut model = recording(16);
    admitted(model.submit(1, &tokens(0, 8), 4));
    model.take_events();
    assert!(!model.reset_prefix_cache());
    assert!(model.take_events().is_empty());
    model.finish(1, true, 4);
    assert!(model.reset_prefix_cache());
    assert_eq!(model.take_events(), [CacheEvent::AllCleared]);
    assert_eq!(model.cached_tokens(&tokens(0, 8)), 0);
}

#[test]
fn a_rank_that_does_not_record_keeps_no_events() {
    let mut model = rank(4, 4, None);
    serve(&mut model, 1, &tokens(0, 12));
    serve(&mut model, 2, &tokens(100, 12));
    assert!(model.take_events().is_empty());
    assert!(!model.pool.recording());
}

/// The hash of the block `tokens` whose parent is `parent`, as `block_hashes` chains it.
fn chained(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut hash = fnv1a(FNV_OFFSET, &parent.unwrap_or(ROOT_PARENT).to_le_bytes());
    for token in tokens {
        hash = fnv1a(hash, &token.to_le_bytes());
    }
    hash
}

/// Applies `events` to a subscriber's view of the cache, checking each against it: a stored run's
/// parent is cached (prefix-closed), its hashes are its tokens' chained hashes and new; a removed
/// block was cached.
fn follow(view: &mut BTreeSet<u64>, events: Vec<CacheEvent>, block_size: u32) {
    for event in events {
        match event {
            CacheEvent::Stored {
                hashes,
                parent,
                tokens,
            } => {
                assert_eq!(tokens.len(), hashes.len() * block_size as usize);
                if let Some(parent) = parent {
                    assert!(view.contains(&parent), "parent {parent:x} not cached");
                }
                let mut previous = parent;
                for (hash, block) in hashes.iter().zip(tokens.chunks(block_size as usize)) {
                    assert_eq!(*hash, chained(previous, block));
                    assert!(view.insert(*hash), "{hash:x} stored twice");
                    previous = Some(*hash);
                }
            }
            CacheEvent::Removed { hashes } => {
                for hash in hashes {
                    assert!(view.remove(&hash), "{hash:x} removed but not cached");
                }
            }
            CacheEvent::AllCleared => view.clear(),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Submit {
        family: u32,
        shared: u32,
        variant: u32,
        suffix: u32,
        output: u32,
    },
    Finish {
        pick: usize,
        completed: bool,
        generated: u32,
    },
    FinishUnknown,
    SetLimits {
        kv_blocks: u32,
        max_running: u32,
        max_queue: Option<u32>,
    },
    CountRejected,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u32..3, 0u32..40, 0u32..3, 0u32..12, 0u32..12).prop_map(
            |(family, shared, variant, suffix, output)| Op::Submit {
                family,
                shared,
                variant,
                suffix,
                output
            }
        ),
        4 => (any::<usize>(), any::<bool>(), 0u32..20).prop_map(|(pick, completed, generated)| {
            Op::Finish {
                pick,
                completed,
                generated,
            }
        }),
        1 => Just(Op::FinishUnknown),
        1 => (1u32..40, 1u32..6, proptest::option::of(0u32..5)).prop_map(
            |(kv_blocks, max_running, max_queue)| Op::SetLimits {
                kv_blocks,
                max_running,
                max_queue
            }
        ),
        1 => Just(Op::CountRejected),
    ]
}

/// A prompt from a family's shared stem followed by a variant's suffix, so prompts share
/// prefixes of many lengths.
fn prompt(family: u32, shared: u32, variant: u32, suffix: u32) -> Vec<u32> {
    let mut prompt: Vec<u32> = (0..shared).map(|i| family * 1000 + i).collect();
    prompt.extend((0..suffix).map(|i| 100_000 + family * 10_000 + variant * 1000 + i));
    prompt
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_event_sequences_keep_the_invariants(
        block_size in 1u32..6,
        kv_blocks in 1u32..40,
        max_running in 1u32..6,
        max_queue in proptest::option::of(0u32..5),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut model = RankModel::new(0, nz(block_size), nz(kv_blocks), nz(max_running), max_queue);
        model.record_events(true);
        let mut view = BTreeSet::new();
        let mut next_id: RequestId = 0;
        let mut live: BTreeSet<RequestId> = BTreeSet::new();
        let mut prompt_lens = std::collections::HashMap::new();
        let mut last_admitted: Option<RequestId> = None;
        let (mut submitted, mut refused, mut ended, mut injected) = (0u64, 0u64, 0u64, 0u64);

        for op in ops {
            let used_before = model.stats().kv_used_blocks;
            let running_before = model.running();
            let mut admissions = Vec::new();
            let mut limits_changed = false;
            match op {
                Op::Submit { family, shared, variant, suffix, output } => {
                    let tokens = prompt(family, shared, variant, suffix);
                    let id = next_id;
                    next_id += 1;
                    submitted += 1;
                    prompt_lens.insert(id, tokens.len() as u32);
                    let expected_cached = model.cached_tokens(&tokens);
                    match model.submit(id, &tokens, output) {
                        Ok(Submit::Admitted(admission)) => {
                            prop_assert_eq!(admission.cached_tokens, expected_cached);
                            live.insert(id);
                            admissions.push(admission);
                        }
                        Ok(Submit::Queued { position }) => {
                            prop_assert_eq!(position as u64 + 1, model.waiting());
                            live.insert(id);
                        }
                        Err(Refusal::TooLong { needed_blocks, capacity }) => {
                            prop_assert!(needed_blocks > capacity);
                            refused += 1;
                        }
                        Err(Refusal::QueueFull { limit }) => {
                            prop_assert_eq!(Some(limit), model.max_queue);
                            prop_assert!(model.waiting() >= u64::from(limit));
                            refused += 1;
                        }
                        Err(Refusal::DuplicateId { .. }) => prop_assert!(false, "fresh id refused"),
                    }
                }
                Op::Finish { pick, completed, generated } => {
                    if !live.is_empty() {
                        let id = *live.iter().nth(pick % live.len()).unwrap();
                        live.remove(&id);
                        ended += 1;
                        admissions = model.finish(id, completed, generated);
                    }
                }
                Op::FinishUnknown => {
                    prop_assert!(model.finish(next_id + 1000, true, 5).is_empty());
                }
                Op::SetLimits { kv_blocks, max_running, max_queue } => {
                    limits_changed = true;
                    admissions = model.set_limits(nz(kv_blocks), nz(max_running), max_queue);
                }
                Op::CountRejected => {
                    injected += 1;
                    model.count_rejected();
                }
            }

            check_invariants(&model);
            // A subscriber that applies every event sees exactly the cached blocks.
            follow(&mut view, model.take_events(), block_size);
            prop_assert_eq!(&view, &model.pool.cached().collect::<BTreeSet<u64>>());
            let stats = model.stats();
            for admission in &admissions {
                // FIFO: ids are submitted in increasing order, so admissions are too.
                prop_assert!(last_admitted.is_none_or(|last| admission.id > last));
                last_admitted = Some(admission.id);
                prop_assert!(model.running.contains_key(&admission.id));
                prop_assert_eq!(
                    admission.cached_tokens + admission.uncached_tokens,
                    prompt_lens[&admission.id]
                );
                prop_assert_eq!(admission.cached_tokens % block_size, 0);
            }
            if !admissions.is_empty() {
                prop_assert!(stats.kv_used_blocks <= stats.kv_total_blocks);
                prop_assert!(stats.running <= stats.max_running);
            }
            if !limits_changed {
                // Only a shrink can put the rank over its limits, and it does not grow over them.
                if stats.kv_used_blocks > stats.kv_total_blocks {
                    prop_assert!(used_before > stats.kv_total_blocks);
                }
                if stats.running > stats.max_running {
                    prop_assert!(stats.running <= running_before);
                }
            }
            prop_assert_eq!(stats.running + stats.waiting, live.len() as u64);
            let c = stats.counters;
            prop_assert_eq!(c.rejected, refused + injected);
            prop_assert_eq!(c.finished_length + c.aborted, ended);
            prop_assert_eq!(submitted, refused + ended + live.len() as u64);
        }
    }
}

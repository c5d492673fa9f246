use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use super::*;
use crate::prefix::{block_hashes, prefix_seed};

const TTL: Duration = Duration::from_secs(2);

fn size(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A pool of `workers` one-rank workers with blocks of `block`.
fn index(workers: usize, block: u32) -> EventIndex {
    EventIndex::new(&vec![1; workers], &vec![1000; workers], size(block), TTL)
}

fn seed() -> u64 {
    prefix_seed("m", None)
}

/// Tokens `0..n`.
fn prompt(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// The depth each worker matches for a request whose prompt is `tokens`.
fn depths(index: &EventIndex, tokens: &[u32], block: u32, now: Instant) -> Vec<(u32, u64)> {
    index
        .matches(&block_hashes(seed(), tokens, size(block)), now)
        .into_iter()
        .map(|found| (found.worker.0, found.matched_tokens))
        .collect()
}

/// Engine blocks of `engine` tokens over `tokens`, hashed by the engine as 1000 + their position.
fn engine_blocks(tokens: &[u32], engine: usize) -> Vec<(u64, &[u32])> {
    tokens
        .chunks(engine)
        .enumerate()
        .map(|(at, chunk)| (1000 + at as u64, chunk))
        .collect()
}

fn slot(index: &EventIndex, worker: u32) -> Slot {
    index.slot(WorkerId(worker), 0).unwrap()
}

#[test]
fn equal_engine_and_index_blocks_match_a_request_exactly_as_deep_as_stored() {
    let now = start();
    let index = index(2, 16);
    let tokens = prompt(64);
    // vLLM: one event carries several blocks.
    let stored = index.store(
        slot(&index, 1),
        seed(),
        None,
        engine_blocks(&tokens[..48], 16),
    );
    assert_eq!(stored.blocks, 3);
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 48)]);
    // The fourth block, stored later under its parent.
    index.store(slot(&index, 1), seed(), Some(1002), [(2000, &tokens[48..])]);
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 64)]);
    // The engine evicts the tail first.
    assert_eq!(index.remove(slot(&index, 1), &[2000, 1002]), 2);
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 32)]);
    assert_eq!(index.stats().engine_keys, [0, 2]);
}

#[test]
fn an_engine_block_of_several_index_blocks_is_stored_and_removed_whole() {
    let now = start();
    // SGLang with page size 64 in front of a pool hashing blocks of 16.
    let index = index(1, 16);
    let tokens = prompt(128);
    index.store(slot(&index, 0), seed(), None, engine_blocks(&tokens, 64));
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 128)]);
    assert_eq!(index.stats().index.entries, 8);
    index.remove(slot(&index, 0), &[1001]);
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 64)]);
    assert_eq!(index.stats().index.entries, 4);
}

#[test]
fn single_token_pages_complete_an_index_block_every_block_size_pages() {
    let now = start();
    // SGLang's default page size 1: one event per token, each under the previous.
    let index = index(1, 4);
    let tokens = prompt(10);
    let mut parent = None;
    for (at, token) in tokens.chunks(1).enumerate() {
        let engine = 500 + at as u64;
        index.store(slot(&index, 0), seed(), parent, [(engine, token)]);
        parent = Some(engine);
    }
    // Two full blocks of 4; the last two tokens are a tail.
    assert_eq!(depths(&index, &tokens, 4, now), [(0, 8)]);
    assert_eq!(index.stats().index.entries, 2);
    // Evicting the page that completed the second block drops it.
    index.remove(slot(&index, 0), &[509, 508, 507]);
    assert_eq!(depths(&index, &tokens, 4, now), [(0, 4)]);
}

#[test]
fn a_partial_last_page_is_continued_by_its_child() {
    let now = start();
    let index = index(1, 16);
    let tokens = prompt(40);
    // A page of 24 (partial against 16) and then one of 16: the child completes the second block.
    index.store(slot(&index, 0), seed(), None, [(1, &tokens[..24])]);
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 16)]);
    index.store(slot(&index, 0), seed(), Some(1), [(2, &tokens[24..40])]);
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 32)]);
}

#[test]
fn a_block_whose_parent_is_unknown_is_counted_and_skipped() {
    let now = start();
    let index = index(1, 16);
    let tokens = prompt(32);
    let stored = index.store(slot(&index, 0), seed(), Some(77), [(1, &tokens[16..])]);
    assert_eq!(
        stored,
        Stored {
            orphans: 1,
            ..Stored::default()
        }
    );
    assert_eq!(depths(&index, &tokens, 16, now), []);
}

#[test]
fn a_worker_matches_as_deep_as_its_deepest_rank() {
    let now = start();
    let index = EventIndex::new(&[1, 2], &[100, 100], size(16), TTL);
    let tokens = prompt(48);
    let rank1 = index.slot(WorkerId(1), 1).unwrap();
    assert_eq!(index.slot(WorkerId(1), 2), None);
    assert_eq!(index.slot(WorkerId(0), 1), None);
    index.store(rank1, seed(), None, engine_blocks(&tokens, 16));
    index.store(
        index.slot(WorkerId(1), 0).unwrap(),
        seed(),
        None,
        engine_blocks(&tokens[..16], 16),
    );
    index.store(
        slot(&index, 0),
        seed(),
        None,
        engine_blocks(&tokens[..32], 16),
    );
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 48), (0, 32)]);
    // Engine hashes are per rank: rank 0's removal does not touch rank 1.
    index.remove(index.slot(WorkerId(1), 0).unwrap(), &[1000]);
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 48), (0, 32)]);
    index.clear(rank1);
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 32)]);
}

#[test]
fn a_cleared_slot_holds_nothing_and_goes_on_learning() {
    let now = start();
    let index = index(1, 16);
    let tokens = prompt(32);
    index.store(slot(&index, 0), seed(), None, engine_blocks(&tokens, 16));
    index.clear(slot(&index, 0));
    assert_eq!(depths(&index, &tokens, 16, now), []);
    assert_eq!(index.stats().engine_keys, [0]);
    // Its old hashes mean nothing now: a child of one is an orphan.
    assert_eq!(
        index
            .store(slot(&index, 0), seed(), Some(1000), [(5, &tokens[16..])])
            .orphans,
        1
    );
    index.store(slot(&index, 0), seed(), None, engine_blocks(&tokens, 16));
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 32)]);
}

#[test]
fn a_guess_counts_until_its_ttl_and_says_it_is_one() {
    let start = self::start();
    let index = index(2, 16);
    let tokens = prompt(32);
    let hashes = block_hashes(seed(), &tokens, size(16));
    index.speculate(WorkerId(0), &hashes, start);
    index.store(
        slot(&index, 1),
        seed(),
        None,
        engine_blocks(&tokens[..16], 16),
    );
    let sourced = index.sourced(&hashes, start + Duration::from_secs(1));
    assert_eq!(
        sourced,
        [
            SourcedMatch {
                worker: WorkerId(0),
                events_tokens: 0,
                speculative_tokens: 32
            },
            SourcedMatch {
                worker: WorkerId(1),
                events_tokens: 16,
                speculative_tokens: 0
            }
        ]
    );
    assert_eq!(sourced[0].source(), DepthSource::Speculative);
    assert_eq!(sourced[1].source(), DepthSource::Events);
    assert_eq!(depths(&index, &tokens, 16, start + TTL), [(1, 16)]);
    assert_eq!(index.stats().speculative_entries, 0);
}

#[test]
fn a_flooding_publisher_is_bounded_by_the_workers_capacity() {
    let now = start();
    let index = EventIndex::new(&[1], &[8], size(4), TTL);
    let tokens = prompt(4000);
    // Roots only: each engine block its own prompt, as a flood of distinct prompts would be.
    for (at, chunk) in tokens.chunks(4).enumerate() {
        index.store(
            slot(&index, 0),
            prefix_seed("m", Some(&at.to_string())),
            None,
            [(at as u64, chunk)],
        );
    }
    let stats = index.stats();
    assert_eq!(stats.index.entries, 8);
    assert_eq!(stats.engine_keys, [8]);
    // Pages that end mid block are bounded too.
    let index = EventIndex::new(&[1], &[8], size(4), TTL);
    let mut over = 0;
    for (at, chunk) in tokens.chunks(3).enumerate() {
        over += index
            .store(slot(&index, 0), seed(), None, [(at as u64, chunk)])
            .over_bound;
    }
    assert!(over > 0);
    assert!(index.stats().side_entries[0] <= 8);
    assert!(depths(&index, &tokens, 4, now).len() <= 1);
}

#[test]
fn a_restored_block_under_a_new_engine_hash_is_found_by_the_new_one() {
    let now = start();
    let index = index(1, 16);
    let tokens = prompt(16);
    index.store(slot(&index, 0), seed(), None, [(1, &tokens[..])]);
    index.store(slot(&index, 0), seed(), None, [(2, &tokens[..])]);
    // The old hash no longer names it; the new one does.
    assert_eq!(index.remove(slot(&index, 0), &[1]), 0);
    assert_eq!(depths(&index, &tokens, 16, now), [(0, 16)]);
    assert_eq!(index.remove(slot(&index, 0), &[2]), 1);
    assert_eq!(depths(&index, &tokens, 16, now), []);
}

/// Any instant: the index reads no clock, so tests pick their own times from here.
#[allow(clippy::disallowed_methods)]
fn start() -> Instant {
    Instant::now()
}

#[test]
fn a_decision_keeps_its_prefix_recent_so_the_bound_evicts_colder_blocks() {
    let now = start();
    // Room for three blocks: a conversation's prefix and two blocks of other prompts.
    let index = EventIndex::new(&[1], &[3], size(4), Duration::ZERO);
    let slot = slot(&index, 0);
    let conversation = prompt(8);
    index.store(slot, seed(), None, engine_blocks(&conversation, 4));
    index.store(
        slot,
        prefix_seed("m", Some("older")),
        None,
        [(76, &conversation[..4])],
    );
    // A hit: the engine reports nothing, but the picker's decision refreshes the prefix, so the
    // next store evicts the other prompt's block rather than the conversation's.
    index.speculate(
        WorkerId(0),
        &block_hashes(seed(), &conversation, size(4)),
        now,
    );
    index.store(
        slot,
        prefix_seed("m", Some("other")),
        None,
        [(77, &conversation[..4])],
    );
    assert_eq!(depths(&index, &conversation, 4, now), [(0, 8)]);
    // A larger engine-reported capacity lifts the bound for every rank of the worker.
    assert!(index.capacity_outdated(3));
    assert!(!index.capacity_outdated(3));
    index.set_capacity(WorkerId(0), 10);
    index.store(
        slot,
        prefix_seed("m", Some("third")),
        None,
        [(78, &conversation[..4])],
    );
    assert_eq!(index.stats().index.entries, 4);
}

#[test]
fn a_suspended_rank_keeps_its_blocks_but_makes_no_owner() {
    let now = start();
    let index = EventIndex::new(&[2], &[100, 100], size(4), TTL);
    let tokens = prompt(8);
    let rank0 = index.slot(WorkerId(0), 0).unwrap();
    let rank1 = index.slot(WorkerId(0), 1).unwrap();
    index.store(rank0, seed(), None, engine_blocks(&tokens, 4));
    index.store(rank1, seed(), None, engine_blocks(&tokens[..4], 4));
    index.suspend(rank0, true);
    assert_eq!(depths(&index, &tokens, 4, now), [(0, 4)]);
    // A guess counts while one rank's stream is up, not once all are down.
    index.speculate(WorkerId(0), &block_hashes(seed(), &tokens, size(4)), now);
    assert_eq!(depths(&index, &tokens, 4, now), [(0, 8)]);
    index.suspend(rank1, true);
    assert_eq!(depths(&index, &tokens, 4, now), []);
    index.suspend(rank1, false);
    index.suspend(rank0, false);
    assert_eq!(depths(&index, &tokens, 4, now), [(0, 8)]);
}

#[test]
fn a_peer_s_guess_makes_an_owner_at_its_deepest_checkpoint_until_the_ttl() {
    let index = index(3, 16);
    let start = start();
    let tokens = prompt(16 * 100);
    let chain = block_hashes(seed(), &tokens, size(16));
    assert!(index.peer_guess(WorkerId(1), &crate::prefix::checkpoints(&chain), start));
    // The same prompt and a follow-up that extends it: 96 blocks, the checkpoint at or below 100.
    assert_eq!(depths(&index, &tokens, 16, start), [(1, 96 * 16)]);
    assert_eq!(depths(&index, &prompt(16 * 130), 16, start), [(1, 96 * 16)]);
    let sourced = index.sourced(&chain, start);
    assert_eq!(sourced[0].source(), DepthSource::Speculative);
    // A worker the pool does not have is refused.
    assert!(!index.peer_guess(WorkerId(7), &[1, 2], start));
    // Gone after the TTL, and with the worker's slot.
    assert!(depths(&index, &tokens, 16, start + TTL).is_empty());
    index.peer_guess(WorkerId(1), &crate::prefix::checkpoints(&chain), start);
    index.reset_worker(WorkerId(1), 1000);
    assert!(depths(&index, &tokens, 16, start).is_empty());
}

#[test]
fn a_prefix_guessed_again_stays_until_the_last_guess_expires() {
    let index = index(2, 16);
    let t0 = start();
    let first = prompt(16 * 40);
    let again = prompt(16 * 60);
    index.speculate(WorkerId(0), &block_hashes(seed(), &first, size(16)), t0);
    // A second turn of the same conversation, routed there a second later, shares its 40 blocks.
    let t1 = t0 + Duration::from_secs(1);
    index.speculate(WorkerId(0), &block_hashes(seed(), &again, size(16)), t1);
    // When the first guess expires, the second still holds all 60 blocks, the shared 40 included.
    assert_eq!(depths(&index, &again, 16, t0 + TTL), [(0, 60 * 16)]);
    assert_eq!(depths(&index, &first, 16, t0 + TTL), [(0, 40 * 16)]);
    assert!(depths(&index, &again, 16, t1 + TTL).is_empty());
}

#[test]
fn a_worker_that_joins_after_start_up_keeps_its_guesses() {
    // Slot 1 is empty at start-up (capacity 0), as in a discovery pool before its second worker.
    let index = EventIndex::new(&[1, 1], &[1000, 0], size(16), TTL);
    index.reset_worker(WorkerId(1), 1000);
    let now = start();
    let tokens = prompt(16 * 10);
    index.speculate(WorkerId(1), &block_hashes(seed(), &tokens, size(16)), now);
    assert_eq!(depths(&index, &tokens, 16, now), [(1, 10 * 16)]);
}

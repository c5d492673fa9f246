//! The request path end to end without the network: body → pool → tokens → blocks → owners → decision
//! → commit, on a pool whose workers have not been scraped (the gate fails open).

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::time::Instant;

use cachepick::config::{self, Overrides};
use cachepick::load::PoolLoad;
use cachepick::policy::{Outcome, Reason};
use cachepick::route::Picker;
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn picker(block_size: u32) -> Picker {
    let yaml = format!(
        "policy: {{min_match_tokens: 64}}\n\
         pools:\n  - model: m\n    engine: vllm\n    block_size: {block_size}\n    workers:\n\
         \x20     - endpoint: 127.0.0.1:1\n      - endpoint: 127.0.0.1:2\n      - endpoint: 127.0.0.1:3\n"
    );
    let config = config::parse(&yaml, "test.yaml", &Overrides::default()).expect("valid config");
    let loads = PoolLoad::for_pools(&config);
    Picker::new(&config, &loads).expect("picker")
}

fn chat(turns: usize) -> Vec<u8> {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You answer questions about cities. ".repeat(20)}),
    ];
    for turn in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("Tell me about city number {turn}. ").repeat(8)}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("City {turn} is lovely. ").repeat(8)}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

/// Routes one body and commits it; returns (selected worker, reason, matched tokens).
fn route(picker: &Picker, body: &[u8], rng: &mut SmallRng) -> (u32, Reason, u64) {
    let prepared = picker
        .prepare("/v1/chat/completions", body, Instant::now())
        .expect("prepared");
    let pinned = picker
        .pin(&prepared, Instant::now())
        .expect("the prepared pool exists");
    match pinned.decide(None, rng) {
        Outcome::Route(decision) => {
            pinned.commit(&decision);
            (
                decision.selected.0,
                decision.reason,
                decision.matched_tokens,
            )
        }
        Outcome::Refuse(refused) => panic!("refused: {refused:?}"),
    }
}

#[test]
fn a_burst_of_identical_prompts_follows_the_first_ones_placement() {
    let picker = picker(16);
    let mut rng = SmallRng::seed_from_u64(3);
    let body = chat(2);
    let (first, reason, _) = route(&picker, &body, &mut rng);
    assert_eq!(reason, Reason::CacheMiss);
    for _ in 0..20 {
        let (worker, reason, matched) = route(&picker, &body, &mut rng);
        assert_eq!((worker, reason), (first, Reason::CacheHit));
        assert!(matched >= 16 * 10);
    }
}

#[test]
fn a_growing_conversation_stays_with_the_worker_holding_its_history() {
    let picker = picker(16);
    let mut rng = SmallRng::seed_from_u64(9);
    let (home, _, _) = route(&picker, &chat(1), &mut rng);
    let mut last_matched = 0;
    for turns in 2..=10 {
        let (worker, reason, matched) = route(&picker, &chat(turns), &mut rng);
        assert_eq!((worker, reason), (home, Reason::CacheHit), "turn {turns}");
        assert!(
            matched > last_matched,
            "each turn matches the whole previous prompt"
        );
        last_matched = matched;
    }
}

#[test]
fn a_prompt_whose_blocks_nobody_holds_is_a_cache_miss_with_no_owners() {
    let picker = picker(16);
    let prepared = picker
        .prepare("/v1/completions", br#"{"model": "m", "prompt": "completely new text never seen before, long enough to fill blocks"}"#, Instant::now())
        .unwrap();
    assert!(prepared.owners.is_empty());
    assert_eq!(
        prepared.block_hashes.len() as u64,
        prepared.prompt_tokens / 16
    );
}

#[test]
fn bad_bodies_and_unknown_models_are_refused_with_their_status() {
    let picker = picker(16);
    let cases: [(&[u8], u16, &str); 3] = [
        (b"{not json", 400, "invalid_json"),
        (
            br#"{"model": "other", "messages": [{"role": "user", "content": "hi"}]}"#,
            404,
            "unknown_model",
        ),
        (
            br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            400,
            "missing_model",
        ),
    ];
    for (body, status, kind) in cases {
        let error = picker
            .prepare("/v1/chat/completions", body, Instant::now())
            .unwrap_err();
        let reason = error.reason();
        assert_eq!(
            (reason.status(), reason.as_str()),
            (status, kind),
            "{error}"
        );
    }
}

//! Routing by the prompt on the real engine: repeats and next turns go to their owner, and the
//! engine's own `cached_tokens` confirms what cachepick credited; cachepick's tokens and block keys
//! are the engine's; traffic that bypasses the picker still makes an owner; cold prompts spread.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use cachepick::tokenize::PoolTokenizer;
use cachepick_tokenizer::{Chat, ChatTurn};

use crate::engines;
use crate::stack::{Index, Stack, selected, upstream};
use crate::support::vllm::{ENGINE_BLOCK, Fleet, MODEL, prose, whole_blocks};

/// A chat's reply text.
fn content(reply: &Value) -> String {
    reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The prompt tokens cachepick credited the selected worker with (its access-log entry).
fn credited(entry: &Value) -> u64 {
    entry["prefix_tokens"]
        .as_str()
        .and_then(|tokens| tokens.parse().ok())
        .unwrap_or_else(|| panic!("no prefix_tokens in {entry}"))
}

/// The access log's `entry` is a `cache_hit` that the picker sent to `owner` and Envoy delivered there.
fn assert_hit_on(entry: &Value, owner: SocketAddr) {
    assert_eq!(entry["decision"], "cache_hit", "{entry}");
    assert_eq!(
        (selected(entry), upstream(entry)),
        (Some(owner), Some(owner)),
        "{entry}"
    );
}

/// A repeated chat, then two next turns: every one after the first is a `cache_hit` on the first's
/// worker, served there, and cachepick never credits more than the engine reused
/// (`usage.prompt_tokens_details.cached_tokens`, in whole 128-token blocks); for the exact repeat,
/// exactly as much.
async fn repeats_and_next_turns(index: Index, seed: u64) {
    let fleet = Fleet::lock(&engines()).await;
    let stack = Stack::start(&fleet, index, "").await;
    let mut messages = vec![json!({"role": "user", "content": prose(seed, 1500)})];
    let first = stack
        .chat(&json!(messages), 8, &format!("{seed}-first"))
        .await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let entry = stack.access(&format!("{seed}-first")).await;
    assert_eq!(entry["decision"], "cache_miss", "{entry}");
    let owner = selected(&entry).unwrap();
    assert!(
        first.prompt_tokens() > 2 * ENGINE_BLOCK * 4,
        "the prompt is long enough to be worth routing: {:?}",
        first.body["usage"]
    );

    let again = stack
        .chat(&json!(messages), 8, &format!("{seed}-again"))
        .await;
    let entry = stack.access(&format!("{seed}-again")).await;
    assert_hit_on(&entry, owner);
    let reusable = whole_blocks(again.prompt_tokens());
    assert_eq!(
        (again.cached_tokens(), credited(&entry)),
        (reusable, reusable),
        "the engine reused the repeat's whole blocks and cachepick credited exactly those: {:?} {entry}",
        again.body["usage"]
    );

    let mut previous = again;
    for turn in 0..2 {
        messages.push(json!({"role": "assistant", "content": content(&previous.body)}));
        messages.push(json!({"role": "user", "content": prose(seed * 10 + turn, 120)}));
        let id = format!("{seed}-turn{turn}");
        let reply = stack.chat(&json!(messages), 8, &id).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let entry = stack.access(&id).await;
        assert_hit_on(&entry, owner);
        let previous_blocks = whole_blocks(previous.prompt_tokens());
        assert!(
            reply.cached_tokens() >= previous_blocks,
            "the engine reused at least the earlier turn's whole blocks: {:?} after {previous_blocks}",
            reply.body["usage"]
        );
        assert!(
            credited(&entry) <= reply.cached_tokens() && credited(&entry) >= previous_blocks,
            "cachepick credits what the engine reuses, never more: {entry} {:?}",
            reply.body["usage"]
        );
        assert_eq!(reply.cached_tokens() % ENGINE_BLOCK, 0);
        previous = reply;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_mode_repeats_and_next_turns_are_hits_the_engine_confirms() {
    repeats_and_next_turns(Index::Events, 1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_repeats_and_next_turns_are_hits_the_engine_confirms() {
    repeats_and_next_turns(Index::Approximate, 2_000).await;
}

/// A chat's tokens as cachepick's `events` pools take them (the rendered text tokenized whole) and as
/// its `approximate` pools do (segment by segment).
fn chat_tokens(tokenizer: &PoolTokenizer, messages: &Value) -> (Vec<u32>, Vec<u32>) {
    let messages = messages.as_array().unwrap();
    let parts: Vec<Vec<std::borrow::Cow<'_, str>>> = messages
        .iter()
        .map(|message| vec![message["content"].as_str().unwrap().into()])
        .collect();
    let turns: Vec<ChatTurn<'_>> = messages
        .iter()
        .zip(&parts)
        .map(|(message, parts)| ChatTurn {
            role: message["role"].as_str().unwrap(),
            parts,
        })
        .collect();
    let whole = tokenizer
        .engine_tokens(Chat::new(&turns), &Default::default())
        .unwrap();
    (whole, tokenizer.tokens_for_chat(Chat::new(&turns)).unwrap())
}

/// cachepick tokenizes a completion's prompt and a chat exactly as the engine does (`/tokenize`), and
/// in `events` mode the blocks it derives from those tokens are the engine's own: a prompt sent to an
/// engine directly, bypassing the picker, is found there to its last whole block by the engine's KV
/// events alone, within 3 s. The workers name no sockets: each engine says where it publishes
/// (`/kv_event_sources`), and the picker's streams are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_block_keys_are_the_engines_and_bypassing_traffic_makes_an_owner() {
    let fleet = Fleet::lock(&engines()).await;
    let stack = Stack::start(&fleet, Index::EventsAdvertised, "").await;
    let engine = &fleet.engines[1];
    let tokenizer = PoolTokenizer::new(&stack.config.pools[0]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snapshot = stack.snapshot().await;
        let streams = snapshot["pools"][0]["kv_events"]
            .as_array()
            .unwrap()
            .clone();
        let asked = streams
            .iter()
            .all(|stream| stream["from"] == "engine" && stream["state"] == "live");
        if asked && streams.len() == 2 {
            for (worker, stream) in fleet.engines.iter().zip(&streams) {
                assert_eq!(stream["live"], worker.kv_events.to_string(), "{stream}");
                assert_eq!(stream["replay"], worker.replay.to_string(), "{stream}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the streams are not where the engines say they publish within 10 s: {streams:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let prompt = prose(3_000, 1500);
    let engine_ids = engine
        .tokenize(&json!({"model": MODEL, "prompt": prompt}))
        .await;
    let ids: Vec<u64> = tokenizer
        .tokens_for_text(&prompt)
        .unwrap()
        .into_iter()
        .map(u64::from)
        .collect();
    assert_eq!(ids, engine_ids, "a completion's prompt");

    let user = prose(3_001, 900);
    let earlier = prose(3_002, 300);
    let messages = json!([
        {"role": "user", "content": earlier},
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "user", "content": user},
    ]);
    let engine_ids = engine
        .tokenize(&json!({"model": MODEL, "messages": messages, "add_generation_prompt": true}))
        .await;
    let (whole, segments) = chat_tokens(&tokenizer, &messages);
    for (name, ours) in [
        ("events (whole text)", whole),
        ("approximate (segments)", segments),
    ] {
        let ours: Vec<u64> = ours.into_iter().map(u64::from).collect();
        assert_eq!(ours, engine_ids, "a chat's tokens, {name}");
    }

    // Sent to the engine directly: the picker never saw it, so only the engine's events can tell.
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    crate::support::vllm::complete_directly(engine.http, &body).await;
    let reusable = whole_blocks(ids.len() as u64);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let explained = stack.explain("/v1/completions", &body).await;
        let owner = explained["prepared"]["owners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|owner| {
                explained["endpoints"][owner["worker"].as_u64().unwrap() as usize]
                    == engine.http.to_string()
            })
            .cloned();
        let events_depth = explained["depth_sources"]
            .as_array()
            .and_then(|sources| sources.first())
            .map(|source| source["events_tokens"].as_u64().unwrap());
        if let Some(owner) = &owner
            && events_depth.is_some_and(|depth| depth >= reusable)
        {
            assert_eq!(
                explained["decision"], "cache_hit",
                "the engine that cached it is the owner: {explained}"
            );
            let _ = owner;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine's events did not make it the owner of its last whole block ({reusable}) within 3 s: {explained}"
        );
        // Explain allows 5 a second (`overload.explain_rate`).
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

//! Cost of turning prompts into tokens with `tokenize::PoolTokenizer`.
//!
//! Run: `cargo bench --bench tokenize`. Figures go to BENCHMARKS.md with the machine they came from.
//!
//! - `text_100k`: each backend on the same ~100 KB of English, as a text prompt. `cold` tokenizes a text
//!   the cache has not seen (a fresh prefix each iteration; it includes hashing the text and inserting
//!   the tokens), `cached` repeats one text (hash, lookup, copy out).
//! - `chat_8k`: a 10-turn chat of about 8k tokens, rendered and tokenized. `cold` finds none of its
//!   segments cached, `warm` finds all of them, and `new_turn` is the common case of a growing
//!   conversation: nine cached turns and a last turn never seen before.
//!
//! - `pathological_1m`: each backend on 1 MiB text prompts that are one pre-token each (a repeated
//!   letter, a repeated digit, a run of spaces, one long word of mixed letters, a repeated two-byte
//!   letter) beside 1 MiB of English, uncached (too long for the segment cache). Pieces longer than
//!   `MAX_PIECE_BYTES` are merged in chunks, so each costs a small multiple of the English.
//!
//! The English is sentences of the fixture corpus (`tests/fixtures/tokenizer/corpus.txt`) in a seeded
//! random order. The Hugging Face tokenizer is the 714-token fixture unless `TOKENIZE_BENCH_HF` names a
//! `tokenizer.json` (a real model's, for figures representative of a 100k+ vocabulary).

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::borrow::Cow;
use std::hint::black_box;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use cachepick::config::{TiktokenEncoding, TokenizerConfig};
use cachepick::tokenize::{Chat, ChatTurn, PoolTokenizer};

const CORPUS: &str = include_str!("../tests/fixtures/tokenizer/corpus.txt");
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
const TEXT_BYTES: usize = 100 * 1024;
const CHAT_TURNS: usize = 10;
/// About 800 o200k_base tokens of this English per turn.
const TURN_BYTES: usize = 3_750;

/// `bytes` English bytes: corpus sentences in a seeded random order, a paragraph break every fifth.
fn english(bytes: usize, seed: u64) -> String {
    let sentences: Vec<&str> = CORPUS
        .split("\n\n")
        .filter(|paragraph| !paragraph.contains("def ") && !paragraph.contains("User:"))
        .flat_map(|paragraph| paragraph.split(". "))
        .map(|sentence| sentence.trim_end_matches('.'))
        .collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut text = String::with_capacity(bytes + 200);
    let mut count = 0;
    while text.len() < bytes {
        let sentence = sentences[rng.random_range(0..sentences.len())];
        text.push_str(sentence);
        count += 1;
        text.push_str(if count % 5 == 0 { ".\n\n" } else { ". " });
    }
    text
}

struct Backend {
    name: &'static str,
    tokenizer: TokenizerConfig,
    template: Option<PathBuf>,
}

fn backends() -> Vec<Backend> {
    let chatml = Some(PathBuf::from(FIXTURES).join("tokenizer_config.json"));
    let hugging_face = std::env::var_os("TOKENIZE_BENCH_HF").map_or_else(
        || PathBuf::from(FIXTURES).join("tokenizer.json"),
        PathBuf::from,
    );
    vec![
        Backend {
            name: "tiktoken_o200k",
            tokenizer: TokenizerConfig::Tiktoken {
                encoding: TiktokenEncoding::O200kBase,
            },
            template: None,
        },
        Backend {
            name: "huggingface_chatml",
            tokenizer: TokenizerConfig::HuggingFace { path: hugging_face },
            template: chatml,
        },
        Backend {
            name: "bytes",
            tokenizer: TokenizerConfig::Bytes,
            template: None,
        },
    ]
}

fn pool(backend: &Backend, entries: usize) -> PoolTokenizer {
    PoolTokenizer::build(
        &backend.tokenizer,
        backend.template.as_deref(),
        NonZeroUsize::new(entries).unwrap(),
    )
    .unwrap()
}

fn text_100k(c: &mut Criterion) {
    let text = english(TEXT_BYTES, 1);
    let mut group = c.benchmark_group("text_100k");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(20);
    for backend in backends() {
        // One entry: each cold text evicts the last, so the cache never holds 100 KB texts by the
        // hundred.
        let tokenizer = pool(&backend, 1);
        let mut fresh = 0u64;
        group.bench_function(format!("{}/cold", backend.name), |b| {
            b.iter_batched(
                || {
                    fresh += 1;
                    format!("{fresh} {text}")
                },
                |text| black_box(tokenizer.tokens_for_text(&text).unwrap()),
                BatchSize::SmallInput,
            )
        });
        tokenizer.tokens_for_text(&text).unwrap();
        group.bench_function(format!("{}/cached", backend.name), |b| {
            b.iter(|| black_box(tokenizer.tokens_for_text(black_box(&text)).unwrap()))
        });
    }
    group.finish();
}

/// Messages as (role, text parts).
type Messages = Vec<(&'static str, Vec<Cow<'static, str>>)>;

/// A 10-turn chat of about 8k tokens, the last turn prefixed with `last_turn_tag`.
fn chat(last_turn_tag: u64) -> Messages {
    let text = english(TURN_BYTES * CHAT_TURNS, 2);
    let mut turns = Messages::new();
    let mut rest = text.as_str();
    for turn in 0..CHAT_TURNS {
        let cut = rest
            .char_indices()
            .skip(TURN_BYTES)
            .find(|(_, c)| *c == ' ')
            .map_or(rest.len(), |(at, _)| at);
        let (content, tail) = rest.split_at(cut);
        rest = tail.trim_start();
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let content = if turn == CHAT_TURNS - 1 {
            format!("({last_turn_tag}) {content}")
        } else {
            content.to_owned()
        };
        turns.push((role, vec![Cow::Owned(content)]));
    }
    turns
}

fn turns(chat: &Messages) -> Vec<ChatTurn<'_>> {
    chat.iter()
        .map(|(role, parts)| ChatTurn { role, parts })
        .collect()
}

fn chat_8k(c: &mut Criterion) {
    let mut group = c.benchmark_group("chat_8k");
    let base = chat(0);
    for backend in backends() {
        let tokens = pool(&backend, 1024)
            .tokens_for_chat(Chat::new(&turns(&base)))
            .unwrap()
            .len();
        eprintln!("chat_8k/{}: {tokens} tokens", backend.name);

        // One entry: the chat's segments evict one another, so every one is tokenized, by a tokenizer
        // whose own caches (the Hugging Face BPE word cache) are as warm as in a running server.
        let cold = pool(&backend, 1);
        group.bench_function(format!("{}/cold", backend.name), |b| {
            b.iter(|| black_box(cold.tokens_for_chat(Chat::new(&turns(&base))).unwrap()))
        });
        assert_eq!(cold.cache_stats().hits, 0, "every segment missed");

        let warm = pool(&backend, 16_384);
        warm.tokens_for_chat(Chat::new(&turns(&base))).unwrap();
        group.bench_function(format!("{}/warm", backend.name), |b| {
            b.iter(|| black_box(warm.tokens_for_chat(Chat::new(&turns(&base))).unwrap()))
        });

        let mut fresh = 0u64;
        group.bench_function(format!("{}/new_turn", backend.name), |b| {
            b.iter_batched(
                || {
                    fresh += 1;
                    chat(fresh)
                },
                |chat| black_box(warm.tokens_for_chat(Chat::new(&turns(&chat))).unwrap()),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// 1 MiB texts: English, and texts that are one pre-token each.
fn pathological_texts() -> Vec<(&'static str, String)> {
    const BYTES: usize = 1 << 20;
    let mut rng = SmallRng::seed_from_u64(3);
    let mixed: String = (0..BYTES)
        .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
        .collect();
    vec![
        ("english", english(BYTES, 3)),
        ("letter", "a".repeat(BYTES)),
        ("digit", "7".repeat(BYTES)),
        ("spaces", format!("x{}x", " ".repeat(BYTES - 2))),
        ("mixed_word", mixed),
        ("two_byte_letter", "é".repeat(BYTES / 2)),
    ]
}

fn pathological_1m(c: &mut Criterion) {
    let mut group = c.benchmark_group("pathological_1m");
    group.sample_size(10);
    for backend in backends() {
        let tokenizer = pool(&backend, 1);
        for (name, text) in pathological_texts() {
            group.throughput(Throughput::Bytes(text.len() as u64));
            group.bench_function(format!("{}/{name}", backend.name), |b| {
                // Prompts this long are never cached (longer than an eighth of a shard's budget).
                b.iter(|| black_box(tokenizer.tokens_for_text(black_box(&text)).ok()))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, text_100k, chat_8k, pathological_1m);
criterion_main!(benches);

//! The bound on one pre-token: ordinary text tokenizes exactly as the libraries tokenize it, and no text
//! costs more than a small multiple of ordinary text of the same size, for every backend.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cachepick_tokenizer::{
    MAX_PIECE_BYTES, Mode, Stop, TiktokenEncoding, TokenizeError, Tokenizer, TokenizerConfig,
};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/tokenizer"
);

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(FIXTURES).join(name)
}

fn corpus() -> String {
    std::fs::read_to_string(fixture("corpus.txt")).unwrap()
}

/// `bytes` of the corpus's words in a fixed shuffled order (no piece longer than a word).
fn english(bytes: usize) -> String {
    let corpus = corpus();
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut text = String::with_capacity(bytes + 32);
    let mut state = 0x9e37_79b9_u64;
    while text.len() < bytes {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let word = words[(state >> 33) as usize % words.len()];
        text.push_str(word);
        text.push(if state.is_multiple_of(11) { '\n' } else { ' ' });
    }
    text.truncate(floor(&text, bytes));
    text
}

/// The last character boundary of `text` at or before `at`.
fn floor(text: &str, at: usize) -> usize {
    (0..=at.min(text.len()))
        .rev()
        .find(|at| text.is_char_boundary(*at))
        .unwrap_or(0)
}

/// Texts of about `bytes` that each are one pre-token (or one whitespace run) under the usual patterns.
fn pathological(bytes: usize) -> Vec<(&'static str, String)> {
    let mut state = 7_u64;
    let mixed: String = (0..bytes)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            char::from(b'a' + ((state >> 33) % 26) as u8)
        })
        .collect();
    vec![
        ("repeated letter", "a".repeat(bytes)),
        ("repeated digit", "7".repeat(bytes)),
        ("whitespace run", format!("x{}x", " ".repeat(bytes - 2))),
        ("long mixed word", mixed),
        ("repeated two-byte letter", "é".repeat(bytes / 2)),
        ("repeated three-byte letter", "あ".repeat(bytes / 3)),
        ("repeated punctuation", "-".repeat(bytes)),
    ]
}

struct Case {
    name: &'static str,
    config: TokenizerConfig,
}

fn backends() -> Vec<Case> {
    let tiktoken = |name, encoding| Case {
        name,
        config: TokenizerConfig::Tiktoken { encoding },
    };
    vec![
        tiktoken("o200k_base", TiktokenEncoding::O200kBase),
        tiktoken("cl100k_base", TiktokenEncoding::Cl100kBase),
        tiktoken("p50k_base", TiktokenEncoding::P50kBase),
        tiktoken("r50k_base", TiktokenEncoding::R50kBase),
        Case {
            name: "huggingface byte-level",
            config: TokenizerConfig::HuggingFace {
                path: fixture("tokenizer.json"),
            },
        },
        Case {
            name: "huggingface metaspace",
            config: TokenizerConfig::HuggingFace {
                path: fixture("metaspace_tokenizer.json"),
            },
        },
        Case {
            name: "bytes",
            config: TokenizerConfig::Bytes,
        },
    ]
}

/// Ordinary texts, including ones with runs longer than the tiktoken backend's run bound whose pieces
/// are still short (a page of Chinese without a space, a long base64 blob, a long dotted leader).
fn ordinary_texts() -> Vec<String> {
    let chinese = "海港小镇在冬天的早晨慢慢醒来，渔船靠着码头摇晃，海鸥在渔网上争吵，街角的面包师在太阳越过山丘之前打开了百叶窗。".repeat(40);
    let base64: String = (0..6000)
        .map(|i: u32| {
            let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
            char::from(alphabet[(i.wrapping_mul(2_654_435_761) >> 7) as usize % 64])
        })
        .collect();
    vec![
        corpus(),
        english(200_000),
        format!("{}<|endoftext|>{}", corpus(), corpus()),
        chinese,
        format!("data:image/png;base64,{base64}"),
        format!("Contents {} 7\n", ".-".repeat(900)),
        "  indented\n\tcode();\n\n\n".repeat(500),
    ]
}

/// The tokens the library gives, without the bound: the reference for ordinary text.
fn reference(config: &TokenizerConfig, text: &str, mode: Mode) -> Vec<u32> {
    match config {
        TokenizerConfig::Tiktoken { encoding } => {
            let bpe = match encoding {
                TiktokenEncoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
                TiktokenEncoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
                TiktokenEncoding::P50kBase => tiktoken_rs::p50k_base_singleton(),
                TiktokenEncoding::R50kBase => tiktoken_rs::r50k_base_singleton(),
            };
            bpe.encode_with_special_tokens(text)
        }
        TokenizerConfig::HuggingFace { path } => {
            let mut tokenizer = tokenizers::Tokenizer::from_file(path).unwrap();
            tokenizer.with_truncation(None).unwrap();
            tokenizer.with_padding(None);
            tokenizer
                .encode_fast(text, mode == Mode::Prompt)
                .unwrap()
                .get_ids()
                .to_vec()
        }
        TokenizerConfig::Bytes => Tokenizer::load(config, None)
            .unwrap()
            .encode(text, mode)
            .unwrap(),
    }
}

#[test]
fn ordinary_text_tokenizes_exactly_as_the_library_does() {
    for case in backends() {
        let tokenizer = Tokenizer::load(&case.config, None).unwrap();
        for text in ordinary_texts() {
            for mode in [Mode::Segment, Mode::Prompt] {
                assert_eq!(
                    tokenizer.encode(&text, mode).unwrap(),
                    reference(&case.config, &text, mode),
                    "{}: {:?}…",
                    case.name,
                    &text[..floor(&text, 60)]
                );
            }
        }
    }
}

#[test]
fn an_over_long_piece_still_encodes_its_exact_bytes() {
    for case in backends() {
        let tokenizer = Tokenizer::load(&case.config, None).unwrap();
        for (name, text) in pathological(3 * MAX_PIECE_BYTES + 17) {
            let text = format!("before {text} after");
            let tokens = tokenizer.encode(&text, Mode::Segment).unwrap();
            // The Metaspace fixture has no byte fallback: what it does not know decodes as `<unk>`.
            if case.name != "huggingface metaspace" {
                let decoded = tokenizer.decode(&tokens).unwrap();
                assert_eq!(decoded, text, "{}: {name}", case.name);
            }
            // Deterministic, so equal prompts give equal tokens.
            assert_eq!(tokenizer.encode(&text, Mode::Segment).unwrap(), tokens);
        }
    }
}

/// The CPU time this thread has run, from `/proc/thread-self/schedstat`: work done, not time waited, so
/// the other processes of a loaded machine do not count.
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    let nanos: u64 = stat.split_whitespace().next().unwrap().parse().unwrap();
    Duration::from_nanos(nanos)
}

/// CPU time a measurement must cover. Some kernels update `schedstat` only at the scheduler tick
/// (4 ms at 250 Hz), so one short run reads as 0 or one whole tick; repeating the work until it
/// covers many ticks makes the per-run figure accurate to a few per cent.
const MEASURED_CPU: Duration = Duration::from_millis(80);

/// The least of three measurements of `work`'s CPU time per run on this thread, each repeating it
/// until it has used [`MEASURED_CPU`].
fn least_of_three(mut work: impl FnMut()) -> Duration {
    (0..3)
        .map(|_| {
            let started = thread_cpu();
            let mut runs = 0_u32;
            loop {
                work();
                runs += 1;
                let spent = thread_cpu().saturating_sub(started);
                if spent >= MEASURED_CPU || runs >= 10_000 {
                    break spent / runs;
                }
            }
        })
        .min()
        .unwrap()
}

/// The stated bound: a text costs at most this many times the CPU of ordinary text of its size.
/// Generous, as a ratio measured in one process must be (measured at most 3.2 times in a debug build);
/// before the bound, 8 MB of one letter cost about 130 times (issue 23, a release build).
const WORK_RATIO: f64 = 8.0;

#[test]
fn no_text_costs_more_than_a_small_multiple_of_ordinary_text() {
    const BYTES: usize = 128 * 1024;
    let ordinary = english(BYTES);
    let mut report = Vec::new();
    let mut over = Vec::new();
    for case in backends() {
        let tokenizer = Tokenizer::load(&case.config, None).unwrap();
        let base = least_of_three(|| {
            tokenizer.encode(&ordinary, Mode::Segment).unwrap();
        })
        .max(Duration::from_micros(200));
        for (name, text) in pathological(BYTES) {
            // A regex that gives up is an error, never a long run: it counts as work all the same.
            let cost = least_of_three(|| {
                let _ = tokenizer.encode(&text, Mode::Segment);
            });
            let ratio = cost.as_secs_f64() / base.as_secs_f64();
            report.push(format!(
                "{} {name}: {ratio:.1}x ({cost:?} vs {base:?})",
                case.name
            ));
            if ratio > WORK_RATIO {
                over.push(report.last().unwrap().clone());
            }
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        over.is_empty(),
        "over {WORK_RATIO}x ordinary text: {over:#?}"
    );
}

#[test]
fn a_stop_interrupts_the_work_between_bounded_chunks() {
    for case in backends().into_iter().filter(|case| case.name != "bytes") {
        let tokenizer = Tokenizer::load(&case.config, None).unwrap();
        let text = "a".repeat(1 << 20);
        let stopped = Stop::new(Some(Instant::now()), None);
        assert!(
            matches!(
                tokenizer.encode_within(&text, Mode::Segment, &stopped),
                Err(TokenizeError::Interrupted)
            ),
            "{}",
            case.name
        );
        // A stop that never comes changes nothing.
        assert_eq!(
            tokenizer
                .encode_within(&text, Mode::Segment, &Stop::never())
                .unwrap(),
            tokenizer.encode(&text, Mode::Segment).unwrap()
        );
    }
}

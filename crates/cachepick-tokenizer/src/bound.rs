//! Bounds on the work one text costs: no pre-token longer than [`MAX_PIECE_BYTES`] reaches BPE, and a
//! [`Stop`] is asked between bounded chunks of work.
//!
//! BPE merges within each pre-token (a piece of the tokenizer's split regex), and its cost grows faster
//! than the piece: tiktoken's heap merge over a piece of n bytes holds about 56 bytes per byte and misses
//! the cache on every step, so 8 MB of one letter (a single piece) costs about 130 times the CPU of 8 MB
//! of words. Ordinary text never has such a piece: words, numbers, punctuation and whitespace runs are
//! short. So a piece longer than [`MAX_PIECE_BYTES`] is cut into chunks of at most that many bytes (at
//! character boundaries), each merged on its own.
//!
//! # What the cut changes
//! Text without an over-long piece is tokenized exactly as before, by the backend's own encode, and a
//! test holds that. Inside an over-long piece (and, under tiktoken, in the text of the same prompt next
//! to where it is cut, see below) the tokens may differ from the engine's, which merges the piece whole:
//! the chunks' tokens are a valid encoding of the same bytes, only not the minimal one. The prefix index
//! hashes tokens in a chain, so a request's hashes match the engine's (events mode) or another request's
//! (both are cut alike: the cut depends only on the text) up to the block holding the first cut, and
//! not after it. Nothing an engine serves has such a piece in practice (no model's vocabulary has a token
//! of more than a few hundred bytes, and no engine is fast on them either: they cost it the same
//! superlinear merge), so what is lost is the affinity of requests built to be slow.
//!
//! This is what the tiktoken and Hugging Face projects settled on too: tiktoken switched its merge to a
//! heap for long pieces (openai/tiktoken#239, fixing #195's `"a" * 100_000`), which removes the
//! quadratic term but not the per-byte constant measured above; truncating or chunking over-long pieces
//! is the workaround their issue threads give (tiktoken-php#25), and Hugging Face's WordPiece goes
//! further and replaces any word of more than `max_input_chars_per_word` (100) with its unknown token.
//!
//! # Backends
//! - **tiktoken**: `CoreBPE` runs its regex and merges inside one call, so the cut is made on the text:
//!   a text with no run of whitespace, or of non-whitespace, longer than [`RUN_BYTES`] has no piece
//!   longer than [`MAX_PIECE_BYTES`] (every piece of the four bundled patterns lies within one such run
//!   and the next, plus one character) and is encoded whole. A text with a longer run is split by the
//!   encoding's own regex; when no piece is over-long it is still encoded whole. Otherwise the text is
//!   encoded in windows cut inside every run longer than [`RUN_BYTES`], every [`RUN_BYTES`] bytes of it,
//!   so every window's pieces are bounded; tokens differ from the whole text's only at the cuts.
//! - **huggingface**: the model (BPE, WordPiece, Unigram, WordLevel) sees each pre-token in turn; a
//!   wrapper around it cuts those longer than [`MAX_PIECE_BYTES`]. Normalizers and pre-tokenizers are
//!   linear and run as they are.
//! - **bytes**: linear already; nothing to bound.
//!
//! # Stopping
//! A [`Stop`] (the decision's deadline, or its request going away) is asked before a text is encoded,
//! between tiktoken's windows, and every [`STOP_CHECK_BYTES`] of pre-tokens the Hugging Face model
//! sees: a stopped encode returns [`TokenizeError::Interrupted`](crate::TokenizeError::Interrupted).
//! The longest run between two questions is one ordinary tiktoken text (its cost is linear: about
//! 8 ns a byte in a release build) or [`STOP_CHECK_BYTES`] of Hugging Face pre-tokens.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The longest piece merged whole. Long enough for any real word, number, indentation or run of one
/// script without punctuation (a long line of Thai, say, is a few hundred bytes); short enough that a
/// piece this long costs a small multiple of ordinary text per byte (see the bound test and the
/// `tokenize` bench).
pub const MAX_PIECE_BYTES: usize = 2048;

/// The longest run of whitespace, or of non-whitespace, that the tiktoken backend leaves uncut: a piece
/// of the bundled patterns spans at most one such run, the run after it and one character, so with runs
/// this long no piece exceeds [`MAX_PIECE_BYTES`].
pub const RUN_BYTES: usize = (MAX_PIECE_BYTES - 4) / 2;

/// Hugging Face pre-tokens the model merges between two questions to the [`Stop`].
pub const STOP_CHECK_BYTES: usize = 64 * 1024;

/// When an encode should give up: a deadline, a flag that cancels, both or neither.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    deadline: Option<Instant>,
    cancelled: Option<Arc<AtomicBool>>,
}

impl Stop {
    /// Never stops.
    pub fn never() -> Stop {
        Stop::default()
    }

    /// Stops from `deadline` on (if any), or once `cancelled` (if any) is set.
    pub fn new(deadline: Option<Instant>, cancelled: Option<Arc<AtomicBool>>) -> Stop {
        Stop {
            deadline,
            cancelled,
        }
    }

    /// Whether the work should stop now.
    pub fn stopped(&self) -> bool {
        self.cancelled
            .as_ref()
            .is_some_and(|cancelled| cancelled.load(Ordering::Acquire))
            || self
                .deadline
                .is_some_and(|deadline| Instant::now() >= deadline)
    }

    fn is_never(&self) -> bool {
        self.deadline.is_none() && self.cancelled.is_none()
    }
}

/// The error an encode stopped by its [`Stop`] returns from inside a backend.
#[derive(Debug)]
pub(crate) struct Interrupted;

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tokenizing was stopped")
    }
}

impl std::error::Error for Interrupted {}

thread_local! {
    /// The stop of the encode running on this thread, for the Hugging Face model wrapper, which the
    /// library calls without a way to pass it.
    static CURRENT: RefCell<Stop> = RefCell::new(Stop::never());
    /// Pre-token bytes seen since the last question to [`CURRENT`].
    static SEEN: Cell<usize> = const { Cell::new(0) };
}

/// Makes `stop` the current thread's stop while the guard lives.
pub(crate) struct Current;

impl Current {
    pub(crate) fn set(stop: &Stop) -> Current {
        CURRENT.with(|current| *current.borrow_mut() = stop.clone());
        SEEN.with(|seen| seen.set(0));
        Current
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        CURRENT.with(|current| *current.borrow_mut() = Stop::never());
    }
}

/// Counts `bytes` of work; every [`STOP_CHECK_BYTES`] asks the current stop. `Err` once stopped.
pub(crate) fn spend(bytes: usize) -> Result<(), Interrupted> {
    let seen = SEEN.with(|seen| {
        let total = seen.get().saturating_add(bytes);
        seen.set(total);
        total
    });
    if seen < STOP_CHECK_BYTES {
        return Ok(());
    }
    SEEN.with(|seen| seen.set(0));
    let stopped = CURRENT.with(|current| {
        let current = current.borrow();
        !current.is_never() && current.stopped()
    });
    if stopped { Err(Interrupted) } else { Ok(()) }
}

/// The byte ranges of `text` in chunks of at most `max` bytes, cut at character boundaries (a chunk
/// holds at least one character, so a character longer than `max` is a chunk of its own).
pub(crate) fn chunks(text: &str, max: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let mut end = start.saturating_add(max.max(1)).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        if end == start {
            // One character longer than `max`: take it whole.
            end = start + text[start..].chars().next().map_or(1, char::len_utf8);
        }
        let range = (start, end);
        start = end;
        Some(range)
    })
}

/// Where `text` is cut so that no run of whitespace, or of non-whitespace, is longer than
/// [`RUN_BYTES`]: inside each longer run, every [`RUN_BYTES`] bytes from its start (at a character
/// boundary). Empty for a text without such a run. The cuts depend only on the run, so two texts that
/// share a prefix share the cuts in it. `None` once `stop` says stop (asked every [`STOP_CHECK_BYTES`]).
pub(crate) fn run_cuts(text: &str, stop: &Stop) -> Option<Vec<usize>> {
    let mut cuts = Vec::new();
    let mut white = None;
    // Where the current chunk of the current run starts.
    let mut chunk = 0;
    let mut checked = 0;
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        // ASCII without decoding (its whitespace is `\t`..=`\r` and the space, as `char::is_whitespace`
        // has it); anything else as the character it starts.
        let (is_white, len) = if byte.is_ascii() {
            (matches!(byte, b' ' | b'\t'..=b'\r'), 1)
        } else {
            let c = text.get(at..).and_then(|rest| rest.chars().next());
            (
                c.is_some_and(char::is_whitespace),
                c.map_or(1, char::len_utf8),
            )
        };
        if white != Some(is_white) {
            white = Some(is_white);
            chunk = at;
        } else if at + len - chunk > RUN_BYTES {
            cuts.push(at);
            chunk = at;
        }
        if at - checked >= STOP_CHECK_BYTES {
            checked = at;
            if stop.stopped() {
                return None;
            }
        }
        at += len;
    }
    Some(cuts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_text_at_character_boundaries() {
        let text = "ééééé";
        let ranges: Vec<_> = chunks(text, 3).collect();
        assert_eq!(ranges, vec![(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]);
        assert_eq!(
            chunks("abcdefg", 3).collect::<Vec<_>>(),
            [(0, 3), (3, 6), (6, 7)]
        );
        assert_eq!(chunks("", 3).count(), 0);
        // A character longer than the bound is a chunk of its own.
        assert_eq!(chunks("😀", 2).collect::<Vec<_>>(), [(0, 4)]);
    }

    #[test]
    fn only_runs_longer_than_the_bound_are_cut() {
        let cuts = |text: &str| run_cuts(text, &Stop::never()).unwrap();
        let ordinary = "word ".repeat(10_000);
        assert!(cuts(&ordinary).is_empty());
        let long = "a".repeat(RUN_BYTES * 3 + 5);
        assert_eq!(cuts(&long), [RUN_BYTES, 2 * RUN_BYTES, 3 * RUN_BYTES]);
        let spaces = format!("x{}y", " ".repeat(RUN_BYTES + 1));
        assert_eq!(cuts(&spaces), [1 + RUN_BYTES]);
        let exact = "a".repeat(RUN_BYTES);
        assert!(cuts(&exact).is_empty());
        // Whitespace beyond ASCII breaks a run as a space does; a letter beyond ASCII does not.
        let wide = format!(
            "{}\u{3000}{}",
            "é".repeat(RUN_BYTES / 2),
            "é".repeat(RUN_BYTES / 2)
        );
        assert!(cuts(&wide).is_empty());
        let vertical_tab = format!("{}\u{b}{}", "a".repeat(RUN_BYTES), "a".repeat(RUN_BYTES));
        assert!(cuts(&vertical_tab).is_empty());
        let stopped = Stop::new(Some(Instant::now()), None);
        assert!(run_cuts(&"a".repeat(4 * STOP_CHECK_BYTES), &stopped).is_none());
    }

    #[test]
    fn a_stop_stops_at_its_deadline_or_when_cancelled() {
        assert!(!Stop::never().stopped());
        assert!(Stop::new(Some(Instant::now()), None).stopped());
        let flag = Arc::new(AtomicBool::new(false));
        let stop = Stop::new(None, Some(Arc::clone(&flag)));
        assert!(!stop.stopped());
        flag.store(true, Ordering::Release);
        assert!(stop.stopped());
    }
}

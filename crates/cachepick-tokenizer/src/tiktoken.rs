//! A bundled tiktoken encoding with its pieces bounded (see [`bound`](crate::bound)).
//!
//! `CoreBPE` splits and merges inside one call, so the bound works on the text: a text that may hold an
//! over-long piece (it has a run longer than [`RUN_BYTES`]) is split here with the encoding's own regex
//! and special tokens, the way `CoreBPE::encode` splits it; only when a piece is over-long is the text
//! encoded in windows.

use std::collections::HashSet;

use fancy_regex::Regex;
use tiktoken_rs::CoreBPE;

use crate::bound::{self, MAX_PIECE_BYTES, Stop};
use crate::config::TiktokenEncoding;
use crate::{Mode, TokenizeError};

/// The split pattern of each bundled encoding, as `tiktoken_rs` builds it (a test holds them equal).
pub(crate) fn pattern(encoding: TiktokenEncoding) -> &'static str {
    const GPT2: &str =
        "'(?:[sdmt]|ll|ve|re)| ?\\p{L}++| ?\\p{N}++| ?[^\\s\\p{L}\\p{N}]++|\\s++$|\\s+(?!\\S)|\\s";
    const CL100K: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";
    match encoding {
        TiktokenEncoding::O200kBase => tiktoken_rs::O200K_BASE_PAT_STR,
        TiktokenEncoding::Cl100kBase => CL100K,
        TiktokenEncoding::P50kBase | TiktokenEncoding::R50kBase => GPT2,
    }
}

/// One loaded encoding: the shared `CoreBPE`, its split regex and its special tokens.
pub(crate) struct Tiktoken {
    pub(crate) bpe: &'static CoreBPE,
    /// Every special token of the encoding, recognised wherever it appears in the text.
    pub(crate) special: HashSet<&'static str>,
    regex: Regex,
}

impl Tiktoken {
    pub(crate) fn new(
        bpe: &'static CoreBPE,
        encoding: TiktokenEncoding,
    ) -> Result<Tiktoken, TokenizeError> {
        let regex = Regex::new(pattern(encoding)).map_err(|source| TokenizeError::Encoding {
            encoding: encoding.as_str(),
            source: source.into(),
        })?;
        Ok(Tiktoken {
            bpe,
            special: bpe.special_tokens(),
            regex,
        })
    }

    /// The tokens of `text` (tiktoken adds no special tokens of its own, so the mode changes nothing).
    pub(crate) fn encode(
        &self,
        text: &str,
        _mode: Mode,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        let cuts = bound::run_cuts(text, stop).ok_or(TokenizeError::Interrupted)?;
        // No long run, or long runs of short pieces (a page of Chinese without a space): the text is
        // encoded as the engine encodes it. A regex that gives up (its backtracking limit, on a
        // megabyte of whitespace) would give up in `CoreBPE` too, after merging what came before it:
        // the cut windows below cannot fail so.
        if cuts.is_empty() || !self.has_long_piece(text, stop)? {
            return self.encode_in_windows(text, stop);
        }
        let mut tokens = Vec::new();
        let mut start = 0;
        for end in cuts.into_iter().chain(std::iter::once(text.len())) {
            let window = text.get(start..end).unwrap_or_default();
            tokens.extend(self.encode_in_windows(window, stop)?);
            start = end;
        }
        Ok(tokens)
    }

    /// `text` encoded in windows of about [`WINDOW_BYTES`] cut where a piece always ends (see
    /// [`safe_cuts`]), asking `stop` between them: the tokens are the whole text's.
    fn encode_in_windows(&self, text: &str, stop: &Stop) -> Result<Vec<u32>, TokenizeError> {
        if stop.stopped() {
            return Err(TokenizeError::Interrupted);
        }
        if text.len() <= WINDOW_BYTES {
            return self.encode_whole(text);
        }
        let mut tokens = Vec::new();
        let mut start = 0;
        for end in safe_cuts(text, WINDOW_BYTES).chain(std::iter::once(text.len())) {
            if stop.stopped() {
                return Err(TokenizeError::Interrupted);
            }
            tokens.extend(self.encode_whole(text.get(start..end).unwrap_or_default())?);
            start = end;
        }
        Ok(tokens)
    }

    fn encode_whole(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.bpe
            .encode(text, &self.special)
            .map(|(tokens, _)| tokens)
            .map_err(|source| TokenizeError::Encode(source.into()))
    }

    /// Whether `text` holds a piece longer than [`MAX_PIECE_BYTES`] as `CoreBPE::encode` splits it: the
    /// text is cut at each special token (leftmost first; no special token of a bundled encoding starts
    /// another) and each stretch split by the regex, a [`WINDOW_BYTES`] slice at a time, asking `stop`
    /// between slices. A piece cut by a slice's end is seen in two parts, so a piece of up to twice the
    /// bound may pass as short: merged whole, it still costs a small multiple. A regex that gives up
    /// (its backtracking limit) counts as a long piece: the windows cannot make it give up.
    fn has_long_piece(&self, text: &str, stop: &Stop) -> Result<bool, TokenizeError> {
        // Each special token's next occurrence, searched again only once passed: linear in the text
        // however many special tokens it holds.
        let mut next: Vec<(Option<usize>, &str)> = self
            .special
            .iter()
            .map(|special| (text.find(special), *special))
            .collect();
        let mut start = 0;
        loop {
            for (at, special) in &mut next {
                if at.is_some_and(|at| at < start) {
                    *at = text
                        .get(start..)
                        .and_then(|rest| rest.find(*special))
                        .map(|found| start + found);
                }
            }
            let special = next
                .iter()
                .filter_map(|(at, special)| at.map(|at| (at, special.len())))
                .min();
            let end = special.map_or(text.len(), |(at, _)| at);
            let stretch = text.get(start..end).unwrap_or_default();
            for (from, to) in bound::chunks(stretch, WINDOW_BYTES) {
                if stop.stopped() {
                    return Err(TokenizeError::Interrupted);
                }
                for piece in self
                    .regex
                    .find_iter(stretch.get(from..to).unwrap_or_default())
                {
                    match piece {
                        Ok(piece) if piece.as_str().len() <= MAX_PIECE_BYTES => {}
                        _ => return Ok(true),
                    }
                }
            }
            match special {
                Some((at, len)) => start = at + len,
                None => return Ok(false),
            }
        }
    }
}

/// Text is encoded, and scanned for long pieces, in windows of about this many bytes, so that a stop is
/// asked between them.
pub(crate) const WINDOW_BYTES: usize = 64 * 1024;

/// Where ordinary text can be cut into windows without changing a token, one cut at most every
/// [`WINDOW_BYTES`]: before a space that follows sentence punctuation (`.,;:!?`) and precedes an ASCII
/// letter, or after a newline that follows a non-whitespace character and precedes a letter. Under all
/// four bundled patterns a piece ends there (no piece continues from such punctuation into a space, or
/// from a newline into a letter) and the pieces before it are the same whether the text goes on or
/// ends there (the `\s+(?!\S)` and `\s++$` alternatives meet a single newline alike), and no special
/// token holds a space or a newline, so the windows' tokens joined are the whole text's (a test holds
/// them equal).
pub(crate) fn safe_cuts(text: &str, every: usize) -> impl Iterator<Item = usize> + '_ {
    let bytes = text.as_bytes();
    let mut next = every.max(1);
    std::iter::from_fn(move || {
        while next + 1 < bytes.len() {
            let at = next;
            next += 1;
            let (Some(before), Some(here), Some(after)) = (
                at.checked_sub(1).and_then(|i| bytes.get(i)),
                bytes.get(at),
                bytes.get(at + 1),
            ) else {
                continue;
            };
            let punctuation_space =
                b".,;:!?".contains(before) && *here == b' ' && after.is_ascii_alphabetic();
            let newline_letter = *before == b'\n'
                && text
                    .get(..at - 1)
                    .and_then(|head| head.chars().next_back())
                    .is_some_and(|c| !c.is_whitespace())
                && text
                    .get(at..)
                    .and_then(|rest| rest.chars().next())
                    .is_some_and(char::is_alphabetic);
            if punctuation_space || newline_letter {
                next = at + every.max(1);
                return Some(at);
            }
        }
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::shared_encoding;

    fn encodings() -> Vec<Tiktoken> {
        TiktokenEncoding::ALL
            .iter()
            .map(|encoding| Tiktoken::new(shared_encoding(*encoding).unwrap(), *encoding).unwrap())
            .collect()
    }

    /// The pieces the scan sees, to hold the patterns to `CoreBPE`'s.
    fn pieces<'t>(tiktoken: &Tiktoken, text: &'t str) -> Vec<&'t str> {
        tiktoken
            .regex
            .find_iter(text)
            .map(|piece| piece.unwrap().as_str())
            .collect()
    }

    const _: () = assert!(crate::bound::RUN_BYTES * 2 + 4 <= MAX_PIECE_BYTES);

    const CORPUS: &str = include_str!("../../../tests/fixtures/tokenizer/corpus.txt");

    fn tricky() -> String {
        let mut text = String::from(CORPUS);
        for piece in [
            "a\nB",
            "a\n\nB",
            "x \nY",
            "z\u{3000}\nW",
            "!\nQ",
            "!\n/x",
            "7\nq",
            "Mr. Smith",
            "end.\tNext",
            "so, then",
            "what?! No",
            "it's. Done",
            "a:b",
            "tail.  Two",
            "é\nà",
            "<|endoftext|>\nA",
            "done.<|endoftext|> B",
            "1. 2. three. Four",
            "\r\nCR",
            "q;\u{a0}x",
        ] {
            text.push_str(piece);
            text.push(' ');
        }
        text
    }

    #[test]
    fn the_scans_patterns_split_as_core_bpe_does() {
        for tiktoken in encodings() {
            let text = tricky().replace("<|endoftext|>", "");
            let joined: Vec<u32> = pieces(&tiktoken, &text)
                .iter()
                .flat_map(|piece| tiktoken.encode_whole(piece).unwrap())
                .collect();
            assert_eq!(joined, tiktoken.encode_whole(&text).unwrap());
        }
    }

    #[test]
    fn a_cut_at_every_safe_place_keeps_the_whole_texts_tokens() {
        for tiktoken in encodings() {
            let text = tricky();
            let whole = tiktoken.encode_whole(&text).unwrap();
            let cuts: Vec<usize> = safe_cuts(&text, 1).collect();
            assert!(cuts.len() > 100, "{}", cuts.len());
            let mut start = 0;
            let mut joined = Vec::new();
            for end in cuts.iter().copied().chain(std::iter::once(text.len())) {
                joined.extend(tiktoken.encode_whole(&text[start..end]).unwrap());
                start = end;
            }
            assert_eq!(joined, whole);
        }
    }
}

//! Prompt → tokens: each pool's tokenizer and chat template (`cachepick-tokenizer`, which the simulator
//! shares) behind the segment cache.
//!
//! The prefix index matches requests by the tokens of their prompts, so this module turns a prompt into
//! the token sequence the engine would prefill, as closely as can be done offline, and fast enough to sit
//! on the request path: a conversation seen before costs a few hash lookups, not a tokenization.
//!
//! A [`PoolTokenizer`] is built once per pool at start-up ([`PoolTokenizer::new`]) and shared by every
//! request of the pool. [`PoolTokenizer::tokens_for_text`] tokenizes a completion prompt;
//! [`PoolTokenizer::tokens_for_chat`] renders chat messages and tokenizes the result.
//!
//! The index compares cachepick's tokens only with cachepick's own tokens, never with the engine's, so
//! what routing needs first is consistency: equal prompt prefixes give equal token prefixes. Fidelity to
//! the engine matters second (block counts and capacities are in engine tokens), and where the two pull
//! apart below, consistency wins.
//!
//! The backends (tiktoken, Hugging Face, bytes) and the chat rendering are documented in
//! `cachepick-tokenizer`; this module adds the segments and their cache.
//!
//! # Segments and the segment cache
//! A chat is tokenized in segments, each looked up in a bounded per-pool LRU keyed by a hash of
//! (tokenizer, mode, segment text) before it is tokenized ([`PoolTokenizer::cache_stats`] counts hits
//! and misses). A conversation's next request repeats all of its earlier segments, so only the new turn
//! is tokenized. In the fixed format each block above is a segment. With a template, the chat is first
//! rendered with a sentinel in place of each message's content; the output is split at the sentinels
//! into template text and contents, and each is a segment. A template that drops, repeats or reorders
//! messages leaves the sentinels out of order; such a chat is rendered with its contents and tokenized
//! whole, as one segment. A text prompt is one segment.
//!
//! ## Where segment-wise tokens differ from whole-text tokens
//! Tokenizers split text into pre-tokens (by a regex) and merge only within each. Tokenizing segment by
//! segment also ends a pre-token at every segment boundary, so the tokens differ from the whole text's
//! where the whole text has a pre-token across a boundary:
//! - Punctuation meeting punctuation: content ending in `.` followed by template text `<|im_end|>` that
//!   the tokenizer does not know as a special token (ChatML under tiktoken): the whole text has `.<|` as
//!   one pre-token, the segments `.` and `<|`.
//! - Runs of whitespace: GPT-2-style patterns (`r50k_base`, `p50k_base`, GPT-2 byte-level BPE) take a
//!   whitespace run at the end of a segment as one pre-token, but in the whole text, before a non-space,
//!   leave its last character to the next pre-token: a message ending in `\n` ends its fixed-format
//!   segment in `\n\n` (one token) where the whole text has `\n`, `\n`.
//!
//! and where a tokenizer treats the start of a text specially, or a segment is not what the engine renders:
//! - Leading-space markers: SentencePiece-style tokenizers (Metaspace with a prepend scheme, as in
//!   Llama 2 and Mistral) mark the start of every encoded text as a word start, so each segment gains
//!   one that the whole text does not have. Byte-level tokenizers without `add_prefix_space`
//!   (Llama 3, Qwen, GPT-style) do not.
//! - Template transformations: the template sees a sentinel, not the content, so a template that trims,
//!   splits or escapes a content (`| trim`, `.split('</think>')`, `| tojson`) is tokenized as if it had
//!   passed the content through unchanged.
//! - `bytes` pads each segment, not the whole text, to a multiple of 4 bytes.
//!
//! Special tokens the tokenizer knows (Hugging Face added tokens, tiktoken's specials) are cut out before
//! pre-tokenization, so a boundary beside one is exact; and under `o200k_base` and `cl100k_base` a
//! pre-token never continues past a newline into a non-space, so the fixed format, whose segments end in
//! `\n` and start with `<|`, tokenizes exactly as the whole text. Measured in the tests: ordinary chats in
//! the fixed format under `o200k_base` and `cl100k_base`, and through a ChatML template whose markers are
//! special tokens of a byte-level BPE, equal their whole-text tokens; ChatML under tiktoken, a message
//! ending in a newline under `r50k_base`/`p50k_base`, and segment starts under Metaspace do not. Where a
//! difference occurs it is confined to the boundary: every token before the two segments that meet there
//! is the same, and so is every token after them. Either way it is the same for every request that shares
//! the segments, which is what prefix matching needs.
// A prompt's tokens must not depend on when they are counted: no clock reads here (clippy.toml).
#![deny(clippy::disallowed_methods)]

mod cache;
#[cfg(test)]
mod tests;

use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::Arc;

pub use cache::CacheStats;
use cache::SegmentCache;
pub use cachepick_tokenizer::{
    Chat, ChatTurn, MAX_PIECE_BYTES, Mode, Stop, TokenizeError, Tokenizer,
};

use crate::config::{PoolConfig, TokenizerConfig};

/// A pool's tokenizer, chat template and segment cache; built once, shared by all its requests.
pub struct PoolTokenizer {
    tokenizer: Tokenizer,
    cache: SegmentCache,
}

impl PoolTokenizer {
    /// Loads the pool's tokenizer and compiles its chat template. Errors name the file and the cause.
    pub fn new(config: &PoolConfig) -> Result<PoolTokenizer, TokenizeError> {
        PoolTokenizer::build(
            &config.tokenizer,
            config.chat_template.as_deref(),
            config.segment_cache_entries,
        )
    }

    /// [`new`](Self::new) from the three settings it reads, for callers without a whole pool.
    pub fn build(
        tokenizer: &TokenizerConfig,
        chat_template: Option<&Path>,
        segment_cache_entries: NonZeroUsize,
    ) -> Result<PoolTokenizer, TokenizeError> {
        let tokenizer = Tokenizer::load(tokenizer, chat_template)?;
        let cache = SegmentCache::new(segment_cache_entries.get(), tokenizer.identity());
        Ok(PoolTokenizer { tokenizer, cache })
    }

    /// The tokenizer and template under the cache.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokens of a text prompt (`/v1/completions`, `/generate`), cached whole as one segment.
    pub fn tokens_for_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokens_for_text_within(text, &Stop::never())
    }

    /// [`tokens_for_text`](Self::tokens_for_text), stopped by `stop` (see [`Tokenizer::encode_within`]).
    pub fn tokens_for_text_within(
        &self,
        text: &str,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = Vec::new();
        self.push_segment(&mut tokens, Mode::Prompt, &[text], stop)?;
        Ok(tokens)
    }

    /// The tokens of a chat: its messages rendered with the generation prompt, and its `tools` (the
    /// request's raw JSON) when it has them. Only segments missing from the cache are tokenized.
    pub fn tokens_for_chat(&self, chat: Chat<'_>) -> Result<Vec<u32>, TokenizeError> {
        self.tokens_for_chat_within(chat, &Stop::never())
    }

    /// [`tokens_for_chat`](Self::tokens_for_chat), stopped by `stop`, which is also asked between
    /// segments.
    pub fn tokens_for_chat_within(
        &self,
        chat: Chat<'_>,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = Vec::new();
        self.tokenizer.for_each_segment(chat, |segment| {
            self.push_segment(&mut tokens, Mode::Segment, segment, stop)
        })?;
        Ok(tokens)
    }

    /// The text [`tokens_for_chat`](Self::tokens_for_chat) tokenizes, its segments joined.
    pub fn render_chat(&self, chat: Chat<'_>) -> Result<String, TokenizeError> {
        self.tokenizer.render_chat(chat)
    }

    /// The chat's tokens as the engine itself computes them: the chat rendered whole and tokenized in
    /// one pass, adding no special tokens (the template writes them), bypassing the segment cache (see
    /// [`Tokenizer::encode_whole`]). Segments can differ from the whole at their boundaries; block hashes
    /// that must equal the engine's (the events index) are taken from these.
    pub fn engine_tokens(&self, chat: Chat<'_>, stop: &Stop) -> Result<Vec<u32>, TokenizeError> {
        let text = self.tokenizer.render_chat(chat)?;
        self.tokenizer.encode_whole_within(&text, false, stop)
    }

    /// The most memory tokenizing a prompt of `bytes` takes, for charging it to the body budget
    /// ([`Tokenizer::memory_per_byte`]).
    pub fn memory_for(&self, bytes: usize) -> usize {
        bytes.saturating_mul(self.tokenizer.memory_per_byte())
    }

    /// Segment cache hits and misses since the tokenizer was built.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Appends the tokens of the segment whose text is `pieces` joined, from the cache when it holds them.
    fn push_segment(
        &self,
        tokens: &mut Vec<u32>,
        mode: Mode,
        pieces: &[&str],
        stop: &Stop,
    ) -> Result<(), TokenizeError> {
        let key = self.cache.key(mode, pieces);
        let segment = match self.cache.get(key, pieces) {
            Some(cached) => cached,
            None => {
                let joined;
                let text = match pieces {
                    [one] => *one,
                    _ => {
                        joined = pieces.concat();
                        joined.as_str()
                    }
                };
                let fresh: Arc<[u32]> = self.tokenizer.encode_within(text, mode, stop)?.into();
                self.cache.insert(key, text, Arc::clone(&fresh));
                fresh
            }
        };
        tokens.extend_from_slice(&segment);
        Ok(())
    }
}

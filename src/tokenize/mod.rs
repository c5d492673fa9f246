//! Prompt → tokens: each pool's tokenizer, chat rendering, and the segment cache.
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
//! # Backends
//! - **tiktoken**: a bundled encoding, loaded once per process per encoding (about 130 ms for
//!   `o200k_base`) and shared by every pool that names it. Text is encoded with the encoding's special
//!   tokens recognised anywhere (`encode` with every special token allowed, i.e.
//!   `encode_with_special_tokens` without rebuilding the set per call): engines tokenize the rendered
//!   prompt with special-token matching on, so `<|endoftext|>` in a template or a prompt is one token.
//! - **huggingface**: a local `tokenizer.json`, with any truncation or padding it carries switched off.
//!   Chat segments are encoded with `add_special_tokens=false`, because the chat template renders the
//!   special tokens itself (a BOS would otherwise appear twice), which is what vLLM does for chat
//!   completions. Text prompts use `add_special_tokens=true`, as vLLM does for completions, so a
//!   Llama-style post-processor prepends its BOS. Added tokens in the text are matched in both.
//! - **bytes**: each 4-byte chunk of the UTF-8 text packed into a little-endian `u32`, the last chunk
//!   zero-padded. No vocabulary; deterministic; about one pseudo-token per real token for English.
//!
//! # Chat rendering
//! With a chat template (`chat_template` in the pool's config: a Jinja file, or a Hugging Face
//! `tokenizer_config.json` whose `chat_template` is a string or a list of `{name, template}`), it is
//! rendered the way transformers renders it for vLLM and SGLang: minijinja with `trim_blocks` and
//! `lstrip_blocks`, Python string methods, and `raise_exception`; the context holds
//! - `messages`: `[{role, content}]`, each content its text parts joined with `"\n"` (vLLM's rendering
//!   of text-only content lists into the "string" content format),
//! - `tools`: the request's `tools` parsed as JSON, or none (the `tool_use` template of a named list is
//!   chosen when there are tools),
//! - `add_generation_prompt`: true,
//! - `bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token` where
//!   the tokenizer config defines them (a Jinja file takes them from a `tokenizer_config.json` beside it).
//!
//! Not reproduced: `strftime_now` (date-stamping templates fall back to their built-in date, which also
//! keeps tokens stable across midnight), `{% generation %}` and loop controls (such templates fail to
//! load), and the exact JSON of tools: minijinja's `tojson` sorts object keys and escapes `<>&'`, where
//! the engine keeps the request's key order and escapes nothing.
//!
//! Without a template the chat is rendered in a fixed format (content parts joined with `"\n"`):
//! ```text
//! <|tools|>\n{tools JSON as the request sent it}\n     only when the request has tools
//! <|{role}|>\n{content}\n                             one per message, in order
//! <|assistant|>\n                                     the generation prompt
//! ```
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
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod backend;
mod cache;
mod template;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::error::Error;
use std::io;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use backend::Backend;
pub use cache::CacheStats;
use cache::SegmentCache;
use template::{ChatTemplate, joined_parts, split_skeleton};

use crate::config::{PoolConfig, TokenizerConfig};

/// One chat message as the request carries it: its role and its text parts, in order.
#[derive(Clone, Copy, Debug)]
pub struct ChatTurn<'a> {
    pub role: &'a str,
    pub parts: &'a [Cow<'a, str>],
}

/// Why a pool's tokenizer could not be built (at start-up: the first five), or a prompt not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load the bundled tiktoken encoding {encoding}: {source}")]
    Encoding {
        encoding: &'static str,
        source: Box<dyn Error + Send + Sync>,
    },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{} is not a usable tokenizer.json: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        source: Box<dyn Error + Send + Sync>,
    },
    /// A `tokenizer_config.json` that is not JSON, or holds no usable `chat_template`.
    #[error("chat template config {}: {reason}", path.display())]
    TemplateConfig { path: PathBuf, reason: String },
    /// A template that does not compile.
    #[error("chat template {}: {source}", path.display())]
    Template {
        path: PathBuf,
        source: minijinja::Error,
    },
    /// The template failed on this chat: mostly the request's fault (`raise_exception` on an unknown
    /// role, say), but also a template that calls what minijinja lacks.
    #[error("chat template {} failed to render this chat: {source}", path.display())]
    Render {
        path: PathBuf,
        source: minijinja::Error,
    },
    /// The request's fault.
    #[error("the request's tools are not valid JSON: {0}")]
    Tools(#[source] serde_json::Error),
    #[error("tokenizing failed: {0}")]
    Encode(#[source] Box<dyn Error + Send + Sync>),
}

/// How a text is encoded. Part of the cache key, because it changes the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Mode {
    /// A segment of a rendered chat: the template has rendered the special tokens it wants.
    Segment = 0,
    /// A whole text prompt: the tokenizer adds its own special tokens, as engines do for completions.
    Prompt = 1,
}

/// A pool's tokenizer, chat template and segment cache; built once, shared by all its requests.
pub struct PoolTokenizer {
    backend: Backend,
    template: Option<ChatTemplate>,
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
        let (backend, identity) = Backend::load(tokenizer)?;
        let template = chat_template.map(ChatTemplate::load).transpose()?;
        Ok(PoolTokenizer {
            backend,
            template,
            cache: SegmentCache::new(segment_cache_entries.get(), identity),
        })
    }

    /// The tokens of a text prompt (`/v1/completions`, `/generate`), cached whole as one segment.
    pub fn tokens_for_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = Vec::new();
        self.push_segment(&mut tokens, Mode::Prompt, &[text])?;
        Ok(tokens)
    }

    /// The tokens of a chat: its messages rendered with the generation prompt, and its `tools` (the
    /// request's raw JSON) when it has them. Only segments missing from the cache are tokenized.
    pub fn tokens_for_chat(
        &self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = Vec::new();
        self.for_each_segment(turns, tools, |segment| {
            self.push_segment(&mut tokens, Mode::Segment, segment)
        })?;
        Ok(tokens)
    }

    /// The text [`tokens_for_chat`](Self::tokens_for_chat) tokenizes, its segments joined.
    pub fn render_chat(
        &self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
    ) -> Result<String, TokenizeError> {
        let mut text = String::new();
        self.for_each_segment(turns, tools, |segment| {
            segment.iter().for_each(|piece| text.push_str(piece));
            Ok(())
        })?;
        Ok(text)
    }

    /// The tokens of a whole text in one pass, bypassing the segment cache, as an engine tokenizes its
    /// prompt: `add_special` for a raw completion prompt, not for a rendered chat (whose template wrote
    /// its own special tokens). The fleet simulator tokenizes this way.
    pub fn encode_whole(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        let mode = if add_special {
            Mode::Prompt
        } else {
            Mode::Segment
        };
        self.backend.encode(text, mode)
    }

    /// Segment cache hits and misses since the tokenizer was built.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Calls `each` with every segment of the rendered chat in order, as pieces to be joined.
    fn for_each_segment(
        &self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
        mut each: impl FnMut(&[&str]) -> Result<(), TokenizeError>,
    ) -> Result<(), TokenizeError> {
        let Some(template) = &self.template else {
            if let Some(tools) = tools {
                each(&["<|tools|>\n", tools, "\n"])?;
            }
            for turn in turns {
                let mut segment = vec!["<|", turn.role, "|>\n"];
                segment.extend(joined_parts(turn));
                segment.push("\n");
                each(&segment)?;
            }
            return each(&["<|assistant|>\n"]);
        };
        let tools = template::tools_value(tools)?;
        let skeleton = template.render_skeleton(turns, &tools)?;
        match split_skeleton(&skeleton, turns) {
            Some(segments) => segments.iter().try_for_each(|segment| each(segment)),
            None => {
                let whole = template.render_whole(turns, &tools)?;
                each(&[&whole])
            }
        }
    }

    /// Appends the tokens of the segment whose text is `pieces` joined, from the cache when it holds them.
    fn push_segment(
        &self,
        tokens: &mut Vec<u32>,
        mode: Mode,
        pieces: &[&str],
    ) -> Result<(), TokenizeError> {
        let key = self.cache.key(mode, pieces);
        let segment = match self.cache.get(key) {
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
                let fresh: Arc<[u32]> = self.backend.encode(text, mode)?.into();
                self.cache.insert(key, Arc::clone(&fresh));
                fresh
            }
        };
        tokens.extend_from_slice(&segment);
        Ok(())
    }
}

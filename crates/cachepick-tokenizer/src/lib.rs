//! The model's tokenizer and chat template, as both the picker and the fleet simulator need them.
//!
//! A real engine and the router in front of it share one thing: the model's tokenizer. So do cachepick and
//! its simulator, through this crate, and nothing else: the simulator parses bodies, hashes blocks and
//! keeps its cache with code of its own, so the two cannot agree by construction. The picker adds its
//! segment cache on top (`cachepick::tokenize`); the simulator tokenizes each prompt whole, as an engine
//! does ([`Tokenizer::encode_whole`]).
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
//! Every backend merges no pre-token longer than [`MAX_PIECE_BYTES`] whole and asks a [`Stop`] between
//! bounded chunks of its work ([`Tokenizer::encode_within`]); text without such a piece tokenizes exactly
//! as the library does. The `bound` module documents the cut, what it changes, and why.
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
mod backend;
mod bound;
mod config;
mod hf;
mod template;
mod tiktoken;

use std::borrow::Cow;
use std::error::Error;
use std::io;
use std::path::{Path, PathBuf};

use backend::Backend;
pub use bound::{MAX_PIECE_BYTES, Stop};
pub use config::{TiktokenEncoding, TokenizerConfig, decode_chat_template, decode_tokenizer};
use template::{ChatTemplate, joined_parts, split_skeleton};

/// One chat message as the request carries it: its role and its text parts, in order.
#[derive(Clone, Copy, Debug)]
pub struct ChatTurn<'a> {
    pub role: &'a str,
    pub parts: &'a [Cow<'a, str>],
}

/// A chat as the engine renders it: its turns and, when the request has them, its `tools` (the
/// request's raw JSON).
#[derive(Clone, Copy, Debug)]
pub struct Chat<'a> {
    pub turns: &'a [ChatTurn<'a>],
    pub tools: Option<&'a str>,
}

impl<'a> Chat<'a> {
    /// A chat of these turns and no tools.
    pub fn new(turns: &'a [ChatTurn<'a>]) -> Chat<'a> {
        Chat { turns, tools: None }
    }

    /// The same chat with `tools`.
    pub fn with_tools(self, tools: Option<&'a str>) -> Chat<'a> {
        Chat { tools, ..self }
    }
}

/// Why a tokenizer could not be built (at start-up: the first five), or a prompt not tokenized.
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
    /// The [`Stop`] the encode was given stopped it: the decision's deadline passed, or its request
    /// went away.
    #[error(
        "tokenizing was stopped before the end: the decision's deadline passed or its request went away"
    )]
    Interrupted,
}

/// How a text is encoded. A cache of tokens must key on it, because it changes the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// A segment of a rendered chat: the template has rendered the special tokens it wants.
    Segment = 0,
    /// A whole text prompt: the tokenizer adds its own special tokens, as engines do for completions.
    Prompt = 1,
}

/// A model's tokenizer and chat template, loaded once and shared.
pub struct Tokenizer {
    backend: Backend,
    template: Option<ChatTemplate>,
    /// Distinguishes tokenizers whose tokens differ, for keying caches of their output.
    identity: u64,
}

impl Tokenizer {
    /// Loads the tokenizer and compiles the chat template. Errors name the file and the cause.
    pub fn load(
        tokenizer: &TokenizerConfig,
        chat_template: Option<&Path>,
    ) -> Result<Tokenizer, TokenizeError> {
        let (backend, identity) = Backend::load(tokenizer)?;
        let template = chat_template.map(ChatTemplate::load).transpose()?;
        Ok(Tokenizer {
            backend,
            template,
            identity,
        })
    }

    /// Equal for tokenizers that give the same tokens, different (up to a 64-bit hash) otherwise.
    pub fn identity(&self) -> u64 {
        self.identity
    }

    /// The tokens of `text` encoded in `mode`. No pre-token longer than [`MAX_PIECE_BYTES`] is merged
    /// whole (`bound` in the source documents the cut and what it changes).
    pub fn encode(&self, text: &str, mode: Mode) -> Result<Vec<u32>, TokenizeError> {
        self.backend.encode(text, mode, &Stop::never())
    }

    /// [`encode`](Self::encode), asking `stop` between bounded chunks of the work:
    /// [`TokenizeError::Interrupted`] once it says stop.
    pub fn encode_within(
        &self,
        text: &str,
        mode: Mode,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.backend.encode(text, mode, stop)
    }

    /// The most memory, in bytes per byte of text, that encoding a text takes at its peak (the output
    /// and the backend's working state, with the prompt's copies around it), measured on the worst
    /// texts found (one token per byte) with headroom. Callers charge it to a budget before encoding.
    pub fn memory_per_byte(&self) -> usize {
        self.backend.memory_per_byte()
    }

    /// The text of `tokens`, for reading what was tokenized (tests, explanations).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, TokenizeError> {
        self.backend.decode(tokens)
    }

    /// The tokens of a whole text in one pass, as an engine tokenizes its prompt: `add_special` for a
    /// raw completion prompt, not for a rendered chat (whose template wrote its own special tokens).
    pub fn encode_whole(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode_whole_within(text, add_special, &Stop::never())
    }

    /// [`encode_whole`](Self::encode_whole), asking `stop` as [`encode_within`](Self::encode_within)
    /// does.
    pub fn encode_whole_within(
        &self,
        text: &str,
        add_special: bool,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mode = if add_special {
            Mode::Prompt
        } else {
            Mode::Segment
        };
        self.backend.encode(text, mode, stop)
    }

    /// The chat's text as the engine renders it: its messages with the generation prompt, and its
    /// tools when it has them.
    pub fn render_chat(&self, chat: Chat<'_>) -> Result<String, TokenizeError> {
        let mut text = String::new();
        self.for_each_segment(chat, |segment| {
            segment.iter().for_each(|piece| text.push_str(piece));
            Ok(())
        })?;
        Ok(text)
    }

    /// Calls `each` with every segment of the rendered chat in order, as pieces to be joined; the
    /// segments joined are [`render_chat`](Self::render_chat)'s text. `cachepick::tokenize` documents
    /// where segments fall and why.
    pub fn for_each_segment(
        &self,
        Chat { turns, tools }: Chat<'_>,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tokenizer_naming_an_encoding_shares_one_copy_of_it() {
        let config = TokenizerConfig::Tiktoken {
            encoding: TiktokenEncoding::O200kBase,
        };
        let first = Tokenizer::load(&config, None).unwrap();
        let second = Tokenizer::load(&config, None).unwrap();
        assert!(first.backend.shares_tables_with(&second.backend));
        assert_eq!(first.identity(), second.identity());
        let other = Tokenizer::load(&TokenizerConfig::Bytes, None).unwrap();
        assert_ne!(first.identity(), other.identity());
    }
}

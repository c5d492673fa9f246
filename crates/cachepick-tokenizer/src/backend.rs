//! The three ways a pool turns text into token ids: a bundled tiktoken encoding, a local Hugging Face
//! `tokenizer.json`, or four bytes per pseudo-token.

use std::error::Error;
use std::path::Path;
use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;
use xxhash_rust::xxh3::xxh3_64;

use cachepick_decode::file::read_regular;

use crate::bound::{Current, Interrupted, Stop};
use crate::config::{TiktokenEncoding, TokenizerConfig};
use crate::hf::HfTokenizer;
use crate::tiktoken::Tiktoken;
use crate::{Mode, TokenizeError};

/// Bytes packed into one pseudo-token by the `bytes` backend.
const BYTES_PER_TOKEN: usize = 4;

/// Peak memory per byte of text while encoding, by backend (see `Tokenizer::memory_per_byte`).
const TIKTOKEN_MEMORY_PER_BYTE: usize = 16;
const HUGGING_FACE_MEMORY_PER_BYTE: usize = 64;
const BYTES_MEMORY_PER_BYTE: usize = 4;

pub(crate) enum Backend {
    Tiktoken(Box<Tiktoken>),
    HuggingFace(Box<HfTokenizer>),
    Bytes,
}

/// The largest `tokenizer.json` read: the largest published ones (Gemma's) hold about 35 MB.
pub const TOKENIZER_FILE_LIMIT: u64 = 128 << 20;

impl Backend {
    /// Loads the backend and returns it with a hash of its identity: the encoding's name, or the bytes
    /// of the `tokenizer.json`.
    pub(crate) fn load(config: &TokenizerConfig) -> Result<(Backend, u64), TokenizeError> {
        match config {
            TokenizerConfig::Tiktoken { encoding } => {
                let bpe = shared_encoding(*encoding)?;
                let identity = xxh3_64(format!("tiktoken:{}", encoding.as_str()).as_bytes());
                let tiktoken = Tiktoken::new(bpe, *encoding)?;
                Ok((Backend::Tiktoken(Box::new(tiktoken)), identity))
            }
            TokenizerConfig::HuggingFace { path } => {
                let bytes = read_regular(path, TOKENIZER_FILE_LIMIT).map_err(|source| {
                    TokenizeError::Read {
                        path: path.clone(),
                        source,
                    }
                })?;
                let tokenizer = hugging_face(&bytes, path)?;
                Ok((Backend::HuggingFace(Box::new(tokenizer)), xxh3_64(&bytes)))
            }
            TokenizerConfig::Bytes => Ok((Backend::Bytes, xxh3_64(b"bytes"))),
        }
    }

    /// The tokens of `text`, with no piece longer than [`MAX_PIECE_BYTES`](crate::MAX_PIECE_BYTES)
    /// merged whole, unless `stop` stops it first.
    pub(crate) fn encode(
        &self,
        text: &str,
        mode: Mode,
        stop: &Stop,
    ) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Backend::Tiktoken(tiktoken) => tiktoken.encode(text, mode, stop),
            Backend::HuggingFace(tokenizer) => {
                if stop.stopped() {
                    return Err(TokenizeError::Interrupted);
                }
                let _current = Current::set(stop);
                tokenizer
                    .encode_fast(text, mode == Mode::Prompt)
                    .map(|encoding| encoding.get_ids().to_vec())
                    .map_err(|source| {
                        if source.downcast_ref::<Interrupted>().is_some() {
                            TokenizeError::Interrupted
                        } else {
                            TokenizeError::Encode(source)
                        }
                    })
            }
            Backend::Bytes => Ok(pack_bytes(text)),
        }
    }

    /// See [`Tokenizer::memory_per_byte`](crate::Tokenizer::memory_per_byte).
    pub(crate) fn memory_per_byte(&self) -> usize {
        match self {
            // A token of at most four bytes per byte, in a vector that may have doubled.
            Backend::Tiktoken(_) => TIKTOKEN_MEMORY_PER_BYTE,
            // The library's encoding keeps each token's string, offsets and masks beside its id.
            Backend::HuggingFace(_) => HUGGING_FACE_MEMORY_PER_BYTE,
            Backend::Bytes => BYTES_MEMORY_PER_BYTE,
        }
    }

    /// The text of `tokens`; the `bytes` backend drops its zero padding.
    pub(crate) fn decode(&self, tokens: &[u32]) -> Result<String, TokenizeError> {
        match self {
            Backend::Tiktoken(tiktoken) => tiktoken
                .bpe
                .decode(tokens)
                .map_err(|source| TokenizeError::Encode(source.into())),
            Backend::HuggingFace(tokenizer) => tokenizer
                .decode(tokens, false)
                .map_err(TokenizeError::Encode),
            Backend::Bytes => {
                let bytes: Vec<u8> = tokens
                    .iter()
                    .flat_map(|token| token.to_le_bytes())
                    .filter(|byte| *byte != 0)
                    .collect();
                String::from_utf8(bytes).map_err(|source| TokenizeError::Encode(source.into()))
            }
        }
    }

    /// Whether two backends share one loaded encoding (tiktoken encodings load once per process).
    #[cfg(test)]
    pub(crate) fn shares_tables_with(&self, other: &Backend) -> bool {
        match (self, other) {
            (Backend::Tiktoken(a), Backend::Tiktoken(b)) => std::ptr::eq(a.bpe, b.bpe),
            _ => false,
        }
    }
}

/// The encoding, loaded on first use and shared by every pool in the process: loading `o200k_base`
/// takes about 130 ms and its tables hold tens of megabytes.
pub(crate) fn shared_encoding(
    encoding: TiktokenEncoding,
) -> Result<&'static CoreBPE, TokenizeError> {
    static O200K_BASE: OnceLock<CoreBPE> = OnceLock::new();
    static CL100K_BASE: OnceLock<CoreBPE> = OnceLock::new();
    static P50K_BASE: OnceLock<CoreBPE> = OnceLock::new();
    static R50K_BASE: OnceLock<CoreBPE> = OnceLock::new();
    match encoding {
        TiktokenEncoding::O200kBase => load_once(&O200K_BASE, encoding, tiktoken_rs::o200k_base),
        TiktokenEncoding::Cl100kBase => load_once(&CL100K_BASE, encoding, tiktoken_rs::cl100k_base),
        TiktokenEncoding::P50kBase => load_once(&P50K_BASE, encoding, tiktoken_rs::p50k_base),
        TiktokenEncoding::R50kBase => load_once(&R50K_BASE, encoding, tiktoken_rs::r50k_base),
    }
}

fn load_once<E>(
    cell: &'static OnceLock<CoreBPE>,
    encoding: TiktokenEncoding,
    load: fn() -> Result<CoreBPE, E>,
) -> Result<&'static CoreBPE, TokenizeError>
where
    E: Into<Box<dyn Error + Send + Sync>>,
{
    if let Some(bpe) = cell.get() {
        return Ok(bpe);
    }
    // Pools are built one after another at start-up, so two threads loading at once (the loser's copy
    // is dropped) costs a little time and nothing else.
    let bpe = load().map_err(|source| TokenizeError::Encoding {
        encoding: encoding.as_str(),
        source: source.into(),
    })?;
    Ok(cell.get_or_init(|| bpe))
}

fn hugging_face(bytes: &[u8], path: &Path) -> Result<HfTokenizer, TokenizeError> {
    let invalid = |source| TokenizeError::Tokenizer {
        path: path.to_path_buf(),
        source,
    };
    let mut tokenizer = HfTokenizer::from_bytes(bytes).map_err(invalid)?;
    // Some tokenizer.json files carry the truncation or padding of a training run; the engine applies
    // neither to a prompt, and a truncated prompt would hide its tail from the prefix index.
    tokenizer.with_truncation(None).map_err(invalid)?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// Packs each 4-byte chunk of the UTF-8 text into a little-endian `u32`, zero-padding the last chunk.
fn pack_bytes(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(BYTES_PER_TOKEN)
        .map(|chunk| {
            let mut word = [0u8; BYTES_PER_TOKEN];
            word.iter_mut()
                .zip(chunk)
                .for_each(|(to, from)| *to = *from);
            u32::from_le_bytes(word)
        })
        .collect()
}

//! Which tokenizer a pool (or a simulated fleet) uses, and how its `tokenizer:` key is decoded, so that
//! both files read it the same way.

use std::path::PathBuf;

use cachepick_decode::{Decode, Map, Node, Phase, Place, Res};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerConfig {
    /// A bundled tiktoken encoding; needs no files.
    Tiktoken { encoding: TiktokenEncoding },
    /// A local `tokenizer.json`.
    HuggingFace { path: PathBuf },
    /// Four bytes per pseudo-token: no tokenizer at all, for when tokenizing costs too much.
    Bytes,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig::Tiktoken {
            encoding: TiktokenEncoding::O200kBase,
        }
    }
}

impl TokenizerConfig {
    /// A short name for reports: the encoding, the file, or `bytes`.
    pub fn label(&self) -> String {
        match self {
            TokenizerConfig::Bytes => "bytes".to_owned(),
            TokenizerConfig::Tiktoken { encoding } => encoding.as_str().to_owned(),
            TokenizerConfig::HuggingFace { path } => path.display().to_string(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TiktokenEncoding {
    O200kBase,
    Cl100kBase,
    P50kBase,
    R50kBase,
}

impl TiktokenEncoding {
    pub const ALL: [TiktokenEncoding; 4] = [
        TiktokenEncoding::O200kBase,
        TiktokenEncoding::Cl100kBase,
        TiktokenEncoding::P50kBase,
        TiktokenEncoding::R50kBase,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TiktokenEncoding::O200kBase => "o200k_base",
            TiktokenEncoding::Cl100kBase => "cl100k_base",
            TiktokenEncoding::P50kBase => "p50k_base",
            TiktokenEncoding::R50kBase => "r50k_base",
        }
    }
}

/// The `tokenizer:` key of `map` (the default tokenizer when it is absent): `{kind: tiktoken,
/// encoding}`, `{kind: huggingface, path}` or `{kind: bytes}`, each kind accepting only its own keys.
pub fn decode_tokenizer<D: Decode>(d: &mut D, map: &Map) -> Res<TokenizerConfig> {
    match map.get("tokenizer") {
        Some((node, at)) => tokenizer(d, node, &at),
        None => Ok(TokenizerConfig::default()),
    }
}

/// The `chat_template:` key of `map`, a path kept as written: whether the file exists and parses is
/// judged where it is loaded.
pub fn decode_chat_template<D: Decode>(d: &mut D, map: &Map) -> Res<Option<PathBuf>> {
    d.opt(map, "chat_template", D::string)
        .map(|path| path.map(|path| PathBuf::from(path.value)))
}

fn tokenizer<D: Decode>(d: &mut D, node: &Node, at: &Place) -> Res<TokenizerConfig> {
    let map = d.any_mapping(node, at)?;
    if map.get("kind").is_none() {
        // Without a kind, a misspelt key is the likelier mistake: name it against every kind's keys.
        d.known_keys(&map, &["kind", "encoding", "path"]);
    }
    let kind = d.required(&map, "kind", D::string)?;
    match kind.value.as_str() {
        "tiktoken" => {
            d.known_keys(&map, &["kind", "encoding"]);
            let encoding = d.opt(&map, "encoding", |d, node, at| {
                d.keyword(node, at, &TiktokenEncoding::ALL, TiktokenEncoding::as_str)
            })?;
            Ok(TokenizerConfig::Tiktoken {
                encoding: encoding.map_or(TiktokenEncoding::O200kBase, |encoding| encoding.value),
            })
        }
        "huggingface" => {
            d.known_keys(&map, &["kind", "path"]);
            let path = d.required(&map, "path", D::string)?;
            Ok(TokenizerConfig::HuggingFace {
                path: path.value.into(),
            })
        }
        "bytes" => {
            d.known_keys(&map, &["kind"]);
            Ok(TokenizerConfig::Bytes)
        }
        other => {
            let message = format!("expected one of: tiktoken, huggingface, bytes; got `{other}`");
            Err(d.report(Phase::Value, kind.at, message))
        }
    }
}

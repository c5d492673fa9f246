//! A Hugging Face `tokenizer.json` whose model merges no pre-token longer than
//! [`MAX_PIECE_BYTES`](crate::bound::MAX_PIECE_BYTES) whole, and stops when asked (see
//! [`bound`](crate::bound)).
//!
//! The library calls the model once per pre-token, after its normalizer and pre-tokenizer; the wrapper
//! is the model, loaded from the same JSON, so everything else of the pipeline (added tokens,
//! normalizer, pre-tokenizer, post-processor) is the library's own.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer};
use tokenizers::{
    DecoderWrapper, Model, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Token, TokenizerImpl,
};

use crate::bound::{self, MAX_PIECE_BYTES};

/// The tokenizer the `huggingface` backend runs: the library's, around [`Bounded`].
pub(crate) type HfTokenizer = TokenizerImpl<
    Bounded,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// The tokenizer.json's model, cutting over-long pre-tokens and counting work for the stop.
pub(crate) struct Bounded(ModelWrapper);

impl<'de> Deserialize<'de> for Bounded {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ModelWrapper::deserialize(deserializer).map(Bounded)
    }
}

impl Model for Bounded {
    type Trainer = <ModelWrapper as Model>::Trainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        if sequence.len() <= MAX_PIECE_BYTES {
            bound::spend(sequence.len())?;
            return self.0.tokenize(sequence);
        }
        let mut tokens = Vec::new();
        for (start, end) in bound::chunks(sequence, MAX_PIECE_BYTES) {
            let chunk = sequence.get(start..end).unwrap_or_default();
            bound::spend(chunk.len())?;
            tokens.extend(self.0.tokenize(chunk)?.into_iter().map(|mut token| {
                token.offsets = (token.offsets.0 + start, token.offsets.1 + start);
                token
            }));
        }
        Ok(tokens)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.0.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.0.id_to_token(id)
    }

    fn get_vocab(&self) -> std::collections::HashMap<String, u32> {
        self.0.get_vocab()
    }

    fn get_vocab_size(&self) -> usize {
        self.0.get_vocab_size()
    }

    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        self.0.save(folder, prefix)
    }

    fn get_trainer(&self) -> Self::Trainer {
        self.0.get_trainer()
    }
}

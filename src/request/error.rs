//! Why a request body cannot be routed; each error names its [`RefusalReason`] (status and label).

use crate::protocol::RefusalReason;

/// A body cachepick refuses, or a model no pool serves. Messages name the member at fault by its path in
/// the body (`messages[2].content`) and, for a wrong type, what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the request body has {size} bytes, more than max_body_bytes ({limit})")]
    TooLarge { size: usize, limit: usize },
    /// `offset` is the first byte that is not part of a valid UTF-8 sequence.
    #[error("the request body is not UTF-8: invalid byte at offset {offset}")]
    NotUtf8 { offset: usize },
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(serde_json::Error),
    #[error("the request body nests arrays and objects more than {limit} deep")]
    TooDeep { limit: usize },
    /// `field` is already formatted: a member path in backticks, or "the request body".
    #[error("{field} must be {expected}, got {got}")]
    WrongType {
        field: String,
        expected: &'static str,
        got: &'static str,
    },
    /// The message says what is missing and, where it depends on the API, for which one.
    #[error("{0}")]
    MissingField(String),
    #[error("the prompt is empty: `{field}` holds no text or token ids")]
    EmptyPrompt { field: &'static str },
    #[error("the request names no model, and no pool is the default (`*`)")]
    MissingModel,
    /// `model` is cut to [`BodyError::MODEL_ECHO_CHARS`] characters: it comes from the client.
    #[error("no pool serves model `{model}`, and no pool is the default (`*`)")]
    UnknownModel { model: String },
}

impl BodyError {
    /// An unknown model is echoed in the message, but no more of it than a real model name needs.
    pub const MODEL_ECHO_CHARS: usize = 256;

    /// Why the request is refused: the status and stable label it answers with.
    pub fn reason(&self) -> RefusalReason {
        match self {
            BodyError::TooLarge { .. } => RefusalReason::TooLarge,
            BodyError::NotUtf8 { .. } => RefusalReason::NotUtf8,
            BodyError::InvalidJson(_) => RefusalReason::InvalidJson,
            BodyError::TooDeep { .. } => RefusalReason::TooDeep,
            BodyError::WrongType { .. } => RefusalReason::WrongType,
            BodyError::MissingField(_) => RefusalReason::MissingField,
            BodyError::EmptyPrompt { .. } => RefusalReason::EmptyPrompt,
            BodyError::MissingModel => RefusalReason::MissingModel,
            BodyError::UnknownModel { .. } => RefusalReason::UnknownModel,
        }
    }

    pub(super) fn unknown_model(model: &str) -> Self {
        let end = model
            .char_indices()
            .nth(Self::MODEL_ECHO_CHARS)
            .map_or(model.len(), |(at, _)| at);
        BodyError::UnknownModel {
            model: model.get(..end).unwrap_or(model).to_owned(),
        }
    }
}

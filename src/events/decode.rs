//! Decoding the engines' msgpack `EventBatch` payloads. Written in full by the decoder task.

use thiserror::Error;

use super::EventBatch;

/// Why a payload is not an event batch.
#[derive(Debug, Error, PartialEq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
}

/// One live or replayed payload → its batch.
pub fn decode_batch(_payload: &[u8]) -> Result<EventBatch, DecodeError> {
    Err(DecodeError::Msgpack("not implemented yet".to_owned()))
}

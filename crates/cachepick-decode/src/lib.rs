//! Positioned YAML decoding that reports every problem at once.
//!
//! cachepick's configuration file and the fleet simulator's are both decoded with this crate: the YAML is
//! built into a tree that keeps the line of every node ([`tree`]), then each schema walks it with its own
//! decoder built on [`Decode`], reading every scalar as its key expects and recording each problem with
//! its YAML path and line (or the flag it came from) instead of stopping at the first. The result is the
//! validated value or [`ConfigError::Invalid`] listing every problem, in phase order.
//!
//! serde is not used because it stops at the first error and loses the lines; operators get every
//! problem of a file in one run.
#![forbid(unsafe_code)]

pub mod decoder;
pub mod duration;
pub mod file;
pub mod problem;
pub mod size;
pub mod tree;

use std::path::Path;

pub use decoder::{
    Decode, Field, Map, Val, at_least_one, at_least_one_u32, at_least_one_usize, blame, overridden,
    value_or, with_default,
};
pub use problem::{ConfigError, Origin, Phase, Problem, Problems, Reported, Res};
pub use tree::{Entry, Kind, Node, Place};

/// Decodes `source` with `schema`; `origin_name` names the source in the error (usually a file's path).
/// The value is returned only if the schema built it and no problem at all was recorded.
pub fn decode<T>(
    source: &str,
    origin_name: &str,
    schema: impl FnOnce(&Node, &mut Problems) -> Res<T>,
) -> Result<T, ConfigError> {
    let mut problems = Problems::default();
    let value = tree::parse(source, &mut problems).and_then(|root| schema(&root, &mut problems));
    match value {
        Ok(value) if problems.is_empty() => Ok(value),
        _ => Err(ConfigError::Invalid {
            file: origin_name.to_owned(),
            problems: problems.into_sorted(),
        }),
    }
}

/// Reads the file at `path` (a regular file of at most [`file::CONFIG_FILE_LIMIT`] bytes) and decodes
/// it with `schema`.
pub fn decode_file<T>(
    path: &Path,
    schema: impl FnOnce(&Node, &mut Problems) -> Res<T>,
) -> Result<T, ConfigError> {
    let source = file::read_regular_to_string(path, file::CONFIG_FILE_LIMIT).map_err(|source| {
        ConfigError::Read {
            path: path.to_owned(),
            source,
        }
    })?;
    decode(&source, &path.display().to_string(), schema)
}

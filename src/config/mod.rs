//! Configuration: a YAML file plus CLI overrides, validated in one place.
//!
//! The file is decoded from a positioned YAML tree (not serde), so that every problem in it — unknown
//! keys, wrong types, out-of-range values, broken cross-field invariants — is reported at once, each with
//! its YAML path and line, or with the flag the value came from.
//!
//! Loading runs in three steps: `yaml` builds the tree (syntax, duplicate keys), `validate` walks it
//! along the schema, merges the flags and defaults and checks everything, and the result is either a
//! [`Config`] or [`ConfigError::Invalid`] listing every problem. Problems come in phases — single values,
//! then cross-field checks, then the structure of the pools — and a check is skipped when a value it
//! depends on already failed, so each mistake is reported once, at its source. [`Config::to_yaml`] renders
//! the effective configuration back in the file's format.

mod emit;
mod overload;
mod readback;
#[cfg(test)]
mod tests;
mod types;
mod types_pd;
mod types_policy;
mod types_security;
mod types_sync;
mod types_tracing;
mod validate;

use std::net::SocketAddr;
use std::path::Path;

pub use cachepick_decode::{ConfigError, Origin, Problem};
pub use overload::OverloadConfig;
pub use readback::{KeyChange, REDACTED, changed_keys};
pub use types::*;
pub use types_pd::*;
pub use types_policy::*;
pub use types_security::*;
pub use types_sync::*;
pub use types_tracing::*;

/// Values given as command-line flags; each replaces the file's value and is validated like it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--listen`
    pub listen: Option<SocketAddr>,
    /// `--metrics-listen`
    pub metrics_listen: Option<SocketAddr>,
    /// `--worker-queue-limit`
    pub worker_queue_limit: Option<u64>,
    /// `--saturation-queue-floor`
    pub saturation_queue_floor: Option<u64>,
    /// `--min-load-choices`
    pub min_load_choices: Option<u64>,
    /// `--shutdown-grace`
    pub shutdown_grace: Option<std::time::Duration>,
}

/// A duration as the configuration writes them (`500ms`, `5s`, `1m`), for flags that take one.
pub fn parse_duration(text: &str) -> Option<std::time::Duration> {
    cachepick_decode::duration::parse(text)
}

/// Reads and validates the configuration file at `path`, with `overrides` applied.
pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
    cachepick_decode::decode_file(path, |root, problems| {
        validate::validate(root, overrides, problems)
    })
}

/// Validates configuration `source`; `origin_name` names it in the error (usually the file's path).
pub fn parse(
    source: &str,
    origin_name: &str,
    overrides: &Overrides,
) -> Result<Config, ConfigError> {
    cachepick_decode::decode(source, origin_name, |root, problems| {
        validate::validate(root, overrides, problems)
    })
}

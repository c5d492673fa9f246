//! Everything `serve` checks before it listens, in one place: the files the configuration names (the
//! listener's TLS files, `debug_token_file`, `load.tls`'s files, `replica_sync.key_file`, every pool's
//! tokenizer and chat template), each loaded as `serve` uses it. `cachepick check` runs the same function, so what `serve`
//! refuses `check` refuses, with the same message; every problem is listed, each once.

use std::sync::Arc;

use thiserror::Error;

use crate::auth::BearerToken;
use crate::config::{Config, ModelMatch};
use crate::load::{ScrapeTlsClient, SyncKeys};
use crate::tls::ServerTls;
use crate::tokenize::PoolTokenizer;

/// What the configuration's files hold, loaded: `serve` runs on it.
pub struct Prepared {
    pub(super) tls: Option<Arc<ServerTls>>,
    pub(super) token: Option<BearerToken>,
    pub(super) scrape_tls: Option<ScrapeTlsClient>,
    /// `replica_sync`'s keys: the key file's, or the empty key between loopback peers.
    pub(super) sync_keys: Option<SyncKeys>,
    /// Every pool's, in configuration order.
    pub(super) tokenizers: Vec<PoolTokenizer>,
}

/// Every reason the configuration cannot start, one line each.
#[derive(Debug, Error)]
#[error("cannot start with this configuration:{}", lines(.problems))]
pub struct StartError {
    pub problems: Vec<String>,
}

fn lines(problems: &[String]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  {problem}"))
        .collect()
}

/// Loads every file `config` names, as `serve` needs them; the problems of all of them at once.
/// Messages are the errors' own (which name the file and the cause), never their source chains, so
/// an operating-system error appears once.
pub fn prepare(config: &Config) -> Result<Prepared, StartError> {
    let mut problems = Vec::new();
    let mut keep = |problem: String| problems.push(problem);
    let tls = match config.tls.clone().map(ServerTls::load).transpose() {
        Ok(tls) => tls.map(Arc::new),
        Err(error) => {
            keep(format!("tls: {error}"));
            None
        }
    };
    let token = match config
        .debug_token_file
        .as_deref()
        .map(BearerToken::from_file)
        .transpose()
    {
        Ok(token) => token,
        Err(error) => {
            keep(error.to_string());
            None
        }
    };
    let scrape_tls = match config
        .load
        .tls
        .as_ref()
        .map(ScrapeTlsClient::load)
        .transpose()
    {
        Ok(client) => client,
        Err(error) => {
            keep(format!("load.tls: {error}"));
            None
        }
    };
    let sync_keys = match config.replica_sync.as_ref().map(|sync| {
        sync.key_file
            .as_deref()
            .map_or_else(|| Ok(SyncKeys::loopback_only()), SyncKeys::from_file)
    }) {
        Some(Ok(keys)) => Some(keys),
        Some(Err(error)) => {
            keep(error.to_string());
            None
        }
        None => None,
    };
    let mut tokenizers = Vec::with_capacity(config.pools.len());
    for pool in &config.pools {
        match PoolTokenizer::new(pool) {
            Ok(tokenizer) => tokenizers.push(tokenizer),
            Err(error) => {
                let label = match &pool.model {
                    ModelMatch::Exact(name) => name.as_str(),
                    ModelMatch::Any => "*",
                };
                keep(format!("pool {label}: {error}"));
            }
        }
    }
    if !problems.is_empty() {
        return Err(StartError { problems });
    }
    Ok(Prepared {
        tls,
        token,
        scrape_tls,
        sync_keys,
        tokenizers,
    })
}

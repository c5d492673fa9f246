//! The effective configuration rendered back into the file's own format.
//!
//! Every key is written, defaults and derived values included (e.g. each worker's `metrics_url`), so the
//! output shows what is actually in force and parses back to an equal [`Config`].

use std::borrow::Cow;
use std::net::SocketAddr;

use serde::Serialize;

use super::{Config, ModelMatch, PoolConfig, TokenizerConfig, duration};
use crate::worker::{Engine, Role};

impl Config {
    /// The effective configuration (file, flags and defaults merged) as YAML with the file's keys.
    pub fn to_yaml(&self) -> String {
        // Everything below is strings, numbers and plain structs, which serde_yaml always renders.
        serde_yaml::to_string(&File::from(self))
            .unwrap_or_else(|error| format!("# cannot render the configuration: {error}\n"))
    }
}

#[derive(Serialize)]
struct File<'c> {
    listen: SocketAddr,
    metrics_listen: SocketAddr,
    policy: Policy,
    load: Load,
    pools: Vec<Pool<'c>>,
}

#[derive(Serialize)]
struct Policy {
    #[serde(skip_serializing_if = "Option::is_none")]
    worker_queue_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    saturation_queue_floor: Option<u64>,
    min_load_choices: usize,
    min_match_tokens: u64,
    pin_depth_ratio: f64,
    max_fallbacks: usize,
}

#[derive(Serialize)]
struct Load {
    scrape_interval: String,
    scrape_timeout: String,
    freshness: String,
}

#[derive(Serialize)]
struct Pool<'c> {
    model: &'c str,
    engine: Engine,
    block_size: u32,
    tokenizer: Tokenizer<'c>,
    workers: Vec<Worker<'c>>,
}

#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Tokenizer<'c> {
    Tiktoken { encoding: &'static str },
    HuggingFace { path: Cow<'c, str> },
    Bytes,
}

#[derive(Serialize)]
struct Worker<'c> {
    endpoint: SocketAddr,
    metrics_url: &'c str,
    role: Role,
    dp_size: u32,
}

impl<'c> From<&'c Config> for File<'c> {
    fn from(config: &'c Config) -> Self {
        let policy = &config.policy;
        File {
            listen: config.listen,
            metrics_listen: config.metrics_listen,
            policy: Policy {
                worker_queue_limit: policy.gate.map(|gate| gate.limit()),
                saturation_queue_floor: policy.gate.and_then(|gate| gate.floor()),
                min_load_choices: policy.min_load_choices.get(),
                min_match_tokens: policy.min_match_tokens,
                pin_depth_ratio: policy.pin_depth_ratio.get(),
                max_fallbacks: policy.max_fallbacks,
            },
            load: Load {
                scrape_interval: duration::format(config.load.scrape_interval),
                scrape_timeout: duration::format(config.load.scrape_timeout),
                freshness: duration::format(config.load.freshness),
            },
            pools: config.pools.iter().map(Pool::from).collect(),
        }
    }
}

impl<'c> From<&'c PoolConfig> for Pool<'c> {
    fn from(pool: &'c PoolConfig) -> Self {
        Pool {
            model: match &pool.model {
                ModelMatch::Exact(name) => name,
                ModelMatch::Any => "*",
            },
            engine: pool.engine,
            block_size: pool.block_size.get(),
            tokenizer: match &pool.tokenizer {
                TokenizerConfig::Tiktoken { encoding } => Tokenizer::Tiktoken {
                    encoding: encoding.as_str(),
                },
                // The path came from the file as UTF-8, so nothing is lost.
                TokenizerConfig::HuggingFace { path } => Tokenizer::HuggingFace {
                    path: path.to_string_lossy(),
                },
                TokenizerConfig::Bytes => Tokenizer::Bytes,
            },
            workers: pool
                .workers
                .iter()
                .map(|worker| Worker {
                    endpoint: worker.endpoint,
                    metrics_url: &worker.metrics_url,
                    role: worker.role,
                    dp_size: worker.dp_size.get(),
                })
                .collect(),
        }
    }
}

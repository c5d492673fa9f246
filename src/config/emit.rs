//! The effective configuration rendered back into the file's own format.
//!
//! Every key is written, defaults and derived values included (e.g. each worker's `metrics_url`), so the
//! output shows what is actually in force and parses back to an equal [`Config`]. Optional values that
//! are not set (the queue gate, capacity overrides, a `loads_url` for a worker reading metrics, a chat
//! template) are left out, since writing them would set them.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::Path;

use serde::Serialize;

use super::{Config, ModelMatch, PoolConfig, TokenizerConfig, duration, size};
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
    max_body_bytes: Size,
    debug_endpoints: bool,
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
    max_body_bytes: Size,
    max_concurrent_scrapes: usize,
}

/// A byte size: `4MiB` when a binary unit holds it exactly, else a bare number of bytes.
#[derive(Serialize)]
#[serde(untagged)]
enum Size {
    Bytes(usize),
    WithUnit(String),
}

impl From<usize> for Size {
    fn from(bytes: usize) -> Self {
        match size::in_binary_unit(bytes) {
            Some(_) => Size::WithUnit(size::format(bytes)),
            None => Size::Bytes(bytes),
        }
    }
}

#[derive(Serialize)]
struct Pool<'c> {
    model: &'c str,
    engine: Engine,
    block_size: u32,
    tokenizer: Tokenizer<'c>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template: Option<Cow<'c, str>>,
    segment_cache_entries: usize,
    default_cache_blocks: usize,
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
    load_source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    loads_url: Option<&'c str>,
    role: Role,
    dp_size: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_running_requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_total_tokens: Option<u64>,
}

impl<'c> From<&'c Config> for File<'c> {
    fn from(config: &'c Config) -> Self {
        let policy = &config.policy;
        File {
            listen: config.listen,
            metrics_listen: config.metrics_listen,
            max_body_bytes: config.max_body_bytes.get().into(),
            debug_endpoints: config.debug_endpoints,
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
                max_body_bytes: config.load.max_body_bytes.get().into(),
                max_concurrent_scrapes: config.load.max_concurrent_scrapes.get(),
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
            // Also from the file as UTF-8.
            chat_template: pool.chat_template.as_deref().map(Path::to_string_lossy),
            segment_cache_entries: pool.segment_cache_entries.get(),
            default_cache_blocks: pool.default_cache_blocks.get(),
            workers: pool
                .workers
                .iter()
                .map(|worker| Worker {
                    endpoint: worker.endpoint,
                    metrics_url: &worker.metrics_url,
                    load_source: worker.load_source.as_str(),
                    loads_url: worker.loads_url.as_deref(),
                    role: worker.role,
                    dp_size: worker.dp_size.get(),
                    max_running_requests: worker.max_running_requests.map(NonZeroU64::get),
                    max_total_tokens: worker.max_total_tokens.map(NonZeroU64::get),
                })
                .collect(),
        }
    }
}

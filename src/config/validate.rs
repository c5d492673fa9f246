//! Schema-directed decoding of the YAML tree, with the flags, into a validated [`Config`].
//!
//! The walk follows the schema, not YAML's own typing: a scalar is read as whatever its key expects, so
//! `endpoint: 10.0.0.11:8000` is a string and `model: 3` names the model "3". Every value keeps its origin
//! (YAML path and line, flag, or default) and is checked on its own first; the cross-field and structural
//! checks then look only at values that passed, so one mistake gives one message.
//!
//! A flag replaces the file's value, and the range checks apply to the value in force; the file's value
//! is still type-checked, because the file must stay valid for runs without the flag.
//!
//! This module walks the schema: the root, `load`, the pools and their workers, and the checks across
//! pools. The `policy:` sections, and how a pool's inherits the top level's, are [`policy`]'s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use super::{
    Config, Discovery, KvEventEndpoints, KvEventsFrom, LoadSource, ModelMatch, Overrides, PdConfig,
    PolicyConfig, PoolConfig, TokenizerConfig, UnknownSubset, WorkerConfig, WorkerTemplate,
};
use crate::worker::{Engine, Role};
use cachepick_decode::{
    Decode, Field, Map, Node, Origin, Phase, Place, Problems, Res, Val, at_least_one,
    at_least_one_u32, at_least_one_usize, blame, overridden, with_default,
};
use cachepick_tokenizer::{decode_chat_template, decode_tokenizer};
use index::IndexDraft;
use policy::Resolved;

mod discovery;
mod feedback;
mod index;
mod knob;
mod load;
mod overload;
mod pd;
mod policy;
mod security;
mod sync;
mod tracing;
mod worker;

const ROOT_KEYS: &[&str] = &[
    "listen",
    "metrics_listen",
    "max_body_bytes",
    "debug_endpoints",
    "cache_salt_header",
    "debug_token_file",
    "tls",
    "metrics_http",
    "policy",
    "load",
    "pools",
    "overload",
    "unknown_subset",
    "feedback",
    "replica_sync",
    "tracing",
];
const POOL_KEYS: &[&str] = &[
    "model",
    "engine",
    "block_size",
    "engine_block_size",
    "tokenizer",
    "chat_template",
    "segment_cache_entries",
    "default_cache_blocks",
    "max_model_len",
    "policy",
    "index",
    "workers",
    "dns",
    "kubernetes",
    "template",
    "max_workers",
    "pd",
];

const HTTP_URL: &str =
    "an http:// or https:// URL naming a host, such as http://10.0.0.11:8000/metrics";

/// Decodes and checks the whole configuration; `Ok` only means every value could be built; the
/// configuration is valid only if, in addition, no problem was recorded (e.g. an unknown key).
pub(super) fn validate(root: &Node, overrides: &Overrides, problems: &mut Problems) -> Res<Config> {
    Validator {
        problems,
        https_scrape: true,
    }
    .config(root, overrides)
}

/// A pool whose pieces are decoded; it is built after the checks across pools.
struct PoolDraft {
    model: Res<Val<ModelMatch>>,
    engine: Res<Engine>,
    block_size: Res<NonZeroU32>,
    engine_block_size: Res<Option<NonZeroU32>>,
    tokenizer: Res<TokenizerConfig>,
    chat_template: Res<Option<PathBuf>>,
    segment_cache_entries: Res<NonZeroUsize>,
    default_cache_blocks: Res<NonZeroUsize>,
    max_model_len: Res<NonZeroU64>,
    workers: Res<Vec<Res<WorkerDraft>>>,
    policy: Res<PolicyConfig>,
    index: Res<IndexDraft>,
    discovery: Res<Discovery>,
    template: Res<WorkerTemplate>,
    max_workers: Res<NonZeroUsize>,
    pd: Res<Option<PdConfig>>,
}

struct WorkerDraft {
    endpoint: Res<Val<SocketAddr>>,
    metrics_url: Res<Option<String>>,
    load_source: Res<LoadSource>,
    /// As given; only ever `Some` with `LoadSource::Loads`.
    loads_url: Res<Option<String>>,
    role: Res<Role>,
    dp_size: Res<NonZeroU32>,
    max_running_requests: Res<Option<NonZeroU64>>,
    max_total_tokens: Res<Option<NonZeroU64>>,
    kv_events: Res<(KvEventEndpoints, KvEventsFrom)>,
    bootstrap_port: Field<u16>,
}

/// What a worker's engine is, beyond its address.
struct EngineKeys {
    /// Checked against the pool's engine.
    load_source: Res<LoadSource>,
    /// Checked against `load_source`; always none for a pool's `template`.
    loads_url: Res<Option<String>>,
    role: Res<Role>,
    dp_size: Res<Val<NonZeroU32>>,
    max_running_requests: Res<Option<NonZeroU64>>,
    max_total_tokens: Res<Option<NonZeroU64>>,
}

impl PoolDraft {
    fn endpoints(&self) -> impl Iterator<Item = &Val<SocketAddr>> {
        self.workers
            .iter()
            .flatten()
            .flatten()
            .filter_map(|worker| worker.endpoint.as_ref().ok())
    }

    fn build(self) -> Res<PoolConfig> {
        Ok(PoolConfig {
            model: self.model?.value,
            engine: self.engine?,
            block_size: self.block_size?,
            engine_block_size: self.engine_block_size?,
            tokenizer: self.tokenizer?,
            chat_template: self.chat_template?,
            segment_cache_entries: self.segment_cache_entries?,
            default_cache_blocks: self.default_cache_blocks?,
            max_model_len: self.max_model_len?,
            workers: self
                .workers?
                .into_iter()
                .map(|worker| worker?.build())
                .collect::<Res<_>>()?,
            policy: self.policy?,
            index: self.index?.config,
            discovery: self.discovery?,
            template: self.template?,
            max_workers: self.max_workers?,
            pd: self.pd?,
        })
    }
}

impl WorkerDraft {
    fn build(self) -> Res<WorkerConfig> {
        let endpoint = self.endpoint?.value;
        let load_source = self.load_source?;
        let loads_url = self.loads_url?;
        let (kv_events, kv_events_from) = self.kv_events?;
        Ok(WorkerConfig {
            endpoint,
            // Both engines serve Prometheus metrics on their API port.
            metrics_url: self
                .metrics_url?
                .unwrap_or_else(|| format!("http://{endpoint}/metrics")),
            load_source,
            // SGLang serves /v1/loads on its API port too.
            loads_url: match load_source {
                LoadSource::Loads => {
                    Some(loads_url.unwrap_or_else(|| format!("http://{endpoint}/v1/loads")))
                }
                LoadSource::Metrics => None,
            },
            role: self.role?,
            dp_size: self.dp_size?,
            max_running_requests: self.max_running_requests?,
            max_total_tokens: self.max_total_tokens?,
            kv_events,
            kv_events_from,
            bootstrap_port: self.bootstrap_port?.map(|port| port.value),
        })
    }
}

/// The decoder of cachepick's own file: the shared walker plus this schema's methods.
struct Validator<'p> {
    problems: &'p mut Problems,
    /// Whether `https://` scrape URLs are allowed: `load.tls` is set (or `load` failed, and is reported
    /// there).
    https_scrape: bool,
}

impl Decode for Validator<'_> {
    fn problems(&mut self) -> &mut Problems {
        self.problems
    }
}

impl Validator<'_> {
    fn config(&mut self, root: &Node, overrides: &Overrides) -> Res<Config> {
        let root = self.mapping(root, &Place::root(root.line), ROOT_KEYS)?;
        let listen = self.opt(&root, "listen", Self::address);
        let listen = with_default(
            overridden(listen, overrides.listen, "--listen"),
            Config::DEFAULT_LISTEN,
        );
        let metrics_listen = self.opt(&root, "metrics_listen", Self::address);
        let metrics_listen =
            overridden(metrics_listen, overrides.metrics_listen, "--metrics-listen");
        let metrics_listen = with_default(metrics_listen, Config::DEFAULT_METRICS_LISTEN);
        let listeners_apart = match (&listen, &metrics_listen) {
            (Ok(grpc), Ok(http)) if same_socket(grpc.value, http.value) => {
                let message = format!(
                    "metrics_listen ({}) takes the port of listen ({}): each server needs its own",
                    http.value, grpc.value
                );
                Err(self.report(Phase::Cross, blame(http, grpc), message))
            }
            _ => Ok(()),
        };
        let max_body_bytes =
            self.positive_size(&root, "max_body_bytes", Config::DEFAULT_MAX_BODY_BYTES);
        let debug_endpoints = self.opt(&root, "debug_endpoints", Self::boolean);
        let cache_salt_header = self.opt(&root, "cache_salt_header", Self::string);
        let cache_salt_header = self.check_opt(cache_salt_header, salt_header);
        let debug_token_file = self.debug_token_file(&root);
        let tls = self.listener_tls(&root);
        let metrics_http = self.metrics_http(&root);
        let policy = self.policy(&root, Some(overrides), None);
        let load = self
            .section(&root, "load", load::LOAD_KEYS)
            .and_then(|map| self.load(&map));
        self.https_scrape = load.as_ref().map_or(true, |load| load.tls.is_some());
        let pools = self.pools(&root, &policy);
        let overload = self.overload(&root, overrides, &max_body_bytes);
        let unknown_subset = self.opt(&root, "unknown_subset", |v, node, at| {
            v.keyword(node, at, &UnknownSubset::ALL, UnknownSubset::as_str)
        });
        listeners_apart?;
        let feedback = self.feedback(&root);
        let replica_sync = self.replica_sync(&root);
        let tracing = self.tracing(&root);
        Ok(Config {
            listen: listen?.value,
            metrics_listen: metrics_listen?.value,
            policy: policy.policy?,
            load: load?,
            pools: pools?,
            max_body_bytes: max_body_bytes?.value,
            debug_endpoints: debug_endpoints?.map(|given| given.value),
            debug_token_file: debug_token_file?,
            tls: tls?,
            metrics_http: metrics_http?,
            cache_salt_header: cache_salt_header?.map(|given| given.value),
            overload: overload?,
            unknown_subset: unknown_subset?.map_or(UnknownSubset::default(), |given| given.value),
            feedback: feedback?,
            replica_sync: replica_sync?,
            tracing: tracing?,
        })
    }

    pub(super) fn positive_duration(
        &mut self,
        map: &Map,
        key: &str,
        default: Duration,
    ) -> Res<Val<Duration>> {
        let given = self.opt(map, key, Self::duration);
        self.check(with_default(given, default), |duration| {
            if duration.is_zero() {
                Err("must be greater than 0".to_owned())
            } else {
                Ok(duration)
            }
        })
    }

    /// A byte size of at least 1, `default` when absent.
    fn positive_size(&mut self, map: &Map, key: &str, default: usize) -> Res<Val<NonZeroUsize>> {
        let given = self.opt(map, key, Self::size);
        self.check(with_default(given, default), |bytes| {
            NonZeroUsize::new(bytes).ok_or_else(|| "must be at least 1 byte".to_owned())
        })
    }

    /// A count of at least 1, `default` when absent.
    fn positive_count(&mut self, map: &Map, key: &str, default: usize) -> Res<NonZeroUsize> {
        let given = self.opt(map, key, Self::integer);
        self.check(with_default(given, default as u64), at_least_one_usize)
            .map(|count| count.value)
    }

    /// The list under `key` (`pools`, `workers`), each item read by `read`, and the list's place; the
    /// list must be given and hold at least one `item`.
    fn required_list<T>(
        &mut self,
        map: &Map,
        key: &str,
        item: &str,
        mut read: impl FnMut(&mut Self, &Node, &Place) -> T,
    ) -> Res<(Vec<T>, Place)> {
        let Some((node, at)) = map.get(key) else {
            let message = format!("missing: at least one {item} is required");
            return Err(self.report(Phase::Structure, map.place_of(key).origin(), message));
        };
        let items = self.list(node, &at, &format!("a list of {key}"))?;
        if items.is_empty() {
            let message = format!("at least one {item} is required");
            return Err(self.report(Phase::Structure, at.origin(), message));
        }
        let decoded = items
            .iter()
            .enumerate()
            .map(|(i, node)| read(self, node, &at.index(i, node.line)))
            .collect();
        Ok((decoded, at))
    }

    fn pools(&mut self, root: &Map, policy: &Resolved) -> Res<Vec<PoolConfig>> {
        let (pools, _) = self.required_list(root, "pools", "pool", |v, node, at| {
            v.pool(node, at, policy)
        })?;
        self.check_models(&pools);
        self.check_endpoints(&pools);
        pools.into_iter().map(|pool| pool?.build()).collect()
    }

    fn pool(&mut self, node: &Node, at: &Place, parent: &Resolved) -> Res<PoolDraft> {
        let map = self.mapping(node, at, POOL_KEYS)?;
        let model = self.required(&map, "model", Self::model);
        let engine = self.required(&map, "engine", |v, node, at| {
            v.keyword(node, at, &[Engine::Vllm, Engine::Sglang], Engine::as_str)
        });
        let block_size = self.opt(&map, "block_size", Self::integer);
        let block_size = self.check(
            with_default(block_size, PoolConfig::DEFAULT_BLOCK_SIZE.into()),
            at_least_one_u32,
        );
        let engine_block_size = self.engine_block_size(&map, &block_size);
        let tokenizer = decode_tokenizer(self, &map);
        let chat_template = decode_chat_template(self, &map);
        let segment_cache_entries = self.positive_count(
            &map,
            "segment_cache_entries",
            PoolConfig::DEFAULT_SEGMENT_CACHE_ENTRIES,
        );
        let default_cache_blocks = self.positive_count(
            &map,
            "default_cache_blocks",
            PoolConfig::DEFAULT_CACHE_BLOCKS,
        );
        let max_model_len = self.opt(&map, "max_model_len", Self::integer);
        let max_model_len = self.check(
            with_default(max_model_len, PoolConfig::DEFAULT_MAX_MODEL_LEN),
            at_least_one,
        );
        // The pool's own keys over the top-level ones; flags apply to the top level only.
        let policy = self.policy(&map, None, Some(parent)).policy;
        let engine = engine.map(|engine| engine.value);
        let index = self.index(&map);
        let source = self.source(&map, at, engine.ok(), &index);
        let pd = self.pd(&map, engine.as_ref().ok().copied());
        let pd = self.pd_workers(&map, pd, &source.workers);
        Ok(PoolDraft {
            pd,
            workers: source.workers,
            discovery: source.discovery,
            template: source.template,
            max_workers: source.max_workers,
            model,
            engine,
            block_size: block_size.map(|size| size.value),
            engine_block_size,
            tokenizer,
            chat_template,
            segment_cache_entries,
            default_cache_blocks,
            max_model_len: max_model_len.map(|len| len.value),
            policy,
            index,
        })
    }

    /// `engine_block_size`, which the pool's `block_size` must divide: a pool block that straddles two
    /// engine blocks can never be reused whole, and one finer than the engine's would credit a worker
    /// with a part of a block the engine recomputes.
    fn engine_block_size(
        &mut self,
        map: &Map,
        block_size: &Res<Val<NonZeroU32>>,
    ) -> Res<Option<NonZeroU32>> {
        let given = self.opt(map, "engine_block_size", Self::integer);
        let Some(engine) = self.check_opt(given, at_least_one_u32)? else {
            return Ok(None);
        };
        if let Ok(pool) = block_size
            && engine.value.get() % pool.value.get() != 0
        {
            let divisors: Vec<String> = (1..=engine.value.get())
                .rev()
                .filter(|size| engine.value.get() % size == 0)
                .take(4)
                .map(|size| size.to_string())
                .collect();
            let message = format!(
                "block_size {} does not divide engine_block_size {}: the engine reuses a cached \
                 prefix in whole blocks of {} tokens; give a block_size that divides it ({})",
                pool.value,
                engine.value,
                engine.value,
                divisors.join(", ")
            );
            return Err(self.report(Phase::Value, pool.at.clone(), message));
        }
        Ok(Some(engine.value))
    }

    /// Models are unique, and at most one pool is the default (`*`).
    fn check_models(&mut self, pools: &[Res<PoolDraft>]) {
        let mut first: HashMap<&ModelMatch, &Origin> = HashMap::new();
        for model in pools
            .iter()
            .flatten()
            .filter_map(|pool| pool.model.as_ref().ok())
        {
            let Some(earlier) = first.get(&model.value) else {
                first.insert(&model.value, &model.at);
                continue;
            };
            let message = match &model.value {
                ModelMatch::Any => {
                    format!("a second default pool (`*`); the default pool is already {earlier}")
                }
                ModelMatch::Exact(name) => {
                    format!("duplicate model {name}; already served by {earlier}")
                }
            };
            self.report(Phase::Structure, model.at.clone(), message);
        }
    }

    /// Endpoints are unique across all pools: an endpoint is one engine, with one model and one load.
    fn check_endpoints(&mut self, pools: &[Res<PoolDraft>]) {
        let mut first: HashMap<SocketAddr, &Origin> = HashMap::new();
        for endpoint in pools.iter().flatten().flat_map(PoolDraft::endpoints) {
            let Some(earlier) = first.get(&endpoint.value) else {
                first.insert(endpoint.value, &endpoint.at);
                continue;
            };
            let message = format!(
                "duplicate endpoint {}; already listed at {earlier}",
                endpoint.value
            );
            self.report(Phase::Structure, endpoint.at.clone(), message);
        }
    }

    /// A URL the scraper can request as is: `http://`, or `https://` when `load.tls` names the CA to
    /// verify it with, with a host, parsed the way the HTTP client will parse it. `serves` names what
    /// the engine exposes there.
    fn http_url(&mut self, node: &Node, at: &Place, serves: &str) -> Res<String> {
        let url = self.string(node, at)?;
        let https = url.starts_with("https://");
        if https && !self.https_scrape {
            let message = format!(
                "`{url}` is https, and load.tls names no CA to verify the engine's {serves} with: set \
                 load.tls.ca_file, or scrape over plain http"
            );
            return Err(self.report(Phase::Cross, at.origin(), message));
        }
        let has_host = (https || url.starts_with("http://"))
            && url
                .parse::<http::Uri>()
                .is_ok_and(|uri| uri.host().is_some_and(|host| !host.is_empty()));
        if has_host {
            Ok(url)
        } else {
            Err(self.type_error(node, at, HTTP_URL))
        }
    }

    fn model(&mut self, node: &Node, at: &Place) -> Res<ModelMatch> {
        let name = self.string(node, at)?;
        Ok(if name == "*" {
            ModelMatch::Any
        } else {
            ModelMatch::Exact(name)
        })
    }
}

/// `cache_salt_header`: an HTTP header name a client sends (not a pseudo-header, not one the proxy
/// owns), lower-cased as Envoy hands headers to ext_proc.
fn salt_header(name: String) -> Result<String, String> {
    let lower = name.to_ascii_lowercase();
    let token = |byte: u8| byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte);
    if !lower.bytes().all(token) {
        return Err(format!(
            "{name:?} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"
        ));
    }
    if lower.starts_with(crate::protocol::OWNED_PREFIX) || lower == crate::protocol::DESTINATION {
        return Err(format!(
            "{name:?} is a header cachepick sets and removes from client requests"
        ));
    }
    Ok(lower)
}

/// Whether two listeners would bind the same port: the same one (unless the system picks it, port 0),
/// or one on every address of its family and the other on any address of it.
fn same_socket(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && a.is_ipv4() == b.is_ipv4()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

//! Schema-directed decoding of the YAML tree, with the flags, into a validated [`Config`].
//!
//! The walk follows the schema, not YAML's own typing: a scalar is read as whatever its key expects, so
//! `endpoint: 10.0.0.11:8000` is a string and `model: 3` names the model "3". Every value keeps its origin
//! (YAML path and line, flag, or default) and is checked on its own first; the cross-field and structural
//! checks then look only at values that passed, so one mistake gives one message.
//!
//! A flag replaces the file's value, and the range checks apply to the value in force; the file's value
//! is still type-checked, because the file must stay valid for runs without the flag.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use super::error::{Origin, Phase, Problems, Reported, Res};
use super::yaml::{Entry, Kind, Node, Place};
use super::{
    Config, DepthRatio, LoadConfig, ModelMatch, Overrides, PolicyConfig, PoolConfig, QueueGate,
    TiktokenEncoding, TokenizerConfig, WorkerConfig, duration,
};
use crate::worker::{Engine, Role};

const ROOT_KEYS: &[&str] = &["listen", "metrics_listen", "policy", "load", "pools"];
const POLICY_KEYS: &[&str] = &[
    "worker_queue_limit",
    "saturation_queue_floor",
    "min_load_choices",
    "min_match_tokens",
    "pin_depth_ratio",
    "max_fallbacks",
];
const LOAD_KEYS: &[&str] = &["scrape_interval", "scrape_timeout", "freshness"];
const POOL_KEYS: &[&str] = &["model", "engine", "block_size", "tokenizer", "workers"];
const WORKER_KEYS: &[&str] = &["endpoint", "metrics_url", "role", "dp_size"];

const ADDRESS: &str = "ip:port such as 10.0.0.11:8000 (an IP address, not a host name)";
const DURATION: &str = "a duration such as 1s, 500ms or 1.5m (units: ms, s, m, h)";
const INTEGER: &str = "a non-negative integer";

/// Decodes and checks the whole configuration; `Ok` only means every value could be built; the
/// configuration is valid only if, in addition, no problem was recorded (e.g. an unknown key).
pub(super) fn validate(root: &Node, overrides: &Overrides, problems: &mut Problems) -> Res<Config> {
    Validator { problems }.config(root, overrides)
}

/// A value and where it came from.
struct Val<T> {
    value: T,
    at: Origin,
}

impl<T> Val<T> {
    /// How a message names this value: by its flag if it came from one, else by its key.
    fn name<'a>(&'a self, key: &'a str) -> &'a str {
        match &self.at {
            Origin::Flag(flag) => flag,
            _ => key,
        }
    }
}

/// An optional value: absent, given, or given but rejected.
type Field<T> = Res<Option<Val<T>>>;

/// A flag, when given, replaces the file's value.
fn overridden<T>(file: Field<T>, flag: Option<T>, name: &'static str) -> Field<T> {
    match flag {
        Some(value) => Ok(Some(Val {
            value,
            at: Origin::Flag(name),
        })),
        None => file,
    }
}

fn with_default<T>(field: Field<T>, default: T) -> Res<Val<T>> {
    field.map(|given| {
        given.unwrap_or(Val {
            value: default,
            at: Origin::Default,
        })
    })
}

/// The origin to blame when two values disagree: the first one unless it is a default.
fn blame<A, B>(first: &Val<A>, second: &Val<B>) -> Origin {
    match first.at {
        Origin::Default => second.at.clone(),
        _ => first.at.clone(),
    }
}

/// A mapping being decoded.
struct Map<'n> {
    at: Place,
    entries: &'n [Entry],
}

impl<'n> Map<'n> {
    /// The value of `key` and its place; a null value counts as absent.
    fn get(&self, key: &str) -> Option<(&'n Node, Place)> {
        let entry = self
            .entries
            .iter()
            .find(|entry| entry.key == key && !entry.value.is_null())?;
        Some((&entry.value, self.at.key(key, entry.line)))
    }

    /// Where `key` is, or would be: its own line if written, else the mapping's.
    fn place_of(&self, key: &str) -> Place {
        let line = self
            .entries
            .iter()
            .find(|entry| entry.key == key)
            .map_or(self.at.line, |entry| entry.line);
        self.at.key(key, line)
    }
}

/// A pool whose pieces are decoded; it is built after the checks across pools.
struct PoolDraft {
    model: Res<Val<ModelMatch>>,
    engine: Res<Engine>,
    block_size: Res<NonZeroU32>,
    tokenizer: Res<TokenizerConfig>,
    workers: Res<Vec<Res<WorkerDraft>>>,
}

struct WorkerDraft {
    endpoint: Res<Val<SocketAddr>>,
    metrics_url: Res<Option<String>>,
    role: Res<Role>,
    dp_size: Res<NonZeroU32>,
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
            tokenizer: self.tokenizer?,
            workers: self
                .workers?
                .into_iter()
                .map(|worker| worker?.build())
                .collect::<Res<_>>()?,
        })
    }
}

impl WorkerDraft {
    fn build(self) -> Res<WorkerConfig> {
        let endpoint = self.endpoint?.value;
        Ok(WorkerConfig {
            endpoint,
            // Both engines serve Prometheus metrics on their API port.
            metrics_url: self
                .metrics_url?
                .unwrap_or_else(|| format!("http://{endpoint}/metrics")),
            role: self.role?,
            dp_size: self.dp_size?,
        })
    }
}

struct Validator<'p> {
    problems: &'p mut Problems,
}

impl Validator<'_> {
    fn report(&mut self, phase: Phase, at: Origin, message: impl Into<String>) -> Reported {
        self.problems.report(phase, at, message)
    }

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
        let policy = self
            .section(&root, "policy", POLICY_KEYS)
            .and_then(|map| self.policy(&map, overrides));
        let load = self
            .section(&root, "load", LOAD_KEYS)
            .and_then(|map| self.load(&map));
        let pools = self.pools(&root);
        Ok(Config {
            listen: listen?.value,
            metrics_listen: metrics_listen?.value,
            policy: policy?,
            load: load?,
            pools: pools?,
        })
    }

    fn policy(&mut self, map: &Map, overrides: &Overrides) -> Res<PolicyConfig> {
        let limit = self.opt(map, "worker_queue_limit", Self::integer);
        let limit = overridden(limit, overrides.worker_queue_limit, "--worker-queue-limit");
        let limit = self.check_opt(limit, at_least_one);
        let floor = self.opt(map, "saturation_queue_floor", Self::integer);
        let floor = overridden(
            floor,
            overrides.saturation_queue_floor,
            "--saturation-queue-floor",
        );
        let floor = self.check_opt(floor, at_least_one);
        let choices = self.opt(map, "min_load_choices", Self::integer);
        let choices = overridden(choices, overrides.min_load_choices, "--min-load-choices");
        let choices = self.check(
            with_default(choices, PolicyConfig::DEFAULT_MIN_LOAD_CHOICES as u64),
            |n| {
                NonZeroUsize::try_from(at_least_one(n)?)
                    .map_err(|_| format!("must be at most {}", usize::MAX))
            },
        );
        let min_match_tokens = self.opt(map, "min_match_tokens", Self::integer);
        let min_match_tokens =
            with_default(min_match_tokens, PolicyConfig::DEFAULT_MIN_MATCH_TOKENS);
        let ratio = self.opt(map, "pin_depth_ratio", Self::number);
        let ratio = self.check(
            with_default(ratio, PolicyConfig::DEFAULT_PIN_DEPTH_RATIO),
            |ratio| {
                DepthRatio::new(ratio)
                    .ok_or_else(|| format!("must be between 0 and 1, got {ratio}"))
            },
        );
        let fallbacks = self.opt(map, "max_fallbacks", Self::integer);
        let fallbacks = self.check(
            with_default(fallbacks, PolicyConfig::DEFAULT_MAX_FALLBACKS as u64),
            |n| {
                usize::try_from(n)
                    .ok()
                    .filter(|n| *n <= PolicyConfig::MAX_FALLBACKS_LIMIT)
                    .ok_or_else(|| format!("must be at most {}", PolicyConfig::MAX_FALLBACKS_LIMIT))
            },
        );
        let gate = self.gate(limit, floor);
        Ok(PolicyConfig {
            gate: gate?,
            min_load_choices: choices?.value,
            min_match_tokens: min_match_tokens?.value,
            pin_depth_ratio: ratio?.value,
            max_fallbacks: fallbacks?.value,
        })
    }

    /// The queue gate, once the limit and the floor each passed their own checks.
    fn gate(
        &mut self,
        limit: Field<NonZeroU64>,
        floor: Field<NonZeroU64>,
    ) -> Res<Option<QueueGate>> {
        match (limit?, floor?) {
            (limit, None) => Ok(limit.and_then(|limit| QueueGate::new(limit.value, None))),
            (None, Some(floor)) => {
                let message = format!(
                    "{} requires worker_queue_limit (there is no diversion to cancel without it)",
                    floor.name("saturation_queue_floor")
                );
                Err(self.report(Phase::Cross, floor.at, message))
            }
            (Some(limit), Some(floor)) => match QueueGate::new(limit.value, Some(floor.value)) {
                Some(gate) => Ok(Some(gate)),
                None => {
                    let message = format!(
                        "{} ({}) must be at most {} ({}): a floor above the limit would declare the fleet saturated \
                         while the gate still admits some workers",
                        floor.name("saturation_queue_floor"),
                        floor.value,
                        limit.name("worker_queue_limit"),
                        limit.value,
                    );
                    Err(self.report(Phase::Cross, floor.at, message))
                }
            },
        }
    }

    fn load(&mut self, map: &Map) -> Res<LoadConfig> {
        let defaults = LoadConfig::default();
        let interval = self.positive_duration(map, "scrape_interval", defaults.scrape_interval);
        let timeout = self.positive_duration(map, "scrape_timeout", defaults.scrape_timeout);
        let freshness = self.positive_duration(map, "freshness", defaults.freshness);
        let timeout_fits = match (&interval, &timeout) {
            (Ok(interval), Ok(timeout)) if timeout.value > interval.value => {
                let message = format!(
                    "scrape_timeout ({}) must be at most scrape_interval ({}): scrape rounds would overlap",
                    duration::format(timeout.value),
                    duration::format(interval.value),
                );
                Err(self.report(Phase::Cross, blame(timeout, interval), message))
            }
            _ => Ok(()),
        };
        let freshness_lasts = match (&interval, &freshness) {
            (Ok(interval), Ok(freshness)) if freshness.value <= interval.value => {
                let message = format!(
                    "freshness ({}) must be longer than scrape_interval ({}): a healthy worker's reading would \
                     lapse between scrapes and the gate would go blind",
                    duration::format(freshness.value),
                    duration::format(interval.value),
                );
                Err(self.report(Phase::Cross, blame(freshness, interval), message))
            }
            _ => Ok(()),
        };
        timeout_fits?;
        freshness_lasts?;
        Ok(LoadConfig {
            scrape_interval: interval?.value,
            scrape_timeout: timeout?.value,
            freshness: freshness?.value,
        })
    }

    fn positive_duration(&mut self, map: &Map, key: &str, default: Duration) -> Res<Val<Duration>> {
        let given = self.opt(map, key, Self::duration);
        self.check(with_default(given, default), |duration| {
            if duration.is_zero() {
                Err("must be greater than 0".to_owned())
            } else {
                Ok(duration)
            }
        })
    }

    fn pools(&mut self, root: &Map) -> Res<Vec<PoolConfig>> {
        let Some((node, at)) = root.get("pools") else {
            let at = root.place_of("pools").origin();
            return Err(self.report(
                Phase::Structure,
                at,
                "missing: at least one pool is required",
            ));
        };
        let items = self.list(node, &at, "a list of pools")?;
        if items.is_empty() {
            return Err(self.report(
                Phase::Structure,
                at.origin(),
                "at least one pool is required",
            ));
        }
        let pools: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, item)| self.pool(item, &at.index(i, item.line)))
            .collect();
        self.check_models(&pools);
        self.check_endpoints(&pools);
        pools.into_iter().map(|pool| pool?.build()).collect()
    }

    fn pool(&mut self, node: &Node, at: &Place) -> Res<PoolDraft> {
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
        let tokenizer = match map.get("tokenizer") {
            Some((node, at)) => self.tokenizer(node, &at),
            None => Ok(TokenizerConfig::default()),
        };
        Ok(PoolDraft {
            model,
            engine: engine.map(|engine| engine.value),
            block_size: block_size.map(|size| size.value),
            tokenizer,
            workers: self.workers(&map),
        })
    }

    fn tokenizer(&mut self, node: &Node, at: &Place) -> Res<TokenizerConfig> {
        let map = self.any_mapping(node, at)?;
        let kind = self.required(&map, "kind", Self::string)?;
        match kind.value.as_str() {
            "tiktoken" => {
                self.known_keys(&map, &["kind", "encoding"]);
                let encoding = self.opt(&map, "encoding", |v, node, at| {
                    v.keyword(node, at, &TiktokenEncoding::ALL, TiktokenEncoding::as_str)
                })?;
                Ok(TokenizerConfig::Tiktoken {
                    encoding: encoding
                        .map_or(TiktokenEncoding::O200kBase, |encoding| encoding.value),
                })
            }
            "huggingface" => {
                self.known_keys(&map, &["kind", "path"]);
                let path = self.required(&map, "path", Self::string)?;
                Ok(TokenizerConfig::HuggingFace {
                    path: path.value.into(),
                })
            }
            "bytes" => {
                self.known_keys(&map, &["kind"]);
                Ok(TokenizerConfig::Bytes)
            }
            other => {
                let message =
                    format!("expected one of: tiktoken, huggingface, bytes; got `{other}`");
                Err(self.report(Phase::Value, kind.at, message))
            }
        }
    }

    fn workers(&mut self, pool: &Map) -> Res<Vec<Res<WorkerDraft>>> {
        let Some((node, at)) = pool.get("workers") else {
            let at = pool.place_of("workers").origin();
            return Err(self.report(
                Phase::Structure,
                at,
                "missing: at least one worker is required",
            ));
        };
        let items = self.list(node, &at, "a list of workers")?;
        if items.is_empty() {
            return Err(self.report(
                Phase::Structure,
                at.origin(),
                "at least one worker is required",
            ));
        }
        let workers: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, item)| self.worker(item, &at.index(i, item.line)))
            .collect();
        // Judged only when every worker's role is known: a rejected one may have been the prefill worker.
        let roles: Res<Vec<Role>> = workers
            .iter()
            .map(|worker| worker.as_ref().map_err(|r| *r)?.role)
            .collect();
        if roles.is_ok_and(|roles| !roles.iter().any(|role| role.serves_prefill())) {
            let message =
                "no worker has role prefill or both: every request to this pool would be rejected";
            self.report(Phase::Structure, at.origin(), message);
        }
        Ok(workers)
    }

    fn worker(&mut self, node: &Node, at: &Place) -> Res<WorkerDraft> {
        let map = self.mapping(node, at, WORKER_KEYS)?;
        let endpoint = self.required(&map, "endpoint", Self::address);
        let metrics_url = self.opt(&map, "metrics_url", Self::metrics_url);
        let role = self.opt(&map, "role", |v, node, at| {
            v.keyword(
                node,
                at,
                &[Role::Prefill, Role::Decode, Role::Both],
                Role::as_str,
            )
        });
        let dp_size = self.opt(&map, "dp_size", Self::integer);
        let dp_size = self.check(
            with_default(dp_size, WorkerConfig::DEFAULT_DP_SIZE.into()),
            at_least_one_u32,
        );
        Ok(WorkerDraft {
            endpoint,
            metrics_url: metrics_url.map(|url| url.map(|url| url.value)),
            role: with_default(role, WorkerConfig::DEFAULT_ROLE).map(|role| role.value),
            dp_size: dp_size.map(|size| size.value),
        })
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

    // Walking the tree.

    /// A mapping with exactly the keys known at this point of the schema.
    fn mapping<'n>(&mut self, node: &'n Node, at: &Place, keys: &[&str]) -> Res<Map<'n>> {
        let map = self.any_mapping(node, at)?;
        self.known_keys(&map, keys);
        Ok(map)
    }

    /// A mapping whose keys are checked later; null reads as an empty mapping (an empty file).
    fn any_mapping<'n>(&mut self, node: &'n Node, at: &Place) -> Res<Map<'n>> {
        match &node.kind {
            Kind::Map(entries) => Ok(Map {
                at: at.clone(),
                entries,
            }),
            _ if node.is_null() => Ok(Map {
                at: at.clone(),
                entries: &[],
            }),
            _ => Err(self.type_error(node, at, "a mapping")),
        }
    }

    fn known_keys(&mut self, map: &Map, keys: &[&str]) {
        for entry in map
            .entries
            .iter()
            .filter(|entry| !keys.contains(&entry.key.as_str()))
        {
            let message = format!("unknown key; expected one of: {}", keys.join(", "));
            self.report(
                Phase::Value,
                map.at.key(&entry.key, entry.line).origin(),
                message,
            );
        }
    }

    /// A section of the root; absent is empty, so its keys take their defaults (and flags still apply).
    fn section<'n>(&mut self, root: &Map<'n>, key: &str, keys: &[&str]) -> Res<Map<'n>> {
        match root.get(key) {
            Some((node, at)) => self.mapping(node, &at, keys),
            None => Ok(Map {
                at: root.place_of(key),
                entries: &[],
            }),
        }
    }

    fn list<'n>(&mut self, node: &'n Node, at: &Place, expected: &str) -> Res<&'n [Node]> {
        match &node.kind {
            Kind::Seq(items) => Ok(items),
            _ => Err(self.type_error(node, at, expected)),
        }
    }

    fn opt<T>(
        &mut self,
        map: &Map,
        key: &str,
        decode: impl FnOnce(&mut Self, &Node, &Place) -> Res<T>,
    ) -> Field<T> {
        let Some((node, at)) = map.get(key) else {
            return Ok(None);
        };
        let value = decode(self, node, &at)?;
        Ok(Some(Val {
            value,
            at: at.origin(),
        }))
    }

    fn required<T>(
        &mut self,
        map: &Map,
        key: &str,
        decode: impl FnOnce(&mut Self, &Node, &Place) -> Res<T>,
    ) -> Res<Val<T>> {
        self.opt(map, key, decode)?.ok_or_else(|| {
            self.report(
                Phase::Value,
                map.place_of(key).origin(),
                "missing required key",
            )
        })
    }

    /// Checks a value on its own, turning it into its validated type.
    fn check<T, U>(
        &mut self,
        given: Res<Val<T>>,
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Res<Val<U>> {
        let Val { value, at } = given?;
        match check(value) {
            Ok(value) => Ok(Val { value, at }),
            Err(message) => Err(self.report(Phase::Value, at, message)),
        }
    }

    fn check_opt<T, U>(
        &mut self,
        given: Field<T>,
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Field<U> {
        given?.map(|given| self.check(Ok(given), check)).transpose()
    }

    fn type_error(&mut self, node: &Node, at: &Place, expected: &str) -> Reported {
        let got = match &node.kind {
            Kind::Map(_) => "a mapping".to_owned(),
            Kind::Seq(_) => "a list".to_owned(),
            Kind::Scalar { text, plain: true } => format!("`{text}`"),
            Kind::Scalar { text, plain: false } => format!("the quoted string {text:?}"),
        };
        self.report(
            Phase::Value,
            at.origin(),
            format!("expected {expected}, got {got}"),
        )
    }

    // Scalars, read as the schema expects.

    /// Any scalar, as text: where a string is expected, `3` is "3".
    fn text<'n>(&mut self, node: &'n Node, at: &Place, expected: &str) -> Res<&'n str> {
        match &node.kind {
            Kind::Scalar { text, .. } => Ok(text),
            _ => Err(self.type_error(node, at, expected)),
        }
    }

    fn string(&mut self, node: &Node, at: &Place) -> Res<String> {
        match self.text(node, at, "a string")? {
            "" => Err(self.report(Phase::Value, at.origin(), "must not be empty")),
            text => Ok(text.to_owned()),
        }
    }

    /// Numbers are plain scalars; a quoted one is a string.
    fn integer(&mut self, node: &Node, at: &Place) -> Res<u64> {
        match &node.kind {
            Kind::Scalar { text, plain: true } => text.parse().map_err(|_| {
                if text.bytes().all(|b| b.is_ascii_digit()) {
                    self.report(
                        Phase::Value,
                        at.origin(),
                        format!("must be at most {}", u64::MAX),
                    )
                } else {
                    self.type_error(node, at, INTEGER)
                }
            }),
            _ => Err(self.type_error(node, at, INTEGER)),
        }
    }

    fn number(&mut self, node: &Node, at: &Place) -> Res<f64> {
        match &node.kind {
            Kind::Scalar { text, plain: true } => text
                .parse()
                .map_err(|_| self.type_error(node, at, "a number")),
            _ => Err(self.type_error(node, at, "a number")),
        }
    }

    fn duration(&mut self, node: &Node, at: &Place) -> Res<Duration> {
        let text = self.text(node, at, DURATION)?;
        duration::parse(text).ok_or_else(|| self.type_error(node, at, DURATION))
    }

    /// An IP literal, not a host name: Envoy's `override_host` needs an address.
    fn address(&mut self, node: &Node, at: &Place) -> Res<SocketAddr> {
        let text = self.text(node, at, ADDRESS)?;
        text.parse().map_err(|_| self.type_error(node, at, ADDRESS))
    }

    fn metrics_url(&mut self, node: &Node, at: &Place) -> Res<String> {
        let url = self.string(node, at)?;
        let has_host = |scheme| {
            url.strip_prefix(scheme)
                .is_some_and(|rest: &str| !rest.is_empty())
        };
        if has_host("http://") || has_host("https://") {
            Ok(url)
        } else {
            let message =
                format!("must start with http:// or https:// and name a host, got `{url}`");
            Err(self.report(Phase::Value, at.origin(), message))
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

    fn keyword<T: Copy>(
        &mut self,
        node: &Node,
        at: &Place,
        options: &[T],
        name: fn(T) -> &'static str,
    ) -> Res<T> {
        let text = self.text(node, at, "a string")?;
        options
            .iter()
            .copied()
            .find(|option| name(*option) == text)
            .ok_or_else(|| {
                let names: Vec<_> = options.iter().map(|option| name(*option)).collect();
                let message = format!("expected one of: {}; got `{text}`", names.join(", "));
                self.report(Phase::Value, at.origin(), message)
            })
    }
}

fn at_least_one(n: u64) -> Result<NonZeroU64, String> {
    NonZeroU64::new(n).ok_or_else(|| "must be at least 1".to_owned())
}

fn at_least_one_u32(n: u64) -> Result<NonZeroU32, String> {
    NonZeroU32::try_from(at_least_one(n)?).map_err(|_| format!("must be at most {}", u32::MAX))
}

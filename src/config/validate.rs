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
use std::path::PathBuf;
use std::time::Duration;

use super::{
    BalanceKnobs, CacheAwareKnobs, Config, DepthRatio, LoadConfig, LoadSource, Mode, ModeKind,
    ModelMatch, Overrides, PolicyConfig, PoolConfig, QueueGate, RelThreshold, TokenizerConfig,
    WorkerConfig,
};
use crate::worker::{Engine, Role};
use cachepick_decode::duration;
use cachepick_decode::{
    Decode, Field, Map, Node, Origin, Phase, Place, Problems, Reported, Res, Val, at_least_one,
    at_least_one_u32, at_least_one_usize, blame, overridden, value_or, with_default,
};
use cachepick_tokenizer::decode_tokenizer;

const ROOT_KEYS: &[&str] = &[
    "listen",
    "metrics_listen",
    "max_body_bytes",
    "debug_endpoints",
    "policy",
    "load",
    "pools",
];
const POLICY_KEYS: &[&str] = &[
    "mode",
    "worker_queue_limit",
    "saturation_queue_floor",
    "min_load_choices",
    "min_match_tokens",
    "pin_depth_ratio",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "cache_threshold",
    "max_fallbacks",
];
const LOAD_KEYS: &[&str] = &[
    "scrape_interval",
    "scrape_timeout",
    "freshness",
    "max_body_bytes",
    "max_concurrent_scrapes",
];
const POOL_KEYS: &[&str] = &[
    "model",
    "engine",
    "block_size",
    "tokenizer",
    "chat_template",
    "segment_cache_entries",
    "default_cache_blocks",
    "policy",
    "workers",
];
const WORKER_KEYS: &[&str] = &[
    "endpoint",
    "metrics_url",
    "load_source",
    "loads_url",
    "role",
    "dp_size",
    "max_running_requests",
    "max_total_tokens",
];

const HTTP_URL: &str = "a plain http:// URL naming a host, such as http://10.0.0.11:8000/metrics";

/// Decodes and checks the whole configuration; `Ok` only means every value could be built; the
/// configuration is valid only if, in addition, no problem was recorded (e.g. an unknown key).
pub(super) fn validate(root: &Node, overrides: &Overrides, problems: &mut Problems) -> Res<Config> {
    Validator { problems }.config(root, overrides)
}

/// A pool whose pieces are decoded; it is built after the checks across pools.
struct PoolDraft {
    model: Res<Val<ModelMatch>>,
    engine: Res<Engine>,
    block_size: Res<NonZeroU32>,
    tokenizer: Res<TokenizerConfig>,
    chat_template: Res<Option<PathBuf>>,
    segment_cache_entries: Res<NonZeroUsize>,
    default_cache_blocks: Res<NonZeroUsize>,
    workers: Res<Vec<Res<WorkerDraft>>>,
    policy: Res<PolicyConfig>,
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
            chat_template: self.chat_template?,
            segment_cache_entries: self.segment_cache_entries?,
            default_cache_blocks: self.default_cache_blocks?,
            workers: self
                .workers?
                .into_iter()
                .map(|worker| worker?.build())
                .collect::<Res<_>>()?,
            policy: self.policy?,
        })
    }
}

impl WorkerDraft {
    fn build(self) -> Res<WorkerConfig> {
        let endpoint = self.endpoint?.value;
        let load_source = self.load_source?;
        let loads_url = self.loads_url?;
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
        })
    }
}

/// The decoder of cachepick's own file: the shared walker plus this schema's methods.
struct Validator<'p> {
    problems: &'p mut Problems,
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
        let max_body_bytes =
            self.positive_size(&root, "max_body_bytes", Config::DEFAULT_MAX_BODY_BYTES);
        let debug_endpoints = self.opt(&root, "debug_endpoints", Self::boolean);
        let policy = match self.section(&root, "policy", POLICY_KEYS) {
            Ok(map) => {
                let (keys, given) = self.policy_keys(&map, Some(overrides));
                self.resolve_policy(keys, &given, None)
            }
            Err(reported) => Resolved::failed(reported),
        };
        let load = self
            .section(&root, "load", LOAD_KEYS)
            .and_then(|map| self.load(&map));
        let pools = self.pools(&root, &policy);
        Ok(Config {
            listen: listen?.value,
            metrics_listen: metrics_listen?.value,
            policy: policy.policy?,
            load: load?,
            pools: pools?,
            max_body_bytes: max_body_bytes?.value,
            debug_endpoints: debug_endpoints?.is_none_or(|given| given.value),
        })
    }

    /// One scope's policy keys (the top-level `policy` with the flags, or a pool's), each checked on its
    /// own, and where each mode-specific key was given, whether or not its value passed.
    fn policy_keys(&mut self, map: &Map, overrides: Option<&Overrides>) -> (PolicyKeys, Given) {
        let flag = |pick: fn(&Overrides) -> Option<u64>| overrides.and_then(pick);
        let mode = self.opt(map, "mode", |v, node, at| {
            v.keyword(node, at, &ModeKind::ALL, ModeKind::as_str)
        });
        let limit = self.opt(map, "worker_queue_limit", Self::integer);
        let limit = overridden(
            limit,
            flag(|o| o.worker_queue_limit),
            "--worker-queue-limit",
        );
        let limit = self.check_opt(limit, at_least_one);
        let floor = self.opt(map, "saturation_queue_floor", Self::integer);
        let floor = overridden(
            floor,
            flag(|o| o.saturation_queue_floor),
            "--saturation-queue-floor",
        );
        let floor = self.check_opt(floor, at_least_one);
        let choices = self.opt(map, "min_load_choices", Self::integer);
        let choices = overridden(choices, flag(|o| o.min_load_choices), "--min-load-choices");
        let choices = self.check_opt(choices, at_least_one_usize);
        let min_match_tokens = self.opt(map, "min_match_tokens", Self::integer);
        let pin_depth_ratio = self.opt(map, "pin_depth_ratio", Self::number);
        let pin_depth_ratio = self.check_opt(pin_depth_ratio, share);
        let abs_threshold = self.opt(map, "balance_abs_threshold", Self::integer);
        let rel_threshold = self.opt(map, "balance_rel_threshold", Self::number);
        let rel_threshold = self.check_opt(rel_threshold, |factor| {
            RelThreshold::new(factor).ok_or_else(|| {
                format!(
                    "must be greater than 1, got {factor}: the rule compares max > factor × min"
                )
            })
        });
        let cache_threshold = self.opt(map, "cache_threshold", Self::number);
        let cache_threshold = self.check_opt(cache_threshold, share);
        let fallbacks = self.opt(map, "max_fallbacks", Self::integer);
        let fallbacks = self.check_opt(fallbacks, |n| {
            usize::try_from(n)
                .ok()
                .filter(|n| *n <= PolicyConfig::MAX_FALLBACKS_LIMIT)
                .ok_or_else(|| format!("must be at most {}", PolicyConfig::MAX_FALLBACKS_LIMIT))
        });
        let mut given = Vec::new();
        for knob in Knob::ALL {
            if let Some(name) = knob
                .flag()
                .filter(|_| overrides.is_some_and(|o| knob.flagged(o)))
            {
                given.push((knob, Origin::Flag(name)));
            }
            if let Some((_, at)) = map.get(knob.key()) {
                given.push((knob, at.origin()));
            }
        }
        let keys = PolicyKeys {
            mode,
            limit,
            floor,
            min_load_choices: choices,
            min_match_tokens,
            pin_depth_ratio,
            abs_threshold,
            rel_threshold,
            cache_threshold,
            max_fallbacks: fallbacks,
        };
        (keys, given)
    }

    /// A scope's policy: its mode (its own, else the parent's, else the default), the mode-specific keys
    /// given here checked against that mode, then every key not given here taken from the parent, and
    /// the policy built from what is in force.
    fn resolve_policy(
        &mut self,
        keys: PolicyKeys,
        given: &Given,
        parent: Option<&Resolved>,
    ) -> Resolved {
        let inherits_mode = matches!(keys.mode, Ok(None)) && parent.is_some();
        let mode: Res<Val<ModeKind>> = match (keys.mode.clone(), parent) {
            (Ok(Some(mode)), _) => Ok(mode),
            // A resolved parent's mode is always set; the default stands in should it not be.
            (Ok(None), Some(parent)) => parent.keys.mode.clone().map(|mode| {
                mode.unwrap_or(Val {
                    value: ModeKind::default(),
                    at: Origin::Default,
                })
            }),
            (Ok(None), None) => Ok(Val {
                value: ModeKind::default(),
                at: Origin::Default,
            }),
            (Err(reported), _) => Err(reported),
        };

        // A key the mode does not read is a mistake wherever it was given (file or flag): the operator
        // believes it does something.
        let mut misplaced: Vec<(Knob, Reported)> = Vec::new();
        if let Ok(mode) = &mode {
            for (knob, at) in given.iter().filter(|(knob, _)| knob.mode() != mode.value) {
                let message = format!(
                    "ignored by {}: remove it (it only applies to {})",
                    mode_by(mode, inherits_mode),
                    knob.mode().as_str()
                );
                let reported = self.report(Phase::Cross, at.clone(), message);
                misplaced.push((*knob, reported));
            }
        }
        let own = |knob: Knob| misplaced.iter().find(|(k, _)| *k == knob).map(|(_, r)| *r);
        let limit_here = !matches!(keys.limit, Ok(None));
        let floor_here = !matches!(keys.floor, Ok(None));
        let effective = PolicyKeys {
            mode: mode.clone().map(Some),
            limit: inherit(
                keys.limit,
                own(Knob::WorkerQueueLimit),
                parent.map(|p| &p.keys.limit),
            ),
            floor: inherit(
                keys.floor,
                own(Knob::SaturationQueueFloor),
                parent.map(|p| &p.keys.floor),
            ),
            min_load_choices: inherit(
                keys.min_load_choices,
                own(Knob::MinLoadChoices),
                parent.map(|p| &p.keys.min_load_choices),
            ),
            min_match_tokens: inherit(
                keys.min_match_tokens,
                own(Knob::MinMatchTokens),
                parent.map(|p| &p.keys.min_match_tokens),
            ),
            pin_depth_ratio: inherit(
                keys.pin_depth_ratio,
                own(Knob::PinDepthRatio),
                parent.map(|p| &p.keys.pin_depth_ratio),
            ),
            abs_threshold: inherit(
                keys.abs_threshold,
                own(Knob::BalanceAbsThreshold),
                parent.map(|p| &p.keys.abs_threshold),
            ),
            rel_threshold: inherit(
                keys.rel_threshold,
                own(Knob::BalanceRelThreshold),
                parent.map(|p| &p.keys.rel_threshold),
            ),
            cache_threshold: inherit(
                keys.cache_threshold,
                own(Knob::CacheThreshold),
                parent.map(|p| &p.keys.cache_threshold),
            ),
            max_fallbacks: inherit(
                keys.max_fallbacks,
                None,
                parent.map(|p| &p.keys.max_fallbacks),
            ),
        };
        // Checked where one of the two is given; a pool that sets neither takes its parent's verdict,
        // so a bad pair at the top level is reported once, not once per pool.
        let gate = match parent {
            Some(parent) if !limit_here && !floor_here => parent.gate,
            _ => self.gate(
                effective.limit.clone(),
                effective.floor.clone(),
                limit_here,
                floor_here,
            ),
        };
        let policy = self.build_policy(&effective, gate);
        Resolved {
            keys: effective,
            gate,
            policy,
        }
    }

    /// The policy in force, from keys that each passed their checks (defaults for the absent ones).
    fn build_policy(
        &mut self,
        keys: &PolicyKeys,
        gate: Res<Option<QueueGate>>,
    ) -> Res<PolicyConfig> {
        let mode = keys
            .mode
            .clone()?
            .map_or(ModeKind::default(), |mode| mode.value);
        let max_fallbacks = with_default(
            keys.max_fallbacks.clone(),
            PolicyConfig::DEFAULT_MAX_FALLBACKS,
        )?
        .value;
        let mode = match mode {
            ModeKind::CacheAware => {
                let defaults = CacheAwareKnobs::default();
                Mode::CacheAware(CacheAwareKnobs {
                    gate: gate?,
                    min_load_choices: value_or(
                        keys.min_load_choices.clone(),
                        defaults.min_load_choices,
                    )?,
                    min_match_tokens: value_or(
                        keys.min_match_tokens.clone(),
                        defaults.min_match_tokens,
                    )?,
                    pin_depth_ratio: value_or(
                        keys.pin_depth_ratio.clone(),
                        defaults.pin_depth_ratio,
                    )?,
                })
            }
            ModeKind::RoundRobin => Mode::RoundRobin,
            ModeKind::LeastLoad => Mode::LeastLoad,
            ModeKind::BalanceThreshold => {
                let defaults = BalanceKnobs::default();
                Mode::BalanceThreshold(BalanceKnobs {
                    abs_threshold: value_or(keys.abs_threshold.clone(), defaults.abs_threshold)?,
                    rel_threshold: value_or(keys.rel_threshold.clone(), defaults.rel_threshold)?,
                    cache_threshold: value_or(
                        keys.cache_threshold.clone(),
                        defaults.cache_threshold,
                    )?,
                })
            }
        };
        Ok(PolicyConfig {
            mode,
            max_fallbacks,
        })
    }

    /// The queue gate, once the limit and the floor each passed their own checks. `limit_here` and
    /// `floor_here` say which of the two the scope gave itself (the other is inherited): a disagreement
    /// is reported at the one given here.
    fn gate(
        &mut self,
        limit: Field<NonZeroU64>,
        floor: Field<NonZeroU64>,
        limit_here: bool,
        floor_here: bool,
    ) -> Res<Option<QueueGate>> {
        match (limit?, floor?) {
            (limit, None) => Ok(limit.and_then(|limit| QueueGate::new(limit.value, None))),
            (None, Some(floor)) => {
                let message = "requires a queue limit, policy.worker_queue_limit or --worker-queue-limit \
                               (there is no diversion to cancel without it)";
                Err(self.report(Phase::Cross, floor.at, message))
            }
            (Some(limit), Some(floor)) => match QueueGate::new(limit.value, Some(floor.value)) {
                Some(gate) => Ok(Some(gate)),
                None => {
                    let floor_blamed = floor_here || !limit_here;
                    let named = |val: &Val<NonZeroU64>, key: &str, here: bool| {
                        if here {
                            format!("{} ({})", val.name(key), val.value)
                        } else {
                            format!("{key} ({}, inherited from {})", val.value, val.at)
                        }
                    };
                    let message = format!(
                        "{} must be at most {}: a floor above the limit would declare the fleet saturated \
                         while the gate still admits some workers",
                        named(&floor, "saturation_queue_floor", floor_here),
                        named(&limit, "worker_queue_limit", limit_here),
                    );
                    let at = if floor_blamed { floor.at } else { limit.at };
                    Err(self.report(Phase::Cross, at, message))
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
        let body = self.positive_size(map, "max_body_bytes", LoadConfig::DEFAULT_MAX_BODY_BYTES);
        let scrapes = self.opt(map, "max_concurrent_scrapes", Self::integer);
        let scrapes = self.check(
            with_default(scrapes, LoadConfig::DEFAULT_MAX_CONCURRENT_SCRAPES as u64),
            at_least_one_usize,
        );
        timeout_fits?;
        freshness_lasts?;
        Ok(LoadConfig {
            scrape_interval: interval?.value,
            scrape_timeout: timeout?.value,
            freshness: freshness?.value,
            max_body_bytes: body?.value,
            max_concurrent_scrapes: scrapes?.value,
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

    fn pools(&mut self, root: &Map, policy: &Resolved) -> Res<Vec<PoolConfig>> {
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
            .map(|(i, item)| self.pool(item, &at.index(i, item.line), policy))
            .collect();
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
        let tokenizer = match map.get("tokenizer") {
            Some((node, at)) => decode_tokenizer(self, node, &at),
            None => Ok(TokenizerConfig::default()),
        };
        // Kept as written: whether the file exists and parses is judged where it is loaded.
        let chat_template = self
            .opt(&map, "chat_template", Self::string)
            .map(|path| path.map(|path| PathBuf::from(path.value)));
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
        // The pool's own keys over the top-level ones; flags apply to the top level only.
        let policy = match self.section(&map, "policy", POLICY_KEYS) {
            Ok(section) => {
                let (keys, given) = self.policy_keys(&section, None);
                self.resolve_policy(keys, &given, Some(parent)).policy
            }
            Err(reported) => Err(reported),
        };
        let engine = engine.map(|engine| engine.value);
        let workers = self.workers(&map, engine.ok());
        Ok(PoolDraft {
            model,
            engine,
            block_size: block_size.map(|size| size.value),
            tokenizer,
            chat_template,
            segment_cache_entries,
            default_cache_blocks,
            workers,
            policy,
        })
    }

    /// `engine` is the pool's, `None` if it was rejected (the checks against it are then skipped).
    fn workers(&mut self, pool: &Map, engine: Option<Engine>) -> Res<Vec<Res<WorkerDraft>>> {
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
            .map(|(i, item)| self.worker(item, &at.index(i, item.line), engine))
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

    fn worker(&mut self, node: &Node, at: &Place, engine: Option<Engine>) -> Res<WorkerDraft> {
        let map = self.mapping(node, at, WORKER_KEYS)?;
        let endpoint = self.required(&map, "endpoint", Self::address).and_then(|endpoint| {
            if endpoint.value.ip().is_unspecified() || endpoint.value.port() == 0 {
                let message = format!(
                    "{} is not an address Envoy can send a request to: give the worker's own IP and port",
                    endpoint.value
                );
                return Err(self.report(Phase::Value, endpoint.at, message));
            }
            Ok(endpoint)
        });
        let metrics_url = self.opt(&map, "metrics_url", |v, node, at| {
            v.http_url(node, at, "metrics")
        });
        let load_source = self.opt(&map, "load_source", |v, node, at| {
            v.keyword(
                node,
                at,
                &[LoadSource::Metrics, LoadSource::Loads],
                LoadSource::as_str,
            )
        });
        let loads_url = self.opt(&map, "loads_url", |v, node, at| {
            v.http_url(node, at, "/v1/loads")
        });
        let (load_source, loads_url) = self.load_source(
            with_default(load_source, LoadSource::default()),
            loads_url,
            engine,
        );
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
            |n| {
                at_least_one_u32(n).and_then(|size| {
                    if size.get() > WorkerConfig::MAX_DP_SIZE {
                        Err(format!(
                            "must be at most {}: the scraper keeps a sample per rank",
                            WorkerConfig::MAX_DP_SIZE
                        ))
                    } else {
                        Ok(size)
                    }
                })
            },
        );
        let max_running_requests = self.opt(&map, "max_running_requests", Self::integer);
        let max_running_requests = self.check_opt(max_running_requests, at_least_one);
        let max_total_tokens = self.opt(&map, "max_total_tokens", Self::integer);
        let max_total_tokens = self.check_opt(max_total_tokens, at_least_one);
        let value = |field: Field<NonZeroU64>| field.map(|given| given.map(|given| given.value));
        Ok(WorkerDraft {
            endpoint,
            metrics_url: metrics_url.map(|url| url.map(|url| url.value)),
            load_source,
            loads_url,
            role: with_default(role, WorkerConfig::DEFAULT_ROLE).map(|role| role.value),
            dp_size: dp_size.map(|size| size.value),
            max_running_requests: value(max_running_requests),
            max_total_tokens: value(max_total_tokens),
        })
    }

    /// A worker's load source against its pool's engine, and its `loads_url` against the source; each
    /// check is skipped when a value it reads was rejected.
    fn load_source(
        &mut self,
        source: Res<Val<LoadSource>>,
        url: Field<String>,
        engine: Option<Engine>,
    ) -> (Res<LoadSource>, Res<Option<String>>) {
        let source = source.and_then(|source| match (source.value, engine) {
            (LoadSource::Loads, Some(engine)) if engine != Engine::Sglang => {
                let message = format!(
                    "load_source: loads reads SGLang's /v1/loads; engine {} has no such endpoint",
                    engine.as_str()
                );
                Err(self.report(Phase::Cross, source.at, message))
            }
            _ => Ok(source.value),
        });
        let url = url.and_then(|url| match (url, source) {
            (Some(url), Ok(LoadSource::Metrics)) => Err(self.report(
                Phase::Cross,
                url.at,
                "loads_url is read only with load_source: loads",
            )),
            (url, _) => Ok(url.map(|url| url.value)),
        });
        (source, url)
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

    /// A URL the scraper can request as is: plain `http://` (it speaks no TLS) with a host, parsed the
    /// way the HTTP client will parse it. `serves` names what the engine exposes there.
    fn http_url(&mut self, node: &Node, at: &Place, serves: &str) -> Res<String> {
        let url = self.string(node, at)?;
        if url.starts_with("https://") {
            let message = format!(
                "TLS scraping is not supported: expose the engine's {serves} over plain HTTP on the pod \
                 network, got `{url}`"
            );
            return Err(self.report(Phase::Value, at.origin(), message));
        }
        let has_host = url.starts_with("http://")
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

fn share(value: f64) -> Result<DepthRatio, String> {
    DepthRatio::new(value).ok_or_else(|| format!("must be between 0 and 1, got {value}"))
}

/// The keys that belong to one mode; given under another, they are errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Knob {
    WorkerQueueLimit,
    SaturationQueueFloor,
    MinLoadChoices,
    MinMatchTokens,
    PinDepthRatio,
    BalanceAbsThreshold,
    BalanceRelThreshold,
    CacheThreshold,
}

impl Knob {
    const ALL: [Knob; 8] = [
        Knob::WorkerQueueLimit,
        Knob::SaturationQueueFloor,
        Knob::MinLoadChoices,
        Knob::MinMatchTokens,
        Knob::PinDepthRatio,
        Knob::BalanceAbsThreshold,
        Knob::BalanceRelThreshold,
        Knob::CacheThreshold,
    ];

    fn key(self) -> &'static str {
        match self {
            Knob::WorkerQueueLimit => "worker_queue_limit",
            Knob::SaturationQueueFloor => "saturation_queue_floor",
            Knob::MinLoadChoices => "min_load_choices",
            Knob::MinMatchTokens => "min_match_tokens",
            Knob::PinDepthRatio => "pin_depth_ratio",
            Knob::BalanceAbsThreshold => "balance_abs_threshold",
            Knob::BalanceRelThreshold => "balance_rel_threshold",
            Knob::CacheThreshold => "cache_threshold",
        }
    }

    /// The mode that reads it.
    fn mode(self) -> ModeKind {
        match self {
            Knob::WorkerQueueLimit
            | Knob::SaturationQueueFloor
            | Knob::MinLoadChoices
            | Knob::MinMatchTokens
            | Knob::PinDepthRatio => ModeKind::CacheAware,
            Knob::BalanceAbsThreshold | Knob::BalanceRelThreshold | Knob::CacheThreshold => {
                ModeKind::BalanceThreshold
            }
        }
    }

    /// The flag that sets it at the top level.
    fn flag(self) -> Option<&'static str> {
        match self {
            Knob::WorkerQueueLimit => Some("--worker-queue-limit"),
            Knob::SaturationQueueFloor => Some("--saturation-queue-floor"),
            Knob::MinLoadChoices => Some("--min-load-choices"),
            _ => None,
        }
    }

    fn flagged(self, overrides: &Overrides) -> bool {
        match self {
            Knob::WorkerQueueLimit => overrides.worker_queue_limit.is_some(),
            Knob::SaturationQueueFloor => overrides.saturation_queue_floor.is_some(),
            Knob::MinLoadChoices => overrides.min_load_choices.is_some(),
            _ => false,
        }
    }
}

/// Where each mode-specific key of a scope was given: its line, or its flag (both when a flag replaced
/// a key of the file).
type Given = Vec<(Knob, Origin)>;

/// The policy keys of one scope, each checked on its own; `Ok(None)` is absent.
#[derive(Clone)]
struct PolicyKeys {
    mode: Field<ModeKind>,
    limit: Field<NonZeroU64>,
    floor: Field<NonZeroU64>,
    min_load_choices: Field<NonZeroUsize>,
    min_match_tokens: Field<u64>,
    pin_depth_ratio: Field<DepthRatio>,
    abs_threshold: Field<u64>,
    rel_threshold: Field<RelThreshold>,
    cache_threshold: Field<DepthRatio>,
    max_fallbacks: Field<usize>,
}

/// A scope's policy once resolved: the keys in force (a pool inherits them), the gate's verdict, and
/// the policy built from them.
struct Resolved {
    keys: PolicyKeys,
    gate: Res<Option<QueueGate>>,
    policy: Res<PolicyConfig>,
}

impl Resolved {
    /// A section that is not even a mapping: everything in it is already reported.
    fn failed(reported: Reported) -> Resolved {
        Resolved {
            keys: PolicyKeys {
                mode: Err(reported),
                limit: Err(reported),
                floor: Err(reported),
                min_load_choices: Err(reported),
                min_match_tokens: Err(reported),
                pin_depth_ratio: Err(reported),
                abs_threshold: Err(reported),
                rel_threshold: Err(reported),
                cache_threshold: Err(reported),
                max_fallbacks: Err(reported),
            },
            gate: Err(reported),
            policy: Err(reported),
        }
    }
}

/// A key in force: the scope's own (rejected if `misplaced`), else the parent's.
fn inherit<T: Clone>(
    own: Field<T>,
    misplaced: Option<Reported>,
    parent: Option<&Field<T>>,
) -> Field<T> {
    if let Some(reported) = misplaced {
        return Err(reported);
    }
    match (own, parent) {
        (Ok(None), Some(parent)) => parent.clone(),
        (own, _) => own,
    }
}

/// How a misplaced key's message names the mode in force: by its key and line, as the default, or as
/// the top level's when a pool inherits it.
fn mode_by(mode: &Val<ModeKind>, inherited: bool) -> String {
    let name = mode.value.as_str();
    match &mode.at {
        Origin::Yaml { path, line } if inherited => {
            format!("{path} {name} (line {line}), which this pool inherits")
        }
        Origin::Yaml { path, line } => format!("{path} {name} (line {line})"),
        Origin::Flag(flag) => format!("{flag} {name}"),
        Origin::Default => format!("policy.mode {name} (the default)"),
    }
}

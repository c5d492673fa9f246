//! Schema of the simulator's file (`cachepick sim --config`), decoded with the same walker as
//! cachepick's own configuration: every problem listed with its YAML path and line, unknown keys refused.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use super::error::{Phase, Problems, Res};
use super::validate::{Field, Map, Val, Validator, at_least_one_u32, overridden, with_default};
use super::yaml::{Node, Place};
use super::{SimConfig, SimParams, TokenizerConfig};
use crate::worker::Engine;

const SIM_KEYS: &[&str] = &[
    "engine",
    "model",
    "workers",
    "host",
    "base_port",
    "seed",
    "block_size",
    "tokenizer",
    "chat_template",
    "dp_size",
];
/// The keys of `SimParams`, which `/admin/config` may also change at run time.
pub(super) const PARAM_KEYS: &[&str] = &[
    "kv_blocks",
    "max_running",
    "max_queue",
    "max_model_len",
    "default_max_tokens",
    "prefill_overhead",
    "prefill_per_token",
    "inter_token_latency",
    "load_slowdown",
    "jitter",
    "time_scale",
    "failure_rate",
];

/// Values given as `cachepick sim` flags; each replaces the file's value and is validated like it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimOverrides {
    /// `--engine`
    pub engine: Option<Engine>,
    /// `--workers`
    pub workers: Option<u64>,
    /// `--host`
    pub host: Option<IpAddr>,
    /// `--base-port`
    pub base_port: Option<u64>,
    /// `--seed`
    pub seed: Option<u64>,
    /// `--time-scale`
    pub time_scale: Option<f64>,
    /// `--dp-size`
    pub dp_size: Option<u64>,
}

/// Decodes and checks a simulator file; `Ok` only means every value could be built (see `validate`).
pub(super) fn validate(
    root: &Node,
    overrides: &SimOverrides,
    problems: &mut Problems,
) -> Res<SimConfig> {
    Validator { problems }.sim(root, overrides)
}

fn ratio(max: f64) -> impl FnOnce(f64) -> Result<f64, String> {
    move |value| {
        if value.is_finite() && (0.0..=max).contains(&value) {
            Ok(value)
        } else {
            Err(format!("must be between 0 and {max}"))
        }
    }
}

/// Decodes a change of model parameters: only the parameter keys, each defaulting to `base`.
pub(super) fn validate_params(
    root: &Node,
    base: &SimParams,
    problems: &mut Problems,
) -> Res<SimParams> {
    let mut validator = Validator { problems };
    let map = validator.mapping(root, &Place::root(root.line), PARAM_KEYS)?;
    validator.params(&map, base, None)
}

impl Validator<'_> {
    fn sim(&mut self, root: &Node, overrides: &SimOverrides) -> Res<SimConfig> {
        let keys: Vec<&str> = SIM_KEYS.iter().chain(PARAM_KEYS).copied().collect();
        let map = self.mapping(root, &Place::root(root.line), &keys)?;
        let defaults = SimParams::default();

        let engine = self.opt(&map, "engine", |v, node, at| {
            v.keyword(node, at, &[Engine::Vllm, Engine::Sglang], Engine::as_str)
        });
        let engine = match overridden(engine, overrides.engine, "--engine") {
            Ok(Some(engine)) => Ok(engine.value),
            Ok(None) => Err(self.report(
                Phase::Value,
                map.place_of("engine").origin(),
                "missing: set `engine: vllm|sglang` or pass --engine",
            )),
            Err(reported) => Err(reported),
        };
        let model = self.opt(&map, "model", Self::string);
        let model = with_default(model, SimConfig::DEFAULT_MODEL.to_owned());
        let workers = self.opt(&map, "workers", Self::integer);
        let workers = with_default(overridden(workers, overrides.workers, "--workers"), 1);
        let workers = self.check(workers, |n| {
            if n > u64::from(SimConfig::MAX_WORKERS) {
                Err(format!("must be at most {}", SimConfig::MAX_WORKERS))
            } else {
                at_least_one_u32(n)
            }
        });
        let host = self.opt(&map, "host", |v, node, at| {
            let text = v.text(node, at, "an IP address such as 127.0.0.1")?;
            text.parse::<IpAddr>()
                .map_err(|_| v.type_error(node, at, "an IP address such as 127.0.0.1"))
        });
        let host = with_default(
            overridden(host, overrides.host, "--host"),
            SimConfig::DEFAULT_HOST,
        );
        // The simulator answers anyone who connects; it stays on the machine.
        let host = self.check(host, |host| {
            if host.is_loopback() {
                Ok(host)
            } else {
                Err(format!(
                    "must be a loopback address such as 127.0.0.1 (the simulator is for tests and \
                     demos on one machine), got {host}"
                ))
            }
        });
        let base_port = self.opt(&map, "base_port", Self::integer);
        let base_port = overridden(base_port, overrides.base_port, "--base-port");
        let base_port = self.check_opt(base_port, |port| {
            u16::try_from(port)
                .ok()
                .filter(|port| *port > 0)
                .ok_or_else(|| "must be a port between 1 and 65535".to_owned())
        });
        let seed = self.opt(&map, "seed", Self::integer);
        let seed = with_default(
            overridden(seed, overrides.seed, "--seed"),
            SimConfig::DEFAULT_SEED,
        );
        let block_size = self.positive_u32(&map, "block_size", SimConfig::DEFAULT_BLOCK_SIZE);
        let tokenizer = match map.get("tokenizer") {
            Some((node, at)) => self.tokenizer(node, &at),
            None => Ok(TokenizerConfig::default()),
        };
        let chat_template = self
            .opt(&map, "chat_template", Self::string)
            .map(|path| path.map(|path| PathBuf::from(path.value)));
        let dp_size = self.opt(&map, "dp_size", Self::integer);
        let dp_size = with_default(overridden(dp_size, overrides.dp_size, "--dp-size"), 1);
        let dp_size = self.check(dp_size, |n| {
            if n > 1024 {
                Err("must be at most 1024".to_owned())
            } else {
                at_least_one_u32(n)
            }
        });

        let params = self.params(&map, &defaults, overrides.time_scale);

        Ok(SimConfig {
            engine: engine?,
            model: model?.value,
            workers: workers?.value,
            host: host?.value,
            base_port: base_port?.map(|port| port.value),
            seed: seed?.value,
            block_size: block_size?,
            tokenizer: tokenizer?,
            chat_template: chat_template?,
            dp_size: dp_size?.value,
            params: params?,
        })
    }

    /// The model parameters, each defaulting to `base`: the built-in defaults for a file, the values in
    /// force for a change at run time (`/admin/config`).
    fn params(
        &mut self,
        map: &Map,
        base: &SimParams,
        time_scale_flag: Option<f64>,
    ) -> Res<SimParams> {
        let kv_blocks = self.positive_u32(map, "kv_blocks", base.kv_blocks.get());
        let max_running = self.positive_u32(map, "max_running", base.max_running.get());
        let max_queue = self.opt(map, "max_queue", Self::integer);
        let max_queue = self.check_opt(max_queue, |n| {
            u32::try_from(n).map_err(|_| format!("must be at most {}", u32::MAX))
        });
        let max_model_len = self.positive_u32(map, "max_model_len", base.max_model_len.get());
        let default_max_tokens =
            self.positive_u32(map, "default_max_tokens", base.default_max_tokens.get());
        let prefill_overhead = self.any_duration(map, "prefill_overhead", base.prefill_overhead);
        let prefill_per_token = self.any_duration(map, "prefill_per_token", base.prefill_per_token);
        let inter_token_latency =
            self.any_duration(map, "inter_token_latency", base.inter_token_latency);
        let load_slowdown = self.opt(map, "load_slowdown", Self::number);
        let load_slowdown = self.check(with_default(load_slowdown, base.load_slowdown), |f| {
            if f.is_finite() && (1.0..=100.0).contains(&f) {
                Ok(f)
            } else {
                Err("must be between 1 (no slow-down) and 100".to_owned())
            }
        });
        let jitter = self.opt(map, "jitter", Self::number);
        let jitter = self.check(with_default(jitter, base.jitter), ratio(0.5));
        let time_scale = self.opt(map, "time_scale", Self::number);
        let time_scale = overridden(time_scale, time_scale_flag, "--time-scale");
        let time_scale = self.check(with_default(time_scale, base.time_scale), |f| {
            if f.is_finite() && f > 0.0 && f <= 1000.0 {
                Ok(f)
            } else {
                Err(
                    "must be greater than 0 and at most 1000 (0.01 runs 100 times faster)"
                        .to_owned(),
                )
            }
        });
        let failure_rate = self.opt(map, "failure_rate", Self::number);
        let failure_rate = self.check(with_default(failure_rate, base.failure_rate), ratio(1.0));

        Ok(SimParams {
            kv_blocks: kv_blocks?,
            max_running: max_running?,
            max_queue: max_queue?.map(|n| n.value).or(base.max_queue),
            max_model_len: max_model_len?,
            default_max_tokens: default_max_tokens?,
            prefill_overhead: prefill_overhead?,
            prefill_per_token: prefill_per_token?,
            inter_token_latency: inter_token_latency?,
            load_slowdown: load_slowdown?.value,
            jitter: jitter?.value,
            time_scale: time_scale?.value,
            failure_rate: failure_rate?.value,
        })
    }

    fn positive_u32(&mut self, map: &Map, key: &str, default: u32) -> Res<NonZeroU32> {
        let given = self.opt(map, key, Self::integer);
        self.check(with_default(given, u64::from(default)), at_least_one_u32)
            .map(|n| n.value)
    }

    /// A duration that may be zero (a model without prefill overhead, say).
    fn any_duration(&mut self, map: &Map, key: &str, default: Duration) -> Res<Duration> {
        let given: Field<Duration> = self.opt(map, key, Self::duration);
        with_default(given, default).map(|Val { value, .. }| value)
    }
}

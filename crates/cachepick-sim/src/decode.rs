//! Schema of the simulator's file (`cachepick sim --config`) and of `/admin/config` changes, decoded with
//! the walker cachepick's own configuration uses (`cachepick-decode`): every problem listed with its
//! YAML path and line, unknown keys refused.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use std::path::Path;

use cachepick_decode::{
    ConfigError, Decode, Field, Map, Node, Phase, Place, Problems, Res, Val, at_least_one_u32,
    overridden, with_default,
};
use cachepick_tokenizer::{decode_chat_template, decode_tokenizer};

use crate::config::{
    Engine, KvEventsConfig, KvEventsFormat, Profile, SchedulePolicy, SimConfig, SimParams, Timing,
};

const SIM_KEYS: &[&str] = &[
    "timing",
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
    "prefill_workers",
    "kv_events",
];
/// The keys of `kv_events:`.
const KV_EVENTS_KEYS: &[&str] = &["format", "replay", "ring_batches", "topic", "base_port"];
/// The keys of `SimParams`, which `/admin/config` may also change at run time.
const PARAM_KEYS: &[&str] = &[
    "kv_blocks",
    "max_running",
    "max_queue",
    "max_model_len",
    "default_max_tokens",
    "prefill_overhead",
    "prefill_per_token",
    "inter_token_latency",
    "load_slowdown",
    "profile",
    "batch_tokens",
    "max_prefill_tokens",
    "schedule_policy",
    "jitter",
    "time_scale",
    "failure_rate",
];
/// The keys only the slots model reads.
const SLOTS_KEYS: &[&str] = &[
    "prefill_overhead",
    "prefill_per_token",
    "inter_token_latency",
    "load_slowdown",
];
/// The keys only the step model reads, and of them those only its SGLang scheduler reads.
const STEP_KEYS: &[&str] = &[
    "profile",
    "batch_tokens",
    "max_prefill_tokens",
    "schedule_policy",
];
const SGLANG_STEP_KEYS: &[&str] = &["max_prefill_tokens", "schedule_policy"];
/// The keys of a `profile:` mapping: the named profile it starts from and any coefficient replaced.
const PROFILE_KEYS: &[&str] = &[
    "base",
    "step_overhead_ms",
    "weight_read_ms",
    "per_token_us",
    "blend",
    "attention_pair_ns",
    "kv_read_ns",
    "per_sequence_us",
    "front_ms",
    "api_token_us",
    "api_output_us",
    "api_metrics_ms",
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
    /// `--kv-events FORMAT`: publish KV cache events in this format; the file's other `kv_events`
    /// settings (or their defaults) apply.
    pub kv_events: Option<KvEventsFormat>,
    /// `--timing`
    pub timing: Option<Timing>,
    /// `--profile NAME`
    pub profile: Option<String>,
    /// `--prefill-workers N`
    pub prefill_workers: Option<u64>,
}

/// Reads and validates a simulator file (`cachepick sim --config`), with `overrides` applied.
pub fn load(path: &Path, overrides: &SimOverrides) -> Result<SimConfig, ConfigError> {
    cachepick_decode::decode_file(path, |root, problems| {
        Decoder { problems }.sim(root, overrides)
    })
}

/// Validates simulator configuration `source`; an empty source is every default (flags still apply).
pub fn parse(
    source: &str,
    origin_name: &str,
    overrides: &SimOverrides,
) -> Result<SimConfig, ConfigError> {
    cachepick_decode::decode(source, origin_name, |root, problems| {
        Decoder { problems }.sim(root, overrides)
    })
}

/// Validates a change of model parameters (a JSON or YAML mapping of `SimParams` keys) for a worker of
/// `engine` under `timing`; keys not given keep their value in `base`.
pub fn parse_params(
    source: &str,
    base: &SimParams,
    timing: Timing,
    engine: Engine,
) -> Result<SimParams, ConfigError> {
    cachepick_decode::decode(source, "the request body", |root, problems| {
        let mut decoder = Decoder { problems };
        let map = decoder.mapping(root, &Place::root(root.line), PARAM_KEYS)?;
        decoder.model_keys(&map, timing, engine);
        let profile = decoder.profile(&map, &base.profile, None)?;
        decoder.params(&map, base, profile, None)
    })
}

/// The simulator schema's decoder: the shared walker plus the methods below.
struct Decoder<'p> {
    problems: &'p mut Problems,
}

impl Decode for Decoder<'_> {
    fn problems(&mut self) -> &mut Problems {
        self.problems
    }
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

impl Decoder<'_> {
    // Over 100 lines: each top-level key read once, in the file's order, with its flag override;
    // every problem is collected, none stops the rest.
    fn sim(&mut self, root: &Node, overrides: &SimOverrides) -> Res<SimConfig> {
        let keys: Vec<&str> = SIM_KEYS.iter().chain(PARAM_KEYS).copied().collect();
        let map = self.mapping(root, &Place::root(root.line), &keys)?;

        let engine = self.opt(&map, "engine", |v, node, at| {
            v.keyword(node, at, &Engine::ALL, Engine::as_str)
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
        let tokenizer = decode_tokenizer(self, &map);
        let chat_template = decode_chat_template(self, &map);
        let dp_size = self.opt(&map, "dp_size", Self::integer);
        let dp_size = with_default(overridden(dp_size, overrides.dp_size, "--dp-size"), 1);
        let dp_size = self.check(dp_size, |n| {
            if n > 1024 {
                Err("must be at most 1024".to_owned())
            } else {
                at_least_one_u32(n)
            }
        });
        // SGLang's disaggregation: the first N workers prefill, the rest decode; at least one of each.
        let prefill_workers = self.opt(&map, "prefill_workers", Self::integer);
        let prefill_workers = overridden(
            prefill_workers,
            overrides.prefill_workers,
            "--prefill-workers",
        );
        let prefill_workers = match (prefill_workers, &engine, &workers) {
            (Ok(Some(given)), Ok(engine), Ok(workers)) => {
                let total = u64::from(workers.value.get());
                if *engine != Engine::Sglang {
                    let message = "prefill_workers is SGLang's disaggregation_mode: vLLM's workers \
                                   serve either leg of a disaggregated request without one";
                    Err(self.report(Phase::Cross, given.at, message))
                } else if given.value == 0 || given.value >= total {
                    let message = format!(
                        "must leave at least one prefill and one decode worker: 1 to {}, got {}",
                        total.saturating_sub(1),
                        given.value
                    );
                    Err(self.report(Phase::Value, given.at, message))
                } else {
                    Ok(u32::try_from(given.value).ok())
                }
            }
            (Err(reported), ..) => Err(reported),
            _ => Ok(None),
        };

        let timing = self.opt(&map, "timing", |v, node, at| {
            v.keyword(node, at, &Timing::ALL, Timing::as_str)
        });
        let timing = with_default(
            overridden(timing, overrides.timing, "--timing"),
            Timing::Step,
        );
        let engine_kind = engine.as_ref().ok().copied().unwrap_or(Engine::Vllm);
        if let Ok(timing) = &timing {
            self.model_keys(&map, timing.value, engine_kind);
        }
        let profile = self.profile(&map, &Profile::default(), overrides.profile.as_deref());
        let params = match (&timing, profile) {
            (Ok(timing), Ok(profile)) => {
                let defaults = match timing.value {
                    Timing::Step => SimParams::step(engine_kind, &profile),
                    Timing::Slots => SimParams::slots(),
                };
                self.params(&map, &defaults, profile, overrides.time_scale)
            }
            (_, Err(reported)) => Err(reported),
            (Err(reported), _) => Err(*reported),
        };
        let kv_events = self.kv_events(&map, overrides.kv_events, engine.ok());

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
            timing: timing?.value,
            params: params?,
            kv_events: kv_events?,
            prefill_workers: prefill_workers?,
        })
    }

    /// `kv_events:`, or the `--kv-events` flag: absent (or null) and without the flag, no events. The
    /// format defaults to what the engine's current release publishes and must be that engine's.
    fn kv_events(
        &mut self,
        root: &Map,
        flag: Option<KvEventsFormat>,
        engine: Option<Engine>,
    ) -> Res<Option<KvEventsConfig>> {
        if root.get("kv_events").is_none() && flag.is_none() {
            return Ok(None);
        }
        let map = self.section(root, "kv_events", KV_EVENTS_KEYS)?;
        let format = self.opt(&map, "format", |v, node, at| {
            v.keyword(node, at, &KvEventsFormat::ALL, KvEventsFormat::as_str)
        });
        let fallback = KvEventsFormat::default_for(engine.unwrap_or(Engine::Vllm));
        let format = self.check(
            with_default(overridden(format, flag, "--kv-events"), fallback),
            |format| match engine {
                Some(engine) if format.engine() != engine => Err(format!(
                    "`{}` is what {} publishes, but the workers are {} (engine)",
                    format.as_str(),
                    format.engine().as_str(),
                    engine.as_str()
                )),
                _ => Ok(format),
            },
        );
        let replay = with_default(self.opt(&map, "replay", Self::boolean), true);
        let ring_batches = self.opt(&map, "ring_batches", Self::integer);
        let ring_batches = with_default(
            ring_batches,
            u64::from(KvEventsConfig::DEFAULT_RING_BATCHES),
        );
        let ring_batches = self.check(ring_batches, |n| {
            if n > u64::from(KvEventsConfig::MAX_RING_BATCHES) {
                Err(format!(
                    "must be at most {}",
                    KvEventsConfig::MAX_RING_BATCHES
                ))
            } else {
                at_least_one_u32(n)
            }
        });
        let topic = self.opt(&map, "topic", |v, node, at| {
            v.text(node, at, "a string").map(str::to_owned)
        });
        let base_port = self.opt(&map, "base_port", Self::integer);
        let base_port = self.check_opt(base_port, |port| {
            u16::try_from(port)
                .ok()
                .filter(|port| *port > 0)
                .ok_or_else(|| "must be a port between 1 and 65535".to_owned())
        });
        Ok(Some(KvEventsConfig {
            format: format?.value,
            replay: replay?.value,
            ring_batches: ring_batches?.value,
            topic: topic?.map(|topic| topic.value).unwrap_or_default(),
            base_port: base_port?.map(|port| port.value),
            replay_delay: std::time::Duration::ZERO,
        }))
    }

    /// The model parameters, each defaulting to `base`: the built-in defaults for a file, the values in
    /// force for a change at run time (`/admin/config`).
    fn params(
        &mut self,
        map: &Map,
        base: &SimParams,
        profile: Profile,
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
        let batch_tokens = self.positive_u32(map, "batch_tokens", base.batch_tokens.get());
        let max_prefill_tokens =
            self.positive_u32(map, "max_prefill_tokens", base.max_prefill_tokens.get());
        let schedule_policy = self.opt(map, "schedule_policy", |v, node, at| {
            v.keyword(node, at, &SchedulePolicy::ALL, SchedulePolicy::as_str)
        });
        let schedule_policy = with_default(schedule_policy, base.schedule_policy);

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
            profile,
            batch_tokens: batch_tokens?,
            max_prefill_tokens: max_prefill_tokens?,
            schedule_policy: schedule_policy?.value,
            jitter: jitter?.value,
            time_scale: time_scale?.value,
            failure_rate: failure_rate?.value,
            pd: base.pd.clone(),
        })
    }

    /// Refuses the keys the chosen timing model (or engine) does not read: a knob that silently does
    /// nothing would mislead whoever set it.
    fn model_keys(&mut self, map: &Map, timing: Timing, engine: Engine) {
        let (ignored, why): (&[&str], &str) = match timing {
            Timing::Step => (
                SLOTS_KEYS,
                "is read by `timing: slots` only; the step model prices every step from `profile`",
            ),
            Timing::Slots => (STEP_KEYS, "is read by `timing: step` only"),
        };
        for key in ignored {
            if let Some((_, at)) = map.get(key) {
                self.report(Phase::Value, at.origin(), format!("`{key}` {why}"));
            }
        }
        if timing == Timing::Step && engine == Engine::Vllm {
            for key in SGLANG_STEP_KEYS {
                if let Some((_, at)) = map.get(key) {
                    self.report(
                        Phase::Value,
                        at.origin(),
                        format!("`{key}` is read by the SGLang scheduler only (engine: sglang)"),
                    );
                }
            }
        }
    }

    /// `profile:`: a named profile, or a mapping of one (`base`) with coefficients replaced; the flag
    /// names a profile and replaces the file's.
    fn profile(&mut self, map: &Map, base: &Profile, flag: Option<&str>) -> Res<Profile> {
        let named = |v: &mut Self, name: &str, at: &Place| -> Res<Profile> {
            Profile::by_name(name).ok_or_else(|| {
                v.report(
                    Phase::Value,
                    at.origin(),
                    format!(
                        "unknown profile `{name}`; known: {}",
                        Profile::names().join(", ")
                    ),
                )
            })
        };
        if let Some(name) = flag {
            return Profile::by_name(name).ok_or_else(|| {
                self.report(
                    Phase::Value,
                    cachepick_decode::Origin::Flag("--profile"),
                    format!(
                        "unknown profile `{name}`; known: {}",
                        Profile::names().join(", ")
                    ),
                )
            });
        }
        let Some((node, at)) = map.get("profile") else {
            return Ok(base.clone());
        };
        if let cachepick_decode::Kind::Scalar { text, .. } = &node.kind {
            return named(self, text, &at);
        }
        let section = self.mapping(node, &at, PROFILE_KEYS)?;
        let start = match section.get("base") {
            Some((node, at)) => {
                let name = self.text(node, &at, "a profile name")?;
                named(self, name, &at)?
            }
            None => base.clone(),
        };
        let coefficient = |v: &mut Self, key: &str, scale: f64, default: f64| -> Res<f64> {
            let given = v.opt(&section, key, Self::number);
            let value = v.check(with_default(given, default / scale), |value| {
                if value.is_finite() && value >= 0.0 {
                    Ok(value * scale)
                } else {
                    Err("must be a number at least 0".to_owned())
                }
            });
            value.map(|value| value.value)
        };
        let step_overhead = coefficient(self, "step_overhead_ms", 1e-3, start.step_overhead);
        let weight_read = coefficient(self, "weight_read_ms", 1e-3, start.weight_read);
        let per_token = coefficient(self, "per_token_us", 1e-6, start.per_token);
        let attention_pair = coefficient(self, "attention_pair_ns", 1e-9, start.attention_pair);
        let kv_read = coefficient(self, "kv_read_ns", 1e-9, start.kv_read);
        let per_sequence = coefficient(self, "per_sequence_us", 1e-6, start.per_sequence);
        let front = coefficient(self, "front_ms", 1e-3, start.front);
        let api_token = coefficient(self, "api_token_us", 1e-6, start.api_token);
        let api_output = coefficient(self, "api_output_us", 1e-6, start.api_output);
        let api_metrics = coefficient(self, "api_metrics_ms", 1e-3, start.api_metrics);
        let blend = self.opt(&section, "blend", Self::number);
        let blend = self.check(with_default(blend, start.blend), |value| {
            if value.is_finite() && (0.5..=8.0).contains(&value) {
                Ok(value)
            } else {
                Err("must be between 0.5 and 8".to_owned())
            }
        });
        Ok(Profile {
            step_overhead: step_overhead?,
            weight_read: weight_read?,
            per_token: per_token?,
            blend: blend?.value,
            attention_pair: attention_pair?,
            kv_read: kv_read?,
            per_sequence: per_sequence?,
            front: front?,
            api_token: api_token?,
            api_output: api_output?,
            api_metrics: api_metrics?,
            ..start
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn sim_problems(source: &str, overrides: &SimOverrides) -> Vec<String> {
        match parse(source, "sim.yaml", overrides) {
            Ok(config) => panic!("accepted:\n{source}\nas {config:?}"),
            Err(ConfigError::Invalid { problems, .. }) => {
                problems.iter().map(ToString::to_string).collect()
            }
            Err(error) => panic!("unexpected {error}"),
        }
    }

    #[test]
    fn prefill_workers_split_an_sglang_fleet_and_nothing_else() {
        let flags = SimOverrides {
            engine: Some(Engine::Sglang),
            workers: Some(4),
            ..SimOverrides::default()
        };
        let config = parse("prefill_workers: 1\n", "sim.yaml", &flags).unwrap();
        assert_eq!(config.prefill_workers, Some(1));
        let flag = SimOverrides {
            prefill_workers: Some(2),
            ..flags.clone()
        };
        assert_eq!(parse("", "cli", &flag).unwrap().prefill_workers, Some(2));
        for (file, expected) in [
            ("prefill_workers: 4\n", "1 to 3, got 4"),
            ("prefill_workers: 0\n", "1 to 3, got 0"),
        ] {
            let error = parse(file, "sim.yaml", &flags).unwrap_err().to_string();
            assert!(error.contains(expected), "{file}: {error}");
        }
        let vllm = "engine: vllm\nworkers: 4\nprefill_workers: 1\n";
        let error = parse(vllm, "sim.yaml", &SimOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(error.contains("SGLang's disaggregation_mode"), "{error}");
    }

    #[test]
    fn an_empty_simulator_file_is_every_default_once_the_engine_is_named() {
        let flags = SimOverrides {
            engine: Some(Engine::Sglang),
            workers: Some(3),
            ..SimOverrides::default()
        };
        let config = parse("", "cli", &flags).unwrap();
        let mut expected = SimConfig::new(Engine::Sglang, NonZeroU32::new(3).unwrap());
        assert_eq!(config, expected);
        expected.timing = Timing::Slots;
        expected.params = SimParams::slots();
        expected.params.prefill_per_token = Duration::from_micros(50);
        expected.params.max_queue = Some(10);
        let file = "engine: vllm\ntiming: slots\nprefill_per_token: 0.05ms\nmax_queue: 10\n";
        let config = parse(file, "sim.yaml", &flags).unwrap();
        assert_eq!(config.engine, Engine::Sglang, "the flag beats the file");
        assert_eq!(config.params, expected.params);
    }

    #[test]
    fn every_simulator_problem_is_listed_with_its_line() {
        let file = "workers: 0\nhost: 10.0.0.1\njitter: 2\ntime_scale: 0\nkv_blocks: x\nbogus: 1\n";
        let problems = sim_problems(file, &SimOverrides::default());
        for expected in [
            "workers (line 1): must be at least 1",
            "host (line 2): must be a loopback address",
            "jitter (line 3): must be between 0 and 0.5",
            "time_scale (line 4): must be greater than 0",
            "kv_blocks (line 5): expected a non-negative integer",
            "bogus (line 6): unknown key",
        ] {
            assert!(
                problems.iter().any(|problem| problem.contains(expected)),
                "{expected:?} not in {problems:#?}"
            );
        }
        assert_eq!(problems.len(), 7, "{problems:#?}");
    }

    #[test]
    fn a_parameter_change_keeps_what_it_does_not_name() {
        let base = SimParams {
            max_queue: Some(4),
            ..SimParams::slots()
        };
        let changed = parse_params(
            "{\"max_running\": 8, \"inter_token_latency\": \"5ms\"}",
            &base,
            Timing::Slots,
            Engine::Vllm,
        )
        .unwrap();
        assert_eq!(changed.max_running.get(), 8);
        assert_eq!(changed.inter_token_latency, Duration::from_millis(5));
        assert_eq!(changed.max_queue, Some(4));
        assert_eq!(changed.kv_blocks, base.kv_blocks);
        let message = parse_params(
            "{\"engine\": \"vllm\", \"max_running\": 0}",
            &base,
            Timing::Slots,
            Engine::Vllm,
        )
        .unwrap_err()
        .to_string();
        assert!(
            message.contains("engine (line 1): unknown key"),
            "{message}"
        );
        assert!(
            message.contains("max_running (line 1): must be at least 1"),
            "{message}"
        );
    }

    #[test]
    fn the_step_model_is_the_default_and_each_model_refuses_the_others_knobs() {
        let sglang = SimOverrides {
            engine: Some(Engine::Sglang),
            ..SimOverrides::default()
        };
        let config = parse("", "cli", &sglang).unwrap();
        assert_eq!(config.timing, Timing::Step);
        assert_eq!(
            config.params,
            SimParams::step(Engine::Sglang, &Profile::default())
        );
        assert_eq!(config.params.kv_blocks.get(), 29_205);
        assert_eq!(config.params.batch_tokens.get(), 8192);

        let file = "engine: vllm\ninter_token_latency: 5ms\nload_slowdown: 1\nschedule_policy: lpm\n\
                    max_prefill_tokens: 4096\n";
        let problems = sim_problems(file, &SimOverrides::default());
        for expected in [
            "inter_token_latency (line 2): `inter_token_latency` is read by `timing: slots` only",
            "load_slowdown (line 3): `load_slowdown` is read by `timing: slots` only",
            "schedule_policy (line 4): `schedule_policy` is read by the SGLang scheduler only",
            "max_prefill_tokens (line 5): `max_prefill_tokens` is read by the SGLang scheduler only",
        ] {
            assert!(
                problems.iter().any(|problem| problem.contains(expected)),
                "{expected:?} not in {problems:#?}"
            );
        }
        assert_eq!(problems.len(), 4, "{problems:#?}");
        let file =
            "engine: vllm\ntiming: slots\nprofile: llama31-8b-a100-bf16\nbatch_tokens: 512\n";
        let problems = sim_problems(file, &SimOverrides::default());
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0].contains("`profile` is read by `timing: step` only"),
            "{problems:#?}"
        );

        // The flag beats the file, and the slots model gets its own defaults.
        let slots = SimOverrides {
            timing: Some(Timing::Slots),
            ..SimOverrides::default()
        };
        let config = parse("engine: vllm\nkv_blocks: 100\n", "sim.yaml", &slots).unwrap();
        assert_eq!(config.timing, Timing::Slots);
        assert_eq!(config.params.max_running, SimParams::slots().max_running);
        assert_eq!(config.params.kv_blocks.get(), 100);
    }

    #[test]
    fn a_profile_is_named_or_a_named_one_with_coefficients_replaced() {
        let vllm = SimOverrides {
            engine: Some(Engine::Vllm),
            ..SimOverrides::default()
        };
        let config = parse("profile: llama31-8b-a100-bf16\n", "sim.yaml", &vllm).unwrap();
        assert_eq!(config.params.profile, Profile::llama31_8b_a100());
        // vLLM's A100 defaults come with it.
        assert_eq!(config.params.batch_tokens.get(), 2048);
        assert_eq!(config.params.max_running.get(), 256);
        let file = "profile:\n  base: llama31-70b-h100-tp4\n  weight_read_ms: 12.5\n  attention_pair_ns: 0.9\n\
                    batch_tokens: 4096\n";
        let config = parse(file, "sim.yaml", &vllm).unwrap();
        let profile = &config.params.profile;
        assert_eq!(profile.name, "llama31-70b-h100-tp4");
        assert!((profile.weight_read - 12.5e-3).abs() < 1e-12);
        assert!((profile.attention_pair - 0.9e-9).abs() < 1e-18);
        assert_eq!(profile.per_token, Profile::llama31_70b_h100_tp4().per_token);
        assert_eq!(config.params.kv_blocks.get(), 128_273);
        assert_eq!(config.params.batch_tokens.get(), 4096);
        let flag = SimOverrides {
            profile: Some("llama31-8b-a100-bf16".to_owned()),
            ..vllm.clone()
        };
        assert_eq!(
            parse(file, "sim.yaml", &flag).unwrap().params.profile,
            Profile::llama31_8b_a100(),
            "the flag names the profile the file's mapping would have changed"
        );

        let file =
            "engine: vllm\nprofile:\n  base: h200\n  per_token_us: -1\n  blend: 20\n  bogus: 1\n";
        let problems = sim_problems(file, &SimOverrides::default());
        for expected in [
            "profile.base (line 3): unknown profile `h200`; known: llama31-8b-h100-bf16",
            "profile.bogus (line 6): unknown key",
        ] {
            assert!(
                problems.iter().any(|problem| problem.contains(expected)),
                "{expected:?} not in {problems:#?}"
            );
        }
        let file = "engine: vllm\nprofile:\n  per_token_us: -1\n  blend: 20\n";
        let problems = sim_problems(file, &SimOverrides::default());
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("profile.per_token_us (line 3): must be a number at least 0"))
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("profile.blend (line 4): must be between 0.5 and 8"))
        );
        let unknown = SimOverrides {
            profile: Some("tpu".to_owned()),
            ..vllm
        };
        let problems = sim_problems("", &unknown);
        assert!(
            problems[0].contains("--profile: unknown profile `tpu`"),
            "{problems:#?}"
        );
    }

    #[test]
    fn kv_events_are_off_unless_configured_or_flagged() {
        let vllm = SimOverrides {
            engine: Some(Engine::Vllm),
            ..SimOverrides::default()
        };
        assert_eq!(parse("", "cli", &vllm).unwrap().kv_events, None);
        assert_eq!(
            parse("kv_events: null\n", "sim.yaml", &vllm)
                .unwrap()
                .kv_events,
            None
        );
        let defaults = parse("kv_events: {}\n", "sim.yaml", &vllm).unwrap();
        assert_eq!(
            defaults.kv_events,
            Some(KvEventsConfig::new(KvEventsFormat::VllmMap))
        );
        let sglang = SimOverrides {
            engine: Some(Engine::Sglang),
            kv_events: Some(KvEventsFormat::Sglang),
            ..SimOverrides::default()
        };
        let flagged = parse("", "cli", &sglang).unwrap();
        assert_eq!(
            flagged.kv_events,
            Some(KvEventsConfig::new(KvEventsFormat::Sglang))
        );
    }

    #[test]
    fn kv_events_settings_are_decoded_and_checked() {
        let file = "engine: vllm\nkv_events:\n  format: vllm_array\n  replay: false\n  \
                    ring_batches: 7\n  topic: \"\"\n  base_port: 6000\n";
        let events = parse(file, "sim.yaml", &SimOverrides::default())
            .unwrap()
            .kv_events
            .unwrap();
        assert_eq!(
            events,
            KvEventsConfig {
                format: KvEventsFormat::VllmArray,
                replay: false,
                ring_batches: NonZeroU32::new(7).unwrap(),
                topic: String::new(),
                base_port: Some(6000),
                replay_delay: std::time::Duration::ZERO,
            }
        );
        let flag = SimOverrides {
            kv_events: Some(KvEventsFormat::VllmMap),
            ..SimOverrides::default()
        };
        let flagged = parse(file, "sim.yaml", &flag).unwrap().kv_events.unwrap();
        assert_eq!(
            flagged.format,
            KvEventsFormat::VllmMap,
            "the flag beats the file"
        );
        assert_eq!(
            flagged.ring_batches.get(),
            7,
            "the file's other settings stay"
        );

        let file = "engine: sglang\nkv_events:\n  format: vllm_map\n  replay: 1\n  \
                    ring_batches: 0\n  base_port: 70000\n  buffer_steps: 3\n";
        let problems = sim_problems(file, &SimOverrides::default());
        for expected in [
            "kv_events.format (line 3): `vllm_map` is what vllm publishes, but the workers are sglang",
            "kv_events.replay (line 4): expected true or false",
            "kv_events.ring_batches (line 5): must be at least 1",
            "kv_events.base_port (line 6): must be a port between 1 and 65535",
            "kv_events.buffer_steps (line 7): unknown key",
        ] {
            assert!(
                problems.iter().any(|problem| problem.contains(expected)),
                "{expected:?} not in {problems:#?}"
            );
        }
        assert_eq!(problems.len(), 5, "{problems:#?}");
    }
}

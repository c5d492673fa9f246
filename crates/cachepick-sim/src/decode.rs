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

use crate::config::{Engine, KvEventsConfig, KvEventsFormat, SimConfig, SimParams};

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
    /// `--kv-events FORMAT`: publish KV cache events in this format; the file's other `kv_events`
    /// settings (or their defaults) apply.
    pub kv_events: Option<KvEventsFormat>,
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

/// Validates a change of model parameters (a JSON or YAML mapping of `SimParams` keys); keys not given
/// keep their value in `base`.
pub fn parse_params(source: &str, base: &SimParams) -> Result<SimParams, ConfigError> {
    cachepick_decode::decode(source, "the request body", |root, problems| {
        let mut decoder = Decoder { problems };
        let map = decoder.mapping(root, &Place::root(root.line), PARAM_KEYS)?;
        decoder.params(&map, base, None)
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
    fn sim(&mut self, root: &Node, overrides: &SimOverrides) -> Res<SimConfig> {
        let keys: Vec<&str> = SIM_KEYS.iter().chain(PARAM_KEYS).copied().collect();
        let map = self.mapping(root, &Place::root(root.line), &keys)?;
        let defaults = SimParams::default();

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

        let params = self.params(&map, &defaults, overrides.time_scale);
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
            params: params?,
            kv_events: kv_events?,
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
        }))
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
    fn an_empty_simulator_file_is_every_default_once_the_engine_is_named() {
        let flags = SimOverrides {
            engine: Some(Engine::Sglang),
            workers: Some(3),
            ..SimOverrides::default()
        };
        let config = parse("", "cli", &flags).unwrap();
        let mut expected = SimConfig::new(Engine::Sglang, NonZeroU32::new(3).unwrap());
        assert_eq!(config, expected);
        expected.params.prefill_per_token = Duration::from_micros(50);
        expected.params.max_queue = Some(10);
        let file = "engine: vllm\nprefill_per_token: 0.05ms\nmax_queue: 10\n";
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
            ..SimParams::default()
        };
        let changed = parse_params(
            "{\"max_running\": 8, \"inter_token_latency\": \"5ms\"}",
            &base,
        )
        .unwrap();
        assert_eq!(changed.max_running.get(), 8);
        assert_eq!(changed.inter_token_latency, Duration::from_millis(5));
        assert_eq!(changed.max_queue, Some(4));
        assert_eq!(changed.kv_blocks, base.kv_blocks);
        let message = parse_params("{\"engine\": \"vllm\", \"max_running\": 0}", &base)
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

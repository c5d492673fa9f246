//! What a replay runs: the cachepick policies it knows by name and the `policy:` section each applies
//! to the fleet's generated configuration, the index mode written into it, and the arms a run is made
//! of (policy × index mode × replicas, then the other routers, then the oracle).

use std::fmt::Write as _;
use std::time::Duration;

use cachepick::config::{self, Config, WaitGate};
use cachepick_sim::{KvEventsConfig, KvEventsFormat, SimConfig, Timing};

use super::IndexMode;
use super::front::Front;
use super::peers::PeerRule;
use crate::stage::{StageError, on_free_ports};

/// Every policy the tool knows, by name: the `policy:` section it applies. `{limit}`, `{floor}` and
/// `{block}` are filled from the fleet as `cachepick sim --emit-config` sizes them ([`gate_limits`]) and
/// the KV block size in tokens; `{margin}` and `{wait_floor}` are the prefill-time unit's defaults
/// ([`WaitGate`]) in the simulator's wall time ([`wall`]); `{rate}` the profile's cold prefill rate
/// ([`profile_rate`]). The prefill-time arms but `time_floor_all_profile_rate` configure no rate:
/// they run on what the picker learns from the engines' counters, as a deployment does.
pub const POLICIES: [(&str, &str); 14] = [
    ("round_robin", "mode: round_robin"),
    ("least_load", "mode: least_load"),
    ("balance_threshold", "mode: balance_threshold"),
    // Pure prefix affinity: the cache-aware mode with its queue gate turned off.
    ("affinity", "mode: cache_aware\nworker_queue_limit: null"),
    (
        "gate",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: null",
    ),
    (
        "gate_floor",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}",
    ),
    (
        "gate_floor_pressure_only",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}\npin_depth_ratio: 0",
    ),
    (
        "gate_floor_min_match_1block",
        "worker_queue_limit: {limit}\nsaturation_queue_floor: {floor}\nmin_match_tokens: {block}",
    ),
    // A cache miss samples two workers, as the request unit does.
    (
        "time_floor",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: {wait_floor}\n\
         min_load_choices: 2",
    ),
    (
        "time",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: null",
    ),
    // A cache miss goes to the worker predicted soonest of the whole fleet, not of two sampled: the
    // product's default policy, its durations written in the simulator's wall time.
    (
        "time_floor_all",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: {wait_floor}\n\
         min_load_choices: 64",
    ),
    // Two diagnostics of the default, for issue 47's chat finding (BENCHMARKS.md): priced from the
    // first request at the profile's cold prefill rate (the rate llm-d's arm is calibrated with)
    // instead of after the picker learns one, and with a match of under 2k tokens (the chat's shared
    // 1k-token system prompt) not making an owner.
    (
        "time_floor_all_profile_rate",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: {wait_floor}\n\
         min_load_choices: 64\nprefill_tokens_per_second: {rate}",
    ),
    (
        "time_floor_all_min_match_2k",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: {wait_floor}\n\
         min_load_choices: 64\nmin_match_tokens: 2048",
    ),
    // The default as it was before `min_match_share`: every match of `min_match_tokens` an owner.
    (
        "time_floor_all_share_0",
        "gate_unit: prefill_time\ndivert_margin: {margin}\nsaturation_wait_floor: {wait_floor}\n\
         min_load_choices: 64\nmin_match_share: 0",
    ),
];

/// What `--policies` runs when empty.
pub const DEFAULT_TRACE_POLICIES: [&str; 8] = [
    "round_robin",
    "least_load",
    "balance_threshold",
    "affinity",
    "gate",
    "gate_floor",
    "gate_floor_pressure_only",
    "gate_floor_min_match_1block",
];
/// What `--policies` runs when empty and other routers are compared ([`ReplayOptions::fronts`]):
/// cachepick with the gate and floor, with the gate alone, and with pure affinity.
pub const DEFAULT_FRONT_POLICIES: [&str; 3] = ["gate_floor", "gate", "affinity"];
/// In `--policies`, runs no cachepick arm: only the fronts.
pub const NO_POLICIES: &str = "none";
pub const DEFAULT_BURST_POLICIES: [&str; 4] = [
    "gate",
    "gate_floor",
    "gate_floor_pressure_only",
    "gate_floor_min_match_1block",
];

/// The `policy:` section of `name` for `sim`'s fleet, or `None` for an unknown name.
pub fn policy_yaml(name: &str, sim: &SimConfig) -> Option<String> {
    let (_, template) = POLICIES.iter().find(|(known, _)| *known == name)?;
    let (limit, floor) = gate_limits(sim);
    let wait = WaitGate::default();
    Some(
        template
            .replace("{limit}", &limit.to_string())
            .replace("{floor}", &floor.to_string())
            .replace("{block}", &sim.block_size.to_string())
            .replace("{rate}", &profile_rate(sim).to_string())
            .replace("{margin}", &wall(sim, wait.divert_margin))
            .replace(
                "{wait_floor}",
                &wall(sim, wait.floor.unwrap_or(WaitGate::DEFAULT_FLOOR)),
            ),
    )
}

/// One rank's cold prefill rate under `sim`'s profile, tokens per wall second: what a benchmark of
/// the GPU measures, as llm-d's operators calibrate its peak prefill throughput.
fn profile_rate(sim: &SimConfig) -> u64 {
    let rate = super::peers::Calibration::of(sim).peak_tokens_per_s.round();
    if rate.is_finite() && rate >= 1.0 {
        rate as u64
    } else {
        1
    }
}

/// A GPU duration as the simulator's wall time (`time_scale` wall seconds per model second), written
/// as the configuration reads it, to the microsecond.
pub fn wall(sim: &SimConfig, gpu: Duration) -> String {
    let us = (gpu.as_secs_f64() * sim.params.time_scale * 1e6)
        .round()
        .max(0.0) as u64;
    written(Duration::from_micros(us))
}

/// `duration` as the configuration reads it, in milliseconds to the microsecond.
fn written(duration: Duration) -> String {
    let us = duration.as_micros();
    format!("{}.{:03}ms", us / 1000, us % 1000)
}

/// The queue gate's limit and the saturation floor for `sim`'s fleet, as the simulator's emitted
/// configuration sets them: under the step model cachepick's own defaults (4 and 2 waiting per rank),
/// since a rank's waiting queue is the prefill backlog beyond one step's budget whatever its running
/// limit; under the slots model a quarter and an eighth of the running slots, where waiting starts to
/// dominate a request's TTFT.
pub fn gate_limits(sim: &SimConfig) -> (u32, u32) {
    match sim.timing {
        Timing::Step => (4, 2),
        Timing::Slots => {
            let running = sim.params.max_running.get();
            ((running / 4).max(1), (running / 8).max(1))
        }
    }
}

/// Applies the `policy:` section `policy` to the generated cachepick configuration `generated`, on fresh
/// loopback ports, and validates the result.
pub fn apply_policy(generated: &str, policy: &str) -> Result<Config, StageError> {
    apply_arm(generated, policy, None, IndexMode::Approximate)
}

/// [`apply_policy`], with every pool's owner index in `mode` (`index: {mode: <mode>}` in each pool,
/// written only when the mode is not `approximate`, the default) and, when given, `load` as the `load:`
/// section.
pub fn apply_arm(
    generated: &str,
    policy: &str,
    load: Option<&str>,
    mode: IndexMode,
) -> Result<Config, StageError> {
    on_free_ports(
        &arm_text(generated, policy, load, mode)?,
        "the replay configuration",
        config::Overrides::default(),
    )
}

/// The text [`apply_arm`] validates: `generated` with the `policy:` section, the `load:` section when
/// given, and every pool's index mode.
pub fn arm_text(
    generated: &str,
    policy: &str,
    load: Option<&str>,
    mode: IndexMode,
) -> Result<String, StageError> {
    let invalid = |what: &str, error: serde_yaml::Error| {
        StageError::Compose(format!("{what} is not YAML: {error}"))
    };
    let mut root: serde_yaml::Value = serde_yaml::from_str(generated)
        .map_err(|error| invalid("the generated configuration", error))?;
    let section: serde_yaml::Value =
        serde_yaml::from_str(policy).map_err(|error| invalid("the policy section", error))?;
    let load: Option<serde_yaml::Value> = load
        .map(|text| serde_yaml::from_str(text).map_err(|error| invalid("the load section", error)))
        .transpose()?;
    if let serde_yaml::Value::Mapping(map) = &mut root {
        map.insert("policy".into(), section);
        if let Some(load) = load {
            map.insert("load".into(), load);
        }
        if mode != IndexMode::Approximate
            && let Some(serde_yaml::Value::Sequence(pools)) = map.get_mut("pools")
        {
            for pool in pools {
                if let serde_yaml::Value::Mapping(pool) = pool {
                    let mut index = serde_yaml::Mapping::new();
                    index.insert("mode".into(), mode.as_str().into());
                    pool.insert("index".into(), index.into());
                }
            }
        }
    }
    serde_yaml::to_string(&root).map_err(|error| invalid("the configuration", error))
}

/// The shortest scrape timeout a replay gives, in wall time. The replay's processes share two cores,
/// where a scrape can wait tens of milliseconds for a core; a timeout scaled below that would make
/// answering workers late (or, with no other sign of life, unreachable), which no production picker
/// with a 2 s timeout sees.
const MIN_WALL_TIMEOUT: Duration = Duration::from_millis(100);

/// The `load:` section a replay gives cachepick: the product's defaults (scrape every 1 s, 2 s
/// timeout, 3 s freshness; prefill rate half-life 30 s, warm-up 5 s) as model time, so a compressed
/// replay sees its engines as often, and learns their rate as fast, as a production picker would.
/// `interval` (model time) replaces the default scrape interval, the timeout and freshness keeping
/// their proportions to it, so the drift between replicas can be measured against it. The timeout is
/// at least [`MIN_WALL_TIMEOUT`] of wall time, the interval stretched with it.
pub fn load_yaml(sim: &SimConfig, interval: Option<Duration>) -> String {
    let defaults = config::LoadConfig::default();
    let model = |d: Duration| d.mul_f64(sim.params.time_scale.max(0.0));
    let asked = interval.unwrap_or(defaults.scrape_interval);
    let ratio = |d: Duration| d.as_secs_f64() / defaults.scrape_interval.as_secs_f64();
    let timeout_ratio = ratio(defaults.scrape_timeout);
    let interval = model(asked).max(MIN_WALL_TIMEOUT.div_f64(timeout_ratio));
    let timeout = interval.mul_f64(timeout_ratio);
    let freshness = interval.mul_f64(ratio(defaults.freshness));
    format!(
        "scrape_interval: {}\nscrape_timeout: {}\nfreshness: {}\nprefill_rate_half_life: {}\n\
         prefill_rate_warmup: {}",
        written(interval),
        written(timeout),
        written(freshness),
        written(model(defaults.rate.half_life)),
        written(model(defaults.rate.warmup)),
    )
}

/// THE one place that turns the simulator's KV event publisher on, for an `events` arm's fleet.
///
/// The workers publish in their engine's current format (a fleet configuration that chose one keeps
/// it), and `Fleet::cachepick_config()` then names every worker's `kv_events:` sockets itself.
pub fn enable_sim_events(sim: &mut SimConfig) {
    if sim.kv_events.is_none() {
        sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::default_for(sim.engine)));
    }
}

/// One arm of the run: a policy with an index mode and a number of picker replicas, another router, or
/// the oracle.
#[derive(Clone, Debug)]
pub(super) struct Arm {
    pub label: String,
    pub policy: String,
    pub yaml: String,
    pub index_mode: IndexMode,
    pub replicas: usize,
    /// Its replicas announce their dispatches to one another (`replica_sync`).
    pub sync: bool,
    pub kind: ArmKind,
}

/// Who routes an arm's requests.
#[derive(Clone, Debug)]
pub(super) enum ArmKind {
    /// cachepick, with the arm's policy, index mode and replicas.
    Picker,
    /// Another router ([`front`](super::front)); the policy fields do not apply.
    Front(Front),
    /// The routing limit ([`oracle`](super::oracle)); the policy fields do not apply.
    Oracle,
    /// A re-implemented peer ([`peers`](super::peers)) with the arm's replicas; the policy and index
    /// fields do not apply.
    Peer(PeerRule),
    /// Dynamo's own selection service ([`dynamo`](super::dynamo)), started from this command template.
    Dynamo(String),
}

impl Arm {
    /// A front's arm.
    pub fn front(front: &Front) -> Arm {
        Arm {
            label: front.label.clone(),
            policy: front.label.clone(),
            yaml: String::new(),
            index_mode: IndexMode::Approximate,
            replicas: 1,
            sync: false,
            kind: ArmKind::Front(front.clone()),
        }
    }

    /// A re-implemented peer's arms, one per replica count: labelled like the policies' (`/x<n>` when
    /// the run uses more than one replica anywhere).
    pub fn peers(rule: PeerRule, replicas: &[usize]) -> Vec<Arm> {
        let show_replicas = replicas != [1];
        replicas
            .iter()
            .map(|&count| {
                let mut label = rule.label().to_owned();
                if show_replicas {
                    let _ = write!(label, "/x{count}");
                }
                Arm {
                    policy: rule.label().to_owned(),
                    label,
                    yaml: String::new(),
                    index_mode: IndexMode::Events,
                    replicas: count,
                    sync: false,
                    kind: ArmKind::Peer(rule),
                }
            })
            .collect()
    }

    /// The arm of Dynamo's selection service started from `template`, the `nth` such arm of the run
    /// (`#2`, `#3`, … after the first).
    pub fn dynamo(template: &str, nth: usize) -> Arm {
        let label = match nth {
            0 => super::dynamo::LABEL.to_owned(),
            _ => format!("{}#{}", super::dynamo::LABEL, nth + 1),
        };
        Arm {
            policy: label.clone(),
            label,
            yaml: String::new(),
            index_mode: IndexMode::Events,
            replicas: 1,
            sync: false,
            kind: ArmKind::Dynamo(template.to_owned()),
        }
    }

    /// The oracle's arm.
    pub fn oracle() -> Arm {
        Arm {
            label: super::oracle::LABEL.to_owned(),
            policy: super::oracle::LABEL.to_owned(),
            yaml: String::new(),
            index_mode: IndexMode::Approximate,
            replicas: 1,
            sync: false,
            kind: ArmKind::Oracle,
        }
    }
}

/// Every arm, policy by policy: the policy's name, then `/<mode>` when the run compares modes or uses a
/// non-default one, then `/x<n>` when it uses more than one replica anywhere. With `sync`, each arm of
/// more than one replica has a twin whose replicas announce their dispatches (`/x<n>+sync`).
pub(super) fn arms(
    names: &[String],
    sim: &SimConfig,
    modes: &[IndexMode],
    replicas: &[usize],
    sync: bool,
) -> Vec<Arm> {
    let show_mode = modes != [IndexMode::Approximate];
    let show_replicas = replicas != [1];
    let mut arms = Vec::new();
    for name in names {
        let yaml = policy_yaml(name, sim).unwrap_or_default();
        for &index_mode in modes {
            for &count in replicas {
                let mut label = name.clone();
                if show_mode {
                    label.push('/');
                    label.push_str(index_mode.as_str());
                }
                if show_replicas {
                    let _ = write!(label, "/x{count}");
                }
                let arm = Arm {
                    label,
                    policy: name.clone(),
                    yaml: yaml.clone(),
                    index_mode,
                    replicas: count,
                    sync: false,
                    kind: ArmKind::Picker,
                };
                if sync && count > 1 {
                    let mut synced = arm.clone();
                    synced.label.push_str("+sync");
                    synced.sync = true;
                    arms.push(arm);
                    arms.push(synced);
                } else {
                    arms.push(arm);
                }
            }
        }
    }
    arms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{Scenario, default_fleet};
    use cachepick_sim::Engine;

    fn sim() -> SimConfig {
        default_fleet(&Scenario::Burst, 4.0, Timing::Step)
    }

    fn labels(modes: &[IndexMode], replicas: &[usize]) -> Vec<String> {
        labels_synced(modes, replicas, false)
    }

    fn labels_synced(modes: &[IndexMode], replicas: &[usize], sync: bool) -> Vec<String> {
        let names = ["gate".to_owned(), "gate_floor".to_owned()];
        arms(&names, &sim(), modes, replicas, sync)
            .into_iter()
            .map(|arm| arm.label)
            .collect()
    }

    #[test]
    fn arms_are_named_after_their_policy_unless_the_run_compares_more() {
        use IndexMode::{Approximate, Events};
        assert_eq!(labels(&[Approximate], &[1]), ["gate", "gate_floor"]);
        assert_eq!(
            labels(&[Approximate, Events], &[3]),
            [
                "gate/approximate/x3",
                "gate/events/x3",
                "gate_floor/approximate/x3",
                "gate_floor/events/x3"
            ]
        );
        assert_eq!(
            labels(&[Approximate], &[1, 2]),
            ["gate/x1", "gate/x2", "gate_floor/x1", "gate_floor/x2"]
        );
        assert_eq!(
            labels(&[Events], &[1]),
            ["gate/events", "gate_floor/events"]
        );
        // A synced twin for each arm of several replicas, none for one replica.
        assert_eq!(
            labels_synced(&[Events], &[1, 3], true),
            [
                "gate/events/x1",
                "gate/events/x3",
                "gate/events/x3+sync",
                "gate_floor/events/x1",
                "gate_floor/events/x3",
                "gate_floor/events/x3+sync"
            ]
        );
        assert_eq!("events".parse(), Ok(Events));
        assert!("exact".parse::<IndexMode>().is_err());
    }

    const GENERATED: &str = "listen: 127.0.0.1:9002\npools:\n  - model: a\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:8001\n  - model: b\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:8002\n";

    #[test]
    fn the_index_mode_is_written_into_every_pool_only_when_not_approximate() {
        let pools = |mode| -> Vec<serde_yaml::Value> {
            let text = arm_text(GENERATED, "mode: round_robin", None, mode).expect("composed");
            let root: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
            assert_eq!(root["policy"]["mode"].as_str(), Some("round_robin"));
            root["pools"].as_sequence().cloned().expect("pools")
        };
        let events = pools(IndexMode::Events);
        assert_eq!(events.len(), 2);
        for pool in &events {
            assert_eq!(pool["index"]["mode"].as_str(), Some("events"), "{pool:?}");
        }
        for pool in &pools(IndexMode::Approximate) {
            assert!(pool.get("index").is_none(), "{pool:?}");
        }
        let approximate = apply_arm(GENERATED, "mode: round_robin", None, IndexMode::Approximate);
        assert!(approximate.is_ok(), "{approximate:?}");
        // Until the product knows `pools[].index`, the key is an unknown one, and says where it is.
        match apply_arm(GENERATED, "mode: round_robin", None, IndexMode::Events) {
            Ok(config) => assert_eq!(config.pools.len(), 2),
            Err(error) => assert!(error.to_string().contains("index"), "{error}"),
        }
    }

    #[test]
    fn the_load_section_is_the_product_s_defaults_in_model_time() {
        let mut fast = sim();
        fast.params.time_scale = 0.125;
        let text = load_yaml(&fast, None);
        assert_eq!(
            text,
            "scrape_interval: 125.000ms\nscrape_timeout: 250.000ms\nfreshness: 375.000ms\n\
             prefill_rate_half_life: 3750.000ms\nprefill_rate_warmup: 625.000ms"
        );
        let config = apply_arm(
            GENERATED,
            "mode: round_robin",
            Some(&text),
            IndexMode::Approximate,
        )
        .expect("valid");
        assert_eq!(config.load.rate.warmup, Duration::from_millis(625));
        // A very fast replay keeps the wall-time floor, with the interval and freshness around it.
        fast.params.time_scale = 0.001;
        assert!(load_yaml(&fast, None).starts_with(
            "scrape_interval: 50.000ms\nscrape_timeout: 100.000ms\nfreshness: 150.000ms\n"
        ));
        // An interval asked for in model time brings its timeout and freshness with it.
        fast.params.time_scale = 0.5;
        assert!(
            load_yaml(&fast, Some(Duration::from_millis(250))).starts_with(
                "scrape_interval: 125.000ms\nscrape_timeout: 250.000ms\nfreshness: 375.000ms\n"
            )
        );
    }

    #[test]
    fn the_gate_is_cachepicks_default_under_the_step_model_and_a_share_of_the_slots_under_slots() {
        assert_eq!(gate_limits(&sim()), (4, 2));
        assert_eq!(
            policy_yaml("gate_floor", &sim()).as_deref(),
            Some("worker_queue_limit: 4\nsaturation_queue_floor: 2")
        );
        let mut scaled = sim();
        scaled.params.time_scale = 2.5;
        assert_eq!(
            policy_yaml("time_floor", &scaled).as_deref(),
            Some(
                "gate_unit: prefill_time\ndivert_margin: 1250.000ms\nsaturation_wait_floor: 2500.000ms\n\
                 min_load_choices: 2"
            )
        );
        assert!(apply_policy(GENERATED, &policy_yaml("time_floor", &scaled).unwrap()).is_ok());
        assert!(apply_policy(GENERATED, &policy_yaml("time", &scaled).unwrap()).is_ok());
        let slots = default_fleet(&Scenario::Burst, 4.0, Timing::Slots);
        assert_eq!(slots.params.max_running.get(), 8);
        assert_eq!(gate_limits(&slots), (2, 1));
    }

    #[test]
    fn every_named_policy_fills_its_template_and_validates() {
        let fleet = sim();
        for (name, _) in POLICIES {
            let yaml = policy_yaml(name, &fleet).expect("a known name");
            assert!(!yaml.contains('{'), "{name}: {yaml}");
            assert!(apply_policy(GENERATED, &yaml).is_ok(), "{name}: {yaml}");
        }
        // The diagnostic's rate is the one llm-d's arm is calibrated with, to the token.
        let rate = crate::replay::peers::Calibration::of(&fleet).peak_tokens_per_s;
        let yaml = policy_yaml("time_floor_all_profile_rate", &fleet).expect("known");
        assert!(
            yaml.ends_with(&format!(
                "prefill_tokens_per_second: {}",
                rate.round() as u64
            )),
            "{yaml}"
        );
        assert!(rate > 1_000.0, "{rate}");
    }

    #[test]
    fn events_mode_turns_on_the_engines_own_event_format() {
        let mut vllm = sim();
        enable_sim_events(&mut vllm);
        assert_eq!(
            vllm.kv_events.map(|events| events.format),
            Some(KvEventsFormat::default_for(Engine::Vllm))
        );
    }
}

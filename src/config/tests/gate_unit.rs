//! `gate_unit` and the prefill-time keys: decoded, defaulted, inherited, emitted, and each key of
//! the other unit refused where it was given (file or flag).

use std::num::NonZeroU64;
use std::time::Duration;

use super::super::*;

const POOL: &str = super::POOL;

fn wait_of(config: &Config) -> Option<WaitGate> {
    config
        .policy
        .cache_aware()
        .and_then(|knobs| knobs.wait().copied())
}

fn knobs(config: &Config) -> &CacheAwareKnobs {
    config.policy.cache_aware().unwrap()
}

#[test]
fn the_prefill_time_unit_is_the_default_and_weighs_the_whole_fleet() {
    let config = super::accepted(POOL, &Overrides::default());
    assert_eq!(wait_of(&config), Some(WaitGate::default()));
    assert_eq!(config.policy.gate(), None);
    assert_eq!(knobs(&config).min_load_choices.get(), 64);
    assert_eq!(knobs(&config).min_match_share.get(), 0.5);
}

#[test]
fn a_request_unit_key_without_gate_unit_runs_the_seed_s_gate() {
    // In the file: the seed's limit and floor, its two-way sampling.
    let config = super::accepted(
        &format!("policy:\n  worker_queue_limit: 6\n  saturation_queue_floor: 3\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(wait_of(&config), None);
    assert_eq!(
        config
            .policy
            .gate()
            .map(|gate| (gate.limit(), gate.floor())),
        Some((6, Some(3)))
    );
    assert_eq!(knobs(&config).min_load_choices.get(), 2);
    // Every match of min_match_tokens is an owner, as in the seed.
    assert_eq!(knobs(&config).min_match_share.get(), 0.0);
    // `null` still turns the gate off: pure prefix affinity, in the request unit.
    let config = super::accepted(
        &format!("policy: {{worker_queue_limit: null}}\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(knobs(&config).gating, Gating::Requests(None));
    // The flags, unchanged: alone they run the request unit, with the default floor.
    for (flags, limit, floor) in [
        (
            Overrides {
                worker_queue_limit: Some(8),
                ..Overrides::default()
            },
            8,
            2,
        ),
        (
            Overrides {
                saturation_queue_floor: Some(3),
                ..Overrides::default()
            },
            4,
            3,
        ),
    ] {
        let config = super::accepted(POOL, &flags);
        assert_eq!(
            config
                .policy
                .gate()
                .map(|gate| (gate.limit(), gate.floor())),
            Some((limit, Some(floor)))
        );
        assert_eq!(knobs(&config).min_load_choices.get(), 2);
    }
    // Their invariants too: a floor above the limit is refused as before.
    let flags = Overrides {
        worker_queue_limit: Some(2),
        saturation_queue_floor: Some(3),
        ..Overrides::default()
    };
    assert_eq!(super::messages(POOL, &flags).len(), 1);
}

#[test]
fn keys_of_both_units_without_gate_unit_name_the_key_that_implied_it() {
    let messages = super::messages(
        &format!("policy:\n  divert_margin: 1s\n  worker_queue_limit: 4\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(
        messages,
        [
            "policy.divert_margin (line 2): ignored by policy.gate_unit requests, implied by \
             policy.worker_queue_limit (line 3): remove it (it only applies to gate_unit prefill_time)"
        ]
    );
    let flag = Overrides {
        worker_queue_limit: Some(4),
        ..Overrides::default()
    };
    let messages = super::messages(
        &format!("policy: {{saturation_wait_floor: 2s}}\n{POOL}"),
        &flag,
    );
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].contains("implied by --worker-queue-limit"),
        "{messages:?}"
    );
}

#[test]
fn a_pool_inherits_the_implied_unit_unless_it_names_its_own() {
    let source = "policy: {worker_queue_limit: 5}\n\
        pools:\n  - model: a\n    engine: vllm\n    workers: [{endpoint: 10.0.0.1:8000}]\n  \
        - model: b\n    engine: vllm\n    policy: {gate_unit: prefill_time}\n    \
        workers: [{endpoint: 10.0.0.2:8000}]\n  \
        - model: c\n    engine: vllm\n    policy: {divert_margin: 2s}\n    \
        workers: [{endpoint: 10.0.0.3:8000}]\n";
    let messages = super::messages(source, &Overrides::default());
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("pools[2].policy.divert_margin")
            && messages[0].contains("implied by policy.worker_queue_limit (line 1)"),
        "{messages:?}"
    );
    let fixed = source.replace("    policy: {divert_margin: 2s}\n", "");
    let config = super::accepted(&fixed, &Overrides::default());
    assert_eq!(config.pools[0].policy.gate().map(QueueGate::limit), Some(5));
    assert_eq!(
        config.pools[1].policy.cache_aware().map(|k| k.gating),
        Some(Gating::PrefillTime(WaitGate::default()))
    );
    // The prefill-time pool takes its own unit's sampling default; the top level keeps the seed's.
    assert_eq!(knobs(&config).min_load_choices.get(), 2);
    assert_eq!(
        config.pools[1]
            .policy
            .cache_aware()
            .map(|k| k.min_load_choices.get()),
        Some(64)
    );
    assert_eq!(knobs(&config).min_match_share.get(), 0.0);
    assert_eq!(
        config.pools[1]
            .policy
            .cache_aware()
            .map(|k| k.min_match_share.get()),
        Some(0.5)
    );
    // Emitted and read back: the same configuration.
    let yaml = config.to_yaml();
    assert_eq!(
        super::accepted(&yaml, &Overrides::default()),
        config,
        "{yaml}"
    );
}

#[test]
fn the_prefill_time_unit_takes_its_defaults_and_turns_the_request_gate_off() {
    let config = super::accepted(
        &format!("policy: {{gate_unit: prefill_time}}\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(wait_of(&config), Some(WaitGate::default()));
    assert_eq!(config.policy.gate(), None);
    let config = super::accepted(
        &format!(
            "policy:\n  gate_unit: prefill_time\n  divert_margin: 250ms\n  saturation_wait_floor: null\n  \
             prefill_tokens_per_second: 12000\n{POOL}"
        ),
        &Overrides::default(),
    );
    assert_eq!(
        wait_of(&config),
        Some(WaitGate {
            divert_margin: Duration::from_millis(250),
            floor: None,
            fallback_rate: NonZeroU64::new(12_000),
        })
    );
}

#[test]
fn keys_of_the_other_unit_are_refused_where_they_were_given() {
    let messages = super::messages(
        &format!("policy:\n  gate_unit: prefill_time\n  worker_queue_limit: 8\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(
        messages,
        [
            "policy.worker_queue_limit (line 3): ignored by policy.gate_unit prefill_time (line 2): remove \
          it (it only applies to gate_unit requests)"
        ]
    );
    let flag = Overrides {
        worker_queue_limit: Some(8),
        ..Overrides::default()
    };
    let messages = super::messages(
        &format!("policy: {{gate_unit: prefill_time}}\n{POOL}"),
        &flag,
    );
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("--worker-queue-limit"),
        "{messages:?}"
    );
    let messages = super::messages(
        &format!("policy: {{gate_unit: requests, divert_margin: 1s}}\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(
        messages,
        [
            "policy.divert_margin (line 1): ignored by policy.gate_unit requests (line 1): remove it \
          (it only applies to gate_unit prefill_time)"
        ]
    );
}

#[test]
fn bad_values_are_each_reported() {
    let messages = super::messages(
        &format!(
            "policy:\n  gate_unit: seconds\n  divert_margin: soon\n  saturation_wait_floor: -1s\n  \
             prefill_tokens_per_second: 0\n{POOL}"
        ),
        &Overrides::default(),
    );
    assert_eq!(messages.len(), 4, "{messages:?}");
    assert!(
        messages[0].contains("gate_unit (line 2)")
            && messages[0].contains("requests, prefill_time")
    );
    assert!(messages[3].contains("prefill_tokens_per_second (line 5): must be at least 1"));
}

#[test]
fn a_pool_inherits_the_unit_and_may_change_it() {
    let source = "policy: {gate_unit: prefill_time, divert_margin: 2s}\n\
        pools:\n  - model: a\n    engine: vllm\n    workers: [{endpoint: 10.0.0.1:8000}]\n  \
        - model: b\n    engine: vllm\n    policy: {gate_unit: requests, worker_queue_limit: 6}\n    \
        workers: [{endpoint: 10.0.0.2:8000}]\n  \
        - model: c\n    engine: vllm\n    policy: {worker_queue_limit: 6}\n    \
        workers: [{endpoint: 10.0.0.3:8000}]\n";
    let messages = super::messages(source, &Overrides::default());
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("pools[2].policy.worker_queue_limit")
            && messages[0].contains("which this pool inherits"),
        "{messages:?}"
    );
    let fixed = source.replace("    policy: {worker_queue_limit: 6}\n", "");
    let config = super::accepted(&fixed, &Overrides::default());
    let wait = |pool: usize| {
        config.pools[pool]
            .policy
            .cache_aware()
            .and_then(|k| k.wait().copied())
    };
    assert_eq!(
        wait(0).map(|w| w.divert_margin),
        Some(Duration::from_secs(2))
    );
    assert_eq!(wait(1), None);
    assert_eq!(config.pools[1].policy.gate().map(QueueGate::limit), Some(6));
    // Emitted and read back: the same configuration, the second pool saying its unit.
    let yaml = config.to_yaml();
    let again = super::accepted(&yaml, &Overrides::default());
    assert_eq!(again, config, "{yaml}");
    assert!(yaml.contains("gate_unit: requests"), "{yaml}");
    assert!(
        yaml.contains(
            "  gate_unit: prefill_time\n  divert_margin: 2s\n  saturation_wait_floor: 1s\n"
        ),
        "{yaml}"
    );
}

#[test]
fn min_match_share_is_read_in_either_unit_and_checked() {
    for unit in ["requests", "prefill_time"] {
        let config = super::accepted(
            &format!("policy: {{gate_unit: {unit}, min_match_share: 0.25}}\n{POOL}"),
            &Overrides::default(),
        );
        assert_eq!(knobs(&config).min_match_share.get(), 0.25, "{unit}");
        // A 10,000-token prompt: the share sets the depth; a 2,000-token one: min_match_tokens.
        assert_eq!(knobs(&config).owner_depth(10_000), 2_500);
        assert_eq!(knobs(&config).owner_depth(2_000), 1_024);
        let yaml = config.to_yaml();
        assert_eq!(
            super::accepted(&yaml, &Overrides::default()),
            config,
            "{yaml}"
        );
    }
    let messages = super::messages(
        &format!("policy:\n  min_match_share: 1.5\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].contains("policy.min_match_share (line 2): must be between 0 and 1, got 1.5"),
        "{messages:?}"
    );
    let messages = super::messages(
        &format!("policy:\n  mode: round_robin\n  min_match_share: 0.5\n{POOL}"),
        &Overrides::default(),
    );
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(messages[0].contains("ignored by"), "{messages:?}");
}

//! Configuration decoding: defaults, every key, every problem with its line, flags, and the round trip
//! through `check`.

mod discovery;
mod gate_unit;
mod overload;
mod pd;
mod replica_sync;
mod security;
mod tracing;

use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::worker::{Engine, Role};

/// The documented example, plus a default pool exercising the remaining options.
const EXAMPLE: &str = "\
listen: 127.0.0.1:9002          # ext_proc gRPC
metrics_listen: 127.0.0.1:9090
max_body_bytes: 16MiB
policy:
  mode: cache_aware
  worker_queue_limit: 4
  saturation_queue_floor: 2
  min_load_choices: 2
  min_match_tokens: 1024
  pin_depth_ratio: 0.5
  max_fallbacks: 2
load:
  scrape_interval: 1s
  scrape_timeout: 500ms
  freshness: 3s
  max_body_bytes: 512KiB
  max_concurrent_scrapes: 16
pools:
  - model: llama-3-8b
    engine: vllm
    block_size: 64
    tokenizer: {kind: tiktoken, encoding: o200k_base}
    workers:
      - endpoint: 10.0.0.11:8000
        metrics_url: http://10.0.0.11:8000/metrics
        load_source: metrics
        role: both
        dp_size: 1
        max_running_requests: 256
        max_total_tokens: 500000
  - model: \"*\"
    engine: sglang
    block_size: 16
    tokenizer:
      kind: huggingface
      path: /models/qwen/tokenizer.json
    chat_template: /models/qwen/tokenizer_config.json
    segment_cache_entries: 4096
    default_cache_blocks: 65536
    index:
      mode: events
      speculative_ttl: 1500ms
      replay_port: 5558
      topic: kv@
    policy:                     # per rank, so a worker of four ranks is passed over at 64 waiting
      worker_queue_limit: 16
      saturation_queue_floor: 8
    workers:
      - endpoint: 10.0.0.21:30000
        role: prefill
        dp_size: 4
        load_source: loads
      - endpoint: \"[fd00::22]:30000\"
        metrics_url: http://metrics.internal/w22
        load_source: loads
        loads_url: http://loads.internal:8080/w22
        role: decode
        max_total_tokens: 1000000
        kv_events:
          endpoint: tcp://10.0.0.22:6000
";

/// The smallest valid file: one pool, one worker.
const POOL: &str =
    "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";

const NO_FLAGS: Overrides = Overrides {
    listen: None,
    metrics_listen: None,
    worker_queue_limit: None,
    saturation_queue_floor: None,
    min_load_choices: None,
    shutdown_grace: None,
};

/// `source` as the configuration it parses to; the test fails with its problems if it is refused.
fn accepted(source: &str, overrides: &Overrides) -> Config {
    match parse(source, "test.yaml", overrides) {
        Ok(config) => config,
        Err(error) => panic!("rejected:\n{source}\n{error}"),
    }
}

fn problems(source: &str, overrides: &Overrides) -> Vec<Problem> {
    match parse(source, "test.yaml", overrides) {
        Ok(config) => panic!("accepted:\n{source}\nas {config:?}"),
        Err(ConfigError::Invalid { file, problems }) => {
            assert_eq!(file, "test.yaml");
            assert!(!problems.is_empty());
            problems
        }
        Err(error) => panic!("unexpected {error}"),
    }
}

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

/// The default cache-aware policy with a request-unit queue gate.
fn gated(limit: u64, floor: u64) -> PolicyConfig {
    PolicyConfig {
        mode: Mode::CacheAware(CacheAwareKnobs::with_gating(Gating::Requests(
            QueueGate::new(NonZeroU64::new(limit).unwrap(), NonZeroU64::new(floor)),
        ))),
        ..PolicyConfig::default()
    }
}

#[test]
fn a_subset_hint_naming_no_known_worker_is_refused_unless_asked_otherwise() {
    let default = parse(POOL, "test.yaml", &Overrides::default()).unwrap();
    assert_eq!(default.unknown_subset, UnknownSubset::Refuse);
    let source = format!("unknown_subset: route_within\n{POOL}");
    let config = parse(&source, "test.yaml", &Overrides::default()).unwrap();
    assert_eq!(config.unknown_subset, UnknownSubset::RouteWithin);
    let again = parse(&config.to_yaml(), "effective.yaml", &Overrides::default()).unwrap();
    assert_eq!(again.unknown_subset, UnknownSubset::RouteWithin);
}

#[test]
fn the_full_example_is_accepted_with_its_values() {
    let config = parse(EXAMPLE, "example.yaml", &Overrides::default()).unwrap();
    let expected = Config {
        listen: addr("127.0.0.1:9002"),
        metrics_listen: addr("127.0.0.1:9090"),
        debug_endpoints: None,
        debug_token_file: None,
        tls: None,
        metrics_http: HttpLimits::default(),
        cache_salt_header: None,
        overload: OverloadConfig::default(),
        unknown_subset: UnknownSubset::Refuse,
        feedback: FeedbackConfig::default(),
        replica_sync: None,
        tracing: TracingConfig::default(),
        policy: gated(4, 2),
        load: LoadConfig {
            scrape_interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_millis(500),
            freshness: Duration::from_secs(3),
            max_body_bytes: NonZeroUsize::new(512 << 10).unwrap(),
            max_concurrent_scrapes: NonZeroUsize::new(16).unwrap(),
            ..LoadConfig::default()
        },
        max_body_bytes: NonZeroUsize::new(16 << 20).unwrap(),
        pools: vec![
            PoolConfig {
                model: ModelMatch::Exact("llama-3-8b".into()),
                engine: Engine::Vllm,
                block_size: NonZeroU32::new(64).unwrap(),
                engine_block_size: None,
                tokenizer: TokenizerConfig::Tiktoken {
                    encoding: TiktokenEncoding::O200kBase,
                },
                chat_template: None,
                segment_cache_entries: NonZeroUsize::new(16_384).unwrap(),
                default_cache_blocks: NonZeroUsize::new(16_384).unwrap(),
                max_model_len: NonZeroU64::new(PoolConfig::DEFAULT_MAX_MODEL_LEN).unwrap(),
                workers: vec![WorkerConfig {
                    endpoint: addr("10.0.0.11:8000"),
                    metrics_url: "http://10.0.0.11:8000/metrics".into(),
                    load_source: LoadSource::Metrics,
                    loads_url: None,
                    role: Role::Both,
                    dp_size: NonZeroU32::MIN,
                    max_running_requests: NonZeroU64::new(256),
                    max_total_tokens: NonZeroU64::new(500_000),
                    kv_events: KvEventEndpoints {
                        live: addr("10.0.0.11:5557"),
                        replay: None,
                    },
                    kv_events_from: KvEventsFrom::Engine,
                    bootstrap_port: None,
                }],
                policy: gated(4, 2),
                index: IndexConfig::default(),
                discovery: Discovery::Static,
                template: WorkerTemplate::default(),
                max_workers: NonZeroUsize::new(256).unwrap(),
                pd: None,
            },
            PoolConfig {
                model: ModelMatch::Any,
                engine: Engine::Sglang,
                block_size: NonZeroU32::new(16).unwrap(),
                engine_block_size: None,
                tokenizer: TokenizerConfig::HuggingFace {
                    path: PathBuf::from("/models/qwen/tokenizer.json"),
                },
                chat_template: Some(PathBuf::from("/models/qwen/tokenizer_config.json")),
                segment_cache_entries: NonZeroUsize::new(4096).unwrap(),
                default_cache_blocks: NonZeroUsize::new(65_536).unwrap(),
                max_model_len: NonZeroU64::new(PoolConfig::DEFAULT_MAX_MODEL_LEN).unwrap(),
                workers: vec![
                    WorkerConfig {
                        endpoint: addr("10.0.0.21:30000"),
                        metrics_url: "http://10.0.0.21:30000/metrics".into(),
                        load_source: LoadSource::Loads,
                        loads_url: Some("http://10.0.0.21:30000/v1/loads".into()),
                        role: Role::Prefill,
                        dp_size: NonZeroU32::new(4).unwrap(),
                        max_running_requests: None,
                        max_total_tokens: None,
                        kv_events: KvEventEndpoints {
                            live: addr("10.0.0.21:5557"),
                            replay: Some(addr("10.0.0.21:5558")),
                        },
                        kv_events_from: KvEventsFrom::Engine,
                        bootstrap_port: None,
                    },
                    WorkerConfig {
                        endpoint: addr("[fd00::22]:30000"),
                        metrics_url: "http://metrics.internal/w22".into(),
                        load_source: LoadSource::Loads,
                        loads_url: Some("http://loads.internal:8080/w22".into()),
                        role: Role::Decode,
                        dp_size: NonZeroU32::MIN,
                        max_running_requests: None,
                        max_total_tokens: NonZeroU64::new(1_000_000),
                        // The worker's own socket; the pool's replay port still applies, on its IP.
                        kv_events: KvEventEndpoints {
                            live: addr("10.0.0.22:6000"),
                            replay: Some(addr("[fd00::22]:5558")),
                        },
                        kv_events_from: KvEventsFrom::Worker,
                        bootstrap_port: None,
                    },
                ],
                policy: gated(16, 8),
                index: IndexConfig {
                    mode: IndexMode::Events,
                    speculative_ttl: Duration::from_millis(1500),
                    topic: "kv@".into(),
                    stream_grace: IndexConfig::DEFAULT_STREAM_GRACE,
                    ..IndexConfig::default()
                },
                discovery: Discovery::Static,
                template: WorkerTemplate {
                    kv_replay_port: Some(5558),
                    ..WorkerTemplate::default()
                },
                max_workers: NonZeroUsize::new(256).unwrap(),
                pd: None,
            },
        ],
    };
    assert_eq!(config, expected);
}

#[test]
fn the_shipped_example_is_accepted() {
    let config = parse(
        include_str!("../../examples/cachepick.yaml"),
        "cachepick.yaml",
        &NO_FLAGS,
    )
    .unwrap();
    let workers = &config.pools[0].workers;
    assert_eq!(workers.len(), 3);
    assert_eq!(
        (workers[1].role, workers[2].role),
        (Role::Both, Role::Decode)
    );
    // The SGLang pool reads /v1/loads, with two data-parallel ranks per worker.
    let sglang = &config.pools[1];
    assert_eq!(sglang.engine, Engine::Sglang);
    assert!(
        sglang
            .workers
            .iter()
            .all(|worker| worker.load_source == LoadSource::Loads && worker.dp_size.get() == 2)
    );
    assert!(
        sglang
            .workers
            .iter()
            .any(|worker| worker.max_running_requests.is_some())
    );
}

#[test]
fn defaults_fill_a_minimal_file() {
    let config = parse(POOL, "minimal.yaml", &Overrides::default()).unwrap();
    assert_eq!(config.listen, addr("127.0.0.1:9002"));
    assert_eq!(config.metrics_listen, addr("127.0.0.1:9090"));
    assert_eq!(config.policy, PolicyConfig::default());
    assert_eq!(config.policy.mode.kind(), ModeKind::CacheAware);
    let knobs = config.policy.cache_aware().unwrap();
    // The gate and its floor are the product's point: on by default, in predicted prefill time, with
    // off-owner picks weighing the whole fleet.
    assert_eq!(knobs.gating, Gating::PrefillTime(WaitGate::default()));
    assert_eq!(config.policy.gate(), None);
    assert_eq!(knobs.min_match_tokens, 1024);
    assert_eq!(knobs.min_load_choices.get(), 64);
    assert_eq!(knobs.pin_depth_ratio.get(), 0.5);
    assert_eq!(config.policy.max_fallbacks, 2);
    assert_eq!(config.pools[0].policy, config.policy);
    assert_eq!(config.load, LoadConfig::default());
    assert_eq!(config.load.max_body_bytes.get(), 4 << 20);
    assert_eq!(config.load.max_concurrent_scrapes.get(), 64);
    assert_eq!(config.max_body_bytes.get(), 8 << 20);
    let pool = &config.pools[0];
    assert_eq!(pool.block_size.get(), 64);
    assert_eq!(pool.chat_template, None);
    assert_eq!(pool.segment_cache_entries.get(), 16_384);
    assert_eq!(pool.default_cache_blocks.get(), 16_384);
    assert_eq!(pool.max_model_len.get(), 131_072);
    assert_eq!(config.cache_salt_header, None);
    assert_eq!(
        pool.tokenizer,
        TokenizerConfig::Tiktoken {
            encoding: TiktokenEncoding::O200kBase
        }
    );
    assert_eq!(
        pool.workers,
        [WorkerConfig {
            endpoint: addr("10.0.0.1:8000"),
            metrics_url: "http://10.0.0.1:8000/metrics".into(),
            load_source: LoadSource::Metrics,
            loads_url: None,
            role: Role::Both,
            dp_size: NonZeroU32::MIN,
            max_running_requests: None,
            max_total_tokens: None,
            kv_events: KvEventEndpoints {
                live: addr("10.0.0.1:5557"),
                replay: None,
            },
            kv_events_from: KvEventsFrom::Engine,
            bootstrap_port: None,
        }]
    );
    assert_eq!(pool.workers[0].scrape_url(), "http://10.0.0.1:8000/metrics");
}

#[test]
fn a_loads_worker_gets_a_loads_url_from_its_endpoint() {
    let source = "pools:\n  - model: m\n    engine: sglang\n    workers:\n      \
                      - {endpoint: 10.0.0.1:30000, load_source: loads}\n      \
                      - {endpoint: '[fd00::2]:30000', load_source: loads}\n      \
                      - {endpoint: 10.0.0.3:30000, load_source: loads, loads_url: 'http://lb:1/x'}\n      \
                      - {endpoint: 10.0.0.4:30000, load_source: metrics}\n";
    let config = parse(source, "t", &NO_FLAGS).unwrap();
    let urls: Vec<_> = config.pools[0]
        .workers
        .iter()
        .map(|worker| (worker.loads_url.as_deref(), worker.scrape_url()))
        .collect();
    assert_eq!(
        urls,
        [
            (
                Some("http://10.0.0.1:30000/v1/loads"),
                "http://10.0.0.1:30000/v1/loads"
            ),
            (
                Some("http://[fd00::2]:30000/v1/loads"),
                "http://[fd00::2]:30000/v1/loads"
            ),
            (Some("http://lb:1/x"), "http://lb:1/x"),
            (None, "http://10.0.0.4:30000/metrics"),
        ]
    );
}

/// Sizes are whole numbers of bytes or of a unit, case-sensitive: `4mb` is rejected (see the table of
/// invalid values), since lower case often means bits.
#[test]
fn max_body_bytes_is_a_size_emitted_in_the_largest_exact_binary_unit() {
    for (given, bytes, emitted) in [
        ("4MiB", 4 << 20, "4MiB"),
        ("1KB", 1000, "1000"),
        ("512KiB", 512 << 10, "512KiB"),
        ("123", 123, "123"),
        ("1024KiB", 1 << 20, "1MiB"),
        ("2048", 2048, "2KiB"),
        ("'64KiB'", 64 << 10, "64KiB"),
        ("1MB", 1_000_000, "1000000"),
        ("3GB", 3_000_000_000, "3000000000"),
        ("2GiB", 2 << 30, "2GiB"),
    ] {
        let source = format!("load:\n  max_body_bytes: {given}\n{POOL}");
        let config = parse(&source, "t", &NO_FLAGS).unwrap();
        assert_eq!(config.load.max_body_bytes.get(), bytes, "{given}");
        let yaml = config.to_yaml();
        assert!(
            yaml.contains(&format!("\n  max_body_bytes: {emitted}\n")),
            "{given}: expected {emitted} in\n{yaml}"
        );
        assert_eq!(
            parse(&yaml, "emitted", &NO_FLAGS).unwrap(),
            config,
            "{yaml}"
        );
    }
}

#[test]
fn null_values_and_empty_sections_count_as_absent() {
    let source = format!("listen: ~\npolicy:\nload:\n  freshness: null\n{POOL}");
    assert_eq!(
        parse(&source, "t", &NO_FLAGS).unwrap(),
        parse(POOL, "t", &NO_FLAGS).unwrap()
    );
}

#[test]
fn scalars_are_read_as_their_key_expects() {
    let source = "pools:\n  - model: 3\n    engine: 'vllm'\n    tokenizer: {kind: bytes}\n    workers:\n      \
                      - endpoint: '10.0.0.1:8000'\n        role: \"decode\"\n      - endpoint: 10.0.0.2:8000\n";
    let config = parse(source, "t", &NO_FLAGS).unwrap();
    assert_eq!(config.pools[0].model, ModelMatch::Exact("3".into()));
    assert_eq!(config.pools[0].tokenizer, TokenizerConfig::Bytes);
    assert_eq!(config.pools[0].workers[0].role, Role::Decode);
}

#[test]
fn flags_override_file_values() {
    let source = format!(
        "listen: 0.0.0.0:1\npolicy:\n  worker_queue_limit: 4\n  min_load_choices: 3\n{POOL}"
    );
    let overrides = Overrides {
        listen: Some(addr("127.0.0.1:7000")),
        metrics_listen: Some(addr("0.0.0.0:9100")),
        worker_queue_limit: Some(8),
        saturation_queue_floor: Some(8),
        min_load_choices: Some(1),
        shutdown_grace: None,
    };
    let config = parse(&source, "t", &overrides).unwrap();
    assert_eq!(config.listen, addr("127.0.0.1:7000"));
    assert_eq!(config.metrics_listen, addr("0.0.0.0:9100"));
    assert_eq!(
        config
            .policy
            .gate()
            .map(|gate| (gate.limit(), gate.floor())),
        Some((8, Some(8)))
    );
    assert_eq!(
        config.policy.cache_aware().unwrap().min_load_choices.get(),
        1
    );
    assert_eq!(config.pools[0].policy, config.policy, "the pool inherits");
}

#[test]
fn the_effective_config_round_trips_through_yaml() {
    let sub_millisecond = format!(
        "load:\n  scrape_interval: 1.5s\n  scrape_timeout: 0.25ms\n  freshness: 2m\n{POOL}"
    );
    let bytes = POOL.replace("engine: vllm", "engine: vllm\n    tokenizer: {kind: bytes}");
    let loads = format!(
        "load:\n  max_body_bytes: 1KB\n  max_concurrent_scrapes: 1\n{}        load_source: loads\n",
        POOL.replace("engine: vllm", "engine: sglang")
    );
    let flagged = Overrides {
        worker_queue_limit: Some(3),
        ..NO_FLAGS
    };
    // Template paths are kept as written, so ones YAML would read as other types must come back quoted.
    let relative_template = POOL.replace(
        "engine: vllm",
        "engine: vllm\n    chat_template: 'templates/chat ml.jinja'",
    );
    let numeric_template = format!(
        "max_body_bytes: 1000\n{}",
        POOL.replace("engine: vllm", "engine: vllm\n    chat_template: 0x10")
    );
    for (source, overrides) in [
        (EXAMPLE, &NO_FLAGS),
        (POOL, &NO_FLAGS),
        (&sub_millisecond, &NO_FLAGS),
        (&bytes, &flagged),
        (&loads, &NO_FLAGS),
        (&relative_template, &NO_FLAGS),
        (&numeric_template, &NO_FLAGS),
    ] {
        let config = parse(source, "t", overrides).unwrap();
        let yaml = config.to_yaml();
        assert_eq!(
            parse(&yaml, "emitted", &NO_FLAGS).unwrap(),
            config,
            "{yaml}"
        );
    }
}

#[test]
fn the_effective_config_uses_the_file_keys_and_readable_durations() {
    let yaml = parse(EXAMPLE, "t", &NO_FLAGS).unwrap().to_yaml();
    for expected in [
        "listen: 127.0.0.1:9002",
        "  worker_queue_limit: 4\n  saturation_queue_floor: 2\n",
        "  scrape_interval: 1s\n  scrape_timeout: 500ms\n  freshness: 3s\n",
        "  tokenizer:\n    kind: tiktoken\n    encoding: o200k_base\n",
        "    kind: huggingface\n",
        "metrics_url: http://10.0.0.21:30000/metrics",
        "  max_body_bytes: 512KiB\n  max_concurrent_scrapes: 16\n",
        "load_source: loads\n    loads_url: http://10.0.0.21:30000/v1/loads\n",
        "max_running_requests: 256\n    max_total_tokens: 500000\n",
        "metrics_listen: 127.0.0.1:9090\nmax_body_bytes: 16MiB\nmetrics_http:\n  max_connections: 64\n",
        "  chat_template: /models/qwen/tokenizer_config.json\n  segment_cache_entries: 4096\n  \
             default_cache_blocks: 65536\n",
    ] {
        assert!(yaml.contains(expected), "{expected:?} not in\n{yaml}");
    }
    // Unset options stay unset; the load keys and the load source are always written.
    let minimal = parse(POOL, "t", &NO_FLAGS).unwrap().to_yaml();
    for absent in [
        "loads_url",
        "max_running_requests",
        "max_total_tokens",
        "chat_template",
    ] {
        assert!(!minimal.contains(absent), "{absent:?} in\n{minimal}");
    }
    for present in [
        "  max_body_bytes: 4MiB\n  max_concurrent_scrapes: 64\n",
        "    load_source: metrics\n",
        "\nmax_body_bytes: 8MiB\n",
        "  segment_cache_entries: 16384\n  default_cache_blocks: 16384\n",
        "  gate_unit: prefill_time\n  divert_margin: 500ms\n  saturation_wait_floor: 1s\n",
    ] {
        assert!(minimal.contains(present), "{present:?} not in\n{minimal}");
    }
    // A gate turned off is written as such, so the file read back runs without it.
    let off = format!("policy: {{worker_queue_limit: null}}\n{POOL}");
    let off = parse(&off, "t", &NO_FLAGS).unwrap();
    assert_eq!(off.policy.gate(), None);
    let written = off.to_yaml();
    assert!(
        written.contains("  worker_queue_limit: null\n  saturation_queue_floor: null\n"),
        "{written}"
    );
    assert_eq!(parse(&written, "t", &NO_FLAGS).unwrap(), off);
}

/// Each case has exactly one problem, at `at`, whose message contains `message`.
#[test]
fn each_invalid_value_gives_one_message_at_its_origin() {
    // POOL with more lines for its worker, from line 6 on.
    let pool = |worker: &str| format!("{POOL}{worker}");
    // POOL and a second pool, whose model is on line 6 and endpoint on line 9.
    let two_pools = |first: &str, second: &str, endpoint: &str| {
        let second = format!(
            "  - model: {second}\n    engine: vllm\n    workers:\n      - endpoint: {endpoint}\n"
        );
        format!(
            "{}{second}",
            POOL.replace("model: m", &format!("model: {first}"))
        )
    };
    let pool_with =
        |extra: &str| POOL.replace("engine: vllm\n", &format!("engine: vllm\n    {extra}\n"));
    // POOL on SGLang, with more lines for its worker, from line 6 on.
    let sglang =
        |worker: &str| format!("{}{worker}", POOL.replace("engine: vllm", "engine: sglang"));
    let too_large = format!("must be at most {} bytes", usize::MAX);
    let policy = |lines: &str| format!("policy:\n{lines}{POOL}");
    let load = |lines: &str| format!("load:\n{lines}{POOL}");
    let floor_flag = Overrides {
        saturation_queue_floor: Some(5),
        ..NO_FLAGS
    };
    let limit_flag = Overrides {
        worker_queue_limit: Some(0),
        ..NO_FLAGS
    };
    let choices_flag = Overrides {
        min_load_choices: Some(0),
        ..NO_FLAGS
    };
    let choices_two = Overrides {
        min_load_choices: Some(2),
        ..NO_FLAGS
    };
    #[rustfmt::skip]
        let cases: Vec<(&str, String, &Overrides, &str, &str)> = vec![
            ("floor with the gate off", policy("  worker_queue_limit: null\n  saturation_queue_floor: 2\n"),
             &NO_FLAGS, "policy.saturation_queue_floor (line 3)",
             "requires a queue limit, but policy.worker_queue_limit is null (the gate is off, so there is no \
              diversion to cancel)"),
            ("floor above the default limit", policy("  saturation_queue_floor: 5\n"), &NO_FLAGS,
             "policy.saturation_queue_floor (line 2)",
             "saturation_queue_floor (5) must be at most worker_queue_limit (4, the default)"),
            ("floor above limit", policy("  worker_queue_limit: 2\n  saturation_queue_floor: 3\n"), &NO_FLAGS,
             "policy.saturation_queue_floor (line 3)",
             "saturation_queue_floor (3) must be at most worker_queue_limit (2): a floor above the limit would \
              declare the fleet saturated while the gate still admits some workers"),
            ("floor flag above file limit", policy("  worker_queue_limit: 4\n"), &floor_flag,
             "--saturation-queue-floor", "--saturation-queue-floor (5) must be at most worker_queue_limit (4)"),
            ("floor flag above the default limit", POOL.to_owned(), &floor_flag,
             "--saturation-queue-floor", "must be at most worker_queue_limit (4, the default)"),
            ("floor 0 without limit", policy("  saturation_queue_floor: 0\n"), &NO_FLAGS,
             "policy.saturation_queue_floor (line 2)", "must be at least 1"),
            ("floor 0", policy("  worker_queue_limit: 2\n  saturation_queue_floor: 0\n"), &NO_FLAGS,
             "policy.saturation_queue_floor (line 3)", "must be at least 1"),
            ("limit 0", policy("  worker_queue_limit: 0\n"), &NO_FLAGS,
             "policy.worker_queue_limit (line 2)", "must be at least 1"),
            ("limit 0 hides the floor check", policy("  worker_queue_limit: 0\n  saturation_queue_floor: 2\n"),
             &NO_FLAGS, "policy.worker_queue_limit (line 2)", "must be at least 1"),
            ("limit flag 0", policy("  worker_queue_limit: 4\n"), &limit_flag,
             "--worker-queue-limit", "must be at least 1"),
            ("min_load_choices 0", policy("  min_load_choices: 0\n"), &NO_FLAGS,
             "policy.min_load_choices (line 2)", "must be at least 1"),
            ("min_load_choices flag 0", POOL.to_owned(), &choices_flag, "--min-load-choices", "must be at least 1"),
            ("ratio above 1", policy("  pin_depth_ratio: 1.5\n"), &NO_FLAGS,
             "policy.pin_depth_ratio (line 2)", "must be between 0 and 1, got 1.5"),
            ("ratio below 0", policy("  pin_depth_ratio: -0.1\n"), &NO_FLAGS,
             "policy.pin_depth_ratio (line 2)", "must be between 0 and 1, got -0.1"),
            ("ratio not finite", policy("  pin_depth_ratio: NaN\n"), &NO_FLAGS,
             "policy.pin_depth_ratio (line 2)", "must be between 0 and 1"),
            ("too many fallbacks", policy("  max_fallbacks: 9\n"), &NO_FLAGS,
             "policy.max_fallbacks (line 2)", "must be at most 8"),
            ("unknown mode", policy("  mode: fastest\n"), &NO_FLAGS, "policy.mode (line 2)",
             "expected one of: cache_aware, round_robin, least_load, balance_threshold; got `fastest`"),
            ("mode as a number", policy("  mode: 1\n"), &NO_FLAGS, "policy.mode (line 2)",
             "expected one of: cache_aware, round_robin, least_load, balance_threshold; got `1`"),
            ("relative threshold of 1", policy("  mode: balance_threshold\n  balance_rel_threshold: 1\n"),
             &NO_FLAGS, "policy.balance_rel_threshold (line 3)",
             "must be greater than 1, got 1: the rule compares max > factor × min"),
            ("relative threshold not finite", policy("  mode: balance_threshold\n  balance_rel_threshold: inf\n"),
             &NO_FLAGS, "policy.balance_rel_threshold (line 3)", "must be greater than 1"),
            ("absolute threshold negative", policy("  mode: balance_threshold\n  balance_abs_threshold: -1\n"),
             &NO_FLAGS, "policy.balance_abs_threshold (line 3)", "expected a non-negative integer, got `-1`"),
            ("cache threshold above 1", policy("  mode: balance_threshold\n  cache_threshold: 1.5\n"),
             &NO_FLAGS, "policy.cache_threshold (line 3)", "must be between 0 and 1, got 1.5"),
            ("cache threshold as a word", policy("  mode: balance_threshold\n  cache_threshold: high\n"),
             &NO_FLAGS, "policy.cache_threshold (line 3)", "expected a number, got `high`"),
            ("pool policy of the wrong type", pool_with("policy: 3"), &NO_FLAGS,
             "pools[0].policy (line 4)", "expected a mapping, got `3`"),
            ("unknown pool policy key", pool_with("policy: {mood: least_load}"), &NO_FLAGS,
             "pools[0].policy.mood (line 4)", "unknown key; expected one of: mode, worker_queue_limit"),
            ("pool limit 0", pool_with("policy: {worker_queue_limit: 0}"), &NO_FLAGS,
             "pools[0].policy.worker_queue_limit (line 4)", "must be at least 1"),
            ("pool floor under a gate turned off above",
             format!("policy:\n  worker_queue_limit: null\n{}", pool_with("policy: {saturation_queue_floor: 2}")),
             &NO_FLAGS, "pools[0].policy.saturation_queue_floor (line 6)", "requires a queue limit"),
            ("pool floor above the inherited limit",
             format!("policy:\n  worker_queue_limit: 4\n{}", pool_with("policy: {saturation_queue_floor: 5}")),
             &NO_FLAGS, "pools[0].policy.saturation_queue_floor (line 6)",
             "saturation_queue_floor (5) must be at most worker_queue_limit (4, inherited from \
              policy.worker_queue_limit (line 2))"),
            ("pool limit below the inherited floor",
             format!("policy:\n  worker_queue_limit: 4\n  saturation_queue_floor: 3\n{}",
                     pool_with("policy: {worker_queue_limit: 2}")),
             &NO_FLAGS, "pools[0].policy.worker_queue_limit (line 7)",
             "saturation_queue_floor (3, inherited from policy.saturation_queue_floor (line 3)) must be at most \
              worker_queue_limit (2)"),
            ("pool knob of another mode", pool_with("policy: {mode: least_load, min_match_tokens: 64}"),
             &NO_FLAGS, "pools[0].policy.min_match_tokens (line 4)",
             "ignored by pools[0].policy.mode least_load (line 4): remove it (it only applies to cache_aware)"),
            ("pool knob of the inherited mode",
             format!("policy:\n  mode: round_robin\n{}", pool_with("policy: {pin_depth_ratio: 0.2}")),
             &NO_FLAGS, "pools[0].policy.pin_depth_ratio (line 6)",
             "ignored by policy.mode round_robin (line 2), which this pool inherits: remove it (it only applies \
              to cache_aware)"),
            ("balance knob under the default mode", policy("  cache_threshold: 0.5\n"), &NO_FLAGS,
             "policy.cache_threshold (line 2)",
             "ignored by policy.mode cache_aware (the default): remove it (it only applies to balance_threshold)"),
            ("a flag under another mode", policy("  mode: least_load\n"), &choices_two,
             "--min-load-choices",
             "ignored by policy.mode least_load (line 2): remove it (it only applies to cache_aware)"),
            ("integer as a word", policy("  min_match_tokens: lots\n"), &NO_FLAGS,
             "policy.min_match_tokens (line 2)", "expected a non-negative integer, got `lots`"),
            ("quoted integer", policy("  worker_queue_limit: \"4\"\n"), &NO_FLAGS,
             "policy.worker_queue_limit (line 2)", "expected a non-negative integer, got the quoted string \"4\""),
            ("negative integer", policy("  min_match_tokens: -1\n"), &NO_FLAGS,
             "policy.min_match_tokens (line 2)", "expected a non-negative integer, got `-1`"),
            ("integer beyond u64", policy("  min_match_tokens: 18446744073709551616\n"), &NO_FLAGS,
             "policy.min_match_tokens (line 2)", "must be at most 18446744073709551615"),
            ("zero interval", load("  scrape_interval: 0s\n"), &NO_FLAGS,
             "load.scrape_interval (line 2)", "must be greater than 0"),
            ("zero timeout", load("  scrape_timeout: 0ms\n"), &NO_FLAGS,
             "load.scrape_timeout (line 2)", "must be greater than 0"),
            ("zero freshness", load("  freshness: 0s\n"), &NO_FLAGS,
             "load.freshness (line 2)", "must be greater than 0"),
            ("zero rate half-life", load("  prefill_rate_half_life: 0s\n"), &NO_FLAGS,
             "load.prefill_rate_half_life (line 2)", "must be greater than 0"),
            ("rate warm-up without unit", load("  prefill_rate_warmup: 5\n"), &NO_FLAGS,
             "load.prefill_rate_warmup (line 2)", "expected a duration"),
            ("duration without unit", load("  freshness: 3\n"), &NO_FLAGS,
             "load.freshness (line 2)",
             "expected a duration such as 1s, 500ms or 1.5m (units: ms, s, m, h), got `3`"),
            ("negative duration", load("  freshness: -3s\n"), &NO_FLAGS,
             "load.freshness (line 2)", "expected a duration"),
            ("timeout not below freshness", load("  freshness: 3s\n  scrape_timeout: 3s\n"), &NO_FLAGS,
             "load.scrape_timeout (line 3)",
             "scrape_timeout (3s) must be shorter than freshness (3s): an answer that late is stale when it arrives"),
            ("freshness within interval", load("  scrape_interval: 2s\n  freshness: 2s\n  scrape_timeout: 1s\n"), &NO_FLAGS,
             "load.freshness (line 3)",
             "freshness (2s) must be longer than scrape_interval (2s): a healthy worker's reading would lapse \
              between scrapes and the gate would go blind"),
            ("max_body_bytes 0", load("  max_body_bytes: 0\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "must be at least 1 byte"),
            ("max_body_bytes 0MiB", load("  max_body_bytes: 0MiB\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "must be at least 1 byte"),
            ("negative size", load("  max_body_bytes: -1\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)",
             "expected a size such as 4MiB, 512KiB or 200000 (a whole number of bytes or of KiB, MiB, GiB, KB, \
              MB, GB), got `-1`"),
            ("fractional size", load("  max_body_bytes: 1.5MiB\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "expected a size such as 4MiB, 512KiB or 200000"),
            ("lower-case unit", load("  max_body_bytes: 4mb\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "expected a size such as 4MiB, 512KiB or 200000"),
            ("unit without a number", load("  max_body_bytes: MiB\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "got `MiB`"),
            ("size with a space", load("  max_body_bytes: 4 MiB\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "got `4 MiB`"),
            ("size beyond usize", load("  max_body_bytes: 99999999999999999999GiB\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", &too_large),
            ("size as a list", load("  max_body_bytes: [4MiB]\n"), &NO_FLAGS,
             "load.max_body_bytes (line 2)", "expected a size such as 4MiB, 512KiB or 200000 (a whole number of \
              bytes or of KiB, MiB, GiB, KB, MB, GB), got a list"),
            ("max_concurrent_scrapes 0", load("  max_concurrent_scrapes: 0\n"), &NO_FLAGS,
             "load.max_concurrent_scrapes (line 2)", "must be at least 1"),
            ("max_concurrent_scrapes as a word", load("  max_concurrent_scrapes: many\n"), &NO_FLAGS,
             "load.max_concurrent_scrapes (line 2)", "expected a non-negative integer, got `many`"),
            ("unknown load key", load("  max_body_size: 1MiB\n"), &NO_FLAGS,
             "load.max_body_size (line 2)",
             "unknown key; expected one of: scrape_interval, scrape_timeout, freshness, max_body_bytes, \
              max_concurrent_scrapes"),
            ("interval beyond default freshness", load("  scrape_interval: 5s\n"), &NO_FLAGS,
             "load.scrape_interval (line 2)", "freshness (3s) must be longer than scrape_interval (5s)"),
            ("unknown top-level key", format!("{POOL}listn: 127.0.0.1:1\n"), &NO_FLAGS,
             "listn (line 6)", "unknown key; expected one of: listen, metrics_listen, max_body_bytes, debug_endpoints,"),
            ("unknown nested key", policy("  worker_queue_limt: 4\n"), &NO_FLAGS,
             "policy.worker_queue_limt (line 2)",
             "unknown key; expected one of: mode, worker_queue_limit, saturation_queue_floor, min_load_choices, \
              min_match_tokens, min_match_share, pin_depth_ratio, gate_unit, divert_margin, \
              saturation_wait_floor, \
              prefill_tokens_per_second, balance_abs_threshold, balance_rel_threshold, cache_threshold, \
              max_fallbacks"),
            ("unknown worker key", pool("        weight: 2\n"), &NO_FLAGS,
             "pools[0].workers[0].weight (line 6)",
             "unknown key; expected one of: endpoint, metrics_url, load_source, loads_url, role, dp_size, \
              max_running_requests, max_total_tokens"),
            ("duplicate key", policy("  min_load_choices: 2\n  min_load_choices: 3\n"), &NO_FLAGS,
             "policy.min_load_choices (line 3)", "duplicate key; first given on line 2"),
            ("section of the wrong type", format!("policy: 4\n{POOL}"), &NO_FLAGS,
             "policy (line 1)", "expected a mapping, got `4`"),
            ("malformed listen", format!("listen: localhost:9002\n{POOL}"), &NO_FLAGS,
             "listen (line 1)", "expected ip:port such as 10.0.0.11:8000"),
            ("endpoint without port", POOL.replace("10.0.0.1:8000", "10.0.0.11"), &NO_FLAGS,
             "pools[0].workers[0].endpoint (line 5)", "expected ip:port such as 10.0.0.11:8000"),
            ("endpoint with host name", POOL.replace("10.0.0.1:8000", "host:80"), &NO_FLAGS,
             "pools[0].workers[0].endpoint (line 5)", "expected ip:port such as 10.0.0.11:8000"),
            ("unspecified endpoint", POOL.replace("10.0.0.1:8000", "0.0.0.0:8000"), &NO_FLAGS,
             "pools[0].workers[0].endpoint (line 5)", "0.0.0.0:8000 is not an address Envoy can send a request to"),
            ("endpoint port 0", POOL.replace("10.0.0.1:8000", "10.0.0.1:0"), &NO_FLAGS,
             "pools[0].workers[0].endpoint (line 5)", "10.0.0.1:0 is not an address Envoy can send a request to"),
            ("missing endpoint", pool("      - role: both\n"), &NO_FLAGS,
             "pools[0].workers[1].endpoint (line 6)", "missing required key"),
            ("missing engine", POOL.replace("    engine: vllm\n", ""), &NO_FLAGS,
             "pools[0].engine (line 2)", "missing required key"),
            ("empty model", POOL.replace("model: m", "model: ''"), &NO_FLAGS,
             "pools[0].model (line 2)", "must not be empty"),
            ("unknown engine", POOL.replace("engine: vllm", "engine: tgi"), &NO_FLAGS,
             "pools[0].engine (line 3)", "expected one of: vllm, sglang; got `tgi`"),
            ("unknown role", pool("        role: both-ways\n"), &NO_FLAGS,
             "pools[0].workers[0].role (line 6)", "expected one of: prefill, decode, both; got `both-ways`"),
            ("block_size not dividing the engine's", pool_with("block_size: 48\n    engine_block_size: 128"), &NO_FLAGS,
             "pools[0].block_size (line 4)",
             "block_size 48 does not divide engine_block_size 128: the engine reuses a cached prefix in whole \
              blocks of 128 tokens; give a block_size that divides it (128, 64, 32, 16)"),
            ("engine_block_size 0", pool_with("engine_block_size: 0"), &NO_FLAGS,
             "pools[0].engine_block_size (line 4)", "must be at least 1"),
            ("block_size 0", pool_with("block_size: 0"), &NO_FLAGS,
             "pools[0].block_size (line 4)", "must be at least 1"),
            ("block_size beyond u32", pool_with("block_size: 4294967296"), &NO_FLAGS,
             "pools[0].block_size (line 4)", "must be at most 4294967295"),
            ("empty chat_template", pool_with("chat_template: ''"), &NO_FLAGS,
             "pools[0].chat_template (line 4)", "must not be empty"),
            ("chat_template as a list", pool_with("chat_template: [a.jinja]"), &NO_FLAGS,
             "pools[0].chat_template (line 4)", "expected a string, got a list"),
            ("segment_cache_entries 0", pool_with("segment_cache_entries: 0"), &NO_FLAGS,
             "pools[0].segment_cache_entries (line 4)", "must be at least 1"),
            ("segment_cache_entries as a word", pool_with("segment_cache_entries: many"), &NO_FLAGS,
             "pools[0].segment_cache_entries (line 4)", "expected a non-negative integer, got `many`"),
            ("default_cache_blocks 0", pool_with("default_cache_blocks: 0"), &NO_FLAGS,
             "pools[0].default_cache_blocks (line 4)", "must be at least 1"),
            ("max_model_len 0", pool_with("max_model_len: 0"), &NO_FLAGS,
             "pools[0].max_model_len (line 4)", "must be at least 1"),
            ("an unknown_subset answer that does not exist", format!("unknown_subset: route\n{POOL}"),
             &NO_FLAGS, "unknown_subset (line 1)", "expected one of: refuse, route_within; got `route`"),
            ("a salt header with a space", format!("cache_salt_header: x tenant\n{POOL}"), &NO_FLAGS,
             "cache_salt_header (line 1)", "is not an HTTP header name"),
            ("a salt header cachepick owns", format!("cache_salt_header: X-Cachepick-Tenant\n{POOL}"),
             &NO_FLAGS, "cache_salt_header (line 1)", "is a header cachepick sets and removes"),
            ("default_cache_blocks as a size", pool_with("default_cache_blocks: 1MiB"), &NO_FLAGS,
             "pools[0].default_cache_blocks (line 4)", "expected a non-negative integer, got `1MiB`"),
            ("unknown pool key", pool_with("chat_templates: a.jinja"), &NO_FLAGS,
             "pools[0].chat_templates (line 4)",
             "unknown key; expected one of: model, engine, block_size, engine_block_size, tokenizer, chat_template, \
              segment_cache_entries, default_cache_blocks, max_model_len, policy, index, workers"),
            ("request body limit 0", format!("max_body_bytes: 0\n{POOL}"), &NO_FLAGS,
             "max_body_bytes (line 1)", "must be at least 1 byte"),
            ("request body limit in lower case", format!("max_body_bytes: 8mib\n{POOL}"), &NO_FLAGS,
             "max_body_bytes (line 1)", "expected a size such as 4MiB, 512KiB or 200000"),
            ("request body limit beyond usize", format!("max_body_bytes: 99999999999999999999GiB\n{POOL}"),
             &NO_FLAGS, "max_body_bytes (line 1)", &too_large),
            ("dp_size 0", pool("        dp_size: 0\n"), &NO_FLAGS,
             "pools[0].workers[0].dp_size (line 6)", "must be at least 1"),
            ("dp_size absurdly large", pool("        dp_size: 10000000\n"), &NO_FLAGS,
             "pools[0].workers[0].dp_size (line 6)", "must be at most 1024"),
            ("metrics_url without scheme", pool("        metrics_url: 10.0.0.1:8000/metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)",
             "expected an http:// or https:// URL naming a host, such as http://10.0.0.11:8000/metrics, \
              got `10.0.0.1:8000/metrics`"),
            ("metrics_url without host", pool("        metrics_url: http:///metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)", "expected an http:// or https:// URL naming a host"),
            ("metrics_url with an empty host", pool("        metrics_url: http://:8000/metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)", "expected an http:// or https:// URL naming a host"),
            ("metrics_url of scheme only", pool("        metrics_url: http://\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)", "expected an http:// or https:// URL naming a host"),
            ("metrics_url with a space", pool("        metrics_url: http://a b/metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)", "expected an http:// or https:// URL naming a host"),
            ("metrics_url of another scheme", pool("        metrics_url: ftp://10.0.0.1/metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)", "expected an http:// or https:// URL naming a host"),
            ("metrics_url over TLS", pool("        metrics_url: https://10.0.0.1:8000/metrics\n"), &NO_FLAGS,
             "pools[0].workers[0].metrics_url (line 6)",
             "`https://10.0.0.1:8000/metrics` is https, and load.tls names no CA to verify the engine's metrics \
              with: set load.tls.ca_file, or scrape over plain http"),
            ("loads_url over TLS", sglang("        load_source: loads\n        loads_url: https://w/v1/loads\n"),
             &NO_FLAGS, "pools[0].workers[0].loads_url (line 7)",
             "`https://w/v1/loads` is https, and load.tls names no CA to verify the engine's /v1/loads with"),
            ("loads_url without scheme", sglang("        load_source: loads\n        loads_url: /v1/loads\n"),
             &NO_FLAGS, "pools[0].workers[0].loads_url (line 7)",
             "expected an http:// or https:// URL naming a host, such as http://10.0.0.11:8000/metrics, got `/v1/loads`"),
            ("unknown load source", pool("        load_source: prometheus\n"), &NO_FLAGS,
             "pools[0].workers[0].load_source (line 6)", "expected one of: metrics, loads; got `prometheus`"),
            ("loads_url without a load source", sglang("        loads_url: http://w/v1/loads\n"), &NO_FLAGS,
             "pools[0].workers[0].loads_url (line 6)", "loads_url is read only with load_source: loads"),
            ("loads_url with the metrics source",
             sglang("        load_source: metrics\n        loads_url: http://w/v1/loads\n"), &NO_FLAGS,
             "pools[0].workers[0].loads_url (line 7)", "loads_url is read only with load_source: loads"),
            ("loads_url with a rejected load source",
             sglang("        load_source: load\n        loads_url: http://w/v1/loads\n"), &NO_FLAGS,
             "pools[0].workers[0].load_source (line 6)", "expected one of: metrics, loads; got `load`"),
            ("loads on vllm", pool("        load_source: loads\n"), &NO_FLAGS,
             "pools[0].workers[0].load_source (line 6)",
             "load_source: loads reads SGLang's /v1/loads; engine vllm has no such endpoint"),
            ("loads and loads_url on vllm", pool("        load_source: loads\n        loads_url: http://w/l\n"),
             &NO_FLAGS, "pools[0].workers[0].load_source (line 6)",
             "load_source: loads reads SGLang's /v1/loads; engine vllm has no such endpoint"),
            ("loads on a rejected engine",
             pool("        load_source: loads\n").replace("engine: vllm", "engine: tgi"), &NO_FLAGS,
             "pools[0].engine (line 3)", "expected one of: vllm, sglang; got `tgi`"),
            ("max_running_requests 0", pool("        max_running_requests: 0\n"), &NO_FLAGS,
             "pools[0].workers[0].max_running_requests (line 6)", "must be at least 1"),
            ("max_total_tokens 0", pool("        max_total_tokens: 0\n"), &NO_FLAGS,
             "pools[0].workers[0].max_total_tokens (line 6)", "must be at least 1"),
            ("max_total_tokens as a size", pool("        max_total_tokens: 1MiB\n"), &NO_FLAGS,
             "pools[0].workers[0].max_total_tokens (line 6)", "expected a non-negative integer, got `1MiB`"),
            ("quoted max_running_requests", pool("        max_running_requests: '8'\n"), &NO_FLAGS,
             "pools[0].workers[0].max_running_requests (line 6)",
             "expected a non-negative integer, got the quoted string \"8\""),
            ("unknown tokenizer kind", pool_with("tokenizer: {kind: sentencepiece}"), &NO_FLAGS,
             "pools[0].tokenizer.kind (line 4)",
             "expected one of: tiktoken, huggingface, bytes; got `sentencepiece`"),
            ("unknown encoding", pool_with("tokenizer: {kind: tiktoken, encoding: gpt2}"), &NO_FLAGS,
             "pools[0].tokenizer.encoding (line 4)",
             "expected one of: o200k_base, cl100k_base, p50k_base, r50k_base; got `gpt2`"),
            ("huggingface without path", pool_with("tokenizer: {kind: huggingface}"), &NO_FLAGS,
             "pools[0].tokenizer.path (line 4)", "missing required key"),
            ("key of another tokenizer kind", pool_with("tokenizer: {kind: bytes, encoding: o200k_base}"), &NO_FLAGS,
             "pools[0].tokenizer.encoding (line 4)", "unknown key; expected one of: kind"),
            ("empty pools", "pools: []\n".to_owned(), &NO_FLAGS,
             "pools (line 1)", "at least one pool is required"),
            ("no pools", "listen: 127.0.0.1:9002\n".to_owned(), &NO_FLAGS,
             "pools (line 1)", "missing: at least one pool is required"),
            ("empty file", String::new(), &NO_FLAGS, "pools (line 1)", "missing: at least one pool is required"),
            ("pool without workers", POOL.replace("\n      - endpoint: 10.0.0.1:8000", " []"), &NO_FLAGS,
             "pools[0].workers (line 4)", "at least one worker is required"),
            ("pool with workers missing", POOL.replace("    workers:\n      - endpoint: 10.0.0.1:8000\n", ""),
             &NO_FLAGS, "pools[0].workers (line 2)", "missing: at least one worker is required"),
            ("duplicate endpoint in a pool", pool("      - endpoint: 10.0.0.1:8000\n"), &NO_FLAGS,
             "pools[0].workers[1].endpoint (line 6)",
             "duplicate endpoint 10.0.0.1:8000; already listed at pools[0].workers[0].endpoint (line 5)"),
            ("duplicate endpoint across pools", two_pools("m", "n", "10.0.0.1:8000"), &NO_FLAGS,
             "pools[1].workers[0].endpoint (line 9)",
             "duplicate endpoint 10.0.0.1:8000; already listed at pools[0].workers[0].endpoint (line 5)"),
            ("duplicate model", two_pools("m", "m", "10.0.0.2:8000"), &NO_FLAGS,
             "pools[1].model (line 6)", "duplicate model m; already served by pools[0].model (line 2)"),
            ("two default pools", two_pools("'*'", "\"*\"", "10.0.0.2:8000"), &NO_FLAGS,
             "pools[1].model (line 6)",
             "a second default pool (`*`); the default pool is already pools[0].model (line 2)"),
            ("pool without a prefill worker", pool("        role: decode\n"), &NO_FLAGS,
             "pools[0].workers (line 4)",
             "no worker has role prefill or both: every request to this pool would be refused"),
            ("YAML syntax error", format!("{POOL}  - model: [x\n"), &NO_FLAGS, "line 7", "invalid YAML"),
            ("alias", format!("{}      - endpoint: *e\n", POOL.replace("endpoint: ", "endpoint: &e ")), &NO_FLAGS,
             "line 6", "aliases (*name) are not supported"),
        ];
    for (name, source, overrides, at, message) in cases {
        let found = problems(&source, overrides);
        let [problem] = found.as_slice() else {
            panic!("{name}: expected one problem, got {found:#?}\nin\n{source}");
        };
        assert_eq!(problem.at.to_string(), at, "{name}: {problem}");
        assert!(
            problem.message.contains(message),
            "{name}: {problem}\nexpected: {message}"
        );
    }
}

/// Every mode-specific key, one per line from line 3 on, under `mode`.
fn every_knob(mode: &str) -> String {
    format!(
        "policy:\n  mode: {mode}\n  worker_queue_limit: 4\n  saturation_queue_floor: 2\n  \
             min_load_choices: 3\n  min_match_tokens: 64\n  pin_depth_ratio: 0.5\n  \
             balance_abs_threshold: 32\n  balance_rel_threshold: 2\n  cache_threshold: 0.5\n  \
             max_fallbacks: 1\n{POOL}"
    )
}

fn messages(source: &str, overrides: &Overrides) -> Vec<String> {
    problems(source, overrides)
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn every_knob_a_mode_ignores_is_listed_at_once_with_its_line() {
    let cache = "remove it (it only applies to cache_aware)";
    let balance = "remove it (it only applies to balance_threshold)";
    let cache_keys = [
        "worker_queue_limit (line 3)",
        "saturation_queue_floor (line 4)",
        "min_load_choices (line 5)",
        "min_match_tokens (line 6)",
        "pin_depth_ratio (line 7)",
    ];
    let balance_keys = [
        "balance_abs_threshold (line 8)",
        "balance_rel_threshold (line 9)",
        "cache_threshold (line 10)",
    ];
    for mode in ["round_robin", "least_load"] {
        let expected: Vec<String> = cache_keys
            .iter()
            .map(|key| (key, cache))
            .chain(balance_keys.iter().map(|key| (key, balance)))
            .map(|(key, why)| {
                format!("policy.{key}: ignored by policy.mode {mode} (line 2): {why}")
            })
            .collect();
        assert_eq!(messages(&every_knob(mode), &NO_FLAGS), expected, "{mode}");
    }
    let expected: Vec<String> = cache_keys
        .iter()
        .map(|key| {
            format!("policy.{key}: ignored by policy.mode balance_threshold (line 2): {cache}")
        })
        .collect();
    assert_eq!(
        messages(&every_knob("balance_threshold"), &NO_FLAGS),
        expected
    );
    let expected: Vec<String> = balance_keys
        .iter()
        .map(|key| format!("policy.{key}: ignored by policy.mode cache_aware (line 2): {balance}"))
        .collect();
    assert_eq!(messages(&every_knob("cache_aware"), &NO_FLAGS), expected);
}

#[test]
fn value_problems_come_before_the_mode_problems_and_both_are_listed() {
    let source = format!(
            "policy:\n  mode: least_load\n  worker_queue_limit: 0\n  balance_rel_threshold: 1\n  \
             min_match_tokens: 64\n  max_fallbacks: 9\n{}",
            POOL.replace(
                "engine: vllm",
                "engine: vllm\n    policy: {mode: balance_threshold, cache_threshold: 2, pin_depth_ratio: 0.5}"
            )
        );
    let found = messages(&source, &NO_FLAGS);
    let least_load = "ignored by policy.mode least_load (line 2): remove it";
    let pool_mode = "ignored by pools[0].policy.mode balance_threshold (line 10): remove it";
    let expected = [
        "policy.worker_queue_limit (line 3): must be at least 1".to_owned(),
        "policy.balance_rel_threshold (line 4): must be greater than 1, got 1".to_owned(),
        "policy.max_fallbacks (line 6): must be at most 8".to_owned(),
        "pools[0].policy.cache_threshold (line 10): must be between 0 and 1, got 2".to_owned(),
        format!("policy.worker_queue_limit (line 3): {least_load}"),
        format!("policy.balance_rel_threshold (line 4): {least_load}"),
        format!("policy.min_match_tokens (line 5): {least_load}"),
        format!("pools[0].policy.pin_depth_ratio (line 10): {pool_mode}"),
    ];
    assert_eq!(found.len(), expected.len(), "{found:#?}");
    for (found, expected) in found.iter().zip(&expected) {
        assert!(
            found.starts_with(expected.as_str()),
            "{found}\nexpected: {expected}"
        );
    }
}

#[test]
fn a_flag_for_a_knob_the_mode_ignores_is_named_with_the_file_key_it_replaces() {
    let source = format!("policy:\n  mode: round_robin\n  worker_queue_limit: 4\n{POOL}");
    let flags = Overrides {
        worker_queue_limit: Some(8),
        saturation_queue_floor: Some(2),
        ..NO_FLAGS
    };
    let why =
        "ignored by policy.mode round_robin (line 2): remove it (it only applies to cache_aware)";
    assert_eq!(
        messages(&source, &flags),
        [
            format!("--worker-queue-limit: {why}"),
            format!("--saturation-queue-floor: {why}"),
            format!("policy.worker_queue_limit (line 3): {why}"),
        ]
    );
}

#[test]
fn pools_inherit_the_keys_they_do_not_set() {
    let source = "\
policy:
  worker_queue_limit: 4
  saturation_queue_floor: 2
  min_match_tokens: 512
  max_fallbacks: 3
pools:
  - model: a
    engine: vllm
    workers: [{endpoint: 10.0.0.1:8000}]
  - model: b
    engine: sglang
    policy: {worker_queue_limit: 16}
    workers: [{endpoint: 10.0.0.2:8000, dp_size: 4}]
  - model: c
    engine: vllm
    policy: {mode: balance_threshold, cache_threshold: 0.5}
    workers: [{endpoint: 10.0.0.3:8000}]
  - model: d
    engine: vllm
    policy: {mode: round_robin, max_fallbacks: 0}
    workers: [{endpoint: 10.0.0.4:8000}]
";
    let config = parse(source, "t", &NO_FLAGS).unwrap();
    let cache_aware = |limit: u64, floor: u64| PolicyConfig {
        mode: Mode::CacheAware(CacheAwareKnobs {
            min_match_tokens: 512,
            ..CacheAwareKnobs::with_gating(Gating::Requests(QueueGate::new(
                NonZeroU64::new(limit).unwrap(),
                NonZeroU64::new(floor),
            )))
        }),
        max_fallbacks: 3,
    };
    assert_eq!(config.policy, cache_aware(4, 2));
    let policies: Vec<_> = config
        .pools
        .iter()
        .map(|pool| pool.policy.clone())
        .collect();
    assert_eq!(
        policies,
        [
            cache_aware(4, 2),
            cache_aware(16, 2),
            PolicyConfig {
                mode: Mode::BalanceThreshold(BalanceKnobs {
                    cache_threshold: DepthRatio::new(0.5).unwrap(),
                    ..BalanceKnobs::default()
                }),
                max_fallbacks: 3,
            },
            PolicyConfig {
                mode: Mode::RoundRobin,
                max_fallbacks: 0,
            },
        ]
    );
    assert_eq!(config.most_fallbacks(), 3);
    let defaults = BalanceKnobs::default();
    assert_eq!(
        (defaults.abs_threshold, defaults.rel_threshold.get()),
        (64, 1.5)
    );

    // A pool can run cache_aware under a top level that does not.
    let source = "\
policy: {mode: least_load, max_fallbacks: 1}
pools:
  - model: a
    engine: vllm
    policy: {mode: cache_aware, worker_queue_limit: 8}
    workers: [{endpoint: 10.0.0.1:8000}]
  - model: b
    engine: vllm
    workers: [{endpoint: 10.0.0.2:8000}]
";
    let config = parse(source, "t", &NO_FLAGS).unwrap();
    assert_eq!(config.most_fallbacks(), 1);
    assert_eq!(config.pools[0].policy.gate().map(QueueGate::limit), Some(8));
    assert_eq!(config.pools[0].policy.max_fallbacks, 1);
    assert_eq!(config.pools[1].policy, config.policy);
    assert_eq!(config.policy.mode, Mode::LeastLoad);
}

#[test]
fn flags_replace_the_top_level_value_and_a_pools_own_key_still_wins() {
    let source = "\
policy: {worker_queue_limit: 4}
pools:
  - model: a
    engine: vllm
    workers: [{endpoint: 10.0.0.1:8000}]
  - model: b
    engine: vllm
    policy: {worker_queue_limit: 16, min_load_choices: 4}
    workers: [{endpoint: 10.0.0.2:8000}]
";
    let flags = Overrides {
        worker_queue_limit: Some(6),
        min_load_choices: Some(3),
        ..NO_FLAGS
    };
    let config = parse(source, "t", &flags).unwrap();
    let knobs = |policy: &PolicyConfig| {
        let knobs = policy.cache_aware().unwrap();
        (
            knobs.queue_gate().map(QueueGate::limit),
            knobs.min_load_choices.get(),
        )
    };
    assert_eq!(knobs(&config.policy), (Some(6), 3));
    assert_eq!(knobs(&config.pools[0].policy), (Some(6), 3));
    assert_eq!(knobs(&config.pools[1].policy), (Some(16), 4));
}

#[test]
fn a_top_level_problem_is_reported_once_however_many_pools_inherit_it() {
    let pool = |i: u8| {
        format!("  - model: m{i}\n    engine: vllm\n    workers: [{{endpoint: 10.0.0.{i}:8000}}]\n")
    };
    let source = format!(
        "policy:\n  worker_queue_limit: 2\n  saturation_queue_floor: 3\npools:\n{}{}{}",
        pool(1),
        pool(2),
        pool(3)
    );
    assert_eq!(
        messages(&source, &NO_FLAGS),
        [
            "policy.saturation_queue_floor (line 3): saturation_queue_floor (3) must be at most \
              worker_queue_limit (2): a floor above the limit would declare the fleet saturated while the \
              gate still admits some workers"
        ]
    );
    let source = format!(
        "policy:\n  mode: round_robin\n  min_match_tokens: 3\npools:\n{}{}",
        pool(1),
        pool(2)
    );
    assert_eq!(messages(&source, &NO_FLAGS).len(), 1);
}

#[test]
fn per_pool_policies_round_trip_and_are_written_as_differences() {
    let source = "\
policy:
  mode: cache_aware
  worker_queue_limit: 4
  saturation_queue_floor: 2
pools:
  - model: same
    engine: vllm
    policy: {worker_queue_limit: 4}
    workers: [{endpoint: 10.0.0.1:8000}]
  - model: bigger
    engine: sglang
    policy: {worker_queue_limit: 16, saturation_queue_floor: 8, pin_depth_ratio: 0.25}
    workers: [{endpoint: 10.0.0.2:8000, dp_size: 4}]
  - model: classic
    engine: vllm
    policy: {mode: balance_threshold, balance_abs_threshold: 32, max_fallbacks: 4}
    workers: [{endpoint: 10.0.0.3:8000}]
  - model: rr
    engine: vllm
    policy: {mode: round_robin}
    workers: [{endpoint: 10.0.0.4:8000}]
  - model: ll
    engine: vllm
    policy: {mode: least_load, max_fallbacks: 2}
    workers: [{endpoint: 10.0.0.5:8000}]
";
    let config = parse(source, "t", &NO_FLAGS).unwrap();
    let yaml = config.to_yaml();
    let again = parse(&yaml, "emitted", &NO_FLAGS).unwrap();
    assert_eq!(again, config, "{yaml}");
    assert_eq!(again.to_yaml(), yaml, "emitting is idempotent");
    let emitted: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
    let pool_policy = |i: usize| serde_yaml::to_string(&emitted["pools"][i]["policy"]).unwrap();
    assert_eq!(
        pool_policy(0),
        "null\n",
        "same as the top level: not written"
    );
    assert_eq!(
        pool_policy(1),
        "worker_queue_limit: 16\nsaturation_queue_floor: 8\npin_depth_ratio: 0.25\n"
    );
    assert_eq!(
        pool_policy(2),
        "mode: balance_threshold\nbalance_abs_threshold: 32\nbalance_rel_threshold: 1.5\n\
             cache_threshold: 0.3\nmax_fallbacks: 4\n"
    );
    assert_eq!(pool_policy(3), "mode: round_robin\n");
    assert_eq!(pool_policy(4), "mode: least_load\n");
    assert!(
            yaml.contains(
                "policy:\n  mode: cache_aware\n  worker_queue_limit: 4\n  saturation_queue_floor: 2\n  \
                 min_load_choices: 2\n  min_match_tokens: 1024\n  min_match_share: 0.0\n  pin_depth_ratio: 0.5\n  \
                 gate_unit: requests\n  \
                 max_fallbacks: 2\n"
            ),
            "{yaml}"
        );

    // A top level of another mode is written with its own keys only.
    let source =
        format!("policy: {{mode: balance_threshold, balance_rel_threshold: 1.25}}\n{POOL}");
    let config = parse(&source, "t", &NO_FLAGS).unwrap();
    let yaml = config.to_yaml();
    assert!(
            yaml.contains(
                "policy:\n  mode: balance_threshold\n  balance_abs_threshold: 64\n  balance_rel_threshold: 1.25\n  \
                 cache_threshold: 0.3\n  max_fallbacks: 2\nload:"
            ),
            "{yaml}"
        );
    assert_eq!(parse(&yaml, "emitted", &NO_FLAGS).unwrap(), config);
}

/// Values for the policy keys of the top level and of one pool; `None` leaves a key out.
#[derive(Debug, Clone)]
struct PolicyKeys {
    mode: Option<ModeKind>,
    limit: Option<u64>,
    floor: Option<u64>,
    min_match_tokens: Option<u64>,
    abs: Option<u64>,
    rel: Option<f64>,
    cache: Option<f64>,
    max_fallbacks: Option<u64>,
}

fn policy_keys() -> impl Strategy<Value = PolicyKeys> {
    (
        prop::option::of(prop::sample::select(&ModeKind::ALL[..])),
        prop::option::of(1_u64..20),
        prop::option::of(1_u64..20),
        prop::option::of(0_u64..5000),
        prop::option::of(0_u64..200),
        prop::option::of(1.01_f64..4.0),
        prop::option::of(0.0_f64..=1.0),
        prop::option::of(0_u64..=8),
    )
        .prop_map(
            |(mode, limit, floor, min_match_tokens, abs, rel, cache, max_fallbacks)| PolicyKeys {
                mode,
                limit,
                floor,
                min_match_tokens,
                abs,
                rel,
                cache,
                max_fallbacks,
            },
        )
}

impl PolicyKeys {
    fn flow(&self) -> String {
        let mut keys = Vec::new();
        if let Some(mode) = self.mode {
            keys.push(format!("mode: {}", mode.as_str()));
        }
        let mut push = |key: &str, value: Option<String>| {
            if let Some(value) = value {
                keys.push(format!("{key}: {value}"));
            }
        };
        push("worker_queue_limit", self.limit.map(|v| v.to_string()));
        push("saturation_queue_floor", self.floor.map(|v| v.to_string()));
        push(
            "min_match_tokens",
            self.min_match_tokens.map(|v| v.to_string()),
        );
        push("balance_abs_threshold", self.abs.map(|v| v.to_string()));
        push("balance_rel_threshold", self.rel.map(|v| v.to_string()));
        push("cache_threshold", self.cache.map(|v| v.to_string()));
        push("max_fallbacks", self.max_fallbacks.map(|v| v.to_string()));
        format!("{{{}}}", keys.join(", "))
    }
}

proptest! {
    /// Whatever the keys at both levels, a configuration is accepted exactly when every key given
    /// belongs to the mode in force where it is given, and every accepted one round-trips.
    #[test]
    fn per_pool_policies_are_accepted_as_the_rules_say_and_round_trip(
        top in policy_keys(),
        own in policy_keys(),
    ) {
        let source = format!(
            "policy: {}\npools:\n  - model: m\n    engine: vllm\n    policy: {}\n    \
             workers: [{{endpoint: 10.0.0.1:8000}}]\n",
            top.flow(),
            own.flow(),
        );
        let fits = |keys: &PolicyKeys, mode: ModeKind| {
            let cache = keys.limit.is_some() || keys.floor.is_some() || keys.min_match_tokens.is_some();
            let balance = keys.abs.is_some() || keys.rel.is_some() || keys.cache.is_some();
            (mode == ModeKind::CacheAware || !cache) && (mode == ModeKind::BalanceThreshold || !balance)
        };
        let top_mode = top.mode.unwrap_or_default();
        let pool_mode = own.mode.unwrap_or(top_mode);
        // The gate is on by default: a floor given without a limit is judged against the default
        // limit, and an absent floor takes a default that never exceeds the limit.
        let gate_fits = |limit: Option<u64>, floor: Option<u64>| {
            floor.is_none_or(|floor| floor <= limit.unwrap_or(QueueGate::DEFAULT_LIMIT))
        };
        let top_gate = top_mode != ModeKind::CacheAware || gate_fits(top.limit, top.floor);
        let own_gate = pool_mode != ModeKind::CacheAware
            || gate_fits(own.limit.or(top.limit), own.floor.or(top.floor));
        let valid = fits(&top, top_mode) && fits(&own, pool_mode) && top_gate && own_gate;
        match parse(&source, "t", &NO_FLAGS) {
            Ok(config) => {
                prop_assert!(valid, "accepted:\n{}", source);
                prop_assert_eq!(config.pools[0].policy.mode.kind(), pool_mode);
                let yaml = config.to_yaml();
                let again = parse(&yaml, "emitted", &NO_FLAGS).unwrap();
                prop_assert_eq!(&again, &config, "{}", yaml);
                prop_assert_eq!(again.to_yaml(), yaml);
            }
            Err(error) => prop_assert!(!valid, "rejected:\n{}\n{}", source, error),
        }
    }
}

#[test]
fn every_unknown_key_is_listed() {
    let found = problems(
        &format!("lissen: 1\npolicy:\n  max_fallback: 1\n{POOL}"),
        &NO_FLAGS,
    );
    let at: Vec<_> = found.iter().map(|problem| problem.at.to_string()).collect();
    assert_eq!(at, ["lissen (line 1)", "policy.max_fallback (line 3)"]);
}

#[test]
fn problems_are_listed_in_phase_order() {
    let source = "\
policy:
  saturation_queue_floor: 5
pools:
  - model: m
    engine: vllm
    workers:
      - endpoint: 10.0.0.1:8000
        dp_size: 0
  - model: m
    engine: vllm
    workers:
      - endpoint: 10.0.0.2:8000
listn: 1
";
    let found: Vec<_> = problems(source, &NO_FLAGS)
        .iter()
        .map(ToString::to_string)
        .collect();
    let at: Vec<_> = found
        .iter()
        .map(|problem| problem.split(':').next().unwrap())
        .collect();
    assert_eq!(
        at,
        [
            "pools[0].workers[0].dp_size (line 8)",
            "listn (line 13)",
            "policy.saturation_queue_floor (line 2)",
            "pools[1].model (line 9)",
        ],
        "{found:#?}"
    );
}

#[test]
fn the_error_lists_every_problem_one_per_line() {
    let error = parse(
        &format!("policy:\n  worker_queue_limit: 0\n  min_load_choices: 0\n{POOL}"),
        "f.yaml",
        &NO_FLAGS,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        error,
        "invalid configuration in f.yaml:\n  policy.worker_queue_limit (line 2): must be at least 1\n  \
             policy.min_load_choices (line 3): must be at least 1"
    );
}

#[test]
fn load_reads_the_file_and_names_it_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cachepick.yaml");
    let missing = load(&path, &NO_FLAGS).unwrap_err();
    assert!(matches!(missing, ConfigError::Read { .. }), "{missing:?}");
    assert!(
        missing.to_string().contains("cachepick.yaml: No such file"),
        "{missing}"
    );
    std::fs::write(&path, POOL).unwrap();
    assert_eq!(
        load(&path, &NO_FLAGS).unwrap(),
        parse(POOL, "t", &NO_FLAGS).unwrap()
    );
    std::fs::write(&path, "pools: []\n").unwrap();
    let Err(ConfigError::Invalid { file, .. }) = load(&path, &NO_FLAGS) else {
        panic!("accepted")
    };
    assert_eq!(file, path.display().to_string());
}

/// Characters that make YAML structure, for mutating the example.
const YAML_CHARS: &[char] = &[
    ':', '-', ' ', '\n', '[', ']', '{', '}', '#', '&', '*', '!', '|', '>', '\'', '"', '?', ',',
    '%', '@', '`', '0', 'a', '.', '\t',
];

/// Up to seven insertions, deletions or replacements of single characters.
fn edits() -> impl Strategy<Value = Vec<(prop::sample::Index, u8, char)>> {
    let edit = (
        any::<prop::sample::Index>(),
        0..3u8,
        prop::sample::select(YAML_CHARS),
    );
    prop::collection::vec(edit, 1..8)
}

/// Values for the load keys and a worker's load and capacity keys; `None` leaves a key out.
#[derive(Debug)]
struct LoadKeys {
    max_body_bytes: Option<String>,
    max_concurrent_scrapes: Option<u64>,
    engine: Engine,
    load_source: Option<LoadSource>,
    loads_url: Option<String>,
    max_running_requests: Option<u64>,
    max_total_tokens: Option<u64>,
}

fn load_keys() -> impl Strategy<Value = LoadKeys> {
    let size = (
        1u64..=u64::from(u32::MAX),
        prop::sample::select(&["", "KiB", "MiB", "GiB", "KB", "MB", "GB"][..]),
    )
        .prop_map(|(count, unit)| format!("{count}{unit}"));
    (
        prop::option::of(size),
        prop::option::of(1u64..=1024),
        prop::sample::select(&[Engine::Vllm, Engine::Sglang][..]),
        prop::option::of(prop::sample::select(
            &[LoadSource::Metrics, LoadSource::Loads][..],
        )),
        prop::option::of("http://[a-z]{1,8}(:[0-9]{1,4})?(/[a-z0-9]{0,8}){0,2}"),
        prop::option::of(1u64..),
        prop::option::of(1u64..),
    )
        .prop_map(
            |(size, scrapes, engine, source, url, running, tokens)| LoadKeys {
                max_body_bytes: size,
                max_concurrent_scrapes: scrapes,
                engine,
                load_source: source,
                loads_url: url,
                max_running_requests: running,
                max_total_tokens: tokens,
            },
        )
}

impl LoadKeys {
    fn source(&self) -> String {
        let mut load = String::new();
        if let Some(bytes) = &self.max_body_bytes {
            load += &format!("  max_body_bytes: {bytes}\n");
        }
        if let Some(scrapes) = self.max_concurrent_scrapes {
            load += &format!("  max_concurrent_scrapes: {scrapes}\n");
        }
        let mut worker = String::new();
        if let Some(source) = self.load_source {
            worker += &format!("        load_source: {}\n", source.as_str());
        }
        if let Some(url) = &self.loads_url {
            worker += &format!("        loads_url: {url}\n");
        }
        if let Some(running) = self.max_running_requests {
            worker += &format!("        max_running_requests: {running}\n");
        }
        if let Some(tokens) = self.max_total_tokens {
            worker += &format!("        max_total_tokens: {tokens}\n");
        }
        let pool = POOL.replace("engine: vllm", &format!("engine: {}", self.engine.as_str()));
        format!("load:\n{load}{pool}{worker}")
    }

    /// Whether the rules accept these values.
    fn valid(&self) -> bool {
        let loads = self.load_source == Some(LoadSource::Loads);
        (!loads || self.engine == Engine::Sglang) && (loads || self.loads_url.is_none())
    }
}

proptest! {
    #[test]
    fn the_load_keys_are_accepted_as_the_rules_say_and_round_trip(keys in load_keys()) {
        let source = keys.source();
        // Sizes are at most u32::MAX GB, which fits a 64-bit usize.
        match parse(&source, "t", &NO_FLAGS) {
            Ok(config) => {
                prop_assert!(keys.valid(), "accepted:\n{}", source);
                let worker = &config.pools[0].workers[0];
                prop_assert_eq!(worker.load_source, keys.load_source.unwrap_or_default());
                let loads = worker.load_source == LoadSource::Loads;
                prop_assert_eq!(worker.loads_url.is_some(), loads);
                let running = worker.max_running_requests.map(NonZeroU64::get);
                prop_assert_eq!(running, keys.max_running_requests);
                let tokens = worker.max_total_tokens.map(NonZeroU64::get);
                prop_assert_eq!(tokens, keys.max_total_tokens);
                let emitted = parse(&config.to_yaml(), "emitted", &NO_FLAGS).unwrap();
                prop_assert_eq!(emitted, config);
            }
            Err(error) => prop_assert!(!keys.valid(), "rejected:\n{}\n{}", source, error),
        }
    }

    #[test]
    fn parse_never_panics_on_arbitrary_text(source in any::<String>()) {
        let _ = parse(&source, "fuzz", &NO_FLAGS);
    }

    #[test]
    fn mutations_of_the_example_never_panic_and_round_trip_when_accepted(edits in edits()) {
        let mut source: Vec<char> = EXAMPLE.chars().collect();
        for (at, edit, c) in edits {
            let i = at.index(source.len() + 1);
            match edit {
                0 => source.insert(i, c),
                1 if i < source.len() => { source.remove(i); }
                _ if i < source.len() => source[i] = c,
                _ => source.push(c),
            }
        }
        let source: String = source.into_iter().collect();
        if let Ok(config) = parse(&source, "fuzz", &NO_FLAGS) {
            prop_assert_eq!(parse(&config.to_yaml(), "emitted", &NO_FLAGS).unwrap(), config);
        }
    }
}

#[test]
fn debug_endpoints_is_a_plain_boolean_or_absent() {
    let off = format!("debug_endpoints: false\n{POOL}");
    assert_eq!(
        parse(&off, "t.yaml", &NO_FLAGS).unwrap().debug_endpoints,
        Some(false)
    );
    assert_eq!(
        parse(POOL, "t.yaml", &NO_FLAGS).unwrap().debug_endpoints,
        None
    );
    let quoted = format!("debug_endpoints: \"false\"\n{POOL}");
    let message = parse(&quoted, "t.yaml", &NO_FLAGS).unwrap_err().to_string();
    assert!(
        message.contains("debug_endpoints (line 1): expected true or false"),
        "{message}"
    );
}

#[test]
fn a_misspelt_tokenizer_kind_is_named_as_an_unknown_key() {
    let text = POOL.replace(
        "engine: vllm",
        "engine: vllm\n    tokenizer: {kidn: tiktoken}",
    );
    let message = parse(&text, "t.yaml", &NO_FLAGS).unwrap_err().to_string();
    assert!(
        message.contains("pools[0].tokenizer.kidn (line 4): unknown key"),
        "{message}"
    );
    assert!(message.contains("pools[0].tokenizer.kind"), "{message}");
}

#[test]
fn kv_event_sockets_are_checked_and_every_rank_needs_a_port() {
    let pool = |index: &str, worker: &str| {
        format!(
            "pools:\n  - model: m\n    engine: sglang\n    index: {index}\n    workers:\n      - endpoint: 10.0.0.1:8000\n        dp_size: 4\n{worker}"
        )
    };
    let messages = |source: String| -> Vec<String> {
        problems(&source, &NO_FLAGS)
            .into_iter()
            .map(|problem| problem.to_string())
            .collect()
    };
    let found = messages(pool("{mode: exact, port: 0, speculative_ttl: 5m}", ""));
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(
        found[0].contains("expected one of: approximate, events"),
        "{found:?}"
    );
    assert!(
        found.iter().any(|m| m.contains("a port from 1 to 65535")),
        "{found:?}"
    );
    assert!(found.iter().any(|m| m.contains("at most 60s")), "{found:?}");
    let found = messages(pool(
        "{mode: events, port: 65534}",
        "        kv_events: {endpoint: 'tcp://*:5557', replay_endpoint: tcp://10.0.0.1:5558, extra: 1}\n",
    ));
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|m| m.contains("unknown key")), "{found:?}");
    assert!(
        found.iter().any(|m| m.contains("a ZeroMQ TCP endpoint")),
        "{found:?}"
    );
    let found = messages(pool("{mode: events, port: 65534}", ""));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("rank 3 would publish on port 65537"),
        "{found:?}"
    );
}

/// `index.sockets`: whose word a worker's KV event sockets are, file and discovered workers alike; a
/// worker's own `kv_events:` is the override, never asked of the engine.
#[test]
fn who_names_a_workers_kv_event_sockets() {
    let pool = |index: &str| {
        format!(
            "pools:\n  - model: m\n    engine: vllm\n    index: {index}\n    workers:\n      - endpoint: 10.0.0.1:8000\n      - endpoint: 10.0.0.2:8000\n        kv_events: {{endpoint: tcp://10.0.0.2:6000}}\n"
        )
    };
    let from = |index: &str| -> Vec<KvEventsFrom> {
        accepted(&pool(index), &NO_FLAGS).pools[0]
            .workers
            .iter()
            .map(|worker| worker.kv_events_from)
            .collect()
    };
    assert_eq!(
        from("{mode: events}"),
        [KvEventsFrom::Engine, KvEventsFrom::Worker]
    );
    assert_eq!(
        from("{mode: events, sockets: ports}"),
        [KvEventsFrom::Pool, KvEventsFrom::Worker]
    );
    let config = accepted(
        &pool("{mode: events, sockets: ports, port: 6001}"),
        &NO_FLAGS,
    );
    assert_eq!(config.pools[0].index.sockets, IndexSockets::Ports);
    assert_eq!(
        config.pools[0].workers[0].kv_events.live,
        addr("10.0.0.1:6001")
    );
    // The effective file says the same, and a worker's sockets stay its own.
    let again = accepted(&config.to_yaml(), &NO_FLAGS);
    assert_eq!(again.pools[0].workers, config.pools[0].workers);
    assert_eq!(again.pools[0].index, config.pools[0].index);
    let found = problems(&pool("{mode: events, sockets: asked}"), &NO_FLAGS);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0]
            .to_string()
            .contains("expected one of: advertised, ports"),
        "{found:?}"
    );
}

#[test]
fn the_lifecycle_keys_are_read_and_checked() {
    let yaml = |load: &str| {
        format!(
            "load: {{{load}}}\npools:\n  - model: m\n    engine: vllm\n    workers: [{{endpoint: 10.0.0.1:8000}}]\n"
        )
    };
    let config = parse(
        &yaml("unreachable_after: 3, drain_timeout: 1m"),
        "t",
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(config.load.unreachable_after.get(), 3);
    assert_eq!(config.load.drain_timeout, Duration::from_secs(60));
    let defaults = parse(&yaml(""), "t", &Overrides::default()).unwrap();
    assert_eq!(defaults.load.unreachable_after.get(), 2);
    assert_eq!(defaults.load.drain_timeout, Duration::from_secs(30));
    let error = parse(
        &yaml("unreachable_after: 0, drain_timeout: 0s"),
        "t",
        &Overrides::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("load.unreachable_after (line 1)"), "{error}");
    assert!(error.contains("load.drain_timeout (line 1)"), "{error}");
}

#[test]
fn the_prefill_rate_window_is_read_and_defaults_to_30s_and_5s() {
    let source =
        format!("load:\n  prefill_rate_half_life: 2m\n  prefill_rate_warmup: 750ms\n{POOL}");
    let config = parse(&source, "t", &Overrides::default()).unwrap();
    assert_eq!(config.load.rate.half_life, Duration::from_secs(120));
    assert_eq!(config.load.rate.warmup, Duration::from_millis(750));
    let defaults = parse(POOL, "t", &Overrides::default()).unwrap();
    assert_eq!(defaults.load.rate.half_life, Duration::from_secs(30));
    assert_eq!(defaults.load.rate.warmup, Duration::from_secs(5));
}

#[test]
fn the_salt_header_is_lower_cased_and_emitted() {
    let source = format!("cache_salt_header: X-Tenant-ID\n{POOL}");
    let config = parse(&source, "salt.yaml", &Overrides::default()).unwrap();
    assert_eq!(config.cache_salt_header.as_deref(), Some("x-tenant-id"));
    let again = parse(&config.to_yaml(), "emitted.yaml", &Overrides::default()).unwrap();
    assert_eq!(again, config);
}

#[test]
fn listen_and_metrics_listen_may_not_share_a_port() {
    let pool = "pools:\n  - model: m\n    engine: vllm\n    workers: [{endpoint: 127.0.0.1:1}]\n";
    for (listen, metrics) in [
        ("127.0.0.1:9002", "127.0.0.1:9002"),
        ("0.0.0.0:9002", "127.0.0.1:9002"),
        ("127.0.0.1:9002", "0.0.0.0:9002"),
    ] {
        let source = format!("listen: {listen}\nmetrics_listen: {metrics}\n{pool}");
        assert_eq!(
            messages(&source, &NO_FLAGS),
            [format!(
                "metrics_listen (line 2): metrics_listen ({metrics}) takes the port of listen ({listen}): each server needs its own"
            )],
            "{source}"
        );
    }
    // The system's choice (port 0), other ports, other addresses of one port are all fine.
    for (listen, metrics) in [
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("127.0.0.1:9002", "127.0.0.1:9090"),
        ("127.0.0.1:9002", "127.0.0.2:9002"),
    ] {
        let source = format!("listen: {listen}\nmetrics_listen: {metrics}\n{pool}");
        assert!(parse(&source, "test.yaml", &NO_FLAGS).is_ok(), "{source}");
    }
}

#[test]
fn a_pool_block_that_divides_the_engine_s_is_taken_and_the_empty_topic_is_the_default() {
    let text = POOL.replace(
        "engine: vllm\n",
        "engine: vllm\n    block_size: 16\n    engine_block_size: 128\n    index: {mode: events, topic: \"\"}\n",
    );
    let config = parse(&text, "t.yaml", &Overrides::default()).unwrap();
    assert_eq!(
        config.pools[0].engine_block_size.map(NonZeroU32::get),
        Some(128)
    );
    assert_eq!(config.pools[0].index.topic, "");
    // Written back as read, so `check`'s effective configuration reloads to the same.
    let again = parse(&config.to_yaml(), "again.yaml", &Overrides::default()).unwrap();
    assert_eq!(again.pools[0], config.pools[0]);
}

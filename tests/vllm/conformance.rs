//! The simulator held to the real engine: the same requests to a real vLLM 0.32 and to a simulated
//! vLLM with the same tokenizer, chat template and block size, and what a router reads of each
//! compared — `/metrics` (names, types and label names of every family cachepick and its peers read),
//! the KV event batches (their shape, and the fields and value kinds of each event), the responses'
//! `usage` (whole-block `cached_tokens`), `/tokenize`, `/version`, `/kv_event_sources` and
//! `cache_config_info`.
//!
//! Every difference fails, unless [`KNOWN`] lists it with the reason; a [`KNOWN`] entry no difference
//! matches fails too, so the list never outlives what it explains.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use rmpv::Value as Msgpack;
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SubSocket};

use cachepick_sim::config::{KvEventsConfig, KvEventsFormat, TokenizerConfig};
use cachepick_sim::fleet::Fleet as SimFleet;
use cachepick_sim::{Engine as SimEngine, SimConfig};

use crate::engines;
use crate::support::vllm::{self, ENGINE_BLOCK, Fleet, MODEL, prose};

/// The families a router reads of a vLLM: cachepick's (`src/load/engine.rs`) and its peers' (the
/// Gateway API Inference Extension and llm-d: waiting, running, KV usage, `cache_config_info`;
/// vllm-router and smg: waiting, running, KV usage, the prefix-cache counters; AIBrix adds the
/// latency histograms).
const READ_BY_ROUTERS: &[&str] = &[
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_prefill_kv_computed_tokens",
    "process_start_time_seconds",
];

/// Every difference the simulator keeps, with why. A difference not listed here fails the test.
const KNOWN: &[(&str, &str)] = &[(
    "vllm:cache_config_info labels",
    "the simulator writes the labels routers read (block_size, num_gpu_blocks, engine) and a few \
         more; vLLM 0.32 writes every CacheConfig field (36 labels), none of which changes routing",
)];

/// One family of an exposition: its type and the label names of its samples (`le` and `_bucket`,
/// `_sum`, `_count` folded into the family).
#[derive(Debug, PartialEq, Eq)]
struct Family {
    kind: String,
    labels: BTreeSet<String>,
}

fn families(text: &str) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            // prometheus_client writes a counter's TYPE without `_total`, its samples with it.
            let name = if kind == "counter" {
                format!("{}_total", name.trim_end_matches("_total"))
            } else {
                name.to_owned()
            };
            families.entry(name).or_insert(Family {
                kind: kind.to_owned(),
                labels: BTreeSet::new(),
            });
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let series = line.rsplit_once(' ').map_or(line, |(series, _)| series);
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = name.strip_suffix(suffix)?;
                families.contains_key(base).then(|| base.to_owned())
            })
            .unwrap_or_else(|| name.to_owned());
        if let Some(family) = families.get_mut(&family) {
            for pair in labels
                .trim_end_matches('}')
                .split(',')
                .filter(|pair| !pair.is_empty())
            {
                let key = pair.split('=').next().unwrap_or_default();
                if key != "le" {
                    family.labels.insert(key.to_owned());
                }
            }
        }
    }
    families
}

/// The first KV event batch published after `send` runs, as (batch shape, first `BlockStored`).
async fn first_batch(endpoint: &str, send: impl Future<Output = ()>) -> Msgpack {
    let mut sub = SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    // The subscription has to reach the publisher before the batch is published.
    tokio::time::sleep(Duration::from_millis(500)).await;
    send.await;
    let message = tokio::time::timeout(Duration::from_secs(20), sub.recv())
        .await
        .expect("a batch within 20 s")
        .unwrap();
    let frames: Vec<_> = message.into_vec();
    assert_eq!(frames.len(), 3, "topic, sequence, payload");
    rmpv::decode::read_value(&mut frames[2].as_ref()).unwrap()
}

/// A batch's shape: its length and element kinds, and each event's fields and their value kinds.
fn shape(batch: &Msgpack) -> (Vec<&'static str>, BTreeMap<String, &'static str>) {
    fn kind(value: &Msgpack) -> &'static str {
        match value {
            Msgpack::Nil => "nil",
            Msgpack::Boolean(_) => "bool",
            Msgpack::Integer(_) => "int",
            Msgpack::F32(_) | Msgpack::F64(_) => "float",
            Msgpack::String(_) => "str",
            Msgpack::Binary(_) => "bytes",
            Msgpack::Array(_) => "array",
            Msgpack::Map(_) => "map",
            Msgpack::Ext(..) => "ext",
        }
    }
    let Msgpack::Array(items) = batch else {
        panic!("a batch is an array: {batch}");
    };
    let outer = items.iter().map(kind).collect();
    let mut fields = BTreeMap::new();
    if let Some(Msgpack::Array(events)) = items.get(1)
        && let Some(Msgpack::Map(event)) = events.first()
    {
        for (key, value) in event {
            fields.insert(key.as_str().unwrap_or_default().to_owned(), kind(value));
        }
    }
    (outer, fields)
}

/// The differences found, each known one reported and set aside.
#[derive(Default)]
struct Differences {
    unknown: Vec<String>,
    known_seen: BTreeSet<&'static str>,
}

impl Differences {
    fn note(&mut self, what: String) {
        match KNOWN.iter().find(|(known, _)| what.starts_with(known)) {
            Some((known, _)) => {
                eprintln!("conformance: known difference: {what}");
                self.known_seen.insert(known);
            }
            None => self.unknown.push(what),
        }
    }

    /// Fails on any difference not known, and on any known one no longer found.
    fn finish(self) {
        assert!(
            self.unknown.is_empty(),
            "the simulator differs from vLLM 0.32 where a router looks:\n  {}",
            self.unknown.join("\n  ")
        );
        for (known, why) in KNOWN {
            assert!(
                self.known_seen.contains(known),
                "{known} no longer differs ({why}): drop it from KNOWN"
            );
        }
    }
}

/// A simulated vLLM as like the real engines as the simulator can be told: their model name,
/// tokenizer, chat template, block size, context and event format.
async fn simulated_engine() -> SimFleet {
    let install = vllm::install();
    let mut sim = SimConfig::new(SimEngine::Vllm, cachepick_rig::nz(1));
    sim.model = MODEL.to_owned();
    sim.tokenizer = TokenizerConfig::HuggingFace {
        path: install.tokenizer(),
    };
    sim.chat_template = Some(install.tokenizer_config());
    sim.block_size = cachepick_rig::nz(ENGINE_BLOCK as u32);
    sim.params.max_model_len = cachepick_rig::nz(8192);
    sim.params.jitter = 0.0;
    sim.params.time_scale = 0.01;
    sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::VllmMap));
    SimFleet::start(&sim).await.unwrap()
}

/// A completion, its repeat (served from the cache) and a chat: one engine's answers.
type Answers = (Value, Value, Value);

/// The answers' `usage`: the same fields, the same prompt tokens, and the repeat's cached tokens in
/// whole blocks of the same size.
fn compare_usage(real: &Answers, simulated: &Answers, differences: &mut Differences) {
    for (name, real, simulated) in [
        ("completion", &real.0, &simulated.0),
        ("repeat", &real.1, &simulated.1),
        ("chat", &real.2, &simulated.2),
    ] {
        let keys = |usage: &Value| -> BTreeSet<String> {
            let mut keys: BTreeSet<String> = usage.as_object().unwrap().keys().cloned().collect();
            if let Some(details) = usage["prompt_tokens_details"].as_object() {
                keys.extend(
                    details
                        .keys()
                        .map(|key| format!("prompt_tokens_details.{key}")),
                );
            }
            keys
        };
        let (real_keys, simulated_keys) = (keys(&real["usage"]), keys(&simulated["usage"]));
        if real_keys != simulated_keys {
            differences.note(format!(
                "{name} usage fields: real {real_keys:?}, simulated {simulated_keys:?}"
            ));
        }
        if real["usage"]["prompt_tokens"] != simulated["usage"]["prompt_tokens"] {
            differences.note(format!(
                "{name} prompt_tokens: real {}, simulated {}",
                real["usage"], simulated["usage"]
            ));
        }
    }
    let cached =
        |answer: &Value| answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let prompt_tokens = real.1["usage"]["prompt_tokens"].as_u64().unwrap();
    let whole = vllm::whole_blocks(prompt_tokens);
    assert_eq!(
        cached(&real.1),
        Some(whole),
        "the real engine: {}",
        real.1["usage"]
    );
    if cached(&simulated.1) != Some(whole) {
        differences.note(format!(
            "repeat cached_tokens: real {whole}, simulated {:?}",
            cached(&simulated.1)
        ));
    }
}

/// `/tokenize` of each body, and `/version`.
async fn compare_tokenize_and_version(
    real: SocketAddr,
    simulated: SocketAddr,
    bodies: &[&Value],
    differences: &mut Differences,
) {
    let fields = |value: &Value| {
        value
            .as_object()
            .map(|object| object.keys().cloned().collect::<BTreeSet<_>>())
    };
    for body in bodies {
        let (real, simulated) = (
            post(real, "/tokenize", body).await,
            post(simulated, "/tokenize", body).await,
        );
        if real["tokens"] != simulated["tokens"] || real["count"] != simulated["count"] {
            differences.note(format!(
                "/tokenize of {body}: real {real}, simulated {simulated}"
            ));
        }
        if fields(&real) != fields(&simulated) {
            differences.note(format!(
                "/tokenize fields: real {real}, simulated {simulated}"
            ));
        }
    }
    let version = |addr| async move {
        let (status, text) = vllm::get(addr, "/version", Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let (real, simulated) = (version(real).await, version(simulated).await);
    assert!(
        real["version"].as_str().unwrap().starts_with("0.32."),
        "{real}"
    );
    if !simulated["version"].as_str().unwrap().starts_with("0.32.") {
        differences.note(format!("/version: real {real}, simulated {simulated}"));
    }
}

/// `/kv_event_sources`: the ranks that publish, and the fields of each rank's publisher.
async fn compare_kv_event_sources(
    real: SocketAddr,
    simulated: SocketAddr,
    differences: &mut Differences,
) {
    let sources = |addr| async move {
        let (status, text) = vllm::get(addr, "/kv_event_sources", Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(status, 200, "{text}");
        let sources: Value = serde_json::from_str(&text).unwrap();
        let shape: BTreeMap<String, BTreeSet<String>> = sources
            .as_object()
            .unwrap()
            .iter()
            .map(|(rank, source)| {
                let fields = source.as_object().unwrap().keys().cloned().collect();
                (rank.clone(), fields)
            })
            .collect();
        (sources, shape)
    };
    let ((real, real_shape), (simulated, simulated_shape)) =
        (sources(real).await, sources(simulated).await);
    assert!(real["0"]["endpoint"].is_string(), "{real}");
    if real_shape != simulated_shape {
        differences.note(format!(
            "/kv_event_sources: real {real}, simulated {simulated}"
        ));
    }
}

/// The KV event batches: their shape, and the first event's fields and value kinds.
fn compare_events(real: &Msgpack, simulated: &Msgpack, differences: &mut Differences) {
    let (real_outer, real_fields) = shape(real);
    let (simulated_outer, simulated_fields) = shape(simulated);
    if real_outer != simulated_outer {
        differences.note(format!(
            "event batch: real {real_outer:?}, simulated {simulated_outer:?}"
        ));
    }
    let keys: BTreeSet<_> = real_fields.keys().chain(simulated_fields.keys()).collect();
    for key in keys {
        let (real, simulated) = (real_fields.get(key), simulated_fields.get(key));
        if real != simulated {
            differences.note(format!(
                "BlockStored.{key}: real {real:?}, simulated {simulated:?}"
            ));
        }
    }
}

/// `/metrics`: every family a router reads, with its type and label names, and the block size.
fn compare_metrics(real_text: &str, simulated_text: &str, differences: &mut Differences) {
    let (real_families, simulated_families) = (families(real_text), families(simulated_text));
    for name in READ_BY_ROUTERS {
        let real = real_families.get(*name).unwrap_or_else(|| {
            panic!("the real engine has no {name}: what a router reads is gone")
        });
        match simulated_families.get(*name) {
            None => differences.note(format!("{name}: missing from the simulator")),
            Some(simulated) if simulated.kind != real.kind => differences.note(format!(
                "{name}: type {} real, {} simulated",
                real.kind, simulated.kind
            )),
            Some(simulated) if simulated.labels != real.labels => differences.note(format!(
                "{name} labels: real {:?}, simulated {:?}",
                real.labels, simulated.labels
            )),
            Some(_) => {}
        }
    }
    let block = |text: &str| vllm::label_of(text, "vllm:cache_config_info", "block_size");
    assert_eq!(block(real_text).as_deref(), Some("128"));
    if block(real_text) != block(simulated_text) {
        differences.note(format!(
            "cache_config_info block_size: real {:?}, simulated {:?}",
            block(real_text),
            block(simulated_text)
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_shows_a_router_what_the_real_engine_shows() {
    let fleet = Fleet::lock(&engines()).await;
    let engine = &fleet.engines[0];
    let simulated = simulated_engine().await;
    let worker = &simulated.workers()[0];
    let sim_events = worker.kv_events().unwrap().live_endpoint().unwrap();
    let real_events = format!("tcp://{}", engine.kv_events);

    // The same requests to both: a completion (sent twice: its repeat is served from the cache), then
    // a chat. Both engines' KV event batches of the first one are kept.
    let completion = json!({"model": MODEL, "prompt": prose(20_000, 1000), "max_tokens": 4});
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": prose(20_001, 400)}],
                      "max_tokens": 4});
    let mut answers = Vec::new();
    let mut batches = Vec::new();
    for (target, events) in [(engine.http, real_events), (worker.addr(), sim_events)] {
        let mut first = None;
        let batch = first_batch(&events, async {
            first = Some(post(target, "/v1/completions", &completion).await);
        })
        .await;
        let again = post(target, "/v1/completions", &completion).await;
        let chatted = post(target, "/v1/chat/completions", &chat).await;
        answers.push((first.unwrap(), again, chatted));
        batches.push(batch);
    }
    let mut differences = Differences::default();
    compare_usage(&answers[0], &answers[1], &mut differences);
    compare_tokenize_and_version(
        engine.http,
        worker.addr(),
        &[&completion, &chat],
        &mut differences,
    )
    .await;
    compare_events(&batches[0], &batches[1], &mut differences);
    compare_kv_event_sources(engine.http, worker.addr(), &mut differences).await;
    let (real_metrics, _) = engine.metrics().await;
    let (status, simulated_metrics) = vllm::get(worker.addr(), "/metrics", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(status, 200);
    compare_metrics(&real_metrics, &simulated_metrics, &mut differences);
    differences.finish();
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (status, text) = vllm::post(addr, path, body, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(status, 200, "{addr}{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

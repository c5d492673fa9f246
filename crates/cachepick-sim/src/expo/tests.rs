use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use super::*;
use crate::stats::{LATENCY_BUCKETS, sample_ranks as ranks};

const MODEL: &str = "org/model \"q\"";

/// One parsed sample line.
struct Line {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parses the exposition strictly: every line is a comment or `name{labels} value`, every sample's
/// family has exactly one TYPE line before it.
fn lines(text: &str) -> Vec<Line> {
    assert!(text.ends_with('\n'));
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["gauge", "counter", "histogram"].contains(&kind), "{line}");
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "{line}"
            );
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.strip_suffix('}').unwrap()),
            None => (series, ""),
        };
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "{line}"
        );
        let labels = split_labels(labels);
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| types.get(*base).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "no TYPE for {line}");
        samples.push(Line {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    samples
}

/// `a="x",b="y"` into pairs, unescaping values.
fn split_labels(mut text: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    while !text.is_empty() {
        let (name, rest) = text.split_once("=\"").unwrap();
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (at, c) = chars.next().unwrap();
            match c {
                '\\' => match chars.next().unwrap().1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break at,
                c => value.push(c),
            }
        };
        labels.push((name.to_owned(), value));
        text = rest[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&rest[end + 1..]);
    }
    labels
}

fn label<'a>(line: &'a Line, name: &str) -> Option<&'a str> {
    line.labels
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn every_line_is_well_formed_and_typed() {
    for engine in [Engine::Vllm, Engine::Sglang] {
        for n in [0, 1, 3] {
            let text = render_metrics(engine, MODEL, &ranks(n));
            // The process collector's series is the process's, unlabelled; the rest are the engine's.
            let (process, samples): (Vec<Line>, Vec<Line>) = lines(&text)
                .into_iter()
                .partition(|s| s.name.starts_with("process_"));
            let expected = if n == 0 { 0 } else { 1 };
            assert_eq!(process.len(), expected, "{engine:?}, {n} ranks");
            assert!(
                process
                    .iter()
                    .all(|s| s.name == "process_start_time_seconds"
                        && s.labels.is_empty()
                        && s.value == ranks(n)[0].process_start_time)
            );
            assert!(
                samples.iter().all(|s| label(s, "model_name") == Some(MODEL)
                    || s.name.ends_with("cache_config_info"))
            );
            if engine == Engine::Sglang {
                let with_dp = samples
                    .iter()
                    .filter(|s| label(s, "dp_rank").is_some())
                    .count();
                assert_eq!(with_dp, if n > 1 { samples.len() } else { 0 });
                assert!(samples.iter().all(|s| label(s, "tp_rank") == Some("0")));
            } else {
                assert!(samples.iter().all(|s| label(s, "engine").is_some()));
            }
        }
    }
}

#[test]
fn histograms_are_cumulative_and_end_at_the_count() {
    let stats = ranks(3);
    for (engine, prefix) in [(Engine::Vllm, "vllm"), (Engine::Sglang, "sglang")] {
        let samples = lines(&render_metrics(engine, MODEL, &stats));
        for family in ["time_to_first_token_seconds", "e2e_request_latency_seconds"] {
            let name = format!("{prefix}:{family}");
            for want in &stats {
                let ours = |s: &&Line| {
                    let rank = label(s, "engine").or(label(s, "dp_rank")).unwrap_or("0");
                    rank == want.rank.to_string()
                };
                let buckets: Vec<&Line> = samples
                    .iter()
                    .filter(|s| s.name == format!("{name}_bucket"))
                    .filter(ours)
                    .collect();
                assert_eq!(buckets.len(), LATENCY_BUCKETS.len() + 1);
                let bounds: Vec<f64> = buckets
                    .iter()
                    .map(|s| label(s, "le").unwrap().parse().unwrap())
                    .collect();
                assert!(bounds.windows(2).all(|w| w[0] < w[1]));
                assert_eq!(bounds.last(), Some(&f64::INFINITY));
                assert!(buckets.windows(2).all(|w| w[0].value <= w[1].value));
                let count = samples
                    .iter()
                    .filter(ours)
                    .find(|s| s.name == format!("{name}_count"))
                    .unwrap();
                let sum = samples
                    .iter()
                    .filter(ours)
                    .find(|s| s.name == format!("{name}_sum"))
                    .unwrap();
                assert_eq!(buckets.last().unwrap().value, count.value);
                assert_eq!(count.value, 6.0);
                let histogram = if family.starts_with("time") {
                    &want.ttft
                } else {
                    &want.e2e
                };
                assert_eq!(sum.value, histogram.sum);
                // 5000 s and beyond overflows every bound: only +Inf counts it.
                assert_eq!(buckets[buckets.len() - 2].value, 5.0);
            }
        }
    }
}

#[test]
fn counters_and_info_carry_the_rank_numbers() {
    let stats = ranks(3);
    let samples = lines(&render_metrics(Engine::Vllm, MODEL, &stats));
    let find = |name: &str, rank: &str, extra: Option<(&str, &str)>| {
        samples
            .iter()
            .find(|s| {
                s.name == name
                    && label(s, "engine") == Some(rank)
                    && extra.is_none_or(|(k, v)| label(s, k) == Some(v))
            })
            .unwrap_or_else(|| panic!("{name} {rank}"))
            .value
    };
    assert_eq!(find("vllm:prefix_cache_hits_total", "2", None), 3000.0);
    assert_eq!(find("vllm:prefix_cache_queries_total", "2", None), 4000.0);
    assert_eq!(find("vllm:prompt_tokens_total", "1", None), 5001.0);
    assert_eq!(find("vllm:generation_tokens_total", "1", None), 900.0);
    assert_eq!(
        find(
            "vllm:request_success_total",
            "2",
            Some(("finished_reason", "length"))
        ),
        42.0
    );
    let info = samples
        .iter()
        .find(|s| s.name == "vllm:cache_config_info" && label(s, "engine") == Some("1"))
        .unwrap();
    assert_eq!(label(info, "num_gpu_blocks"), Some("8192"));
    assert_eq!(label(info, "block_size"), Some("16"));
    assert_eq!(label(info, "enable_prefix_caching"), Some("True"));
    assert!(render_metrics(Engine::Vllm, MODEL, &stats).contains(
        "vllm:num_requests_running{engine=\"0\",model_name=\"org/model \\\"q\\\"\"} 3.0\n"
    ));

    let samples = lines(&render_metrics(Engine::Sglang, MODEL, &stats));
    let value = |name: &str, rank: &str| {
        samples
            .iter()
            .find(|s| s.name == name && label(s, "dp_rank") == Some(rank))
            .unwrap()
    };
    assert_eq!(value("sglang:cache_hit_rate", "0").value, 0.25);
    assert_eq!(value("sglang:num_requests_total", "2").value, 44.0);
    assert_eq!(value("sglang:cached_tokens_total", "2").value, 3000.0);
    // A worker without a cache hit yet writes no cached-tokens series, as SGLang's counter is created
    // at the first hit.
    let mut cold = stats.clone();
    for rank in &mut cold {
        rank.counters.prefix_hit_tokens = 0;
    }
    assert!(!render_metrics(Engine::Sglang, MODEL, &cold).contains("sglang:cached_tokens_total"));
    let info = value("sglang:cache_config_info", "2");
    assert_eq!(
        (label(info, "page_size"), label(info, "num_pages")),
        (Some("16"), Some("8192"))
    );
    let empty = RankStats::default();
    assert_eq!(hit_rate(&empty), 0.0);
}

#[test]
fn special_floats_render_as_prometheus_spells_them() {
    let mut out = String::new();
    for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.25, 1e-9, 3.0] {
        write_num(&mut out, Num::Float(value));
        out.push(' ');
    }
    assert_eq!(out, "NaN +Inf -Inf 0.25 1e-9 3.0 ");
}

fn identity(engine: Engine) -> Identity<'static> {
    Identity {
        engine,
        model: "sim-model",
        dp_size: 2,
        block_size: 16,
        max_running: 64,
        kv_blocks: 8192,
        max_model_len: 131_072,
        tokenizer: "bytes",
        disaggregation: "null",
        bootstrap_port: 8998,
        kv_events: None,
    }
}

fn parse(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn discovery_documents_carry_their_fields() {
    for (engine, owner) in [(Engine::Vllm, "vllm"), (Engine::Sglang, "sglang")] {
        let models = parse(&models_json(&identity(engine)));
        assert_eq!(models["object"], "list");
        let card = &models["data"][0];
        assert_eq!(card["id"], "sim-model");
        assert_eq!(card["object"], "model");
        assert_eq!(card["owned_by"], owner);
        assert_eq!(card["max_model_len"], 131_072);
        assert_eq!(models["data"].as_array().unwrap().len(), 1);
    }
    let version = parse(&version_json(&identity(Engine::Vllm)));
    assert_eq!(version["version"], VLLM_VERSION);

    let info = parse(&server_info_json(&identity(Engine::Sglang)));
    let expected = [
        ("model_path", json!("sim-model")),
        ("tokenizer_path", json!("bytes")),
        ("served_model_name", json!("sim-model")),
        ("dp_size", json!(2)),
        ("tp_size", json!(1)),
        ("page_size", json!(16)),
        ("max_running_requests", json!(64)),
        ("max_total_num_tokens", json!(8192 * 16)),
        ("context_length", json!(131_072)),
        ("disaggregation_mode", json!("null")),
        ("disaggregation_bootstrap_port", json!(8998)),
        ("version", json!(SGLANG_VERSION)),
    ];
    for (key, value) in expected {
        assert_eq!(info[key], value, "{key}");
    }
    let model = parse(&model_info_json(&identity(Engine::Sglang)));
    assert_eq!(model["model_path"], "sim-model");
    assert_eq!(model["tokenizer_path"], "bytes");
    assert_eq!(model["is_generation"], true);
}

#[test]
fn rendering_is_deterministic() {
    let stats = ranks(3);
    let families: HashSet<_> = [Engine::Vllm, Engine::Sglang]
        .iter()
        .map(|engine| render_metrics(*engine, MODEL, &stats))
        .collect();
    assert_eq!(families.len(), 2);
    assert_eq!(
        render_metrics(Engine::Sglang, MODEL, &stats),
        render_metrics(Engine::Sglang, MODEL, &stats)
    );
}

#[test]
fn the_kv_event_sockets_are_advertised_as_each_engine_does() {
    use crate::kv_events::{KvEventEndpoints, KvEventsFormat, RankEventEndpoints};
    let addr = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let events = KvEventEndpoints {
        format: KvEventsFormat::VllmMap,
        topic: "kv".into(),
        ranks: (0..2)
            .map(|rank| RankEventEndpoints {
                rank,
                live: addr(5557 + rank as u16),
                replay: Some(addr(6557 + rank as u16)),
            })
            .collect(),
    };
    let on = Identity {
        kv_events: Some(&events),
        ..identity(Engine::Vllm)
    };
    let sources = parse(&kv_event_sources_json(&on));
    assert_eq!(sources["1"]["publisher"], "zmq");
    assert_eq!(sources["1"]["endpoint"], "tcp://127.0.0.1:5558");
    assert_eq!(sources["1"]["replay_endpoint"], "tcp://127.0.0.1:6558");
    assert_eq!(sources["0"]["topic"], "kv");
    assert_eq!(
        parse(&kv_event_sources_json(&identity(Engine::Vllm))),
        json!({})
    );

    let info = parse(&server_info_json(&Identity {
        engine: Engine::Sglang,
        ..on
    }));
    let block = &info["kv_events"];
    assert_eq!(
        (&block["endpoint_host"], &block["endpoint_port_base"]),
        (&json!("127.0.0.1"), &json!(5557))
    );
    assert_eq!(block["replay_endpoint_port_base"], 6557);
    assert_eq!(block["dp_size"], 2);
    assert_eq!(
        parse(&server_info_json(&identity(Engine::Sglang)))["kv_events"],
        Value::Null
    );
}

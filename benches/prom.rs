//! Cost of reading one worker's `/metrics` with `load::samples`, on a ~200 KB vLLM exposition.
//!
//! Run: `cargo bench --bench prom`. Figures go to BENCHMARKS.md with the machine they came from.
//!
//! The exposition is what a vLLM V1 server with `prometheus_client` writes: process and GC series, then
//! per engine the request gauges, counters with their `_created` series, `cache_config_info`, and the
//! real histograms with their `le` buckets, `_count`, `_sum` and `_created`. Engines are added until the
//! text reaches 200 KB, so buckets make up most of it, as they do in production.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::fmt::{Display, Write};
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

use cachepick::load::samples;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// The series the scraper reads from a vLLM worker.
const WANTED: [&str; 5] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
];

const REQUEST_LATENCY: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const TOKENS_1_2_5: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// vLLM's histograms and their bucket bounds.
const HISTOGRAMS: &[(&str, &str, &[f64])] = &[
    (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &[
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
        ],
    ),
    (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &[
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ],
    ),
    (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY,
    ),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY,
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY,
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY,
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY,
    ),
    (
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        TOKENS_1_2_5,
    ),
    (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        TOKENS_1_2_5,
    ),
    (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        TOKENS_1_2_5,
    ),
    (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        &[
            1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
            16384.0,
        ],
    ),
];

const GAUGES: &[(&str, &str)] = &[
    (
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
    ),
    (
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
    ),
    (
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
    ),
];

const COUNTERS: &[(&str, &str)] = &[
    (
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
    ),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    (
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
    ),
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
];

/// Writes `# HELP` and `# TYPE` for one family.
fn family(out: &mut String, name: &str, help: &str, kind: &str) {
    writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}").unwrap();
}

/// Writes one sample line; `labels` is the text between the braces.
fn line(out: &mut String, name: &str, labels: &str, value: impl Display) {
    writeln!(out, "{name}{{{labels}}} {value}").unwrap();
}

/// A deterministic vLLM exposition over `engines` data-parallel engines. Values are written the way
/// `prometheus_client` writes them (`12.0`, `1.7331337e+09`, `4.5321093e+010`).
fn exposition(engines: usize) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "python_gc_objects_collected_total",
        "Objects collected during gc",
        "counter",
    );
    for generation in 0..3 {
        let labels = format!("generation=\"{generation}\"");
        line(
            &mut out,
            "python_gc_objects_collected_total",
            &labels,
            7000.0 * f64::from(generation + 1),
        );
    }
    family(
        &mut out,
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        "gauge",
    );
    out.push_str("process_virtual_memory_bytes 4.5321093e+010\n");
    let labels: Vec<String> = (0..engines)
        .map(|engine| format!("engine=\"{engine}\",model_name=\"{MODEL}\""))
        .collect();
    for (name, help) in GAUGES {
        family(&mut out, name, help, "gauge");
        for (engine, labels) in labels.iter().enumerate() {
            line(
                &mut out,
                name,
                labels,
                format!("{:?}", (engine * 7 % 11) as f64 / 4.0),
            );
        }
    }
    for (name, help) in COUNTERS {
        family(&mut out, &format!("{name}_total"), help, "counter");
        for (engine, labels) in labels.iter().enumerate() {
            line(
                &mut out,
                &format!("{name}_total"),
                labels,
                format!("{}.0", 12_345 * (engine + 1)),
            );
        }
        created(&mut out, name, help, &labels);
    }
    family(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    for engine in 0..engines {
        let labels = format!(
            "block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",\
             enable_prefix_caching=\"True\",engine=\"{engine}\",gpu_memory_utilization=\"0.9\",\
             is_attention_free=\"False\",num_cpu_blocks=\"None\",num_gpu_blocks=\"2048\",\
             num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",sliding_window=\"None\",\
             swap_space=\"4\",swap_space_bytes=\"4294967296\""
        );
        line(&mut out, "vllm:cache_config_info", &labels, "1.0");
    }
    for (name, help, bounds) in HISTOGRAMS {
        family(&mut out, name, help, "histogram");
        for (engine, labels) in labels.iter().enumerate() {
            let bucket = format!("{name}_bucket");
            let mut count = 0;
            for (i, bound) in bounds.iter().enumerate() {
                count += (i * 3 + engine) % 5;
                let le = format!("engine=\"{engine}\",le=\"{bound:?}\",model_name=\"{MODEL}\"");
                line(&mut out, &bucket, &le, format!("{count}.0"));
            }
            let le = format!("engine=\"{engine}\",le=\"+Inf\",model_name=\"{MODEL}\"");
            line(&mut out, &bucket, &le, format!("{count}.0"));
            line(
                &mut out,
                &format!("{name}_count"),
                labels,
                format!("{count}.0"),
            );
            line(
                &mut out,
                &format!("{name}_sum"),
                labels,
                format!("{:?}", count as f64 * 0.137),
            );
        }
        created(&mut out, name, help, &labels);
    }
    out
}

/// The `_created` family `prometheus_client` writes after each counter and histogram.
fn created(out: &mut String, name: &str, help: &str, labels: &[String]) {
    let name = format!("{name}_created");
    family(out, &name, help, "gauge");
    for (engine, labels) in labels.iter().enumerate() {
        line(out, &name, labels, format!("1.7331337{engine:02}e+09"));
    }
}

fn bench_samples(c: &mut Criterion) {
    let text = (1..)
        .map(exposition)
        .find(|text| text.len() >= 200_000)
        .unwrap();
    let mut all = samples(&text, |_| true);
    let count = all.by_ref().count();
    assert_eq!(
        all.malformed(),
        0,
        "the generated exposition is well-formed"
    );
    eprintln!("exposition: {} bytes, {count} samples", text.len());
    let mut group = c.benchmark_group("prom");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("scraper_filter", |b| {
        b.iter(|| {
            let mut sum = 0.0;
            let mut label_bytes = 0;
            let mut found = samples(black_box(&text), |name| WANTED.contains(&name));
            for sample in found.by_ref() {
                sum += sample.value;
                let mut read = |label| label_bytes += sample.label(label).map_or(0, |v| v.len());
                read("engine");
                read("model_name");
                if sample.name == "vllm:cache_config_info" {
                    read("block_size");
                    read("num_gpu_blocks");
                }
            }
            (sum, label_bytes, found.malformed())
        })
    });
    group.bench_function("full_parse", |b| {
        b.iter(|| {
            let mut sum = 0.0;
            let mut label_bytes = 0;
            let mut all = samples(black_box(&text), |_| true);
            for sample in all.by_ref() {
                sum += sample.value;
                for (name, value) in sample.labels() {
                    label_bytes += name.len() + value.len();
                }
            }
            (sum, label_bytes, all.malformed())
        })
    });
    group.finish();
}

criterion_group!(benches, bench_samples);
criterion_main!(benches);

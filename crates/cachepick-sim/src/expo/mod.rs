//! What a simulated engine exposes for scraping and discovery: `/metrics` under vLLM's or SGLang's
//! names, SGLang's `/v1/loads`, and the discovery documents (`/v1/models`, vLLM's `/version`, SGLang's
//! `/server_info` and `/model_info`).
//!
//! The exposition follows what the engines' Python `prometheus_client` writes (text format 0.0.4): a
//! `# HELP` and `# TYPE` line per family, then one series per data-parallel rank; a counter's family is
//! named with its `_total` suffix; every value is a float, integers written as `3.0`. vLLM labels a rank
//! with `engine`, SGLang with `dp_rank` (only when there are several ranks, as SGLang adds it only under
//! data parallelism). Everything here is a pure function of its arguments, so a scrape of an unchanged
//! rank is byte-for-byte the same.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::json;

use crate::config::Engine;
use crate::stats::{Histogram, RankStats};

/// The version the simulated vLLM reports; the suffix marks it as the simulator.
pub const VLLM_VERSION: &str = "0.11.0+cachepick.sim";
/// The version the simulated SGLang reports.
pub const SGLANG_VERSION: &str = "0.5.4+cachepick.sim";

/// The engine's `/metrics` for `model` served by `ranks`.
pub fn render_metrics(engine: Engine, model: &str, ranks: &[RankStats]) -> String {
    let mut out = Exposition::default();
    match engine {
        Engine::Vllm => vllm(&mut out, model, ranks),
        Engine::Sglang => sglang(&mut out, model, ranks),
    }
    out.text
}

/// A sample value: counts are exact integers, the rest floats.
#[derive(Clone, Copy)]
enum Num {
    Int(u64),
    Float(f64),
}

/// A family's name, its help text, and how to read its value off a rank.
type Series = (&'static str, &'static str, fn(&RankStats) -> Num);

/// Prometheus text being written. Writing to a `String` cannot fail, so `write!` results are dropped.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: Num) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (index, (label, value)) in labels.iter().enumerate() {
                if index > 0 {
                    self.text.push(',');
                }
                self.text.push_str(label);
                self.text.push_str("=\"");
                escape_label(&mut self.text, value);
                self.text.push('"');
            }
            self.text.push('}');
        }
        self.text.push(' ');
        write_num(&mut self.text, value);
        self.text.push('\n');
    }

    /// A gauge or counter family with one sample per rank.
    fn per_rank(
        &mut self,
        (name, kind, help): (&str, &str, &str),
        ranks: &[RankStats],
        labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
        value: &dyn Fn(&RankStats) -> Num,
    ) {
        self.family(name, kind, help);
        for rank in ranks {
            let owned = labels(rank);
            let borrowed: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            self.sample(name, &borrowed, value(rank));
        }
    }

    /// A histogram family with one series per rank: cumulative buckets, `+Inf`, `_count`, `_sum`.
    fn histogram(
        &mut self,
        (name, help): (&str, &str),
        ranks: &[RankStats],
        labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
        histogram: &dyn Fn(&RankStats) -> &Histogram,
    ) {
        self.family(name, "histogram", help);
        let (bucket, count, sum) = (
            format!("{name}_bucket"),
            format!("{name}_count"),
            format!("{name}_sum"),
        );
        for rank in ranks {
            let owned = labels(rank);
            let base: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let observed = histogram(rank);
            for (bound, cumulative) in observed.cumulative() {
                let mut le = String::new();
                write_num(&mut le, Num::Float(bound));
                self.sample(&bucket, &with(&base, ("le", &le)), Num::Int(cumulative));
            }
            self.sample(
                &bucket,
                &with(&base, ("le", "+Inf")),
                Num::Int(observed.count),
            );
            self.sample(&count, &base, Num::Int(observed.count));
            self.sample(&sum, &base, Num::Float(observed.sum));
        }
    }
}

/// `labels` followed by `extra`.
fn with<'a>(labels: &[(&'a str, &'a str)], extra: (&'a str, &'a str)) -> Vec<(&'a str, &'a str)> {
    labels
        .iter()
        .copied()
        .chain(std::iter::once(extra))
        .collect()
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape_label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// A value as Python's client writes it: `3.0` for integers, the shortest round-trip form otherwise, and
/// `+Inf`, `-Inf`, `NaN` for the special values. The round-trip form lets a reader recover the exact
/// float the simulator computed.
fn write_num(out: &mut String, value: Num) {
    let _ = match value {
        Num::Int(n) => write!(out, "{n}.0"),
        Num::Float(f) if f.is_nan() => write!(out, "NaN"),
        Num::Float(f) if f == f64::INFINITY => write!(out, "+Inf"),
        Num::Float(f) if f == f64::NEG_INFINITY => write!(out, "-Inf"),
        Num::Float(f) => write!(out, "{f:?}"),
    };
}

/// Prefix-cache hit rate in [0, 1]: hit over queried tokens, 0 before any lookup.
fn hit_rate(rank: &RankStats) -> f64 {
    let counters = &rank.counters;
    if counters.prefix_queried_tokens == 0 {
        0.0
    } else {
        (counters.prefix_hit_tokens as f64 / counters.prefix_queried_tokens as f64).min(1.0)
    }
}

/// Tokens in use as engines report them: pinned by requests (evictable cache counts as free).
fn used_tokens(rank: &RankStats) -> u64 {
    rank.kv_pinned_blocks
        .saturating_mul(u64::from(rank.block_size))
}

fn total_tokens(rank: &RankStats) -> u64 {
    rank.kv_total_blocks
        .saturating_mul(u64::from(rank.block_size))
}

fn vllm(out: &mut Exposition, model: &str, ranks: &[RankStats]) {
    let labels = |rank: &RankStats| {
        vec![
            ("engine", rank.rank.to_string()),
            ("model_name", model.to_owned()),
        ]
    };
    let gauges: [Series; 3] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            |r| Num::Int(r.running),
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            |r| Num::Int(r.waiting),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            |r| Num::Float(r.kv_usage()),
        ),
    ];
    for (name, help, value) in gauges {
        out.per_rank((name, "gauge", help), ranks, &labels, &value);
    }
    // vLLM's info metric: the configuration as labels, the value always 1. Capacity in tokens is
    // block_size × num_gpu_blocks, which is how readers of vLLM's metrics learn it.
    out.family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    for rank in ranks {
        let (block_size, blocks, engine) = (
            rank.block_size.to_string(),
            rank.kv_total_blocks.to_string(),
            rank.rank.to_string(),
        );
        out.sample(
            "vllm:cache_config_info",
            &[
                ("block_size", &block_size),
                ("cache_dtype", "auto"),
                ("enable_prefix_caching", "True"),
                ("engine", &engine),
                ("gpu_memory_utilization", "0.9"),
                ("num_gpu_blocks", &blocks),
            ],
            Num::Float(1.0),
        );
    }
    let counters: [Series; 4] = [
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            |r| Num::Int(r.counters.prefix_queried_tokens),
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            |r| Num::Int(r.counters.prefix_hit_tokens),
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            |r| Num::Int(r.counters.prompt_tokens),
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            |r| Num::Int(r.counters.generation_tokens),
        ),
    ];
    for (name, help, value) in counters {
        out.per_rank((name, "counter", help), ranks, &labels, &value);
    }
    out.family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for rank in ranks {
        let engine = rank.rank.to_string();
        // The simulator stops on length only; `stop` is listed at 0 as vLLM lists every reason.
        for (reason, count) in [
            ("stop", 0),
            ("length", rank.counters.finished_length),
            ("abort", rank.counters.aborted),
        ] {
            out.sample(
                "vllm:request_success_total",
                &[
                    ("engine", &engine),
                    ("finished_reason", reason),
                    ("model_name", model),
                ],
                Num::Int(count),
            );
        }
    }
    out.histogram(
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        ),
        ranks,
        &labels,
        &|r| &r.ttft,
    );
    out.histogram(
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
        ),
        ranks,
        &labels,
        &|r| &r.e2e,
    );
}

fn sglang(out: &mut Exposition, model: &str, ranks: &[RankStats]) {
    let data_parallel = ranks.len() > 1;
    let labels = |rank: &RankStats| {
        let mut labels = vec![
            ("model_name", model.to_owned()),
            ("pp_rank", "0".to_owned()),
            ("tp_rank", "0".to_owned()),
        ];
        if data_parallel {
            labels.push(("dp_rank", rank.rank.to_string()));
        }
        labels
    };
    let gauges: [Series; 7] = [
        (
            "sglang:num_running_reqs",
            "The number of running requests.",
            |r| Num::Int(r.running),
        ),
        (
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            |r| Num::Int(r.waiting),
        ),
        ("sglang:token_usage", "The token usage.", |r| {
            Num::Float(r.kv_usage())
        }),
        (
            "sglang:num_used_tokens",
            "The number of used tokens.",
            |r| Num::Int(used_tokens(r)),
        ),
        (
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            |r| Num::Int(total_tokens(r)),
        ),
        (
            "sglang:max_running_requests",
            "The maximum number of running requests.",
            |r| Num::Int(r.max_running),
        ),
        ("sglang:cache_hit_rate", "The prefix cache hit rate.", |r| {
            Num::Float(hit_rate(r))
        }),
    ];
    for (name, help, value) in gauges {
        out.per_rank((name, "gauge", help), ranks, &labels, &value);
    }
    let info_labels = |rank: &RankStats| {
        let mut labels = labels(rank);
        labels.push(("num_pages", rank.kv_total_blocks.to_string()));
        labels.push(("page_size", rank.block_size.to_string()));
        labels
    };
    out.per_rank(
        (
            "sglang:cache_config_info",
            "gauge",
            "Information of the KV cache configuration.",
        ),
        ranks,
        &info_labels,
        &|_| Num::Float(1.0),
    );
    let counters: [Series; 3] = [
        (
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            |r| Num::Int(r.counters.prompt_tokens),
        ),
        (
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            |r| Num::Int(r.counters.generation_tokens),
        ),
        (
            "sglang:num_requests_total",
            "Number of requests processed.",
            |r| {
                Num::Int(
                    r.counters
                        .finished_length
                        .saturating_add(r.counters.aborted),
                )
            },
        ),
    ];
    for (name, help, value) in counters {
        out.per_rank((name, "counter", help), ranks, &labels, &value);
    }
    out.histogram(
        (
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        ),
        ranks,
        &labels,
        &|r| &r.ttft,
    );
    out.histogram(
        (
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
        ),
        ranks,
        &labels,
        &|r| &r.e2e,
    );
}

/// One rank of SGLang's `/v1/loads`.
#[derive(Serialize)]
struct Load {
    dp_rank: u32,
    num_running_reqs: u64,
    num_waiting_reqs: u64,
    num_waiting_uncached_tokens: u64,
    num_used_tokens: u64,
    /// SGLang's single load figure: KV tokens in use plus the tokens waiting for prefill. The simulator
    /// counts the waiting requests' uncached tokens, the part that will need new KV.
    num_total_tokens: u64,
    max_total_num_tokens: u64,
    max_running_requests: u64,
    token_usage: f64,
    cache_hit_rate: f64,
}

#[derive(Serialize)]
struct Loads {
    loads: Vec<Load>,
}

/// SGLang's `/v1/loads`: one entry per rank under `loads`. The response time SGLang adds is left out
/// so the output is a function of the ranks alone.
pub fn render_loads(ranks: &[RankStats]) -> Vec<u8> {
    let loads = ranks
        .iter()
        .map(|rank| Load {
            dp_rank: rank.rank,
            num_running_reqs: rank.running,
            num_waiting_reqs: rank.waiting,
            num_waiting_uncached_tokens: rank.waiting_uncached_tokens,
            num_used_tokens: used_tokens(rank),
            num_total_tokens: used_tokens(rank).saturating_add(rank.waiting_uncached_tokens),
            max_total_num_tokens: total_tokens(rank),
            max_running_requests: rank.max_running,
            token_usage: rank.kv_usage(),
            cache_hit_rate: hit_rate(rank),
        })
        .collect();
    serde_json::to_vec(&Loads { loads }).unwrap_or_default()
}

/// What discovery reports about a worker. Capacities are per data-parallel rank, as each engine
/// scheduler reports its own.
#[derive(Clone, Copy, Debug)]
pub struct Identity<'a> {
    pub engine: Engine,
    /// The served model name, also reported as the model and tokenizer path.
    pub model: &'a str,
    pub dp_size: u32,
    pub block_size: u32,
    pub max_running: u64,
    pub kv_blocks: u64,
    pub max_model_len: u32,
    /// The tokenizer the worker uses, as SGLang reports `tokenizer_path`.
    pub tokenizer: &'a str,
}

impl Identity<'_> {
    fn version(&self) -> &'static str {
        match self.engine {
            Engine::Vllm => VLLM_VERSION,
            Engine::Sglang => SGLANG_VERSION,
        }
    }

    fn max_total_num_tokens(&self) -> u64 {
        self.kv_blocks.saturating_mul(u64::from(self.block_size))
    }
}

/// Discovery documents are built from `json!` values, whose serialization cannot fail.
fn to_bytes(value: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// `GET /v1/models`: the OpenAI model list with the one served model. `created` is 0 to keep the
/// document a function of the identity.
pub fn models_json(id: &Identity) -> Vec<u8> {
    let mut card = json!({
        "id": id.model,
        "object": "model",
        "created": 0,
        "owned_by": id.engine.as_str(),
        "root": id.model,
        "parent": null,
        "max_model_len": id.max_model_len,
    });
    if id.engine == Engine::Vllm
        && let Some(card) = card.as_object_mut()
    {
        card.insert(
            "permission".to_owned(),
            json!([{
                "id": "modelperm-cachepick-sim",
                "object": "model_permission",
                "created": 0,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }]),
        );
    }
    to_bytes(&json!({ "object": "list", "data": [card] }))
}

/// vLLM's `GET /version`.
pub fn version_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({ "version": id.version() }))
}

/// SGLang's `GET /server_info` (also `/get_server_info`): the server arguments and scheduler limits a
/// router reads to learn the worker's parallelism and capacity.
pub fn server_info_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({
        "model_path": id.model,
        "tokenizer_path": id.tokenizer,
        "served_model_name": id.model,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": id.dp_size,
        "enable_dp_attention": false,
        "load_balance_method": "shortest_queue",
        "page_size": id.block_size,
        "max_running_requests": id.max_running,
        "max_total_num_tokens": id.max_total_num_tokens(),
        "context_length": id.max_model_len,
        "disaggregation_mode": "null",
        "disable_radix_cache": false,
        "skip_tokenizer_init": false,
        "is_embedding": false,
        "version": id.version(),
    }))
}

/// SGLang's `GET /model_info` (also `/get_model_info`).
pub fn model_info_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({
        "model_path": id.model,
        "tokenizer_path": id.tokenizer,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use std::collections::{HashMap, HashSet};

    use serde_json::Value;

    use super::*;
    use crate::stats::{LATENCY_BUCKETS, RankCounters};

    /// `n` ranks with distinct, non-trivial numbers in every field.
    fn ranks(n: u32) -> Vec<RankStats> {
        (0..n)
            .map(|rank| {
                let r = u64::from(rank);
                let mut stats = RankStats {
                    rank,
                    running: 3 + r,
                    waiting: 7 * r + 1,
                    waiting_uncached_tokens: 1000 + r,
                    kv_used_blocks: 300 + 17 * r,
                    kv_pinned_blocks: 100,
                    kv_total_blocks: 8192,
                    block_size: 16,
                    max_running: 64,
                    counters: RankCounters {
                        prompt_tokens: 5000 + r,
                        generation_tokens: 900,
                        prefix_queried_tokens: 4000,
                        prefix_hit_tokens: 1000 * (r + 1),
                        finished_length: 40 + r,
                        aborted: r,
                        rejected: 0,
                        evicted_blocks: 0,
                    },
                    ..RankStats::default()
                };
                for seconds in [0.0005, 0.03, 0.03, 0.7, 3.0, 5000.0] {
                    stats.ttft.observe(seconds * (r as f64 + 1.0));
                    stats.e2e.observe(seconds * 2.0);
                }
                stats
            })
            .collect()
    }

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
                let samples = lines(&text);
                assert!(samples.iter().all(|s| label(s, "model_name") == Some(MODEL)
                    || s.name.ends_with("cache_config_info")));
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
}

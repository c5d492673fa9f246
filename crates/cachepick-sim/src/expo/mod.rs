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
use std::cell::RefCell;
use std::fmt::Write as _;
use std::rc::Rc;

use serde::Serialize;

use crate::config::Engine;
use crate::stats::{Histogram, RankStats};

mod discovery;

pub use discovery::{
    Identity, kv_event_sources_json, model_info_json, models_json, server_info_json, version_json,
};

/// The version the simulated vLLM reports: the release whose exposition, events and APIs it follows
/// (`tests/vllm/conformance.rs` holds it to that engine); the suffix marks it as the simulator.
pub const VLLM_VERSION: &str = "0.32.0+cachepick.sim";
/// The version the simulated SGLang reports.
pub const SGLANG_VERSION: &str = "0.5.4+cachepick.sim";

/// The engine's `/metrics` for `model` served by `ranks`.
pub fn render_metrics(engine: Engine, model: &str, ranks: &[RankStats]) -> String {
    let mut out = Exposition::default();
    process(&mut out, ranks);
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

/// How to read a histogram off a rank.
type HistogramOf = fn(&RankStats) -> &Histogram;

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
                push_label(&mut self.text, label, value);
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

    /// Each of `families` as a gauge or counter family of `kind`, one sample per rank.
    fn series(
        &mut self,
        kind: &str,
        families: &[Series],
        ranks: &[RankStats],
        labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
    ) {
        for (name, help, value) in families {
            self.per_rank((name, kind, help), ranks, labels, value);
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
        // A rank's bucket lines share their name and labels up to `le`, written once per rank, and
        // the bounds are written once per process (`le_labels`): a histogram is most of an
        // exposition, and a replay renders thousands a second.
        for rank in ranks {
            let owned = labels(rank);
            let base: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let mut head = format!("{bucket}{{");
            for (label, value) in &base {
                push_label(&mut head, label, value);
                head.push(',');
            }
            head.push_str("le=\"");
            let observed = histogram(rank);
            let les = le_labels(observed.bounds);
            for ((_, cumulative), le) in observed.cumulative().zip(les.iter()) {
                self.text.push_str(&head);
                self.text.push_str(le);
                self.text.push_str("\"} ");
                write_num(&mut self.text, Num::Int(cumulative));
                self.text.push('\n');
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

/// The `le` values of a histogram's `bounds`, written once per thread and bucket list (the lists are
/// static, and there are a handful).
fn le_labels(bounds: &'static [f64]) -> Rc<[String]> {
    /// A bucket list and its `le` values.
    type Written = (&'static [f64], Rc<[String]>);
    thread_local! {
        static WRITTEN: RefCell<Vec<Written>> = const { RefCell::new(Vec::new()) };
    }
    WRITTEN.with_borrow_mut(|written| {
        if let Some((_, les)) = written
            .iter()
            .find(|(known, _)| std::ptr::eq(*known, bounds))
        {
            return Rc::clone(les);
        }
        let les: Rc<[String]> = bounds
            .iter()
            .map(|bound| {
                let mut le = String::new();
                write_num(&mut le, Num::Float(*bound));
                le
            })
            .collect();
        written.push((bounds, Rc::clone(&les)));
        les
    })
}

/// `labels` followed by `extra`.
fn with<'a>(labels: &[(&'a str, &'a str)], extra: (&'a str, &'a str)) -> Vec<(&'a str, &'a str)> {
    labels
        .iter()
        .copied()
        .chain(std::iter::once(extra))
        .collect()
}

/// `label="value"`, the value escaped.
fn push_label(out: &mut String, label: &str, value: &str) {
    out.push_str(label);
    out.push_str("=\"");
    escape_label(out, value);
    out.push('"');
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

/// SGLang's `cache_hit_rate`: the latest prefill batch's share under the step model, else the share of
/// every lookup so far; in [0, 1], 0 before any lookup.
fn hit_rate(rank: &RankStats) -> f64 {
    if let Some(latest) = rank.last_prefill_hit_rate {
        return latest.clamp(0.0, 1.0);
    }
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

/// Python's process collector, which both engines' `prometheus_client` registry writes first:
/// `process_start_time_seconds`, the worker's (re)start, one unlabelled series. Readers compare it
/// across scrapes to tell an engine restart, whose counters start again from zero.
fn process(out: &mut Exposition, ranks: &[RankStats]) {
    let Some(first) = ranks.first() else {
        return;
    };
    let name = "process_start_time_seconds";
    out.family(
        name,
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    out.sample(name, &[], Num::Float(first.process_start_time));
}

/// The token counters both engines write under their own prefix, with the same help.
fn token_counters(
    out: &mut Exposition,
    prefix: &str,
    ranks: &[RankStats],
    labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
) {
    out.per_rank(
        (
            &format!("{prefix}:prompt_tokens_total"),
            "counter",
            "Number of prefill tokens processed.",
        ),
        ranks,
        labels,
        &|r| Num::Int(r.counters.prompt_tokens),
    );
    out.per_rank(
        (
            &format!("{prefix}:generation_tokens_total"),
            "counter",
            "Number of generation tokens processed.",
        ),
        ranks,
        labels,
        &|r| Num::Int(r.counters.generation_tokens),
    );
}

/// The latency histograms both engines write under their own prefix: time to first token, and the
/// whole request under the engine's own `e2e_help`.
fn latencies(
    out: &mut Exposition,
    prefix: &str,
    e2e_help: &str,
    ranks: &[RankStats],
    labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
) {
    out.histogram(
        (
            &format!("{prefix}:time_to_first_token_seconds"),
            "Histogram of time to first token in seconds.",
        ),
        ranks,
        labels,
        &|r| &r.ttft,
    );
    out.histogram(
        (&format!("{prefix}:e2e_request_latency_seconds"), e2e_help),
        ranks,
        labels,
        &|r| &r.e2e,
    );
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
    out.series("gauge", &gauges, ranks, &labels);
    cache_config_info(out, ranks);
    let counters: [Series; 3] = [
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            |r| Num::Int(r.counters.preemptions),
        ),
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
    ];
    out.series("counter", &counters, ranks, &labels);
    token_counters(out, "vllm", ranks, &labels);
    request_success(out, model, ranks);
    latencies(
        out,
        "vllm",
        "Histogram of e2e request latency in seconds.",
        ranks,
        &labels,
    );
    phases(out, ranks, &labels);
}

/// vLLM's info metric: the configuration as labels, the value always 1. Capacity in tokens is
/// block_size × num_gpu_blocks, which is how readers of vLLM's metrics learn it.
fn cache_config_info(out: &mut Exposition, ranks: &[RankStats]) {
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
}

/// Finished requests by reason, every reason listed as vLLM lists them.
fn request_success(out: &mut Exposition, model: &str, ranks: &[RankStats]) {
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
}

/// vLLM V1's per-request phases (0.13 and later), observed when a request finishes.
fn phases(
    out: &mut Exposition,
    ranks: &[RankStats],
    labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
) {
    let phases: [(&str, &str, HistogramOf); 3] = [
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            |r| &r.queue_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            |r| &r.prefill_time,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            |r| &r.prefill_tokens,
        ),
    ];
    for (name, help, histogram) in phases {
        out.histogram((name, help), ranks, labels, &histogram);
    }
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
    out.series("gauge", &gauges, ranks, &labels);
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
    token_counters(out, "sglang", ranks, &labels);
    cached_tokens(out, ranks, &labels);
    out.per_rank(
        (
            "sglang:num_requests_total",
            "counter",
            "Number of requests processed.",
        ),
        ranks,
        &labels,
        &|r| {
            Num::Int(
                r.counters
                    .finished_length
                    .saturating_add(r.counters.aborted),
            )
        },
    );
    latencies(
        out,
        "sglang",
        "Histogram of End-to-end request latency in seconds",
        ranks,
        &labels,
    );
}

/// SGLang's tokenizer manager creates this counter at a rank's first cache hit: a worker that has
/// had none writes no series at all. (SGLang counts when a request finishes; the simulator when its
/// prefill does, as for vLLM's counters.)
fn cached_tokens(
    out: &mut Exposition,
    ranks: &[RankStats],
    labels: &dyn Fn(&RankStats) -> Vec<(&'static str, String)>,
) {
    let hit: Vec<&RankStats> = ranks
        .iter()
        .filter(|rank| rank.counters.prefix_hit_tokens > 0)
        .collect();
    if !hit.is_empty() {
        let name = "sglang:cached_tokens_total";
        out.family(name, "counter", "Number of cached prompt tokens.");
        for rank in hit {
            let owned = labels(rank);
            let borrowed: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            out.sample(name, &borrowed, Num::Int(rank.counters.prefix_hit_tokens));
        }
    }
}

/// One rank of SGLang's `/v1/loads`.
#[derive(Serialize)]
struct Load {
    dp_rank: u32,
    num_running_reqs: u64,
    num_waiting_reqs: u64,
    num_waiting_uncached_tokens: u64,
    num_used_tokens: u64,
    /// SGLang's single load figure: KV tokens in use plus every token of the waiting requests.
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
            num_total_tokens: used_tokens(rank).saturating_add(rank.waiting_tokens),
            max_total_num_tokens: total_tokens(rank),
            max_running_requests: rank.max_running,
            token_usage: rank.kv_usage(),
            cache_hit_rate: hit_rate(rank),
        })
        .collect();
    serde_json::to_vec(&Loads { loads }).unwrap_or_default()
}

#[cfg(test)]
mod tests;

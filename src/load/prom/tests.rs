//! The parser against real engines' exposition, tables of accepted and rejected lines, and properties
//! over arbitrary and exposition-like text.

use std::cell::Cell;

use proptest::prelude::*;

use super::*;

/// An excerpt of a vLLM V1 server's `/metrics` with two data-parallel engines, as
/// `prometheus_client` writes it.
const VLLM: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes 4.5321093e+010
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0625
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 884211.0
vllm:prompt_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 790032.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7331337021e+09
vllm:prompt_tokens_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7331337025e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 53.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 53.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.180232524871826
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 44.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 44.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 44.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0122
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="2048",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="2048",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"#;

/// An excerpt of an SGLang server's `/metrics` with two data-parallel ranks.
const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 17.0
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 15.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0",dp_rank="0"} 0.0
sglang:num_queue_reqs{model_name="m",tp_rank="0",dp_rank="1"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0",dp_rank="0"} 0.28
sglang:token_usage{model_name="m",tp_rank="0",dp_rank="1"} 0.31
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m",tp_rank="0",dp_rank="0"} 91.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m",tp_rank="0",dp_rank="0"} 120.0
sglang:time_to_first_token_seconds_sum{model_name="m",tp_rank="0",dp_rank="0"} 33.5
sglang:time_to_first_token_seconds_count{model_name="m",tp_rank="0",dp_rank="0"} 120.0
"#;

/// A sample with its labels unescaped, for comparisons.
#[derive(Debug)]
struct Owned {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
    timestamp_ms: Option<i64>,
}

impl From<Sample<'_>> for Owned {
    fn from(sample: Sample<'_>) -> Self {
        Owned {
            name: sample.name.to_owned(),
            labels: sample
                .labels()
                .map(|(name, value)| (name.to_owned(), value.into_owned()))
                .collect(),
            value: sample.value,
            timestamp_ms: sample.timestamp_ms,
        }
    }
}

/// Every sample of `text` and the malformed-line count.
fn parse_all(text: &str) -> (Vec<Owned>, usize) {
    let mut all = samples(text, |_| true);
    let parsed = all.by_ref().map(Owned::from).collect();
    (parsed, all.malformed())
}

fn same_value(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Lines the parser accepts: (what, text, name, labels, value, timestamp).
#[rustfmt::skip]
#[allow(clippy::type_complexity)]
const WELL_FORMED: &[(&str, &str, &str, &[(&str, &str)], f64, Option<i64>)] = &[
    ("a name with colons", "vllm:num_requests_waiting 3", "vllm:num_requests_waiting", &[], 3.0, None),
    ("a name starting with a colon", ":m 1", ":m", &[], 1.0, None),
    ("a name starting with an underscore", "_m_1 1", "_m_1", &[], 1.0, None),
    ("one label", r#"m{a="b"} 1"#, "m", &[("a", "b")], 1.0, None),
    ("an empty label set", "m{} 1", "m", &[], 1.0, None),
    ("an empty label value", r#"m{a=""} 1"#, "m", &[("a", "")], 1.0, None),
    ("an escaped quote", r#"m{a="say \"hi\""} 1"#, "m", &[("a", "say \"hi\"")], 1.0, None),
    ("an escaped backslash", r#"m{path="C:\\dir\\"} 1"#, "m", &[("path", "C:\\dir\\")], 1.0, None),
    ("an escaped newline", r#"m{a="x\ny"} 1"#, "m", &[("a", "x\ny")], 1.0, None),
    ("braces, commas and equals in a value", r#"m{a="}{,=",b="c"} 1"#, "m", &[("a", "}{,="), ("b", "c")],
     1.0, None),
    ("a UTF-8 value", r#"m{a="ünï 🚀"} 1"#, "m", &[("a", "ünï 🚀")], 1.0, None),
    ("a trailing comma", r#"m{a="b",} 1"#, "m", &[("a", "b")], 1.0, None),
    ("blanks around every token", "  m \t{ a = \"b\" ,\tc=\"d\" , }\t1 \t 5 \t", "m", &[("a", "b"), ("c", "d")],
     1.0, Some(5)),
    ("no blank between the braces and the value", r#"m{a="b"}1"#, "m", &[("a", "b")], 1.0, None),
    ("a blank between the name and the braces", r#"m {a="b"} 1"#, "m", &[("a", "b")], 1.0, None),
    ("a tab-separated value and timestamp", "m\t2\t3", "m", &[], 2.0, Some(3)),
    ("NaN", "m NaN", "m", &[], f64::NAN, None),
    ("+Inf", "m +Inf", "m", &[], f64::INFINITY, None),
    ("-Inf", "m -Inf", "m", &[], f64::NEG_INFINITY, None),
    ("Inf", "m Inf", "m", &[], f64::INFINITY, None),
    ("an exponent with a sign", "m 1.5e+03", "m", &[], 1500.0, None),
    ("a negative exponent", "m -2E-2", "m", &[], -0.02, None),
    ("an integer value", "m 42", "m", &[], 42.0, None),
    ("a timestamp", "m 1 1712345678901", "m", &[], 1.0, Some(1_712_345_678_901)),
    ("a negative timestamp", "m 1 -5", "m", &[], 1.0, Some(-5)),
    ("a CRLF line ending", "m{a=\"b\"} 1 7\r\n", "m", &[("a", "b")], 1.0, Some(7)),
    ("a histogram bucket", r#"h_bucket{le="+Inf"} 53.0"#, "h_bucket", &[("le", "+Inf")], 53.0, None),
    ("a summary quantile", r#"s{quantile="0.99"} 0.25"#, "s", &[("quantile", "0.99")], 0.25, None),
    ("comments and blank lines around", "# HELP m x\n# TYPE m gauge\n\n  \n\t\r\n#\nm 1\n# EOF\n", "m", &[],
     1.0, None),
];

#[test]
fn well_formed_lines_parse_to_their_name_labels_value_and_timestamp() {
    for (what, text, name, labels, value, timestamp_ms) in WELL_FORMED {
        let (parsed, malformed) = parse_all(text);
        assert_eq!(malformed, 0, "{what}: {text:?}");
        let [sample] = parsed.as_slice() else {
            panic!("{what}: one sample expected from {text:?}, got {parsed:?}");
        };
        let expected: Vec<(String, String)> = labels
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(sample.name, *name, "{what}");
        assert_eq!(sample.labels, expected, "{what}");
        assert!(same_value(sample.value, *value), "{what}: {}", sample.value);
        assert_eq!(sample.timestamp_ms, *timestamp_ms, "{what}");
    }
}

/// Lines that are wanted but not samples: (what, line).
const MALFORMED: &[(&str, &str)] = &[
    ("an unterminated label value", r#"m{a="b} 1"#),
    ("an unterminated label list", r#"m{a="b" 1"#),
    ("a label without `=`", r#"m{a "b"} 1"#),
    ("an unquoted label value", "m{a=b} 1"),
    ("a label name starting with a digit", r#"m{1a="b"} 1"#),
    ("a colon in a label name", r#"m{a:b="c"} 1"#),
    ("labels without a comma between them", r#"m{a="b" c="d"} 1"#),
    ("two commas in a row", r#"m{a="b",,c="d"} 1"#),
    ("a leading comma", r#"m{,a="b"} 1"#),
    ("an escape other than \\\\, \\\" and \\n", r#"m{a="\t"} 1"#),
    ("a backslash ending the line", "m{a=\"\\"),
    ("a raw newline inside a label value", "m{a=\"x\ny\"} 1"),
    ("no value", "m"),
    ("no value after a blank", "m \t"),
    ("no value after the labels", r#"m{a="b"}"#),
    ("a garbage value", "m abc"),
    ("a value with two points", "m 1.0.0"),
    ("a hexadecimal value", "m 0x10"),
    ("a value glued to the name", "m1.0"),
    ("an `=` after the name", "m=1"),
    ("junk after the labels", r#"m{a="b"}x 1"#),
    ("a fractional timestamp", "m 1 1.5"),
    ("junk after the timestamp", "m 1 2 3"),
    ("a carriage return inside the line", "m 1\r2"),
    ("a name starting with a digit", "1m 1"),
    ("a line starting with braces", r#"{a="b"} 1"#),
    ("a quoted name", r#"{"m"} 1"#),
];

#[test]
fn malformed_lines_are_counted_and_skipped_and_the_next_line_still_parses() {
    for (what, line) in MALFORMED {
        let text = format!("before 1\n{line}\nafter 2\n");
        let (parsed, malformed) = parse_all(&text);
        let names: Vec<&str> = parsed.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["before", "after"], "{what}: {text:?}");
        let expected = if line.contains('\n') { 2 } else { 1 };
        assert_eq!(malformed, expected, "{what}: {text:?}");
    }
}

#[test]
fn a_malformed_last_line_without_a_newline_is_counted() {
    let (parsed, malformed) = parse_all("m 1\nm{a=");
    assert_eq!(parsed.len(), 1);
    assert_eq!(malformed, 1);
}

#[test]
fn malformed_lines_of_unwanted_names_are_skipped_uncounted() {
    // Unwanted lines are never parsed, so their errors cannot be seen; a line without a name is still
    // counted, since no filter could have asked for it.
    let text = "junk{a=\"unterminated 1\njunk garbage\nkept 1\n9junk 1\n";
    let mut found = samples(text, |name| name == "kept");
    let names: Vec<&str> = found.by_ref().map(|s| s.name).collect();
    assert_eq!(names, ["kept"]);
    assert_eq!(found.malformed(), 1);
}

#[test]
fn empty_input_yields_nothing_and_nothing_malformed() {
    for text in ["", "\n", "\r\n", "   ", "# only a comment"] {
        let (parsed, malformed) = parse_all(text);
        assert!(parsed.is_empty() && malformed == 0, "{text:?}");
    }
}

#[test]
fn a_vllm_exposition_yields_only_the_wanted_gauges_with_their_engine() {
    let wanted = ["vllm:num_requests_waiting", "vllm:num_requests_running"];
    let mut found = samples(VLLM, |name| wanted.contains(&name));
    let read: Vec<(&str, String, f64)> = found
        .by_ref()
        .map(|s| (s.name, s.label("engine").unwrap().into_owned(), s.value))
        .collect();
    assert_eq!(
        read,
        [
            ("vllm:num_requests_running", "0".to_owned(), 12.0),
            ("vllm:num_requests_running", "1".to_owned(), 9.0),
            ("vllm:num_requests_waiting", "0".to_owned(), 3.0),
            ("vllm:num_requests_waiting", "1".to_owned(), 0.0),
        ]
    );
    assert_eq!(found.malformed(), 0);
}

#[test]
fn a_vllm_cache_config_info_gives_block_size_and_block_count() {
    let infos: Vec<Sample<'_>> = samples(VLLM, |name| name == "vllm:cache_config_info").collect();
    assert_eq!(infos.len(), 2);
    for (engine, info) in infos.iter().enumerate() {
        assert_eq!(info.label("block_size").as_deref(), Some("16"));
        assert_eq!(info.label("num_gpu_blocks").as_deref(), Some("2048"));
        assert_eq!(
            info.label("engine").as_deref(),
            Some(engine.to_string().as_str())
        );
        assert_eq!(info.label("absent"), None);
        assert_eq!(info.labels().count(), 15);
        assert_eq!(info.value, 1.0);
    }
}

#[test]
fn a_vllm_exposition_parses_completely_with_histograms_as_plain_samples() {
    let (parsed, malformed) = parse_all(VLLM);
    assert_eq!(malformed, 0);
    let sample_lines = VLLM.lines().filter(|l| !l.starts_with('#')).count();
    assert_eq!(parsed.len(), sample_lines);
    let buckets: Vec<&Owned> = parsed
        .iter()
        .filter(|s| s.name == "vllm:time_to_first_token_seconds_bucket")
        .collect();
    assert_eq!(buckets.len(), 10);
    assert_eq!(buckets[4].labels[1], ("le".to_owned(), "+Inf".to_owned()));
    assert_eq!(buckets[4].value, 53.0);
    let created = parsed
        .iter()
        .find(|s| s.name == "vllm:prompt_tokens_created")
        .unwrap();
    assert_eq!(created.value, 1.7331337021e9);
    let memory = parsed
        .iter()
        .find(|s| s.name == "process_virtual_memory_bytes")
        .unwrap();
    assert!(memory.labels.is_empty());
    assert_eq!(memory.value, 45_321_093_000.0);
}

#[test]
fn crlf_line_endings_parse_like_lf() {
    let (lf, _) = parse_all(VLLM);
    let (crlf, malformed) = parse_all(&VLLM.replace('\n', "\r\n"));
    assert_eq!(malformed, 0);
    assert_eq!(format!("{lf:?}"), format!("{crlf:?}"));
}

#[test]
fn an_sglang_exposition_yields_queue_depth_per_dp_rank() {
    let mut found = samples(SGLANG, |name| name == "sglang:num_queue_reqs");
    let read: Vec<(String, String, String, f64)> = found
        .by_ref()
        .map(|s| {
            let label = |name| s.label(name).unwrap().into_owned();
            (
                label("model_name"),
                label("tp_rank"),
                label("dp_rank"),
                s.value,
            )
        })
        .collect();
    assert_eq!(
        read,
        [
            ("m".to_owned(), "0".to_owned(), "0".to_owned(), 0.0),
            ("m".to_owned(), "0".to_owned(), "1".to_owned(), 3.0),
        ]
    );
    assert_eq!(found.malformed(), 0);
    assert_eq!(parse_all(SGLANG).0.len(), 10);
}

#[test]
fn label_values_are_borrowed_unless_they_hold_an_escape() {
    let text = r#"m{plain="abc",escaped="a\"b"} 1"#;
    let sample = samples(text, |_| true).next().unwrap();
    assert!(matches!(sample.label("plain"), Some(Cow::Borrowed("abc"))));
    assert!(matches!(sample.label("escaped"), Some(Cow::Owned(v)) if v == "a\"b"));
}

#[test]
fn label_returns_the_first_of_duplicate_names() {
    let sample = samples(r#"m{a="1",a="2"} 1"#, |_| true).next().unwrap();
    assert_eq!(sample.label("a").as_deref(), Some("1"));
    assert_eq!(sample.labels().count(), 2);
}

#[test]
fn want_is_asked_once_per_run_of_lines_with_the_same_name() {
    let asked = Cell::new(0);
    let text = "a 1\na{x=\"1\"} 2\n# TYPE a gauge\na 3\nb 4\na 5\n";
    let count = samples(text, |name| {
        asked.set(asked.get() + 1);
        name == "a"
    })
    .count();
    assert_eq!(count, 4);
    assert_eq!(asked.get(), 3, "a, then b, then a again");
}

#[test]
fn a_name_extending_the_previous_one_is_a_different_name() {
    let text = "m 1\nm_bucket 2\nm:x 3\nm 4\n";
    let mut found = samples(text, |name| name != "m:x");
    let read: Vec<(&str, f64)> = found.by_ref().map(|s| (s.name, s.value)).collect();
    assert_eq!(read, [("m", 1.0), ("m_bucket", 2.0), ("m", 4.0)]);
    assert_eq!(found.malformed(), 0);
}

/// Renders a sample line as an exporter would, escaping label values.
fn render(
    name: &str,
    labels: &[(String, String)],
    value: f64,
    timestamp_ms: Option<i64>,
    spaced: bool,
    exponent: bool,
) -> String {
    let gap = if spaced { " \t" } else { "" };
    let mut line = name.to_owned();
    if !labels.is_empty() || spaced {
        line.push('{');
        for (label, raw) in labels {
            let escaped = raw
                .replace('\\', r"\\")
                .replace('"', r#"\""#)
                .replace('\n', r"\n");
            line.push_str(&format!("{gap}{label}{gap}={gap}\"{escaped}\"{gap},"));
        }
        if !spaced {
            line.pop();
        }
        line.push('}');
    }
    let value = match value {
        v if v.is_nan() => "NaN".to_owned(),
        f64::INFINITY => "+Inf".to_owned(),
        f64::NEG_INFINITY => "-Inf".to_owned(),
        v if exponent => format!("{v:e}"),
        v => v.to_string(),
    };
    line.push_str(&format!(" {value}"));
    if let Some(timestamp) = timestamp_ms {
        line.push_str(&format!("{gap} {timestamp}"));
    }
    line
}

/// Text made of the format's tokens, which reaches deeper into the parser than arbitrary strings.
fn exposition_like() -> impl Strategy<Value = String> {
    let tokens = vec![
        "m", "vllm:x", "m_bucket", " ", "\t", "\n", "\r\n", "\r", "{", "}", "=", "\"", "\\", "\\n",
        ",", "#", "le", "a", "1", "-2", "1.5e+03", "NaN", "+Inf", ".", "é", "🚀", ":",
    ];
    prop::collection::vec(prop::sample::select(tokens), 0..80).prop_map(|parts| parts.concat())
}

/// Parses `text` in full and filtered, and checks what holds for any input: every label of a yielded
/// sample is found by name, the malformed count is bounded by the lines, and filtering by name yields
/// exactly the full parse's samples of those names.
fn check_invariants(text: &str) -> Result<(), TestCaseError> {
    let mut all = samples(text, |_| true);
    let mut names = Vec::new();
    for sample in all.by_ref() {
        prop_assert!(!sample.name.is_empty());
        let mut seen = Vec::new();
        for (label, value) in sample.labels() {
            if !seen.contains(&label) {
                prop_assert_eq!(sample.label(label), Some(value));
                seen.push(label);
            }
        }
        names.push(sample.name);
    }
    prop_assert!(all.malformed() <= text.split('\n').count());
    let even: Vec<&str> = samples(text, |name| name.len() % 2 == 0)
        .map(|s| s.name)
        .collect();
    let expected: Vec<&str> = names.into_iter().filter(|n| n.len() % 2 == 0).collect();
    prop_assert_eq!(even, expected);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_text_never_panics_and_filtering_equals_filtering_the_full_parse(text in any::<String>()) {
        check_invariants(&text)?;
    }

    #[test]
    fn exposition_like_text_never_panics_and_filtering_equals_filtering_the_full_parse(text in exposition_like()) {
        check_invariants(&text)?;
    }

    #[test]
    fn a_rendered_sample_parses_back_to_itself(
        name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,30}",
        labels in prop::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,12}", any::<String>()), 0..6),
        value in any::<f64>(),
        timestamp_ms in prop::option::of(any::<i64>()),
        spaced in any::<bool>(),
        exponent in any::<bool>(),
        crlf in any::<bool>(),
    ) {
        let line = render(&name, &labels, value, timestamp_ms, spaced, exponent);
        let newline = if crlf { "\r\n" } else { "\n" };
        let text = format!("# TYPE {name} gauge{newline}{line}{newline}after 1{newline}");
        let mut all = samples(&text, |_| true);
        let sample = all.next().expect("the rendered line parses");
        prop_assert_eq!(sample.name, name.as_str());
        let parsed: Vec<(String, String)> =
            sample.labels().map(|(n, v)| (n.to_owned(), v.into_owned())).collect();
        prop_assert_eq!(&parsed, &labels);
        for ((_, raw), (_, value)) in labels.iter().zip(sample.labels()) {
            let escapes = raw.contains(['\\', '"', '\n']);
            prop_assert_eq!(matches!(value, Cow::Owned(_)), escapes);
        }
        prop_assert!(same_value(sample.value, value), "{} parsed as {}", value, sample.value);
        prop_assert_eq!(sample.timestamp_ms, timestamp_ms);
        prop_assert_eq!(all.next().map(|s| s.name), Some("after"));
        prop_assert_eq!(all.malformed(), 0);
    }
}

//! Real clients streaming chat completions through a real Envoy and cachepick to a simulated worker
//! whose tokens come a visible 80 ms apart: the official `openai` Python package
//! (`scripts/openai-stream.py`, on the interpreter `scripts/provision-python` installs with the pinned
//! version) and a plain `curl -sN` SSE session, in Envoy's BUFFERED and FULL_DUPLEX_STREAMED modes.
//!
//! Each chunk is timestamped as the client receives it (the Python script prints a monotonic time per
//! chunk; curl's stdout is read line by line here and each `data:` line stamped on arrival). A proxy or
//! a picker that held the response back would deliver the chunks in one burst at the end; the tests
//! assert they are spread like the worker's inter-token latency instead, and that the content is whole
//! and ends as the API says (`finish_reason`, usage, `data: [DONE]`).
//!
//! Timing is asserted with wide margins (gaps of a quarter of the latency, a spread of half the decode
//! time): buffering collapses them to nothing, while a slow machine only stretches them.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod gateway;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{gateway, sim_client};

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use cachepick::envoy_config::BodyMode;
use gateway::Gateway;
use sim_client::{CHAT, MODEL, metric_sum};

/// Tokens each stream decodes, and the worker's time between two of them.
const TOKENS: u64 = 12;
const INTER_TOKEN: Duration = Duration::from_millis(80);
/// How long one client may take before the test fails instead of hanging.
const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The interpreter with the pinned `openai`, installed once per test binary; panics with the
/// script's reason when it cannot be.
fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let out = Command::new("bash")
                .arg(root().join("scripts/provision-python"))
                .stdin(Stdio::null())
                .output()
                .expect("run scripts/provision-python");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "scripts/provision-python failed ({}); the openai client test needs Python 3 with venv and PyPI:\n{stderr}",
                out.status
            );
            let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
            assert!(path.is_file(), "provision-python printed {path:?}, not a file:\n{stderr}");
            path
        })
        .clone()
}

/// Three workers decoding `INTER_TOKEN` apart, behind cachepick and Envoy in `mode`: the default
/// model slowed until one request's decode step (about 7.2 ms on its GPU) takes that long.
async fn stack(mode: BodyMode) -> Gateway {
    Gateway::start(
        3,
        |sim| {
            let mut alone = cachepick_sim::step::StepWork::default();
            alone.decode(60);
            sim.params.time_scale =
                INTER_TOKEN.as_secs_f64() / sim.params.profile.step_time(&alone);
        },
        Some(mode),
    )
    .await
}

fn prompt(client: &str) -> String {
    format!(
        "{client} streams through Envoy and cachepick. {}",
        "context ".repeat(40)
    )
}

async fn decisions(stack: &Gateway) -> f64 {
    metric_sum(
        &stack.picker_metrics().await,
        "cachepick_decisions_total",
        &[("pool", MODEL)],
    )
}

/// Arrival times of the chunks that carried content, relative to the first; asserts they are spread
/// like the worker's decode: the last well after the first, most gaps a sizeable share of the latency.
#[track_caller]
fn assert_streamed(client: &str, arrivals: &[Duration]) {
    assert!(
        arrivals.len() as u64 >= TOKENS / 2,
        "{client}: only {} content chunks for {TOKENS} tokens",
        arrivals.len()
    );
    let first = arrivals[0];
    let spread = *arrivals.last().unwrap() - first;
    let decode = INTER_TOKEN * (TOKENS as u32 - 1);
    let gaps: Vec<Duration> = arrivals.windows(2).map(|pair| pair[1] - pair[0]).collect();
    let wide = gaps.iter().filter(|gap| **gap >= INTER_TOKEN / 4).count();
    let offsets: Vec<u128> = arrivals
        .iter()
        .map(|at| (*at - first).as_millis())
        .collect();
    assert!(
        spread >= decode / 2,
        "{client}: content arrived within {spread:?} of the first chunk, the worker decodes over {decode:?}: \
         buffered, not streamed (arrivals in ms: {offsets:?})"
    );
    assert!(
        wide * 3 >= gaps.len() * 2,
        "{client}: only {wide} of {} gaps between chunks are over {:?} (arrivals in ms: {offsets:?})",
        gaps.len(),
        INTER_TOKEN / 4
    );
}

/// `scripts/openai-stream.py` through Envoy: its chunks are stamped by the client as they arrive.
async fn openai_client(stack: &Gateway) {
    let before = decisions(stack).await;
    let python = python();
    let script = root().join("scripts/openai-stream.py");
    let base_url = format!("http://{}/v1", stack.gateway());
    let prompt = prompt("openai");
    let run = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([
                base_url.as_str(),
                MODEL,
                &TOKENS.to_string(),
                prompt.as_str(),
            ])
            .stdin(Stdio::null())
            .output()
            .expect("run openai-stream.py")
    });
    let out = tokio::time::timeout(CLIENT_DEADLINE, run)
        .await
        .expect("the openai client ends in time")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai-stream.py failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("{error}: {line}")))
        .collect();
    let (end, chunks) = lines.split_last().expect("output lines");
    assert_eq!(end["end"], true, "{stdout}");

    let seconds = |chunk: &Value| chunk["t"].as_f64().expect("a monotonic time");
    let content: Vec<&Value> = chunks
        .iter()
        .filter(|chunk| !chunk["content"].as_str().unwrap_or_default().is_empty())
        .collect();
    let first = seconds(content.first().expect("content"));
    let arrivals: Vec<Duration> = content
        .iter()
        .map(|chunk| Duration::from_secs_f64(seconds(chunk) - first))
        .collect();
    assert_streamed("openai", &arrivals);

    // Complete: the worker's every token, ended by the length limit, with the usage chunk last.
    let finish: Vec<&str> = chunks
        .iter()
        .filter_map(|chunk| chunk["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["length"], "{stdout}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], TOKENS, "{stdout}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{stdout}");
    // cachepick decided it.
    assert_eq!(decisions(stack).await, before + 1.0);
}

/// `curl -sN` through Envoy: its stdout is read line by line here, each `data:` line stamped on arrival.
async fn curl_client(stack: &Gateway) {
    let before = decisions(stack).await;
    let url = format!("http://{}{CHAT}", stack.gateway());
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt("curl")}],
        "max_tokens": TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let headers = tempfile::NamedTempFile::new().unwrap();
    let headers_path = headers.path().to_owned();
    let run = tokio::task::spawn_blocking(move || {
        let mut child = Command::new("curl")
            .args(["-sN", "--max-time", "20", "-D"])
            .arg(&headers_path)
            .args([
                "-H",
                "content-type: application/json",
                "--data-binary",
                &body,
                &url,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot run curl (is it installed?): {error}"));
        let stdout = child.stdout.take().unwrap();
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("curl's stdout is UTF-8");
            lines.push((Instant::now(), line));
        }
        let out = child.wait_with_output().unwrap();
        (out, lines)
    });
    let (out, lines) = tokio::time::timeout(CLIENT_DEADLINE, run)
        .await
        .expect("curl ends in time")
        .unwrap();
    let transcript: String = lines.iter().map(|(_, line)| format!("{line}\n")).collect();
    assert!(
        out.status.success(),
        "curl failed ({}): {}\n{transcript}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let head = std::fs::read_to_string(headers.path())
        .unwrap()
        .to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    // The worker saw cachepick's destination header: Envoy asked cachepick, and obeyed it.
    assert!(
        head.contains("x-sim-echo-x-gateway-destination-endpoint:"),
        "{head}"
    );

    // Framing: `data:` lines separated by blank lines, the last one `[DONE]`.
    let data: Vec<(Instant, &str)> = lines
        .iter()
        .filter(|(_, line)| !line.is_empty())
        .map(|(at, line)| {
            let payload = line
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data line: {line:?}\n{transcript}"));
            (*at, payload)
        })
        .collect();
    let ((_, done), payloads) = data.split_last().expect("data lines");
    assert_eq!(*done, "[DONE]", "{transcript}");
    let mut arrivals = Vec::new();
    let mut finish = Vec::new();
    let mut usage = None;
    for (at, payload) in payloads {
        let chunk: Value = serde_json::from_str(payload)
            .unwrap_or_else(|error| panic!("{error}: {payload}\n{transcript}"));
        let choice = &chunk["choices"][0];
        if !choice["delta"]["content"]
            .as_str()
            .unwrap_or_default()
            .is_empty()
        {
            arrivals.push(*at);
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish.push(reason.to_owned());
        }
        if chunk["usage"].is_object() {
            usage = Some(chunk["usage"].clone());
        }
    }
    let first = *arrivals.first().expect("content");
    let arrivals: Vec<Duration> = arrivals.iter().map(|at| *at - first).collect();
    assert_streamed("curl", &arrivals);
    assert_eq!(finish, ["length"], "{transcript}");
    let usage = usage.expect("a usage chunk (include_usage)");
    assert_eq!(usage["completion_tokens"], TOKENS, "{transcript}");
    assert_eq!(decisions(stack).await, before + 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_and_curl_stream_unbuffered_through_envoy_in_buffered_mode() {
    let stack = stack(BodyMode::Buffered).await;
    openai_client(&stack).await;
    curl_client(&stack).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_and_curl_stream_unbuffered_through_envoy_in_full_duplex_mode() {
    let stack = stack(BodyMode::Duplex).await;
    openai_client(&stack).await;
    curl_client(&stack).await;
}

/// The negative control: chunks a buffering proxy releases together at the end fail the check.
#[test]
#[should_panic(expected = "buffered, not streamed")]
fn a_burst_of_chunks_at_the_end_is_not_streaming() {
    let burst: Vec<Duration> = (0..TOKENS)
        .map(|index| Duration::from_micros(index * 50))
        .collect();
    assert_streamed("burst", &burst);
}

/// And the check passes chunks that arrive as the worker decodes them.
#[test]
fn chunks_spread_like_the_decode_are_streaming() {
    let decoded: Vec<Duration> = (0..TOKENS as u32)
        .map(|index| INTER_TOKEN * index)
        .collect();
    assert_streamed("decoded", &decoded);
}

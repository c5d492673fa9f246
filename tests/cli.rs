//! The `cachepick` binary as an operator runs it: real processes, real files, real sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
    pub mod serve;
}

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;

use support::engine::{FakeEngine, Mode, refused_addr, vllm_metrics};
use support::serve::{self, Server, http_get};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn cachepick(args: &[&str]) -> Output {
    Command::new(cachepick_rig::cachepick_binary())
        .args(args)
        .output()
        .expect("the cachepick binary runs")
}

/// `cachepick check --config <config> <flags…>`.
fn check(config: &Path, flags: &[&str]) -> Output {
    let config = config.to_str().expect("a UTF-8 path");
    cachepick(&[&["check", "--config", config], flags].concat())
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cachepick.yaml")
}

/// One pool whose only worker never answers: `serve` starts, and stays not ready.
const UNREACHABLE_WORKER: &str = "\
pools:
  - model: m
    engine: sglang
    workers: [{endpoint: 127.0.0.1:1}]
";

fn write_config(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write config");
    file
}

/// `cachepick explain --config CONFIG --body BODY` and `extra`, run off the async runtime (the tests
/// serve fake engines on it while the command scrapes them).
async fn explain(config: &std::path::Path, body: &std::path::Path, extra: &[&str]) -> Output {
    let mut args: Vec<String> = [
        "explain",
        "--config",
        path_str(config),
        "--body",
        path_str(body),
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cachepick(&args)
    })
    .await
    .unwrap()
}

fn path_str(path: &std::path::Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn check_accepts_the_example_and_prints_the_effective_config() {
    let output = check(&example(), &[]);
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let effective: serde_yaml::Value = serde_yaml::from_str(&stdout(&output)).expect("YAML output");
    assert_eq!(effective["policy"]["gate_unit"], "prefill_time");
    assert_eq!(effective["policy"]["divert_margin"], "500ms");
    // The SGLang pool counts waiting requests, as its own gate_unit says.
    assert_eq!(effective["pools"][1]["policy"]["gate_unit"], "requests");
    assert_eq!(effective["pools"][1]["policy"]["worker_queue_limit"], 6);
    assert_eq!(
        effective["pools"][0]["workers"][1]["role"], "both",
        "defaults are filled in"
    );
    assert_eq!(
        effective["pools"][0]["workers"][1]["metrics_url"],
        "http://10.0.0.12:8000/metrics"
    );
    // It ends with where the debug endpoints are served and a one-line verdict, as YAML comments.
    let text = stdout(&output);
    let tail: Vec<&str> = text.lines().rev().take(2).collect();
    assert!(tail[0].starts_with("# ok: valid ("), "{text}");
    assert!(
        tail[1].starts_with("# effective debug endpoints (")
            && tail[1].contains("metrics_listen 127.0.0.1:9090 on"),
        "{text}"
    );
}

/// `check`'s output goes where configurations are pasted (CI logs, tickets): a worker's `metrics_url`
/// keeps its host and path but not its credentials or query, as `/debug/config` shows it.
#[test]
fn check_redacts_credentials_as_debug_config_does() {
    let file = write_config(
        "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:8000\n        metrics_url: http://scraper:s3cret@127.0.0.1:8000/metrics?api_key=k3y\n",
    );
    let output = check(file.path(), &[]);
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let text = stdout(&output);
    assert!(
        !text.contains("s3cret") && !text.contains("scraper") && !text.contains("k3y"),
        "{text}"
    );
    let effective: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML output");
    assert_eq!(
        effective["pools"][0]["workers"][0]["metrics_url"],
        "http://REDACTED@127.0.0.1:8000/metrics?REDACTED"
    );
}

#[test]
fn the_effective_config_is_itself_a_valid_config() {
    let first = check(&example(), &[]);
    let file = write_config(&stdout(&first));
    let second = check(file.path(), &[]);
    assert!(second.status.success(), "stderr: {}", stderr(&second));
    assert_eq!(stdout(&first), stdout(&second));
}

/// A file in the seed's request unit: its keys given, no `gate_unit`.
const REQUEST_UNIT: &str = "\
policy:
  worker_queue_limit: 4
  saturation_queue_floor: 2
pools:
  - model: m
    engine: vllm
    workers: [{endpoint: 10.0.0.1:8000}]
";

#[test]
fn flags_override_the_file() {
    let file = write_config(REQUEST_UNIT);
    let output = check(
        file.path(),
        &[
            "--worker-queue-limit",
            "8",
            "--saturation-queue-floor",
            "3",
            "--min-load-choices",
            "4",
            "--listen",
            "127.0.0.1:7000",
        ],
    );
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let effective: serde_yaml::Value = serde_yaml::from_str(&stdout(&output)).unwrap();
    assert_eq!(effective["policy"]["worker_queue_limit"], 8);
    assert_eq!(effective["policy"]["saturation_queue_floor"], 3);
    assert_eq!(effective["policy"]["min_load_choices"], 4);
    assert_eq!(effective["listen"], "127.0.0.1:7000");
}

#[test]
fn check_refuses_a_block_size_that_does_not_divide_the_engines() {
    // vLLM's CPU build caches in blocks of 128 tokens: a 48-token block can never be reused whole.
    let file = write_config(
        "pools:\n  - model: m\n    engine: vllm\n    block_size: 48\n    engine_block_size: 128\n    \
         workers:\n      - endpoint: 10.0.0.1:8000\n",
    );
    let output = check(file.path(), &[]);
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(
        message.contains(
            "pools[0].block_size (line 4): block_size 48 does not divide engine_block_size 128"
        ) && message.contains("(128, 64, 32, 16)"),
        "{message}"
    );
    let divides = write_config(
        "pools:\n  - model: m\n    engine: vllm\n    block_size: 16\n    engine_block_size: 128\n    \
         workers:\n      - endpoint: 10.0.0.1:8000\n",
    );
    assert_eq!(check(divides.path(), &[]).status.code(), Some(0));
}

#[test]
fn check_lists_every_problem_and_exits_2() {
    let file = write_config(
        "\
listen: nowhere
policy:
  worker_queue_limit: 0
  min_load_choices: 0
  pin_depth_ratio: 1.5
  bogus: true
pools:
  - model: m
    engine: vllm
    workers:
      - endpoint: 10.0.0.1:80
      - endpoint: 10.0.0.1:80
",
    );
    let output = check(file.path(), &[]);
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    for expected in [
        "listen (line 1)",
        "policy.worker_queue_limit (line 3)",
        "policy.min_load_choices (line 4)",
        "policy.pin_depth_ratio (line 5)",
        "policy.bogus (line 6)",
        "10.0.0.1:80",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in:\n{message}"
        );
    }
    assert!(
        stdout(&output).is_empty(),
        "nothing printed as effective config"
    );
}

#[test]
fn a_flag_that_breaks_an_invariant_is_named_in_the_message() {
    let file = write_config(REQUEST_UNIT);
    let output = check(file.path(), &["--saturation-queue-floor", "9"]);
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(message.contains("--saturation-queue-floor"), "{message}");
    assert!(message.contains("must be at most"), "{message}");
}

#[test]
fn a_request_unit_flag_on_a_prefill_time_file_is_refused_with_the_line_that_chose_the_unit() {
    // The shipped example names gate_unit: prefill_time; the seed's flags do not silently switch it.
    let output = check(&example(), &["--worker-queue-limit", "8"]);
    assert_eq!(output.status.code(), Some(2));
    let message = stderr(&output);
    assert!(
        message.contains("--worker-queue-limit: ignored by policy.gate_unit prefill_time (line"),
        "{message}"
    );
}

#[test]
fn a_missing_config_file_is_a_config_error() {
    let output = check(Path::new("/nonexistent/cachepick.yaml"), &[]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("/nonexistent/cachepick.yaml"));
}

#[test]
fn serve_answers_grpc_health_and_stops_on_sigterm() {
    let config = write_config(UNREACHABLE_WORKER);
    let args = [serve::ANY_PORTS.as_slice(), &["--shutdown-grace", "200ms"]].concat();
    let child = serve::command(config.path(), &args, "info")
        .spawn()
        .expect("serve starts");
    let mut server = Server(child);

    // The log names the address actually bound.
    let stdout = server.0.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let field = |line: &str, name: &str| {
        line.split(&format!(" {name}="))
            .nth(1)
            .map(|rest| rest.split_whitespace().next().unwrap().to_owned())
    };
    let (addr, metrics_addr) = loop {
        let line = lines
            .next()
            .expect("serve logs its address")
            .expect("log line");
        if let (Some(addr), Some(metrics)) =
            (field(&line, "listen"), field(&line, "metrics_listen"))
        {
            break (addr, metrics);
        }
    };

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap();
        let channel = tokio::time::timeout(Duration::from_secs(10), endpoint.connect())
            .await
            .expect("connects in time")
            .expect("connects");
        let mut client = HealthClient::new(channel);
        let status = |service: &str| HealthCheckRequest {
            service: service.to_owned(),
        };
        let liveness = client.check(status("liveness")).await.unwrap().into_inner();
        assert_eq!(liveness.status(), ServingStatus::Serving);
        // Not ready while no worker has a fresh reading (the only one is unreachable): Envoy's health
        // check, which asks the ext_proc service, routes past a picker that knows no load
        // (tests/drain.rs shows it turning SERVING once a reading is fresh).
        for _ in 0..10 {
            for service in ["readiness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
                let health = client.check(status(service)).await.unwrap().into_inner();
                assert_eq!(health.status(), ServingStatus::NotServing, "{service}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });

    // Prometheus on metrics_listen, with the scraper's counters for the configured (unreachable) worker.
    let metrics = std::thread::spawn(move || {
        for _ in 0..50 {
            let text = http_get(&metrics_addr, "/metrics");
            if text.contains("cachepick_workers_stale") {
                return text;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("no scrape gauges on /metrics");
    })
    .join()
    .unwrap();
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains(
            r#"cachepick_scrapes_total{outcome="connect_error",pool="m",worker="127.0.0.1:1"}"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"cachepick_workers_stale{pool="m"} 1"#),
        "{metrics}"
    );

    let pid = server.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = server.0.wait().unwrap();
    assert!(
        status.success(),
        "serve exits cleanly on SIGTERM: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_shows_what_cachepick_sees_of_each_worker() {
    let engine = FakeEngine::start(Mode::Body("text/plain", vllm_metrics(&[(0, 3, 5, 0.5)]))).await;
    let down = refused_addr();
    let config = write_config(&format!(
        "load: {{scrape_interval: 200ms, scrape_timeout: 100ms, freshness: 1s}}\n\
         pools:\n  - model: m\n    engine: vllm\n    workers:\n\
         \x20     - endpoint: \"{}\"\n      - endpoint: \"{down}\"\n",
        engine.addr
    ));
    let path = config.path().to_str().unwrap().to_owned();
    let output = tokio::task::spawn_blocking(move || {
        cachepick(&["snapshot", "--config", &path, "--rounds", "2", "--json"])
    })
    .await
    .unwrap();
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let pools: serde_json::Value = serde_json::from_str(&stdout(&output)).expect("JSON output");
    let workers = &pools[0]["workers"];
    assert_eq!(workers[0]["fresh"], true);
    assert_eq!(workers[0]["waiting"], 3);
    assert_eq!(workers[0]["running"], 5);
    assert_eq!(workers[0]["max_total_tokens"], 16000);
    assert_eq!(workers[0]["scrapes"], 2);
    assert_eq!(workers[1]["fresh"], false);
    assert_eq!(workers[1]["last_outcome"], "connect_error");
    assert!(
        workers[1]["why_not_fresh"]
            .as_str()
            .unwrap()
            .contains("no reading yet")
    );
    assert_eq!(engine.hits(), 2, "one request per round");

    let path = config.path().to_str().unwrap().to_owned();
    let table = tokio::task::spawn_blocking(move || cachepick(&["snapshot", "--config", &path]))
        .await
        .unwrap();
    let table = stdout(&table);
    assert!(table.contains("WAITING"), "{table}");
    assert!(table.contains(&format!("{down}")), "{table}");
    assert!(
        table.contains("no: no reading yet: cannot connect"),
        "{table}"
    );
}

/// Every worker down: the snapshot still prints what it saw, and exits 3 (not 0, which says every pool
/// has a worker with a fresh reading; not 1 or 2, which say the command or the file is broken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_exits_3_when_a_pool_has_no_fresh_worker() {
    let down = refused_addr();
    let config = write_config(&format!(
        "load: {{scrape_interval: 200ms, scrape_timeout: 100ms, freshness: 1s}}\n\
         pools:\n  - model: m\n    engine: vllm\n    workers:\n\
         \x20     - endpoint: \"{down}\"\n      - endpoint: \"127.0.0.2:{}\"\n",
        down.port()
    ));
    let path = config.path().to_str().unwrap().to_owned();
    let output = tokio::task::spawn_blocking(move || cachepick(&["snapshot", "--config", &path]))
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(3), "stderr: {}", stderr(&output));
    assert!(
        stdout(&output).contains("cannot connect"),
        "{}",
        stdout(&output)
    );
    assert!(
        stderr(&output).contains("no worker with a fresh reading in pool(s) m"),
        "{}",
        stderr(&output)
    );
}

/// A freshness far beyond the one-shot commands' single scrape round: their tests assert what a fresh
/// reading shows, and a debug build on a loaded 2-core machine can take seconds between the scrape and
/// the decision (3.3–3.8 s measured while benchmarks ran), past the default 3 s.
const ONE_SHOT_LOAD: &str = "load: {freshness: 60s}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_pool_tokens_blocks_and_decision_for_a_body() {
    let engine = FakeEngine::start(Mode::Body("text/plain", vllm_metrics(&[(0, 0, 2, 0.1)]))).await;
    // {ONE_SHOT_LOAD} keeps the one scrape fresh however slowly a loaded machine starts the picker.
    let config = write_config(&format!(
        "{ONE_SHOT_LOAD}pools:\n  - model: m\n    engine: vllm\n    block_size: 16\n    workers:\n\
         \x20     - endpoint: \"{}\"\n",
        engine.addr
    ));
    let body = write_config(
        r#"{"model": "m", "messages": [{"role": "system", "content": "You are terse and exact, and you answer in one line."},
            {"role": "user", "content": "Which worker serves this request, and why does it hold the prefix of my prompt?"}]}"#,
    );
    let output = explain(config.path(), body.path(), &["--json"]).await;
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let explanation: serde_json::Value =
        serde_json::from_str(&stdout(&output)).expect("JSON output");
    let tokens = explanation["prepared"]["prompt_tokens"].as_u64().unwrap();
    let blocks = explanation["prepared"]["block_hashes"]
        .as_array()
        .unwrap()
        .len() as u64;
    assert!(tokens > 16, "{explanation}");
    assert_eq!(blocks, tokens / 16, "full blocks only");
    assert_eq!(explanation["outcome"]["outcome"], "route");
    assert_eq!(explanation["outcome"]["reason"], "cache_miss");
    assert_eq!(
        explanation["outcome"]["trace"]["fresh"], 1,
        "the worker was scraped first: {explanation}"
    );

    let text = explain(config.path(), body.path(), &[]).await;
    let text = stdout(&text);
    assert!(text.contains("pool:    m"), "{text}");
    assert!(
        text.contains(&format!("{tokens} tokens, {blocks} full blocks of 16")),
        "{text}"
    );
    assert!(
        text.contains(&format!("decision: cache_miss -> {}", engine.addr)),
        "{text}"
    );

    let bad = write_config(r#"{"model": "m", "messages": "hello"}"#);
    let refused = explain(config.path(), bad.path(), &[]).await;
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("400"), "{}", stderr(&refused));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_prints_each_workers_prediction_under_the_prefill_time_unit() {
    // Four requests wait on the first worker, none on the second; the rate is configured.
    let busy = FakeEngine::start(Mode::Body("text/plain", vllm_metrics(&[(0, 4, 2, 0.1)]))).await;
    let idle = FakeEngine::start(Mode::Body("text/plain", vllm_metrics(&[(0, 0, 2, 0.1)]))).await;
    let config = write_config(&format!(
        "{ONE_SHOT_LOAD}policy: {{gate_unit: prefill_time, prefill_tokens_per_second: 1000}}\n\
         pools:\n  - model: m\n    engine: vllm\n    block_size: 16\n    workers:\n\
         \x20     - endpoint: \"{}\"\n      - endpoint: \"{}\"\n",
        busy.addr, idle.addr
    ));
    let body = write_config(
        r#"{"model": "m", "messages": [{"role": "user", "content": "Which worker is predicted to start this prefill first?"}]}"#,
    );
    let output = explain(config.path(), body.path(), &["--json"]).await;
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let explanation: serde_json::Value =
        serde_json::from_str(&stdout(&output)).expect("JSON output");
    let tokens = explanation["prepared"]["prompt_tokens"].as_u64().unwrap();
    let predictions = explanation["outcome"]["trace"]["predictions"]
        .as_array()
        .unwrap();
    assert_eq!(predictions.len(), 2, "{explanation}");
    // Nothing learned yet: each waiting request stands in as this prompt, 1,000 tokens a second.
    assert_eq!(predictions[0]["ahead_tokens"], 4 * tokens, "{explanation}");
    assert_eq!(
        predictions[0]["queue_us"],
        4 * tokens * 1000,
        "{explanation}"
    );
    assert_eq!(predictions[0]["rate_source"], "configured");
    assert_eq!(predictions[1]["ahead_tokens"], 0);
    assert_eq!(predictions[1]["prefill_us"], tokens * 1000);
    assert_eq!(explanation["outcome"]["reason"], "cache_miss");

    let text = explain(config.path(), body.path(), &[]).await;
    let text = stdout(&text);
    assert!(
        text.contains(&format!(
            "predict: {} cached 0 tokens, {} uncached ahead (0 sent since its reading): queue {}.0 ms",
            busy.addr,
            4 * tokens,
            4 * tokens
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("decision: cache_miss -> {}", idle.addr)),
        "{text}"
    );
}

#[test]
fn envoy_config_writes_the_pickers_tls_and_refuses_flags_that_do_not_fit() {
    let config = write_config(
        "tls: {cert_file: /tls/p.crt, key_file: /tls/p.key, client_ca_file: /tls/clients.crt}\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n",
    );
    let path = config.path().to_str().expect("a UTF-8 path");
    let missing = cachepick(&["envoy-config", "--config", path]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        stderr(&missing).contains("give --picker-ca"),
        "{}",
        stderr(&missing)
    );
    let no_client = cachepick(&["envoy-config", "--config", path, "--picker-ca", "/e/ca.crt"]);
    assert_eq!(no_client.status.code(), Some(2));
    assert!(stderr(&no_client).contains("--picker-client-cert"));
    let output = cachepick(&[
        "envoy-config",
        "--config",
        path,
        "--picker-ca",
        "/e/ca.crt",
        "--picker-client-cert",
        "/e/envoy.crt",
        "--picker-client-key",
        "/e/envoy.key",
        "--picker-sni",
        "cachepick.llm.svc",
    ]);
    assert!(output.status.success(), "stderr: {}", stderr(&output));
    let yaml = stdout(&output);
    assert_eq!(yaml.matches("UpstreamTlsContext").count(), 2, "{yaml}");
}

/// `--log-format json` writes one JSON object per line with the fields at the top level, with no
/// colour codes when stdout is a pipe (`NO_COLOR` unset), and `RUST_LOG=debug` leaves the HTTP/2 and
/// gRPC stacks at `info`. A `RUST_LOG` that does not parse is refused at start.
#[test]
fn serve_logs_json_lines_without_colour_or_transport_noise() {
    let config = write_config(UNREACHABLE_WORKER);
    let args = [serve::ANY_PORTS.as_slice(), &["--log-format", "json"]].concat();
    let mut command = serve::command(config.path(), &args, "debug");
    command.env_remove("NO_COLOR");
    let (server, lines) = serve::spawn_logged(&mut command);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let listen = loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            .unwrap_or_else(|_| panic!("no listen record in {seen:#?}"));
        assert!(!line.contains('\u{1b}'), "colour in a pipe: {line:?}");
        let record: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert!(
            record["level"].is_string() && record["timestamp"].is_string(),
            "{record}"
        );
        seen.push(record.clone());
        if let Some(listen) = record["listen"].as_str() {
            break listen.to_owned();
        }
    };
    // A gRPC health check drives h2 and tonic, which at debug would log every frame.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{listen}")).unwrap();
        let channel = endpoint.connect().await.expect("connects");
        let mut client = HealthClient::new(channel);
        let request = HealthCheckRequest {
            service: "liveness".to_owned(),
        };
        client.check(request).await.expect("liveness answers");
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(server);
    for line in lines.try_iter() {
        let record: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        let target = record["target"].as_str().unwrap_or_default();
        let level = record["level"].as_str().unwrap_or_default();
        let transport = ["h2", "hyper", "tonic", "tower"]
            .iter()
            .any(|name| target == *name || target.starts_with(&format!("{name}::")));
        assert!(
            !(transport && matches!(level, "DEBUG" | "TRACE")),
            "transport noise at debug: {record}"
        );
    }

    let refused = serve::command(config.path(), &serve::ANY_PORTS, "cachepick=loud")
        .output()
        .expect("serve runs");
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("cachepick=loud"),
        "{}",
        stderr(&refused)
    );
}

#[test]
fn serve_stops_at_start_up_on_a_certificate_it_cannot_read() {
    let config = write_config(
        "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\ntls: {cert_file: /nonexistent/tls.crt, key_file: /nonexistent/tls.key}\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 127.0.0.1:9\n",
    );
    let path = config.path().to_str().expect("a UTF-8 path");
    let output = cachepick(&["serve", "--config", path]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("/nonexistent/tls.crt"),
        "{}",
        stderr(&output)
    );
}

/// `snapshot --from URL`: a running picker's own view, from its metrics listener, with the local
/// snapshot's exit statuses: 3 names the pool with no fresh worker; 1 when nothing answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_from_a_running_picker_shows_its_view_and_fails_when_a_pool_is_blind() {
    let engine = FakeEngine::start(Mode::Body("text/plain", vllm_metrics(&[(0, 1, 2, 0.1)]))).await;
    let config = write_config(&format!(
        "load: {{scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s}}\n\
         pools:\n  - model: m\n    engine: vllm\n    workers: [{{endpoint: \"{}\"}}]\n\
         \x20 - model: n\n    engine: vllm\n    workers: [{{endpoint: 127.0.0.1:1}}]\n",
        engine.addr
    ));
    let engine_addr = engine.addr.to_string();
    tokio::task::spawn_blocking(move || {
        let (server, lines) = serve::spawn_logged(&mut serve::command(
            config.path(),
            &serve::ANY_PORTS,
            "info",
        ));
        let metrics = serve::logged_field(&lines, "metrics_listen");
        let url = format!("http://{metrics}");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let output = loop {
            let output = cachepick(&["snapshot", "--from", &url]);
            if stdout(&output).contains("yes") || std::time::Instant::now() > deadline {
                break output;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = stdout(&output);
        assert_eq!(output.status.code(), Some(3), "{text}\n{}", stderr(&output));
        assert!(text.contains("pool m") && text.contains("pool n"), "{text}");
        let row = text
            .lines()
            .find(|line| line.contains(&engine_addr))
            .unwrap_or_else(|| panic!("no row for {engine_addr}:\n{text}"));
        assert!(row.contains(" yes "), "{row}");
        assert!(stderr(&output).contains("pool(s) n"), "{}", stderr(&output));

        let json = cachepick(&["snapshot", "--from", &url, "--json"]);
        let parsed: serde_json::Value = serde_json::from_str(&stdout(&json)).expect("JSON only");
        assert_eq!(
            parsed["pools"].as_array().map(Vec::len),
            Some(2),
            "{parsed}"
        );
        drop(server);

        let gone = cachepick(&["snapshot", "--from", &url]);
        assert_eq!(gone.status.code(), Some(1), "{}", stderr(&gone));
        let no_source = cachepick(&["snapshot"]);
        assert_eq!(no_source.status.code(), Some(2), "{}", stderr(&no_source));
    })
    .await
    .unwrap();
}

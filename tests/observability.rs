//! What operators load beside cachepick — the Grafana dashboard (`deploy/grafana/cachepick.json`), the
//! Prometheus recording rules and alerts (`deploy/prometheus/`) — checked with the real promtool against
//! a live picker and a real Envoy, so neither can drift from the code: every PromQL expression parses,
//! the alerts' unit tests pass, and every `cachepick_*`, `inference_pool_*` and `envoy_*` series they
//! read is one the running processes export. Also: `promtool check metrics` accepts cachepick's
//! exposition, and the Gateway API Inference Extension's pool gauges follow the workers' own metrics.
//!
//! promtool comes from `scripts/provision-promtool` (Debian's `prometheus` package, unpacked under
//! `target/`); a test that cannot get it fails with the script's reason, it never skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod gateway;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{gateway, provision, sim_client};

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use cachepick::envoy_config::BodyMode;
use cachepick_sim::config::{KvEventsConfig, KvEventsFormat};
use gateway::Gateway;
use sim_client::{DEADLINE, MODEL, PromSample, prom_samples};

const DASHBOARD: &str = "deploy/grafana/cachepick.json";
const RULES_DIR: &str = "deploy/prometheus";
const RULES: &str = "cachepick-rules.yaml";
const RULE_TESTS: &str = "cachepick-rules.test.yaml";

/// The series prefixes the dashboard and the rules read from cachepick and from Envoy.
const PICKER_PREFIXES: [&str; 2] = ["cachepick_", "inference_pool_"];
const ENVOY_PREFIX: &str = "envoy_";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

// === promtool ===

/// The promtool `scripts/provision-promtool` installs (once per process); panics with the script's
/// stderr when it cannot.
fn promtool() -> PathBuf {
    static PROMTOOL: OnceLock<PathBuf> = OnceLock::new();
    PROMTOOL
        .get_or_init(|| {
            let path = provision::script(
                "provision-promtool",
                "the observability tests cannot run without promtool",
            );
            assert!(path.is_file(), "{} is not an executable", path.display());
            path
        })
        .clone()
}

/// Runs promtool with `args` in `dir`, feeding `stdin`.
fn run_promtool(dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool starts");
    let mut input = child.stdin.take().expect("promtool's stdin");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("feed promtool");
    }
    drop(input);
    child.wait_with_output().expect("promtool ends")
}

#[track_caller]
fn assert_promtool_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "promtool {what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

// === what the dashboard and the rules read ===

/// Every PromQL expression of the dashboard (`targets[].expr`), with the title of its panel.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(value: &Value, title: &str, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) => {
                let title = map.get("title").and_then(Value::as_str).unwrap_or(title);
                if let Some(Value::String(expr)) = map.get("expr") {
                    out.push((title.to_owned(), expr.clone()));
                }
                for child in map.values() {
                    walk(child, title, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|item| walk(item, title, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], "", &mut out);
    out
}

/// The dashboard's template variable queries (`label_values(...)`): they name series too.
fn template_queries(dashboard: &Value) -> Vec<String> {
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter_map(|variable| match &variable["query"] {
            Value::String(query) if variable["type"] == "query" => Some(query.clone()),
            Value::Object(query) => query
                .get("query")
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// Every rule's `expr` in the rules file, with its record or alert name.
fn rule_exprs(rules: &serde_yaml::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["record"]
                .as_str()
                .or_else(|| rule["alert"].as_str())
                .expect("a record or an alert");
            let expr = rule["expr"].as_str().expect("an expr");
            out.push((name.to_owned(), expr.to_owned()));
        }
    }
    out
}

/// The series an expression reads that cachepick or Envoy export: names with one of the prefixes,
/// outside label matchers (`{...}`), string literals and grouping lists (`by (...)`, `on (...)`...),
/// which name labels. Recording-rule names (with a `:`) are the rules' own.
fn series_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut chars = expr.chars().peekable();
    let mut braces = 0_usize;
    let mut grouping = false;
    let mut in_label_list = false;
    let skip_string = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => break,
                _ => {}
            }
        }
    };
    while let Some(c) = chars.next() {
        if braces > 0 {
            match c {
                '{' => braces += 1,
                '}' => braces -= 1,
                '"' => skip_string(&mut chars),
                _ => {}
            }
            continue;
        }
        if in_label_list {
            in_label_list = c != ')';
            continue;
        }
        match c {
            '{' => braces = 1,
            '"' => skip_string(&mut chars),
            '(' if grouping => {
                in_label_list = true;
                grouping = false;
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == ':' => {
                let mut token = String::from(c);
                while let Some(&next) = chars.peek() {
                    if next.is_ascii_alphanumeric() || next == '_' || next == ':' {
                        token.push(next);
                        chars.next();
                    } else {
                        break;
                    }
                }
                grouping = matches!(
                    token.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                );
                let ours = PICKER_PREFIXES
                    .iter()
                    .chain([&ENVOY_PREFIX])
                    .any(|prefix| token.starts_with(prefix));
                if ours && !token.contains(':') {
                    names.insert(token);
                }
            }
            c if c.is_whitespace() => {}
            _ => grouping = false,
        }
    }
    names
}

/// `expr` with Grafana's variables replaced by what Prometheus accepts: the interval variables by a
/// duration, every other variable (used inside `=~"..."` matchers) by a match-anything regex.
fn concrete(expr: &str) -> String {
    let mut text = expr
        .replace("$__rate_interval", "5m")
        .replace("$__interval", "5m")
        .replace("$__range", "5m");
    let mut out = String::new();
    let mut chars = text.drain(..).peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'{') {
            for c in chars.by_ref() {
                if c == '}' {
                    break;
                }
            }
        } else {
            while chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
            {
                chars.next();
            }
        }
        out.push_str(".*");
    }
    out
}

fn load_dashboard() -> Value {
    let text = std::fs::read_to_string(repo(DASHBOARD)).expect("the dashboard");
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{DASHBOARD} is not JSON: {error}"))
}

fn load_rules() -> serde_yaml::Value {
    let path = repo(RULES_DIR).join(RULES);
    let text = std::fs::read_to_string(&path).expect("the rules");
    serde_yaml::from_str(&text).unwrap_or_else(|error| panic!("{RULES} is not YAML: {error}"))
}

// === the files alone ===

#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = repo(RULES_DIR);
    assert_promtool_ok(
        &run_promtool(&dir, &["check", "rules", RULES], None),
        "check rules",
    );
    let tested = run_promtool(&dir, &["test", "rules", RULE_TESTS], None);
    assert_promtool_ok(&tested, "test rules");

    // Every alert has a unit test, and each is shown both silent (`exp_alerts: []`) and firing.
    let tests = std::fs::read_to_string(dir.join(RULE_TESTS)).expect("the rule tests");
    let tests: serde_yaml::Value = serde_yaml::from_str(&tests).expect("the rule tests are YAML");
    let mut silent = BTreeSet::new();
    let mut firing = BTreeSet::new();
    for test in tests["tests"].as_sequence().expect("tests") {
        for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_owned();
            let fires = case["exp_alerts"]
                .as_sequence()
                .is_some_and(|alerts| !alerts.is_empty());
            if fires {
                firing.insert(name);
            } else {
                silent.insert(name);
            }
        }
    }
    let alerts: BTreeSet<String> = rule_exprs(&load_rules())
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !name.contains(':'))
        .collect();
    assert!(alerts.len() >= 5, "{alerts:?}");
    assert_eq!(firing, alerts, "alerts shown firing");
    assert_eq!(silent, alerts, "alerts shown silent");

    // Every alert tells the person paged what it means and what to do first.
    for group in load_rules()["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let Some(alert) = rule["alert"].as_str() else {
                continue;
            };
            for annotation in ["summary", "description", "runbook"] {
                assert!(
                    rule["annotations"][annotation]
                        .as_str()
                        .is_some_and(|text| text.len() > 20),
                    "{alert} has no {annotation}"
                );
            }
        }
    }
}

#[test]
fn every_dashboard_expression_parses_as_promql_and_the_datasource_is_a_variable() {
    let dashboard = load_dashboard();
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 20, "only {} expressions", exprs.len());

    // promtool parses recording rules' expressions with Prometheus's own parser: one rule per query.
    let rules: Vec<Value> = exprs
        .iter()
        .enumerate()
        .map(|(index, (_, expr))| json!({"record": format!("dashboard:query_{index}"), "expr": concrete(expr)}))
        .collect();
    let file = json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-rules.yaml");
    std::fs::write(&path, serde_yaml::to_string(&file).unwrap()).unwrap();
    let output = run_promtool(
        dir.path(),
        &["check", "rules", "dashboard-rules.yaml"],
        None,
    );
    assert_promtool_ok(&output, "check rules (the dashboard's queries)");

    // No hard-coded datasource: a `datasource` variable, and every panel and query names it.
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables
            .iter()
            .any(|variable| variable["type"] == "datasource"
                && variable["name"] == "datasource"
                && variable["query"] == "prometheus"),
        "no Prometheus datasource variable in {variables:?}"
    );
    let mut datasources = Vec::new();
    fn collect(value: &Value, out: &mut Vec<Value>) {
        match value {
            Value::Object(map) => {
                if let Some(datasource) = map.get("datasource") {
                    out.push(datasource.clone());
                }
                map.values().for_each(|child| collect(child, out));
            }
            Value::Array(items) => items.iter().for_each(|item| collect(item, out)),
            _ => {}
        }
    }
    collect(&dashboard["panels"], &mut datasources);
    assert!(datasources.len() >= exprs.len());
    for datasource in datasources {
        assert_eq!(datasource["uid"], "${datasource}", "{datasource}");
    }
}

#[test]
fn series_names_skip_labels_strings_and_recorded_series() {
    let names = series_names(
        r#"sum by (envoy_virtual_cluster, le) (rate(envoy_x_bucket{envoy_virtual_host="llm", a="cachepick_no"}[5m]))
           / on (pool) pool:cachepick_decisions:rate5m + cachepick_y_total"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["cachepick_y_total", "envoy_x_bucket"]
    );
    assert_eq!(
        concrete(r#"rate(x{pool=~"$pool", p="${datasource}"}[$__rate_interval])"#),
        r#"rate(x{pool=~".*", p=".*"}[5m])"#
    );
}

// === against a live picker and Envoy ===

fn sample_names(samples: &[PromSample]) -> BTreeSet<String> {
    samples.iter().map(|sample| sample.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_rules_read_only_series_a_live_picker_and_envoy_export() {
    // The workers publish KV events and the pool runs in `events` mode, so the exposition promtool
    // checks holds the KV event streams' families too.
    let stack = Gateway::start(
        2,
        |sim| sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::VllmMap)),
        Some(BodyMode::Buffered),
    )
    .await;
    // Decisions through Envoy: cachepick counts them, Envoy counts them per reason's virtual cluster.
    for index in 0..6 {
        let reply = stack
            .chat(&format!("observability {} {}", index % 2, "x".repeat(600)))
            .await;
        assert!(
            reply.status.is_success(),
            "{} {}",
            reply.status,
            reply.text()
        );
    }
    let picker = stack.picker_metrics().await;
    let envoy = stack.envoy().prometheus().await;
    let picker_names = sample_names(&prom_samples(&picker));
    let envoy_names = sample_names(&prom_samples(&envoy));

    // promtool's linter accepts cachepick's exposition as it is after traffic, the KV event streams'
    // families included.
    assert!(
        picker_names
            .iter()
            .any(|name| name.starts_with("cachepick_kv_events_")),
        "no KV event stream series in:\n{picker}"
    );
    let checked = run_promtool(Path::new("."), &["check", "metrics"], Some(&picker));
    assert_promtool_ok(&checked, "check metrics (cachepick's /metrics)");

    // The GIE pool gauges are there, labelled as the EPP labels them.
    for name in [
        "inference_pool_average_queue_size",
        "inference_pool_average_kv_cache_utilization",
        "inference_pool_average_running_requests",
        "inference_pool_ready_pods",
        "inference_pool_per_pod_queue_size",
    ] {
        let samples: Vec<PromSample> = prom_samples(&picker)
            .into_iter()
            .filter(|sample| sample.name == name)
            .collect();
        assert!(!samples.is_empty(), "no {name} in:\n{picker}");
        assert!(
            samples
                .iter()
                .all(|sample| sample.label("name") == Some(MODEL)),
            "{name} not labelled name=\"{MODEL}\": {:?}",
            samples
                .iter()
                .map(|sample| &sample.labels)
                .collect::<Vec<_>>()
        );
    }

    // Every series the dashboard and the rules read exists in the live processes.
    let dashboard = load_dashboard();
    let mut read: Vec<(String, String)> = dashboard_exprs(&dashboard);
    read.extend(
        template_queries(&dashboard)
            .into_iter()
            .map(|query| ("templating".to_owned(), query)),
    );
    read.extend(rule_exprs(&load_rules()));
    let mut missing = Vec::new();
    let mut used = BTreeSet::new();
    for (source, expr) in &read {
        for name in series_names(expr) {
            let live = if name.starts_with(ENVOY_PREFIX) {
                &envoy_names
            } else {
                &picker_names
            };
            if !live.contains(&name) {
                missing.push(format!("{name} (in {source})"));
            }
            used.insert(name);
        }
    }
    assert!(
        missing.is_empty(),
        "series the dashboard or rules read but no live process exports:\n  {}\n\nEnvoy's vcluster series:\n{}",
        missing.join("\n  "),
        envoy_names
            .iter()
            .filter(|name| name.contains("vcluster"))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The labels the dashboard groups Envoy's per-reason series by are Envoy's.
    let envoy_samples = prom_samples(&envoy);
    for (name, labels) in [
        (
            "envoy_vhost_vcluster_upstream_rq_total",
            ["envoy_virtual_host", "envoy_virtual_cluster"].as_slice(),
        ),
        (
            "envoy_vhost_vcluster_upstream_rq_xx",
            [
                "envoy_virtual_host",
                "envoy_virtual_cluster",
                "envoy_response_code_class",
            ]
            .as_slice(),
        ),
    ] {
        assert!(
            envoy_samples.iter().any(|sample| sample.name == name
                && sample.label("envoy_virtual_host") == Some("llm")
                && labels.iter().all(|label| sample.label(label).is_some())),
            "no {name} with labels {labels:?}"
        );
    }
    // The dashboard reads the Envoy per-reason series, the GIE gauges and cachepick's own.
    for prefix in ["cachepick_", "inference_pool_", "envoy_vhost_vcluster_"] {
        assert!(
            used.iter().any(|name| name.starts_with(prefix)),
            "nothing read from {prefix}*: {used:?}"
        );
    }
}

/// Polls cachepick's `/metrics` until `check` accepts it; panics with the GIE series on expiry.
async fn wait_metrics(stack: &Gateway, what: &str, check: impl Fn(&[PromSample]) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let text = stack.picker_metrics().await;
        if check(&prom_samples(&text)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {DEADLINE:?}; the GIE series:\n{}",
            text.lines()
                .filter(|line| line.starts_with("inference_pool_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the one sample `name` with `labels`, if there is exactly one.
fn value(samples: &[PromSample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = samples.iter().filter(|sample| {
        sample.name == name
            && labels
                .iter()
                .all(|(label, value)| sample.label(label) == Some(value))
    });
    let one = found.next()?;
    found.next().is_none().then_some(one.value)
}

fn near(value: Option<f64>, expected: f64) -> bool {
    value.is_some_and(|value| (value - expected).abs() < 1e-3)
}

/// The pool's ready pods, average queue, average running requests and average KV usage are
/// `expected`, in that order.
fn pool_gauges_are(samples: &[PromSample], pool: &[(&str, &str)], expected: [f64; 4]) -> bool {
    [
        "inference_pool_ready_pods",
        "inference_pool_average_queue_size",
        "inference_pool_average_running_requests",
        "inference_pool_average_kv_cache_utilization",
    ]
    .iter()
    .zip(expected)
    .all(|(name, expected)| near(value(samples, name, pool), expected))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gie_pool_gauges_follow_the_workers_metrics() {
    let stack = Gateway::start(3, |_| {}, None).await;
    let workers = stack.fleet.endpoints();
    let pool = [("name", MODEL)];
    // Queues 4, 1 and 1; KV use 0.5, 0.1 and 0.3; running 2, 0, 1.
    for (addr, waiting, running, kv) in [
        (workers[0], 4, 2, 0.5),
        (workers[1], 1, 0, 0.1),
        (workers[2], 1, 1, 0.3),
    ] {
        let fake = json!({"waiting": waiting, "running": running, "kv_usage": kv});
        stack.fake_metrics(addr, "live", fake).await;
    }
    let first = workers[0].to_string();
    wait_metrics(&stack, "three ready workers, averaged", |samples| {
        pool_gauges_are(samples, &pool, [3.0, 2.0, 1.0, 0.3])
            && near(
                value(
                    samples,
                    "inference_pool_per_pod_queue_size",
                    &[("name", MODEL), ("model_server_pod", &first)],
                ),
                4.0,
            )
    })
    .await;

    // The third worker's metrics fail: once its reading is stale it is no longer ready, and the
    // averages run over the two others.
    stack.fake_metrics(workers[2], "fail", Value::Null).await;
    let third = workers[2].to_string();
    wait_metrics(
        &stack,
        "the failing worker leaves the averages",
        |samples| {
            pool_gauges_are(samples, &pool, [2.0, 2.5, 1.0, 0.3])
                && value(
                    samples,
                    "inference_pool_per_pod_queue_size",
                    &[("name", MODEL), ("model_server_pod", &third)],
                )
                .is_none()
        },
    )
    .await;

    // Every worker fails: nothing is ready, and the averages are gone rather than stuck.
    for addr in &workers[..2] {
        stack.fake_metrics(*addr, "fail", Value::Null).await;
    }
    wait_metrics(&stack, "no ready worker, no averages", |samples| {
        near(value(samples, "inference_pool_ready_pods", &pool), 0.0)
            && value(samples, "inference_pool_average_queue_size", &pool).is_none()
            && value(
                samples,
                "inference_pool_average_kv_cache_utilization",
                &pool,
            )
            .is_none()
    })
    .await;
}

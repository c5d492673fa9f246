//! NVIDIA Dynamo's own KV router as a replay arm (`cachepick replay --dynamo-selector`): the real
//! selection service from PyPI `ai-dynamo-runtime`, installed by `scripts/provision-peers`, started on
//! the arm's fleet, fed by the workers' KV events over ZeroMQ and asked for every request by the
//! replay's ext_proc server behind a real Envoy.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod peers;
    pub mod provision;
    pub mod replay;
}

use support::replay::{replay_status, tiny_trace};
use support::{envoy, peers};

/// The service decides every request of its arm through Envoy, and routes the conversations' later
/// turns to the workers holding their earlier ones: it found them in the workers' KV events, since the
/// replay tells it nothing else of the cache.
#[test]
fn dynamo_s_own_selection_service_routes_an_arm_behind_envoy_on_the_workers_kv_events() {
    let python = peers::bin_dir().join("python");
    let envoy = envoy::binary();
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("conversations.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("trace written");
    let out = dir.path().join("out");
    let selector = format!(
        "{} -m dynamo.select_service --port {{port}} --threads 1",
        python.display()
    );
    let (ok, stdout, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "gate_floor",
        "--via",
        "envoy",
        "--envoy",
        envoy.to_str().unwrap(),
        "--no-oracle",
        "--dynamo-selector",
        &selector,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let text = std::fs::read_to_string(out.join("report.json")).expect("report.json written");
    let report: serde_json::Value = serde_json::from_str(&text).expect("report.json is JSON");
    let arms = report["policies"].as_array().expect("arms");
    let labels: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(labels, ["gate_floor", "dynamo/select_service"], "{stdout}");
    let dynamo = &arms[1];
    assert_eq!(
        dynamo["ok"], 30,
        "every request streamed to the end: {dynamo}"
    );
    assert_eq!(dynamo["through_envoy"], 30, "{dynamo}");
    // The decision header the ext_proc server set on each request, echoed by the worker that served it.
    assert_eq!(
        dynamo["reasons"],
        serde_json::json!({"dynamo/select_service": 30}),
        "{dynamo}"
    );
    assert_eq!(dynamo["index_mode"], "kv events", "{dynamo}");
    // Each later turn finds its prefix where the service sent it: near the ideal hit rate (the events
    // of a turn still prefilling are not out yet, so a little below it), far above what placing the
    // turns blind would find.
    let ideal = report["ideal_hit_rate"].as_f64().unwrap();
    let hit = dynamo["hit_rate"].as_f64().unwrap();
    assert!(ideal > 0.7, "{report}");
    assert!(
        hit >= 0.8 * ideal,
        "hit {hit} against ideal {ideal}: {dynamo}"
    );
    let log = out.join("dynamo_select_service.log");
    let log = std::fs::read_to_string(&log).expect("the service's output is kept");
    assert!(log.contains("ZMQ listener"), "{log}");
}

/// A template without `{port}` is refused before anything starts, and so is the arm on the virtual
/// clock, which runs no outside process, and on a prefill/decode fleet; a service that cannot start
/// fails the run with its reason.
#[test]
fn a_dynamo_selector_without_a_port_or_on_the_virtual_clock_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("conversations.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("trace written");
    let out = dir.path().join("out");
    let (ok, _, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "none",
        "--dynamo-selector",
        "python -m dynamo.select_service",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("names no `{port}`"), "{stderr}");
    assert!(!out.join("report.json").exists());
    let (ok, _, stderr) = replay_status(&[
        "--clock",
        "virtual",
        "--trace",
        trace.to_str().unwrap(),
        "--dynamo-selector",
        "python -m dynamo.select_service --port {port}",
    ]);
    assert!(!ok && stderr.contains("--dynamo-selector"), "{stderr}");
    // No prefill/decode form of the arm exists, and it is not dropped silently from such a run.
    let (ok, _, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "none",
        "--pd",
        "1",
        "--via",
        "envoy",
        "--dynamo-selector",
        "python -m dynamo.select_service --port {port}",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        !ok && stderr.contains("routes aggregated fleets"),
        "{stderr}"
    );
    // A service that dies at start fails the run, pointing at its output.
    let (ok, stdout, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "none",
        "--dynamo-selector",
        "sh -c 'echo no such service >&2; exit 3' {port}",
        "--out",
        out.to_str().unwrap(),
    ]);
    let all = format!("{stdout}{stderr}");
    assert!(!ok && all.contains("exited (exit status: 3)"), "{all}");
    let log = std::fs::read_to_string(out.join("dynamo_select_service.log")).expect("its output");
    assert!(log.contains("no such service"), "{log}");
}

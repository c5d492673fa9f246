//! `cachepick replay` end to end through the real binary: a tiny Mooncake trace over ext_proc, a tiny
//! burst scenario through the real Envoy, picker replicas behind one Envoy with a crashed worker, and the
//! real `smg` and `vllm-router` as front arms beside cachepick's, so the tool cannot rot.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod peers;
    pub mod provision;
    pub mod replay;
}

use support::replay::{replay, replay_status, tiny_trace};
use support::{envoy, peers};

use std::path::Path;
use std::process::Command;

fn svg(path: &Path) {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    assert!(
        text.starts_with("<svg"),
        "{}: {}",
        path.display(),
        &text[..40.min(text.len())]
    );
    assert!(text.trim_end().ends_with("</svg>"), "{}", path.display());
    assert!(
        text.contains("<polyline"),
        "{} draws no line",
        path.display()
    );
}

fn report(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("report.json")).expect("report.json written");
    serde_json::from_str(&text).expect("report.json is JSON")
}

/// The sum of a JSON object of counts (`{"a": 3, "b": 4}`: 7); panics, saying `what`, on a non-object.
fn sum_of_counts(counts: &serde_json::Value, what: &str) -> u64 {
    counts
        .as_object()
        .expect(what)
        .values()
        .filter_map(serde_json::Value::as_u64)
        .sum()
}

#[test]
fn a_tiny_trace_replays_over_ext_proc_for_two_policies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("write trace");
    let out = dir.path().join("out");
    let (stdout, _) = replay(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--policies",
        "gate,gate_floor",
        "--speedup",
        "2",
        "--via",
        "direct",
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(stdout.contains("| gate |"), "{stdout}");
    assert!(stdout.contains("| gate_floor |"), "{stdout}");
    assert!(stdout.contains("decision reasons"), "{stdout}");
    // The limit beside them: the oracle's row, every row's TTFT p90 as a multiple of its, and the
    // trace's ideal hit rate.
    assert!(stdout.contains("| oracle |"), "{stdout}");
    assert!(stdout.contains("TTFT p90 ÷ oracle"), "{stdout}");
    assert!(stdout.contains("ideal prefix-hit rate"), "{stdout}");

    let report = report(&out);
    assert_eq!(report["requests"], 30);
    assert_eq!(report["via"], "direct");
    assert_eq!(report["fleet"]["timing"], "step");
    let ideal = report["ideal_hit_rate"].as_f64().expect("ideal hit rate");
    let policies = report["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), 3);
    assert_eq!(policies[2]["arm"], "oracle");
    assert_eq!(policies[2]["reasons"]["oracle"], 30, "{}", policies[2]);
    for policy in policies {
        let name = policy["policy"].as_str().expect("name");
        assert_eq!(policy["requests"], 30, "{name}");
        assert_eq!(policy["ok"], 30, "{name}: {policy}");
        // Later turns extend earlier ones: the workers report cache hits, never more than the ideal.
        let hit = policy["hit_rate"].as_f64().expect("hit rate");
        assert!(
            hit > 0.2 && hit <= ideal,
            "{name}: hit rate {hit} (ideal {ideal})"
        );
        let busy = policy["utilisation"]["busy"].as_f64().expect("busy share");
        assert!(busy > 0.0 && busy <= 1.0, "{name}: busy {busy}");
        for key in ["p50", "p90", "p99"] {
            assert!(
                policy["ttft_ms"][key].as_f64().is_some(),
                "{name}: ttft {key}"
            );
        }
        assert!(policy["e2e_ms"]["p99"].as_f64().is_some(), "{name}");
        let share = policy["worker_share"].as_f64().expect("worker share");
        assert!((1.0..=4.0).contains(&share), "{name}: share {share}");
        let served = sum_of_counts(&policy["worker_requests"], "per worker");
        assert_eq!(served, 30, "{name}");
        let reasons = sum_of_counts(&policy["reasons"], "reasons");
        assert_eq!(reasons, 30, "{name}");
    }
    svg(&out.join("ttft_cdf.svg"));
    assert!(out.join("table.md").is_file());
}

/// A short burst through a real Envoy: cachepick's arms, a re-implemented peer and the oracle, each
/// answer proxied by Envoy and each decision echoed by the worker that served it.
#[test]
fn a_tiny_burst_replays_through_envoy() {
    let envoy = envoy::binary();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let (stdout, _) = replay(&[
        "--scenario",
        "burst",
        "--duration-scale",
        "0.05",
        "--speedup",
        "4",
        "--policies",
        "gate,gate_floor",
        "--peer",
        "llm-d",
        "--via",
        "envoy",
        "--envoy",
        envoy.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(stdout.contains("| gate_floor |"), "{stdout}");
    assert!(stdout.contains("burst hit"), "{stdout}");
    let report = report(&out);
    assert_eq!(report["via"], "envoy");
    let arms: Vec<&str> = report["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .filter_map(|policy| policy["arm"].as_str())
        .collect();
    assert_eq!(
        arms,
        ["gate", "gate_floor", "llm-d/sticky (re-impl)", "oracle"],
        "{stdout}"
    );
    for policy in report["policies"].as_array().expect("policies") {
        let requests = policy["requests"].as_u64().expect("requests");
        assert!(requests > 5, "{policy}");
        assert_eq!(policy["ok"].as_u64(), Some(requests), "{policy}");
        // Every arm pays the same path: the in-process routers decide behind the same Envoy.
        assert_eq!(policy["through_envoy"].as_u64(), Some(requests), "{policy}");
        assert!(
            policy["hit_rate"].as_f64().is_some_and(|hit| hit > 0.0),
            "{policy}"
        );
        // The decision reasons arrive through Envoy, as the worker saw them.
        assert!(
            policy["reasons"]
                .as_object()
                .is_some_and(|reasons| !reasons.contains_key("none")),
            "{policy}"
        );
    }
    svg(&out.join("ttft_cdf.svg"));
    svg(&out.join("burst_timeline.svg"));
}

/// The same burst on a prefill/decode fleet: cachepick's arm and the PD oracle each make both picks
/// and send vLLM's NIXL prefill leg, through the same Envoy, and every request is served.
#[test]
fn a_tiny_burst_replays_on_a_prefill_decode_fleet_with_the_pd_oracle() {
    tiny_pd_burst(&[]);
}

/// The same on an SGLang fleet, whose workers run `disaggregation_mode` prefill and decode: both
/// arms perform the bootstrap rendezvous (a decode worker refuses a request without a room, so a
/// request served is a rendezvous made).
#[test]
fn a_tiny_burst_replays_on_an_sglang_prefill_decode_fleet_with_the_pd_oracle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fleet = dir.path().join("sglang.yaml");
    std::fs::write(
        &fleet,
        "engine: sglang\nworkers: 4\ntokenizer: {kind: bytes}\nkv_blocks: 4096\ntime_scale: 0.25\n",
    )
    .expect("write the fleet");
    tiny_pd_burst(&["--config", fleet.to_str().expect("utf-8 path")]);
}

fn tiny_pd_burst(fleet: &[&str]) {
    let envoy = envoy::binary();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let mut args = fleet.to_vec();
    args.extend([
        "--scenario",
        "burst",
        "--duration-scale",
        "0.05",
        "--speedup",
        "4",
        "--policies",
        "gate_floor",
        "--pd",
        "2",
        "--via",
        "envoy",
        "--envoy",
        envoy.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    let (stdout, _) = replay(&args);
    let report = report(&out);
    let arms: Vec<&str> = report["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .filter_map(|policy| policy["arm"].as_str())
        .collect();
    assert_eq!(arms, ["gate_floor", "oracle"], "{stdout}");
    for policy in report["policies"].as_array().expect("policies") {
        let requests = policy["requests"].as_u64().expect("requests");
        assert!(requests > 5, "{policy}");
        assert_eq!(policy["ok"].as_u64(), Some(requests), "{policy}");
        assert_eq!(policy["through_envoy"].as_u64(), Some(requests), "{policy}");
        // Only the two decode workers answer clients: each prefill leg is cachepick's (or the
        // oracle's) own request, not the client's.
        let served: Vec<u64> = policy["worker_requests"]
            .as_object()
            .expect("worker_requests")
            .values()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        assert_eq!(
            served.iter().filter(|count| **count == 0).count(),
            2,
            "{policy}"
        );
        assert_eq!(served.iter().sum::<u64>(), requests, "{policy}");
        // Both engines report the pulled prompt as held: every decode leg pulled its KV.
        assert!(
            policy["hit_rate"].as_f64().is_some_and(|hit| hit > 0.9),
            "{policy}"
        );
    }
    assert!(stdout.contains("TTFT p90 ÷ oracle"), "{stdout}");
}

/// The prefill-heavy agents scenario, shortened: sessions whose long system prompts and growing
/// histories the cache-aware rows keep hitting, far beyond round robin, with the oracle beside them.
#[test]
fn a_short_agents_replay_keeps_its_long_prefixes_cached() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let (stdout, _) = replay(&[
        "--scenario",
        "agents",
        "--duration-scale",
        "0.05",
        "--policies",
        "round_robin,gate_floor",
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(stdout.contains("| oracle |"), "{stdout}");
    let report = report(&out);
    assert_eq!(report["scenario"], "agents");
    let ideal = report["ideal_hit_rate"].as_f64().expect("ideal");
    assert!(ideal > 0.6, "{report}");
    let arms = report["policies"].as_array().expect("arms");
    let hit = |name: &str| {
        let arm = arms.iter().find(|arm| arm["arm"] == name).expect(name);
        assert_eq!(arm["ok"], arm["requests"], "{arm}");
        // Prompts of thousands of tokens: long prompts in every row.
        assert!(arm["prompt_tokens"].as_u64().unwrap() > 3_000 * 5, "{arm}");
        arm["hit_rate"].as_f64().expect("hit rate")
    };
    let (rr, cachepick, oracle) = (hit("round_robin"), hit("gate_floor"), hit("oracle"));
    assert!(
        cachepick > rr && oracle > rr && cachepick <= ideal,
        "round robin {rr}, gate_floor {cachepick}, oracle {oracle}, ideal {ideal}"
    );
}

/// The re-implemented peers (llm-d's sticky-until-saturated rule, Dynamo's KV-router cost) run as arms
/// at one and three router replicas, each request's decision labelled with the rule, and both keep the
/// agents' long prefixes cached as an affinity router does.
#[test]
fn the_reimplemented_peers_run_at_one_and_three_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let (stdout, _) = replay(&[
        "--scenario",
        "agents",
        "--duration-scale",
        "0.05",
        "--policies",
        "none",
        "--peer",
        "llm-d,dynamo",
        "--replicas",
        "1,3",
        "--no-oracle",
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    let report = report(&out);
    let ideal = report["ideal_hit_rate"].as_f64().expect("ideal");
    let arms = report["policies"].as_array().expect("arms");
    let labels: Vec<&str> = arms.iter().filter_map(|arm| arm["arm"].as_str()).collect();
    assert_eq!(
        labels,
        [
            "llm-d/sticky (re-impl)/x1",
            "llm-d/sticky (re-impl)/x3",
            "dynamo/kv (re-impl)/x1",
            "dynamo/kv (re-impl)/x3"
        ],
        "{stdout}"
    );
    for arm in arms {
        let rule = arm["policy"].as_str().expect("rule");
        assert_eq!(arm["ok"], arm["requests"], "{arm}");
        assert_eq!(arm["reasons"][rule], arm["requests"], "{arm}");
        let hit = arm["hit_rate"].as_f64().expect("hit rate");
        assert!(hit > ideal * 0.5 && hit <= ideal, "{arm}: ideal {ideal}");
    }
}

/// Two picker replicas behind one real Envoy, both index modes, and a worker crash: Envoy round-robins
/// the requests' ext_proc streams over the replicas (each replica's `/metrics` counts its decisions),
/// both index modes run (the events arm on the simulator's KV event streams), and the fault arm's
/// stale-credit windows are in the report.
#[test]
fn two_replicas_share_the_decisions_through_envoy_and_the_crash_is_reported() {
    let envoy = envoy::binary();
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("write trace");
    let out = dir.path().join("out");
    // No --via: more than one replica implies Envoy.
    let (stdout, _) = replay(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--policies",
        "gate",
        "--speedup",
        "2",
        "--replicas",
        "2",
        "--index",
        "approximate,events",
        "--crash-worker",
        "0",
        "--crash-at",
        "0.6",
        "--restart-after",
        "0.2",
        // The crash is the pickers' arms' own; the oracle has no picker to fool.
        "--no-oracle",
        "--envoy",
        envoy.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(stdout.contains("| gate/approximate/x2 |"), "{stdout}");
    assert!(stdout.contains("decisions per picker replica"), "{stdout}");
    assert!(stdout.contains("stale credits"), "{stdout}");

    let report = report(&out);
    assert_eq!(report["via"], "envoy");
    assert_eq!(report["replicas"], serde_json::json!([2]));
    assert_eq!(
        report["index_modes"],
        serde_json::json!(["approximate", "events"])
    );
    assert_eq!(report["crash"]["worker"], 0);
    let skipped = report["skipped"].as_array().expect("skipped");
    assert!(skipped.is_empty(), "{skipped:?}");

    let policies = report["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), 2);
    assert_eq!(policies[1]["arm"], "gate/events/x2");
    assert_eq!(policies[1]["index_mode"], "events");
    for arm in policies {
        check_replicated_arm(arm);
    }
    assert_eq!(policies[0]["arm"], "gate/approximate/x2");
    svg(&out.join("ttft_cdf.svg"));
    let chart = std::fs::read_to_string(out.join("ttft_cdf.svg")).expect("chart");
    assert!(
        chart.contains("gate/approximate/x2"),
        "the arm names its line"
    );
    check_replicated_chart(&out);
}

/// Two replicas behind one real Envoy, with and without `replica_sync`: the synced arm's replicas each
/// accept every decision the other made (announced over UDP on loopback), the unsynced arm's none.
#[test]
fn two_synced_replicas_hear_every_decision_the_other_made() {
    let envoy = envoy::binary();
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("write trace");
    let out = dir.path().join("out");
    let (stdout, _) = replay(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--policies",
        "time_floor_all",
        "--speedup",
        "2",
        "--replicas",
        "2",
        "--replica-sync",
        "--index",
        "events",
        "--no-oracle",
        "--envoy",
        envoy.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(
        stdout.contains("| time_floor_all/events/x2+sync |"),
        "{stdout}"
    );
    let report = report(&out);
    let policies = report["policies"].as_array().expect("policies");
    let arms: Vec<&str> = policies
        .iter()
        .filter_map(|arm| arm["arm"].as_str())
        .collect();
    assert_eq!(
        arms,
        ["time_floor_all/events/x2", "time_floor_all/events/x2+sync"]
    );
    let plain = &policies[0];
    assert_eq!(plain["replica_sync"], false);
    assert_eq!(plain["replica_synced"], serde_json::json!([null, null]));
    let synced = &policies[1];
    assert_eq!(synced["replica_sync"], true);
    let decided: Vec<u64> = synced["replica_decisions"]
        .as_array()
        .expect("decisions")
        .iter()
        .map(|n| n.as_u64().expect("both replicas read"))
        .collect();
    let heard: Vec<u64> = synced["replica_synced"]
        .as_array()
        .expect("synced")
        .iter()
        .map(|n| n.as_u64().expect("both replicas synced"))
        .collect();
    assert!(
        decided.iter().all(|n| *n > 0),
        "both replicas decided: {decided:?}"
    );
    assert_eq!(
        heard,
        [decided[1], decided[0]],
        "each hears the other's decisions"
    );
}

/// One arm of the two-replica run: both replicas decided, and the crash's windows are reported.
fn check_replicated_arm(arm: &serde_json::Value) {
    assert_eq!(arm["policy"], "gate");
    assert_eq!(arm["replicas"], 2);
    assert_eq!(arm["requests"], 30);
    // The crash may cut a stream or two; everything else is served.
    let ok = arm["ok"].as_u64().expect("ok");
    assert!(ok >= 25, "{arm}");
    // Both replicas decided, and between them every request that reached a picker.
    let decisions: Vec<u64> = arm["replica_decisions"]
        .as_array()
        .expect("replica decisions")
        .iter()
        .map(|count| count.as_u64().expect("a replica's metrics were read"))
        .collect();
    assert_eq!(decisions.len(), 2, "{arm}");
    assert!(decisions.iter().all(|&count| count > 0), "{decisions:?}");
    assert!(decisions.iter().sum::<u64>() >= ok, "{decisions:?}");

    let fault = &arm["fault"];
    assert!(fault["error"].is_null(), "{fault}");
    let crashed = fault["crash_at_s"].as_f64().expect("crash time");
    let restarted = fault["restart_at_s"].as_f64().expect("restart time");
    assert!(crashed >= 0.6 && restarted >= crashed + 0.2, "{fault}");
    let windows: Vec<&str> = fault["windows"]
        .as_array()
        .expect("windows")
        .iter()
        .map(|window| window["window"].as_str().expect("window name"))
        .collect();
    assert_eq!(
        windows,
        ["before crash", "first 1 s after restart", "after"],
        "{fault}"
    );
    for window in fault["windows"].as_array().expect("windows") {
        let served = window["served"].as_u64().expect("served");
        let credited = window["credited"].as_u64().expect("credited");
        let stale = window["stale"].as_u64().expect("stale");
        let causes: u64 = ["in_flight", "evicted", "unlearned"]
            .iter()
            .map(|cause| window[*cause].as_u64().expect("a cause's count"))
            .sum();
        assert!(
            causes == stale && stale <= credited && credited <= served,
            "{window}"
        );
    }
}

/// The chart of the two-replica run names its arms and its replicas.
fn check_replicated_chart(out: &std::path::Path) {
    let chart = std::fs::read_to_string(out.join("ttft_cdf.svg")).expect("chart");
    assert!(
        chart.contains("picker replicas 2"),
        "the caption names the replicas"
    );
}

#[test]
fn more_than_one_replica_without_envoy_is_refused_saying_why() {
    let output = Command::new(cachepick_rig::cachepick_binary())
        .args([
            "replay",
            "--scenario",
            "burst",
            "--replicas",
            "2",
            "--via",
            "direct",
        ])
        .output()
        .expect("cachepick runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--replicas 2 needs --via envoy"),
        "{stderr}"
    );
}

#[test]
fn smg_and_vllm_router_rows_sit_beside_cachepicks_in_one_table() {
    let bin = peers::bin_dir();
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("trace written");
    let out = dir.path().join("out");
    // The peers' metrics listeners default to 0.0.0.0:29000; every port here is a loopback one.
    let front = |program: &str, subcommand: &str, policy: &str| {
        format!(
            "{}{subcommand} --worker-urls {{workers}} --host {{host}} --port {{port}} --policy {policy} \
             --prometheus-host {{host}} --prometheus-port {{metrics_port}}",
            bin.join(program).display()
        )
    };
    let smg_cache = front("smg", " launch", "cache_aware");
    let smg_rr = front("smg", " launch", "round_robin");
    let vllm = front("vllm-router", "", "cache_aware");
    // vllm-router's kv_aware reads the workers' KV events: each worker's sockets, its flag repeated
    // per worker, and the model they serve.
    let vllm_kv = format!(
        "{} --kv-event-block-size 16 --kv-event-model {{model}} {{kv_events:--kv-event-source}} \
         {{kv_events_replay:--kv-event-replay-source}}",
        front("vllm-router", "", "kv_aware")
    );
    let (stdout, _) = replay(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "gate_floor",
        "--load",
        "2",
        "--front",
        &smg_cache,
        "--front",
        &smg_rr,
        "--front",
        &vllm,
        "--front",
        &vllm_kv,
        "--out",
        out.to_str().unwrap(),
    ]);
    let report = report(&out);
    // The fleet ran twice as slowly as the trace assumes: the trace's speed-up of 8, times 2.
    assert_eq!(report["fleet"]["load"].as_f64(), Some(2.0), "{report}");
    assert_eq!(
        report["fleet"]["time_scale"].as_f64(),
        Some(0.25),
        "{report}"
    );
    let arms = report["policies"].as_array().expect("arms");
    let labels: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(
        labels,
        [
            "gate_floor",
            "smg/cache_aware",
            "smg/round_robin",
            "vllm-router/cache_aware",
            "vllm-router/kv_aware",
            "oracle"
        ],
        "{stdout}"
    );
    for arm in arms {
        let label = arm["arm"].as_str().unwrap();
        assert!(
            stdout.contains(&format!("| {label} | 30 |")),
            "{label}:\n{stdout}"
        );
        assert_eq!(arm["requests"], 30, "{label}: {arm}");
        assert_eq!(
            arm["ok"], 30,
            "{label}: every request streamed to the end: {arm}"
        );
        // Worker share comes from the workers' own `x-served-by`, whoever routed.
        assert_eq!(
            sum_of_counts(&arm["worker_requests"], "worker_requests"),
            30,
            "{label}: {arm}"
        );
        assert!(arm["prompt_tokens"].as_u64().unwrap() > 0, "{label}: {arm}");
        let utilisation = &arm["utilisation"];
        assert!(
            utilisation["readings"].as_u64().unwrap() > 0,
            "{label}: {arm}"
        );
        let busy = utilisation["busy"].as_f64().unwrap();
        assert!(busy > 0.0 && busy <= 1.0, "{label}: {arm}");
        let front = arm["front"].as_str();
        if label == "gate_floor" || label == "oracle" {
            assert!(front.is_none(), "{arm}");
            assert!(
                arm["reasons"].get("none").is_none(),
                "cachepick or the oracle decided: {arm}"
            );
        } else {
            assert!(front.unwrap().contains("--policy"), "{arm}");
            // No cachepick decision reached a worker: the front routed alone.
            assert_eq!(arm["reasons"]["none"], 30, "{label}: {arm}");
        }
    }
    // Round robin over 4 workers: 8, 8, 7, 7 requests, as the workers counted them.
    let rr = &arms[2];
    let share = rr["worker_share"].as_f64().unwrap();
    assert!(share < 1.1, "smg round_robin is not even: {rr}");
    // The conversations extend each other's prompts, so a cache-aware router finds prefixes: smg in the
    // text, vllm-router in the token ids it asks the workers to render.
    assert!(arms[1]["hit_rate"].as_f64().unwrap() > 0.0, "{}", arms[1]);
    let vllm_router = &arms[3];
    assert!(
        vllm_router["hit_rate"].as_f64().unwrap() > 0.0,
        "{vllm_router}"
    );
    let counters = vllm_router["front_counters"].to_string();
    assert!(counters.contains("prefix_hit"), "{vllm_router}");
    // kv_aware found prefixes too, from the events alone.
    let kv_aware = &arms[4];
    assert!(kv_aware["hit_rate"].as_f64().unwrap() > 0.0, "{kv_aware}");
}

#[test]
fn a_front_that_cannot_start_fails_the_replay_with_the_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("trace written");
    let out = dir.path().join("out");
    let (ok, stdout, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "none",
        "--front",
        "sh -c 'echo no such router >&2; exit 3' {workers} {port}",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok, "a missing row must fail the run:\n{stdout}\n{stderr}");
    let all = format!("{stdout}{stderr}");
    assert!(
        all.contains("exited") && all.contains("before it answered"),
        "{all}"
    );
    let (ok, _, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--front",
        "smg launch --worker-urls {workers}",
    ]);
    assert!(!ok && stderr.contains("{port}"), "{stderr}");
}

/// Kills the router it holds when the test ends, whichever way.
struct Router(std::process::Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port `p` with `p + 1` free too, for a two-worker fleet on `base_port: p`.
fn two_free_ports() -> u16 {
    for _ in 0..50 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = first.local_addr().expect("its address").port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free loopback ports in 50 tries");
}

/// `--front-url`: a router the operator already runs, started here before the replay and pointed at
/// the fixed ports the fleet will take; the replay drives it like any arm. Without fixed ports the
/// replay refuses, saying why.
#[test]
fn a_router_already_running_is_replayed_with_front_url() {
    let bin = peers::bin_dir();
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("tiny.jsonl");
    std::fs::write(&trace, tiny_trace()).expect("trace written");
    let out = dir.path().join("out");

    let (ok, _, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--front-url",
        "vllm-router=http://127.0.0.1:9",
    ]);
    assert!(!ok && stderr.contains("base_port"), "{stderr}");

    let base = two_free_ports();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let sim = dir.path().join("fleet.yaml");
    std::fs::write(
        &sim,
        format!(
            "engine: vllm\nworkers: 2\nbase_port: {base}\nmax_running: 16\ntime_scale: 0.125\n"
        ),
    )
    .expect("fleet config written");
    // vllm-router waits for its workers (checked every second here) before it listens: it starts
    // first, and the replay's readiness probe waits for it once the fleet is up.
    let log = std::fs::File::create(dir.path().join("vllm-router.log")).expect("log file");
    let router = Router(
        Command::new(bin.join("vllm-router"))
            .args(["--worker-urls"])
            .arg(format!("http://127.0.0.1:{base}"))
            .arg(format!("http://127.0.0.1:{}", base + 1))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--policy",
                "round_robin",
                "--worker-startup-check-interval",
                "1",
            ])
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
            .arg(metrics.to_string())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("vllm-router starts"),
    );
    let url = format!("vllm-router=http://127.0.0.1:{port}");
    let (ok, stdout, stderr) = replay_status(&[
        "--trace",
        trace.to_str().unwrap(),
        "--config",
        sim.to_str().unwrap(),
        "--policies",
        "none",
        "--front-url",
        &url,
        "--out",
        out.to_str().unwrap(),
    ]);
    let router_log =
        std::fs::read_to_string(dir.path().join("vllm-router.log")).unwrap_or_default();
    drop(router);
    assert!(ok, "{stdout}\n{stderr}\nvllm-router's log:\n{router_log}");
    let report = report(&out);
    let arms = report["policies"].as_array().expect("arms");
    // The router, then the oracle on a fleet of its own on the same fixed ports.
    assert_eq!(arms.len(), 2, "{report}");
    assert_eq!(arms[1]["arm"], "oracle", "{report}");
    let arm = &arms[0];
    assert_eq!(arm["arm"], "vllm-router", "{arm}");
    assert_eq!(arm["front"], format!("http://127.0.0.1:{port}"), "{arm}");
    assert!(stdout.contains("| vllm-router | 30 |"), "{stdout}");
    assert_eq!(arm["ok"], 30, "every request streamed to the end: {arm}");
    // The two workers on the fixed ports served all of it, as they counted it, evenly.
    let served = arm["worker_requests"].as_object().expect("worker_requests");
    assert_eq!(served.len(), 2, "{arm}");
    assert!(
        served
            .keys()
            .all(|worker| worker.ends_with(&format!(":{base}"))
                || worker.ends_with(&format!(":{}", base + 1))),
        "{arm}"
    );
    assert_eq!(
        sum_of_counts(&arm["worker_requests"], "worker_requests"),
        30
    );
    assert!(arm["worker_share"].as_f64().unwrap() < 1.1, "{arm}");
    assert_eq!(arm["reasons"]["none"], 30, "the front routed alone: {arm}");
}

//! `cachepick replay --clock virtual` through the real binary: the same seed gives the same report byte
//! for byte, every in-process arm runs (cachepick's pipeline with replicas and `replica_sync`, round
//! robin, the re-implemented peers, the oracle), and what the virtual clock cannot model is refused
//! by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn cachepick(args: &[&str]) -> Output {
    Command::new(cachepick_rig::cachepick_binary())
        .arg("replay")
        .args(args)
        .output()
        .expect("cachepick runs")
}

/// `cachepick replay --clock virtual` with `args`, written to `out`: its report.json, parsed, once the
/// run has succeeded.
fn virtual_report(args: &[&str], out: &Path) -> Value {
    let out_text = out.display().to_string();
    let mut all = vec!["--clock", "virtual"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--out", &out_text]);
    let output = cachepick(&all);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap()
}

/// A small burst cell: its first 80 requests, two seeds, every kind of arm.
fn virtual_replay(out: &Path, seed: &str) -> Vec<u8> {
    let out_text = out.display().to_string();
    let output = cachepick(&[
        "--clock",
        "virtual",
        "--scenario",
        "burst",
        "--limit",
        "80",
        "--seed",
        seed,
        "--seeds",
        "2",
        "--policies",
        "default,round_robin",
        "--replicas",
        "1,2",
        "--replica-sync",
        "--peer",
        "llm-d,dynamo",
        "--out",
        &out_text,
    ]);
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("simulated GPU-seconds per wall-second"),
        "{stdout}"
    );
    std::fs::read(out.join("report.json")).unwrap()
}

#[test]
fn the_same_seed_replays_to_the_same_bytes_and_every_arm_serves_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let first = virtual_replay(&dir.path().join("a"), "3");
    let again = virtual_replay(&dir.path().join("b"), "3");
    assert!(first == again, "the same seed gave two reports");
    let other = virtual_replay(&dir.path().join("c"), "4");
    assert!(first != other, "another seed changed nothing");

    let report: Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(report["clock"], "virtual");
    let arms: Vec<&str> = report["arms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|arm| arm["arm"].as_str().unwrap())
        .collect();
    assert_eq!(
        arms,
        [
            "default/x1",
            "default/x2",
            "default/x2/sync",
            "round_robin/x1",
            "round_robin/x2",
            "llm-d/sticky (re-impl)/x1",
            "llm-d/sticky (re-impl)/x2",
            "dynamo/kv (re-impl)/x1",
            "dynamo/kv (re-impl)/x2",
            "oracle",
        ]
    );
    let mut hit = std::collections::BTreeMap::new();
    for arm in report["arms"].as_array().unwrap() {
        let runs = arm["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{arm}");
        for run in runs {
            assert_eq!(run["requests"], 80, "{}", arm["arm"]);
            assert_eq!(
                run["served"], run["requests"],
                "{}: every request got its first token",
                arm["arm"]
            );
            assert!(run["simulated_s"].as_f64().unwrap() > 0.0);
        }
        assert_eq!(arm["ttft_p90_ms"]["seeds"], 2, "{}", arm["arm"]);
        hit.insert(
            arm["arm"].as_str().unwrap().to_owned(),
            arm["hit_rate"]["mean"].as_f64().unwrap(),
        );
    }
    // The burst's conversations share long prefixes in groups: routing by prefix finds more of them
    // cached than round robin does.
    assert!(hit["default/x1"] > hit["round_robin/x1"], "{hit:?}");
    let table = std::fs::read_to_string(dir.path().join("a/table.md")).unwrap();
    assert!(table.contains("| oracle |"), "{table}");
}

#[test]
fn what_the_virtual_clock_cannot_model_is_refused_by_name() {
    let output = cachepick(&[
        "--clock",
        "virtual",
        "--scenario",
        "burst",
        "--via",
        "envoy",
        "--front",
        "sleep 1",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    for flag in ["--front", "--via"] {
        assert!(stderr.contains(flag), "{flag} not named: {stderr}");
    }
    let output = cachepick(&["--clock", "virtual", "--scenario", "burst", "--seeds", "0"]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--seeds must be at least 1"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The default's and round robin's hit rates on the first `limit` requests of a synthetic scenario
/// (one seed, every request served), and the scenario's ceiling with an unlimited cache.
fn hit_rates(scenario: &str, limit: &str) -> (f64, f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let report = virtual_report(
        &[
            "--scenario",
            scenario,
            "--limit",
            limit,
            "--seeds",
            "1",
            "--policies",
            "default,round_robin",
            "--no-oracle",
        ],
        &dir.path().join(scenario),
    );
    assert_eq!(report["scenario"], scenario);
    let hit = |arm: &str| {
        let row = report["arms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["arm"] == arm)
            .unwrap_or_else(|| panic!("no {arm} arm: {report}"));
        let run = &row["runs"][0];
        assert_eq!(
            run["served"], run["requests"],
            "{arm}: every request served"
        );
        row["hit_rate"]["mean"].as_f64().unwrap()
    };
    let ceiling = report["unlimited_hit_rate"]["mean"].as_f64().unwrap();
    let (default, round_robin) = (hit("default"), hit("round_robin"));
    assert!(
        default <= ceiling + 1e-9,
        "default {default} above the ceiling {ceiling}"
    );
    (default, round_robin, ceiling)
}

/// The multi-turn chat workload: a conversation's rounds resend its whole context, so the router that
/// keeps a conversation on its worker finds most of each later round cached, and round robin, which
/// moves it every round, finds little; neither finds more than the workload's ceiling.
#[test]
fn chat_rounds_find_their_conversation_cached_where_the_router_keeps_it() {
    let (default, round_robin, ceiling) = hit_rates("chat", "150");
    assert!(
        default > 0.5 * ceiling && default > 2.0 * round_robin,
        "default {default}, round robin {round_robin}, ceiling {ceiling}"
    );
}

/// The long-document chat workload: most of its prefill is new wherever it goes, so its ceiling is
/// low, and what can hit — a follow-up's conversation — hits only where the conversation was served:
/// the default reaches most of the ceiling, round robin, which moves a follow-up three times in four,
/// well under it.
#[test]
fn document_follow_ups_find_their_conversation_where_the_router_kept_it() {
    let (default, round_robin, ceiling) = hit_rates("documents", "300");
    assert!(
        (0.15..0.5).contains(&ceiling),
        "a mostly cold workload, ceiling {ceiling}"
    );
    assert!(
        default > 0.8 * ceiling && default > 1.5 * round_robin,
        "default {default}, round robin {round_robin}, ceiling {ceiling}"
    );
}

/// `--regret`: every decision's predicted first token against the soonest worker's. The oracle routes
/// to the soonest, so its regret is zero; round robin ignores load and caches, so some of its decisions
/// cost time; the default's regret is split by the reasons it counted. Without the flag no run carries
/// it, and the wall-clock replay refuses it.
#[test]
fn regret_is_zero_for_the_oracle_and_counted_by_reason_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let report = virtual_report(
        &[
            "--scenario",
            "burst",
            "--limit",
            "80",
            "--seeds",
            "2",
            "--policies",
            "default,round_robin",
            "--regret",
        ],
        &dir.path().join("regret"),
    );
    let arm = |label: &str| -> Value {
        report["arms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|arm| arm["arm"].as_str().unwrap().starts_with(label))
            .unwrap_or_else(|| panic!("no {label} arm"))
            .clone()
    };
    for run in arm("oracle")["runs"].as_array().unwrap() {
        let all = &run["regret"]["all"];
        assert!(all.get("prediction_error_ms").is_none(), "{all}");
        assert_eq!(all["decisions"], 80, "{all}");
        assert_eq!(
            (all["mean_ms"].as_f64(), all["slower"].as_u64()),
            (Some(0.0), Some(0)),
            "{all}"
        );
    }
    let round_robin = arm("round_robin");
    assert!(
        round_robin["regret_ms"]["mean"].as_f64().unwrap() > 0.0,
        "{}",
        round_robin["regret_ms"]
    );
    for run in arm("default")["runs"].as_array().unwrap() {
        // cachepick's arms say what they believed, so their picture is measured too.
        let all = &run["regret"]["all"];
        assert!(
            all["prediction_abs_error_ms"].as_f64().unwrap() >= 0.0,
            "{all}"
        );
        assert!(all["credit_error_tokens"].is_f64(), "{all}");
        assert!(all["credit_error_at_admission_tokens"].is_f64(), "{all}");
        let by_reason = run["regret"]["by_reason"].as_object().unwrap();
        let counted: Vec<(&String, u64)> = by_reason
            .iter()
            .map(|(reason, regret)| (reason, regret["decisions"].as_u64().unwrap()))
            .collect();
        let reasons: Vec<(&String, u64)> = run["reasons"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(reason, count)| (reason, count.as_u64().unwrap()))
            .collect();
        assert_eq!(counted, reasons, "{run}");
    }

    let plain = virtual_report(
        &[
            "--scenario",
            "burst",
            "--limit",
            "40",
            "--seeds",
            "1",
            "--policies",
            "default",
        ],
        &dir.path().join("plain"),
    );
    let text = plain.to_string();
    assert!(!text.contains("regret"), "{text}");
    let output = cachepick(&["--scenario", "burst", "--regret"]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--regret needs --clock virtual"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `--join-at`: three arms per cachepick arm of several replicas, the same before the join, the
/// joining replica deciding nothing before it and its share after; a warm joiner starts from its
/// siblings' placements, so its first decisions after the join find more cached than a cold one's.
#[test]
fn a_replica_that_joins_decides_only_after_its_time_and_warm_starts_from_its_siblings() {
    let dir = tempfile::tempdir().unwrap();
    let report = virtual_report(
        &[
            "--scenario",
            "chat",
            "--load",
            "4",
            "--duration-scale",
            "0.5",
            "--seeds",
            "3",
            "--policies",
            "default",
            "--replicas",
            "4",
            "--replica-sync",
            "--join-at",
            "10",
            "--no-oracle",
        ],
        dir.path(),
    );
    let arms = report["arms"].as_array().unwrap();
    let labels: Vec<&str> = arms
        .iter()
        .map(|arm| arm["arm"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "default/x4/present",
            "default/x4/join",
            "default/x4/join+warm",
            "default/x4/sync/present",
            "default/x4/sync/join",
            "default/x4/sync/join+warm",
        ]
    );
    let windows = |arm: &Value, run: usize| arm["runs"][run]["joined"]["windows"].clone();
    let mut warm_ahead = 0;
    for run in 0..3 {
        let (present, cold, warm) = (
            windows(&arms[3], run),
            windows(&arms[4], run),
            windows(&arms[5], run),
        );
        // Nine windows over every request; before the join the joiner decided nothing, after it
        // its share.
        let requests: u64 = cold
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(requests, arms[4]["runs"][run]["requests"].as_u64().unwrap());
        assert!(cold[0]["joiner_hit_rate"].is_null(), "{}", cold[0]);
        assert!(!present[0]["joiner_hit_rate"].is_null(), "{}", present[0]);
        assert!(!cold[1]["joiner_hit_rate"].is_null(), "{}", cold[1]);
        // Cold and warm are the same run until the join.
        assert_eq!(cold[0], warm[0]);
        let first = |w: &Value| w[1]["joiner_hit_rate"].as_f64().unwrap();
        warm_ahead += usize::from(first(&warm) > first(&cold));
    }
    assert!(
        warm_ahead >= 2,
        "the warm joiner ahead on {warm_ahead} of 3 seeds"
    );
}

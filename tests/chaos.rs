//! The chaos run, short: the real `cachepick` binary as a child process behind a real Envoy 1.40, a
//! simulated fleet, steady traffic, and the whole fault schedule compressed into ~20 s — workers crash
//! and restart, their metrics hang and turn to garbage, the picker is SIGKILLed twice (once long
//! enough for Envoy's health check to mark it down), slowloris connections, slow and stalled bodies,
//! malformed clients.
//!
//! Asserted on counts and causality, never on timings: every good request the fleet could serve was
//! served; every failure has a cause; malformed clients were refused with a 4xx and a reason; the
//! picker's kills cost no good request (Envoy failed open: its counters show it did); slowloris
//! connections were closed by Envoy. A missing Envoy fails the test (`support/envoy.rs` provisions it).
//!
//! Run alone: `cargo build -p cachepick-cli && cargo test --test chaos`.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
}

use support::envoy;

use std::time::Duration;

use cachepick::envoy_config::BodyMode;
use cachepick_rig::chaos::classify::Cause;
use cachepick_rig::chaos::schedule::{Fault, Malformed};
use cachepick_rig::chaos::{ChaosOptions, Mode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_chaos_run_loses_no_request_a_live_worker_could_have_served() {
    short_chaos_run(BodyMode::Buffered).await;
}

/// The same run behind the streamed bootstrap (`cachepick envoy-config --mode streamed`), where Envoy
/// sends the body without waiting for cachepick's headers answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_chaos_run_loses_no_request_a_live_worker_could_have_served_streamed() {
    short_chaos_run(BodyMode::Streamed).await;
}

async fn short_chaos_run(body_mode: BodyMode) {
    let out = tempfile::tempdir().expect("a temporary directory");
    let mut options = ChaosOptions::new(
        Mode::Chaos,
        Duration::from_secs(20),
        8.0,
        cachepick_rig::cachepick_binary(),
    );
    options.body_mode = body_mode;
    options.envoy = Some(envoy::binary());
    options.out = out.path().to_owned();
    options.seed = 14;
    options.crowd.slowloris = 8;
    options.crowd.trickles = 3;
    options.crowd.stalled = 2;
    // Generous: a loaded 2-core machine runs a debug picker and Envoy beside the test.
    options.deadline = Duration::from_secs(20);
    let report = cachepick_rig::chaos::run(&options)
        .await
        .unwrap_or_else(|error| panic!("the chaos run could not run: {error}"));
    let table = &report.table;
    let good = &report.good;

    // Every fault was carried out, so the run tested what it claims.
    let failed: Vec<_> = report
        .schedule
        .iter()
        .filter(|fired| fired.error.is_some())
        .collect();
    assert!(
        failed.is_empty(),
        "faults not carried out: {failed:?}\n{table}"
    );
    assert_eq!(report.picker_starts, 3, "two kills, two restarts\n{table}");
    assert_eq!(report.timeline.picker_down.len(), 2, "{table}");
    assert!(
        report
            .timeline
            .picker_down
            .iter()
            .all(|spell| spell.to.is_some()),
        "the picker came back each time\n{table}"
    );
    assert_eq!(report.timeline.workers_down.len(), 3, "{table}");

    // Every good request a live worker could have served was served.
    assert_eq!(good.not_sent, 0, "{table}");
    assert!(
        good.sent >= 100,
        "enough traffic to mean something\n{table}"
    );
    assert_eq!(
        good.lost_servable,
        0,
        "lost requests a live worker could have served: {:#?}\n{table}",
        report
            .failures
            .iter()
            .filter(|failure| failure.servable)
            .collect::<Vec<_>>()
    );
    assert_eq!(good.served + good.failed, good.sent, "{table}");
    // Each failure has a cause, and it is one the fleet could not have avoided: the worker it was on
    // died with it in flight (generations are not retried once a worker has them).
    for failure in &report.failures {
        assert!(
            matches!(failure.cause, Cause::WorkerDied { .. } | Cause::NoWorkerUp),
            "{failure:?}\n{table}"
        );
    }
    // The slow bodies were counted with the good requests (served unless their worker died).
    assert!(
        report
            .failures
            .iter()
            .all(|failure| failure.kind != "trickle" || !failure.servable),
        "{table}"
    );

    // The picker's kills cost no good request: some were sent while it was down, Envoy failed open
    // (its own counters say so), and every one of them was served (or died with its worker).
    assert!(
        good.during_picker_down > 0,
        "no request was sent while the picker was down\n{table}"
    );
    let lost_while_down = report
        .failures
        .iter()
        .filter(|failure| {
            failure.servable
                && report
                    .timeline
                    .picker_down_during(failure.sent, failure.ended)
        })
        .count();
    assert_eq!(lost_while_down, 0, "{table}");
    let failed_open = report
        .envoy_counters
        .get("http.ingress_http.ext_proc.failure_mode_allowed")
        .copied()
        .unwrap_or(0);
    assert!(
        failed_open > 0,
        "Envoy never failed open, so the picker kills tested nothing: {:?}\n{table}",
        report.envoy_counters
    );

    // Malformed clients: every kind sent, each refused with a 4xx and a reason (the picker's header or
    // Envoy's details) whenever the picker was up; while it was down, still a 4xx, from the worker.
    let malformed_kinds = report
        .schedule
        .iter()
        .filter(|fired| matches!(fired.step.fault, Fault::Malformed { .. }))
        .count();
    assert_eq!(report.malformed.len(), malformed_kinds, "{table}");
    // One exception, Envoy's own: bytes that are not HTTP fail in Envoy's codec, and with the response
    // phase on (served-endpoint feedback) the codec's 400 goes through the ext_proc filter, which opens
    // its first stream then; with the picker killed, Envoy 1.40 closes that connection without the 400.
    // No request is lost by it (there was none), so a garbage client while the picker is down may see a
    // closed connection instead (RELIABILITY.md, "Hostile clients").
    // And one of the schedule's: an oversized body while the picker is down streams past the filter to
    // whichever worker Envoy's least-request picks; when that worker has just been killed, Envoy cannot
    // retry a body larger than its retry buffer and answers 503 with the connect failure. The worker,
    // not the request, was at fault; a live worker would have refused it with a 4xx.
    for outcome in &report.malformed {
        let closed_while_down = outcome.kind == Malformed::GarbageBytes
            && outcome.picker_down
            && outcome.status.is_none();
        let dead_worker_while_down = outcome.kind == Malformed::Oversized
            && outcome.picker_down
            && outcome.status == Some(503)
            && outcome.refused_by.contains("remote_connection_failure");
        assert!(
            closed_while_down
                || dead_worker_while_down
                || outcome
                    .status
                    .is_some_and(|status| (400..500).contains(&status)),
            "{outcome:?}\n{table}"
        );
    }
    assert!(
        report.malformed_unrefused().is_empty(),
        "{:?}\n{table}",
        report.malformed_unrefused()
    );
    assert!(
        report
            .malformed
            .iter()
            .any(|outcome| outcome.refused_by.starts_with("picker ")),
        "the picker refused none itself\n{table}"
    );

    // Slowloris: Envoy closed every connection (its request_headers_timeout), none held to the end.
    let slowloris: Vec<_> = report
        .slow
        .iter()
        .filter(|slow| slow.kind == "slowloris")
        .collect();
    assert_eq!(slowloris.len(), options.crowd.slowloris, "{table}");
    assert!(
        slowloris.iter().all(|slow| slow.closed_after.is_some()),
        "a slowloris connection outlived the run: {slowloris:?}\n{table}"
    );

    // The decisions were made, and the picker's memory was read.
    assert!(report.decision_latency.decisions > 0, "{table}");
    assert!(report.rss.samples.len() >= 5, "{table}");
    assert!(out.path().join("report.json").is_file());
}

//! The overhead bench (`cachepick overhead`) with a handful of requests per cell, against a real Envoy
//! 1.40: behaviour only, never timing. Every arm answers every size and mode (buffered, duplex,
//! streamed); only arm (d)'s requests reach the worker with cachepick's decision, and only arm (c′)'s
//! with the decision its server made in advance; the no-op server of arm (c) sees the messages its
//! mode sends, and nothing else decides for it. Envoy is provisioned (`envoy::binary()`), never
//! skipped.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
}

use support::envoy;

use cachepick::envoy_config::BodyMode;
use cachepick_rig::overhead::{Arm, OverheadOptions, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_arm_answers_every_size_and_mode_and_only_cachepicks_arm_decides() {
    let options = OverheadOptions {
        requests: 4,
        warmup: 1,
        batch: 2,
        envoy: Some(envoy::binary()),
        ..OverheadOptions::new()
    };
    let report = run(&options).await.expect("the bench runs");

    // (a) and (b) once per size, (c), (c′) and (d) per size and mode (buffered, duplex, streamed).
    assert_eq!(report.cells.len(), OverheadOptions::SIZES.len() * 11);
    for cell in &report.cells {
        assert_eq!(cell.requests, 4, "{cell:?}");
        assert_eq!(cell.ok, 4, "every request answered 200: {cell:?}");
        let expected = if cell.arm == Arm::Cachepick { 4 } else { 0 };
        assert_eq!(
            cell.decided, expected,
            "only cachepick's arm carries a decision: {cell:?}"
        );
        let expected = if cell.arm == Arm::Routing { 4 } else { 0 };
        assert_eq!(
            cell.routed_in_advance, expected,
            "only arm (c′) carries the decision made in advance: {cell:?}"
        );
        assert!(cell.latency_ms.p50 > 0.0 && cell.latency_ms.p99 >= cell.latency_ms.p50);
        assert_eq!(cell.mode.is_some(), cell.arm.has_mode(), "{cell:?}");
    }
    assert_eq!(
        report.comparisons.len(),
        OverheadOptions::SIZES.len() * 3,
        "one comparison per size and mode"
    );
    assert!(
        report
            .comparisons
            .iter()
            .all(|row| row.routing.is_some() && row.cachepick_minus_routing.is_some()),
        "every row splits d − c at (c′)"
    );

    // Per size: warm-up and measured requests, plus the one readiness probe that reached the server.
    let per_mode = (OverheadOptions::SIZES.len() * (4 + 1)) as u64;
    let buffered = report.noop_received.buffered;
    assert_eq!(buffered.streams, per_mode + 1, "{buffered:?}");
    assert_eq!(buffered.headers, buffered.streams, "{buffered:?}");
    assert_eq!(
        buffered.bodies, buffered.streams,
        "one buffered body message per request: {buffered:?}"
    );
    assert_eq!(buffered.trailers, 0, "{buffered:?}");
    assert_eq!(
        buffered.with_attributes, 0,
        "the generated filter asks for no attributes: {buffered:?}"
    );
    let duplex = report.noop_received.duplex;
    assert_eq!(duplex.streams, per_mode + 1, "{duplex:?}");
    assert_eq!(duplex.headers, duplex.streams, "{duplex:?}");
    assert!(
        duplex.bodies > duplex.streams,
        "a 200 KB body streams in more than one chunk: {duplex:?}"
    );
    assert_eq!(
        duplex.trailers, 0,
        "an HTTP/1.1 client sends no trailers: {duplex:?}"
    );

    // Arm (c′)'s server answers in cachepick's shape: the headers answer held in duplex and streamed
    // mode until the body is whole, which Envoy sends without waiting only because the generated
    // bootstraps ask it to; one stream per request in every mode, no trailers.
    let routing = report
        .routing_received
        .expect("the generated bootstrap has arm (c′)");
    for (mode, received) in [
        ("buffered", routing.buffered),
        ("duplex", routing.duplex),
        ("streamed", routing.streamed),
    ] {
        assert_eq!(received.streams, per_mode + 1, "{mode}: {received:?}");
        assert_eq!(received.headers, received.streams, "{mode}: {received:?}");
        assert!(received.bodies >= received.streams, "{mode}: {received:?}");
        assert_eq!(received.trailers, 0, "{mode}: {received:?}");
    }

    // Every arm's requests reached the one worker: measured, warm-up and the probes of every cell.
    assert!(report.worker_served >= (report.cells.len() as u64) * 5);
    let modes: Vec<String> = [BodyMode::Buffered, BodyMode::Duplex, BodyMode::Streamed]
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        report
            .comparisons
            .iter()
            .all(|row| modes.contains(&row.mode))
    );
}

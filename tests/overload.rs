//! Overload at the gRPC level, against the real server (`app::run` on loopback) with a real tonic
//! client: admission (queue, deadline, cancellation), the commit that never comes late, fail-open on a
//! panic, the global body budget, the stream deadline, the listener's stream and connection caps, and
//! explain's rate.
//!
//! Slow and panicking decisions are injected with the test-only `fault-injection` feature
//! (`x-fault-injection: sleep=<ms>` or `panic`); every test checks first that the build has it.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod picker;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{picker, sim_client};

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_response,
};
use http::{Method, StatusCode};
use tonic::transport::Endpoint;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use cachepick::protocol::SHED_METADATA;
use picker::{
    CHAT, DEADLINE, ExtProcStream, Harness, body, bounded, chat, common, duplex_headers, headers,
    http, immediate, metadata_destination, post_headers, refusal_of, route_of, set_headers,
    streamed_chunk, streamed_headers,
};
use sim_client::{metric, metric_sum};

use picker::{FAULT, require_fault_injection};

/// A buffered request to `/v1/chat/completions` whose decision carries `fault` (if any).
fn request(seed: u64, fault: Option<&str>) -> Vec<ProcessingRequest> {
    let extra: Vec<(&str, &str)> = fault.map(|fault| (FAULT, fault)).into_iter().collect();
    vec![
        headers("POST", CHAT, &extra, false, BodySendMode::Buffered, None),
        body(&chat(seed, 400), true),
    ]
}

/// Opens a stream and sends `messages` on it, without reading.
async fn send(harness: &Harness, messages: Vec<ProcessingRequest>) -> ExtProcStream {
    let mut stream = harness.open().await;
    for message in messages {
        stream.send(message).await;
    }
    stream
}

/// Reads the buffered headers response, then every response to the end: `Ok` with them when the
/// stream ended cleanly (answered), the status when it ended with a gRPC error (shed).
async fn outcome(stream: &mut ExtProcStream) -> Result<Vec<ProcessingResponse>, tonic::Status> {
    stream.next_headers_response().await;
    let mut responses = Vec::new();
    loop {
        match stream.next().await {
            Ok(Some(response)) => responses.push(response),
            Ok(None) => return Ok(responses),
            Err(status) => return Err(status),
        }
    }
}

fn shed_reason(status: &tonic::Status) -> &str {
    status
        .metadata()
        .get(SHED_METADATA)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
}

/// The picker's decision slots, from `/debug/snapshot`.
async fn slots(harness: &Harness) -> usize {
    let snapshot = harness.get_debug("/debug/snapshot").await.json();
    let slots = snapshot["admission"]["decision_slots"].as_u64().unwrap();
    usize::try_from(slots).unwrap()
}

/// Fills every decision slot with a decision that sleeps `ms`; the streams are returned, unread.
async fn fill_slots(harness: &Harness, ms: u64) -> Vec<ExtProcStream> {
    let slots = slots(harness).await;
    let mut held = Vec::new();
    for seed in 0..slots {
        let fault = format!("sleep={ms}");
        held.push(send(harness, request(1000 + seed as u64, Some(&fault))).await);
    }
    harness
        .wait_metrics("every decision slot taken", |text| {
            metric(text, "cachepick_decisions_in_flight", &[]) == slots as f64
        })
        .await;
    held
}

/// Whether the owner index credits anyone with the prompt of `request(seed, _)`.
async fn owned(harness: &Harness, seed: u64) -> bool {
    let reply = http(
        Method::POST,
        harness.metrics_listen,
        "/debug/explain",
        &[],
        chat(seed, 400),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    !reply.json()["prepared"]["owners"]
        .as_array()
        .expect("owners")
        .is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_closed_while_its_decision_waits_or_runs_commits_nothing() {
    require_fault_injection();
    let harness = Harness::start(
        2,
        "overload: {message_timeout: 10s, decision_deadline: 8s, explain_rate: 100}",
    )
    .await;
    let mut running = fill_slots(&harness, 1500).await;

    // A request that must wait for a slot, whose stream then closes.
    let waiting = send(&harness, request(7, None)).await;
    harness
        .wait_metrics("one decision queued", |text| {
            metric(text, "cachepick_decisions_queued", &[]) == 1.0
        })
        .await;
    drop(waiting);
    let text = harness
        .wait_metrics("the closed stream leaves the queue", |text| {
            metric(text, "cachepick_decisions_queued", &[]) == 0.0
                && metric(text, "cachepick_shed_total", &[("reason", "cancelled")]) == 1.0
        })
        .await;
    assert_eq!(
        metric(text.as_str(), "cachepick_decisions_in_flight", &[]),
        running.len() as f64
    );

    // A decision already running whose stream closes: it finishes, and is not committed.
    let cancelled = running.pop().unwrap();
    drop(cancelled);
    for mut stream in running {
        outcome(&mut stream).await.expect("a clean end");
    }
    harness
        .wait_metrics("the running decision is refused its commit", |text| {
            metric(
                text,
                "cachepick_commits_refused_total",
                &[("reason", "cancelled")],
            ) == 1.0
                && metric(text, "cachepick_decisions_in_flight", &[]) == 0.0
        })
        .await;
    let slots = slots(&harness).await as u64;
    let text = harness.metrics().await;
    assert_eq!(
        metric_sum(&text, "cachepick_decisions_total", &[]),
        (slots - 1) as f64,
        "only the answered decisions count"
    );
    assert_eq!(
        metric(
            &text,
            "cachepick_commits_refused_total",
            &[("reason", "deadline")]
        ),
        0.0
    );
    // Neither the queued request nor the cancelled decision left a prefix behind; the answered ones did.
    assert!(!owned(&harness, 7).await, "the queued request committed");
    assert!(
        !owned(&harness, 1000 + slots - 1).await,
        "the cancelled decision committed"
    );
    assert!(
        owned(&harness, 1000).await,
        "an answered decision did not commit"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_and_a_missed_deadline_are_shed_with_grpc_errors_and_never_commit() {
    require_fault_injection();
    let harness = Harness::start(
        2,
        "overload: {message_timeout: 600ms, decision_deadline: 400ms, max_queued_decisions: 1}",
    )
    .await;
    let started = Instant::now();
    let running = fill_slots(&harness, 1200).await;
    let mut queued = send(&harness, request(7, None)).await;
    harness
        .wait_metrics("one decision queued", |text| {
            metric(text, "cachepick_decisions_queued", &[]) == 1.0
        })
        .await;
    // The queue holds one: the next complete request is shed at once.
    let mut full = send(&harness, request(8, None)).await;
    let status = outcome(&mut full).await.expect_err("shed");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(shed_reason(&status), "queue_full");
    // The queued one is shed at its deadline, and so is every running decision: nobody waits for them.
    let status = outcome(&mut queued).await.expect_err("shed");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert_eq!(shed_reason(&status), "deadline");
    for mut stream in running {
        let status = outcome(&mut stream).await.expect_err("shed");
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    }
    assert!(
        started.elapsed() < Duration::from_millis(1200),
        "the sheds came before the slow decisions ended ({:?})",
        started.elapsed()
    );
    let slots = slots(&harness).await;
    // The slow decisions end later, after their deadline: each is refused its commit.
    let text = harness
        .wait_metrics("every late decision refused its commit", |text| {
            metric(
                text,
                "cachepick_commits_refused_total",
                &[("reason", "deadline")],
            ) == slots as f64
        })
        .await;
    assert_eq!(metric_sum(&text, "cachepick_decisions_total", &[]), 0.0);
    assert_eq!(
        metric(&text, "cachepick_shed_total", &[("reason", "deadline")]),
        (slots + 1) as f64
    );
    assert_eq!(
        metric(&text, "cachepick_shed_total", &[("reason", "queue_full")]),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "cachepick_extproc_streams_closed_total",
            &[("outcome", "shed")]
        ),
        (slots + 2) as f64
    );
    // Nothing reached the owner index.
    for seed in [7, 8, 1000] {
        assert!(!owned(&harness, seed).await, "request {seed} committed");
    }
    // Once the slots are free, the picker decides again.
    let mut stream = send(&harness, request(9, None)).await;
    outcome(&mut stream).await.expect("routed");
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_decision_fails_open_with_a_grpc_error_not_a_5xx() {
    require_fault_injection();
    let harness = Harness::start(2, "").await;
    let mut stream = send(&harness, request(1, Some("panic"))).await;
    let headers_response = stream.next_headers_response().await;
    assert!(immediate(&headers_response).is_none());
    let status = stream.next().await.expect_err("a gRPC error");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert_eq!(shed_reason(&status), "internal");
    let text = harness.metrics().await;
    assert_eq!(
        metric(&text, "cachepick_shed_total", &[("reason", "internal")]),
        1.0
    );
    assert_eq!(
        metric_sum(&text, "cachepick_refusals_total", &[("reason", "internal")]),
        0.0,
        "no refusal of cachepick's own"
    );
    // The slot came back: the next request is decided.
    let responses = harness.exchange(request(2, None)).await.clean();
    harness.assert_routed_to_a_worker(&route_of(responses.last().unwrap()));
    harness.stop().await;
}

/// A headers answer that continues the request without a destination: no header set, no metadata.
fn assert_no_destination(headers_response: &ProcessingResponse) {
    let mutation = common(headers_response)
        .and_then(|common| common.header_mutation.as_ref())
        .expect("a header mutation");
    assert!(set_headers(mutation).is_empty(), "{mutation:?}");
    assert!(metadata_destination(headers_response).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_global_budget_is_shed_and_the_budget_comes_back() {
    let harness = Harness::start(
        2,
        "max_body_bytes: 64KiB\noverload: {max_buffered_bytes: 100KiB}",
    )
    .await;
    let chunk = vec![b' '; 60 << 10];
    let mut first = send(
        &harness,
        vec![duplex_headers(CHAT, &[]), body(&chunk, false)],
    )
    .await;
    harness
        .wait_metrics("the first body held", |text| {
            metric(text, "cachepick_buffered_body_bytes", &[]) == (60 << 10) as f64
        })
        .await;

    // A buffered body that would take the streams together over 100 KiB: a gRPC error (Envoy still
    // holds a buffered body, so it fails open).
    let mut buffered = send(
        &harness,
        vec![post_headers(CHAT), body(&chat(4, 60 << 10), true)],
    )
    .await;
    let status = outcome(&mut buffered).await.expect_err("shed");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(shed_reason(&status), "body_budget");

    // A duplex body over the budget: Envoy no longer holds it, so it is handed back and the request
    // continues without a destination; the rest of it is echoed as it comes, never held.
    let mut duplex = send(
        &harness,
        vec![duplex_headers(CHAT, &[]), body(&chunk, false)],
    )
    .await;
    assert_no_destination(&duplex.next_headers_response().await);
    let echoed = duplex.next_response("the held chunk echoed").await;
    assert_eq!(streamed_chunk(&echoed).body.len(), 60 << 10);
    assert!(!streamed_chunk(&echoed).end_of_stream);
    duplex.send(body(b"{}", true)).await;
    let last = duplex.next_response("the last chunk echoed").await;
    assert_eq!(streamed_chunk(&last).body, b"{}");
    assert!(streamed_chunk(&last).end_of_stream);
    duplex.expect_clean_end().await;

    // A streamed body over the budget: Envoy holds the body but waits for cachepick's headers answer,
    // so the request continues without a destination, the held chunk and each later one let through
    // with a CONTINUE that carries no body.
    let mut streamed = send(&harness, vec![streamed_headers(CHAT), body(&chunk, false)]).await;
    assert_no_destination(&streamed.next_headers_response().await);
    for what in ["the held chunk let through", "the last chunk let through"] {
        if what == "the last chunk let through" {
            streamed.send(body(b"{}", true)).await;
        }
        let response = streamed.next_response(what).await;
        assert!(
            matches!(
                response.response,
                Some(processing_response::Response::RequestBody(_))
            ),
            "{what}: {response:?}"
        );
        assert!(
            common(&response).is_none_or(|common| common.body_mutation.is_none()),
            "{what}: Envoy holds the body; nothing is echoed: {response:?}"
        );
    }
    streamed.expect_clean_end().await;

    // The first goes on: its body ends and it is decided. 60 KiB of spaces before a JSON body is still
    // JSON: the request is routed.
    first.send(body(&chat(3, 400), true)).await;
    let response = first.next_response("the first is answered").await;
    assert!(immediate(&response).is_none(), "{response:?}");
    harness.assert_routed_to_a_worker(&route_of(&response));
    drop(first);
    harness
        .wait_metrics("the budget given back", |text| {
            metric(text, "cachepick_buffered_body_bytes", &[]) == 0.0
                && metric(text, "cachepick_shed_total", &[("reason", "body_budget")]) == 3.0
        })
        .await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_its_deadline_is_answered_408() {
    let harness = Harness::start(
        2,
        "overload: {message_timeout: 400ms, stream_deadline: 600ms}",
    )
    .await;
    let started = Instant::now();
    // Headers, then a body that never ends.
    let mut stream = send(&harness, vec![post_headers(CHAT)]).await;
    stream.next_headers_response().await;
    let response = stream.next_response("the 408").await;
    let refused = refusal_of(&response);
    assert_eq!(refused.status, 408, "{refused:?}");
    let message = refused.body["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("stream_deadline"), "{message}");
    assert!(started.elapsed() >= Duration::from_millis(550));
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_caps_streams_per_connection_and_connections() {
    // The harness's own channel is one connection; the test opens one more; a third waits while both
    // hold a stream.
    let harness = Harness::start(
        2,
        "overload: {max_concurrent_streams: 2, max_connections: 2}",
    )
    .await;
    let endpoint = Endpoint::from_shared(format!("http://{}", harness.listen)).unwrap();
    let second = bounded("a second connection", DEADLINE, endpoint.connect())
        .await
        .unwrap();
    let check = |channel: tonic::transport::Channel| async move {
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map(|_| ())
    };
    bounded("a health check", DEADLINE, check(second.clone()))
        .await
        .unwrap();
    assert_eq!(
        metric(&harness.metrics().await, "cachepick_grpc_connections", &[]),
        2.0
    );
    // A third connection while both hold a stream (a Process stream on the harness's, a health Watch
    // on the second) waits for a place: nothing idle can make room.
    let mut on_first = send(&harness, vec![post_headers(CHAT)]).await;
    on_first.next_headers_response().await;
    let mut watch = bounded(
        "a health Watch on the second connection",
        DEADLINE,
        HealthClient::new(second.clone()).watch(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .unwrap()
    .into_inner();
    bounded("the Watch's first status", DEADLINE, watch.message())
        .await
        .unwrap()
        .unwrap();
    let third = endpoint.connect_lazy();
    let waiting = tokio::spawn(check(third));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "a third connection was served while both held a stream"
    );
    // The Watch ends: the second connection holds no stream, and is closed to make room at once.
    drop(watch);
    bounded(
        "the third connection is served once one is idle",
        DEADLINE,
        waiting,
    )
    .await
    .unwrap()
    .unwrap();
    // The third's channel may have closed already (the check owned it): at most two are open.
    let text = harness.metrics().await;
    assert!(metric(&text, "cachepick_grpc_connections", &[]) <= 2.0);
    assert_eq!(
        metric(
            &text,
            "cachepick_grpc_connections_closed_total",
            &[("reason", "evicted")]
        ),
        1.0
    );
    drop(on_first);
    drop(second);

    // Two streams open on one connection: a third stream waits for one of them to end.
    let mut first = send(&harness, vec![post_headers(CHAT)]).await;
    first.next_headers_response().await;
    let mut second = send(&harness, vec![post_headers(CHAT)]).await;
    second.next_headers_response().await;
    let raw = harness.raw();
    let third = tokio::spawn(async move {
        let mut client = raw;
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        for message in request(5, None) {
            sender.send(message).await.unwrap();
        }
        let mut responses = client
            .process(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        let first = responses.message().await?;
        drop(sender);
        Ok::<_, tonic::Status>(first)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!third.is_finished(), "a third stream ran beside two");
    drop(first);
    let answered = bounded("the third stream runs once one ends", DEADLINE, third)
        .await
        .unwrap()
        .unwrap();
    assert!(answered.is_some());
    drop(second);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_over_its_rate_is_429_and_resource_exhausted() {
    let harness = Harness::start(2, "overload: {explain_rate: 1}").await;
    let explain = || {
        http(
            Method::POST,
            harness.metrics_listen,
            "/debug/explain",
            &[],
            chat(1, 100),
        )
    };
    assert_eq!(explain().await.status, StatusCode::OK);
    let refused = explain().await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.text()
    );
    assert_eq!(refused.json()["error"]["type"], "explain_refused");
    let channel = Endpoint::from_shared(format!("http://{}", harness.listen))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = cachepick::extproc::admin_api::admin_client::AdminClient::new(channel)
        .explain(cachepick::extproc::admin_api::ExplainRequest {
            path: CHAT.to_owned(),
            body: chat(1, 100),
            ..Default::default()
        })
        .await
        .expect_err("over the rate");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let text = harness.metrics().await;
    assert_eq!(
        metric(
            &text,
            "cachepick_explain_refused_total",
            &[("reason", "rate")]
        ),
        2.0
    );
    harness.stop().await;
}

//! cachepick's real gRPC interface, as Envoy 1.40 speaks it: a simulated vLLM fleet in process, cachepick
//! started through `app::run` on free loopback ports, and ext_proc `Process` streams driven with
//! cachepick's own client and by hand with envoy-types' generated client.
//!
//! Covered: readiness through gRPC health; BUFFERED routing with a synchronous commit (a miss then a hit
//! on the same worker, which then serves the request); the wire form of the answer (`raw_value`,
//! OVERWRITE_IF_EXISTS_OR_ADD, spoofed headers removed, `envoy.lb` metadata, a clean end of stream);
//! FULL_DUPLEX_STREAMED (a delayed headers response, the body echoed in bounded chunks); header-only
//! requests; refusals as JSON immediate responses (400, 404, 413, 503); the proxy's subset hint; a body
//! above tonic's default 4 MiB decode limit; the metrics and debug endpoints; and a client that goes
//! away mid-stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod picker;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{picker, sim_client};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use http::{Method, StatusCode};
use serde_json::json;

use cachepick::extproc::{DECISION_HEADER, DESTINATION, MAX_STREAMED_CHUNK, PREFIX_TOKENS_HEADER};
use cachepick_rig::client::Verdict;
use picker::{
    CHAT, COMPLETIONS, DEADLINE, Harness, MODEL, Refused, Route, body, bounded, chat, common,
    duplex_headers, find_header, headers, http, is_body_response, is_headers_response,
    metadata_destination, post_headers, refusal_of, route_of, set_headers, streamed_chunk,
    subset_list, subset_string,
};
use sim_client::{metric, metric_sum};

const POOL: &str = MODEL;

/// Asks through cachepick's own client and expects a route.
async fn decide(client: &cachepick_rig::client::Client, path: &str, body: &[u8]) -> Route {
    let verdict = bounded("a decision", DEADLINE, client.decide(path, body))
        .await
        .expect("the ext_proc stream works");
    match verdict {
        Verdict::Route {
            endpoints,
            reason,
            prefix_tokens,
        } => Route {
            endpoints,
            reason,
            prefix_tokens,
        },
        Verdict::Refuse {
            status,
            reason,
            body,
        } => panic!(
            "expected a route, got {status} {reason}: {}",
            String::from_utf8_lossy(&body)
        ),
    }
}

/// Sends a BUFFERED request (headers, then the whole body) by hand and returns the one answer, after
/// checking the protocol around it: a headers response first (unless the answer is an immediate
/// response to the body), exactly one answer, and a clean end of the stream.
async fn buffered(
    harness: &Harness,
    path: &str,
    payload: &[u8],
    metadata: Option<envoy_types::pb::envoy::config::core::v3::Metadata>,
) -> ProcessingResponse {
    let responses = harness
        .exchange(vec![
            headers("POST", path, &[], false, BodySendMode::Buffered, metadata),
            body(payload, true),
        ])
        .await
        .clean();
    assert_eq!(
        responses.len(),
        2,
        "a headers response, then one answer: {responses:?}"
    );
    assert!(is_headers_response(&responses[0]), "{:?}", responses[0]);
    responses.into_iter().nth(1).unwrap()
}

/// The refusal a BUFFERED body gets; checks the JSON error shape and the headers.
async fn refused(harness: &Harness, path: &str, payload: &[u8]) -> Refused {
    checked_refusal(&buffered(harness, path, payload, None).await)
}

/// The refusal `answer` carries, after [`check_refusal`].
fn checked_refusal(answer: &ProcessingResponse) -> Refused {
    let refused = refusal_of(answer);
    check_refusal(&refused);
    refused
}

fn check_refusal(refused: &Refused) {
    assert_eq!(refused.content_type, "application/json", "{refused:?}");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .is_some_and(|message| !message.is_empty()),
        "{refused:?}"
    );
    assert_eq!(
        refused.body["error"]["type"].as_str(),
        Some(refused.reason.as_str()),
        "the JSON type is the reject reason: {refused:?}"
    );
    assert_ne!(refused.status, 500, "bad input is never a 500: {refused:?}");
}

/// `cachepick_extproc_streams_closed_total{outcome}` in a `/metrics` text.
fn closed(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        "cachepick_extproc_streams_closed_total",
        &[("outcome", outcome)],
    )
}

// === 1. BUFFERED through cachepick's client: a miss, then a hit that the worker serves from cache ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_a_hit_on_the_worker_that_then_serves_it_from_cache() {
    let harness = Harness::start(3, "").await;
    let client = harness.client().await;
    let endpoints = harness.endpoints();
    let prompt = chat(1, 8000);

    let first = decide(&client, CHAT, &prompt).await;
    let chosen = first.endpoints[0];
    assert!(
        endpoints.contains(&chosen),
        "{first:?} not in {endpoints:?}"
    );
    assert_eq!(first.reason, "cache_miss", "{first:?}");
    assert_eq!(first.prefix_tokens, 0, "{first:?}");
    for fallback in &first.endpoints[1..] {
        assert!(endpoints.contains(fallback), "{first:?}");
        assert_ne!(*fallback, chosen, "{first:?}");
    }

    // The worker serves it with the picker's headers.
    let reason = first.reason.clone();
    let reply = serve(&harness, &first, &prompt).await;
    assert_eq!(
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(
        reply.header(&format!("x-sim-echo-{DECISION_HEADER}")),
        Some(reason.as_str())
    );

    // The picker committed synchronously: the same body at once is a hit on the same worker.
    let second = decide(&client, CHAT, &prompt).await;
    assert_eq!(second.endpoints[0], chosen, "{second:?} after {first:?}");
    assert_eq!(second.reason, "cache_hit", "{second:?}");
    assert!(second.prefix_tokens > 0, "{second:?}");
    assert_eq!(second.prefix_tokens % 16, 0, "whole blocks: {second:?}");

    // And the worker indeed holds the prefix the picker credited it with.
    let reply = serve(&harness, &second, &prompt).await;
    let usage = &reply.json()["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0, "the hit was not served from cache: {usage}");
    assert!(
        second.prefix_tokens <= prompt_tokens,
        "credited {} of a {prompt_tokens}-token prompt",
        second.prefix_tokens
    );
    assert!(
        second.prefix_tokens.abs_diff(cached) <= 16,
        "the picker credits {} tokens, the worker served {cached} from cache",
        second.prefix_tokens
    );

    harness.stop().await;
}

/// Sends `payload` to the route's first endpoint with the headers Envoy would forward, expects a 200
/// served by that worker, and returns the reply.
async fn serve(harness: &Harness, route: &Route, payload: &[u8]) -> picker::Reply {
    let destination = route.destination();
    let prefix = route.prefix_tokens.to_string();
    let target = route.endpoints[0];
    assert!(harness.endpoints().contains(&target));
    let reply = http(
        Method::POST,
        target,
        CHAT,
        &[
            ("content-type", "application/json"),
            (DESTINATION, &destination),
            (DECISION_HEADER, &route.reason),
            (PREFIX_TOKENS_HEADER, &prefix),
        ],
        payload.to_vec(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(
        reply.header("x-served-by"),
        Some(target.to_string().as_str()),
        "{:?}",
        reply.headers
    );
    assert_eq!(
        reply.header(&format!("x-sim-echo-{DESTINATION}")),
        Some(destination.as_str())
    );
    reply
}

// === 2. the wire form of a BUFFERED answer ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_answer_overwrites_spoofed_headers_with_raw_values_and_metadata() {
    let harness = Harness::start(2, "").await;
    let spoofed = [
        (DESTINATION, "10.9.9.9:1"),
        (DECISION_HEADER, "cache_hit"),
        ("x-cachepick-foo", "bar"),
    ];
    let mut stream = harness.open().await;
    stream
        .send(headers(
            "POST",
            CHAT,
            &spoofed,
            false,
            BodySendMode::Buffered,
            None,
        ))
        .await;
    let first = stream.next_headers_response().await;
    let mutation = common(&first)
        .and_then(|common| common.header_mutation.clone())
        .expect("the headers response strips the client's copies");
    let mut removed = mutation.remove_headers.clone();
    removed.sort();
    assert_eq!(
        removed,
        vec![DECISION_HEADER, "x-cachepick-foo", DESTINATION],
        "{mutation:?}"
    );
    assert!(mutation.set_headers.is_empty(), "{mutation:?}");
    assert!(first.dynamic_metadata.is_none(), "{first:?}");

    stream.send(body(&chat(2, 300), true)).await;
    let answer = stream.next_response("an answer").await;
    assert!(is_body_response(&answer), "{answer:?}");
    let common = common(&answer).expect("a common response");
    assert_eq!(common.status, 0, "CONTINUE");
    assert!(common.body_mutation.is_none(), "{common:?}");
    let mutation = common.header_mutation.as_ref().expect("a header mutation");
    for header in set_headers(mutation) {
        assert!(
            header.value.is_empty(),
            "`value` must stay empty: {header:?}"
        );
        assert!(!header.raw_value.is_empty(), "{header:?}");
        assert_eq!(
            header.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            "{header:?}"
        );
    }
    let destination = find_header(mutation, DESTINATION).raw();
    let first_endpoint: SocketAddr = destination.split(',').next().unwrap().parse().unwrap();
    assert!(
        harness.endpoints().contains(&first_endpoint),
        "{destination}"
    );
    assert!(!destination.contains("10.9.9.9"), "{destination}");
    assert_eq!(find_header(mutation, DECISION_HEADER).raw(), "cache_miss");
    assert_eq!(find_header(mutation, PREFIX_TOKENS_HEADER).raw(), "0");
    // The headers cachepick sets overwrite the client's copies; the rest are removed.
    assert_eq!(
        mutation.remove_headers,
        vec!["x-cachepick-foo"],
        "{mutation:?}"
    );
    assert_eq!(
        metadata_destination(&answer).as_deref(),
        Some(destination.as_str()),
        "envoy.lb metadata: {:?}",
        answer.dynamic_metadata
    );

    // The answer is the last message: the server ends the stream cleanly.
    stream.expect_clean_end().await;
    harness.stop().await;
}

// === 3. FULL_DUPLEX_STREAMED ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_answers_in_the_delayed_headers_response_and_echoes_the_body_in_chunks() {
    let harness = Harness::start(2, "").await;
    let payload = chat(3, 150_000);
    assert!(payload.len() > 150_000);
    let mut stream = harness.open().await;
    stream
        .send(duplex_headers(CHAT, &[(DESTINATION, "10.9.9.9:1")]))
        .await;
    let third = payload.len() / 3;
    stream.send(body(&payload[..third], false)).await;
    stream.send(body(&payload[third..2 * third], false)).await;
    // Nothing is answered before the end of the body.
    let early = tokio::time::timeout(Duration::from_millis(200), stream.next()).await;
    assert!(early.is_err(), "answered before the body ended: {early:?}");
    stream.send(body(&payload[2 * third..], true)).await;
    // A proxy may repeat the end of the stream; the answer is already decided.
    stream.send(body(&[], true)).await;

    let responses = stream.read_to_end().await.clean();
    let (head, chunks) = responses.split_first().expect("responses");
    assert!(
        is_headers_response(head),
        "the headers response comes first: {head:?}"
    );
    let route = route_of(head);
    harness.assert_routed_to_a_worker(&route);
    assert_eq!(route.reason, "cache_miss");
    assert_eq!(metadata_destination(head), Some(route.destination()));
    let mutation = common(head).unwrap().header_mutation.as_ref().unwrap();
    assert!(
        mutation.remove_headers.is_empty(),
        "the destination is overwritten, not removed: {mutation:?}"
    );

    let mut echoed = Vec::new();
    let mut ends = Vec::new();
    for response in chunks {
        assert!(is_body_response(response), "{response:?}");
        let streamed = streamed_chunk(response);
        assert!(!streamed.body.is_empty(), "an empty chunk mid-body");
        assert!(
            streamed.body.len() <= MAX_STREAMED_CHUNK && streamed.body.len() <= 62_000,
            "a chunk of {} bytes",
            streamed.body.len()
        );
        echoed.extend_from_slice(&streamed.body);
        ends.push(streamed.end_of_stream);
    }
    assert_eq!(chunks.len(), payload.len().div_ceil(62_000), "{ends:?}");
    assert!(
        echoed == payload,
        "the echoed body differs from the sent one"
    );
    let last = ends.pop().unwrap();
    assert!(last, "the last chunk ends the body");
    assert!(
        ends.iter().all(|end| !end),
        "only the last chunk ends the body"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_refusals_are_immediate_responses() {
    let harness = Harness::start(2, "max_body_bytes: 64KiB").await;
    // Malformed JSON, decided at the end of the body.
    let exchanged = harness
        .exchange(vec![
            duplex_headers(CHAT, &[]),
            body(b"{\"model\": ", false),
            body(b"oops", true),
        ])
        .await
        .clean();
    assert_eq!(exchanged.len(), 1, "{exchanged:?}");
    let refused = checked_refusal(&exchanged[0]);
    assert_eq!(refused.status, 400, "{refused:?}");

    // Too large: refused at the chunk that crosses the limit, before the end of the body.
    let mut stream = harness.open().await;
    stream.send(duplex_headers(CHAT, &[])).await;
    let spaces = vec![b' '; 40 << 10];
    stream.send(body(&spaces, false)).await;
    stream.send(body(&spaces, false)).await;
    let refused = checked_refusal(&stream.next_response("an answer").await);
    assert_eq!(refused.status, 413, "{refused:?}");
    assert_eq!(refused.reason, "too_large");
    stream.expect_clean_end().await;
    harness.stop().await;
}

// === 3b. requests whose body ends with trailers ===

/// Envoy, BUFFERED, a request with trailers (HTTP/1.1 chunked trailers, HTTP/2 trailers): when the
/// trailers arrive Envoy sends the buffered body with `end_of_stream: false` (ext_proc.cc `onTrailers`,
/// "Sending data left over in the buffer": `setupBodyChunk(state, *state.bufferedData(), false)`), and
/// with the recommended `request_trailer_mode: SKIP` nothing follows it. In BUFFERED mode that one body
/// message is the whole body, so it must carry the decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_sent_before_trailers_is_decided() {
    let harness = Harness::start(2, "").await;
    let payload = chat(20, 2000);
    let mut stream = harness.open().await;
    stream.send(post_headers(CHAT)).await;
    stream.next_headers_response().await;
    stream.send(body(&payload, false)).await;
    let answer = stream.next_response("an answer").await;
    assert!(is_body_response(&answer), "{answer:?}");
    let has_destination = common(&answer)
        .and_then(|common| common.header_mutation.as_ref())
        .is_some_and(|mutation| {
            mutation
                .set_headers
                .iter()
                .any(|option| option.header.as_ref().is_some_and(|h| h.key == DESTINATION))
        });
    assert!(
        has_destination,
        "the whole BUFFERED body arrived (end_of_stream false because trailers follow) but the body \
         response carries no destination, so Envoy routes the request undecided: {answer:?}"
    );
    let route = route_of(&answer);
    harness.assert_routed_to_a_worker(&route);
    assert!(metadata_destination(&answer).is_some(), "{answer:?}");
    harness.stop().await;
}

/// FULL_DUPLEX_STREAMED, a request with trailers: the proto (processing_mode.proto, FULL_DUPLEX_STREAMED)
/// says "Sending the trailers (if present) is to inform the server that the complete body has arrived"
/// and "The server response has to maintain the headers-body-trailers ordering". So the trailers end
/// the body: the decision goes in the (delayed) headers response, then the body chunks, then the
/// trailers response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_with_trailers_decides_when_the_trailers_arrive() {
    let harness = Harness::start(2, "").await;
    let payload = chat(21, 100_000);
    let mut stream = harness.open().await;
    stream.send(duplex_headers(CHAT, &[])).await;
    let half = payload.len() / 2;
    stream.send(body(&payload[..half], false)).await;
    stream.send(body(&payload[half..], false)).await;
    stream.send(picker::trailers(&[("x-trailer", "1")])).await;
    let (responses, end) = stream.read_until_quiet(Duration::from_secs(2)).await;
    let kinds: Vec<&str> = responses
        .iter()
        .map(|response| {
            if is_headers_response(response) {
                "headers"
            } else if is_body_response(response) {
                "body"
            } else if picker::is_trailers_response(response) {
                "trailers"
            } else {
                "other"
            }
        })
        .collect();
    let expected_bodies = payload.len().div_ceil(MAX_STREAMED_CHUNK);
    let mut expected = vec!["headers"];
    expected.extend(std::iter::repeat_n("body", expected_bodies));
    expected.push("trailers");
    assert_eq!(
        kinds, expected,
        "headers-body-trailers ordering, decided at the trailers (stream end: {end:?})"
    );
    let route = route_of(&responses[0]);
    harness.assert_routed_to_a_worker(&route);
    let mut echoed = Vec::new();
    for response in &responses[1..=expected_bodies] {
        echoed.extend_from_slice(&streamed_chunk(response).body);
    }
    assert!(
        echoed == payload,
        "the echoed body differs from the sent one"
    );
    harness.stop().await;
}

// === 3c. many streams at once ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_are_all_answered() {
    let harness = Harness::start(3, "").await;
    let clients = [harness.client().await, harness.client().await];
    let endpoints = harness.endpoints();
    let mut tasks = tokio::task::JoinSet::new();
    const STREAMS: usize = 200;
    for index in 0..STREAMS {
        let client = clients[index % clients.len()].clone();
        tasks.spawn(async move {
            let payload = chat(1000 + index as u64, 600);
            decide(&client, CHAT, &payload).await
        });
    }
    let started = Instant::now();
    let mut routed = 0;
    while let Some(route) = bounded("the concurrent decisions", DEADLINE, tasks.join_next()).await {
        let route = route.expect("the task did not panic");
        assert!(endpoints.contains(&route.endpoints[0]), "{route:?}");
        routed += 1;
    }
    assert_eq!(routed, STREAMS);
    eprintln!("{STREAMS} concurrent decisions in {:?}", started.elapsed());
    let text = harness.wait_streams_closed("every stream closed").await;
    let decisions = metric_sum(&text, "cachepick_decisions_total", &[]);
    assert_eq!(decisions, STREAMS as f64);
    assert_eq!(closed(&text, "answered"), STREAMS as f64);
    harness.stop().await;
}

// === 4. header-only requests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_only_request_is_routed_in_the_headers_response() {
    let harness = Harness::start(2, "").await;
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let responses = harness
            .exchange(vec![headers(
                "GET",
                "/v1/models",
                &[(DESTINATION, "10.9.9.9:1")],
                true,
                mode,
                None,
            )])
            .await
            .clean();
        assert_eq!(responses.len(), 1, "{mode:?}: {responses:?}");
        assert!(is_headers_response(&responses[0]), "{responses:?}");
        let route = route_of(&responses[0]);
        harness.assert_routed_to_a_worker(&route);
        assert_eq!(route.prefix_tokens, 0);
        assert_eq!(
            metadata_destination(&responses[0]),
            Some(route.destination())
        );
        // The worker answers the GET it is sent to.
        let reply = http(
            Method::GET,
            route.endpoints[0],
            "/v1/models",
            &[],
            Vec::new(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.json()["data"][0]["id"], MODEL);
    }
    harness.stop().await;
}

// === 5. refusals ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_json_immediate_responses() {
    let harness = Harness::start(2, "max_body_bytes: 64KiB").await;
    assert_eq!(harness.max_body_bytes, 64 << 10);

    let malformed = refused(
        &harness,
        CHAT,
        b"{\"model\": \"sim-model\", \"messages\": [",
    )
    .await;
    assert_eq!(
        (malformed.status, malformed.reason.as_str()),
        (400, "invalid_json")
    );

    let unknown = serde_json::to_vec(&json!({
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "hello"}],
    }))
    .unwrap();
    let unknown = refused(&harness, CHAT, &unknown).await;
    assert_eq!(
        (unknown.status, unknown.reason.as_str()),
        (404, "unknown_model")
    );

    let large = refused(&harness, CHAT, &chat(5, 70 << 10)).await;
    assert_eq!(large.status, 413, "{large:?}");
    assert!(
        large.reason == "body_too_large" || large.reason == "too_large",
        "{large:?}"
    );

    // Other bad bodies: never a 500, never a transport error.
    for bad in [
        b"".as_slice(),
        b"[]",
        b"\xff\xfe",
        b"{\"model\": \"sim-model\"}",
        b"{\"model\": \"sim-model\", \"messages\": 3}",
        b"{\"model\": 7, \"prompt\": \"x\"}",
    ] {
        let refused = checked_refusal(&buffered(&harness, CHAT, bad, None).await);
        assert_eq!(
            refused.status,
            400,
            "{:?}: {refused:?}",
            String::from_utf8_lossy(bad)
        );
    }
    harness.stop().await;
}

// === 6. the proxy's subset hint ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_the_choice() {
    let harness = Harness::start(3, "").await;
    let endpoints = harness.endpoints();
    let b = endpoints[1];

    for seed in 0..6 {
        let answer = buffered(
            &harness,
            CHAT,
            &chat(100 + seed, 2000),
            Some(subset_string(&b.to_string())),
        )
        .await;
        let route = route_of(&answer);
        assert_eq!(route.endpoints, vec![b], "seed {seed}: {route:?}");
    }

    // A prefix held by one worker still goes where the proxy allows.
    let prompt = chat(200, 8000);
    let owner = route_of(&buffered(&harness, CHAT, &prompt, None).await).endpoints[0];
    let again = route_of(&buffered(&harness, CHAT, &prompt, None).await);
    assert_eq!(
        (again.endpoints[0], again.reason.as_str()),
        (owner, "cache_hit")
    );
    let other = *endpoints
        .iter()
        .find(|endpoint| **endpoint != owner)
        .unwrap();
    let hinted = route_of(
        &buffered(
            &harness,
            CHAT,
            &prompt,
            Some(subset_string(&other.to_string())),
        )
        .await,
    );
    assert_eq!(hinted.endpoints, vec![other], "{hinted:?}");
    assert_ne!(hinted.reason, "cache_hit", "{hinted:?}");

    // The list form, and a comma-separated string; unknown entries are ignored.
    let (a, c) = (endpoints[0], endpoints[2]);
    for metadata in [
        subset_list(&[a.to_string(), c.to_string()]),
        subset_string(&format!("{a}, {c}, 10.9.9.9:1, not-an-address")),
    ] {
        for seed in 0..4 {
            let route = route_of(
                &buffered(
                    &harness,
                    CHAT,
                    &chat(300 + seed, 500),
                    Some(metadata.clone()),
                )
                .await,
            );
            assert!(
                route
                    .endpoints
                    .iter()
                    .all(|endpoint| [a, c].contains(endpoint)),
                "{route:?} outside {a}, {c}"
            );
            assert!(!route.endpoints.is_empty());
        }
    }

    // Only endpoints the pool does not know (a gateway whose discovery is ahead of cachepick's): by
    // default 503 no_workers, as the Endpoint Picker Protocol requires when no endpoint of the hint is
    // eligible; counted apart.
    for metadata in unknown_hints().into_iter().map(|(metadata, _)| metadata) {
        let answer = buffered(&harness, CHAT, &chat(400, 500), Some(metadata.clone())).await;
        let refused = checked_refusal(&answer);
        assert_eq!(
            (refused.status, refused.reason.as_str()),
            (503, "no_workers"),
            "{metadata:?}: {refused:?}"
        );
    }
    let text = harness.metrics().await;
    assert_eq!(
        metric(&text, "cachepick_unknown_subset_total", &[]),
        2.0,
        "{text}"
    );

    // No endpoint at all in the hint: 503, never a worker outside it.
    for metadata in [subset_string("garbage"), subset_string("")] {
        let answer = buffered(&harness, CHAT, &chat(400, 500), Some(metadata.clone())).await;
        let refused = checked_refusal(&answer);
        assert_eq!(
            (refused.status, refused.reason.as_str()),
            (503, "no_workers"),
            "{metadata:?}: {refused:?}"
        );
    }
    harness.stop().await;
}

/// Hints naming only endpoints no pool knows, each with the endpoints it allows.
fn unknown_hints() -> Vec<(Metadata, Vec<SocketAddr>)> {
    vec![
        (
            subset_string("10.9.9.9:1,10.9.9.8:2"),
            vec!["10.9.9.9:1".parse().unwrap(), "10.9.9.8:2".parse().unwrap()],
        ),
        (
            subset_list(&["10.9.9.9:1".to_owned()]),
            vec!["10.9.9.9:1".parse().unwrap()],
        ),
    ]
}

/// `unknown_subset: route_within`, for a gateway known to list pods before cachepick's discovery:
/// such a hint is routed within itself blind, as a miss, never outside it; a hint with no endpoint at
/// all is still a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_within_sends_an_unknown_hint_within_itself() {
    let harness = Harness::start(2, "unknown_subset: route_within").await;
    for (metadata, allowed) in unknown_hints() {
        let route = route_of(&buffered(&harness, CHAT, &chat(400, 500), Some(metadata)).await);
        assert!(!route.endpoints.is_empty());
        assert!(
            route.endpoints.iter().all(|e| allowed.contains(e)),
            "{route:?} outside {allowed:?}"
        );
        assert_eq!(route.reason, "cache_miss", "{route:?}");
    }
    let answer = buffered(
        &harness,
        CHAT,
        &chat(401, 500),
        Some(subset_string("garbage")),
    )
    .await;
    assert_eq!(refusal_of(&answer).status, 503);
    let text = harness.metrics().await;
    assert_eq!(
        metric(&text, "cachepick_unknown_subset_total", &[]),
        2.0,
        "{text}"
    );
    harness.stop().await;
}

// === 7. bodies above tonic's default decode limit ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_above_four_mebibytes_is_routed() {
    let harness = Harness::start(2, "max_body_bytes: 8MiB").await;
    assert_eq!(harness.max_body_bytes, 8 << 20);
    let client = harness.client().await;
    let prompt = picker::text(7, 5 << 20);
    let payload =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1})).unwrap();
    assert!(payload.len() > 5 << 20);
    let started = Instant::now();
    let verdict = bounded(
        "a 5 MiB decision",
        Duration::from_secs(30),
        client.decide(COMPLETIONS, &payload),
    )
    .await
    .expect("the stream carries a 5 MiB body");
    let Verdict::Route { endpoints, .. } = &verdict else {
        panic!("expected a route, got {verdict:?}");
    };
    assert!(harness.endpoints().contains(&endpoints[0]), "{verdict:?}");
    eprintln!("5 MiB body decided in {:?}", started.elapsed());

    // Just above max_body_bytes: still a 413 answer, not a transport error.
    let prompt = picker::text(8, (8 << 20) + 1024);
    let payload = serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt})).unwrap();
    let verdict = bounded(
        "an 8 MiB refusal",
        Duration::from_secs(30),
        client.decide(COMPLETIONS, &payload),
    )
    .await
    .expect("the stream carries a body just above max_body_bytes");
    let Verdict::Refuse { status, .. } = verdict else {
        panic!("expected a refusal, got {verdict:?}");
    };
    assert_eq!(status, 413);
    harness.stop().await;
}

// === 8. metrics and the debug endpoints ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_decisions_refusals_and_streams_and_explain_does_not_commit() {
    let harness = Harness::start(3, "max_body_bytes: 64KiB").await;
    let client = harness.client().await;
    let prompt = chat(9, 8000);
    let miss = decide(&client, CHAT, &prompt).await;
    let hit = decide(&client, CHAT, &prompt).await;
    assert_eq!(
        (miss.reason.as_str(), hit.reason.as_str()),
        ("cache_miss", "cache_hit")
    );
    refused(&harness, CHAT, b"{").await;
    refused(
        &harness,
        CHAT,
        br#"{"model": "nope", "messages": [{"role": "user", "content": "x"}]}"#,
    )
    .await;
    refused(&harness, CHAT, &chat(10, 70 << 10)).await;
    let unknown = buffered(
        &harness,
        CHAT,
        &chat(11, 100),
        Some(subset_string("garbage")),
    )
    .await;
    assert_eq!(refusal_of(&unknown).status, 503);

    let text = harness.wait_streams_closed("every stream closed").await;
    let value = |name: &str, labels: &[(&str, &str)]| metric(&text, name, labels);
    for reason in ["cache_hit", "cache_miss"] {
        assert_eq!(
            value(
                "cachepick_decisions_total",
                &[("pool", POOL), ("reason", reason)]
            ),
            1.0,
            "{reason}"
        );
    }
    for reason in ["invalid_json", "unknown_model"] {
        assert_eq!(
            value(
                "cachepick_refusals_total",
                &[("pool", "none"), ("reason", reason)]
            ),
            1.0,
            "{reason}"
        );
    }
    let too_large: f64 = sim_client::prom_samples(&text)
        .iter()
        .filter(|sample| {
            sample.name == "cachepick_refusals_total"
                && matches!(sample.label("reason"), Some("body_too_large" | "too_large"))
        })
        .map(|sample| sample.value)
        .sum();
    assert_eq!(too_large, 1.0, "{text}");
    assert_eq!(
        value(
            "cachepick_refusals_total",
            &[("pool", POOL), ("reason", "no_workers")]
        ),
        1.0
    );
    assert_eq!(
        value("cachepick_decision_seconds_count", &[("pool", POOL)]),
        3.0
    );
    assert_eq!(value("cachepick_extproc_streams_opened_total", &[]), 6.0);
    assert_eq!(closed(&text, "answered"), 6.0);
    assert_eq!(closed(&text, "error"), 0.0);
    assert!(
        value("cachepick_index_entries", &[("pool", POOL)]) > 0.0,
        "{text}"
    );
    assert!(
        value("cachepick_index_blocks", &[("pool", POOL)]) > 0.0,
        "{text}"
    );

    // The snapshot lists every worker, fresh.
    let snapshot = harness.get_debug("/debug/snapshot").await;
    assert_eq!(snapshot.status, StatusCode::OK, "{}", snapshot.text());
    let pools = snapshot.json();
    assert_eq!(pools["pools"][0]["pool"], POOL, "{pools}");
    let listed: Vec<String> = pools["pools"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|worker| worker["endpoint"].as_str().unwrap().to_owned())
        .collect();
    let expected: Vec<String> = harness
        .endpoints()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(listed, expected);

    // Explain reads the live index (the committed prompt is a hit) and commits nothing.
    let explain = |payload: Vec<u8>| {
        http(
            Method::POST,
            harness.metrics_listen,
            "/debug/explain?path=/v1/chat/completions",
            &[("content-type", "application/json")],
            payload,
        )
    };
    let known = explain(prompt.clone()).await;
    assert_eq!(known.status, StatusCode::OK, "{}", known.text());
    let known = known.json();
    assert_eq!(known["outcome"]["reason"], "cache_hit", "{known}");
    assert!(known["outcome"]["trace"].is_object(), "{known}");
    let selected = known["outcome"]["selected"].clone();
    let endpoint = &known["endpoints"][selected.as_u64().unwrap_or(u64::MAX) as usize];
    assert_eq!(
        endpoint.as_str(),
        Some(hit.endpoints[0].to_string().as_str()),
        "{known}"
    );
    let fresh = chat(12, 8000);
    for _ in 0..2 {
        let reply = explain(fresh.clone()).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.json()["outcome"]["reason"], "cache_miss");
    }
    let bad = explain(b"{".to_vec()).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text());
    let after = harness.metrics().await;
    for reason in ["cache_hit", "cache_miss"] {
        assert_eq!(
            metric(
                &after,
                "cachepick_decisions_total",
                &[("pool", POOL), ("reason", reason)]
            ),
            1.0,
            "explain counted a decision"
        );
    }
    assert_eq!(
        metric(&after, "cachepick_extproc_streams_opened_total", &[]),
        6.0
    );
    // Explaining twice did not make the fresh prompt a hit.
    let routed = decide(&client, CHAT, &fresh).await;
    assert_eq!(routed.reason, "cache_miss", "explain committed: {routed:?}");
    harness.stop().await;
}

// === 9. a client that goes away ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_mid_request_counts_as_reset_and_the_picker_keeps_serving() {
    let harness = Harness::start(2, "").await;

    // Reset: the client drops the whole call after its headers were answered.
    let mut stream = harness.open().await;
    stream.send(post_headers(CHAT)).await;
    stream.next_headers_response().await;
    drop(stream);
    let text = harness
        .wait_streams_closed("the dropped stream closes")
        .await;
    assert_eq!(
        closed(&text, "reset"),
        1.0,
        "a client reset is counted as reset"
    );
    assert_eq!(closed(&text, "error"), 0.0);

    // Half-close: the client's side ends without a body; the server ends its side cleanly.
    let mut stream = harness.open().await;
    stream.send(post_headers(CHAT)).await;
    stream.next_headers_response().await;
    stream.close_send();
    stream.expect_clean_end().await;
    let text = harness
        .wait_metrics("the half-closed stream closes", |text| {
            metric(text, "cachepick_extproc_streams_active", &[]) == 0.0
                && metric(text, "cachepick_extproc_streams_opened_total", &[]) == 2.0
        })
        .await;
    assert_eq!(closed(&text, "reset"), 2.0);
    assert_eq!(
        metric(&text, "cachepick_decision_seconds_count", &[("pool", POOL)]),
        0.0,
        "no decision for an abandoned request"
    );

    // Still serving.
    let client = harness.client().await;
    let route = decide(&client, CHAT, &chat(13, 500)).await;
    harness.assert_routed_to_a_worker(&route);
    assert_eq!(
        harness.health(cachepick::extproc::READINESS).await,
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    harness.stop().await;
}

/// A proxy resets a stream with whatever reason its own failure carries, not only CANCEL: here hyper's
/// INTERNAL_ERROR, sent when a request body fails (a connection's GOAWAY and a broken pipe are the same
/// event to the picker). Each is the proxy going away, counted as `reset`; a message that does not
/// decode is the stream's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_proxy_resets_with_any_reason_counts_as_reset() {
    use http_body_util::BodyExt;
    use prost::Message;

    let harness = Harness::start(2, "").await;
    let (frames, response) = raw_process(harness.listen, &post_headers(CHAT).encode_to_vec()).await;
    // The headers' answer arrives: the stream is open at the picker, waiting for the body.
    let mut body = response.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the headers' answer")
        .expect("a frame")
        .expect("not an error");
    assert!(first.data_ref().is_some_and(|data| !data.is_empty()));
    frames
        .send(Err(std::io::Error::other("the proxy's client went away")))
        .await
        .unwrap();
    let text = harness.wait_streams_closed("the reset stream closes").await;
    assert_eq!(closed(&text, "reset"), 1.0, "a reset is counted as reset");
    assert_eq!(
        closed(&text, "error"),
        0.0,
        "a reset is not the stream's error"
    );

    // The control: a message that is not a ProcessingRequest.
    let (_frames, _response) = raw_process(harness.listen, &[0xff, 0xff, 0xff]).await;
    let text = harness
        .wait_metrics("the undecodable stream closes", |text| {
            closed(text, "error") + closed(text, "reset") == 2.0
        })
        .await;
    assert_eq!(closed(&text, "error"), 1.0, "{text}");

    let client = harness.client().await;
    let route = decide(&client, CHAT, &chat(13, 500)).await;
    harness.assert_routed_to_a_worker(&route);
    harness.stop().await;
}

type RawFrames =
    tokio::sync::mpsc::Sender<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>;

/// Opens a `Process` call on its own HTTP/2 connection, as a proxy would, and sends `message` (protobuf
/// bytes) as its first gRPC message; the sender sends the rest of the body, or fails it.
async fn raw_process(
    listen: SocketAddr,
    message: &[u8],
) -> (RawFrames, http::Response<hyper::body::Incoming>) {
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(connection);
    let (frames, receiver) = tokio::sync::mpsc::channel(4);
    let request = http::Request::post(format!(
        "http://{listen}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(receiver),
    ))
    .unwrap();
    // A gRPC message: uncompressed, its length, the bytes.
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    frames.send(Ok(Frame::data(framed.into()))).await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    (frames, response)
}

// === 0. start-up ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_becomes_ready_after_its_first_scrape_round_and_stops_cleanly() {
    let harness = Harness::start(2, "").await;
    // The generated config scrapes every 200 ms; the first round runs at start.
    assert!(
        harness.ready_after < Duration::from_secs(5),
        "ready after {:?}",
        harness.ready_after
    );
    let text = harness.metrics().await;
    for endpoint in harness.endpoints() {
        let worker = endpoint.to_string();
        assert!(
            metric(
                &text,
                "cachepick_scrapes_total",
                &[("pool", POOL), ("worker", &worker), ("outcome", "ok")]
            ) >= 1.0,
            "{text}"
        );
    }
    harness.stop().await;
}

// === requests without a prompt, and prompts the tokenizer cannot take ===

/// A GET and a POST to a non-generation API are passthroughs: routed by load, labelled `passthrough`,
/// counted apart from decisions and never in the owner index; a generation path without a body is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_prompt_pass_through_and_are_not_decisions() {
    let harness = Harness::start(2, "").await;
    let get = harness
        .exchange(vec![headers(
            "GET",
            "/v1/models",
            &[],
            true,
            BodySendMode::Buffered,
            None,
        )])
        .await
        .clean();
    assert_eq!(route_of(&get[0]).reason, "passthrough");
    let embeddings = buffered(
        &harness,
        "/v1/embeddings",
        br#"{"model": "sim-model", "input": ["a", "b"]}"#,
        None,
    )
    .await;
    let route = route_of(&embeddings);
    assert_eq!(route.reason, "passthrough");
    harness.assert_routed_to_a_worker(&route);
    // A model no pool serves is still a 404, even for another API.
    let unknown = refused(
        &harness,
        "/v1/embeddings",
        br#"{"model": "nope", "input": "a"}"#,
    )
    .await;
    assert_eq!(
        (unknown.status, unknown.reason.as_str()),
        (404, "unknown_model")
    );
    // A generation path with no body at all.
    let empty = harness
        .exchange(vec![headers(
            "POST",
            CHAT,
            &[],
            true,
            BodySendMode::Buffered,
            None,
        )])
        .await
        .clean();
    let missing = checked_refusal(&empty[0]);
    assert_eq!(
        (missing.status, missing.reason.as_str()),
        (400, "missing_body")
    );

    let text = harness.metrics().await;
    let pool = [("pool", POOL)];
    assert_eq!(
        metric(&text, "cachepick_passthrough_total", &pool),
        2.0,
        "{text}"
    );
    let decisions: f64 = cachepick::policy::Reason::ALL
        .iter()
        .map(|reason| {
            metric(
                &text,
                "cachepick_decisions_total",
                &[("pool", POOL), ("reason", reason.as_str())],
            )
        })
        .sum();
    assert_eq!(decisions, 0.0, "passthroughs are not decisions: {text}");
    assert_eq!(
        metric(&text, "cachepick_index_entries", &pool),
        0.0,
        "{text}"
    );
    harness.stop().await;
}

/// A prompt the tokenizer fails on is routed without prefix information, never refused with a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_the_tokenizer_fails_on_is_routed_as_a_miss() {
    // The bytes tokenizer cannot fail. o200k's regex backtracking gave up on a megabyte of spaces; now
    // the run is tokenized in cut windows (a run that long is never one piece), and is a miss all the
    // same: routed by load, never refused. A debug build takes seconds over the windows, so the
    // deadline is generous: this is about the outcome, not the time.
    let tiktoken = Harness::start_with_tokenizer(
        2,
        "overload: {message_timeout: 10s}",
        cachepick_sim::config::TokenizerConfig::default(),
    )
    .await;
    let prompt = format!("hello{}world", " ".repeat(1_000_000));
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let answer = buffered(&tiktoken, COMPLETIONS, body.as_bytes(), None).await;
    let route = route_of(&answer);
    assert_eq!(route.reason, "cache_miss");
    assert_eq!(route.prefix_tokens, 0);
    tiktoken.stop().await;
}

/// `debug_endpoints: false` turns off /debug/* and the gRPC admin API; /metrics stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_endpoints_can_be_turned_off() {
    let harness = Harness::start(2, "debug_endpoints: false").await;
    let snapshot = harness.get_debug("/debug/snapshot").await;
    assert_eq!(snapshot.status, StatusCode::NOT_FOUND);
    assert!(harness.metrics().await.contains("cachepick_build_info"));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", harness.listen))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = cachepick::extproc::admin_api::admin_client::AdminClient::new(channel)
        .snapshot(cachepick::extproc::admin_api::SnapshotRequest::default())
        .await
        .expect_err("the admin API is off");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    harness.stop().await;
}

/// A compressed body is read once decoded (and learned, so its repeat is a hit); one that cannot be
/// decoded is routed by load, never refused; both are counted by encoding and outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_bodies_are_decoded_or_routed_by_load() {
    use std::io::Write;

    let harness = Harness::start(2, "").await;
    let compressed = |path: &str, encoding: &str, payload: &[u8]| {
        let harness = &harness;
        let path = path.to_owned();
        let encoding = encoding.to_owned();
        let payload = payload.to_vec();
        async move {
            let responses = harness
                .exchange(vec![
                    headers(
                        "POST",
                        &path,
                        &[("content-encoding", &encoding)],
                        false,
                        BodySendMode::Buffered,
                        None,
                    ),
                    body(&payload, true),
                ])
                .await
                .clean();
            route_of(&responses[1])
        }
    };
    let prompt = "a compressed conversation ".repeat(200);
    let json = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gzip.write_all(json.as_bytes()).unwrap();
    let gzip = gzip.finish().unwrap();
    let first = compressed(COMPLETIONS, "gzip", &gzip).await;
    assert_eq!(first.reason, "cache_miss", "{first:?}");
    assert!(first.prefix_tokens == 0);
    let again = compressed(COMPLETIONS, "gzip", &gzip).await;
    assert_eq!(
        (again.reason.as_str(), again.endpoints.first()),
        ("cache_hit", first.endpoints.first()),
        "the decoded prompt was learned"
    );
    // Not what it claims to be, and a coding nobody decodes: routed by load, never a 400.
    for (encoding, payload) in [("br", &b"not brotli"[..]), ("compress", json.as_bytes())] {
        let route = compressed(COMPLETIONS, encoding, payload).await;
        assert_eq!(route.reason, "passthrough", "{encoding}");
        harness.assert_routed_to_a_worker(&route);
    }
    let text = harness.metrics().await;
    let count = |encoding, outcome| {
        metric(
            &text,
            "cachepick_compressed_bodies_total",
            &[("encoding", encoding), ("outcome", outcome)],
        )
    };
    assert_eq!(count("gzip", "decoded"), 2.0, "{text}");
    assert_eq!(count("br", "corrupt"), 1.0, "{text}");
    assert_eq!(count("other", "unsupported"), 1.0, "{text}");
    harness.stop().await;
}

/// Only a generation request is learned from: a prompt-shaped body on another path (vLLM's
/// `/tokenize`, a gateway's own path) is routed by load and leaves the owner index untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_shaped_bodies_on_other_paths_are_not_learned() {
    let harness = Harness::start(2, "").await;
    let prompt = "a prompt sent to the tokenizer endpoint ".repeat(100);
    let payload = json!({"model": MODEL, "prompt": prompt}).to_string();
    for path in ["/tokenize", "/v1/custom", "/"] {
        let answer = buffered(&harness, path, payload.as_bytes(), None).await;
        let route = route_of(&answer);
        assert_eq!(route.reason, "passthrough", "{path}");
        harness.assert_routed_to_a_worker(&route);
    }
    let text = harness.metrics().await;
    assert_eq!(
        metric(&text, "cachepick_index_entries", &[("pool", POOL)]),
        0.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "cachepick_segment_cache_bytes", &[("pool", POOL)]),
        0.0,
        "a passthrough is not even tokenized: {text}"
    );
    // The same prompt as a completion is a first sighting, not a hit.
    let completion = buffered(&harness, COMPLETIONS, payload.as_bytes(), None).await;
    assert_eq!(route_of(&completion).reason, "cache_miss");
    let text = harness.metrics().await;
    // Its tokens (4 bytes each) and its text are cached.
    let cached = metric(&text, "cachepick_segment_cache_bytes", &[("pool", POOL)]);
    assert!(
        cached >= prompt.len() as f64,
        "{cached} bytes for a {}-byte prompt",
        prompt.len()
    );
    harness.stop().await;
}

//! The debug bearer token and the bounds of the HTTP listener, against a real cachepick (`app::run`)
//! in front of a simulated fleet, over real sockets.
//!
//! - `debug_token_file` guards `/debug/*` and the admin gRPC API (401 / UNAUTHENTICATED without the
//!   token), never `/metrics` or ext_proc.
//! - Slowloris on `metrics_listen` (more connections than `metrics_http.max_connections`, each
//!   trickling its headers) does not stop ext_proc: decisions keep being answered while every slot is
//!   held; each connection over the cap takes the place of the one waiting longest for its headers,
//!   which is closed at once; the slow ones left are closed by
//!   `header_read_timeout` although they keep sending; `/metrics` answers again after them.
//! - A body trickled to `/debug/explain` is cut by `request_timeout` with a 408.
//!
//! Everything asserted is a count or an order of events, never a duration measured against a bound
//! tighter than the configured timeouts with seconds to spare.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod picker;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{picker, sim_client};

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use cachepick::extproc::admin_api::SnapshotRequest;
use cachepick::extproc::admin_api::admin_client::AdminClient;
use cachepick_rig::client::Verdict;
use picker::{CHAT, COMPLETIONS, DEADLINE, Harness, MODEL, bounded, http};
use sim_client::metric;

const TOKEN: &str = "s3cret-debug-token-0123456789";

fn chat_body(seed: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": picker::text(seed, 2048)}],
        "max_tokens": 4,
    }))
    .unwrap()
}

async fn admin_snapshot(
    harness: &Harness,
    authorization: Option<&str>,
) -> Result<(), tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", harness.listen))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut request = tonic::Request::new(SnapshotRequest::default());
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", value.parse().unwrap());
    }
    bounded(
        "an admin snapshot",
        DEADLINE,
        AdminClient::new(channel).snapshot(request),
    )
    .await
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debug_token_guards_debug_and_the_admin_api_but_not_metrics_or_ext_proc() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("debug-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let harness = Harness::start(2, &format!("debug_token_file: {}", token_file.display())).await;
    let bearer = format!("Bearer {TOKEN}");

    // /debug/*: 401 with a Bearer challenge without the token or with a wrong one, 200 with it.
    let refused = harness.get_debug("/debug/snapshot").await;
    assert_eq!(
        refused.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        refused.text()
    );
    assert_eq!(refused.header("www-authenticate"), Some("Bearer"));
    assert_eq!(refused.json()["error"]["type"], "unauthorized");
    let wrong = http(
        Method::POST,
        harness.metrics_listen,
        &format!("/debug/explain?path={COMPLETIONS}"),
        &[("authorization", "Bearer not-the-token-at-all")],
        chat_body(1),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    let admitted = http(
        Method::GET,
        harness.metrics_listen,
        "/debug/snapshot",
        &[("authorization", &bearer)],
        Vec::new(),
    )
    .await;
    assert_eq!(admitted.status, StatusCode::OK, "{}", admitted.text());
    let explained = http(
        Method::POST,
        harness.metrics_listen,
        "/debug/explain",
        &[("authorization", &bearer)],
        chat_body(2),
    )
    .await;
    assert_eq!(explained.status, StatusCode::OK, "{}", explained.text());

    // The admin gRPC API: UNAUTHENTICATED without the token, served with it.
    let status = admin_snapshot(&harness, None).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status}");
    let status = admin_snapshot(&harness, Some("Bearer wrong-token-0123456789"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status}");
    admin_snapshot(&harness, Some(&bearer)).await.unwrap();

    // ext_proc and /metrics need no token.
    let verdict = harness
        .client()
        .await
        .decide(CHAT, &chat_body(3))
        .await
        .unwrap();
    assert!(matches!(verdict, Verdict::Route { .. }), "{verdict:?}");
    let text = harness.metrics().await;
    assert_eq!(
        metric(
            &text,
            "cachepick_debug_unauthorized_total",
            &[("listener", "http")]
        ),
        2.0
    );
    assert_eq!(
        metric(
            &text,
            "cachepick_debug_unauthorized_total",
            &[("listener", "grpc")]
        ),
        2.0
    );
    harness.stop().await;
}

/// Opens a connection to `harness`'s metrics listener and sends the start of a request whose headers
/// never end.
async fn slow_client(harness: &Harness) -> TcpStream {
    let mut stream = TcpStream::connect(harness.metrics_listen).await.unwrap();
    // The server may already have closed a connection over the cap: a failed write is fine.
    let _ = stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: cachepick\r\n")
        .await;
    stream
}

/// Returns when the server has closed `stream`, whatever it sent before.
async fn closed(stream: &mut TcpStream) {
    let mut buffer = [0_u8; 256];
    while let Ok(read) = stream.read(&mut buffer).await {
        if read == 0 {
            return;
        }
    }
}

/// Keeps trickling header bytes on `stream` until the server closes it; returns when it did.
async fn trickle_until_closed(mut stream: TcpStream) {
    let mut buffer = [0_u8; 256];
    loop {
        if stream.write_all(b"X-Slow: a\r\n").await.is_err() {
            return;
        }
        // Anything read before the close (none is expected) is skipped; the end is what counts.
        let read = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_on_the_metrics_listener_does_not_stop_ext_proc() {
    const CAP: usize = 16;
    const OVER: usize = 24;
    let harness = Harness::start(
        2,
        &format!(
            "metrics_http: {{max_connections: {CAP}, header_read_timeout: 8s, request_timeout: 10s}}"
        ),
    )
    .await;
    // No request to metrics_listen before the attack: every slot is the slow clients'.
    let client = harness.client().await;

    // Every slot taken by a client that never finishes its headers, then more of them: each one over the
    // cap takes the place of the one that has waited longest, which is closed at once. Each newcomer
    // waits for that close: a burst faster than evicted connections close meets the bound on closing
    // ones (at most the cap, so descriptors stay under twice it) and is refused at the cap, which a
    // loaded machine showed (8 of 24 refused when the evicted connections' tasks had not yet run).
    let started = Instant::now();
    let mut slow = std::collections::VecDeque::new();
    for _ in 0..CAP {
        slow.push_back(slow_client(&harness).await);
    }
    for newcomer in 0..OVER {
        slow.push_back(slow_client(&harness).await);
        let mut oldest = slow.pop_front().expect("CAP connections wait");
        bounded(
            "the connection waiting longest is closed for the newcomer",
            DEADLINE,
            closed(&mut oldest),
        )
        .await;
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "newcomer {newcomer}: the evictions took longer than the header timeout allows ({:?})",
            started.elapsed()
        );
    }
    let trickling: Vec<_> = slow
        .into_iter()
        .map(|stream| tokio::spawn(trickle_until_closed(stream)))
        .collect();

    // ext_proc answers throughout: its listener and the runtime are untouched by the HTTP listener.
    for seed in 0..20 {
        let verdict = client
            .decide_within(CHAT, &chat_body(100 + seed), DEADLINE)
            .await
            .unwrap_or_else(|error| panic!("decision {seed} during the attack: {error}"));
        assert!(matches!(verdict, Verdict::Route { .. }), "{verdict:?}");
    }
    assert!(
        harness.health(cachepick::extproc::READINESS).await
            == tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    // Every slow client is closed by the server although it keeps sending: the oldest ones as newcomers
    // took their places, the others by header_read_timeout (headers must be whole by then, however they
    // trickle).
    for task in trickling {
        bounded("the slow connection is closed", DEADLINE, task)
            .await
            .unwrap();
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(8),
        "the slow clients held their slots until the header timeout ({took:?})"
    );

    // /metrics answers again, and the counts say what happened.
    let text = harness.metrics().await;
    assert_eq!(
        metric(
            &text,
            "cachepick_metrics_http_refused_total",
            &[("reason", "evicted")]
        ),
        OVER as f64,
        "each connection over the cap took an older one's place"
    );
    assert_eq!(
        metric(
            &text,
            "cachepick_metrics_http_refused_total",
            &[("reason", "connection_cap")]
        ),
        0.0,
        "none was refused: there was always a connection waiting for its headers to close"
    );
    assert_eq!(
        metric(
            &text,
            "cachepick_metrics_http_refused_total",
            &[("reason", "header_timeout")]
        ),
        CAP as f64
    );
    // The one connection open now is this scrape's.
    assert_eq!(
        metric(&text, "cachepick_metrics_http_connections", &[]),
        1.0
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_explain_body_is_cut_by_the_request_timeout() {
    let harness = Harness::start(
        2,
        "metrics_http: {header_read_timeout: 5s, request_timeout: 1s, connection_lifetime: 1m}",
    )
    .await;
    let mut stream = TcpStream::connect(harness.metrics_listen).await.unwrap();
    stream
        .write_all(
            b"POST /debug/explain HTTP/1.1\r\nHost: cachepick\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = async {
        let mut buffer = [0_u8; 1024];
        loop {
            // One byte every 100 ms: the 1000-byte body would take 100 s.
            let _ = stream.write_all(b" ").await;
            match tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buffer)).await {
                Ok(Ok(0) | Err(_)) => return,
                Ok(Ok(read)) => answer.extend_from_slice(&buffer[..read]),
                Err(_) => {}
            }
        }
    };
    bounded("the trickled request is answered", DEADLINE, read).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408 "),
        "expected a 408, got {answer:?}"
    );
    assert!(answer.contains("request_timeout"), "{answer}");
    let text = harness.metrics().await;
    assert_eq!(
        metric(
            &text,
            "cachepick_metrics_http_refused_total",
            &[("reason", "request_timeout")]
        ),
        1.0
    );
    harness.stop().await;
}

//! A simulated worker's restart as a scraper sees it: `process_start_time_seconds` (Python's process
//! collector, which both engines expose) moves forward across `POST /admin/crash` with a restart, even
//! within the same second, and the engine's counters start again from zero, as a restarted engine's
//! do. Over real sockets; every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};

const WAIT: Duration = Duration::from_secs(5);

/// One HTTP/1.1 exchange, or `None` when the worker is down.
async fn exchange(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response.split(' ').nth(1)?.parse().ok()?;
        let (_, body) = response.split_once("\r\n\r\n")?;
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(WAIT, attempt).await.ok().flatten()
}

async fn metrics(addr: SocketAddr) -> String {
    let (status, body) = exchange(addr, "GET", "/metrics", "")
        .await
        .expect("/metrics answers");
    assert_eq!(status, 200, "{body}");
    body
}

/// The sum of every sample of family `name` (0 when absent).
fn total(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .map(|line| line.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum()
}

fn start_time(text: &str) -> f64 {
    let samples: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("process_start_time_seconds"))
        .collect();
    assert_eq!(samples.len(), 1, "one unlabelled series: {samples:?}");
    assert!(
        text.contains("# TYPE process_start_time_seconds gauge\n"),
        "typed as a gauge"
    );
    samples[0]
        .strip_prefix("process_start_time_seconds ")
        .unwrap()
        .parse()
        .unwrap()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test]
async fn a_restart_moves_the_start_time_forward_and_zeroes_the_counters() {
    for (engine, counters) in [
        (
            Engine::Vllm,
            [
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:request_success_total",
            ],
        ),
        (
            Engine::Sglang,
            [
                "sglang:prompt_tokens_total",
                "sglang:generation_tokens_total",
                "sglang:num_requests_total",
            ],
        ),
    ] {
        let mut config = SimConfig::new(engine, NonZeroU32::new(1).unwrap());
        config.tokenizer = TokenizerConfig::Bytes;
        config.params.time_scale = 0.01;
        let fleet = tokio::time::timeout(WAIT, Fleet::start(&config))
            .await
            .unwrap()
            .unwrap();
        let addr = fleet.worker(0).unwrap().addr();

        let before = now();
        let first = metrics(addr).await;
        let started = start_time(&first);
        assert!(
            started > 1e9 && started <= before + 1.0,
            "{engine:?}: a wall-clock start time, got {started}"
        );

        let body =
            serde_json::json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}).to_string();
        let (status, answer) = exchange(addr, "POST", "/v1/completions", &body)
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
        let served = metrics(addr).await;
        for counter in counters {
            assert!(
                total(&served, counter) > 0.0,
                "{engine:?}: {counter} counted the request"
            );
        }
        assert_eq!(
            start_time(&served),
            started,
            "{engine:?}: no restart, same start"
        );

        // Crash and come back within the same second as often as not.
        let (status, _) = exchange(addr, "POST", "/admin/crash", r#"{"restart_after_ms": 50}"#)
            .await
            .unwrap();
        assert_eq!(status, 202);
        let deadline = tokio::time::Instant::now() + WAIT;
        let restarted = loop {
            if let Some((200, text)) = exchange(addr, "GET", "/metrics", "").await
                && start_time(&text) != started
            {
                break text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{engine:?}: not restarted within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let restarted_at = start_time(&restarted);
        assert!(
            restarted_at > started,
            "{engine:?}: {restarted_at} after {started}"
        );
        assert!(restarted_at <= now() + 1.0, "{engine:?}: not in the future");
        for counter in counters {
            assert_eq!(
                total(&restarted, counter),
                0.0,
                "{engine:?}: {counter} starts from zero"
            );
        }
    }
}

//! `cachepick snapshot --from URL`: a running picker's own view, read from its `/debug/snapshot`
//! (metrics listener), printed as the local snapshot is, with the same exit statuses.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};

/// The longest the picker may take to connect and to answer.
const TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read: a snapshot of thousands of workers is a few MB.
const MAX_ANSWER: u64 = 64 << 20;

/// `GET <url>/debug/snapshot` over plain HTTP/1.1; the JSON body.
pub fn fetch(url: &str) -> anyhow::Result<serde_json::Value> {
    let authority = url
        .strip_prefix("http://")
        .with_context(|| format!("--from {url}: expected http://HOST:PORT (the metrics listener)"))?
        .trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        bail!("--from {url}: expected http://HOST:PORT, without a path");
    }
    let address = authority
        .to_socket_addrs()
        .with_context(|| format!("--from {url}: cannot resolve {authority}"))?
        .next()
        .with_context(|| format!("--from {url}: {authority} has no address"))?;
    let mut stream = TcpStream::connect_timeout(&address, TIMEOUT)
        .with_context(|| format!("cannot connect to {authority}"))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    write!(
        stream,
        "GET /debug/snapshot HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .with_context(|| format!("reading the answer of {authority}"))?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{authority} did not answer in HTTP"))?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        bail!(
            "{authority}/debug/snapshot answered {status}: {}",
            body.trim()
        );
    }
    if head.lines().any(|line| {
        line.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    }) {
        bail!("{authority} answered with a chunked body, which this reader does not take");
    }
    serde_json::from_str(body).with_context(|| format!("{authority}/debug/snapshot is not JSON"))
}

/// The snapshot as a table: each pool, then a line per worker.
pub fn render(snapshot: &serde_json::Value) -> String {
    let mut out = String::new();
    let number = |value: &serde_json::Value| {
        value
            .as_f64()
            .map_or_else(|| "-".to_owned(), |number| format!("{number}"))
    };
    for pool in snapshot["pools"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "pool {} (snapshot {}, fresh within {} s)\n",
            pool["pool"].as_str().unwrap_or("?"),
            pool["version"],
            number(&pool["freshness_seconds"])
        ));
        out.push_str(&format!(
            "  {:<24} {:<11} {:<6} {:>7} {:>7} {:>8}  why not fresh\n",
            "worker", "state", "fresh", "waiting", "running", "age s"
        ));
        for worker in pool["workers"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  {:<24} {:<11} {:<6} {:>7} {:>7} {:>8}  {}\n",
                worker["endpoint"].as_str().unwrap_or("?"),
                worker["state"].as_str().unwrap_or("?"),
                if worker["fresh"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "no"
                },
                number(&worker["waiting"]),
                number(&worker["running"]),
                worker["age_seconds"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |age| format!("{age:.1}")),
                worker["why_not_fresh"].as_str().unwrap_or("")
            ));
        }
    }
    out
}

/// The pools of `snapshot` in which no worker has a fresh reading.
pub fn unserved(snapshot: &serde_json::Value) -> Vec<String> {
    snapshot["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|pool| {
            !pool["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|worker| worker["fresh"].as_bool() == Some(true))
        })
        .map(|pool| pool["pool"].as_str().unwrap_or("?").to_owned())
        .collect()
}

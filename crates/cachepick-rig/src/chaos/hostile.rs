//! The clients beside the good traffic, over raw TCP so they can misbehave: malformed requests, a body
//! trickled in small pieces, a body that stalls, and slowloris connections that never finish their
//! headers. Every one is bounded in time; none leaves loopback.

use std::net::SocketAddr;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::classify::{ClientFailure, Observed};
use super::schedule::Malformed;
use super::traffic::{ID_HEADER, PATH, has_usage};

/// Bytes of a response kept: the status line, the headers and enough of the body to find its usage.
const KEEP: usize = 64 * 1024;

/// What a raw exchange got back.
#[derive(Clone, Debug, Default)]
pub struct RawReply {
    pub status: Option<u16>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub failure: Option<ClientFailure>,
}

impl RawReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// Writes `pieces` to a new connection to `addr` (each after its pause), then reads the answer to the
/// end of the connection, all before `until`. A write the server cut short (it answered early, as Envoy
/// does to an oversized body) still reads what it answered.
pub async fn exchange(
    addr: SocketAddr,
    pieces: Vec<(Duration, Vec<u8>)>,
    until: Instant,
) -> RawReply {
    let mut reply = RawReply::default();
    let mut stream = match tokio::time::timeout_at(until, TcpStream::connect(addr)).await {
        Err(_) => {
            reply.failure = Some(ClientFailure::Timeout);
            return reply;
        }
        Ok(Err(error)) => {
            reply.failure = Some(ClientFailure::Connect(error.to_string()));
            return reply;
        }
        Ok(Ok(stream)) => stream,
    };
    for (pause, piece) in pieces {
        if tokio::time::timeout_at(until, tokio::time::sleep(pause))
            .await
            .is_err()
        {
            reply.failure = Some(ClientFailure::Timeout);
            return reply;
        }
        match tokio::time::timeout_at(until, stream.write_all(&piece)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => break,
        }
    }
    let mut buffer = Vec::new();
    let mut chunk = vec![0_u8; 16 * 1024];
    loop {
        match tokio::time::timeout_at(until, stream.read(&mut chunk)).await {
            Err(_) => {
                reply.failure = Some(ClientFailure::Timeout);
                break;
            }
            Ok(Ok(0)) => break,
            Ok(Ok(read)) => {
                buffer.extend_from_slice(chunk.get(..read).unwrap_or_default());
                if buffer.len() > KEEP {
                    let excess = buffer.len() - KEEP;
                    // Keep the head (status, headers) and the tail (usage): drop from the middle.
                    buffer.drain(4096..4096 + excess.min(buffer.len() - 4096));
                }
            }
            Ok(Err(error)) => {
                if buffer.is_empty() {
                    reply.failure = Some(ClientFailure::Broken(error.to_string()));
                }
                break;
            }
        }
    }
    parse_response(&buffer, &mut reply);
    if reply.status.is_none() && reply.failure.is_none() {
        reply.failure = Some(ClientFailure::Broken(
            "the connection closed without a response".to_owned(),
        ));
    }
    reply
}

/// Fills `reply` from an HTTP/1.1 response's bytes: status, headers, the body (undecoded).
fn parse_response(bytes: &[u8], reply: &mut RawReply) {
    let Some(end) = bytes.windows(4).position(|window| window == b"\r\n\r\n") else {
        return;
    };
    let head = String::from_utf8_lossy(bytes.get(..end).unwrap_or_default());
    let mut lines = head.split("\r\n");
    reply.status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok());
    reply.headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(key, value)| (key.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    reply.body = bytes.get(end + 4..).unwrap_or_default().to_vec();
}

/// An HTTP/1.1 POST of `body` to `PATH`, closing the connection after the answer.
fn post_head(id: &str, length: usize) -> Vec<u8> {
    format!(
        "POST {PATH} HTTP/1.1\r\nhost: chaos\r\ncontent-type: application/json\r\n{ID_HEADER}: {id}\r\n\
         content-length: {length}\r\nconnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// The bytes a malformed client sends (its body, or for `GarbageBytes` the whole exchange).
pub fn malformed_bytes(
    kind: Malformed,
    id: &str,
    model: &str,
    max_body: usize,
    seed: u64,
) -> Vec<u8> {
    let body: Vec<u8> = match kind {
        Malformed::InvalidJson => {
            format!(r#"{{"model": "{model}", "prompt": "cut off"#).into_bytes()
        }
        Malformed::WrongType => {
            format!(r#"{{"model": "{model}", "prompt": {{"text": "an object"}}, "max_tokens": 4}}"#)
                .into_bytes()
        }
        Malformed::NotUtf8 => {
            let mut body = format!(r#"{{"model": "{model}", "prompt": "bad "#).into_bytes();
            body.extend_from_slice(&[0xff, 0xfe, 0xc3, 0x28]);
            body.extend_from_slice(br#"", "max_tokens": 4}"#);
            body
        }
        Malformed::TooDeep => {
            let depth = 4_096;
            let mut body = format!(r#"{{"model": "{model}", "prompt": "#).into_bytes();
            body.extend(std::iter::repeat_n(b'[', depth));
            body.push(b'1');
            body.extend(std::iter::repeat_n(b']', depth));
            body.push(b'}');
            body
        }
        Malformed::UnknownModel => {
            br#"{"model": "no-such-model", "prompt": "hello there", "max_tokens": 4}"#.to_vec()
        }
        Malformed::Oversized => {
            let mut body = format!(r#"{{"model": "{model}", "prompt": ""#).into_bytes();
            body.extend(std::iter::repeat_n(b'a', max_body + 64 * 1024));
            body.extend_from_slice(br#"", "max_tokens": 4}"#);
            body
        }
        Malformed::GarbageBytes => {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut bytes: Vec<u8> = (0..512).map(|_| rng.random::<u8>()).collect();
            bytes.extend_from_slice(b"\r\n\r\n");
            return bytes;
        }
    };
    let mut bytes = post_head(id, body.len());
    bytes.extend_from_slice(&body);
    bytes
}

/// Where the hostile clients go and what they know of it.
#[derive(Clone, Debug)]
pub struct Target {
    /// Envoy's listener.
    pub envoy: SocketAddr,
    pub model: String,
    /// The picker's `max_body_bytes` (Envoy's body limit on the route).
    pub max_body: usize,
    /// The start of the run.
    pub start: Instant,
    /// How long one exchange may take.
    pub deadline: Duration,
}

/// Sends one malformed request; what its client saw.
pub async fn malformed(
    target: &Target,
    kind: Malformed,
    id: &str,
    seed: u64,
) -> (Observed, RawReply) {
    let sent = target.start.elapsed();
    let bytes = malformed_bytes(kind, id, &target.model, target.max_body, seed);
    let until = Instant::now() + target.deadline;
    let reply = exchange(target.envoy, vec![(Duration::ZERO, bytes)], until).await;
    (observed(&reply, sent, target.start.elapsed()), reply)
}

fn observed(reply: &RawReply, sent: Duration, ended: Duration) -> Observed {
    Observed {
        sent,
        ended,
        status: reply.status,
        refusal: reply
            .header(cachepick::protocol::REFUSAL_HEADER)
            .map(str::to_owned),
        served_by: reply.header("x-served-by").map(str::to_owned),
        complete: reply.status == Some(200) && has_usage(&reply.body),
        failure: reply.failure.clone(),
    }
}

/// A well-formed, non-streaming request whose body arrives in ten pieces spread over `over`.
pub async fn trickle(target: &Target, id: &str, body: String, over: Duration) -> Observed {
    const PIECES: u32 = 10;
    let start = target.start;
    let sent = start.elapsed();
    let body = body.into_bytes();
    let mut pieces = vec![(Duration::ZERO, post_head(id, body.len()))];
    let size = body.len().div_ceil(PIECES as usize).max(1);
    for piece in body.chunks(size) {
        pieces.push((over / PIECES, piece.to_vec()));
    }
    let reply = exchange(
        target.envoy,
        pieces,
        Instant::now() + target.deadline + over,
    )
    .await;
    observed(&reply, sent, start.elapsed())
}

/// How a connection that never finished its request ended.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Slow {
    /// `slowloris` or `stalled_body`.
    pub kind: String,
    #[serde(rename = "opened_s", serialize_with = "super::seconds")]
    pub opened: Duration,
    /// How long Envoy kept it open before closing it; `None`: still open when the run ended.
    #[serde(rename = "closed_after_s", serialize_with = "super::seconds_opt")]
    pub closed_after: Option<Duration>,
    /// The status Envoy answered before closing, if any (408 for a request that timed out).
    pub status: Option<u16>,
}

/// A connection that sends a request's headers a line a second (slowloris, `stall_body: false`), or
/// its headers and part of its body and then nothing (`stall_body: true`), until Envoy closes it or
/// `until`.
pub async fn slow(target: &Target, stall_body: bool, until: Instant) -> Slow {
    let opened = target.start.elapsed();
    let mut slow = Slow {
        kind: if stall_body {
            "stalled_body"
        } else {
            "slowloris"
        }
        .to_owned(),
        opened,
        ..Slow::default()
    };
    let Ok(Ok(mut stream)) = tokio::time::timeout_at(until, TcpStream::connect(target.envoy)).await
    else {
        return slow;
    };
    let began = Instant::now();
    let first: Vec<u8> = if stall_body {
        let mut bytes = post_head("stalled", 4_096);
        bytes.extend_from_slice(
            format!(r#"{{"model": "{}", "prompt": "never fin"#, target.model).as_bytes(),
        );
        bytes
    } else {
        format!("POST {PATH} HTTP/1.1\r\nhost: chaos\r\n").into_bytes()
    };
    if stream.write_all(&first).await.is_err() {
        slow.closed_after = Some(began.elapsed());
        return slow;
    }
    let mut buffer = Vec::new();
    let mut chunk = [0_u8; 1024];
    let mut line = 0_u64;
    loop {
        let tick = tokio::time::sleep(Duration::from_secs(1));
        tokio::select! {
            read = stream.read(&mut chunk) => {
                match read {
                    Ok(0) | Err(_) => break,
                    Ok(read) => buffer.extend_from_slice(chunk.get(..read).unwrap_or_default()),
                }
            }
            () = tick => {
                if !stall_body {
                    line += 1;
                    if stream.write_all(format!("x-slow-{line}: a\r\n").as_bytes()).await.is_err() {
                        break;
                    }
                }
            }
            () = tokio::time::sleep_until(until) => {
                return slow;
            }
        }
    }
    slow.closed_after = Some(began.elapsed());
    let mut reply = RawReply::default();
    parse_response(&buffer, &mut reply);
    slow.status = reply.status;
    slow
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_head_parses_into_status_and_lowercase_headers() {
        let mut reply = RawReply::default();
        parse_response(
            b"HTTP/1.1 400 Bad Request\r\nX-Cachepick-Refusal-Reason: invalid_json\r\ncontent-length: 2\r\n\r\n{}",
            &mut reply,
        );
        assert_eq!(reply.status, Some(400));
        assert_eq!(
            reply.header(cachepick::protocol::REFUSAL_HEADER),
            Some("invalid_json")
        );
        assert_eq!(reply.body, b"{}");
        let mut partial = RawReply::default();
        parse_response(b"HTTP/1.1 200 OK\r\nx: y", &mut partial);
        assert_eq!(partial.status, None);
    }

    #[test]
    fn malformed_bodies_are_what_they_claim() {
        let model = "sim-model";
        let body = |kind| {
            let bytes = malformed_bytes(kind, "1", model, 1_024, 1);
            let at = bytes
                .windows(4)
                .position(|window| window == b"\r\n\r\n")
                .expect("a head");
            bytes[at + 4..].to_vec()
        };
        assert!(
            serde_json::from_slice::<serde_json::Value>(&body(Malformed::InvalidJson)).is_err()
        );
        assert!(std::str::from_utf8(&body(Malformed::NotUtf8)).is_err());
        let wrong: serde_json::Value =
            serde_json::from_slice(&body(Malformed::WrongType)).expect("JSON");
        assert!(wrong["prompt"].is_object());
        assert!(body(Malformed::Oversized).len() > 1_024 + 64 * 1024);
        let garbage = malformed_bytes(Malformed::GarbageBytes, "1", model, 1_024, 1);
        assert!(!garbage.starts_with(b"POST"));
        assert_eq!(
            garbage,
            malformed_bytes(Malformed::GarbageBytes, "1", model, 1_024, 1)
        );
    }
}

//! SGLang's bootstrap rendezvous, performed by cachepick: both legs carry the same room.
//!
//! The room is minted here (a random integer below 2^63, as SGLang's router draws it) and spliced into
//! the client's bytes with the prefill worker's host and bootstrap port, so a multi-megabyte prompt is
//! copied once and never parsed again. The prefill leg is sent with that body from the relay's own
//! client and is not waited for: SGLang's decode worker joins the room and receives the KV, and the
//! prefill worker answers only once it has sent it. The leg's answer is read up to
//! `pd.max_prefill_response_bytes` and dropped; its failures are counted. It ends by
//! `pd.prefill_timeout`, or sooner when the client goes away before its decode worker answered
//! ([`Dispatched`] aborts it on drop unless released).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Limited};
use tokio::task::JoinHandle;

use super::body::append_members;

/// Mints rooms: random below 2^63, distinct between concurrent requests and between replicas (each
/// process seeds its own hasher from the operating system).
pub(super) struct Rooms {
    seed: RandomState,
    next: AtomicU64,
}

impl Rooms {
    pub(super) fn new() -> Rooms {
        Rooms {
            seed: RandomState::new(),
            next: AtomicU64::new(0),
        }
    }

    pub(super) fn mint(&self) -> u64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.seed.hash_one(n) >> 1
    }
}

/// The body both legs get: the client's, with `bootstrap_host`, `bootstrap_port` and
/// `bootstrap_room` as its last members (a client's own copies are overridden: engines keep the last
/// of a repeated member). `None` when the body does not end as a JSON object.
pub fn rendezvous_body(body: &[u8], prefill: SocketAddr, port: u16, room: u64) -> Option<Vec<u8>> {
    let host = prefill.ip().to_string();
    let members = format!(
        "\"bootstrap_host\":\"{host}\",\"bootstrap_port\":{port},\"bootstrap_room\":{room}"
    );
    append_members(body, &members)
}

/// A prefill leg sent and not waited for. Dropping it aborts the leg (the client went away before its
/// decode worker answered); [`Dispatched::release`] lets it run to its end.
pub struct Dispatched(Option<JoinHandle<()>>);

impl Dispatched {
    pub(super) fn new(task: JoinHandle<()>) -> Dispatched {
        Dispatched(Some(task))
    }

    pub fn release(mut self) {
        self.0 = None;
    }
}

impl Drop for Dispatched {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// A prefill leg's request, owned so that it outlives the stream that sent it.
pub(super) struct Outbound {
    pub path: String,
    pub body: Bytes,
    pub request_id: Option<String>,
    pub authorization: Option<Vec<u8>>,
}

/// One prefill leg to `worker`, drained; why it failed.
pub(super) async fn send(
    client: &super::HttpClient,
    worker: SocketAddr,
    outbound: Outbound,
    limit: usize,
    timeout: Duration,
) -> Result<(), String> {
    let request = super::leg_request(
        worker,
        &outbound.path,
        outbound.body,
        outbound.request_id.as_deref(),
        outbound.authorization.as_deref(),
    )?;
    let leg = async {
        let response = client
            .request(request)
            .await
            .map_err(|error| format!("unreachable: {error}"))?;
        let status = response.status();
        // The answer is drained so the connection is reused; a stream longer than the bound is cut.
        let _ = Limited::new(response.into_body(), limit).collect().await;
        if status == StatusCode::OK {
            Ok(())
        } else {
            Err(format!("answered {status}"))
        }
    };
    tokio::time::timeout(timeout, leg)
        .await
        .map_err(|_| "no answer within pd.prefill_timeout".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rendezvous_is_spliced_last_and_overrides_a_clients() {
        let body = br#"{"model":"m","prompt":"hi","bootstrap_room":1}  "#;
        let out = rendezvous_body(body, "10.0.0.7:30000".parse().unwrap(), 8998, 42).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with(r#"{"model":"m","prompt":"hi","bootstrap_room":1,"#));
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["bootstrap_host"], "10.0.0.7");
        assert_eq!(value["bootstrap_port"], 8998);
        // serde_json, like Python's parser, keeps the last of a repeated member.
        assert_eq!(value["bootstrap_room"], 42);
        assert!(rendezvous_body(b"[1]", "10.0.0.7:1".parse().unwrap(), 1, 1).is_none());
        let ipv6 = rendezvous_body(b"{}", "[::1]:30000".parse().unwrap(), 8998, 7).unwrap();
        assert_eq!(
            String::from_utf8(ipv6).unwrap(),
            r#"{"bootstrap_host":"::1","bootstrap_port":8998,"bootstrap_room":7}"#
        );
    }

    #[test]
    fn rooms_are_below_two_to_the_63_and_distinct() {
        let rooms = Rooms::new();
        let minted: std::collections::HashSet<u64> = (0..10_000).map(|_| rooms.mint()).collect();
        assert_eq!(minted.len(), 10_000);
        assert!(minted.iter().all(|room| *room < 1 << 63));
    }
}

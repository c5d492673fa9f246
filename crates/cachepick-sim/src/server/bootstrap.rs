//! SGLang's disaggregation between simulated workers: the bootstrap rendezvous.
//!
//! SGLang's router sends the same body, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`,
//! to a prefill worker and a decode worker at once. Here a worker in `disaggregation_mode: prefill`
//! serves a request only with a room: it prefills the prompt, produces its one token, and keeps the
//! room's KV for the decode worker (SGLang's bootstrap server; the simulator's answers on the worker's
//! own port, which `/server_info` reports as `disaggregation_bootstrap_port`). A worker in
//! `disaggregation_mode: decode` refuses a request without a room (400, as SGLang's decode worker
//! cannot prefill alone) and otherwise joins it — `GET /sim/bootstrap/<room>` on the named host and
//! port, which waits for the prefill, so the legs may arrive in either order — then waits, counted as
//! transferring, while the KV crosses its link (the same link model as NIXL's), and runs with it held.
//!
//! Failures as SGLang reports them: an unreachable bootstrap server fails the decode leg after the
//! heartbeat window (5 s × 2), a room no prefill joins within `WAITING_TIMEOUT` (300 s) fails it
//! then; both with a 500 naming `KVTransferError`. A room the decode worker never joins is dropped
//! after `BOOTSTRAP_TIMEOUT` (300 s). Durations are model time. Not modelled: SGLang's prefill sends
//! its KV chunk by chunk, overlapping its compute (here the transfer starts when the prefill ends),
//! the decode worker's preallocation queue, and a decode worker without a radix cache keeping nothing
//! (here it caches the pulled prompt as vLLM's does).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::nixl::{self, FetchFailure};
use super::{Body, Incarnation, Shared, error, json, lock};

/// SGLang's `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` and `BOOTSTRAP_TIMEOUT`, model time.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
/// SGLang's heartbeat: a prefill instance is dead after two missed 5 s beats, model time.
const HEARTBEAT_WINDOW: Duration = Duration::from_secs(10);

/// Rooms whose prefill finished, waiting for their decode worker; a restart loses them.
#[derive(Default)]
pub(super) struct Rooms {
    ready: std::sync::Mutex<HashMap<u64, Room>>,
    joined: Notify,
}

struct Room {
    tokens: u32,
    expires: Instant,
}

/// The worker's role in a disaggregated SGLang fleet, as `/server_info` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Disaggregation {
    /// Aggregated (SGLang's `null`): bootstrap fields are ignored.
    #[default]
    Null,
    Prefill,
    Decode,
}

impl Disaggregation {
    pub fn as_str(self) -> &'static str {
        match self {
            Disaggregation::Null => "null",
            Disaggregation::Prefill => "prefill",
            Disaggregation::Decode => "decode",
        }
    }
}

fn scaled(shared: &Shared, duration: Duration) -> Duration {
    let scale = shared.params.load_full().time_scale.max(0.0);
    duration.mul_f64(scale)
}

/// A finished prefill's room: kept for its decode worker until it joins or the bootstrap timeout.
pub(super) fn hold(shared: &Shared, incarnation: &Incarnation, room: u64, tokens: u32) {
    let now = Instant::now();
    let expires = now + scaled(shared, RENDEZVOUS_TIMEOUT);
    {
        let mut ready = lock(&incarnation.rooms.ready);
        ready.retain(|_, room| room.expires > now);
        ready.insert(room, Room { tokens, expires });
    }
    incarnation.rooms.joined.notify_waiters();
}

/// `GET /sim/bootstrap/<room>` on the prefill worker: the room's KV once its prefill has finished
/// (waiting for it up to the waiting timeout), handed over once.
pub(super) async fn join(shared: &Shared, incarnation: &Incarnation, path: &str) -> Response<Body> {
    let Ok(room) = path.trim_start_matches("/sim/bootstrap/").parse::<u64>() else {
        return error(StatusCode::BAD_REQUEST, "expected /sim/bootstrap/<room>");
    };
    let deadline = Instant::now() + scaled(shared, RENDEZVOUS_TIMEOUT);
    loop {
        // Registered before the check, so a room held between the check and the wait wakes it.
        let joined = incarnation.rooms.joined.notified();
        tokio::pin!(joined);
        joined.as_mut().enable();
        if let Some(held) = lock(&incarnation.rooms.ready).remove(&room) {
            return json(
                StatusCode::OK,
                serde_json::json!({"tokens": held.tokens, "served_by": shared.id})
                    .to_string()
                    .into_bytes(),
            );
        }
        if tokio::time::timeout_at(deadline, joined).await.is_err() {
            return error(
                StatusCode::NOT_FOUND,
                "no prefill joined the room within the waiting timeout",
            );
        }
    }
}

/// The decode leg's side: joins `room` at the prefill worker's bootstrap server and waits out the
/// transfer of the tokens this worker lacks (`held` of them it holds); the error is SGLang's.
pub(super) async fn pull(
    shared: &Arc<Shared>,
    host: &str,
    port: u16,
    room: u64,
    held: u32,
) -> Result<nixl::Pulled, String> {
    let addr: SocketAddr = format!("{host}:{port}")
        .parse()
        .or_else(|_| format!("[{host}]:{port}").parse())
        .map_err(|_| format!("bootstrap_host {host:?} is not an IP address"))?;
    // Waiting for the room and for the link count as waiting, as SGLang's transfer queue does.
    shared.transferring.fetch_add(1, Ordering::Relaxed);
    let pulled = join_and_cross(shared, addr, room, held).await;
    shared.transferring.fetch_sub(1, Ordering::Relaxed);
    pulled
}

async fn join_and_cross(
    shared: &Shared,
    addr: SocketAddr,
    room: u64,
    held: u32,
) -> Result<nixl::Pulled, String> {
    let started = Instant::now();
    let (tokens, prefill_worker) = match nixl::fetch_kv(addr, &format!("/sim/bootstrap/{room}"))
        .await
    {
        Ok(joined) => joined,
        Err(FetchFailure::Unreachable(why)) => {
            // SGLang's decode worker notices a dead prefill instance only when its heartbeats fail.
            tokio::time::sleep_until(started + scaled(shared, HEARTBEAT_WINDOW)).await;
            return Err(format!(
                "KVTransferError: lost contact with the prefill instance {addr}, it might be dead \
                 ({why})"
            ));
        }
        Err(FetchFailure::Refused(why)) => {
            return Err(format!(
                "KVTransferError: the prefill instance {addr} did not serve room {room}: {why}"
            ));
        }
    };
    let moved = tokens.saturating_sub(held);
    nixl::cross_link(shared, moved).await;
    Ok(nixl::Pulled {
        tokens,
        moved,
        prefill_worker,
    })
}

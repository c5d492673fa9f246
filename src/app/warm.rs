//! Warm start: what a replica does between its first scrape round and saying it is ready. Under
//! `replica_sync` it answers its siblings' snapshot requests, and at start asks them for theirs; in
//! every case it waits for its KV event streams to replay their engines' rings.
//!
//! A replica that starts or restarts behind the same Envoy as its siblings would otherwise route
//! with empty `approximate` indexes: every conversation a sibling placed looks new to it, so it
//! scatters their next turns and spends their owners' caches for everyone. So once every pool has
//! had its first scrape round (a snapshot names workers by endpoint, and the rosters must know them),
//! it asks every sibling at once, for at most `WARM_WITHIN`, and adopts each answer in turn (each
//! sibling's index holds what it placed itself, so the union is what the fleet knows); readiness
//! waits for that. A replica with no sibling that
//! answers (the first of a fleet, or a fleet restarted together) starts cold, as before, and says
//! so. An `events` pool needs no sibling: each engine replays what its ring holds to a new
//! subscriber, and readiness waits for those replays (a stream that cannot connect is not waited
//! for), within the same `WARM_WITHIN`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use rand::seq::SliceRandom;
use tokio::sync::watch;

use crate::load::{ReplicaSync, SnapshotSource, WARM_WITHIN, Warmed};
use crate::route::{IndexSnapshot, Service};

/// What siblings are answered with: this replica's `approximate` indexes, encoded.
pub(super) fn source(service: &Arc<Service>) -> SnapshotSource {
    let service = Arc::clone(service);
    Arc::new(move || service.picker().index_snapshot().encode())
}

/// Asks the siblings for a snapshot once the rosters are known, adopts the first with something in
/// it, and marks `warmed` either way, or at shutdown.
pub(super) async fn warm_up(
    replica: Option<Arc<ReplicaSync>>,
    service: Arc<Service>,
    warmed: watch::Sender<bool>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::select! {
        () = warm(replica.as_deref(), &service) => {}
        () = shutdown => {}
    }
    let _ = warmed.send(true);
}

async fn warm(replica: Option<&ReplicaSync>, service: &Arc<Service>) {
    for mut round in service.rounds() {
        if round.wait_for(|completed| *completed > 0).await.is_err() {
            return;
        }
    }
    let deadline = Instant::now() + WARM_WITHIN;
    if let Some(replica) = replica {
        ask_siblings(replica, service).await;
    }
    replayed(service, deadline).await;
}

/// Waits until every KV event stream has replayed its engine's ring on its first connection (or
/// found nothing to connect to), until `deadline`.
async fn replayed(service: &Service, deadline: Instant) {
    let started = Instant::now();
    loop {
        let (settled, all) = service.event_streams_settled();
        if settled == all {
            if all > 0 {
                tracing::info!(
                    streams = all,
                    took_ms = started.elapsed().as_millis(),
                    "warm start: every KV event stream has replayed its engine's ring"
                );
            }
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                waiting = all - settled,
                streams = all,
                "warm start: KV event streams still replaying; ready without them"
            );
            return;
        }
        tokio::time::sleep(REPLAY_POLL).await;
    }
}

/// How often readiness looks at the streams' replays.
const REPLAY_POLL: Duration = Duration::from_millis(20);

async fn ask_siblings(replica: &ReplicaSync, service: &Arc<Service>) {
    if service.picker().index_snapshot().pools.is_empty() {
        return;
    }
    let started = Instant::now();
    let mut siblings = replica.siblings();
    siblings.shuffle(&mut rand::rng());
    // All at once, each within what is left of `WARM_WITHIN`: one sibling that hangs costs the
    // budget once, not once per sibling after it.
    let answers = join_all(siblings.iter().map(|sibling| async move {
        match tokio::time::timeout(WARM_WITHIN, replica.ask(*sibling)).await {
            Ok(answer) => (*sibling, answer.map_err(Warmed::from)),
            Err(_) => (*sibling, Err(Warmed::Timeout)),
        }
    }))
    .await;
    // Each sibling's index holds the conversations it placed itself, so all of them are adopted,
    // each in turn (what the last adopts is the most recent where capacity cuts).
    let stats = replica.stats();
    let mut adopted = false;
    for (sibling, answer) in answers {
        let outcome = match answer {
            Ok(bytes) => adopt(service, &bytes).await,
            Err(refused) => (refused, 0),
        };
        stats.count_warmed(outcome.0);
        adopted |= outcome.0 == Warmed::Adopted;
        tracing::info!(%sibling, outcome = outcome.0.as_str(), blocks = outcome.1, "warm start: asked a sibling");
    }
    let held = if adopted {
        service.picker().index_snapshot().blocks()
    } else {
        0
    };
    stats.set_warm_blocks(held as u64);
    let took_ms = started.elapsed().as_millis();
    if held > 0 {
        tracing::info!(
            blocks = held,
            asked = siblings.len(),
            took_ms,
            "warm start: adopted the siblings' owner indexes"
        );
    } else {
        tracing::info!(
            asked = siblings.len(),
            took_ms,
            "warm start: no sibling had an owner index to adopt; starting cold"
        );
    }
}

/// Reads `bytes` as a snapshot and adopts it on the blocking pool; with the blocks held after.
async fn adopt(service: &Arc<Service>, bytes: &[u8]) -> (Warmed, usize) {
    let Ok(snapshot) = IndexSnapshot::decode(bytes) else {
        return (Warmed::Unusable, 0);
    };
    let service = Arc::clone(service);
    match tokio::task::spawn_blocking(move || service.picker().adopt(&snapshot)).await {
        Ok(adopted) if adopted.blocks > 0 => (Warmed::Adopted, adopted.blocks),
        Ok(_) => (Warmed::Empty, 0),
        Err(_) => (Warmed::Unusable, 0),
    }
}

//! The operator's views of a running picker: every pool's load snapshot with its source of workers and
//! its KV event streams (`/debug/snapshot`, the admin API), and what readiness reads. They read the
//! service's state and never take part in a request.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::service::Service;
use crate::discovery::{SourceState, SourceStatus};
use crate::events::stream::StreamView;
use crate::load::PoolView;

/// A pool as the operator commands show it: its load snapshot and, in `events` mode, its KV event
/// streams.
#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    #[serde(flatten)]
    pub view: PoolView,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kv_events: Vec<StreamView>,
    /// Where the pool's workers come from, and how that source is doing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceReport>,
}

/// A pool's source of workers as the operator commands show it.
#[derive(Clone, Debug, Serialize)]
pub struct SourceReport {
    /// `file`, `dns` or `kubernetes`.
    pub kind: &'static str,
    #[serde(flatten)]
    pub state: SourceState,
}

impl PoolReport {
    /// Each pool's view with its streams, matched by pool label.
    pub fn join(
        views: Vec<PoolView>,
        mut streams: Vec<(String, Vec<StreamView>)>,
    ) -> Vec<PoolReport> {
        views
            .into_iter()
            .map(|view| {
                let kv_events = streams
                    .iter_mut()
                    .find(|(pool, _)| *pool == view.pool)
                    .map(|(_, streams)| std::mem::take(streams))
                    .unwrap_or_default();
                PoolReport {
                    view,
                    kv_events,
                    source: None,
                }
            })
            .collect()
    }
}

impl Service {
    /// Reports `status` as pool `pool`'s source of workers in the snapshot and the metrics.
    pub fn watch_source(&self, pool: &str, status: Arc<SourceStatus>) {
        self.metrics.watch_source(pool, Arc::clone(&status));
        self.sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((pool.to_owned(), status));
    }

    /// Every pool's load snapshot, its source of workers and, in `events` mode, its KV event streams:
    /// `/debug/snapshot`.
    pub fn report(&self) -> Vec<PoolReport> {
        let mut reports = PoolReport::join(self.snapshot(), self.feeds.views(Instant::now()));
        let sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        for report in &mut reports {
            report.source = sources
                .iter()
                .find(|(pool, _)| *pool == report.view.pool)
                .map(|(_, status)| SourceReport {
                    kind: status.kind,
                    state: status.state(),
                });
        }
        reports
    }

    /// Every pool's current snapshot as an operator reads it.
    pub fn snapshot(&self) -> Vec<PoolView> {
        let now = Instant::now();
        self.picker
            .loads()
            .map(|load| PoolView::new(load.label(), &load.snapshot(), now))
            .collect()
    }

    /// The pools' scrape-round counters, for readiness: ready once every pool has completed one.
    pub fn rounds(&self) -> Vec<tokio::sync::watch::Receiver<u64>> {
        self.picker.loads().map(|load| load.rounds()).collect()
    }

    /// Whether any pool has a worker the picker can route by at `now`: one that answers, if late
    /// (`Lifecycle::answers`), with a reading or a sign of life (a KV event batch, a response it
    /// served) younger than `recent` (`load.silent_after`). What readiness means: a busy engine's late
    /// `/metrics` leaves its reading stale, yet its prefixes (its KV events, the picker's own
    /// decisions) still route, and its gate fails open; only workers gone, or silent past `recent`,
    /// take readiness away.
    pub fn can_route(&self, now: Instant, recent: Duration) -> bool {
        let since = now.checked_sub(recent).unwrap_or(now);
        self.picker.loads().any(|load| {
            load.snapshot().workers().iter().any(|worker| {
                worker.lifecycle.answers()
                    && (worker
                        .reading
                        .is_some_and(|reading| reading.captured_at >= since)
                        || load.heard_since(worker.id, since))
            })
        })
    }
}

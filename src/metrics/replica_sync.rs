//! `cachepick_replica_sync_*`: the announcements this replica sent its peers and what became of the
//! ones it received, read off the sync's counters each time `/metrics` is read. No series exist
//! while `replica_sync` is off.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, IntGauge, Opts};

use super::families::{descs, samples};
use crate::load::{Received, Served, SyncStats, Warmed};

#[derive(Debug)]
pub(super) struct ReplicaSyncCounters {
    source: Mutex<Option<Arc<SyncStats>>>,
    sent: IntCounterVec,
    received: IntCounterVec,
    key_reloads: IntCounterVec,
    snapshots_served: IntCounterVec,
    warm_start: IntCounterVec,
    warm_blocks: IntGauge,
}

impl ReplicaSyncCounters {
    pub(super) fn new() -> Result<ReplicaSyncCounters, prometheus::Error> {
        Ok(ReplicaSyncCounters {
            source: Mutex::new(None),
            sent: IntCounterVec::new(
                Opts::new(
                    "cachepick_replica_sync_sent_total",
                    "Dispatch announcements sent to the replica_sync peers (one per peer and \
                     dispatch), by outcome: ok, or failed when the socket refused it (buffer full, \
                     no route); a failed one is priced through the dispatch share instead.",
                ),
                &["outcome"],
            )?,
            received: IntCounterVec::new(
                Opts::new(
                    "cachepick_replica_sync_received_total",
                    "Datagrams received on replica_sync.listen, by what became of them: accepted, \
                     own, unknown_source, malformed, unauthenticated (no key held signed it, or its \
                     MAC does not match: forged, altered, or a peer on another key), stale (sent \
                     more than 10 s from this replica's clock, or before it started), replayed \
                     (taken already), unknown_worker, over_budget (beyond max_datagrams_per_second \
                     taken, or four times it refused, in a second).",
                ),
                &["outcome"],
            )?,
            key_reloads: IntCounterVec::new(
                Opts::new(
                    "cachepick_replica_sync_key_reloads_total",
                    "Reads of replica_sync.key_file that found it changed, by outcome: applied (its \
                     keys are in force), failed (unreadable or no valid key: the last keys stay).",
                ),
                &["outcome"],
            )?,
            snapshots_served: IntCounterVec::new(
                Opts::new(
                    "cachepick_replica_sync_snapshots_served_total",
                    "Warm-start requests on replica_sync.listen (TCP), by outcome: answered (a \
                     sibling on a key in force got this replica's owner index), unknown_source (not \
                     a listed peer's address), busy (over 4 at once), malformed, unauthenticated, \
                     stale, replayed, failed (the answer could not be sent within 60 s).",
                ),
                &["outcome"],
            )?,
            warm_start: IntCounterVec::new(
                Opts::new(
                    "cachepick_replica_sync_warm_start_total",
                    "Siblings asked for their owner index when this replica started, by outcome: \
                     adopted, empty (nothing to adopt), unusable, failed, timeout, malformed, \
                     unauthenticated.",
                ),
                &["outcome"],
            )?,
            warm_blocks: IntGauge::new(
                "cachepick_replica_sync_warm_blocks",
                "Blocks this replica's approximate indexes held after adopting a sibling's at start \
                 (0: it started cold).",
            )?,
        })
    }

    pub(super) fn watch(&self, stats: Arc<SyncStats>) {
        *self.source.lock().unwrap_or_else(PoisonError::into_inner) = Some(stats);
    }
}

/// The registered collector.
pub(super) struct ReplicaSyncCollector(pub(super) Arc<ReplicaSyncCounters>);

impl Collector for ReplicaSyncCollector {
    fn desc(&self) -> Vec<&Desc> {
        descs(&[
            &self.0.sent,
            &self.0.received,
            &self.0.key_reloads,
            &self.0.snapshots_served,
            &self.0.warm_start,
            &self.0.warm_blocks,
        ])
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let source = self
            .0
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(stats) = source else {
            return Vec::new();
        };
        let sent = self.0.sent.clone();
        sent.reset();
        let (ok, failed) = stats.sent();
        sent.with_label_values(&["ok"]).inc_by(ok);
        sent.with_label_values(&["failed"]).inc_by(failed);
        let received = self.0.received.clone();
        received.reset();
        for outcome in Received::ALL {
            received
                .with_label_values(&[outcome.as_str()])
                .inc_by(stats.received(outcome));
        }
        let reloads = self.0.key_reloads.clone();
        reloads.reset();
        let (applied, failed) = stats.key_reloads();
        reloads.with_label_values(&["applied"]).inc_by(applied);
        reloads.with_label_values(&["failed"]).inc_by(failed);
        let served = self.0.snapshots_served.clone();
        served.reset();
        for outcome in Served::ALL {
            served
                .with_label_values(&[outcome.as_str()])
                .inc_by(stats.served(outcome));
        }
        let warm = self.0.warm_start.clone();
        warm.reset();
        for outcome in Warmed::ALL {
            warm.with_label_values(&[outcome.as_str()])
                .inc_by(stats.warmed(outcome));
        }
        self.0
            .warm_blocks
            .set(i64::try_from(stats.warm_blocks()).unwrap_or(i64::MAX));
        samples(&[
            &sent,
            &received,
            &reloads,
            &served,
            &warm,
            &self.0.warm_blocks,
        ])
    }
}

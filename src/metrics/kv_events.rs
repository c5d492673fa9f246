//! `cachepick_kv_events_*`: every KV event stream's state and counters, read off the streams each time
//! `/metrics` is read (the subscribers own the counters; nothing here waits on them).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, IntGaugeVec, Opts};

use super::families::{descs, samples};
use crate::events::Medium;
use crate::events::stream::{ResetReason, StreamState, StreamView};

/// Where the stream views come from: every `events` pool's, by pool label.
pub type StreamSource = Arc<dyn Fn(Instant) -> Vec<(String, Vec<StreamView>)> + Send + Sync>;

const STREAM: [&str; 3] = ["pool", "worker", "rank"];

/// The families, as templates: each collection fills fresh copies, so a stream that is gone leaves
/// no series behind.
pub(super) struct KvEventGauges {
    sources: Mutex<Vec<StreamSource>>,
    template: Families,
}

struct Families {
    state: IntGaugeVec,
    last_seq: IntGaugeVec,
    batches: IntCounterVec,
    events: IntCounterVec,
    blocks: IntCounterVec,
    skipped: IntCounterVec,
    gaps: IntCounterVec,
    replays: IntCounterVec,
    resets: IntCounterVec,
    refused: IntCounterVec,
    held: IntGaugeVec,
    socket: IntGaugeVec,
}

impl Families {
    fn new() -> Result<Families, prometheus::Error> {
        let with = |extra: &'static str| -> Vec<&'static str> {
            let mut labels = STREAM.to_vec();
            labels.push(extra);
            labels
        };
        Ok(Families {
            state: IntGaugeVec::new(
                Opts::new(
                    "cachepick_kv_events_stream_state",
                    "1 for the state each worker rank's KV event stream is in (connecting, live, stale).",
                ),
                &with("state"),
            )?,
            last_seq: IntGaugeVec::new(
                Opts::new(
                    "cachepick_kv_events_last_seq",
                    "The last batch sequence number applied from the stream (-1 before the first).",
                ),
                &STREAM,
            )?,
            batches: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_batches_total",
                    "Event batches applied.",
                ),
                &STREAM,
            )?,
            events: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_events_total",
                    "Events received in applied batches.",
                ),
                &STREAM,
            )?,
            blocks: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_blocks_total",
                    "GPU blocks the stream stored in, or removed from, the owner index.",
                ),
                &with("op"),
            )?,
            skipped: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_skipped_total",
                    "What the stream could not use: orphan blocks (unknown parent), blocks over the \
                     worker's bound, blocks with multimodal keys, unknown events, undecodable messages, \
                     live duplicates of replayed batches.",
                ),
                &with("reason"),
            )?,
            gaps: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_gaps_total",
                    "Sequence gaps seen on the live stream (lost batches).",
                ),
                &STREAM,
            )?,
            replays: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_replays_total",
                    "Replays requested from the engine's replay socket, by outcome.",
                ),
                &with("outcome"),
            )?,
            resets: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_resets_total",
                    "Times the worker rank's entries were forgotten: an engine restart, a gap replay \
                     could not heal, the engine clearing its cache, a stream down past its grace.",
                ),
                &with("reason"),
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "cachepick_kv_events_refused_total",
                    "What the stream refused for its size: a live message over the byte limit \
                     (refused from its frame header, unread; the connection is closed and the stream \
                     reconnects), a replay over its batch or byte budget (abandoned).",
                ),
                &with("what"),
            )?,
            held: IntGaugeVec::new(
                Opts::new(
                    "cachepick_kv_events_blocks_held",
                    "Blocks the engine reports holding, per tier (only gpu blocks make an owner).",
                ),
                &with("tier"),
            )?,
            socket: IntGaugeVec::new(
                Opts::new(
                    "cachepick_kv_events_stream_socket",
                    "1 for the socket each stream subscribes to and who named it: the worker's \
                     kv_events (worker), the pool's ports (pool) or the engine when asked (engine).",
                ),
                &[STREAM[0], STREAM[1], STREAM[2], "socket", "from"],
            )?,
        })
    }

    fn collectors(&self) -> [&dyn Collector; 12] {
        [
            &self.state,
            &self.last_seq,
            &self.batches,
            &self.events,
            &self.blocks,
            &self.skipped,
            &self.gaps,
            &self.replays,
            &self.resets,
            &self.refused,
            &self.held,
            &self.socket,
        ]
    }
}

impl std::fmt::Debug for KvEventGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sources = self.sources.lock().map_or(0, |sources| sources.len());
        f.debug_struct("KvEventGauges")
            .field("sources", &sources)
            .finish()
    }
}

impl KvEventGauges {
    pub(super) fn new() -> Result<KvEventGauges, prometheus::Error> {
        Ok(KvEventGauges {
            sources: Mutex::new(Vec::new()),
            template: Families::new()?,
        })
    }

    pub(super) fn watch(&self, source: StreamSource) {
        if let Ok(mut sources) = self.sources.lock() {
            sources.push(source);
        }
    }

    fn collect_at(&self, now: Instant) -> Vec<MetricFamily> {
        let sources: Vec<StreamSource> = self
            .sources
            .lock()
            .map(|sources| sources.clone())
            .unwrap_or_default();
        if sources.is_empty() {
            return Vec::new();
        }
        let Ok(families) = Families::new() else {
            return Vec::new();
        };
        for source in sources {
            for (pool, streams) in source(now) {
                for view in streams {
                    record(&families, &pool, &view);
                }
            }
        }
        samples(&families.collectors())
    }
}

fn record(families: &Families, pool: &str, view: &StreamView) {
    let worker = view.worker.0.to_string();
    let rank = view.rank.to_string();
    let stream = [pool, worker.as_str(), rank.as_str()];
    let with = |extra: &'static str| [pool, worker.as_str(), rank.as_str(), extra];
    for state in StreamState::ALL {
        families
            .state
            .with_label_values(&with(state.as_str()))
            .set(i64::from(state == view.state));
    }
    let socket = view.live.to_string();
    families
        .socket
        .with_label_values(&[pool, &worker, &rank, &socket, view.from.as_str()])
        .set(1);
    families.last_seq.with_label_values(&stream).set(
        view.last_seq
            .map_or(-1, |seq| i64::try_from(seq).unwrap_or(i64::MAX)),
    );
    for (family, count) in [
        (&families.batches, view.batches),
        (&families.events, view.events),
        (&families.gaps, view.gaps),
    ] {
        family.with_label_values(&stream).inc_by(count);
    }
    for (family, label, count) in [
        (&families.blocks, "stored", view.blocks_stored),
        (&families.blocks, "removed", view.blocks_removed),
        (&families.skipped, "orphan", view.orphans),
        (&families.skipped, "over_bound", view.over_bound),
        (&families.skipped, "multimodal", view.opaque),
        (&families.skipped, "unknown_event", view.unknown_events),
        (&families.skipped, "undecodable", view.decode_errors),
        (&families.skipped, "duplicate", view.duplicates),
        (&families.replays, "ok", view.replays),
        (&families.replays, "failed", view.replay_failures),
        (&families.refused, "live_message", view.refused_frames),
        (&families.refused, "replay", view.refused_replays),
    ] {
        family.with_label_values(&with(label)).inc_by(count);
    }
    for (reason, count) in view.resets {
        debug_assert!(ResetReason::ALL.contains(&reason));
        families
            .resets
            .with_label_values(&with(reason.as_str()))
            .inc_by(count);
    }
    for (tier, blocks) in view.tiers {
        debug_assert!(Medium::ALL.contains(&tier));
        families
            .held
            .with_label_values(&with(tier.as_str()))
            .set(i64::try_from(blocks).unwrap_or(i64::MAX));
    }
}

/// Registers the families' descriptions while `Metrics` keeps its handle to add sources.
#[derive(Debug)]
pub(super) struct KvEventCollector(pub(super) Arc<KvEventGauges>);

impl Collector for KvEventCollector {
    fn desc(&self) -> Vec<&Desc> {
        descs(&self.0.template.collectors())
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect_at(Instant::now())
    }
}

//! "What does cachepick see?": a worker-by-worker view of a snapshot, as a table or JSON.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::snapshot::{Lifecycle, PoolSnapshot, PrefillEstimate, ScrapeOutcome, WorkerState};

/// One worker's reading as an operator reads it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerView {
    pub endpoint: String,
    /// The worker's slot: the id decisions and `explain` name it by.
    pub id: u32,
    pub role: &'static str,
    /// Its lifecycle state: new, healthy, late, unreachable, draining or restarted.
    pub state: &'static str,
    /// Engine restarts seen since it joined.
    pub restarts: u64,
    pub fresh: bool,
    /// Why the reading does not count, when it does not.
    pub why_not_fresh: Option<String>,
    pub waiting: Option<u64>,
    pub running: Option<u64>,
    pub waiting_uncached_tokens: Option<u64>,
    pub used_tokens: Option<u64>,
    pub max_total_tokens: Option<u64>,
    pub max_running: Option<u64>,
    /// `used_tokens / max_total_tokens`, where both are known.
    pub kv_usage: Option<f64>,
    pub age_seconds: Option<f64>,
    pub scrapes: u64,
    pub last_outcome: Option<ScrapeOutcome>,
    pub last_error: Option<String>,
    /// The engine's KV block (its `cache_config_info`, else the pool's `engine_block_size`): a match
    /// counts in whole blocks of it.
    pub engine_block: Option<u64>,
    /// What its engine taught: the prefill rate (its prefill histograms), the queue's drain rate,
    /// uncached tokens per request and the engine's own mean queue wait.
    pub prefill: PrefillEstimate,
}

/// A pool's snapshot as an operator reads it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolView {
    pub pool: String,
    pub version: u64,
    pub freshness_seconds: f64,
    pub workers: Vec<WorkerView>,
}

impl PoolView {
    pub fn new(pool: &str, snapshot: &PoolSnapshot, now: Instant) -> Self {
        PoolView {
            pool: pool.to_owned(),
            version: snapshot.version,
            freshness_seconds: snapshot.freshness.as_secs_f64(),
            workers: snapshot
                .workers()
                .iter()
                .map(|worker| worker_view(snapshot, worker, now))
                .collect(),
        }
    }
}

fn worker_view(snapshot: &PoolSnapshot, worker: &WorkerState, now: Instant) -> WorkerView {
    let reading = worker.reading.as_ref();
    let fresh = reading.is_some_and(|reading| snapshot.is_fresh(reading, now));
    let age = reading.map(|reading| now.saturating_duration_since(reading.captured_at));
    let last_error = worker.scrape.last_error.as_deref().map(str::to_owned);
    let why_not_fresh = match (reading, age) {
        _ if fresh => None,
        (None, _) => Some(match &last_error {
            Some(error) => format!("no reading yet: {error}"),
            None => "no reading yet".to_owned(),
        }),
        (Some(reading), _) if !reading.complete => Some(format!(
            "incomplete: {}",
            last_error
                .as_deref()
                .unwrap_or("not every rank has reported")
        )),
        (Some(_), Some(age)) => Some(format!(
            "reading {} old, freshness is {}{}{}",
            seconds(age),
            seconds(snapshot.freshness),
            last_error
                .as_deref()
                .map(|error| format!("; last scrape: {error}"))
                .unwrap_or_default(),
            if worker.lifecycle == Lifecycle::Late {
                "; late, not gone: still an owner, and its gate fails open until it answers"
            } else {
                ""
            }
        )),
        (Some(_), None) => None,
    };
    let load = reading.map(|reading| reading.load);
    let used_tokens = load.and_then(|load| load.used_tokens);
    WorkerView {
        endpoint: worker.endpoint.to_string(),
        id: worker.id.0,
        role: worker.role.as_str(),
        state: worker.lifecycle.as_str(),
        restarts: worker.incarnation,
        fresh,
        why_not_fresh,
        waiting: load.map(|load| load.waiting),
        running: load.map(|load| load.running),
        waiting_uncached_tokens: load.and_then(|load| load.waiting_uncached_tokens),
        used_tokens,
        max_total_tokens: worker.capacity.max_total_tokens,
        max_running: worker.capacity.max_running,
        kv_usage: used_tokens
            .zip(worker.capacity.max_total_tokens)
            .filter(|(_, max)| *max > 0)
            .map(|(used, max)| used as f64 / max as f64),
        age_seconds: age.map(|age| age.as_secs_f64()),
        scrapes: worker.scrape.attempts,
        last_outcome: worker.scrape.last_outcome,
        last_error,
        engine_block: worker.capacity.engine_block,
        prefill: worker.prefill,
    }
}

fn seconds(duration: Duration) -> String {
    format!("{:.1}s", duration.as_secs_f64())
}

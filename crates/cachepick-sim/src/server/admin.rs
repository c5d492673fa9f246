//! The admin controls and what the metrics controls change: how `/metrics` and `/v1/loads` answer.
//!
//! | route | body | effect |
//! |---|---|---|
//! | `GET /admin/state` | | the worker's state (every control answers it too) |
//! | `POST /admin/config` | `SimParams` keys (JSON or YAML) | new parameters, limits at once |
//! | `POST /admin/metrics` | `{"mode": "live\|frozen\|hang\|fail\|garbage", "fake": {...} \| null}` | how `/metrics` answers |
//! | `POST /admin/pause`, `/admin/resume` | | stop and resume every request's progress |
//! | `POST /admin/crash` | `{"restart_after_ms": N}` or nothing | die (and come back empty after N ms): ports closed, cache, queue and KV event seq and ring lost |
//! | `POST /admin/kv-events` | `{"drop_next": N, "unreplayable": bool, "rank": r}` | the next N KV event batches of every rank (or of rank `r`) are not sent on the live socket; they still take their seq and, unless `unreplayable`, enter the replay ring (409 when events are off) |
//!
//! `drop_next` is PUB/SUB loss as a subscriber sees it: a gap in seq that a replay request heals;
//! with `unreplayable: true` the dropped batches are kept out of the ring too, so the replay starts
//! after them. A new `drop_next` replaces the previous one; `{"drop_next": 0}` cancels it.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{Body, Incarnation, Shared, error, full, json, kill, lock, restart, text};
use crate::config::SimParams;
use crate::expo;
use crate::stats::RankStats;

/// How `/metrics` (and `/v1/loads`) answer; set through `/admin/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsMode {
    /// The model's state now.
    #[default]
    Live,
    /// The text captured when this mode was set, repeated: a stuck exporter.
    Frozen,
    /// Accepts the request and never answers.
    Hang,
    /// 500.
    Fail,
    /// 200 with bytes that are not an exposition.
    Garbage,
}

/// Values reported instead of the model's, on every rank; `None` keeps the model's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FakeMetrics {
    pub waiting: Option<u64>,
    pub running: Option<u64>,
    pub kv_usage: Option<f64>,
}

/// Run-time controls.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Controls {
    metrics: MetricsMode,
    fake: Option<FakeMetrics>,
}

// Metrics.

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Scrape {
    Metrics,
    Loads,
}

/// The ranks' stats with the fake values applied.
fn reported(shared: &Shared, incarnation: &Incarnation) -> Vec<RankStats> {
    let fake = lock(&shared.controls).fake;
    let mut stats = incarnation.stats(
        shared
            .transferring
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    if let Some(fake) = fake {
        for rank in &mut stats {
            if let Some(waiting) = fake.waiting {
                rank.waiting = waiting;
            }
            if let Some(running) = fake.running {
                rank.running = running;
            }
            if let Some(usage) = fake.kv_usage {
                let used = (usage.clamp(0.0, 1.0) * rank.kv_total_blocks as f64).round();
                rank.kv_pinned_blocks = used as u64;
                rank.kv_used_blocks = rank.kv_used_blocks.max(used as u64);
            }
        }
    }
    stats
}

fn render(shared: &Shared, incarnation: &Incarnation) -> (String, Vec<u8>) {
    let stats = reported(shared, incarnation);
    (
        expo::render_metrics(shared.spec.engine, &shared.spec.model, &stats),
        expo::render_loads(&stats),
    )
}

pub(super) async fn metrics(
    shared: &Shared,
    incarnation: &Incarnation,
    scrape: Scrape,
) -> Response<Body> {
    let mode = lock(&shared.controls).metrics;
    if mode == MetricsMode::Live {
        // Rendered on the API server's loop, after what it has queued (`api_work`).
        let api_metrics = shared.params.load().profile.api_metrics;
        tokio::time::sleep_until(super::api::api_work(shared, api_metrics)).await;
    }
    let (exposition, loads) = match mode {
        MetricsMode::Live => render(shared, incarnation),
        MetricsMode::Frozen => lock(&shared.frozen)
            .clone()
            .unwrap_or_else(|| render(shared, incarnation)),
        MetricsMode::Hang => {
            std::future::pending::<()>().await;
            (String::new(), Vec::new())
        }
        MetricsMode::Fail => {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "metrics failure (admin)");
        }
        MetricsMode::Garbage => {
            return text(
                StatusCode::OK,
                "<html>\u{0}\u{1} not an exposition {{{{ \"loads\": ]]\n".to_owned(),
            );
        }
    };
    match scrape {
        Scrape::Metrics => full(
            StatusCode::OK,
            exposition,
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        Scrape::Loads => json(StatusCode::OK, loads),
    }
}

// Admin.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricsControl {
    mode: Option<MetricsMode>,
    /// `null` clears the fake values; absent keeps them.
    #[serde(default, deserialize_with = "present")]
    fake: Option<Option<FakeMetrics>>,
}

fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

/// What `/admin/metrics` accepts, as a refusal says it.
const METRICS_CONTROL: &str = concat!(
    r#"{"mode": "live|frozen|hang|fail|garbage", "#,
    r#""fake": {"waiting", "running", "kv_usage"} | null}"#
);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KvEventsControl {
    drop_next: u64,
    #[serde(default)]
    unreplayable: bool,
    /// Only this rank; absent is every rank.
    rank: Option<usize>,
}

/// What `/admin/kv-events` accepts, as a refusal says it.
const KV_EVENTS_CONTROL: &str = r#"{"drop_next": N, "unreplayable": false, "rank": R (optional)}"#;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CrashControl {
    /// Restart by itself after this long; absent stays down until the fleet control restarts it.
    restart_after_ms: Option<u64>,
}

// Over 100 lines: one arm per admin endpoint, each a few lines.
pub(super) async fn admin(
    shared: &Arc<Shared>,
    incarnation: &Incarnation,
    method: &Method,
    path: &str,
    body: &[u8],
) -> Response<Body> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    match (method, path) {
        (&Method::GET, "/admin/state") => state(shared, incarnation),
        (&Method::POST, "/admin/config") => {
            let source = String::from_utf8_lossy(body);
            let current = shared.params.load_full();
            match crate::decode::parse_params(
                &source,
                &current,
                shared.spec.timing,
                shared.spec.engine,
            ) {
                Ok(params) => {
                    apply_params(shared, incarnation, params);
                    state(shared, incarnation)
                }
                Err(problem) => error(StatusCode::BAD_REQUEST, &problem.to_string()),
            }
        }
        (&Method::POST, "/admin/metrics") => {
            let control: MetricsControl = match decode_control(body, METRICS_CONTROL) {
                Ok(control) => control,
                Err(message) => return error(StatusCode::BAD_REQUEST, &message),
            };
            if control.mode == Some(MetricsMode::Frozen) {
                *lock(&shared.frozen) = Some(render(shared, incarnation));
            }
            let mut controls = lock(&shared.controls);
            if let Some(mode) = control.mode {
                controls.metrics = mode;
            }
            if let Some(fake) = control.fake {
                controls.fake = fake;
            }
            drop(controls);
            state(shared, incarnation)
        }
        (&Method::POST, "/admin/pause") => {
            shared.paused.send_replace(true);
            state(shared, incarnation)
        }
        (&Method::POST, "/admin/resume") => {
            shared.paused.send_replace(false);
            state(shared, incarnation)
        }
        (&Method::POST, "/admin/kv-events") => {
            let control: KvEventsControl = match decode_control(body, KV_EVENTS_CONTROL) {
                Ok(control) => control,
                Err(message) => return error(StatusCode::BAD_REQUEST, &message),
            };
            if shared.kv_events.is_none() {
                return error(
                    StatusCode::CONFLICT,
                    "KV events are off on this worker (set `kv_events:` in the simulator's file)",
                );
            }
            if let Some(rank) = control.rank
                && rank >= incarnation.ranks.len()
            {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("no rank {rank}: the worker has {}", incarnation.ranks.len()),
                );
            }
            for (index, rank) in incarnation.ranks.iter().enumerate() {
                if control.rank.is_none_or(|only| only == index) {
                    let mut rank = lock(rank);
                    if let Some(stream) = &mut rank.events {
                        stream.drop_next(control.drop_next, control.unreplayable);
                    }
                }
            }
            state(shared, incarnation)
        }
        (&Method::POST, "/admin/crash") => {
            let control: CrashControl =
                match decode_control(body, r#"{"restart_after_ms": N} or nothing"#) {
                    Ok(control) => control,
                    Err(message) => return error(StatusCode::BAD_REQUEST, &message),
                };
            // Answer first, then die: the caller learns the crash was accepted.
            let shared = Arc::clone(shared);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                kill(&shared).await;
                if let Some(after) = control.restart_after_ms {
                    tokio::time::sleep(Duration::from_millis(after)).await;
                    let _ = restart(&shared).await;
                }
            });
            json(StatusCode::ACCEPTED, b"{\"crashing\": true}".to_vec())
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no admin route {method} {path}"),
        ),
    }
}

/// A control's JSON body, or the message that says what it was `expected` to be.
fn decode_control<T: DeserializeOwned>(body: &[u8], expected: &str) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|problem| format!("expected {expected}: {problem}"))
}

/// `200` with the worker's state, the answer to every control that succeeds.
fn state(shared: &Shared, incarnation: &Incarnation) -> Response<Body> {
    json(StatusCode::OK, state_json(shared, incarnation))
}

/// Installs new parameters; limits apply to the models at once (and may admit waiting requests),
/// timings from each request's next step.
fn apply_params(shared: &Shared, incarnation: &Incarnation, params: SimParams) {
    for rank in &incarnation.ranks {
        let mut rank = lock(rank);
        let admitted = rank
            .engine
            .set_params(shared.spec.engine, shared.spec.block_size, &params);
        rank.publish_events();
        rank.wake(admitted);
    }
    shared.params.store(Arc::new(params));
}

fn state_json(shared: &Shared, incarnation: &Incarnation) -> Vec<u8> {
    let params = shared.params.load_full();
    let controls = *lock(&shared.controls);
    let streams: Vec<Option<serde_json::Value>> = incarnation
        .ranks
        .iter()
        .map(|rank| {
            lock(rank)
                .events
                .as_ref()
                .and_then(|stream| serde_json::to_value(stream.state()).ok())
        })
        .collect();
    let ranks: Vec<serde_json::Value> = incarnation
        .stats(
            shared
                .transferring
                .load(std::sync::atomic::Ordering::Relaxed),
        )
        .iter()
        .zip(streams)
        .map(|(rank, stream)| {
            serde_json::json!({
                "kv_events": stream,
                "rank": rank.rank,
                "running": rank.running,
                "waiting": rank.waiting,
                "requests": rank.requests,
                "waiting_uncached_tokens": rank.waiting_uncached_tokens,
                "kv_used_blocks": rank.kv_used_blocks,
                "kv_pinned_blocks": rank.kv_pinned_blocks,
                "kv_total_blocks": rank.kv_total_blocks,
                "block_size": rank.block_size,
                "max_running": rank.max_running,
                "prompt_tokens": rank.counters.prompt_tokens,
                "generation_tokens": rank.counters.generation_tokens,
                "prefix_queried_tokens": rank.counters.prefix_queried_tokens,
                "prefix_hit_tokens": rank.counters.prefix_hit_tokens,
                "finished": rank.counters.finished_length,
                "aborted": rank.counters.aborted,
                "rejected": rank.counters.rejected,
                "evicted_blocks": rank.counters.evicted_blocks,
                "preemptions": rank.counters.preemptions,
                "busy_seconds": rank.busy_seconds,
                "steps": rank.steps,
                "lagged_seconds": rank.lagged_seconds,
            })
        })
        .collect();
    let value = serde_json::json!({
        "id": shared.id,
        "index": shared.spec.index,
        "engine": shared.spec.engine.as_str(),
        "timing": shared.spec.timing.as_str(),
        "model": shared.spec.model,
        "paused": *shared.paused.borrow(),
        "metrics_mode": controls.metrics,
        "fake_metrics": controls.fake,
        "params": params_json(&params),
        "kv_events": shared.kv_events.as_ref().map(|events| serde_json::json!({
            "format": events.format.as_str(),
            "topic": events.topic,
            "endpoints": events.ranks.iter().map(|rank| serde_json::json!({
                "rank": rank.rank,
                "live": format!("tcp://{}", rank.live),
                "replay": rank.replay.map(|addr| format!("tcp://{addr}")),
            })).collect::<Vec<_>>(),
        })),
        "ranks": ranks,
    });
    serde_json::to_vec_pretty(&value).unwrap_or_default()
}

fn params_json(params: &SimParams) -> serde_json::Value {
    let ms = |duration: Duration| duration.as_secs_f64() * 1000.0;
    let profile = &params.profile;
    serde_json::json!({
        "profile": {
            "name": profile.name,
            "step_overhead_ms": profile.step_overhead * 1e3,
            "weight_read_ms": profile.weight_read * 1e3,
            "per_token_us": profile.per_token * 1e6,
            "blend": profile.blend,
            "attention_pair_ns": profile.attention_pair * 1e9,
            "kv_read_ns": profile.kv_read * 1e9,
            "per_sequence_us": profile.per_sequence * 1e6,
            "front_ms": profile.front * 1e3,
            "api_token_us": profile.api_token * 1e6,
            "api_output_us": profile.api_output * 1e6,
            "api_metrics_ms": profile.api_metrics * 1e3,
        },
        "batch_tokens": params.batch_tokens,
        "max_prefill_tokens": params.max_prefill_tokens,
        "schedule_policy": params.schedule_policy.as_str(),
        "kv_blocks": params.kv_blocks,
        "max_running": params.max_running,
        "max_queue": params.max_queue,
        "max_model_len": params.max_model_len,
        "default_max_tokens": params.default_max_tokens,
        "prefill_overhead_ms": ms(params.prefill_overhead),
        "prefill_per_token_ms": ms(params.prefill_per_token),
        "inter_token_latency_ms": ms(params.inter_token_latency),
        "load_slowdown": params.load_slowdown,
        "jitter": params.jitter,
        "time_scale": params.time_scale,
        "failure_rate": params.failure_rate,
    })
}

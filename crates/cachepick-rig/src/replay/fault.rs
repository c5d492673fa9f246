//! The fault arm of `cachepick replay`: one worker crashes mid-run (the simulator's `/admin/crash`) and
//! restarts with an empty cache, and the report counts the picker's *stale credits* — requests it sent
//! to the restarted worker claiming a prefix the worker no longer held.
//!
//! A picker whose owner index is learned from its own decisions (`approximate`) keeps crediting the
//! restarted worker with everything it held before the crash until those entries age out; one fed by the
//! engines' KV cache events (`events`) hears the worker's cache go and stops. The windows after the
//! restart (its first second, then the rest) show how fast the credits stop; the window before the
//! crash is the baseline (credits the index gets wrong anyway, through evictions it cannot see).

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use cachepick_sim::fleet::Fleet;

use super::drive::{End, Sample};

/// The decision reason that says the picker chose the worker for the prefix it holds.
const CACHE_HIT: &str = "cache_hit";
/// The first window after the restart: the figure events mode must bring to zero.
pub const FIRST_WINDOW: Duration = Duration::from_secs(1);
/// How long a crashed worker may take to come back beyond its `restart_after`.
const RESTART_GRACE: Duration = Duration::from_secs(10);

/// What to crash, when, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Crash {
    /// The worker's index in the fleet (configuration order, from 0).
    pub worker: usize,
    /// Replay time of the crash, from the first arrival.
    #[serde(rename = "at_s", serialize_with = "seconds")]
    pub at: Duration,
    /// How long the worker stays down before it restarts by itself (empty cache, empty queue).
    #[serde(rename = "restart_after_s", serialize_with = "seconds")]
    pub restart_after: Duration,
}

fn seconds<S: serde::Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64())
}

/// When the crash happened and when the worker was serving again, replay time from the first arrival.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrashTimes {
    pub crashed: Duration,
    /// When the worker was first seen down (its ports closing): on a loaded machine its death can
    /// come well after the ~20 ms it asks for.
    pub died: Duration,
    pub restarted: Duration,
}

/// One window's count of requests the restarted worker served.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StaleWindow {
    /// `before crash`, `first 1 s after restart`, `after`.
    pub window: String,
    /// Start of the window, seconds of replay time.
    pub from_s: f64,
    /// End of the window; `None` runs to the end of the replay.
    pub to_s: Option<f64>,
    /// Requests the worker served to the end (with usage).
    pub served: u64,
    /// Of those, the ones the picker sent there for a prefix it credited the worker with (reason
    /// `cache_hit`, or matched tokens > 0).
    pub credited: u64,
    /// Of those, the ones the worker served with 0 cached tokens: the credit was stale.
    pub stale: u64,
    /// Of the stale ones, those the in-flight race explains: an earlier request with the same first
    /// prefix block, sent to the same worker in the same process's life, had not had its first token
    /// when this one was sent, so the engine could not have cached the prefix yet, whatever the index
    /// knew.
    pub in_flight: u64,
    /// Of the stale ones, those for a prefix the process had cached and no longer held: an earlier
    /// request with the same first block was sent to the worker in this process's life and had its
    /// first token before this one was sent. Evictions, which an index learned from decisions cannot
    /// see.
    pub evicted: u64,
    /// Of the stale ones, those for a prefix this process never had: no request with the same first
    /// block was sent to the worker in its life before this one. After the restart, the old process's
    /// prefixes: the crash's own stale credits.
    pub unlearned: u64,
}

/// The fault arm's figures for one arm of the replay.
#[derive(Clone, Debug, Serialize)]
pub struct FaultReport {
    pub worker_index: usize,
    /// The worker's endpoint (as `x-served-by` names it).
    pub worker: String,
    pub crash_at_s: f64,
    pub restart_at_s: f64,
    pub windows: Vec<StaleWindow>,
    /// Stale credits after the restart, all windows together.
    pub stale_credits: u64,
    /// Of those, the ones for the old process's prefixes ([`StaleWindow::unlearned`]).
    pub old_process: u64,
    /// When the crash could not be carried out as asked, why (the windows are then empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl FaultReport {
    /// The report of a crash at `times` on `worker` (its endpoint), from the run's samples.
    pub fn new(
        crash: &Crash,
        worker: String,
        times: CrashTimes,
        samples: &[Sample],
    ) -> FaultReport {
        let windows = stale_credits(samples, &worker, times);
        let after = || windows.iter().skip(1);
        FaultReport {
            worker_index: crash.worker,
            stale_credits: after().map(|window| window.stale).sum(),
            old_process: after().map(|window| window.unlearned).sum(),
            worker,
            crash_at_s: times.crashed.as_secs_f64(),
            restart_at_s: times.restarted.as_secs_f64(),
            windows,
            error: None,
        }
    }

    /// A crash that did not happen as asked.
    pub fn failed(crash: &Crash, worker: String, error: String) -> FaultReport {
        FaultReport {
            worker_index: crash.worker,
            worker,
            crash_at_s: crash.at.as_secs_f64(),
            restart_at_s: (crash.at + crash.restart_after).as_secs_f64(),
            windows: Vec::new(),
            stale_credits: 0,
            old_process: 0,
            error: Some(error),
        }
    }

    /// One line for the table: `before crash 3/40, first 1 s 5/6, after 2/30` (stale of credited).
    pub fn summary(&self) -> String {
        if let Some(error) = &self.error {
            return format!("crash failed: {error}");
        }
        let windows: Vec<String> = self
            .windows
            .iter()
            .map(|window| {
                format!(
                    "{} {} of {} credited ({} in flight, {} evicted, {} unlearned; {} served)",
                    window.window,
                    window.stale,
                    window.credited,
                    window.in_flight,
                    window.evicted,
                    window.unlearned,
                    window.served
                )
            })
            .collect();
        format!(
            "worker {} down at {:.1} s, back at {:.1} s: {}",
            self.worker,
            self.crash_at_s,
            self.restart_at_s,
            windows.join("; ")
        )
    }
}

/// Whether the picker credited the serving worker with a prefix: reason `cache_hit`, or matched tokens.
fn credited(sample: &Sample) -> bool {
    sample.reason == CACHE_HIT || sample.prefix_tokens.is_some_and(|tokens| tokens > 0)
}

/// Why a credit was stale (see [`StaleWindow`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    InFlight,
    Evicted,
    Unlearned,
}

/// The cause of `stale`, from the earlier requests with its first prefix block sent to the same worker
/// at or after `since` (the process's start).
fn cause(samples: &[Sample], stale: &Sample, since: Duration) -> Cause {
    let Some(block) = stale.first_block else {
        return Cause::Unlearned;
    };
    let mut earlier = samples.iter().filter(|earlier| {
        earlier.first_block == Some(block)
            && earlier.worker == stale.worker
            && earlier.at >= since
            && earlier.at < stale.at
    });
    let mut seen = false;
    let prefilling = earlier.any(|earlier| {
        seen = true;
        earlier.ttft.is_none_or(|ttft| earlier.at + ttft > stale.at)
    });
    match (prefilling, seen) {
        (true, _) => Cause::InFlight,
        (false, true) => Cause::Evicted,
        (false, false) => Cause::Unlearned,
    }
}

/// Per window (before the crash; the first [`FIRST_WINDOW`] after the restart; the rest), the requests
/// `worker` served to the end, those the picker credited it with a prefix for, those of them it
/// served with 0 cached tokens (stale credits), and of those the ones the in-flight race explains.
/// Requests are placed by their send time; those sent while the worker was down are in no window.
pub fn stale_credits(samples: &[Sample], worker: &str, times: CrashTimes) -> Vec<StaleWindow> {
    let first_end = times.restarted + FIRST_WINDOW;
    let bounds = [
        (
            "before crash".to_owned(),
            Duration::ZERO,
            Some(times.crashed),
        ),
        (
            format!("first {} s after restart", FIRST_WINDOW.as_secs()),
            times.restarted,
            Some(first_end),
        ),
        ("after".to_owned(), first_end, None),
    ];
    bounds
        .into_iter()
        .map(|(name, from, to)| {
            let mut window = StaleWindow {
                window: name,
                from_s: from.as_secs_f64(),
                to_s: to.map(|to| to.as_secs_f64()),
                ..StaleWindow::default()
            };
            let inside = samples.iter().filter(|sample| {
                sample.end == End::Ok
                    && sample.worker.as_deref() == Some(worker)
                    && sample.at >= from
                    && to.is_none_or(|to| sample.at < to)
            });
            for sample in inside {
                window.served += 1;
                if credited(sample) {
                    window.credited += 1;
                    if sample.cached_tokens == 0 {
                        window.stale += 1;
                        let since = if from < times.restarted {
                            Duration::ZERO
                        } else {
                            times.restarted
                        };
                        match cause(samples, sample, since) {
                            Cause::InFlight => window.in_flight += 1,
                            Cause::Evicted => window.evicted += 1,
                            Cause::Unlearned => window.unlearned += 1,
                        }
                    }
                }
            }
            window
        })
        .collect()
}

/// At `crash.at` after `start`, asks worker `crash.worker` of `fleet` to crash and restart after
/// `crash.restart_after` (`POST /admin/crash`), then watches it go down and come back.
pub async fn crash(fleet: &Fleet, crash: &Crash, start: Instant) -> Result<CrashTimes, String> {
    let worker = fleet.worker(crash.worker).ok_or_else(|| {
        format!(
            "no worker {} in a fleet of {}",
            crash.worker,
            fleet.workers().len()
        )
    })?;
    tokio::time::sleep_until(start + crash.at).await;
    let body = format!(
        "{{\"restart_after_ms\": {}}}",
        crash.restart_after.as_millis()
    );
    let answer = crate::http_exchange(
        http::Method::POST,
        worker.addr(),
        "/admin/crash",
        &body,
        Duration::from_secs(2),
    )
    .await;
    match answer {
        Some((202, _)) => {}
        Some((status, text)) => return Err(format!("/admin/crash answered {status}: {text}")),
        None => return Err("/admin/crash did not answer".to_owned()),
    }
    let crashed = start.elapsed();
    // The worker dies ~20 ms after accepting, and comes back `restart_after` later: watch for both, so
    // the windows start when it really serves again. A down spell too short to see counts as seen once
    // the restart is due.
    let due = Instant::now() + crash.restart_after + Duration::from_millis(50);
    let deadline = due + RESTART_GRACE;
    let mut down = false;
    let mut died = None;
    loop {
        let up = worker.is_up();
        if !up && died.is_none() {
            died = Some(start.elapsed());
        }
        down |= !up || Instant::now() >= due;
        if down && up {
            return Ok(CrashTimes {
                crashed,
                died: died.unwrap_or(crashed),
                restarted: start.elapsed(),
            });
        }
        if Instant::now() > deadline {
            return Err(format!(
                "worker {} did not come back within {:?} of its restart",
                worker.addr(),
                RESTART_GRACE
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRASHED: &str = "127.0.0.1:8001";
    const OTHER: &str = "127.0.0.1:8002";

    fn sample(at_ms: u64, worker: &str, reason: &str, prefix: Option<u64>, cached: u64) -> Sample {
        Sample {
            at: Duration::from_millis(at_ms),
            end: End::Ok,
            status: 200,
            reason: reason.to_owned(),
            worker: Some(worker.to_owned()),
            prefix_tokens: prefix,
            prompt_tokens: 4096,
            cached_tokens: cached,
            ..Sample::default()
        }
    }

    fn times() -> CrashTimes {
        CrashTimes {
            crashed: Duration::from_millis(2_000),
            died: Duration::from_millis(2_020),
            restarted: Duration::from_millis(2_500),
        }
    }

    #[test]
    fn stale_credits_are_credited_requests_the_restarted_worker_served_cold() {
        let samples = vec![
            // Before the crash: a credit that held, one that did not (an eviction), a plain miss.
            sample(100, CRASHED, "cache_hit", Some(2048), 2048),
            sample(200, CRASHED, "cache_hit", Some(2048), 0),
            sample(300, CRASHED, "cache_miss", Some(0), 0),
            // While down: in no window.
            sample(2_100, CRASHED, "cache_hit", Some(2048), 0),
            // First second after the restart: two stale credits (one by reason alone, one by matched
            // tokens under another reason), a miss, another worker's cold hit.
            sample(2_500, CRASHED, "cache_hit", None, 0),
            sample(2_600, CRASHED, "saturation_pin", Some(1024), 0),
            sample(2_700, CRASHED, "cache_miss", Some(0), 0),
            sample(2_800, OTHER, "cache_hit", Some(2048), 0),
            // After: one stale, one that held (the worker re-learned the prefix), one that failed.
            sample(3_500, CRASHED, "cache_hit", Some(2048), 0),
            sample(3_600, CRASHED, "cache_hit", Some(2048), 1024),
            Sample {
                end: End::Error,
                ..sample(3_700, CRASHED, "cache_hit", Some(2048), 0)
            },
        ];
        let windows = stale_credits(&samples, CRASHED, times());
        let counts: Vec<(&str, u64, u64, u64)> = windows
            .iter()
            .map(|w| (w.window.as_str(), w.served, w.credited, w.stale))
            .collect();
        assert_eq!(
            counts,
            [
                ("before crash", 3, 2, 1),
                ("first 1 s after restart", 3, 2, 2),
                ("after", 2, 2, 1),
            ]
        );
        assert_eq!(windows[1].from_s, 2.5);
        assert_eq!(windows[1].to_s, Some(3.5));
        assert_eq!(windows[2].to_s, None);

        let crash = Crash {
            worker: 0,
            at: Duration::from_secs(2),
            restart_after: Duration::from_millis(500),
        };
        let report = FaultReport::new(&crash, CRASHED.to_owned(), times(), &samples);
        assert_eq!(report.stale_credits, 3, "after the restart only");
        assert_eq!(report.old_process, 3, "no sample has a prefix block");
        assert!(report.summary().contains(
            "first 1 s after restart 2 of 2 credited (0 in flight, 0 evicted, 2 unlearned; 3 served)"
        ));
    }

    /// `sample` with its first prefix block and its time to first token.
    fn carrying(sample: Sample, block: u64, ttft_ms: u64) -> Sample {
        Sample {
            first_block: Some(block),
            ttft: Some(Duration::from_millis(ttft_ms)),
            ..sample
        }
    }

    #[test]
    fn a_stale_credit_is_in_flight_evicted_or_unlearned_by_what_the_process_was_sent_before() {
        let samples = vec![
            // Before the crash: the first request with block 7 prefills until 150 ms, so the credit
            // at 120 ms is in flight; the one at 400 ms came after both first tokens (evicted).
            carrying(sample(100, CRASHED, "cache_miss", Some(0), 0), 7, 50),
            carrying(sample(120, CRASHED, "cache_hit", Some(512), 0), 7, 10),
            carrying(sample(400, CRASHED, "cache_hit", Some(512), 0), 7, 10),
            // Block 8 prefilling on another worker explains nothing here (unlearned).
            carrying(sample(500, OTHER, "cache_miss", Some(0), 0), 8, 1_000),
            carrying(sample(600, CRASHED, "cache_hit", Some(512), 0), 8, 10),
            // Sent to the old process only: unlearned after the restart.
            carrying(sample(1_990, CRASHED, "cache_miss", Some(0), 0), 9, 5_000),
            carrying(sample(2_600, CRASHED, "cache_hit", Some(512), 0), 9, 10),
            // After the restart: sent to the new process, first token at 2_900 ms; the request at
            // 2_700 ms came while it prefilled.
            carrying(sample(2_650, CRASHED, "cache_miss", Some(0), 0), 10, 250),
            carrying(sample(2_700, CRASHED, "cache_hit", Some(512), 0), 10, 10),
            // A request that never had a first token is in flight to the end.
            Sample {
                ttft: None,
                ..carrying(sample(3_600, CRASHED, "cache_miss", Some(0), 0), 11, 0)
            },
            carrying(sample(3_900, CRASHED, "cache_hit", Some(512), 0), 11, 10),
        ];
        let windows = stale_credits(&samples, CRASHED, times());
        let counts: Vec<(u64, u64, u64, u64)> = windows
            .iter()
            .map(|w| (w.stale, w.in_flight, w.evicted, w.unlearned))
            .collect();
        assert_eq!(counts, [(3, 1, 1, 1), (2, 1, 0, 1), (1, 1, 0, 0)]);
        let crash = Crash {
            worker: 0,
            at: Duration::from_secs(2),
            restart_after: Duration::from_millis(500),
        };
        let report = FaultReport::new(&crash, CRASHED.to_owned(), times(), &samples);
        assert_eq!((report.stale_credits, report.old_process), (3, 1));
    }

    #[test]
    fn a_window_boundary_belongs_to_the_later_window() {
        let samples = vec![
            sample(2_000, CRASHED, "cache_hit", Some(512), 0),
            sample(3_500, CRASHED, "cache_hit", Some(512), 0),
        ];
        let windows = stale_credits(&samples, CRASHED, times());
        let stale: Vec<u64> = windows.iter().map(|w| w.stale).collect();
        assert_eq!(stale, [0, 0, 1]);
    }
}

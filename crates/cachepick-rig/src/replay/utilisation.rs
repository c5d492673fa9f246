//! How busy the fleet was during an arm, read from the simulated engines themselves (not from any
//! router's view of them), so a cachepick row and a peer router's row are measured alike.
//!
//! Every `every`, every rank of every worker is read: the share of its running slots in use, and
//! whether requests wait in its queue. Over the arrival window this says whether a run was below,
//! near or above the fleet's capacity: a fleet whose slots are mostly busy and whose queues are
//! rarely empty is saturated, whatever its routing. Under the step model a rank's running limit is the
//! engine's (a thousand sequences), so what tells load is how much of the window its GPU spent in
//! steps ([`Utilisation::busy`]), from the model time each rank counts.

use std::time::Duration;

use serde::Serialize;

use cachepick_sim::Timing;
use cachepick_sim::fleet::Fleet;

/// The fleet's load over one arm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Utilisation {
    /// Mean over readings and ranks of running requests ÷ running slots (`max_running`), in [0, 1].
    pub slots: f64,
    /// Share of readings, over ranks, where the rank had a request waiting in its queue.
    pub queued: f64,
    /// Mean requests waiting per rank.
    pub mean_waiting: f64,
    /// Readings taken (one per rank per tick).
    pub readings: u64,
    /// Step model: the share of the window the ranks' GPUs spent running steps, in [0, 1]; `None`
    /// under the slots model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy: Option<f64>,
    /// Wall seconds the ranks' engine loops gave up because the machine could not keep the model's
    /// pace, summed over ranks: above zero, the arm's timings are suspect.
    pub lagged_s: f64,
}

/// Reads the fleet every `every` for `window`, then returns what it saw; `None` if no rank was read.
pub async fn watch(fleet: &Fleet, window: Duration, every: Duration) -> Option<Utilisation> {
    let mut sum = Sums::default();
    // Each rank's model-time counters as last read; a restarted worker's start again from zero, so
    // they are summed reading by reading, not as one difference over the window.
    let mut last: Vec<(f64, f64)> = Vec::new();
    let mut busy = 0.0;
    let mut lagged = 0.0;
    let mut ranks = 0;
    let mut read = |sum: &mut Sums, count: bool| {
        let mut index = 0;
        for worker in fleet.workers() {
            for rank in worker.stats() {
                if count {
                    sum.add(rank.running, rank.max_running, rank.waiting);
                }
                let now = (rank.busy_seconds, rank.lagged_seconds);
                if let Some(before) = last.get_mut(index) {
                    let grew =
                        |now: f64, before: f64| if now >= before { now - before } else { now };
                    busy += grew(now.0, before.0);
                    lagged += grew(now.1, before.1);
                    *before = now;
                } else {
                    last.push(now);
                }
                index += 1;
            }
        }
        ranks = ranks.max(index);
    };
    read(&mut sum, false);
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let deadline = tokio::time::Instant::now() + window;
    loop {
        tick.tick().await;
        read(&mut sum, true);
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    let wall = started.elapsed().as_secs_f64() * ranks as f64;
    let busy = (fleet.config().timing == Timing::Step && wall > 0.0)
        .then(|| (busy * fleet.config().params.time_scale / wall).min(1.0));
    sum.finish().map(|utilisation| Utilisation {
        busy,
        lagged_s: lagged,
        ..utilisation
    })
}

#[derive(Default)]
struct Sums {
    slots: f64,
    queued: u64,
    waiting: u64,
    readings: u64,
}

impl Sums {
    fn add(&mut self, running: u64, max_running: u64, waiting: u64) {
        if max_running > 0 {
            self.slots += (running as f64 / max_running as f64).min(1.0);
        }
        self.queued += u64::from(waiting > 0);
        self.waiting += waiting;
        self.readings += 1;
    }

    fn finish(self) -> Option<Utilisation> {
        (self.readings > 0).then(|| {
            let n = self.readings as f64;
            Utilisation {
                slots: self.slots / n,
                queued: self.queued as f64 / n,
                mean_waiting: self.waiting as f64 / n,
                readings: self.readings,
                busy: None,
                lagged_s: 0.0,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_average_slot_use_and_queueing() {
        let mut sums = Sums::default();
        sums.add(8, 8, 3);
        sums.add(4, 8, 0);
        sums.add(0, 8, 0);
        sums.add(12, 8, 1); // beyond max_running after a shrink: counted as full
        let u = sums.finish().expect("readings");
        assert_eq!(u.readings, 4);
        assert!(
            (u.slots - (1.0 + 0.5 + 0.0 + 1.0) / 4.0).abs() < 1e-9,
            "{u:?}"
        );
        assert!((u.queued - 0.5).abs() < 1e-9, "{u:?}");
        assert!((u.mean_waiting - 1.0).abs() < 1e-9, "{u:?}");
        assert_eq!(Sums::default().finish(), None);
    }
}

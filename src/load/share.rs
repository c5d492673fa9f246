//! The fleet's share: how many requests reach a pool's workers for each one this replica sends them.
//!
//! Between two readings of a worker a replica knows only its own dispatches to it; other replicas
//! (and any client that bypasses cachepick) send theirs unseen. With `R` replicas behind one Envoy each
//! replica's window holds about 1/R of what the worker will have to prefill, and the time unit's queue
//! estimate is short by the rest. Every replica can see the total, though: the engines' counters. The
//! requests that arrived at a worker between two of its readings are those whose first token came
//! (`time_to_first_token_seconds_count`, which vLLM and SGLang export) plus the growth of its waiting
//! queue. Summed over the pool and set against this replica's own dispatches over the same windows,
//! they give the share: about 1 alone, about R among R replicas that share the traffic evenly, and
//! well above the replica count when traffic reaches the workers past cachepick.
//!
//! The time unit scales this replica's own window of uncached tokens by it (the request-count gate
//! keeps the own count, as the seed defines it), and it is published as
//! `cachepick_pool_dispatch_share`. The scale assumes the others sent where this replica did; it
//! prices the volume the others add, not where they put it, so it narrows the loss at three
//! replicas without closing it (BENCHMARKS.md: the runs that collapsed unscaled mostly do not).
//!
//! The windows are not exactly aligned (a request still in its prefill at a reading is counted one
//! reading late), so the sums are exponentially weighted over many readings, where those errors
//! cancel. The factor is never below 1: fewer arrivals than dispatches means late readings, not
//! fewer requests. It is capped at [`MAX_SCALE`], and it stays at 1 until [`MIN_SENT`] of this
//! replica's dispatches weigh in.

/// The most the factor may be: 32 replicas' worth of traffic per replica.
pub const MAX_SCALE: f64 = 32.0;
/// Weighted own dispatches below this leave the factor at 1: too few to tell the share.
pub const MIN_SENT: f64 = 8.0;
/// Weight kept per reading: the sums' time constant is 1 / (1 − DECAY) = 50 readings of the pool
/// (about three seconds of four workers read every 250 ms).
const DECAY: f64 = 0.98;

/// One worker's counters at its last reading, from which the next reading's arrivals follow.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Arrivals {
    last: Option<(f64, u64)>,
}

impl Arrivals {
    /// Requests that arrived since the last reading, from this reading's first-token count and waiting
    /// queue; `None` for the first reading, or when the engine exports no first-token count or the
    /// counter went back (a restart: the caller resets).
    pub(super) fn observe(&mut self, first_tokens: Option<f64>, waiting: u64) -> Option<f64> {
        let Some(first_tokens) = first_tokens else {
            self.last = None;
            return None;
        };
        let previous = self.last.replace((first_tokens, waiting));
        let (before, waited) = previous?;
        if first_tokens < before {
            return None;
        }
        // Not clipped at zero: a queue that shrinks before its requests' first tokens come gives a
        // negative term here and the matching positive one a reading later, and they must cancel.
        Some(first_tokens - before + waiting as f64 - waited as f64)
    }

    pub(super) fn reset(&mut self) {
        self.last = None;
    }
}

/// A pool's weighted arrivals and own dispatches.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ShareMeter {
    arrived: f64,
    sent: f64,
}

impl ShareMeter {
    /// One worker's reading: `arrived` requests reached it while this replica sent `sent`.
    pub(super) fn observe(&mut self, arrived: f64, sent: u64) {
        // An idle reading teaches nothing: a pool that goes quiet keeps the share it had.
        if sent == 0 && arrived == 0.0 {
            return;
        }
        self.arrived = self.arrived * DECAY + arrived;
        self.sent = self.sent * DECAY + sent as f64;
    }

    /// The factor this replica's own window is scaled by.
    pub(super) fn scale(&self) -> f64 {
        if self.sent < MIN_SENT {
            return 1.0;
        }
        (self.arrived / self.sent).clamp(1.0, MAX_SCALE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_first_tokens_plus_the_queues_growth() {
        let mut arrivals = Arrivals::default();
        assert_eq!(arrivals.observe(Some(10.0), 2), None, "no baseline yet");
        assert_eq!(arrivals.observe(Some(13.0), 4), Some(5.0));
        // A queue that drains into first tokens adds nothing new.
        assert_eq!(arrivals.observe(Some(17.0), 0), Some(0.0));
        // Requests that left the queue for a prefill not yet done count back when their tokens come.
        assert_eq!(arrivals.observe(Some(17.0), 0), Some(0.0));
        let (mut queued, mut drained) = (Arrivals::default(), 0.0);
        for (first_tokens, waiting) in [(0.0, 3), (1.0, 0), (4.0, 0)] {
            drained += queued.observe(Some(first_tokens), waiting).unwrap_or(0.0);
        }
        assert_eq!(
            drained, 1.0,
            "three left the queue, one of them new: the terms cancel"
        );
        // A counter that went back is a new run, not negative arrivals.
        assert_eq!(arrivals.observe(Some(1.0), 0), None);
        assert_eq!(arrivals.observe(Some(3.0), 0), Some(2.0));
        assert_eq!(arrivals.observe(None, 0), None);
        assert_eq!(arrivals.observe(Some(5.0), 0), None, "baseline lost");
    }

    #[test]
    fn three_replicas_sharing_the_traffic_scale_by_three_and_one_alone_by_one() {
        let (mut alone, mut third) = (ShareMeter::default(), ShareMeter::default());
        assert_eq!(third.scale(), 1.0, "nothing known yet");
        for reading in 0..200 {
            // Readings one late or one early: the noise the weighting averages out.
            let jitter = [0.0, 1.0, -1.0][reading % 3];
            alone.observe(3.0 + jitter, 3);
            third.observe(9.0 + jitter, 3);
        }
        assert!((alone.scale() - 1.0).abs() < 0.05, "{}", alone.scale());
        assert!((third.scale() - 3.0).abs() < 0.1, "{}", third.scale());
    }

    #[test]
    fn the_factor_is_bounded_and_needs_enough_dispatches() {
        let mut meter = ShareMeter::default();
        meter.observe(100.0, 1);
        assert_eq!(meter.scale(), 1.0, "one dispatch tells nothing");
        for _ in 0..100 {
            meter.observe(1_000.0, 1);
        }
        assert_eq!(meter.scale(), MAX_SCALE);
        let mut late = ShareMeter::default();
        for _ in 0..100 {
            late.observe(0.0, 5);
        }
        assert_eq!(late.scale(), 1.0, "late readings never shrink the window");
        let mut quiet = ShareMeter::default();
        for _ in 0..100 {
            quiet.observe(6.0, 2);
        }
        for _ in 0..1_000 {
            quiet.observe(0.0, 0);
        }
        assert!(
            (quiet.scale() - 3.0).abs() < 1e-9,
            "idle readings keep the share"
        );
    }
}

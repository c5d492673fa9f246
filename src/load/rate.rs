//! How fast each worker prefills, and how fast its queue drains, learned from what its engine exports.
//!
//! A time-unit gate prices each worker's queue and the request's own prefill. Two different speeds
//! set them, and the real engine showed they can be far apart: a vLLM with its sequence slots busy
//! decoding drains its queue at a few hundred tokens a second while each prefill runs at thousands.
//!
//! - **Prefill rate**, from signals that time the prefill itself: vLLM (≥ 0.13) observes, when a
//!   request finishes, the seconds from its first scheduling to its first token
//!   (`request_prefill_time_seconds`) and the uncached tokens that prefill computed
//!   (`request_prefill_kv_computed_tokens`). Their sums' growth is tokens over prefill-seconds: the
//!   speed of one prefill at the load the engine carries (prefills batched together each count the
//!   steps they share), the engine's own measure. Given once [`MIN_REQUESTS`] prefills are behind it.
//! - **Drain rate**, the queue's: between two readings that both show requests waiting, the engine
//!   was working the whole time (a queue never waits on an idle engine), so the uncached tokens it
//!   completed over the interval are how fast the queue ahead of a new request moves, slots and decode
//!   interference included. Intervals with an empty queue at either end are skipped, so an idle spell
//!   keeps what was learned. (A prefill under way at both readings does not qualify: the engine may
//!   have idled between two prefills, and learning from such intervals made the Mooncake replay's TTFT
//!   p90 7–27% worse, BENCHMARKS.md.) No drain rate is given before `load.prefill_rate_warmup` (5 s) of
//!   queued time. An engine without prefill histograms (SGLang, vLLM before 0.13) has its prefill
//!   priced at this rate, as every engine was before the real one showed the difference.
//! - **Tokens per request.** Uncached tokens over first tokens, across every interval.
//! - **Prefills under way** (vLLM: lookups counted at scheduling less prompts counted at completion),
//!   at the latest reading, times the share of recent lookups the cache did not serve. The latest
//!   reading, not the lesser of two: a long prefill started just before a scrape is the work a new
//!   request waits behind, while the dispatch that caused it is forgotten at that same reading.
//! - **Queue wait**, for operators: the mean time recent requests waited in the engine's queue, from
//!   its own histogram (`request_queue_time_seconds`), beside the wait the gate predicts.
//!
//! All are exponentially weighted sums with a half-life (`load.prefill_rate_half_life`, 30 s) of the
//! time they count, so every replica scraping the same counters learns the same estimates, and a
//! change of traffic mix or of hardware is followed within a minute. vLLM counts a prompt when its
//! prefill completes and its cache hits when it is scheduled, so one interval's difference can even
//! be negative; the sums absorb that.
#![deny(clippy::disallowed_methods)]

use std::time::Instant;

use super::engine::{Histograms, Progress};
use super::snapshot::PrefillEstimate;
use crate::config::RateWindow;

/// Requests (first tokens, or finished prefills) before a per-request mean or a prefill rate is given.
pub const MIN_REQUESTS: f64 = 4.0;

/// One worker's learning state; reset when its engine restarts.
#[derive(Clone, Debug, Default)]
pub struct PrefillMeter {
    window: RateWindow,
    last: Option<Mark>,
    busy_tokens: f64,
    busy_seconds: f64,
    request_tokens: f64,
    requests: f64,
    /// Lookups and cache hits counted at scheduling (vLLM), exponentially weighted: the share of a
    /// scheduled prompt the engine must compute.
    looked_up: f64,
    hit: f64,
    /// Prompt tokens of the prefills under way at the latest reading (cached part included).
    prefilling: Option<f64>,
    /// The prefill histograms' growth: tokens computed, prefill-seconds (each capped at its interval's
    /// busy wall time) and prefills finished.
    prefill_tokens: f64,
    prefill_seconds: f64,
    prefills: f64,
    /// The queue histogram's growth: seconds waited and requests.
    queue_seconds: f64,
    queued_requests: f64,
}

/// The counters at one reading.
#[derive(Clone, Copy, Debug)]
struct Mark {
    at: Instant,
    uncached: Option<f64>,
    first_tokens: Option<f64>,
    queried: Option<f64>,
    cached: Option<f64>,
    prefill: Histograms,
    queue: Histograms,
    /// Requests waiting.
    queued: bool,
}

/// The growth of a histogram's sums between two readings, when both have them and neither went back.
fn grown(before: &Histograms, now: &Histograms) -> Option<(f64, f64, Option<f64>)> {
    let seconds = now.seconds? - before.seconds?;
    let requests = now.requests? - before.requests?;
    let tokens = match (before.tokens, now.tokens) {
        (Some(before), Some(now)) if now >= before => Some(now - before),
        (Some(_), Some(_)) => return None,
        _ => None,
    };
    (seconds >= 0.0 && requests >= 0.0).then_some((seconds, requests, tokens))
}

impl PrefillMeter {
    pub fn new(window: RateWindow) -> Self {
        PrefillMeter {
            window,
            ..PrefillMeter::default()
        }
    }

    /// Forgets everything learned: the counters start again with a new run of the engine.
    pub fn reset(&mut self) {
        *self = PrefillMeter::new(self.window);
    }

    /// Takes one complete reading: the counters `progress` as of `at`, with `waiting` requests queued.
    pub fn observe(&mut self, at: Instant, progress: &Progress, waiting: u64) {
        if self.last.is_none_or(|last| at > last.at) {
            self.prefilling = progress.prefilling_tokens();
        }
        let mark = Mark {
            at,
            uncached: progress.uncached_tokens().filter(|value| value.is_finite()),
            first_tokens: progress.first_tokens,
            queried: progress.queried_tokens,
            cached: progress.cached_tokens,
            prefill: progress.prefill,
            queue: progress.queue,
            queued: waiting > 0,
        };
        let Some(last) = self.last else {
            self.last = Some(mark);
            return;
        };
        let Some(elapsed) = at.checked_duration_since(last.at).filter(|d| !d.is_zero()) else {
            // Out of order or the same instant: the newer counters stay, nothing is learned.
            return;
        };
        self.last = Some(mark);
        let seconds = elapsed.as_secs_f64();
        let keep = 0.5_f64.powf(seconds / self.window.half_life.as_secs_f64());
        self.learn_drain(&last, &mark, seconds, keep);
        self.learn_histograms(&last, &mark, keep);
    }

    /// The queue's drain, tokens per request and the share of lookups the cache missed, from the
    /// prompt, hit and first-token counters.
    fn learn_drain(&mut self, last: &Mark, mark: &Mark, seconds: f64, keep: f64) {
        let (Some(before), Some(now)) = (last.uncached, mark.uncached) else {
            return;
        };
        let tokens = now - before;
        if last.queued && mark.queued {
            self.busy_tokens = self.busy_tokens * keep + tokens;
            self.busy_seconds = self.busy_seconds * keep + seconds;
        }
        if let (Some(before), Some(now)) = (last.first_tokens, mark.first_tokens)
            && now >= before
        {
            self.request_tokens = self.request_tokens * keep + tokens;
            self.requests = self.requests * keep + (now - before);
        }
        if let (Some(q0), Some(q1), Some(c0), Some(c1)) =
            (last.queried, mark.queried, last.cached, mark.cached)
            && q1 >= q0
            && c1 >= c0
        {
            self.looked_up = self.looked_up * keep + (q1 - q0);
            self.hit = self.hit * keep + (c1 - c0);
        }
    }

    /// The prefill rate and the queue wait, from the engine's per-request histograms.
    fn learn_histograms(&mut self, last: &Mark, mark: &Mark, keep: f64) {
        if let Some((prefill_seconds, prefills, Some(tokens))) = grown(&last.prefill, &mark.prefill)
        {
            // Prefills side by side each count the steps they shared: the rate is the one a prefill
            // sees at the load the engine carries, which is what the request's own prefill will see.
            self.prefill_tokens = self.prefill_tokens * keep + tokens;
            self.prefill_seconds = self.prefill_seconds * keep + prefill_seconds;
            self.prefills = self.prefills * keep + prefills;
        }
        if let Some((queue_seconds, requests, _)) = grown(&last.queue, &mark.queue) {
            self.queue_seconds = self.queue_seconds * keep + queue_seconds;
            self.queued_requests = self.queued_requests * keep + requests;
        }
    }

    /// What has been learned so far.
    pub fn estimate(&self) -> PrefillEstimate {
        let drain = (self.busy_seconds >= self.window.warmup.as_secs_f64()
            && self.busy_tokens > 0.0)
            .then(|| self.busy_tokens / self.busy_seconds);
        let prefill = (self.prefills >= MIN_REQUESTS
            && self.prefill_seconds > 0.0
            && self.prefill_tokens > 0.0)
            .then(|| self.prefill_tokens / self.prefill_seconds);
        let per_request =
            (self.requests >= MIN_REQUESTS).then(|| self.request_tokens.max(0.0) / self.requests);
        // The prefills under way are priced at the share of recent lookups the cache did not serve:
        // an agent's 100k-token turn running on a warm worker is 95k tokens it need not compute.
        let uncached_share = if self.looked_up > 0.0 {
            (1.0 - self.hit / self.looked_up).clamp(0.0, 1.0)
        } else {
            1.0
        };
        let prefilling = self
            .prefilling
            .map(|tokens| whole(tokens * uncached_share).unwrap_or(0));
        let queue_wait = (self.queued_requests >= MIN_REQUESTS)
            .then(|| self.queue_seconds.max(0.0) / self.queued_requests * 1e6);
        PrefillEstimate {
            prefill_tokens_per_second: prefill.and_then(whole),
            drain_tokens_per_second: drain.and_then(whole),
            uncached_per_request: per_request.and_then(whole),
            prefilling_tokens: prefilling,
            queue_wait_us: queue_wait.map(|us| us.round() as u64),
            // The meter reads counters; which requests wait is the dispatch table's to say.
            waiting_routed_tokens: None,
            routed_per_request: None,
        }
    }
}

/// A positive finite estimate rounded to whole units; `None` otherwise.
fn whole(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.5).then(|| value.round() as u64)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn progress(prompt: f64, cached: f64, first: f64) -> Progress {
        Progress {
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            first_tokens: Some(first),
            queried_tokens: None,
            ..Progress::default()
        }
    }

    #[test]
    fn a_prefill_under_way_counts_from_the_reading_that_sees_it_at_the_share_the_cache_missed() {
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        // Lookups, hits and completed prompts at one reading.
        let reading = |queried: f64, hits: f64, prompt: f64| Progress {
            prompt_tokens: Some(prompt),
            cached_tokens: Some(hits),
            first_tokens: Some(10.0),
            queried_tokens: Some(queried),
            ..Progress::default()
        };
        meter.observe(start, &reading(50_000.0, 10_000.0, 50_000.0), 0);
        assert_eq!(meter.estimate().prefilling_tokens, Some(0));
        // A cold 100k prompt scheduled just before this reading: all of it counts at once, since
        // the dispatch that sent it is forgotten at this same reading.
        meter.observe(
            start + Duration::from_millis(200),
            &reading(150_000.0, 10_000.0, 50_000.0),
            1,
        );
        assert_eq!(meter.estimate().prefilling_tokens, Some(100_000));
        // It completes: nothing under way.
        meter.observe(
            start + Duration::from_millis(400),
            &reading(150_000.0, 10_000.0, 150_000.0),
            0,
        );
        assert_eq!(meter.estimate().prefilling_tokens, Some(0));
        // A mostly warm one (100k looked up, 90k hit): under way, but only its cold part is work.
        // Priced over the lookups so far (200k looked up, 90k hit): about 55k of its 100k count.
        meter.observe(
            start + Duration::from_millis(600),
            &reading(250_000.0, 100_000.0, 150_000.0),
            1,
        );
        let under_way = meter.estimate().prefilling_tokens.unwrap();
        assert!(
            (40_000..60_000).contains(&under_way),
            "priced at the missed share of recent lookups: {under_way}"
        );
        // An engine without the lookup counter (SGLang): nothing is known to be under way.
        let mut sglang = PrefillMeter::default();
        sglang.observe(start, &progress(50_000.0, 10_000.0, 10.0), 1);
        assert_eq!(sglang.estimate().prefilling_tokens, None);
    }

    /// A worker prefilling `rate` uncached tokens a second, `per_request` each, scraped every
    /// `interval` for `seconds`, queued throughout.
    fn steady(rate: f64, per_request: f64, interval: Duration, seconds: u64) -> PrefillMeter {
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        let steps = seconds * 1000 / interval.as_millis() as u64;
        for step in 0..=steps {
            let t = (step * interval.as_millis() as u64) as f64 / 1000.0;
            let uncached = rate * t;
            // Half of each prompt is cached: the meter must subtract it.
            meter.observe(
                start + interval * step as u32,
                &progress(2.0 * uncached, uncached, uncached / per_request),
                3,
            );
        }
        meter
    }

    #[test]
    fn a_queued_worker_s_rate_and_tokens_per_request_are_learned() {
        let meter = steady(12_000.0, 3_000.0, Duration::from_millis(200), 20);
        let estimate = meter.estimate();
        assert_eq!(estimate.drain_tokens_per_second, Some(12_000));
        assert_eq!(estimate.uncached_per_request, Some(3_000));
    }

    #[test]
    fn no_rate_before_min_busy_of_queued_time() {
        let early = steady(12_000.0, 3_000.0, Duration::from_millis(200), 4);
        assert_eq!(early.estimate().drain_tokens_per_second, None);
        let later = steady(12_000.0, 3_000.0, Duration::from_millis(200), 6);
        assert_eq!(later.estimate().drain_tokens_per_second, Some(12_000));
    }

    #[test]
    fn the_warm_up_and_the_half_life_are_the_configured_ones() {
        let window = RateWindow {
            half_life: Duration::from_secs(3),
            warmup: Duration::from_millis(500),
        };
        let start = Instant::now();
        let mut meter = PrefillMeter::new(window);
        let mut uncached = 0.0;
        let mut at = start;
        // 1 s at 10k tokens a second, then 9 s (three half-lives) at 20k.
        for (rate, steps) in [(10_000.0, 5), (20_000.0, 45)] {
            for _ in 0..steps {
                meter.observe(at, &progress(uncached, 0.0, uncached / 1_000.0), 2);
                at += Duration::from_millis(200);
                uncached += rate * 0.2;
            }
            if rate < 15_000.0 {
                // 0.8 s of queued intervals behind it: past the 500 ms warm-up, not the default 5 s.
                assert_eq!(meter.estimate().drain_tokens_per_second, Some(10_000));
            }
        }
        let learned = meter.estimate().drain_tokens_per_second.unwrap();
        assert!(
            (18_500..20_000).contains(&learned),
            "three half-lives on, the old rate weighs about an eighth: {learned}"
        );
        meter.reset();
        assert_eq!(
            meter.window, window,
            "a restart keeps the configured window"
        );
    }

    #[test]
    fn idle_intervals_teach_no_rate_and_keep_what_was_learned() {
        let start = Instant::now();
        let mut meter = steady(10_000.0, 1_000.0, Duration::from_secs(1), 10);
        let learned = meter.estimate().drain_tokens_per_second;
        // Then idle for a minute: the counters barely move, the queue is empty at both ends.
        let at = start + Duration::from_secs(10);
        for second in 0..60 {
            meter.observe(
                at + Duration::from_secs(second),
                &progress(200_000.0 + second as f64, 100_000.0, 100.0),
                0,
            );
        }
        assert_eq!(meter.estimate().drain_tokens_per_second, learned);
    }

    #[test]
    fn the_rate_follows_a_change_within_a_few_half_lives() {
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        let mut uncached = 0.0;
        for second in 0..300_u64 {
            let rate = if second < 60 { 20_000.0 } else { 5_000.0 };
            uncached += rate;
            meter.observe(
                start + Duration::from_secs(second),
                &progress(uncached, 0.0, second as f64),
                2,
            );
            if second == 59 {
                assert_eq!(meter.estimate().drain_tokens_per_second, Some(20_000));
            }
        }
        let rate = meter.estimate().drain_tokens_per_second.unwrap();
        assert!((5_000..5_100).contains(&rate), "{rate}");
    }

    #[test]
    fn lumpy_completions_average_out() {
        // vLLM counts a prompt when its prefill completes: 40k tokens land every 4 s, nothing between.
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        for tick in 0..=200_u64 {
            let done = (tick / 20) as f64 * 40_000.0;
            meter.observe(
                start + Duration::from_millis(200 * tick),
                &progress(done, 0.0, (tick / 20) as f64),
                1,
            );
        }
        let rate = meter.estimate().drain_tokens_per_second.unwrap();
        assert!((9_000..11_000).contains(&rate), "{rate}");
    }

    #[test]
    fn counters_missing_or_out_of_order_teach_nothing_and_reset_forgets() {
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        let blind = Progress {
            prompt_tokens: Some(1e6),
            cached_tokens: None,
            first_tokens: Some(10.0),
            queried_tokens: None,
            ..Progress::default()
        };
        for second in 0..20 {
            meter.observe(start + Duration::from_secs(second), &blind, 5);
        }
        assert_eq!(meter.estimate(), PrefillEstimate::default());
        let mut meter = steady(8_000.0, 2_000.0, Duration::from_secs(1), 10);
        let learned = meter.estimate();
        meter.observe(start, &progress(0.0, 0.0, 0.0), 5);
        assert_eq!(
            meter.estimate(),
            learned,
            "an older reading changes nothing"
        );
        meter.reset();
        assert_eq!(meter.estimate(), PrefillEstimate::default());
    }

    /// A reading whose prefill histograms say `prefills` requests finished, their prefills taking
    /// `seconds` in all and computing `tokens`, and whose queue histogram says `queued` seconds waited.
    fn histograms(prefills: f64, seconds: f64, tokens: f64, queued: f64) -> Progress {
        Progress {
            prefill: Histograms {
                seconds: Some(seconds),
                requests: Some(prefills),
                tokens: Some(tokens),
            },
            queue: Histograms {
                seconds: Some(queued),
                requests: Some(prefills),
                tokens: None,
            },
            ..progress(tokens, 0.0, prefills)
        }
    }

    #[test]
    fn the_prefill_rate_is_what_the_engine_timed_its_prefills_at_not_how_fast_its_queue_drained() {
        // A decode-bound engine: one 2,000-token prefill a second, each timed at 0.2 s by the engine
        // (10k tokens/s), while the queue (always waiting) drains at the same 2,000 tokens a second.
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        for second in 0..=20_u32 {
            let n = f64::from(second);
            meter.observe(
                start + Duration::from_secs(u64::from(second)),
                &histograms(n, 0.2 * n, 2_000.0 * n, 1.5 * n),
                6,
            );
        }
        let estimate = meter.estimate();
        assert_eq!(estimate.prefill_tokens_per_second, Some(10_000));
        assert_eq!(estimate.drain_tokens_per_second, Some(2_000));
        assert_eq!(estimate.queue_wait_us, Some(1_500_000));
    }

    #[test]
    fn a_prefill_longer_than_the_scrape_interval_counts_whole_where_it_ends() {
        // One 40k-token prefill of 4 s ending every 4 s, scraped every second.
        let start = Instant::now();
        let mut long = PrefillMeter::default();
        for second in 0..=40_u32 {
            let done = f64::from(second / 4);
            long.observe(
                start + Duration::from_secs(u64::from(second)),
                &histograms(done, 4.0 * done, 40_000.0 * done, 0.0),
                1,
            );
        }
        assert_eq!(long.estimate().prefill_tokens_per_second, Some(10_000));
    }

    #[test]
    fn no_prefill_rate_before_four_prefills_nor_from_an_engine_without_the_histograms() {
        let start = Instant::now();
        let mut meter = PrefillMeter::default();
        for second in 0..=3_u32 {
            let n = f64::from(second);
            meter.observe(
                start + Duration::from_secs(u64::from(second)),
                &histograms(n, 0.1 * n, 1_000.0 * n, 0.0),
                0,
            );
        }
        assert_eq!(
            meter.estimate().prefill_tokens_per_second,
            None,
            "three prefills"
        );
        // Weighted by age, four prefills a few seconds old count a little under four.
        meter.observe(
            start + Duration::from_secs(4),
            &histograms(5.0, 0.5, 5_000.0, 0.0),
            0,
        );
        assert_eq!(meter.estimate().prefill_tokens_per_second, Some(10_000));
        // SGLang, or vLLM before 0.13: counters only.
        let counters_only = steady(12_000.0, 3_000.0, Duration::from_millis(200), 20);
        assert_eq!(counters_only.estimate().prefill_tokens_per_second, None);
        assert_eq!(counters_only.estimate().queue_wait_us, None);
    }
}

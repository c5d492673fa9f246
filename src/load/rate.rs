//! How fast each worker prefills, learned from the counters its engine already exports.
//!
//! A time-unit gate needs two numbers per worker that no engine reports as gauges: the prompt tokens
//! it computes per second while it has work queued, and how many uncached tokens a request brings on
//! average (vLLM reports its queue as a count only). Both follow from cumulative counters every
//! replica scrapes alike — prompt tokens, prefix-cache hits and first tokens ([`Progress`]) — so every
//! replica learns the same estimate without talking to the others.
//!
//! - **Rate.** Between two readings that both show requests waiting, the engine was prefilling the
//!   whole time (a queue never waits on an idle GPU), so the uncached tokens it completed over the
//!   interval are its sustained prefill rate, decode interference included — the rate at which the
//!   queue ahead of a new request drains. Intervals with an empty queue at either end say nothing
//!   about the rate and are skipped, so an idle spell keeps what was learned. (A prefill under way at
//!   both readings does not qualify: the GPU may have idled between two prefills, and learning from
//!   such intervals made the Mooncake replay's TTFT p90 7–27% worse, BENCHMARKS.md.)
//! - **Tokens per request.** Uncached tokens over first tokens, across every interval.
//! - **Prefills under way** (vLLM: lookups counted at scheduling less prompts counted at completion),
//!   at the latest reading, times the share of recent lookups the cache did not serve. The latest
//!   reading, not the lesser of two: a long prefill started just before a scrape is the work a new
//!   request waits behind, while the dispatch that caused it is forgotten at that same reading.
//!
//! Both are exponentially weighted sums with a half-life (`load.prefill_rate_half_life`, 30 s) of the
//! time they count, so a change of traffic mix or of hardware is followed within a minute. vLLM counts a prompt when its
//! prefill completes and its cache hits when it is scheduled, so one interval's difference can even
//! be negative; the sums absorb that, and no estimate is given before `load.prefill_rate_warmup` (5 s) of queued time and
//! [`MIN_REQUESTS`] first tokens are behind it.
#![deny(clippy::disallowed_methods)]

use std::time::Instant;

use super::engine::Progress;
use super::snapshot::PrefillEstimate;
use crate::config::RateWindow;

/// First tokens before a per-request mean is given.
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
}

/// The counters at one reading.
#[derive(Clone, Copy, Debug)]
struct Mark {
    at: Instant,
    uncached: f64,
    first_tokens: Option<f64>,
    queried: Option<f64>,
    cached: Option<f64>,
    /// Requests waiting.
    queued: bool,
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
    /// A reading without both prompt and cached counters teaches nothing.
    pub fn observe(&mut self, at: Instant, progress: &Progress, waiting: u64) {
        let Some(uncached) = progress.uncached_tokens().filter(|value| value.is_finite()) else {
            return;
        };
        if self.last.is_none_or(|last| at > last.at) {
            self.prefilling = progress.prefilling_tokens();
        }
        let mark = Mark {
            at,
            uncached,
            first_tokens: progress.first_tokens,
            queried: progress.queried_tokens,
            cached: progress.cached_tokens,
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
        let tokens = uncached - last.uncached;
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

    /// What has been learned so far.
    pub fn estimate(&self) -> PrefillEstimate {
        let rate = (self.busy_seconds >= self.window.warmup.as_secs_f64()
            && self.busy_tokens > 0.0)
            .then(|| self.busy_tokens / self.busy_seconds);
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
        PrefillEstimate {
            tokens_per_second: rate.and_then(whole),
            uncached_per_request: per_request.and_then(whole),
            prefilling_tokens: prefilling,
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
        assert_eq!(estimate.tokens_per_second, Some(12_000));
        assert_eq!(estimate.uncached_per_request, Some(3_000));
    }

    #[test]
    fn no_rate_before_min_busy_of_queued_time() {
        let early = steady(12_000.0, 3_000.0, Duration::from_millis(200), 4);
        assert_eq!(early.estimate().tokens_per_second, None);
        let later = steady(12_000.0, 3_000.0, Duration::from_millis(200), 6);
        assert_eq!(later.estimate().tokens_per_second, Some(12_000));
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
                assert_eq!(meter.estimate().tokens_per_second, Some(10_000));
            }
        }
        let learned = meter.estimate().tokens_per_second.unwrap();
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
        let learned = meter.estimate().tokens_per_second;
        // Then idle for a minute: the counters barely move, the queue is empty at both ends.
        let at = start + Duration::from_secs(10);
        for second in 0..60 {
            meter.observe(
                at + Duration::from_secs(second),
                &progress(200_000.0 + second as f64, 100_000.0, 100.0),
                0,
            );
        }
        assert_eq!(meter.estimate().tokens_per_second, learned);
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
                assert_eq!(meter.estimate().tokens_per_second, Some(20_000));
            }
        }
        let rate = meter.estimate().tokens_per_second.unwrap();
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
        let rate = meter.estimate().tokens_per_second.unwrap();
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
}

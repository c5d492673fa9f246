//! The `load:` section: how workers are scraped and when a reading, or a worker, stops counting. Its
//! timings are checked against each other: a scrape timeout shorter than freshness (a later answer is
//! stale when it arrives), freshness longer than the interval, and a silence longer than the timeout.

use cachepick_decode::{
    Decode, Map, Phase, Res, at_least_one_u32, at_least_one_usize, blame, duration, with_default,
};

use super::Validator;
use crate::config::{LoadConfig, RateWindow};

pub(super) const LOAD_KEYS: &[&str] = &[
    "scrape_interval",
    "scrape_timeout",
    "freshness",
    "max_body_bytes",
    "max_concurrent_scrapes",
    "unreachable_after",
    "silent_after",
    "drain_timeout",
    "tls",
    "prefill_rate_half_life",
    "prefill_rate_warmup",
];

impl Validator<'_> {
    pub(super) fn load(&mut self, map: &Map) -> Res<LoadConfig> {
        let defaults = LoadConfig::default();
        let interval = self.positive_duration(map, "scrape_interval", defaults.scrape_interval);
        let timeout = self.positive_duration(map, "scrape_timeout", defaults.scrape_timeout);
        let freshness = self.positive_duration(map, "freshness", defaults.freshness);
        let timeout_fits = match (&freshness, &timeout) {
            (Ok(freshness), Ok(timeout)) if timeout.value >= freshness.value => {
                let message = format!(
                    "scrape_timeout ({}) must be shorter than freshness ({}): an answer that late is stale \
                     when it arrives",
                    duration::format(timeout.value),
                    duration::format(freshness.value),
                );
                Err(self.report(Phase::Cross, blame(timeout, freshness), message))
            }
            _ => Ok(()),
        };
        let freshness_lasts = match (&interval, &freshness) {
            (Ok(interval), Ok(freshness)) if freshness.value <= interval.value => {
                let message = format!(
                    "freshness ({}) must be longer than scrape_interval ({}): a healthy worker's reading would \
                     lapse between scrapes and the gate would go blind",
                    duration::format(freshness.value),
                    duration::format(interval.value),
                );
                Err(self.report(Phase::Cross, blame(freshness, interval), message))
            }
            _ => Ok(()),
        };
        let body = self.positive_size(map, "max_body_bytes", LoadConfig::DEFAULT_MAX_BODY_BYTES);
        let scrapes = self.opt(map, "max_concurrent_scrapes", Self::integer);
        let scrapes = self.check(
            with_default(scrapes, LoadConfig::DEFAULT_MAX_CONCURRENT_SCRAPES as u64),
            at_least_one_usize,
        );
        let unreachable = self.opt(map, "unreachable_after", Self::integer);
        let unreachable = self.check(
            with_default(unreachable, defaults.unreachable_after.get().into()),
            at_least_one_u32,
        );
        let silent = self.positive_duration(map, "silent_after", defaults.silent_after);
        let silence_fits = match (&silent, &timeout) {
            (Ok(silent), Ok(timeout)) if silent.value <= timeout.value => {
                let message = format!(
                    "silent_after ({}) must be longer than scrape_timeout ({}): a worker would be \
                     unreachable at its first late answer",
                    duration::format(silent.value),
                    duration::format(timeout.value),
                );
                Err(self.report(Phase::Cross, blame(silent, timeout), message))
            }
            _ => Ok(()),
        };
        let drain = self.positive_duration(map, "drain_timeout", defaults.drain_timeout);
        let tls = self.scrape_tls(map);
        let half_life =
            self.positive_duration(map, "prefill_rate_half_life", defaults.rate.half_life);
        let warmup = self.positive_duration(map, "prefill_rate_warmup", defaults.rate.warmup);
        timeout_fits?;
        freshness_lasts?;
        silence_fits?;
        Ok(LoadConfig {
            unreachable_after: unreachable?.value,
            silent_after: silent?.value,
            drain_timeout: drain?.value,
            scrape_interval: interval?.value,
            scrape_timeout: timeout?.value,
            freshness: freshness?.value,
            max_body_bytes: body?.value,
            max_concurrent_scrapes: scrapes?.value,
            tls: tls?,
            rate: RateWindow {
                half_life: half_life?.value,
                warmup: warmup?.value,
            },
        })
    }
}

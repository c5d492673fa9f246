//! A pool's scrapes driven by their caller, synchronously, with the time passed in: what a replay in
//! virtual time runs in place of the [`Scraper`](super::Scraper) task. It owns the same [`Roster`] and
//! applies answers by the same rules, in the same order as the task (expire, then a request for every
//! idle worker, healthy first; each answer applied and published as it arrives; a round finished when
//! its last answer is in); the caller fetches (a simulated engine's exposition after a modelled
//! latency) and says when each thing happens. Nothing here reads a clock or does I/O.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::fetch::ScrapeError;
use super::pool::{PoolLoad, RosterObserver, ScrapeObserver};
use super::roster::{Roster, Scrape};
use crate::config::{LoadConfig, PoolConfig};
use crate::worker::WorkerId;

/// One scrape handed to the caller: ask `endpoint` for its load, then hand the answer to
/// [`ScrapeDriver::answered`] (or the failure to [`ScrapeDriver::failed`]).
pub struct ScrapeTicket {
    pub worker: WorkerId,
    pub endpoint: SocketAddr,
    /// When the request was sent: the answer's samples are that old.
    pub sent: Instant,
    round: u64,
    scrape: Scrape,
}

/// One pool's roster, scraped when its caller says.
pub struct ScrapeDriver {
    roster: Roster,
    round: u64,
    /// Requests still outstanding per round.
    pending: BTreeMap<u64, usize>,
}

impl ScrapeDriver {
    /// The driver of `pool`, its file's workers in their slots at `now`; `roster` (the route's index)
    /// hears of them joining.
    pub fn new(
        pool_config: &PoolConfig,
        config: &LoadConfig,
        pool: Arc<PoolLoad>,
        observer: Arc<dyn ScrapeObserver>,
        roster: Option<Arc<dyn RosterObserver>>,
        now: Instant,
    ) -> ScrapeDriver {
        let mut driven = Roster::new(pool_config, config, pool, observer, now);
        if let Some(roster) = roster {
            driven.observe(roster);
        }
        ScrapeDriver {
            roster: driven,
            round: 0,
            pending: BTreeMap::new(),
        }
    }

    /// One tick of `scrape_interval` at `now`: time-driven changes applied, then a ticket for every
    /// worker without a scrape in flight, healthy ones first.
    pub fn tick(&mut self, now: Instant) -> Vec<ScrapeTicket> {
        self.round += 1;
        if self.roster.expire(now) {
            self.roster.publish();
        }
        let idle = self.roster.idle_healthy_first();
        if idle.is_empty() {
            if self.roster.is_empty() {
                self.roster.finish_round(now);
            }
            return Vec::new();
        }
        let round = self.round;
        let tickets: Vec<ScrapeTicket> = idle
            .into_iter()
            .filter_map(|id| {
                let endpoint = self.roster.endpoint(id)?;
                let scrape = self.roster.begin_scrape(id)?;
                Some(ScrapeTicket {
                    worker: id,
                    endpoint,
                    sent: now,
                    round,
                    scrape,
                })
            })
            .collect();
        self.pending.insert(round, tickets.len());
        tickets
    }

    /// The worker answered `body` (its `/metrics` text, or SGLang's `/v1/loads`), received at `now`:
    /// read as the scraper reads it and applied.
    pub fn answered(&mut self, ticket: ScrapeTicket, body: &[u8], now: Instant) {
        let result = ticket.scrape.target.read(body);
        self.finish(ticket, result, now);
    }

    /// The scrape failed at `now` (a timeout, a refused connection).
    pub fn failed(&mut self, ticket: ScrapeTicket, error: ScrapeError, now: Instant) {
        self.finish(ticket, Err(error), now);
    }

    fn finish(
        &mut self,
        ticket: ScrapeTicket,
        result: Result<super::Report, ScrapeError>,
        now: Instant,
    ) {
        let ScrapeTicket {
            sent,
            round,
            scrape,
            ..
        } = ticket;
        self.roster.apply(scrape.finished(sent, result), now);
        self.roster.publish();
        if let Some(count) = self.pending.get_mut(&round) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.pending.remove(&round);
                self.roster.finish_round(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)]

    use std::time::Duration;

    use super::*;
    use crate::config::{self, Overrides};
    use crate::load::Lifecycle;

    struct Counters;

    impl ScrapeObserver for Counters {
        fn scrape_counter(
            &self,
            _pool: &str,
            _worker: &str,
            _outcome: crate::load::ScrapeOutcome,
        ) -> prometheus::IntCounter {
            prometheus::IntCounter::new("scrapes", "scrapes").unwrap()
        }
        fn watch_pool(&self, _pool: Arc<PoolLoad>) {}
        fn worker_left(&self, _pool: &str, _worker: &str) {}
    }

    fn driver(now: Instant) -> (ScrapeDriver, Arc<PoolLoad>) {
        let yaml = "load: {freshness: 3s, unreachable_after: 2}\npools:\n  - model: m\n    \
                    engine: vllm\n    workers:\n      - {endpoint: \"10.0.0.1:1\"}\n      \
                    - {endpoint: \"10.0.0.1:2\"}\n";
        let config = config::parse(yaml, "test.yaml", &Overrides::default()).unwrap();
        let pool = config.pools.first().unwrap();
        let load = PoolLoad::new(pool, &config.load);
        let observer: Arc<dyn ScrapeObserver> = Arc::new(Counters);
        let driver = ScrapeDriver::new(pool, &config.load, Arc::clone(&load), observer, None, now);
        (driver, load)
    }

    const BODY: &[u8] = b"vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n\
                          vllm:kv_cache_usage_perc 0.5\n";

    #[test]
    fn a_driven_round_applies_answers_when_the_caller_says_and_never_asks_a_worker_twice() {
        let start = Instant::now();
        let (mut driver, load) = driver(start);
        let tickets = driver.tick(start);
        let asked: Vec<SocketAddr> = tickets.iter().map(|ticket| ticket.endpoint).collect();
        assert_eq!(
            asked,
            ["10.0.0.1:1".parse().unwrap(), "10.0.0.1:2".parse().unwrap()]
        );
        assert!(
            driver.tick(start + Duration::from_millis(10)).is_empty(),
            "a worker with a scrape in flight is not asked again"
        );
        let mut tickets = tickets.into_iter();
        let (first, second) = (tickets.next().unwrap(), tickets.next().unwrap());
        let answered = start + Duration::from_millis(20);
        driver.answered(first, BODY, answered);
        let snapshot = load.snapshot();
        let worker = snapshot.workers().first().unwrap();
        assert_eq!(worker.lifecycle, Lifecycle::Healthy);
        let reading = worker.reading.unwrap();
        assert_eq!((reading.load.waiting, reading.load.running), (3, 2));
        assert!(snapshot.is_fresh(&reading, answered));
        assert!(
            !snapshot.is_fresh(&reading, start + Duration::from_secs(4)),
            "a reading ages on the caller's clock"
        );
        // The round is not complete until its last answer is in, and a timeout is an answer.
        assert_eq!(*load.rounds().borrow(), 0);
        driver.failed(
            second,
            ScrapeError::Timeout(Duration::from_secs(1)),
            answered,
        );
        assert_eq!(*load.rounds().borrow(), 1);
        assert_eq!(driver.tick(answered).len(), 2, "both idle again");
    }
}

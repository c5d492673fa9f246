//! The per-pool scrape loop: reads every worker's load each `scrape_interval` and feeds the roster.
//!
//! One task per pool. Each tick it starts a request for every worker that has none in flight, at most
//! `max_concurrent_scrapes` at a time, each bounded by `scrape_timeout` and `max_body_bytes`. Results are
//! applied to the [`Roster`] as they arrive and a new snapshot is published right away, so a hung worker
//! delays nobody else's sample; routing decisions read whichever snapshot is current and never wait on
//! a scrape. A failed scrape keeps the old rank samples, which age out of `freshness` on their own:
//! staleness is a property of time, not of the last outcome. The loop reads tokio's clock, once per
//! event, and hands that time to the roster, so a paused runtime drives the whole scraper.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::MissedTickBehavior;

use super::dispatch::Window;
use super::fetch::{ScrapeError, fetch};
use super::pool::{PoolLoad, RosterObserver, ScrapeObserver};
use super::roster::{Fetched, Roster};
use super::tls::{HttpClient, ScrapeTlsClient};
use crate::config::{Discovery, LoadConfig, PoolConfig, WorkerConfig};
use crate::worker::WorkerId;

/// Scrapes one pool. Owned by its task; shares only [`PoolLoad`] with the request path.
pub struct Scraper {
    roster: Roster,
    client: HttpClient,
    config: LoadConfig,
    limiter: Arc<Semaphore>,
    /// Rounds started, which tags each request.
    round: u64,
    desired: watch::Receiver<Arc<[WorkerConfig]>>,
    /// Restarts reported by the KV event streams; `None` when another scraper of the pool took them.
    restarts: Option<mpsc::UnboundedReceiver<WorkerId>>,
    /// A discovered pool's source has not answered yet: until it has, an empty roster is not a
    /// completed round (the pool is not ready with no workers it was never told of).
    awaiting_source: bool,
}

/// The loop's clock: tokio's, which a paused runtime controls, read where events arrive and passed on.
fn clock() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Scraper {
    pub fn new(
        pool_config: &PoolConfig,
        config: &LoadConfig,
        pool: Arc<PoolLoad>,
        observer: Arc<dyn ScrapeObserver>,
    ) -> Self {
        let mut desired = pool.desired().subscribe();
        // The file's workers are in the first snapshot already; what discovery sends later is news.
        desired.mark_unchanged();
        let restarts = pool.take_restart_reports();
        let roster = Roster::new(
            pool_config,
            config,
            Arc::clone(&pool),
            Arc::clone(&observer),
            clock(),
        );
        observer.watch_pool(pool);
        Scraper {
            roster,
            client: HttpClient::new(config, None),
            config: config.clone(),
            limiter: Arc::new(Semaphore::new(config.max_concurrent_scrapes.get())),
            round: 0,
            desired,
            restarts,
            awaiting_source: pool_config.discovery != Discovery::Static,
        }
    }

    /// Scrapes `https://` URLs with `tls` (`load.tls`); without it the scraper speaks plain HTTP only.
    pub fn with_tls(mut self, tls: &ScrapeTlsClient) -> Self {
        self.client = HttpClient::new(&self.config, Some(tls));
        self
    }

    /// Tells `roster` about every change of the roster from now on; the workers already present are
    /// announced as joining.
    pub fn with_roster(mut self, roster: Arc<dyn RosterObserver>) -> Self {
        self.roster.observe(roster);
        self
    }

    /// Brings the roster to what discovery wants, if it said anything new since: the one-shot
    /// commands' step before their rounds ([`Scraper::run`] follows discovery by itself). Whether it
    /// did.
    pub fn follow_discovery(&mut self) -> bool {
        if !self.desired.has_changed().unwrap_or(false) {
            return false;
        }
        let desired = Arc::clone(&self.desired.borrow_and_update());
        self.awaiting_source = false;
        self.roster.reconcile(&desired, clock());
        self.roster.publish();
        true
    }

    /// Scrapes every worker once, waits for all of them, and publishes: the `snapshot` command's round.
    pub async fn round(&mut self) {
        self.round += 1;
        let fetches: Vec<_> = self
            .roster
            .idle_healthy_first()
            .into_iter()
            .map(|id| self.start(id))
            .collect();
        let results = futures_util::future::join_all(fetches).await;
        let now = clock();
        for (_, fetched) in results {
            self.roster.apply(fetched, now);
        }
        self.roster.publish();
        self.roster.finish_round(now);
    }

    /// Scrapes every `scrape_interval` until `shutdown` resolves, and follows discovery.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.config.scrape_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut in_flight = FuturesUnordered::new();
        // Requests still outstanding per round, so a round ends when its own requests do.
        let mut pending: BTreeMap<u64, usize> = BTreeMap::new();
        let mut discovering = true;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(id) = next_restart(&mut self.restarts) => {
                    if self.roster.mark_restarted(id, clock()) {
                        self.roster.publish();
                    }
                }
                changed = self.desired.changed(), if discovering => {
                    if changed.is_err() {
                        // Nobody can send any more: the roster stays as it is.
                        discovering = false;
                        continue;
                    }
                    let desired = Arc::clone(&self.desired.borrow_and_update());
                    self.awaiting_source = false;
                    // Joiners are scraped at once: they serve only once they answer.
                    for id in self.roster.reconcile(&desired, clock()) {
                        in_flight.push(self.start(id));
                    }
                    self.roster.publish();
                }
                _ = ticker.tick() => {
                    self.round += 1;
                    let now = clock();
                    if self.roster.expire(now) {
                        self.roster.publish();
                    }
                    let idle = self.roster.idle_healthy_first();
                    if idle.is_empty() {
                        // A round over no workers is complete at once, once the source has spoken.
                        if self.roster.is_empty() && !self.awaiting_source {
                            self.roster.finish_round(now);
                        }
                        continue;
                    }
                    pending.insert(self.round, idle.len());
                    for id in idle {
                        in_flight.push(self.start(id));
                    }
                }
                Some((round, fetched)) = in_flight.next(), if !in_flight.is_empty() => {
                    let now = clock();
                    let mut done = vec![round];
                    self.roster.apply(fetched, now);
                    // Apply everything that is already finished before publishing once.
                    while let Some(Some((round, fetched))) = in_flight.next().now_or_never() {
                        done.push(round);
                        self.roster.apply(fetched, now);
                    }
                    self.roster.publish();
                    for round in done {
                        if let Some(count) = pending.get_mut(&round) {
                            *count = count.saturating_sub(1);
                            if *count == 0 {
                                pending.remove(&round);
                                self.roster.finish_round(clock());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Starts a request for the worker in slot `id`; the future owns everything it needs and resolves
    /// to its round and result.
    fn start(&mut self, id: WorkerId) -> impl Future<Output = (u64, Fetched)> + use<> {
        let round = self.round;
        let scrape = self.roster.begin_scrape(id);
        let client = self.client.clone();
        let limiter = Arc::clone(&self.limiter);
        let (timeout, max_body) = (self.config.scrape_timeout, self.config.max_body_bytes);
        async move {
            let Some(scrape) = scrape else {
                let fetched = Fetched {
                    id,
                    generation: u64::MAX,
                    sent: clock(),
                    dispatched: Window::default(),
                    result: Err(ScrapeError::Url("no such worker".into())),
                };
                return (round, fetched);
            };
            // Closed only if the scraper is dropped, and then nobody reads the result.
            let _permit = limiter.acquire_owned().await;
            let sent = clock();
            let result =
                match tokio::time::timeout(timeout, fetch(&client, &scrape.target, max_body)).await
                {
                    Ok(result) => result,
                    Err(_) => Err(ScrapeError::Timeout(timeout)),
                };
            (round, scrape.finished(sent, result))
        }
    }
}

/// The next restart a KV event stream reported; pending forever without a receiver.
async fn next_restart(
    restarts: &mut Option<mpsc::UnboundedReceiver<WorkerId>>,
) -> Option<WorkerId> {
    match restarts {
        Some(restarts) => restarts.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;

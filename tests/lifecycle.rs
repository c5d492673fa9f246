//! A pool whose workers change while it runs, against real HTTP engines on loopback: the scraper follows
//! the workers discovery wants (joins, drains, leaves), tells each worker's state from its scrapes (new,
//! healthy, unreachable, restarted), and the owner index follows the roster, so no decision credits a
//! worker with blocks it cannot have.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachepick::config::{self, Config, Overrides, WorkerConfig};
use cachepick::discovery;
use cachepick::events::EventFeeds;
use cachepick::load::{Lifecycle, PoolLoad, PoolSnapshot, Scraper};
use cachepick::metrics::Metrics;
use cachepick::policy::{Outcome, Reason};
use cachepick::route::Picker;
use cachepick::worker::WorkerId;
use cachepick_rig::stage::Shutdown;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use support::engine::{FakeEngine, Mode, vllm_metrics};

const TEXT: &str = "text/plain; version=0.0.4";
const INTERVAL: Duration = Duration::from_millis(150);

/// A vLLM exposition of one idle (or busy) rank, from the engine run that started at `started`, having
/// served `served` prompt tokens.
fn exposition(running: u64, started: f64, served: f64) -> Mode {
    let mut text = vllm_metrics(&[(0, 0, running, 0.1)]);
    text.push_str(&format!(
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {started}\n\
         # TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{{model_name=\"m\"}} {served}\n"
    ));
    Mode::Body(TEXT, text)
}

fn idle() -> Mode {
    exposition(0, 1_700_000_000.25, 1000.0)
}

/// A cache-aware pool over `workers`, scraped every `interval` (a reading lasts four of them).
fn config(workers: &[SocketAddr], interval: Duration) -> Config {
    let mut yaml = format!(
        "policy: {{min_match_tokens: 16}}\n\
         load: {{scrape_interval: {}ms, scrape_timeout: 100ms, freshness: {}ms, unreachable_after: 2, \
         drain_timeout: 5s}}\n\
         pools:\n  - model: m\n    engine: vllm\n    block_size: 16\n    tokenizer: {{kind: bytes}}\n    max_workers: 4\n    workers:\n",
        interval.as_millis(),
        (interval * 4).as_millis(),
    );
    for worker in workers {
        yaml.push_str(&format!("      - endpoint: \"{worker}\"\n"));
    }
    config::parse(&yaml, "test.yaml", &Overrides::default()).expect("valid test config")
}

/// The pool's scraper running (following discovery), with the picker whose index follows its roster;
/// the scraper stops when this is dropped.
struct Running {
    config: Config,
    load: Arc<PoolLoad>,
    picker: Picker,
    _shutdown: Shutdown,
    rng: SmallRng,
}

impl Running {
    fn start(workers: &[SocketAddr]) -> Running {
        Running::start_every(workers, INTERVAL)
    }

    fn start_every(workers: &[SocketAddr], interval: Duration) -> Running {
        let config = config(workers, interval);
        let metrics = Arc::new(Metrics::new().unwrap());
        let loads = PoolLoad::for_pools(&config);
        let load = Arc::clone(&loads[0]);
        let picker = Picker::new(&config, &loads).unwrap();
        let feeds = Arc::new(EventFeeds::new(picker.event_indexes()));
        let scraper = Scraper::new(&config.pools[0], &config.load, Arc::clone(&load), metrics)
            .with_roster(picker.roster(0, &feeds).unwrap());
        let shutdown = Shutdown::default();
        tokio::spawn(scraper.run(shutdown.signal()));
        Running {
            config,
            load,
            picker,
            _shutdown: shutdown,
            rng: SmallRng::seed_from_u64(7),
        }
    }

    /// Discovery now wants exactly `workers`.
    fn want(&self, workers: &[SocketAddr]) {
        let template = &self.config.pools[0].template;
        let members: Vec<WorkerConfig> = workers.iter().map(|w| template.worker(*w)).collect();
        assert!(discovery::publish(
            self.load.desired(),
            discovery::members(members)
        ));
    }

    fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.load.snapshot()
    }

    fn state_of(&self, worker: SocketAddr) -> Option<Lifecycle> {
        self.snapshot()
            .by_endpoint(worker)
            .map(|state| state.lifecycle)
    }

    /// Waits until `check` holds of the published snapshot, for at most `within`.
    async fn until(&self, within: Duration, what: &str, check: impl Fn(&PoolSnapshot) -> bool) {
        let deadline = Instant::now() + within;
        while !check(&self.snapshot()) {
            assert!(
                Instant::now() < deadline,
                "not within {within:?}: {what}; snapshot: {:#?}",
                self.snapshot().workers()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Routes `prompt` and commits it: (worker's endpoint, reason, matched tokens).
    fn route(&mut self, prompt: &str) -> (SocketAddr, Reason, u64) {
        let body =
            serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt})).unwrap();
        let prepared = self
            .picker
            .prepare("/v1/completions", &body, Instant::now())
            .unwrap();
        let pinned = self.picker.pin(&prepared, Instant::now()).unwrap();
        match pinned.decide(None, &mut self.rng) {
            Outcome::Route(decision) => {
                pinned.commit(&decision);
                let endpoint = pinned
                    .snapshot()
                    .worker(decision.selected)
                    .unwrap()
                    .endpoint;
                (endpoint, decision.reason, decision.matched_tokens)
            }
            Outcome::Refuse(refused) => panic!("refused: {refused:?}"),
        }
    }
}

fn healthy(worker: SocketAddr) -> impl Fn(&PoolSnapshot) -> bool {
    move |snapshot| {
        snapshot
            .by_endpoint(worker)
            .is_some_and(|state| state.lifecycle == Lifecycle::Healthy)
    }
}

/// A conversation long enough to own: 40 blocks of 16 bytes.
fn conversation(name: &str) -> String {
    format!("{name}: ").repeat(160)
}

#[tokio::test]
async fn a_joining_worker_is_scraped_at_once_and_serves_once_it_answers() {
    let a = FakeEngine::start(idle()).await;
    let b = FakeEngine::start(idle()).await;
    // Ticks 5 s apart (the first at once): b can only answer before the next one if it is scraped
    // when it joins.
    let tick = Duration::from_secs(5);
    let started = Instant::now();
    let pool = Running::start_every(&[a.addr], tick);
    pool.until(Duration::from_secs(2), "a healthy", healthy(a.addr))
        .await;
    let mut roster = pool.load.roster_changes();
    roster.mark_unchanged();

    pool.want(&[a.addr, b.addr]);
    pool.until(Duration::from_secs(2), "b healthy", healthy(b.addr))
        .await;
    assert!(
        started.elapsed() < tick,
        "b answered {:?} after the start, not before the second tick",
        started.elapsed()
    );
    assert!(
        roster.has_changed().unwrap(),
        "the roster change is announced"
    );
    let snapshot = pool.snapshot();
    let b_state = snapshot.by_endpoint(b.addr).unwrap();
    assert_eq!(b_state.id, WorkerId(1), "the lowest free slot");
    assert!(
        snapshot.envoy_endpoints().contains(&b.addr),
        "Envoy's cluster lists the newcomer"
    );
}

#[tokio::test]
async fn a_worker_that_leaves_discovery_drains_then_leaves_with_its_index_entries() {
    let a = FakeEngine::start(idle()).await;
    let b = FakeEngine::start(idle()).await;
    let mut pool = Running::start(&[a.addr, b.addr]);
    pool.until(Duration::from_secs(2), "both healthy", |s| {
        healthy(a.addr)(s) && healthy(b.addr)(s)
    })
    .await;
    // Each conversation settles on a worker; find one that lives on b.
    let mut on_b = None;
    for n in 0..40 {
        let prompt = conversation(&format!("conversation {n}"));
        if pool.route(&prompt).0 == b.addr {
            on_b = Some(prompt);
            break;
        }
    }
    let on_b = on_b.expect("some conversation lands on b");
    assert_eq!(pool.route(&on_b).1, Reason::CacheHit);

    // b is still busy when discovery drops it: it drains, and nothing new goes there.
    b.set(exposition(3, 1_700_000_000.25, 1000.0));
    tokio::time::sleep(INTERVAL * 2).await;
    pool.want(&[a.addr]);
    pool.until(Duration::from_secs(1), "b draining", |s| {
        s.by_endpoint(b.addr)
            .is_some_and(|w| w.lifecycle == Lifecycle::Draining)
    })
    .await;
    assert!(!pool.snapshot().envoy_endpoints().contains(&b.addr));
    let (worker, reason, _) = pool.route(&on_b);
    assert_eq!(worker, a.addr, "a draining worker gets no new request");
    assert_ne!(reason, Reason::CacheHit, "a held none of it");

    // Idle: it leaves, its slot is free, and whoever takes the slot is not credited with its blocks.
    b.set(idle());
    pool.until(Duration::from_secs(2), "b gone", |s| {
        s.by_endpoint(b.addr).is_none()
    })
    .await;
    let stats = &pool.picker.index_stats()[0].1;
    assert_eq!(stats.held.get(1).copied().unwrap_or(0), 0, "{stats:?}");
    let c = FakeEngine::start(idle()).await;
    pool.want(&[a.addr, c.addr]);
    pool.until(Duration::from_secs(2), "c healthy", healthy(c.addr))
        .await;
    let snapshot = pool.snapshot();
    let c_state = snapshot.by_endpoint(c.addr).unwrap();
    assert_eq!(c_state.id, WorkerId(1), "c takes b's slot");
    assert!(c_state.generation > 0, "with a new generation");
    let (_, reason, matched) = pool.route(&conversation("a fresh one"));
    assert_ne!(reason, Reason::CacheHit);
    assert_eq!(matched, 0);
}

#[tokio::test]
async fn an_unreachable_worker_is_never_an_owner_but_serves_when_nothing_else_is_left() {
    let a = FakeEngine::start(idle()).await;
    let b = FakeEngine::start(idle()).await;
    let b_addr = b.addr;
    let mut pool = Running::start(&[a.addr, b.addr]);
    pool.until(Duration::from_secs(2), "both healthy", |s| {
        healthy(a.addr)(s) && healthy(b_addr)(s)
    })
    .await;
    let mut on_b = None;
    for n in 0..40 {
        let prompt = conversation(&format!("conversation {n}"));
        if pool.route(&prompt).0 == b_addr {
            on_b = Some(prompt);
            break;
        }
    }
    let on_b = on_b.expect("some conversation lands on b");

    // b dies: two failed scrapes later it is unreachable, and its conversation moves.
    let died = Instant::now();
    drop(b);
    pool.until(Duration::from_secs(2), "b unreachable", |s| {
        s.by_endpoint(b_addr)
            .is_some_and(|w| w.lifecycle == Lifecycle::Unreachable)
    })
    .await;
    let detected = died.elapsed();
    assert!(
        detected < Duration::from_millis(600),
        "detected after {detected:?}, within freshness"
    );
    let (worker, reason, _) = pool.route(&on_b);
    assert_eq!(worker, a.addr);
    assert_ne!(reason, Reason::CacheHit);
    let (worker, reason, matched) = pool.route(&on_b);
    assert_eq!((worker, reason), (a.addr, Reason::CacheHit));
    assert!(matched > 0);

    // a dies too: nothing answers, and the picker still routes (fail-open), never refuses.
    let a_addr = a.addr;
    drop(a);
    pool.until(Duration::from_secs(2), "a unreachable", |s| {
        s.by_endpoint(a_addr)
            .is_some_and(|w| w.lifecycle == Lifecycle::Unreachable)
    })
    .await;
    let (worker, reason, matched) = pool.route(&on_b);
    assert!(worker == a_addr || worker == b_addr);
    assert_eq!(matched, 0, "no unreachable worker is an owner");
    assert_ne!(reason, Reason::CacheHit);
}

#[tokio::test]
async fn a_restart_seen_in_the_scrape_forgets_the_workers_prefixes() {
    let a = FakeEngine::start(idle()).await;
    let mut pool = Running::start(&[a.addr]);
    pool.until(Duration::from_secs(2), "a healthy", healthy(a.addr))
        .await;
    let prompt = conversation("long lived");
    pool.route(&prompt);
    let (_, reason, matched) = pool.route(&prompt);
    assert_eq!(reason, Reason::CacheHit);
    assert!(matched > 0);

    // A new process: its start time moved.
    let seen = Instant::now();
    a.set(exposition(0, 1_700_000_100.5, 12.0));
    pool.until(Duration::from_secs(2), "a restarted", |s| {
        s.by_endpoint(a.addr).is_some_and(|w| w.incarnation == 1)
    })
    .await;
    assert!(seen.elapsed() < INTERVAL * 3);
    assert_eq!(pool.state_of(a.addr), Some(Lifecycle::Restarted));
    let (_, reason, matched) = pool.route(&prompt);
    assert_eq!(
        (reason, matched),
        (Reason::CacheMiss, 0),
        "nothing credited to the old cache"
    );
    assert_eq!(pool.route(&prompt).1, Reason::CacheHit, "it learns again");
    // Healthy again one freshness later.
    pool.until(Duration::from_secs(2), "a healthy again", healthy(a.addr))
        .await;

    // The same process start time but a counter that went backwards: a restart too (a process
    // collector that is off, say).
    a.set(exposition(0, 1_700_000_100.5, 3.0));
    pool.until(Duration::from_secs(2), "a restarted twice", |s| {
        s.by_endpoint(a.addr).is_some_and(|w| w.incarnation == 2)
    })
    .await;
    assert_eq!(pool.route(&prompt).1, Reason::CacheMiss);
}

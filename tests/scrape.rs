//! Load scraping against real HTTP servers on loopback: healthy engines of both kinds, and every way an
//! engine can fail. In each failure the reading stops counting within `freshness`, the scrape counter
//! names the cause, nothing panics, and the other workers are unaffected.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

// Tests and benchmarks measure real time; the clock ban is for the code that decides.

mod support {
    pub mod engine;
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachepick::config::{self, Config, Overrides};
use cachepick::load::{DispatchCounts, EngineLoad, PoolLoad, PoolSnapshot, ScrapeOutcome, Scraper};
use cachepick::metrics::Metrics;
use cachepick::worker::WorkerId;
use cachepick_rig::stage::Shutdown;
use support::engine::{FakeEngine, Mode, refused_addr, sglang_metrics, vllm_metrics};

const TEXT: &str = "text/plain; version=0.0.4";

/// One pool of `engine` over the given workers (each an address plus extra YAML keys).
fn config(engine: &str, load: &str, workers: &[(SocketAddr, &str)]) -> Config {
    let mut yaml =
        format!("load: {{{load}}}\npools:\n  - model: m\n    engine: {engine}\n    workers:\n");
    for (addr, extra) in workers {
        yaml.push_str(&format!("      - {{endpoint: \"{addr}\"{extra}}}\n"));
    }
    config::parse(&yaml, "test.yaml", &Overrides::default()).expect("valid test config")
}

const QUICK: &str = "scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s";

struct Pool {
    load: Arc<PoolLoad>,
    scraper: Scraper,
    metrics: Arc<Metrics>,
}

impl Pool {
    fn new(config: &Config) -> Self {
        let metrics = Arc::new(Metrics::new().unwrap());
        let pool = &config.pools[0];
        let load = PoolLoad::new(pool, &config.load);
        let scraper = Scraper::new(pool, &config.load, Arc::clone(&load), metrics.clone());
        Pool {
            load,
            scraper,
            metrics,
        }
    }

    fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.load.snapshot()
    }

    fn scrapes(&self, worker: SocketAddr, outcome: ScrapeOutcome) -> u64 {
        self.metrics
            .scrapes
            .with_label_values(&["m", &worker.to_string(), outcome.as_str()])
            .get()
    }
}

/// A pool of one `engine` worker (with `extra` YAML keys) that answers `answer`, after one scrape round.
async fn scraped_once(engine: &str, extra: &str, answer: Mode) -> (FakeEngine, Pool) {
    let fake = FakeEngine::start(answer).await;
    let mut pool = Pool::new(&config(engine, QUICK, &[(fake.addr, extra)]));
    pool.scraper.round().await;
    (fake, pool)
}

/// The first worker's load, which must be fresh.
fn first_load(snapshot: &PoolSnapshot) -> &EngineLoad {
    snapshot
        .fresh_load(WorkerId(0), Instant::now())
        .expect("fresh")
}

fn is_fresh(snapshot: &PoolSnapshot, worker: u32) -> bool {
    snapshot
        .fresh_load(WorkerId(worker), Instant::now())
        .is_some()
}

fn last_error(snapshot: &PoolSnapshot, worker: u32) -> String {
    snapshot.workers()[worker as usize]
        .scrape
        .last_error
        .as_deref()
        .unwrap_or_default()
        .to_owned()
}

// === healthy engines ===

#[tokio::test]
async fn a_vllm_worker_reports_its_queue_running_batch_and_kv_capacity() {
    let answer = Mode::Body(TEXT, vllm_metrics(&[(0, 3, 7, 0.25)]));
    let (engine, pool) = scraped_once("vllm", "", answer).await;

    let snapshot = pool.snapshot();
    let load = first_load(&snapshot);
    assert_eq!((load.waiting, load.running), (3, 7));
    let capacity = snapshot.workers()[0].capacity;
    assert_eq!(
        capacity.max_total_tokens,
        Some(16 * 1000),
        "block_size x num_gpu_blocks"
    );
    assert_eq!(load.used_tokens, Some(4000), "kv usage x capacity");
    assert_eq!(pool.scrapes(engine.addr, ScrapeOutcome::Ok), 1);
    assert_eq!(*pool.load.rounds().borrow(), 1);
}

#[tokio::test]
async fn data_parallel_ranks_are_summed_and_tensor_parallel_copies_ignored() {
    let answer = Mode::Body(TEXT, sglang_metrics(&[(0, 2, 5), (1, 4, 6)]));
    let (_engine, pool) = scraped_once("sglang", ", dp_size: 2", answer).await;

    let snapshot = pool.snapshot();
    let load = first_load(&snapshot);
    assert_eq!((load.waiting, load.running), (6, 11));
    assert_eq!(load.used_tokens, Some(2000));
    let capacity = snapshot.workers()[0].capacity;
    assert_eq!(
        (capacity.max_running, capacity.max_total_tokens),
        (Some(256), Some(100_000))
    );
}

#[tokio::test]
async fn sglang_loads_json_carries_the_uncached_token_queue() {
    let body = r#"{"loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_waiting_uncached_tokens": 900,
         "num_used_tokens": 5000, "max_total_num_tokens": 60000, "max_running_requests": 64},
        {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
         "num_used_tokens": 100, "max_total_num_tokens": 60000, "max_running_requests": 64}
    ]}"#;
    let answer = Mode::Body("application/json", body.to_owned());
    let extra = ", dp_size: 2, load_source: loads";
    let (_engine, pool) = scraped_once("sglang", extra, answer).await;

    let snapshot = pool.snapshot();
    let load = first_load(&snapshot);
    assert_eq!(
        (load.waiting, load.running, load.waiting_uncached_tokens),
        (1, 5, Some(900))
    );
    assert_eq!(
        snapshot.workers()[0].capacity.max_total_tokens,
        Some(120_000)
    );
}

#[tokio::test]
async fn configured_capacity_overrides_what_the_engine_reports() {
    let answer = Mode::Body(TEXT, sglang_metrics(&[(0, 0, 1)]));
    let extra = ", max_running_requests: 9, max_total_tokens: 777";
    let (_engine, pool) = scraped_once("sglang", extra, answer).await;
    let capacity = pool.snapshot().workers()[0].capacity;
    assert_eq!(
        (capacity.max_running, capacity.max_total_tokens),
        (Some(9), Some(777))
    );
}

// === faults, each beside a healthy worker ===

/// Scrapes a faulty engine next to a healthy one and returns the pool after one round.
async fn one_round_beside_a_healthy_worker(
    engine: &str,
    faulty: SocketAddr,
    extra: &str,
) -> (Pool, FakeEngine) {
    one_round_beside_a_healthy_worker_timed(engine, faulty, extra, QUICK).await
}

/// [`one_round_beside_a_healthy_worker`] with the load section's timings given.
async fn one_round_beside_a_healthy_worker_timed(
    engine: &str,
    faulty: SocketAddr,
    extra: &str,
    timing: &str,
) -> (Pool, FakeEngine) {
    let healthy_body = if engine == "vllm" {
        vllm_metrics(&[(0, 1, 1, 0.1)])
    } else {
        sglang_metrics(&[(0, 1, 1)])
    };
    let healthy = FakeEngine::start(Mode::Body(TEXT, healthy_body)).await;
    let mut pool = Pool::new(&config(
        engine,
        timing,
        &[(faulty, extra), (healthy.addr, "")],
    ));
    pool.scraper.round().await;
    assert!(
        is_fresh(&pool.snapshot(), 1),
        "the healthy worker is unaffected"
    );
    assert!(
        !is_fresh(&pool.snapshot(), 0),
        "the faulty worker has no fresh reading"
    );
    (pool, healthy)
}

#[tokio::test]
async fn a_worker_that_refuses_connections_is_a_connect_error() {
    let addr = refused_addr();
    let (pool, _healthy) = one_round_beside_a_healthy_worker("vllm", addr, "").await;
    assert_eq!(pool.scrapes(addr, ScrapeOutcome::ConnectError), 1);
    assert!(pool.snapshot().workers()[0].reading.is_none());
}

#[tokio::test]
async fn a_worker_that_hangs_times_out_without_holding_up_the_round_longer() {
    let engine = FakeEngine::start(Mode::Hang).await;
    let started = Instant::now();
    let (pool, _healthy) = one_round_beside_a_healthy_worker("vllm", engine.addr, "").await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "bounded by scrape_timeout"
    );
    assert_eq!(pool.scrapes(engine.addr, ScrapeOutcome::Timeout), 1);
    assert!(last_error(&pool.snapshot(), 0).contains("timed out"));
}

#[tokio::test]
async fn a_worker_answering_500_is_an_http_error() {
    let engine = FakeEngine::start(Mode::Status(500)).await;
    let (pool, _healthy) = one_round_beside_a_healthy_worker("vllm", engine.addr, "").await;
    assert_eq!(pool.scrapes(engine.addr, ScrapeOutcome::HttpError), 1);
    assert!(last_error(&pool.snapshot(), 0).contains("500"));
}

#[tokio::test]
async fn a_worker_answering_html_or_garbage_is_a_parse_error() {
    for body in [
        "<html><body>Welcome to nginx!</body></html>",
        "\u{0}\u{1}garbage{{{ 12 ab",
        "",
    ] {
        let engine = FakeEngine::start(Mode::Body("text/html", body.to_owned())).await;
        let (pool, _healthy) = one_round_beside_a_healthy_worker("vllm", engine.addr, "").await;
        assert_eq!(
            pool.scrapes(engine.addr, ScrapeOutcome::ParseError),
            1,
            "body {body:?}"
        );
    }
}

#[tokio::test]
async fn an_exposition_without_the_needed_series_is_a_parse_error() {
    let other = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n";
    let engine = FakeEngine::start(Mode::Body(TEXT, other.to_owned())).await;
    let (pool, _healthy) = one_round_beside_a_healthy_worker("vllm", engine.addr, "").await;
    assert_eq!(pool.scrapes(engine.addr, ScrapeOutcome::ParseError), 1);
    assert!(last_error(&pool.snapshot(), 0).contains("vllm:num_requests_waiting"));
}

#[tokio::test]
async fn a_worker_missing_a_data_parallel_rank_has_no_fresh_reading() {
    let engine = FakeEngine::start(Mode::Body(
        TEXT,
        vllm_metrics(&[(0, 0, 1, 0.1), (2, 0, 1, 0.1)]),
    ))
    .await;
    let (pool, _healthy) =
        one_round_beside_a_healthy_worker("vllm", engine.addr, ", dp_size: 3").await;
    let snapshot = pool.snapshot();
    let reading = snapshot.workers()[0].reading.expect("partial reading kept");
    assert!(!reading.complete);
    assert_eq!(pool.scrapes(engine.addr, ScrapeOutcome::Ok), 1);
    assert!(
        last_error(&snapshot, 0).contains("rank 1 missing"),
        "{}",
        last_error(&snapshot, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_cap_is_abandoned_as_an_http_error() {
    // The fake engine streams 50 MiB on the test's own runtime; on a loaded machine that can delay the
    // healthy worker's answer past QUICK's 150 ms, which is not what this test is about.
    const ROOMY: &str = "scrape_interval: 2s, scrape_timeout: 1500ms, freshness: 5s";
    for declared in [true, false] {
        let engine = FakeEngine::start(Mode::Huge {
            size: 50 << 20,
            declared,
        })
        .await;
        let (pool, _healthy) =
            one_round_beside_a_healthy_worker_timed("vllm", engine.addr, "", ROOMY).await;
        assert_eq!(
            pool.scrapes(engine.addr, ScrapeOutcome::HttpError),
            1,
            "declared length {declared}"
        );
        assert!(
            last_error(&pool.snapshot(), 0).contains("cap"),
            "{}",
            last_error(&pool.snapshot(), 0)
        );
    }
}

#[tokio::test]
async fn a_rank_that_stops_reporting_ages_the_whole_reading_out() {
    let engine = FakeEngine::start(Mode::Body(TEXT, sglang_metrics(&[(0, 1, 1), (1, 1, 1)]))).await;
    let load = "scrape_interval: 100ms, scrape_timeout: 100ms, freshness: 300ms";
    let mut pool = Pool::new(&config("sglang", load, &[(engine.addr, ", dp_size: 2")]));
    pool.scraper.round().await;
    assert!(is_fresh(&pool.snapshot(), 0));

    engine.set(Mode::Body(TEXT, sglang_metrics(&[(0, 1, 1)])));
    pool.scraper.round().await;
    // Rank 1's sample from the first round still stands, so the reading is complete but as old as it.
    let snapshot = pool.snapshot();
    let reading = snapshot.workers()[0].reading.unwrap();
    assert!(reading.complete);
    tokio::time::sleep(Duration::from_millis(350)).await;
    pool.scraper.round().await;
    assert!(
        !is_fresh(&pool.snapshot(), 0),
        "the oldest rank decides the age"
    );
}

// === the periodic scraper ===

async fn run_for(scraper: Scraper, wall: Duration, mut during: impl FnMut()) {
    let stop = Shutdown::default();
    let task = tokio::spawn(scraper.run(stop.signal()));
    let deadline = Instant::now() + wall;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        during();
    }
    stop.trigger();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the scraper stops on shutdown")
        .expect("no panic");
}

#[tokio::test]
async fn a_hung_worker_never_delays_another_workers_sample() {
    let hung = FakeEngine::start(Mode::Hang).await;
    let healthy = FakeEngine::start(Mode::Body(TEXT, vllm_metrics(&[(0, 0, 1, 0.1)]))).await;
    let load = "scrape_interval: 100ms, scrape_timeout: 50ms, freshness: 500ms";
    let pool = Pool::new(&config(
        "vllm",
        load,
        &[(hung.addr, ""), (healthy.addr, "")],
    ));
    let state = Arc::clone(&pool.load);
    let mut worst_age = Duration::ZERO;
    let mut checks = 0;
    run_for(pool.scraper, Duration::from_millis(1200), || {
        let snapshot = state.snapshot();
        if let Some(reading) = snapshot.workers()[1].reading
            && snapshot.version > 2
        {
            worst_age =
                worst_age.max(Instant::now().saturating_duration_since(reading.captured_at));
            checks += 1;
        }
    })
    .await;
    assert!(checks > 20);
    assert!(
        worst_age < Duration::from_millis(300),
        "healthy reading lagged {worst_age:?}"
    );
    assert!(
        healthy.hits() >= 8,
        "scraped every tick: {}",
        healthy.hits()
    );
    let timeouts = pool
        .metrics
        .scrapes
        .with_label_values(&["m", &hung.addr.to_string(), "timeout"])
        .get();
    assert!(timeouts >= 5, "timeouts {timeouts}");
}

#[tokio::test]
async fn a_worker_that_flips_between_healthy_and_failing_goes_stale_and_fresh_again() {
    let engine = FakeEngine::start(Mode::Body(TEXT, vllm_metrics(&[(0, 2, 2, 0.1)]))).await;
    let load = "scrape_interval: 100ms, scrape_timeout: 100ms, freshness: 400ms";
    let config = config("vllm", load, &[(engine.addr, "")]);
    let pool = Pool::new(&config);
    let state = Arc::clone(&pool.load);
    let stop = Shutdown::default();
    let task = tokio::spawn(pool.scraper.run(stop.signal()));

    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(is_fresh(&state.snapshot(), 0));
    state.dispatches().record(WorkerId(0), 0);
    state.dispatches().record(WorkerId(0), 0);

    engine.set(Mode::Status(503));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        state.dispatches().since_reading(WorkerId(0)),
        2,
        "no new reading, no reset"
    );
    // Stale within freshness (400ms) plus one interval of slack.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !is_fresh(&state.snapshot(), 0),
        "stale once freshness passed"
    );
    assert!(
        pool.metrics
            .render()
            .contains("cachepick_workers_stale{pool=\"m\"} 1")
    );

    engine.set(Mode::Body(TEXT, vllm_metrics(&[(0, 5, 1, 0.1)])));
    tokio::time::sleep(Duration::from_millis(250)).await;
    let snapshot = state.snapshot();
    assert_eq!(
        snapshot
            .fresh_load(WorkerId(0), Instant::now())
            .map(|l| l.waiting),
        Some(5)
    );
    assert_eq!(
        state.dispatches().since_reading(WorkerId(0)),
        0,
        "a new reading covers what was sent"
    );
    assert!(
        pool.metrics
            .render()
            .contains("cachepick_workers_fresh{pool=\"m\"} 1")
    );
    let info = format!(
        "cachepick_worker_info{{pool=\"m\",role=\"both\",worker=\"{}\"}} 1",
        engine.addr
    );
    assert!(pool.metrics.render().lines().any(|line| line == info));
    let errors = pool
        .metrics
        .scrapes
        .with_label_values(&["m", &engine.addr.to_string(), "http_error"])
        .get();
    assert!(errors >= 3, "http errors {errors}");

    stop.trigger();
    task.await.unwrap();
}

#[tokio::test]
async fn requests_dispatched_while_a_scrape_is_in_flight_stay_counted() {
    let body = vllm_metrics(&[(0, 0, 0, 0.1)]);
    let engine = FakeEngine::start(Mode::Slow(Duration::from_millis(80), body)).await;
    let mut pool = Pool::new(&config("vllm", QUICK, &[(engine.addr, "")]));
    let load = Arc::clone(&pool.load);
    load.dispatches().record(WorkerId(0), 0);
    let scraping = pool.scraper.round();
    let dispatching = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        for _ in 0..5 {
            load.dispatches().record(WorkerId(0), 0);
        }
    };
    tokio::join!(scraping, dispatching);
    assert!(is_fresh(&pool.snapshot(), 0));
    assert_eq!(
        load.dispatches().since_reading(WorkerId(0)),
        5,
        "the one sent before the scrape is covered by it; the five sent during it are not"
    );
}

#[tokio::test]
async fn failing_workers_queue_behind_healthy_ones_for_scrape_slots() {
    let mut hung = Vec::new();
    for _ in 0..4 {
        hung.push(FakeEngine::start(Mode::Hang).await);
    }
    let healthy = FakeEngine::start(Mode::Body(TEXT, vllm_metrics(&[(0, 0, 1, 0.1)]))).await;
    let load =
        "scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s, max_concurrent_scrapes: 2";
    let mut workers: Vec<(SocketAddr, &str)> =
        hung.iter().map(|engine| (engine.addr, "")).collect();
    workers.push((healthy.addr, ""));
    let pool = Pool::new(&config("vllm", load, &workers));
    let state = Arc::clone(&pool.load);
    let mut worst_age = Duration::ZERO;
    run_for(pool.scraper, Duration::from_millis(1500), || {
        let snapshot = state.snapshot();
        if let Some(reading) = snapshot.workers()[4].reading {
            worst_age =
                worst_age.max(Instant::now().saturating_duration_since(reading.captured_at));
        }
    })
    .await;
    // Once the hung workers have failed once, the healthy one is first in line every tick.
    assert!(
        healthy.hits() >= 6,
        "healthy worker scraped {} times",
        healthy.hits()
    );
    assert!(
        worst_age < Duration::from_millis(600),
        "healthy reading lagged {worst_age:?}"
    );
}

#[tokio::test]
async fn a_fresh_worker_that_starts_hanging_goes_stale_within_freshness_and_spares_the_other() {
    let flaky = FakeEngine::start(Mode::Body(TEXT, vllm_metrics(&[(0, 1, 1, 0.1)]))).await;
    let steady = FakeEngine::start(Mode::Body(TEXT, vllm_metrics(&[(0, 1, 1, 0.1)]))).await;
    let load = "scrape_interval: 100ms, scrape_timeout: 50ms, freshness: 300ms";
    let pool = Pool::new(&config(
        "vllm",
        load,
        &[(flaky.addr, ""), (steady.addr, "")],
    ));
    let state = Arc::clone(&pool.load);
    let stop = Shutdown::default();
    let task = tokio::spawn(pool.scraper.run(stop.signal()));
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(is_fresh(&state.snapshot(), 0) && is_fresh(&state.snapshot(), 1));

    flaky.set(Mode::Hang);
    // freshness (300ms) plus one interval of slack.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let snapshot = state.snapshot();
    assert!(!is_fresh(&snapshot, 0), "a hung worker's reading ages out");
    assert!(is_fresh(&snapshot, 1), "the other worker is unaffected");
    assert!(last_error(&snapshot, 0).contains("timed out"));
    stop.trigger();
    task.await.unwrap();
}

//! The scrape loop in paused time, against engines on loopback: the runtime's clock moves only when
//! every task waits, so ticks and timeouts fire at exact virtual instants and a test of seconds of
//! scraping runs in milliseconds. Unless a test says otherwise the interval is 1s, the timeout 500ms,
//! `freshness` 3s and `unreachable_after` 2.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant as TokioInstant;

use super::*;
use crate::config::{self, Config, Overrides};
use crate::load::snapshot::{Lifecycle, PoolSnapshot, ScrapeOutcome, WorkerState};

const TIMEOUT: Duration = Duration::from_millis(500);
const MILLI: Duration = Duration::from_millis(1);

const METRICS: &str = "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\n";

/// How a fake engine treats a scrape.
#[derive(Clone, Copy)]
enum Engine {
    /// Answers every request on the connection with [`METRICS`].
    Answers,
    /// Reads the request and never answers.
    Hangs,
}

/// A fake engine on loopback and what it has seen.
struct Fake {
    addr: SocketAddr,
    /// Connections accepted.
    connections: Arc<AtomicUsize>,
    /// Requests read.
    requests: Arc<AtomicUsize>,
}

impl Fake {
    async fn start(engine: Engine) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (accepted, read) = (Arc::clone(&connections), Arc::clone(&requests));
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, engine, Arc::clone(&read)));
            }
        });
        Fake {
            addr,
            connections,
            requests,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// Serves one connection: every request is read whole (no body), then answered or not.
async fn serve(mut stream: TcpStream, engine: Engine, requests: Arc<AtomicUsize>) {
    let mut buffer = Vec::new();
    let mut chunk = [0_u8; 1024];
    loop {
        let Ok(read) = stream.read(&mut chunk).await else {
            return;
        };
        if read == 0 {
            return;
        }
        buffer.extend_from_slice(&chunk[..read]);
        while let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            buffer.drain(..end + 4);
            requests.fetch_add(1, Ordering::SeqCst);
            if let Engine::Answers = engine {
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{METRICS}",
                    METRICS.len()
                );
                if stream.write_all(response.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Counters nobody reads; the loop's tests look at the snapshot.
struct Unobserved;

impl ScrapeObserver for Unobserved {
    fn scrape_counter(&self, _: &str, _: &str, _: ScrapeOutcome) -> IntCounter {
        IntCounter::new("scrapes", "scrapes").unwrap()
    }

    fn watch_pool(&self, _: Arc<PoolLoad>) {}

    fn worker_left(&self, _: &str, _: &str) {}
}

fn config(workers: &[&Fake], load: &str) -> Config {
    let mut yaml = format!(
        "load: {{scrape_interval: 1s, scrape_timeout: 500ms, freshness: 3s, unreachable_after: 2{load}}}\n\
         pools:\n  - model: m\n    engine: vllm\n    workers:\n"
    );
    for worker in workers {
        yaml.push_str(&format!("      - {{endpoint: \"{}\"}}\n", worker.addr));
    }
    config::parse(&yaml, "test.yaml", &Overrides::default()).unwrap()
}

/// The pool's scraper, running until the test's runtime ends.
fn run(config: &Config) -> Arc<PoolLoad> {
    let pool = PoolLoad::new(&config.pools[0], &config.load);
    let scraper = Scraper::new(
        &config.pools[0],
        &config.load,
        Arc::clone(&pool),
        Arc::new(Unobserved),
    );
    tokio::spawn(scraper.run(std::future::pending()));
    pool
}

fn worker(snapshot: &PoolSnapshot, fake: &Fake) -> WorkerState {
    snapshot.by_endpoint(fake.addr).unwrap().clone()
}

#[tokio::test(start_paused = true)]
async fn a_hung_worker_does_not_delay_another_workers_sample() {
    let hung = Fake::start(Engine::Hangs).await;
    let healthy = Fake::start(Engine::Answers).await;
    let start = TokioInstant::now();
    let pool = run(&config(&[&hung, &healthy], ""));

    tokio::time::sleep_until(start + TIMEOUT - MILLI).await;
    let snapshot = pool.snapshot();
    let answered = worker(&snapshot, &healthy);
    let reading = answered.reading.expect("the healthy worker's sample is in");
    assert_eq!(
        reading.captured_at,
        start.into_std(),
        "requested at the first tick"
    );
    assert_eq!((reading.load.waiting, reading.load.running), (2, 1));
    assert_eq!(answered.lifecycle, Lifecycle::Healthy);
    let waiting = worker(&snapshot, &hung);
    assert_eq!(
        (hung.requests(), waiting.scrape.attempts),
        (1, 0),
        "still out"
    );
    assert_eq!(
        *pool.rounds().borrow(),
        0,
        "the round waits for its last request"
    );
}

#[tokio::test(start_paused = true)]
async fn the_timeout_fires_at_scrape_timeout_and_two_in_a_row_make_a_worker_unreachable() {
    let hung = Fake::start(Engine::Hangs).await;
    let start = TokioInstant::now();
    let pool = run(&config(&[&hung], ""));
    let state = |pool: &PoolLoad| worker(&pool.snapshot(), &hung);

    tokio::time::sleep_until(start + TIMEOUT - MILLI).await;
    assert_eq!(state(&pool).scrape.last_outcome, None);
    tokio::time::sleep_until(start + TIMEOUT + MILLI).await;
    let first = state(&pool);
    assert_eq!(first.scrape.last_outcome, Some(ScrapeOutcome::Timeout));
    assert_eq!(
        first.scrape.last_error.as_deref(),
        Some("timed out after 500ms")
    );
    assert_eq!(first.lifecycle, Lifecycle::New, "new until it answers");
    assert_eq!(
        *pool.rounds().borrow(),
        1,
        "a round ends when its requests do"
    );

    // The next tick, at 1s, asks again; that one times out at 1.5s.
    tokio::time::sleep_until(start + Duration::from_secs(1) + TIMEOUT - MILLI).await;
    assert_eq!(
        (hung.requests(), state(&pool).lifecycle),
        (2, Lifecycle::New)
    );
    tokio::time::sleep_until(start + Duration::from_secs(1) + TIMEOUT + MILLI).await;
    let second = state(&pool);
    assert_eq!(
        (second.scrape.attempts, second.lifecycle),
        (2, Lifecycle::Unreachable)
    );
}

#[tokio::test(start_paused = true)]
async fn the_interval_ticks_and_each_tick_scrapes_every_idle_worker_once() {
    let first = Fake::start(Engine::Answers).await;
    let second = Fake::start(Engine::Answers).await;
    let start = TokioInstant::now();
    let pool = run(&config(&[&first, &second], ""));

    tokio::time::sleep_until(start + Duration::from_millis(3500)).await;
    assert_eq!(
        (first.requests(), second.requests()),
        (4, 4),
        "ticks at 0, 1, 2 and 3s"
    );
    assert_eq!(*pool.rounds().borrow(), 4);
    let snapshot = pool.snapshot();
    let reading = worker(&snapshot, &first).reading.unwrap();
    assert_eq!(
        reading.captured_at,
        (start + Duration::from_secs(3)).into_std(),
        "the latest sample, from the last tick"
    );
    assert!(snapshot.is_fresh(&reading, TokioInstant::now().into_std()));
    assert_eq!(
        (first.connections(), second.connections()),
        (1, 1),
        "kept alive"
    );
}

#[tokio::test(start_paused = true)]
async fn at_most_max_concurrent_scrapes_requests_are_out_at_once() {
    let one = Fake::start(Engine::Hangs).await;
    let two = Fake::start(Engine::Hangs).await;
    let start = TokioInstant::now();
    run(&config(&[&one, &two], ", max_concurrent_scrapes: 1"));
    let out = || one.connections() + two.connections();

    tokio::time::sleep_until(start + TIMEOUT / 2).await;
    assert_eq!(out(), 1, "the second waits for the first's permit");
    // The first times out at 500ms and hands its permit on; the second's own timeout starts then.
    tokio::time::sleep_until(start + TIMEOUT + TIMEOUT / 2).await;
    assert_eq!((one.connections(), two.connections()), (1, 1));
}

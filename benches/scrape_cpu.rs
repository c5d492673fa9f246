//! CPU cost of keeping a large fleet's load fresh: the periodic scraper against 256 local workers.
//!
//! Run: `cargo bench --bench scrape_cpu` (env: `SCRAPE_WORKERS`, default 256; `SCRAPE_BODY_KB`, default
//! 200; `SCRAPE_SECONDS`, default 20). The workers run in a child process, so the figure is the picker's
//! own CPU: user + system time of this process over the run, as a share of one core.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

// Tests and benchmarks measure real time; the clock ban is for the code that decides.

#[path = "../tests/support/engine.rs"]
mod engine;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachepick::config::{self, Overrides};
use cachepick::load::{PoolLoad, Scraper};
use cachepick::metrics::Metrics;
use cachepick_rig::stage::Shutdown;
use engine::{FakeEngine, Mode};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A vLLM exposition of about `kb` kilobytes: the gauges cachepick reads, then the latency and token
/// histograms a real server emits, repeated over label sets until the size is reached.
fn exposition(kb: usize) -> String {
    let mut out = engine::vllm_metrics(&[(0, 2, 11, 0.42)]);
    let histograms = [
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_queue_time_seconds",
    ];
    let buckets = [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0",
        "+Inf",
    ];
    let mut set = 0;
    while out.len() < kb * 1024 {
        for name in histograms {
            out.push_str(&format!(
                "# HELP {name} Histogram of {name}.\n# TYPE {name} histogram\n"
            ));
            for (i, le) in buckets.iter().enumerate() {
                out.push_str(&format!(
                    "{name}_bucket{{engine=\"0\",le=\"{le}\",model_name=\"model-{set}\"}} {}.0\n",
                    i * 37 + set
                ));
            }
            out.push_str(&format!(
                "{name}_sum{{engine=\"0\",model_name=\"model-{set}\"}} 1234.5\n"
            ));
            out.push_str(&format!(
                "{name}_count{{engine=\"0\",model_name=\"model-{set}\"}} 851.0\n"
            ));
        }
        set += 1;
    }
    out
}

fn cpu_seconds() -> f64 {
    // utime and stime are fields 14 and 15 of /proc/self/stat, in clock ticks (100 per second on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after_name = &stat[stat.rfind(')').expect("comm field") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

fn farm(workers: usize, kb: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let body = exposition(kb);
        let mut engines = Vec::new();
        for _ in 0..workers {
            engines.push(
                FakeEngine::start(Mode::Body("text/plain; version=0.0.4", body.clone())).await,
            );
        }
        let mut stdout = std::io::stdout();
        for engine in &engines {
            writeln!(stdout, "{}", engine.addr).unwrap();
        }
        writeln!(stdout, "ready {}", body.len()).unwrap();
        stdout.flush().unwrap();
        // Serve until the parent closes our stdin.
        let _ =
            tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await;
    });
}

fn main() {
    let workers = env("SCRAPE_WORKERS", 256) as usize;
    let kb = env("SCRAPE_BODY_KB", 200) as usize;
    let seconds = env("SCRAPE_SECONDS", 20);
    if std::env::var_os("SCRAPE_FARM").is_some() {
        farm(workers, kb);
        return;
    }
    if std::env::args().any(|arg| arg == "--list") {
        return; // `cargo bench -- --list` and friends: nothing to enumerate.
    }

    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("SCRAPE_FARM", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the worker farm");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut yaml = String::from(
        "load: {scrape_interval: 1s, scrape_timeout: 500ms, freshness: 3s}\npools:\n  - model: m\n    engine: vllm\n    workers:\n",
    );
    let body_len = loop {
        let line = lines.next().expect("farm output").unwrap();
        if let Some(len) = line.strip_prefix("ready ") {
            break len.parse::<usize>().unwrap();
        }
        yaml.push_str(&format!("      - endpoint: \"{line}\"\n"));
    };
    let config = config::parse(&yaml, "bench.yaml", &Overrides::default()).expect("bench config");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (rounds, fresh) = runtime.block_on(async {
        let metrics = Arc::new(Metrics::new().unwrap());
        let pool = &config.pools[0];
        let load = PoolLoad::new(pool, &config.load);
        let scraper = Scraper::new(pool, &config.load, Arc::clone(&load), metrics.clone());
        let stop = Shutdown::default();
        let task = tokio::spawn(scraper.run(stop.signal()));
        // Warm-up: connections opened, first round parsed.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cpu_before = cpu_seconds();
        let wall = Instant::now();
        let rounds_before = *load.rounds().borrow();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let cpu = cpu_seconds() - cpu_before;
        let elapsed = wall.elapsed().as_secs_f64();
        let rounds = *load.rounds().borrow() - rounds_before;
        let snapshot = load.snapshot();
        let fresh = snapshot
            .workers()
            .iter()
            .filter(|w| snapshot.fresh_load(w.id, Instant::now()).is_some())
            .count();
        stop.trigger();
        let _ = task.await;
        println!(
            "scrape_cpu: {workers} workers x {:.0} KB every 1s: {:.2}% of one core ({cpu:.2} s CPU over {elapsed:.1} s, \
             {rounds} rounds, {:.1} MB/s scraped)",
            body_len as f64 / 1024.0,
            100.0 * cpu / elapsed,
            (workers * body_len) as f64 * rounds as f64 / elapsed / 1e6,
        );
        (rounds, fresh)
    });
    println!("scrape_cpu: {fresh}/{workers} workers fresh at the end, {rounds} rounds");
    drop(child.stdin.take());
    let _ = child.wait();
}

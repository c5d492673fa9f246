//! Can the simulator sustain its fleet? 8 workers × 200 concurrent SSE streams, driven from this
//! process against `cachepick sim` in a child process, on whatever cores the machine has.
//!
//! Each of the 1,600 client slots loops: a streaming `/v1/completions` with a 1,024-token prompt and
//! `max_tokens` 200, read to `[DONE]`. The model has no load slow-down and no jitter, so every stream's
//! modelled decode time is exactly 199 × the inter-token latency (the slots model, `timing: slots`, whose
//! requests pace themselves; the step model's pace is measured by the full-trace replay in
//! BENCHMARKS.md); the bench reports how far the
//! delivered streams are from the model (decode-time ratio), TTFT against the modelled prefill, the
//! token rate, and the CPU the simulator and the client used.
//!
//! Run: `cargo bench --bench sim_streams` (about 40 s). Environment knobs: `SIM_WORKERS` (8),
//! `SIM_STREAMS` per worker (200), `SIM_SECONDS` measured (20), `SIM_ITL_MS` (20).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

const PROMPT_TOKENS: usize = 1024;
const MAX_TOKENS: u32 = 200;

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map(|both| both.iter().filter_map(|f| f.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

#[derive(Default)]
struct Tally {
    streams: AtomicU64,
    errors: AtomicU64,
    tokens: AtomicU64,
    events: AtomicU64,
}

struct Samples {
    ttft: Vec<f64>,
    decode_ratio: Vec<f64>,
}

fn body(slot: usize) -> String {
    // Distinct prompts per slot: the bench measures streaming, not cache hits.
    let tokens: Vec<String> = (0..PROMPT_TOKENS)
        .map(|i| ((slot * 7919 + i * 31) % 50_000).to_string())
        .collect();
    format!(
        "{{\"model\":\"sim-model\",\"prompt\":[{}],\"max_tokens\":{MAX_TOKENS},\"stream\":true,\
         \"stream_options\":{{\"include_usage\":true}}}}",
        tokens.join(",")
    )
}

/// One streaming request on a fresh connection; returns (ttft, total, events, completion tokens).
async fn stream_once(addr: SocketAddr, body: &str) -> Option<(Duration, Duration, u64, u64)> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut buffer = vec![0u8; 64 * 1024];
    let mut seen = Vec::with_capacity(64 * 1024);
    let mut first = None;
    let mut events = 0;
    loop {
        let read = stream.read(&mut buffer).await.ok()?;
        if read == 0 {
            return None;
        }
        let chunk = &buffer[..read];
        let new_events = chunk.windows(6).filter(|w| w == b"data: ").count() as u64;
        if new_events > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        events += new_events;
        seen.extend_from_slice(chunk);
        if seen.windows(12).any(|w| w == b"data: [DONE]") {
            break;
        }
        if seen.len() > 8 * 1024 {
            // Keep only the tail: the usage chunk and [DONE] come last.
            let keep = seen.split_off(seen.len() - 4096);
            seen = keep;
        }
    }
    let total = started.elapsed();
    let text = String::from_utf8_lossy(&seen);
    let tokens = text
        .split("\"completion_tokens\":")
        .nth(1)
        .and_then(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0);
    Some((first?, total, events, tokens))
}

/// Sorts `values` and reads the rig's percentile of them (NaN when empty, so a table still prints).
fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    cachepick_rig::replay::report::percentile(values, p).unwrap_or(f64::NAN)
}

// Over 100 lines: one measurement, start to report: the simulator started, streams driven, CPU and
// latency printed.
fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs benches as tests: skip the long run
    // there, say so, and succeed only for that invocation.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("sim_streams: run with `cargo bench --bench sim_streams`");
        return;
    }
    let workers = knob("SIM_WORKERS", 8);
    let per_worker = knob("SIM_STREAMS", 200);
    let seconds = knob("SIM_SECONDS", 20);
    let itl_ms = knob("SIM_ITL_MS", 20);

    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("sim.yaml");
    std::fs::write(
        &config,
        format!(
            "engine: vllm\ntiming: slots\nworkers: {workers}\ntokenizer: {{kind: bytes}}\nkv_blocks: 65536\n\
             max_running: 256\ninter_token_latency: {itl_ms}ms\nprefill_overhead: 10ms\n\
             prefill_per_token: 0.02ms\nload_slowdown: 1\njitter: 0\n"
        ),
    )
    .expect("write config");
    let mut child = Command::new(cachepick_rig::cachepick_binary())
        .args(["sim", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start cachepick sim");
    let pid = child.id().to_string();
    let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
    let mut addrs: Vec<SocketAddr> = Vec::new();
    let mut line = String::new();
    while addrs.len() < workers as usize {
        line.clear();
        if lines.read_line(&mut line).expect("read sim output") == 0 {
            panic!("cachepick sim exited before listing its workers");
        }
        if let Some(url) = line.trim().strip_prefix("worker ")
            && let Some((_, url)) = url.split_once(' ')
        {
            addrs.push(
                url.trim_start_matches("http://")
                    .parse()
                    .expect("worker address"),
            );
        }
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let tally = Arc::new(Tally::default());
    let samples = Arc::new(Mutex::new(Samples {
        ttft: Vec::new(),
        decode_ratio: Vec::new(),
    }));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let modelled_decode = (f64::from(MAX_TOKENS) - 1.0) * itl_ms as f64 / 1000.0;
    // Each slot repeats its prompt, so after its first stream all but the last partial block hits:
    // prefill is the overhead plus 16 uncached tokens.
    let cached = (PROMPT_TOKENS - 1) / 16 * 16;
    let modelled_ttft = 0.010 + (PROMPT_TOKENS - cached) as f64 * 0.000_02;

    let (sim_cpu, client_cpu, wall) = runtime.block_on(async {
        let mut tasks = Vec::new();
        let slots = workers * per_worker;
        for slot in 0..slots as usize {
            let addr = addrs[slot % addrs.len()];
            let tally = Arc::clone(&tally);
            let samples = Arc::clone(&samples);
            let measuring = Arc::clone(&measuring);
            let stop = Arc::clone(&stop);
            let body = body(slot);
            // Spread the first requests over two seconds: 1,600 simultaneous SYNs overflow the backlog.
            let delay = Duration::from_micros((slot as u64 * 2_000_000) / slots);
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                while !stop.load(Ordering::Relaxed) {
                    let result = stream_once(addr, &body).await;
                    if !measuring.load(Ordering::Relaxed) {
                        continue;
                    }
                    match result {
                        Some((ttft, total, events, tokens)) if tokens == u64::from(MAX_TOKENS) => {
                            tally.streams.fetch_add(1, Ordering::Relaxed);
                            tally.tokens.fetch_add(tokens, Ordering::Relaxed);
                            tally.events.fetch_add(events, Ordering::Relaxed);
                            let decode = (total - ttft).as_secs_f64();
                            let mut samples = samples.lock().await;
                            samples.ttft.push(ttft.as_secs_f64());
                            samples.decode_ratio.push(decode / modelled_decode);
                        }
                        _ => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        // Warm up until every slot has had its first stream in flight.
        tokio::time::sleep(Duration::from_secs(6)).await;
        measuring.store(true, Ordering::Relaxed);
        let sim_before = cpu_seconds(&pid);
        let client_before = cpu_seconds("self");
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let wall = started.elapsed().as_secs_f64();
        let sim_cpu = cpu_seconds(&pid) - sim_before;
        let client_cpu = cpu_seconds("self") - client_before;
        measuring.store(false, Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.abort();
        }
        (sim_cpu, client_cpu, wall)
    });
    let _ = child.kill();
    let _ = child.wait();

    let (mut ttft, mut ratios) = {
        let samples = runtime.block_on(samples.lock());
        (samples.ttft.clone(), samples.decode_ratio.clone())
    };
    let streams = tally.streams.load(Ordering::Relaxed);
    let tokens = tally.tokens.load(Ordering::Relaxed);
    let events = tally.events.load(Ordering::Relaxed);
    let errors = tally.errors.load(Ordering::Relaxed);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "sim_streams: {workers} workers × {per_worker} streams, ITL {itl_ms} ms, {seconds} s measured"
    );
    let _ = writeln!(
        out,
        "  streams completed {streams} ({:.1}/s), errors {errors}, tokens {:.0}/s (model at full \
         concurrency: {:.0}/s), SSE events {:.0}/s ({:.2} tokens per event)",
        streams as f64 / wall,
        tokens as f64 / wall,
        (workers * per_worker) as f64 * 1000.0 / itl_ms as f64,
        events as f64 / wall,
        tokens as f64 / events.max(1) as f64,
    );
    let _ = writeln!(
        out,
        "  TTFT p50 {:.1} ms p99 {:.1} ms (modelled prefill {:.1} ms; the rest is connect and scheduling)",
        percentile(&mut ttft, 0.5) * 1000.0,
        percentile(&mut ttft, 0.99) * 1000.0,
        modelled_ttft * 1000.0
    );
    let _ = writeln!(
        out,
        "  decode time ÷ modelled: p50 {:.3} p99 {:.3} (1.000 = the model exactly)",
        percentile(&mut ratios, 0.5),
        percentile(&mut ratios, 0.99)
    );
    let _ = writeln!(
        out,
        "  CPU: simulator {:.0}% of a core, client {:.0}% of a core",
        sim_cpu / wall * 100.0,
        client_cpu / wall * 100.0
    );
}

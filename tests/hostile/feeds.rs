//! Hostile feeds and files against the real `cachepick serve` process (issue 23, items 5–7): a KV event
//! publisher that sends one frame of hundreds of MB, a replay that answers with hundreds of MB of
//! batches, a configuration file swapped for a FIFO, `/dev/zero` and a 200 MB file as the
//! configuration, and the files `serve` refuses at start that `check` must refuse too.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use http::Method;
use serde_json::{Value, json};

use super::sim_fleet;
use super::support::engine::{FakeEngine, Mode, vllm_metrics};
use super::support::hostile_zmtp::HostileEngine;
use super::support::serve::{self, Server, http_get};
use cachepick_rig::client::{Client as PickerClient, Verdict};
use cachepick_sim::{Engine, KvEventsConfig, KvEventsFormat};

use self::sim_client::{COMPLETIONS, Client, DEADLINE, MODEL, bounded, read_whole};
use super::sim_client;

/// A running `cachepick serve` with its log lines and addresses.
struct Picker {
    server: Server,
    lines: mpsc::Receiver<String>,
    log: String,
    listen: SocketAddr,
    metrics: String,
}

impl Picker {
    fn start(config: &Path) -> Picker {
        let args = [serve::ANY_PORTS.as_slice(), &["--shutdown-grace", "0s"]].concat();
        let mut command = serve::command(config, &args, "info,cachepick::events=debug");
        let (server, lines) = serve::spawn_logged(&mut command);
        let mut log = String::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let started = loop {
            let line = lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("serve logs its addresses; log:\n{log}"));
            log.push_str(&line);
            log.push('\n');
            if line.contains("cachepick started") {
                break line;
            }
        };
        let field = |name: &str| {
            started
                .split(&format!(" {name}="))
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .unwrap_or_else(|| panic!("{name} in {started}"))
                .to_owned()
        };
        Picker {
            server,
            lines,
            log,
            listen: field("listen").parse().unwrap(),
            metrics: field("metrics_listen"),
        }
    }

    fn pid(&self) -> u32 {
        self.server.0.id()
    }

    /// Every log line so far.
    fn log(&mut self) -> &str {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push_str(&line);
            self.log.push('\n');
        }
        &self.log
    }

    /// Waits up to `within` until the log has `text`.
    fn logged(&mut self, within: Duration, text: &str) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.log().contains(text) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn metric(&self, line_prefix: &str) -> u64 {
        let text = http_get(&self.metrics, "/metrics");
        text.lines()
            .find_map(|line| line.strip_prefix(line_prefix))
            .map_or(0, |value| value.trim().parse().unwrap())
    }

    fn reloads(&self, outcome: &str) -> u64 {
        self.metric(&format!(
            "cachepick_config_reloads_total{{outcome=\"{outcome}\"}} "
        ))
    }

    /// The KV event stream of worker `worker`, rank 0, from `/debug/snapshot`.
    fn stream(&self, worker: u64) -> Value {
        let response = http_get(&self.metrics, "/debug/snapshot");
        let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
        let snapshot: Value = serde_json::from_str(body).expect("snapshot JSON");
        snapshot["pools"][0]["kv_events"]
            .as_array()
            .expect("kv_events streams")
            .iter()
            .find(|stream| stream["worker"] == worker && stream["rank"] == 0)
            .expect("the worker's stream")
            .clone()
    }

    /// The process's peak resident memory so far (VmHWM), in bytes.
    fn peak_rss(&self) -> u64 {
        proc_status_kib(self.pid(), "VmHWM:") * 1024
    }

    /// The process's resident memory now (VmRSS), in bytes.
    fn rss(&self) -> u64 {
        proc_status_kib(self.pid(), "VmRSS:") * 1024
    }

    /// SIGTERM, then how long the process took to exit (None: not within `within`).
    fn terminate(&mut self, within: Duration) -> Option<Duration> {
        let asked = Instant::now();
        signal(self.pid(), "-TERM");
        while asked.elapsed() < within {
            if self.server.0.try_wait().unwrap().is_some() {
                return Some(asked.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

fn signal(pid: u32, which: &str) {
    let status = Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {which} {pid}");
}

/// Waits until `check` holds, for at most `within`.
fn until(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const MIB: u64 = 1 << 20;

/// The largest a TCP socket buffer of `kind` (`tcp_rmem`, `tcp_wmem`) may grow to on this machine:
/// the third field of `/proc/sys/net/ipv4/<kind>`.
fn tcp_buffer_max(kind: &str) -> u64 {
    let path = format!("/proc/sys/net/ipv4/{kind}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{path}: {error}"));
    text.split_whitespace()
        .nth(2)
        .and_then(|max| max.parse().ok())
        .unwrap_or_else(|| panic!("{path} has no maximum: {text:?}"))
}
/// The frame the hostile publisher declares: far above any bound the picker may reach.
const FRAME_BYTES: u64 = 512 * MIB;
/// The hostile replay: 100 batches of 4 MiB (each under the 8 MiB message limit), 400 MiB in all,
/// above the picker's 256 MiB replay budget.
const REPLAY_BATCHES: u64 = 100;
const REPLAY_BATCH_BYTES: usize = 4 << 20;
/// The picker's peak resident memory stays under this: its own footprint (a debug build with two
/// pools' worth of state holds about 40 MiB) plus a few messages of at most 8 MiB each, since each
/// stream holds one message at a time. Both attacks are far above it: the frame is 512 MiB, the
/// replay 400 MiB.
const PEAK_RSS_BOUND: u64 = 160 * MIB;

/// A prompt of about `blocks` 16-token blocks under the byte tokenizer, unique to `tag`.
fn prompt(tag: &str, blocks: usize) -> String {
    let mut text = format!("{tag}: ");
    while text.len() < blocks * 16 * 4 {
        text.push_str("the quick brown fox jumps over the lazy dog. ");
    }
    text
}

// Four threads: the test's blocking HTTP reads must not starve the in-process fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_kv_event_frame_and_a_flooding_replay_stay_within_a_memory_bound() {
    let mut sim = sim_fleet::config(Engine::Vllm, 2);
    sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::VllmArray));
    let fleet = sim_fleet::start(&sim).await;
    let honest = fleet.workers()[1].addr();
    let hostile = HostileEngine::start(FRAME_BYTES, REPLAY_BATCHES, REPLAY_BATCH_BYTES);

    // Worker 0's events come from the hostile sockets (its HTTP side stays a simulated engine);
    // worker 1's from its own engine.
    let generated = fleet.cachepick_config();
    let mut text = String::new();
    let (mut live_done, mut replay_done) = (false, false);
    for line in generated.lines() {
        let trimmed = line.trim_start();
        if !live_done && trimmed.starts_with("endpoint: tcp://") {
            text.push_str(&format!("          endpoint: tcp://{}\n", hostile.live));
            live_done = true;
        } else if !replay_done && trimmed.starts_with("replay_endpoint: tcp://") {
            text.push_str(&format!(
                "          replay_endpoint: tcp://{}\n",
                hostile.replay
            ));
            replay_done = true;
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    assert!(live_done && replay_done, "{generated}");
    let text = text.replacen(
        "\n    workers:\n",
        "\n    index:\n      mode: events\n      stream_grace: 30s\n    workers:\n",
        1,
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cachepick.yaml");
    std::fs::write(&path, &text).unwrap();

    let hostile_ref = &hostile;
    let (mut picker, baseline) = tokio::task::spawn_blocking({
        let path = path.clone();
        move || {
            let picker = Picker::start(&path);
            let baseline = picker.peak_rss();
            (picker, baseline)
        }
    })
    .await
    .unwrap();

    // The hostile stream: the flood is refused at the budget, the frame from its header, and the
    // stream comes back and applies the engine's valid batches.
    let started = Instant::now();
    loop {
        let stream = picker.stream(0);
        let recovered = stream["refused_frames"].as_u64() >= Some(1)
            && stream["state"] == "live"
            && stream["batches"].as_u64() >= Some(3);
        if recovered {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the hostile stream did not recover (peak RSS {} MiB, now {} MiB): {stream:#}\nhostile: {:?}\nlog:\n{}",
            picker.peak_rss() / MIB,
            picker.rss() / MIB,
            hostile_ref.counters,
            picker.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The flood is abandoned at its 256 MiB budget (counted as refused) or, on a loaded machine, at
    // the replay's 5 s deadline, whichever comes first; either way it failed and was read no further.
    let stream = picker.stream(0);
    assert!(stream["replay_failures"].as_u64() >= Some(1), "{stream:#}");
    assert!(stream["refused_replays"].as_u64() <= Some(1), "{stream:#}");
    // The flood's sender counts what it wrote, which runs ahead of what the picker read by what the
    // kernel buffers between them: the picker's receive buffer (autotuned up to `tcp_rmem`'s maximum,
    // 32 MiB on the CI machines) and the sender's (`tcp_wmem`'s). The picker reads one batch past the
    // budget, the one that crosses it.
    let replayed = hostile.counter(|c| &c.replay_bytes_sent);
    let buffered = tcp_buffer_max("tcp_rmem") + tcp_buffer_max("tcp_wmem");
    let bound = (256 * MIB) + REPLAY_BATCH_BYTES as u64 + buffered;
    assert!(
        replayed <= bound,
        "the picker read {replayed} bytes of the flood, more than the budget, one batch and the \
         kernel's socket buffers ({buffered} bytes) allow ({bound})"
    );
    assert!(
        bound < REPLAY_BATCHES * REPLAY_BATCH_BYTES as u64,
        "the bound ({bound}) must be below the whole flood for the test to show the budget"
    );
    let frame_read = hostile.counter(|c| &c.frame_body_sent);
    assert!(
        frame_read < FRAME_BYTES / 4,
        "the picker took {frame_read} bytes of the oversized frame"
    );

    // The honest worker's events keep applying, and routing follows them.
    let text = prompt("honest", 80);
    let body = json!({"model": MODEL, "prompt": text, "max_tokens": 1});
    let reply = bounded("a direct request", DEADLINE, async {
        read_whole(
            Client::new()
                .send(Method::POST, honest, COMPLETIONS, Some(&body))
                .await,
        )
        .await
    })
    .await
    .unwrap();
    assert!(reply.status.is_success(), "{}", reply.status);
    let started = Instant::now();
    while picker.stream(1)["blocks_stored"].as_u64() < Some(1) {
        assert!(
            started.elapsed() < DEADLINE,
            "worker 1's events stopped applying: {:#}",
            picker.stream(1)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = PickerClient::connect(picker.listen).await.unwrap();
    let verdict = bounded(
        "a decision",
        DEADLINE,
        client.decide(COMPLETIONS, &serde_json::to_vec(&body).unwrap()),
    )
    .await
    .unwrap();
    match verdict {
        Verdict::Route {
            endpoints, reason, ..
        } => assert_eq!((endpoints[0], reason.as_str()), (honest, "cache_hit")),
        refused => panic!("refused: {refused:?}"),
    }

    let refused = picker.metric(
        "cachepick_kv_events_refused_total{pool=\"sim-model\",rank=\"0\",what=\"live_message\",worker=\"0\"} ",
    );
    assert_eq!(refused, 1);
    let peak = picker.peak_rss();
    eprintln!(
        "peak RSS {} MiB (at start {} MiB, now {} MiB); flood bytes sent {} MiB (the picker read up to one batch past 256 MiB; the kernel buffers the rest) (refused: {}); frame bytes read {} KiB",
        peak / MIB,
        baseline / MIB,
        picker.rss() / MIB,
        replayed / MIB,
        stream["refused_replays"],
        frame_read / 1024
    );
    assert!(
        peak < PEAK_RSS_BOUND,
        "peak RSS {} MiB over the bound of {} MiB",
        peak / MIB,
        PEAK_RSS_BOUND / MIB
    );
    let exited = tokio::task::spawn_blocking(move || picker.terminate(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(exited.is_some(), "SIGTERM did not stop the picker");
}

/// Puts a FIFO named `name` in `dir` in `path`'s place: a configuration file that is not a regular one.
fn swap_in_fifo(dir: &Path, name: &str, path: &Path) {
    let fifo = dir.join(name);
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    std::fs::rename(&fifo, path).unwrap();
}

fn file_config(workers: &[SocketAddr]) -> String {
    let mut text = "load: {scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s}\n\
                    pools:\n  - model: m\n    engine: vllm\n    workers:\n"
        .to_owned();
    for worker in workers {
        text.push_str(&format!("      - endpoint: \"{worker}\"\n"));
    }
    text
}

/// How long SIGTERM may take with `shutdown_grace: 0s`: the drain of open streams and the tasks.
const TERM_BOUND: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_swapped_for_a_fifo_is_refused_and_reload_and_sigterm_keep_working() {
    let healthy = || Mode::Body("text/plain", vllm_metrics(&[(0, 0, 0, 0.1)]));
    let a = FakeEngine::start(healthy()).await;
    let b = FakeEngine::start(healthy()).await;
    let (a, b) = (a.addr, b.addr);
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cachepick.yaml");
        std::fs::write(&path, file_config(&[a])).unwrap();
        let mut picker = Picker::start(&path);

        // A FIFO in the file's place: refused without blocking anything.
        swap_in_fifo(dir.path(), "swap.fifo", &path);
        assert!(
            picker.logged(
                Duration::from_secs(5),
                "cannot read the configuration file: not a regular file (a FIFO)"
            ),
            "{}",
            picker.log()
        );
        let invalid = picker.reloads("invalid");
        signal(picker.pid(), "-HUP");
        until(Duration::from_secs(5), "SIGHUP counted", || {
            picker.reloads("invalid") == invalid + 1
        });
        // The counter moves before the log line is written: wait for the line too.
        assert!(
            picker.logged(Duration::from_secs(5), "trigger=\"SIGHUP\""),
            "{}",
            picker.log()
        );

        // A real edit afterwards applies.
        let staged = dir.path().join("staged.yaml");
        std::fs::write(&staged, file_config(&[a, b])).unwrap();
        std::fs::rename(&staged, &path).unwrap();
        until(Duration::from_secs(5), "the edit applied", || {
            picker.reloads("applied") == 1
        });
        assert!(
            picker.logged(Duration::from_secs(5), "configuration reloaded"),
            "{}",
            picker.log()
        );

        // And a FIFO again, then SIGTERM: the process exits.
        swap_in_fifo(dir.path(), "again.fifo", &path);
        signal(picker.pid(), "-HUP");
        std::thread::sleep(Duration::from_millis(300));
        let took = picker.terminate(TERM_BOUND);
        assert!(
            took.is_some(),
            "SIGTERM did not stop the picker within {TERM_BOUND:?}:\n{}",
            picker.log()
        );
    })
    .await
    .unwrap();
}

fn run(args: &[&str]) -> Output {
    Command::new(cachepick_rig::cachepick_binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cachepick runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn dev_zero_and_a_200_mb_file_are_refused_as_configurations() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yaml");
    // Sparse: 200 MB of length without 200 MB of disk.
    std::fs::File::create(&big)
        .unwrap()
        .set_len(200 * 1000 * 1000)
        .unwrap();
    for (path, reason) in [
        (
            Path::new("/dev/zero"),
            "not a regular file (a character device)",
        ),
        (big.as_path(), "200000000 bytes; the limit is 16 MiB"),
    ] {
        for command in ["check", "serve"] {
            let started = Instant::now();
            let output = run(&[command, "--config", path.to_str().unwrap()]);
            assert_eq!(
                output.status.code(),
                Some(2),
                "{command} {}",
                path.display()
            );
            let message = stderr(&output);
            assert!(
                message.contains(&format!(
                    "cannot read configuration file {}: {reason}",
                    path.display()
                )),
                "{command}: {message}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{command} took {:?}",
                started.elapsed()
            );
        }
    }
}

/// Each configuration `serve` refuses at start: `check` refuses it too, exit 2, with the same
/// message, in which the cause appears once.
#[test]
fn check_refuses_what_serve_refuses_with_the_same_message_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let missing = dir.path().join("missing.json").display().to_string();
    let garbage = file("garbage.json", "this is not JSON");
    let bad_template = file("template.jinja", "{% for %}");
    let short_token = file("token", "short\n");
    let pool = |extra: &str| {
        format!(
            "pools:\n  - model: m\n    engine: vllm\n{extra}    workers:\n      - endpoint: 127.0.0.1:1\n"
        )
    };
    let cases = [
        (
            "a missing tokenizer",
            pool(&format!(
                "    tokenizer: {{kind: huggingface, path: {missing}}}\n"
            )),
            format!("pool m: cannot read {missing}: No such file or directory"),
            "No such file or directory",
        ),
        (
            "an unparsable tokenizer",
            pool(&format!(
                "    tokenizer: {{kind: huggingface, path: {garbage}}}\n"
            )),
            format!("pool m: {garbage} is not a usable tokenizer.json"),
            "is not a usable tokenizer.json",
        ),
        (
            "a missing chat template",
            pool(&format!("    chat_template: {missing}\n")),
            format!("pool m: cannot read {missing}: No such file or directory"),
            "No such file or directory",
        ),
        (
            "an unparsable chat template",
            pool(&format!("    chat_template: {bad_template}\n")),
            format!("pool m: chat template {bad_template}"),
            "chat template",
        ),
        (
            "a short debug token",
            format!("debug_token_file: {short_token}\n{}", pool("")),
            format!("debug_token_file {short_token} holds a token of 5 bytes"),
            "holds a token",
        ),
        (
            "a short replica_sync key",
            format!(
                "replica_sync:\n  listen: 10.0.0.7:9104\n  peers: [10.0.0.8:9104]\n  \
                 key_file: {short_token}\n{}",
                pool("")
            ),
            format!("replica_sync.key_file {short_token} line 1: a key of 5 bytes"),
            "a key of 5 bytes",
        ),
        (
            "replica_sync beyond loopback without a key",
            format!(
                "replica_sync:\n  listen: 0.0.0.0:9104\n  peers: [10.0.0.8:9104]\n{}",
                pool("")
            ),
            "replica_sync.key_file is required: 0.0.0.0:9104 (and more) is not a loopback address"
                .to_owned(),
            "key_file is required",
        ),
        (
            "allowed client identities without client certificates",
            format!(
                "tls: {{cert_file: {missing}, key_file: {missing}, allowed_client_identities: [envoy.gateway.svc]}}\n{}",
                pool("")
            ),
            "allowed_client_identities needs client_ca_file".to_owned(),
            "needs client_ca_file",
        ),
        (
            "listen equal to metrics_listen",
            format!(
                "listen: 127.0.0.1:19002\nmetrics_listen: 127.0.0.1:19002\n{}",
                pool("")
            ),
            "metrics_listen (127.0.0.1:19002) takes the port of listen (127.0.0.1:19002)"
                .to_owned(),
            "takes the port of listen",
        ),
    ];
    for (name, text, expected, once) in cases {
        let path = file("cachepick.yaml", &text);
        let checked = run(&["check", "--config", &path]);
        let served = run(&["serve", "--config", &path]);
        assert_eq!(
            checked.status.code(),
            Some(2),
            "check, {name}: {}",
            stderr(&checked)
        );
        assert_eq!(
            served.status.code(),
            Some(2),
            "serve, {name}: {}",
            stderr(&served)
        );
        assert!(
            checked.stdout.is_empty(),
            "check printed a configuration for {name}"
        );
        let message = stderr(&checked);
        assert_eq!(message, stderr(&served), "{name}: check and serve differ");
        assert!(message.contains(&expected), "{name}: {message}");
        assert_eq!(
            message.matches(once).count(),
            1,
            "{name}: {once:?} more than once in {message}"
        );
    }
}

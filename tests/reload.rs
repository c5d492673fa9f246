//! `cachepick serve` reads its file again while it runs: on a change (here a Kubernetes ConfigMap
//! update, a symlink swap in the mounted directory) and on SIGHUP. A valid file changes the workers and
//! the policy live; an invalid one changes nothing and the log lists every problem with its line; one
//! that changes what needs a restart changes nothing and says so.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
    pub mod serve;
}

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::engine::{FakeEngine, Mode, vllm_metrics};
use support::serve::{self, Server, http_get};

/// A directory laid out as the kubelet mounts a ConfigMap: `cachepick.yaml` → `..data/cachepick.yaml`,
/// `..data` → a timestamped directory, replaced by an atomic rename of a new symlink.
struct ConfigMap {
    dir: tempfile::TempDir,
    version: u32,
}

impl ConfigMap {
    fn new(text: &str) -> ConfigMap {
        let dir = tempfile::tempdir().unwrap();
        let mut map = ConfigMap { dir, version: 0 };
        map.update(text);
        std::os::unix::fs::symlink("..data/cachepick.yaml", map.path()).unwrap();
        map
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("cachepick.yaml")
    }

    /// Writes `text` into a new timestamped directory and swaps `..data` to it, as the kubelet does.
    fn update(&mut self, text: &str) {
        self.version += 1;
        let data = format!("..2026_11_30_{}", self.version);
        std::fs::create_dir(self.dir.path().join(&data)).unwrap();
        std::fs::write(self.dir.path().join(&data).join("cachepick.yaml"), text).unwrap();
        let staged = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&data, &staged).unwrap();
        std::fs::rename(&staged, self.dir.path().join("..data")).unwrap();
    }
}

fn config(workers: &[&str], extra: &str) -> String {
    let mut text = format!(
        "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n\
         load: {{scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s}}\n{extra}\
         pools:\n  - model: m\n    engine: vllm\n    workers:\n"
    );
    for worker in workers {
        text.push_str(&format!("      - endpoint: \"{worker}\"\n"));
    }
    text
}

/// The workers `/debug/snapshot` lists: (endpoint, state).
fn workers(metrics: &str) -> Vec<(String, String)> {
    let response = http_get(metrics, "/debug/snapshot");
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let pools: serde_json::Value = serde_json::from_str(body).expect("snapshot JSON");
    serve::snapshot_workers(&pools)
}

fn reloads(metrics: &str, outcome: &str) -> u64 {
    let text = http_get(metrics, "/metrics");
    let prefix = format!("cachepick_config_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |value| value.trim().parse().unwrap())
}

/// Waits until `check` holds, for at most `within`.
fn until(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The log lines `serve` printed since the last call.
fn drain(lines: &mpsc::Receiver<String>) -> String {
    let mut out = String::new();
    while let Ok(line) = lines.try_recv() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The log lines `serve` printed since the last call, waiting up to 5 s until every one of `expected`
/// is among them: the log arrives through a pipe and a reader thread, so a reload's count can be up
/// before its line has come through.
fn logged(lines: &mpsc::Receiver<String>, expected: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = String::new();
    loop {
        out.push_str(&drain(lines));
        if expected.iter().all(|text| out.contains(text)) || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn start(path: &Path) -> (Server, mpsc::Receiver<String>, String) {
    let (server, receiver) = serve::spawn_logged(&mut serve::command(path, &[], "info"));
    let metrics = serve::logged_field(&receiver, "metrics_listen");
    (server, receiver, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_file_changes_workers_live_and_a_bad_one_changes_nothing() {
    let healthy = || Mode::Body("text/plain", vllm_metrics(&[(0, 0, 0, 0.1)]));
    let a = FakeEngine::start(healthy()).await;
    let b = FakeEngine::start(healthy()).await;
    let (a, b) = (a.addr.to_string(), b.addr.to_string());
    let mut map = ConfigMap::new(&config(&[&a], ""));
    let path = map.path();
    let a2 = a.clone();
    let b2 = b.clone();
    tokio::task::spawn_blocking(move || {
        let (server, lines, metrics) = start(&path);
        until(Duration::from_secs(10), "a healthy", || {
            workers(&metrics) == [(a2.clone(), "healthy".to_owned())]
        });

        // A ConfigMap update adds b: it joins without a restart.
        map.update(&config(&[&a2, &b2], ""));
        until(Duration::from_secs(5), "b joins", || {
            workers(&metrics).contains(&(b2.clone(), "healthy".to_owned()))
        });
        assert_eq!(reloads(&metrics, "applied"), 1);
        // The log names each changed key, old → new, and the count is exported.
        let added = format!("pools[0].workers[1].endpoint: (unset) → {b2}");
        let log = logged(&lines, &["configuration reloaded", &added]);
        assert!(log.contains(&added), "{log}");
        let keys_changed = http_get(&metrics, "/metrics")
            .lines()
            .find_map(|line| line.strip_prefix("cachepick_config_keys_changed_total "))
            .map(|value| value.trim().parse::<u64>().unwrap());
        assert!(
            keys_changed.is_some_and(|keys| keys >= 1),
            "{keys_changed:?}"
        );
        // The live configuration shows the reload.
        let live = http_get(&metrics, "/debug/config");
        assert!(
            live.contains("application/yaml") && live.contains(&b2),
            "{live}"
        );

        // An invalid file: every problem with its line in the log, nothing changed.
        map.update(&format!(
            "{}        bogus: 1\n      - endpoint: nowhere\n",
            config(&[&a2, &b2], "policy: {worker_queue_limit: 0}\n")
        ));
        until(Duration::from_secs(5), "counted invalid", || {
            reloads(&metrics, "invalid") == 1
        });
        let expected = [
            "invalid; nothing changed",
            "policy.worker_queue_limit (line 4)",
            "pools[0].workers[1].bogus (line 11)",
            "pools[0].workers[2].endpoint (line 12)",
        ];
        let log = logged(&lines, &expected);
        for expected in expected {
            assert!(log.contains(expected), "missing {expected:?} in:\n{log}");
        }
        let now = workers(&metrics);
        assert_eq!(now.len(), 2, "{now:?}");

        // A valid file that moves the listen address: refused whole, and it says why.
        map.update(
            &config(&[&a2], "")
                .replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:1\n")
                .replacen(
                    "metrics_listen: 127.0.0.1:1",
                    "metrics_listen: 127.0.0.1:0",
                    1,
                ),
        );
        until(Duration::from_secs(5), "counted needs_restart", || {
            reloads(&metrics, "needs_restart") == 1
        });
        let log = logged(&lines, &["listen changed (restart to apply it)"]);
        assert!(
            log.contains("listen changed (restart to apply it)"),
            "{log}"
        );
        assert_eq!(workers(&metrics).len(), 2, "b is still there");

        // Back to a file without b: b drains and leaves; SIGHUP reads the file again even unchanged.
        map.update(&config(&[&a2], ""));
        until(Duration::from_secs(5), "b leaves", || {
            workers(&metrics) == [(a2.clone(), "healthy".to_owned())]
        });
        let applied = reloads(&metrics, "applied");
        let pid = server.0.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-HUP", &pid])
                .status()
                .unwrap()
                .success()
        );
        until(Duration::from_secs(5), "SIGHUP reloads", || {
            reloads(&metrics, "applied") == applied + 1
        });
        assert!(logged(&lines, &["trigger=\"SIGHUP\""]).contains("trigger=\"SIGHUP\""));
        drop(server);
    })
    .await
    .unwrap();
}

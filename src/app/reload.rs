//! Reloading the configuration file while serving: when its content changes, and on SIGHUP.
//!
//! The file is read again every scrape interval (at most every [`POLL`]) and compared with what was
//! last applied, so a worker added to the file is scraped, and can serve, within two scrape
//! intervals. Polling the
//! content, rather than watching inotify events, sees every way a file is replaced: an edit in place,
//! an editor's rename over it, and a Kubernetes ConfigMap update, which swaps the `..data` symlink of
//! the mounted directory without touching the file's own path (an inotify watch on the file would
//! miss it, and one on the directory must be re-armed after each swap). A look a second is one
//! `stat`: the file is read only when what the path leads to, its size or its times changed.
//!
//! The file is read off the runtime, on a thread of its own, within [`READ_TIMEOUT`], and only a
//! regular file of at most 16 MiB: a FIFO, a device or an oversized file put in its place is refused
//! (logged once, counted as `invalid`), so SIGHUP, later edits and SIGTERM keep working.
//!
//! A new file is validated in full first. An invalid one changes nothing: every problem is logged
//! with its line, and counted. A valid one that changes what only a restart can change (the listen
//! addresses, the pools themselves, their tokenizers, indexes and sources, the load settings) is
//! refused whole, with a message naming each such change. Otherwise the file's workers go to their
//! pools' scrapers (which drain, join and keep everything else, including the owner index), and the
//! policies are swapped for the next decisions: a `workers:` pool's list and every `policy:` (top
//! level and per pool) are all a reload changes, and [`restart_only_changes`] refuses a change to
//! anything else, so an applied reload never leaves a changed key unapplied.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use xxhash_rust::xxh3::xxh3_64;

use crate::config::{self, Config, Discovery, IndexMode, Overrides, PoolConfig, ReloadOutcome};
use crate::discovery::{self, SourceStatus};
use crate::load::PoolLoad;
use crate::metrics::Metrics;
use crate::prefix::EventIndex;
use crate::route::Service;

/// The longest the file goes unread: pools scraped less often still see a change within this.
pub const POLL: Duration = Duration::from_secs(1);
/// The longest one look at the file may take. A read still blocked after it (a hung network file
/// system) is left to its thread, and no other starts until it returns.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the running configuration came from, so it can be read again.
#[derive(Clone, Debug)]
pub struct Reload {
    pub path: PathBuf,
    pub overrides: Overrides,
}

/// What a reload acts on.
pub(super) struct Targets {
    pub loads: Vec<Arc<PoolLoad>>,
    pub service: Arc<Service>,
    pub metrics: Arc<Metrics>,
    /// The `file` source of each pool whose workers the file lists, by pool position.
    pub sources: Vec<Option<Arc<SourceStatus>>>,
}

/// Reloads `reload.path` when its content changes or SIGHUP arrives, until `shutdown` resolves.
/// `current` is the configuration running now.
pub(super) async fn watch(
    reload: Reload,
    mut current: Config,
    targets: Targets,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut file = FileReader::new(reload.path.clone());
    let (mut seen, mut applied) = tokio::select! {
        () = &mut shutdown => return,
        read = file.read(None) => match read {
            Ok(Look::Changed(stamp, text)) => (Some(stamp), Some(xxh3_64(text.as_bytes()))),
            _ => (None, None),
        },
    };
    // The last reason the file could not be read, so that a lasting one is logged once.
    let mut unreadable: Option<String> = None;
    let mut hangup = hangups();
    let mut ticker = tokio::time::interval(current.load.scrape_interval.min(POLL));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let asked = tokio::select! {
            () = &mut shutdown => return,
            _ = ticker.tick() => false,
            Some(()) = next_hangup(&mut hangup) => true,
        };
        // SIGHUP reads the file even when it looks unchanged.
        let hung = file.blocked.is_some();
        let look = tokio::select! {
            () = &mut shutdown => return,
            look = file.read(if asked { None } else { seen }) => look,
        };
        let text = match look {
            Ok(Look::Unchanged) => continue,
            Ok(Look::Changed(stamp, text)) => {
                seen = Some(stamp);
                unreadable = None;
                text
            }
            // Mid-swap, or removed: the running configuration stands until a file is there again.
            Err(error) if !asked && error.kind() == io::ErrorKind::NotFound => continue,
            // A poll that could not look in time (a starved machine, a hung file system) saw no
            // change: nothing is reloaded or counted, and the next poll looks again. A read still
            // hung at the next poll is worth one warning.
            Err(error) => {
                let timed_out = !asked && error.kind() == io::ErrorKind::TimedOut;
                let reason = error.to_string();
                let new = unreadable.as_ref() != Some(&reason);
                if timed_out && hung && new {
                    tracing::warn!(path = %reload.path.display(), "the configuration file cannot be polled: {reason}; the running configuration stands");
                } else if !timed_out && (asked || new) {
                    let trigger = if asked { "SIGHUP" } else { "poll" };
                    tracing::error!(path = %reload.path.display(), trigger, "cannot read the configuration file: {reason}; nothing changed");
                    targets.metrics.record_reload(ReloadOutcome::Invalid);
                }
                unreadable = Some(reason);
                if !timed_out {
                    seen = None;
                }
                continue;
            }
        };
        let hash = xxh3_64(text.as_bytes());
        if !asked && applied == Some(hash) {
            continue;
        }
        applied = Some(hash);
        let trigger = if asked { "SIGHUP" } else { "file changed" };
        let parsed = config::parse(&text, &reload.path.display().to_string(), &reload.overrides);
        drop(text);
        let outcome = match parsed {
            Err(error) => {
                tracing::error!(path = %reload.path.display(), trigger, "the reloaded configuration is invalid; nothing changed:\n{error}");
                for status in targets.sources.iter().flatten() {
                    status.failed(format!("invalid configuration: {error}"));
                }
                ReloadOutcome::Invalid
            }
            Ok(next) => {
                let refused = restart_only_changes(&current, &next);
                if refused.is_empty() {
                    apply(&next, &targets);
                    let changes = config::changed_keys(&current, &next);
                    targets.metrics.record_reload_changes(changes.len());
                    tracing::info!(path = %reload.path.display(), trigger, changed = changes.len(),
                        "configuration reloaded{}", describe(&changes));
                    targets.service.set_effective_config(&next);
                    current = next;
                    ReloadOutcome::Applied
                } else {
                    tracing::error!(path = %reload.path.display(), trigger,
                        "the reloaded configuration changes what only a restart can change; nothing changed:\n  {}",
                        refused.join("\n  "));
                    ReloadOutcome::NeedsRestart
                }
            }
        };
        targets.metrics.record_reload(outcome);
    }
}

/// What identifies a version of the file without reading it: the file the path leads to (a symlink
/// swap changes it), its size and its modification and change times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    device: u64,
    inode: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
    changed: (i64, i64),
}

impl Stamp {
    fn of(metadata: &std::fs::Metadata) -> Stamp {
        #[cfg(unix)]
        let (device, inode, changed) = {
            use std::os::unix::fs::MetadataExt;
            (
                metadata.dev(),
                metadata.ino(),
                (metadata.ctime(), metadata.ctime_nsec()),
            )
        };
        #[cfg(not(unix))]
        let (device, inode, changed) = (0, 0, (0, 0));
        Stamp {
            device,
            inode,
            len: metadata.len(),
            modified: metadata.modified().ok(),
            changed,
        }
    }
}

/// One look at the file.
enum Look {
    /// Its stamp is the one given: not read again.
    Unchanged,
    Changed(Stamp, String),
}

/// Reads the file off the runtime, on a thread of its own, within [`READ_TIMEOUT`]; only a regular
/// file of at most [`CONFIG_FILE_LIMIT`](cachepick_decode::file::CONFIG_FILE_LIMIT) bytes.
struct FileReader {
    path: PathBuf,
    /// A read that did not return in time: no other starts until it has.
    blocked: Option<oneshot::Receiver<io::Result<Look>>>,
}

impl FileReader {
    fn new(path: PathBuf) -> FileReader {
        FileReader {
            path,
            blocked: None,
        }
    }

    /// The file, unless its stamp is still `known`.
    async fn read(&mut self, known: Option<Stamp>) -> io::Result<Look> {
        if let Some(mut blocked) = self.blocked.take()
            && let Err(oneshot::error::TryRecvError::Empty) = blocked.try_recv()
        {
            self.blocked = Some(blocked);
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "an earlier read of it has not returned",
            ));
        }
        let (sender, mut receiver) = oneshot::channel();
        let path = self.path.clone();
        std::thread::Builder::new()
            .name("config-read".to_owned())
            .spawn(move || {
                let _ = sender.send(look(&path, known));
            })?;
        match tokio::time::timeout(READ_TIMEOUT, &mut receiver).await {
            Ok(Ok(look)) => look,
            Ok(Err(_)) => Err(io::Error::other(
                "the reading thread ended without an answer",
            )),
            Err(_) => {
                self.blocked = Some(receiver);
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("reading it did not return within {READ_TIMEOUT:?}"),
                ))
            }
        }
    }
}

/// Runs on the reading thread: the file's stamp, and its text when the stamp is not `known`.
fn look(path: &Path, known: Option<Stamp>) -> io::Result<Look> {
    let stamp = Stamp::of(&std::fs::metadata(path)?);
    if known == Some(stamp) {
        return Ok(Look::Unchanged);
    }
    let text = cachepick_decode::file::read_regular_to_string(
        path,
        cachepick_decode::file::CONFIG_FILE_LIMIT,
    )?;
    Ok(Look::Changed(stamp, text))
}

/// The most changed keys a reload's log line lists; the count says how many there were.
const LOGGED_CHANGES: usize = 40;

/// `: key old → new; …` for the log line, at most [`LOGGED_CHANGES`] keys; nothing when no key changed.
fn describe(changes: &[config::KeyChange]) -> String {
    if changes.is_empty() {
        return ": no key changed".to_owned();
    }
    let mut text: Vec<String> = changes
        .iter()
        .take(LOGGED_CHANGES)
        .map(|change| format!("{}: {} → {}", change.key, change.old, change.new))
        .collect();
    if changes.len() > LOGGED_CHANGES {
        text.push(format!("and {} more", changes.len() - LOGGED_CHANGES));
    }
    format!(": {}", text.join("; "))
}

/// Sends each file pool its workers and every pool its policy.
fn apply(next: &Config, targets: &Targets) {
    for (position, pool) in next.pools.iter().enumerate() {
        targets
            .service
            .picker()
            .set_policy(position, pool.policy.clone());
        if pool.discovery != Discovery::Static {
            continue;
        }
        if let Some(load) = targets.loads.get(position) {
            discovery::publish(load.desired(), discovery::members(pool.workers.clone()));
        }
        if let Some(Some(status)) = targets.sources.get(position) {
            status.updated(pool.workers.len());
        }
    }
}

/// Every difference between `old` and `new` that a running picker cannot take, one line each; empty
/// when the new file changes only workers and policies.
pub fn restart_only_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut refused = Vec::new();
    let mut differs = |what: &str, same: bool| {
        if !same {
            refused.push(format!("{what} changed (restart to apply it)"));
        }
    };
    differs("listen", old.listen == new.listen);
    differs("metrics_listen", old.metrics_listen == new.metrics_listen);
    differs("max_body_bytes", old.max_body_bytes == new.max_body_bytes);
    differs(
        "debug_endpoints",
        old.debug_endpoints == new.debug_endpoints,
    );
    differs("load", old.load == new.load);
    differs("tls", old.tls == new.tls);
    differs(
        "debug_token_file",
        old.debug_token_file == new.debug_token_file,
    );
    differs("metrics_http", old.metrics_http == new.metrics_http);
    differs("overload", old.overload == new.overload);
    differs("unknown_subset", old.unknown_subset == new.unknown_subset);
    differs("replica_sync", old.replica_sync == new.replica_sync);
    differs("tracing", old.tracing == new.tracing);
    differs("feedback", old.feedback == new.feedback);
    differs(
        "cache_salt_header",
        old.cache_salt_header == new.cache_salt_header,
    );
    if old.pools.len() != new.pools.len() {
        refused.push(format!(
            "pools: {} pools instead of {} (restart to add or remove a pool)",
            new.pools.len(),
            old.pools.len()
        ));
        return refused;
    }
    for (position, (old, new)) in old.pools.iter().zip(&new.pools).enumerate() {
        refused.extend(
            pool_changes(old, new)
                .into_iter()
                .map(|field| format!("pools[{position}].{field} changed (restart to apply it)")),
        );
    }
    refused
}

/// The fields of a pool that differ, among those only a restart applies.
fn pool_changes(old: &PoolConfig, new: &PoolConfig) -> Vec<&'static str> {
    let fields: [(&'static str, bool); 13] = [
        ("model", old.model == new.model),
        ("max_model_len", old.max_model_len == new.max_model_len),
        ("pd", old.pd == new.pd),
        ("engine", old.engine == new.engine),
        ("block_size", old.block_size == new.block_size),
        ("tokenizer", old.tokenizer == new.tokenizer),
        ("chat_template", old.chat_template == new.chat_template),
        (
            "segment_cache_entries",
            old.segment_cache_entries == new.segment_cache_entries,
        ),
        (
            "default_cache_blocks",
            old.default_cache_blocks == new.default_cache_blocks,
        ),
        (
            "index",
            old.index == new.index && old.template == new.template,
        ),
        ("source (workers, dns or kubernetes)", same_source(old, new)),
        ("max_workers", old.max_workers == new.max_workers),
        (
            "workers[].dp_size beyond the pool's largest",
            ranks_fit(old, new),
        ),
    ];
    fields
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(field, _)| field)
        .collect()
}

/// A file pool stays a file pool (its list may change); a discovered pool keeps its source's settings.
fn same_source(old: &PoolConfig, new: &PoolConfig) -> bool {
    match (&old.discovery, &new.discovery) {
        (Discovery::Static, Discovery::Static) => true,
        (old, new) => old == new,
    }
}

/// In an `events` pool every worker slot has rank slots for the largest data-parallel degree the pool
/// started with; a worker with more ranks needs a restart.
fn ranks_fit(old: &PoolConfig, new: &PoolConfig) -> bool {
    old.index.mode == IndexMode::Approximate
        || EventIndex::ranks_per_worker(new) <= EventIndex::ranks_per_worker(old)
}

#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = Option<()>;

#[cfg(unix)]
fn hangups() -> Hangups {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok()
}

#[cfg(not(unix))]
fn hangups() -> Hangups {
    None
}

/// The next SIGHUP; pending forever where there is none to wait for.
async fn next_hangup(hangup: &mut Hangups) -> Option<()> {
    #[cfg(unix)]
    if let Some(signal) = hangup {
        return signal.recv().await;
    }
    let _ = hangup;
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;

    const BASE: &str =
        "pools:\n  - model: m\n    engine: vllm\n    workers: [{endpoint: \"10.0.0.1:8000\"}]\n";

    fn config(text: &str) -> Config {
        config::parse(text, "t.yaml", &Overrides::default()).expect("valid")
    }

    /// What a reload applies (workers, policies) is accepted; every other key is refused by name, so
    /// an applied reload never reports a change it did not make.
    #[test]
    fn only_workers_and_policies_reload_and_every_other_change_is_named() {
        let base = config(BASE);
        let workers = config(&BASE.replace("}]", "}, {endpoint: \"10.0.0.2:8000\"}]"));
        let policy = config(&format!("policy: {{max_fallbacks: 1}}\n{BASE}"));
        assert_eq!(restart_only_changes(&base, &workers), Vec::<String>::new());
        assert_eq!(restart_only_changes(&base, &policy), Vec::<String>::new());
        for (head, named) in [
            ("feedback: {enabled: false}\n", "feedback"),
            ("cache_salt_header: x-tenant\n", "cache_salt_header"),
            (
                "tracing: {otlp_endpoint: \"http://otel:4317\"}\n",
                "tracing",
            ),
        ] {
            let changed = restart_only_changes(&base, &config(&format!("{head}{BASE}")));
            assert!(
                changed.iter().any(|line| line.starts_with(named)),
                "{named}: {changed:?}"
            );
        }
        let longer = config(&BASE.replace("engine: vllm", "engine: vllm\n    max_model_len: 4096"));
        assert_eq!(
            restart_only_changes(&base, &longer),
            ["pools[0].max_model_len changed (restart to apply it)"]
        );
    }
}

//! Discovery: where each pool's workers come from while the picker runs.
//!
//! A source publishes the pool's whole desired worker set ([`Members`]) on a `watch` channel each time
//! it changes; the pool's scraper (`load::Scraper`) reconciles its roster against it — joins, drains,
//! leaves — and the rest of the picker follows the roster, never the source. So a source knows nothing
//! of slots, indexes or Envoy, and every source is tested the same way: what it publishes.
//!
//! - the file's `workers:` list, re-read on change and on SIGHUP (`app` reloads the whole file, since
//!   the policy knobs reload with it);
//! - [`dns`]: a name's A/AAAA records, re-resolved every `interval`;
//! - [`kubernetes`]: ready Pods matching a label selector or an InferencePool, watched.
//!
//! A source that fails keeps its last published set: a DNS timeout or an API server restart must not
//! drain a healthy fleet. Only an answer (an empty record set, pods gone) removes workers.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::config::WorkerConfig;

pub mod dns;
pub mod kubernetes;

/// A pool's desired workers, sorted by endpoint, each endpoint once.
pub type Members = Arc<[WorkerConfig]>;

/// Sorts `workers` by endpoint and keeps the first of each endpoint: what a source publishes.
pub fn members(mut workers: Vec<WorkerConfig>) -> Members {
    workers.sort_by_key(|worker| worker.endpoint);
    workers.dedup_by_key(|worker| worker.endpoint);
    workers.into()
}

/// Publishes `next` unless it lists the same workers as the current set; whether it did.
pub fn publish(sender: &tokio::sync::watch::Sender<Members>, next: Members) -> bool {
    sender.send_if_modified(|current| {
        if *current == next {
            false
        } else {
            *current = next;
            true
        }
    })
}

/// The endpoints of `members`, for logs.
pub fn endpoints(members: &[WorkerConfig]) -> Vec<SocketAddr> {
    members.iter().map(|worker| worker.endpoint).collect()
}

/// What a source says about itself, shared with metrics and the debug snapshot.
#[derive(Debug)]
pub struct SourceStatus {
    /// `file`, `dns` or `kubernetes`.
    pub kind: &'static str,
    state: Mutex<SourceState>,
}

/// A copy of a source's state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SourceState {
    /// Answers that were read (a resolution, a list, a watch event, a reload), whether or not they
    /// changed the set.
    pub updates: u64,
    /// Attempts that failed (a DNS error, a watch error, an invalid reloaded file).
    pub errors: u64,
    /// The last failure, until the next success.
    pub last_error: Option<String>,
    /// When the source last answered.
    #[serde(skip)]
    pub last_update: Option<SystemTime>,
    /// Workers in the last published set.
    pub members: usize,
    /// When a failure was last logged as a warning, during the current spell of failures.
    #[serde(skip)]
    warned: Option<Instant>,
}

/// A failing source warns at most this often; every failure is counted.
pub const WARN_EVERY: Duration = Duration::from_secs(60);

impl SourceStatus {
    pub fn new(kind: &'static str) -> Arc<Self> {
        Arc::new(SourceStatus {
            kind,
            state: Mutex::new(SourceState::default()),
        })
    }

    /// An answer was read; `members` workers are published. Whether it ends a spell of failures that
    /// was warned about (the caller says the source answers again).
    pub fn updated(&self, members: usize) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.updates += 1;
        state.last_error = None;
        state.last_update = Some(SystemTime::now());
        state.members = members;
        state.warned.take().is_some()
    }

    /// An attempt failed; the published set is unchanged. Whether the caller should log it as a
    /// warning: the first failure of a spell, then one every [`WARN_EVERY`], so a source that stays
    /// down cannot flood the log.
    pub fn failed(&self, error: impl std::fmt::Display) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.errors += 1;
        state.last_error = Some(error.to_string());
        let now = Instant::now();
        let due = state
            .warned
            .is_none_or(|last| now.saturating_duration_since(last) >= WARN_EVERY);
        if due {
            state.warned = Some(now);
        }
        due
    }

    pub fn state(&self) -> SourceState {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

//! What `cachepick chaos` is asked to run (the mode, the stage's size, the traffic and the crowd) and
//! what can stop it.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use cachepick::envoy_config::BodyMode;

use super::schedule::Crowd;

/// What to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Traffic under the fault schedule.
    Chaos,
    /// Traffic alone, the picker's memory sampled.
    Soak,
}

impl Mode {
    /// Where a run of this mode writes its report unless told: soaks and chaos runs apart, so one
    /// does not overwrite the other's.
    pub fn default_out(self) -> PathBuf {
        PathBuf::from(match self {
            Mode::Chaos => "target/chaos",
            Mode::Soak => "target/soak",
        })
    }
}

/// What `cachepick chaos` runs.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    pub mode: Mode,
    /// The ext_proc body mode of Envoy's bootstrap (buffered, duplex or streamed).
    pub body_mode: BodyMode,
    /// How long good traffic flows (faults fire within it).
    pub length: Duration,
    /// Good requests per second.
    pub rate: f64,
    pub workers: u32,
    pub seed: u64,
    /// The Envoy binary (default: `CACHEPICK_ENVOY`, the provisioned copy, `PATH`).
    pub envoy: Option<PathBuf>,
    /// The `cachepick` binary to run as the picker.
    pub picker: PathBuf,
    /// Where `report.json`, `table.md`, Envoy's access log and the picker's log go.
    pub out: PathBuf,
    /// The hostile crowd (chaos mode).
    pub crowd: Crowd,
    /// One client's deadline: a good request's whole answer, a malformed one's refusal.
    pub deadline: Duration,
    /// Soak: RSS samples before this are the warm-up.
    pub warmup: Duration,
    /// How often the picker's RSS is sampled.
    pub rss_every: Duration,
    /// Good requests in flight at most; one due beyond it is not sent, and counted.
    pub max_in_flight: usize,
    /// Print the faults as they fire.
    pub verbose: bool,
}

impl ChaosOptions {
    /// A chaos run of `length` at `rate` with the rest at its defaults.
    pub fn new(mode: Mode, length: Duration, rate: f64, picker: PathBuf) -> ChaosOptions {
        ChaosOptions {
            mode,
            body_mode: BodyMode::Buffered,
            length,
            rate,
            workers: 4,
            seed: 1,
            envoy: None,
            picker,
            out: mode.default_out(),
            crowd: Crowd {
                slowloris: 50,
                trickles: 4,
                stalled: 4,
            },
            deadline: Duration::from_secs(30),
            warmup: Duration::from_secs(60),
            rss_every: Duration::from_secs(1),
            max_in_flight: 1_000,
            verbose: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("Envoy not found (pass --envoy, set CACHEPICK_ENVOY, or run scripts/provision-envoy)")]
    NoEnvoy,
    #[error("Envoy at {path}: {message}")]
    Envoy { path: String, message: String },
    #[error(transparent)]
    Fleet(#[from] cachepick_sim::fleet::FleetError),
    #[error("the picker's configuration: {0}")]
    Config(String),
    #[error("cannot find a free loopback port: {0}")]
    Port(std::io::Error),
    #[error("cannot start {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("the picker exited ({status}); its log: {log}")]
    PickerExited { status: String, log: PathBuf },
    #[error("the picker did not become ready: {0}")]
    PickerNotReady(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--rate must be a positive number, got {0}")]
    Rate(f64),
    #[error("a chaos run needs at least 2 workers (one always serves), got {0}")]
    Workers(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soaks_and_chaos_runs_report_to_their_own_directories() {
        let options = |mode| ChaosOptions::new(mode, Duration::from_secs(1), 1.0, PathBuf::new());
        assert_eq!(options(Mode::Chaos).out, PathBuf::from("target/chaos"));
        assert_eq!(options(Mode::Soak).out, PathBuf::from("target/soak"));
    }
}

//! The stage every rig run and many integration tests stand on: a simulated fleet, cachepick serving it
//! in this process through `app::run` with a named [`Shutdown`] (optionally several replicas of it, as
//! production runs them for availability, each with its own owner index), and optionally a real Envoy in
//! front, round-robining the replicas.
//!
//! The demo, `cachepick replay` (one stage per policy), the ext_proc and end-to-end tests and the
//! ext_proc bench all start it here, so "start a fleet, a picker and an Envoy, then stop them in order"
//! exists once.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use cachepick::app::AppError;
use cachepick::config::{self, Config, ConfigError, Overrides};
use cachepick_sim::SimConfig;
use cachepick_sim::fleet::{Fleet, FleetError};

use crate::envoy::Envoy;

/// How long a picker may take to become ready: its first scrape round of every pool.
pub const READY_WITHIN: Duration = Duration::from_secs(15);

/// The longest shutdown grace a stage's picker drains for: nothing but the stage's own Envoy health-
/// checks it, and a run or a test must not wait seconds at every stop. Drains at production length
/// are shown with the real binary.
pub const STAGE_GRACE: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("the picker's configuration is invalid: {0}")]
    Config(#[from] ConfigError),
    #[error("cannot find a free loopback port: {0}")]
    Port(std::io::Error),
    #[error("cannot compose the picker's configuration: {0}")]
    Compose(String),
    #[error("the picker did not become ready: {0}")]
    NotReady(String),
    #[error("the picker failed: {0}")]
    Picker(#[from] AppError),
    #[error("the picker's task ended abnormally: {0}")]
    Task(String),
    #[error("Envoy at {path}: {message}")]
    Envoy { path: String, message: String },
}

/// A shutdown that can be asked for by name: the picker's `app::run` awaits [`signal`](Self::signal),
/// [`trigger`](Self::trigger) resolves it. Dropping the `Shutdown` triggers it too.
#[derive(Debug)]
pub struct Shutdown(watch::Sender<bool>);

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown(watch::channel(false).0)
    }
}

impl Shutdown {
    /// A future that resolves once the shutdown is triggered (or the `Shutdown` is gone).
    pub fn signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stopped = self.0.subscribe();
        async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }
    }

    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// cachepick running in this process through `app::run`, stopped through its [`Shutdown`].
pub struct Picker {
    config: Config,
    shutdown: Shutdown,
    task: Option<JoinHandle<Result<(), AppError>>>,
}

impl Picker {
    /// Starts `app::run` with `config` on the current runtime; it serves until stopped or dropped.
    pub fn spawn(config: Config) -> Picker {
        Picker::spawn_serving(config, None)
    }

    /// Starts `app::serve` with `config` on the current runtime, reading its file again on change and
    /// SIGHUP when `reload` names it; it serves until stopped or dropped.
    pub fn spawn_serving(mut config: Config, reload: Option<cachepick::app::Reload>) -> Picker {
        config.overload.shutdown_grace = config.overload.shutdown_grace.min(STAGE_GRACE);
        // The file read again must agree, or the reload would see the grace as changed.
        let reload = reload.map(|mut reload| {
            reload.overrides.shutdown_grace = Some(config.overload.shutdown_grace);
            reload
        });
        let shutdown = Shutdown::default();
        let signal = shutdown.signal();
        let task = {
            let config = config.clone();
            tokio::spawn(async move { cachepick::app::serve(&config, reload, signal).await })
        };
        Picker {
            config,
            shutdown,
            task: Some(task),
        }
    }

    /// Waits until the picker's gRPC readiness is SERVING; a picker that stopped meanwhile reports why.
    pub async fn ready(&mut self, within: Duration) -> Result<(), StageError> {
        let waited = crate::client::wait_ready(self.config.listen, within).await;
        match waited {
            Ok(()) => Ok(()),
            Err(error) => match self.task.take_if(|task| task.is_finished()) {
                Some(task) => Err(ended(task.await)
                    .err()
                    .unwrap_or_else(|| StageError::NotReady(error.to_string()))),
                None => Err(StageError::NotReady(error.to_string())),
            },
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether `app::run` has returned (an error at start-up, or a shutdown).
    pub fn has_ended(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// The ext_proc and health listener.
    pub fn listen(&self) -> SocketAddr {
        self.config.listen
    }

    /// The `/metrics` and debug listener.
    pub fn metrics_listen(&self) -> SocketAddr {
        self.config.metrics_listen
    }

    /// Triggers the shutdown and waits for `app::run` to return, with its result.
    pub async fn stop(mut self) -> Result<(), StageError> {
        self.shutdown.trigger();
        match self.task.take() {
            Some(task) => ended(task.await),
            None => Ok(()),
        }
    }
}

impl Drop for Picker {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn ended(joined: Result<Result<(), AppError>, tokio::task::JoinError>) -> Result<(), StageError> {
    match joined {
        Ok(result) => Ok(result?),
        Err(error) => Err(StageError::Task(error.to_string())),
    }
}

/// `text` (a cachepick configuration, such as a fleet's generated one) on fresh loopback ports, with
/// `overrides` for the rest, validated.
pub fn on_free_ports(text: &str, origin: &str, overrides: Overrides) -> Result<Config, StageError> {
    let overrides = Overrides {
        listen: Some(crate::free_port().map_err(StageError::Port)?),
        metrics_listen: Some(crate::free_port().map_err(StageError::Port)?),
        ..overrides
    };
    Ok(config::parse(text, origin, &overrides)?)
}

/// Fleet, picker (and any further replicas of it) and, when asked for, Envoy; dropping it stops them all.
pub struct Stage {
    pub fleet: Fleet,
    pub picker: Picker,
    /// Replicas beyond [`picker`](Self::picker) ([`with_replicas`](Self::with_replicas)): the same
    /// configuration on ports of their own, each learning its own owner index from its own decisions.
    pub replicas: Vec<Picker>,
    pub envoy: Option<Envoy>,
}

impl Stage {
    /// Starts the fleet `sim` describes, then a picker with the configuration `configure` makes of the
    /// fleet's generated one, and waits until the picker is ready.
    pub async fn start(
        sim: &SimConfig,
        configure: impl FnOnce(&str) -> Result<Config, StageError>,
    ) -> Result<Stage, StageError> {
        let fleet = Fleet::start(sim).await?;
        let config = configure(&fleet.cachepick_config())?;
        let mut picker = Picker::spawn(config);
        picker.ready(READY_WITHIN).await?;
        Ok(Stage {
            fleet,
            picker,
            replicas: Vec::new(),
            envoy: None,
        })
    }

    /// Runs `count` pickers in all (at least the one there is): the others with the first one's
    /// configuration on fresh `listen` and `metrics_listen` ports, each waited for until ready. Call it
    /// before [`with_envoy`](Self::with_envoy), whose ext_proc cluster then lists every replica.
    pub async fn with_replicas(mut self, count: usize) -> Result<Stage, StageError> {
        while self.replicas.len() + 1 < count {
            let mut config = self.picker.config().clone();
            config.listen = crate::free_port().map_err(StageError::Port)?;
            config.metrics_listen = crate::free_port().map_err(StageError::Port)?;
            // Replica i hears its peers on the i-th address of the list they share.
            let position = self.replicas.len() + 1;
            if let Some(sync) = &mut config.replica_sync
                && let Some(cachepick::config::PeerAddress::Socket(listen)) =
                    sync.peers.get(position)
            {
                sync.listen = *listen;
            }
            let mut replica = Picker::spawn(config);
            replica.ready(READY_WITHIN).await?;
            self.replicas.push(replica);
        }
        Ok(self)
    }

    /// Every picker replica, the first one first.
    pub fn pickers(&self) -> impl Iterator<Item = &Picker> {
        std::iter::once(&self.picker).chain(&self.replicas)
    }

    /// Puts the Envoy at `path` in front, with the bootstrap `cachepick envoy-config` generates (buffered),
    /// its ext_proc cluster listing every picker replica.
    pub async fn with_envoy(self, path: &Path) -> Result<Stage, StageError> {
        self.with_envoy_at(path, None, None).await
    }

    /// [`with_envoy`](Self::with_envoy), Envoy's listener and admin interface at the addresses given
    /// (fresh loopback ports for those not).
    pub async fn with_envoy_at(
        mut self,
        path: &Path,
        listen: Option<SocketAddr>,
        admin: Option<SocketAddr>,
    ) -> Result<Stage, StageError> {
        let pickers: Vec<cachepick::envoy_config::PickerAddr> = self
            .pickers()
            .map(|picker| cachepick::envoy_config::picker_address(picker.listen()).into())
            .collect();
        let config = self.picker.config().clone();
        let envoy = Envoy::start_rendered_at(path, None, listen, admin, |listen, admin| {
            Ok(cachepick::envoy_config::render(
                &config,
                &cachepick::envoy_config::EnvoyOptions {
                    listen,
                    admin,
                    pickers,
                    ..cachepick::envoy_config::EnvoyOptions::for_config(&config)
                },
            ))
        })
        .await
        .map_err(|message| StageError::Envoy {
            path: path.display().to_string(),
            message,
        })?;
        self.envoy = Some(envoy);
        Ok(self)
    }

    pub fn config(&self) -> &Config {
        self.picker.config()
    }

    /// Stops Envoy, then the pickers (returning how the first `app::run` that failed ended), then the
    /// fleet.
    pub async fn stop(self) -> Result<(), StageError> {
        let Stage {
            fleet,
            picker,
            replicas,
            envoy,
        } = self;
        drop(envoy);
        let mut stopped = picker.stop().await;
        for replica in replicas {
            let replica = replica.stop().await;
            if stopped.is_ok() {
                stopped = replica;
            }
        }
        drop(fleet);
        stopped
    }
}

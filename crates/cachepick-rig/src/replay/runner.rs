//! One arm on a fresh fleet: cachepick (its stage, over ext_proc or through Envoy), another router in
//! front, or the oracle; the same workload driven open-loop, the fleet's load watched, and the arm's
//! report.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachepick_sim::SimConfig;
use cachepick_sim::fleet::Fleet;

use super::arms::{Arm, ArmKind, apply_arm, enable_sim_events, load_yaml};
use super::behind::{self, InProcess};
use super::drive::{self, Route, Sample};
use super::dynamo::DynamoRouter;
use super::fault::{self, FaultReport};
use super::front::{self, Front, KvSources};
use super::oracle::Oracle;
use super::peers::{PeerRouter, PeerRule};
use super::rates;
use super::report::PolicyReport;
use super::trace::{Item, PromptBuilder};
use super::{IndexMode, ReplayError, ReplayOptions, utilisation};
use crate::client::Client as PickerClient;
use crate::envoy::Envoy;
use crate::stage::{Stage, StageError};
use cachepick::config::{PeerAddress, ReplicaSyncConfig};
use cachepick::envoy_config::{BodyMode, EnvoyOptions};
use std::num::NonZeroU32;

/// Envoy's cluster of ext_proc servers in the generated bootstrap.
const PICKER_CLUSTER: &str = "cachepick";
/// How long an arm's Envoy may take to count its ext_proc server healthy.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// How often the fleet's slots and queues are read during an arm.
const READ_LOAD_EVERY: Duration = Duration::from_millis(100);
/// How often a picker's learned prefill rates are read during an arm (wall time).
const READ_RATES_EVERY: Duration = Duration::from_millis(250);

/// What every arm of one replay shares.
pub(super) struct Workload<'a> {
    pub options: &'a ReplayOptions,
    pub sim: &'a SimConfig,
    pub items: &'a [Item],
    pub prompts: &'a PromptBuilder,
    pub speedup: f64,
    pub envoy: Option<&'a Path>,
    pub phases: &'a [&'a str],
    pub bucket: Duration,
}

impl Workload<'_> {
    /// The arrival window, over which the fleet's load is read.
    fn window(&self) -> Duration {
        let first = self.items.first().map_or(0, |item| item.timestamp_ms);
        let last = self.items.last().map_or(0, |item| item.timestamp_ms);
        Duration::from_secs_f64(last.saturating_sub(first) as f64 / 1000.0 / self.speedup)
    }

    /// Runs `arm` and reports it.
    pub async fn run(&self, arm: &Arm) -> Result<PolicyReport, ReplayError> {
        match &arm.kind {
            ArmKind::Picker => self.picker(arm).await,
            ArmKind::Front(front) => self.front(arm, front).await,
            ArmKind::Oracle => self.oracle(arm).await,
            ArmKind::Peer(rule) => self.peer(arm, *rule).await,
            ArmKind::Dynamo(template) => self.dynamo(arm, template).await,
        }
    }

    /// Drives the workload along `route` while watching `fleet`; the samples, the wall time and the
    /// fleet's load.
    async fn drive(
        &self,
        route: &Route,
        fleet: &Fleet,
    ) -> (Vec<Sample>, Duration, Option<utilisation::Utilisation>) {
        let started = Instant::now();
        let (samples, utilisation) = tokio::join!(
            drive::drive(
                route,
                self.items,
                self.prompts,
                &self.sim.model,
                self.speedup,
                self.options.max_in_flight,
            ),
            utilisation::watch(fleet, self.window(), READ_LOAD_EVERY),
        );
        (samples, started.elapsed(), utilisation)
    }

    fn report(
        &self,
        arm: &Arm,
        yaml: &str,
        samples: &[Sample],
        fleet: &Fleet,
        wall: Duration,
    ) -> PolicyReport {
        let workers = drive::per_worker(samples, &fleet.endpoints());
        let mut report = PolicyReport::new(
            &arm.policy,
            yaml,
            samples,
            workers,
            self.phases,
            self.bucket,
            wall,
        );
        report.arm = arm.label.clone();
        report
    }

    /// cachepick with the arm's policy, index mode and replicas.
    ///
    /// Over 100 lines: one arm's stage started, driven, read and stopped, in order, filling one
    /// report.
    async fn picker(&self, arm: &Arm) -> Result<PolicyReport, ReplayError> {
        let mut sim = self.sim.clone();
        if arm.index_mode == IndexMode::Events {
            enable_sim_events(&mut sim);
        }
        let load = load_yaml(&sim, self.options.scrape_interval);
        let sync = if arm.sync {
            let peers = (0..arm.replicas)
                .map(|_| crate::free_port())
                .collect::<Result<Vec<_>, _>>()
                .map_err(StageError::Port)?;
            peers.first().map(|&listen| ReplicaSyncConfig {
                listen,
                peers: peers.iter().copied().map(PeerAddress::Socket).collect(),
                // Loopback replicas: the empty key (a keyed sync differs by one MAC per datagram).
                key_file: None,
                resolve_interval: ReplicaSyncConfig::DEFAULT_RESOLVE_INTERVAL,
                max_datagrams_per_second: NonZeroU32::new(
                    ReplicaSyncConfig::DEFAULT_MAX_DATAGRAMS_PER_SECOND,
                )
                .unwrap_or(NonZeroU32::MIN),
            })
        } else {
            None
        };
        let (pd_prefill, local_tokens) = (
            self.options.pd_prefill,
            self.options.pd_local_prefill_tokens,
        );
        let mut stage = Stage::start(&sim, |generated| {
            let mut config = apply_arm(generated, &arm.yaml, Some(&load), arm.index_mode)?;
            config.replica_sync = sync.clone();
            if let Some(prefill) = pd_prefill {
                disaggregate(&mut config, prefill);
                for pd in config.pools.iter_mut().filter_map(|pool| pool.pd.as_mut()) {
                    pd.local_prefill_tokens = local_tokens.unwrap_or(pd.local_prefill_tokens);
                }
            }
            Ok(config)
        })
        .await?
        .with_replicas(arm.replicas)
        .await?;
        if let Some(path) = self.envoy {
            stage = stage.with_envoy(path).await?;
            // As for the in-process routers: no request is sent until Envoy trusts every replica.
            if let Some(envoy) = &stage.envoy {
                envoy
                    .wait_healthy(PICKER_CLUSTER, READY_WITHIN)
                    .await
                    .map_err(|message| StageError::Envoy {
                        path: path.display().to_string(),
                        message,
                    })?;
            }
        }
        let route = match &stage.envoy {
            Some(envoy) => Route::Proxy(envoy.listen),
            None => Route::Direct(
                PickerClient::connect(stage.picker.listen())
                    .await
                    .map_err(|error| ReplayError::Picker(error.to_string()))?,
            ),
        };
        let start = tokio::time::Instant::now();
        let crashing = async {
            match &self.options.crash {
                Some(crash) => Some(fault::crash(&stage.fleet, crash, start).await),
                None => None,
            }
        };
        // The first replica's learned prefill rates over the arrival window (every replica reads the
        // same counters, so one stands for all).
        let first = stage.pickers().next().map(|picker| picker.metrics_listen());
        let rates = async {
            match first {
                Some(metrics) => Some(
                    rates::watch(
                        metrics,
                        self.window(),
                        READ_RATES_EVERY,
                        self.sim.params.time_scale,
                        stage.fleet.endpoints().len(),
                    )
                    .await,
                ),
                None => None,
            }
        };
        let ((samples, wall, utilisation), crashed, rates) =
            tokio::join!(self.drive(&route, &stage.fleet), crashing, rates);
        let mut replica_decisions = Vec::new();
        let mut replica_shares = Vec::new();
        let mut replica_synced = Vec::new();
        let mut scrapes = BTreeMap::new();
        for picker in stage.pickers() {
            let read = decisions(picker.metrics_listen()).await;
            for (outcome, count) in read
                .as_ref()
                .map(|read| read.scrapes.clone())
                .unwrap_or_default()
            {
                *scrapes.entry(outcome).or_insert(0) += count;
            }
            replica_shares.push(read.as_ref().and_then(|read| read.share));
            replica_synced.push(read.as_ref().and_then(|read| read.synced));
            replica_decisions.push(read.map(|read| read.decisions));
        }
        let fault = self
            .options
            .crash
            .as_ref()
            .zip(crashed)
            .map(|(crash, crashed)| {
                let worker = stage
                    .fleet
                    .worker(crash.worker)
                    .map_or_else(String::new, |worker| worker.addr().to_string());
                match crashed {
                    Ok(times) => FaultReport::new(crash, worker, times, &samples),
                    Err(error) => FaultReport::failed(crash, worker, error),
                }
            });
        let mut report = self.report(arm, &arm.yaml, &samples, &stage.fleet, wall);
        stage.stop().await?;
        report.index_mode = arm.index_mode.as_str().to_owned();
        report.replicas = arm.replicas;
        report.load_yaml = Some(load);
        report.scrapes = scrapes;
        report.replica_decisions = replica_decisions;
        report.replica_shares = replica_shares;
        report.replica_synced = replica_synced;
        report.replica_sync = arm.sync;
        report.fault = fault;
        report.utilisation = utilisation;
        report.prefill_rates = rates;
        Ok(report)
    }

    /// Another router in front of a fresh fleet; a template that names the workers' KV event
    /// endpoints gets a fleet that publishes them.
    async fn front(&self, arm: &Arm, front: &Front) -> Result<PolicyReport, ReplayError> {
        let mut sim = self.sim.clone();
        if let front::Target::Command(template) = &front.target
            && front::wants_kv_events(template)
        {
            enable_sim_events(&mut sim);
        }
        let fleet = Fleet::start(&sim).await.map_err(StageError::from)?;
        let running = match front::Running::start(
            front,
            &fleet.endpoints(),
            &KvSources::of(&fleet),
            &sim.model,
            &self.options.out,
        )
        .await
        {
            Ok(running) => running,
            Err(error) => {
                fleet.stop().await;
                return Err(error.into());
            }
        };
        let (samples, wall, utilisation) = self.drive(&Route::Proxy(running.addr), &fleet).await;
        let counters = running.routing_counters().await;
        let mut report = self.report(arm, "", &samples, &fleet, wall);
        drop(running);
        fleet.stop().await;
        report.index_mode = "-".to_owned();
        report.front = Some(match &front.target {
            front::Target::Command(template) => template.clone(),
            front::Target::Url(addr) => format!("http://{addr}"),
        });
        report.front_counters = counters;
        report.utilisation = utilisation;
        Ok(report)
    }

    /// The oracle on a fresh fleet it reads in process.
    async fn oracle(&self, arm: &Arm) -> Result<PolicyReport, ReplayError> {
        let prefill = self.options.pd_prefill;
        self.in_process(arm, self.sim, "-", async |fleet| {
            Ok(InProcess::Oracle(Arc::new(match prefill {
                Some(prefill) => Oracle::disaggregated(fleet, prefill),
                None => Oracle::new(fleet),
            })))
        })
        .await
    }

    /// A re-implemented peer on a fresh fleet it reads in process, with the arm's router replicas.
    async fn peer(&self, arm: &Arm, rule: PeerRule) -> Result<PolicyReport, ReplayError> {
        let seed = self.options.seed;
        self.in_process(arm, self.sim, "true cache", async |fleet| {
            Ok(InProcess::Peer(Arc::new(PeerRouter::new(
                fleet,
                rule,
                arm.replicas,
                seed,
            ))))
        })
        .await
    }

    /// Dynamo's own selection service, started from `template` on a fresh fleet that publishes its KV
    /// events, and asked for every request ([`super::dynamo`]).
    async fn dynamo(&self, arm: &Arm, template: &str) -> Result<PolicyReport, ReplayError> {
        let mut sim = self.sim.clone();
        enable_sim_events(&mut sim);
        let model = sim.model.clone();
        let out = &self.options.out;
        self.in_process(arm, &sim, "kv events", async |fleet| {
            let router = DynamoRouter::start(template, fleet, &model, out).await?;
            Ok(InProcess::Dynamo(Arc::new(router)))
        })
        .await
    }

    /// An arm whose router reads the fleet in process: `router` is built on a fresh fleet, put behind
    /// the same Envoy bootstrap as cachepick when the replay runs through Envoy ([`behind`]), the
    /// workload driven, and the fleet stopped once everything has let it go.
    async fn in_process(
        &self,
        arm: &Arm,
        sim: &SimConfig,
        index_mode: &str,
        router: impl AsyncFnOnce(Arc<Fleet>) -> Result<InProcess, ReplayError>,
    ) -> Result<PolicyReport, ReplayError> {
        let fleet = Arc::new(Fleet::start(sim).await.map_err(StageError::from)?);
        let router = match router(Arc::clone(&fleet)).await {
            Ok(router) => router,
            Err(error) => {
                if let Ok(fleet) = Arc::try_unwrap(fleet) {
                    fleet.stop().await;
                }
                return Err(error);
            }
        };
        let (samples, wall, utilisation) = match self.envoy {
            Some(path) => {
                let tickets = Arc::new(behind::Tickets::default());
                let proxied = async {
                    let server = behind::Server::start(router, Arc::clone(&tickets))
                        .await
                        .map_err(StageError::Port)?;
                    let envoy =
                        behind_envoy(path, &fleet, server.addr(), self.options.pd_prefill).await?;
                    let route = Route::Behind {
                        envoy: envoy.listen,
                        tickets: Arc::clone(&tickets),
                    };
                    let driven = self.drive(&route, &fleet).await;
                    drop(envoy);
                    drop(server);
                    Ok::<_, StageError>(driven)
                };
                match proxied.await {
                    Ok(driven) => driven,
                    Err(error) => {
                        if let Ok(fleet) = Arc::try_unwrap(fleet) {
                            fleet.stop().await;
                        }
                        return Err(error.into());
                    }
                }
            }
            None => self.drive(&Route::InProcess(router), &fleet).await,
        };
        let mut report = self.report(arm, "", &samples, &fleet, wall);
        if let Ok(fleet) = Arc::try_unwrap(fleet) {
            fleet.stop().await;
        }
        report.index_mode = index_mode.to_owned();
        report.utilisation = utilisation;
        Ok(report)
    }
}

/// The Envoy at `path` in front of `fleet` on the bootstrap cachepick generates for it, its ext_proc
/// cluster at `server` ([`behind::bootstrap`]), once Envoy counts that server healthy.
/// `prefill`: a prefill/decode fleet, whose bootstrap waits for the prefill leg as cachepick's does.
async fn behind_envoy(
    path: &Path,
    fleet: &Fleet,
    server: SocketAddr,
    prefill: Option<usize>,
) -> Result<Envoy, StageError> {
    let mut config = crate::stage::on_free_ports(
        &fleet.cachepick_config(),
        "the fleet's generated configuration",
        cachepick::config::Overrides::default(),
    )?;
    if let Some(prefill) = prefill {
        disaggregate(&mut config, prefill);
    }
    let envoy_error = |message: String| StageError::Envoy {
        path: path.display().to_string(),
        message,
    };
    let envoy = Envoy::start_rendered(path, None, |listen, admin| {
        let generated = cachepick::envoy_config::render(
            &config,
            &EnvoyOptions {
                mode: BodyMode::Buffered,
                listen,
                admin,
                pickers: vec![server.into()],
                ..EnvoyOptions::for_config(&config)
            },
        );
        behind::bootstrap(&generated, &fleet.endpoints())
    })
    .await
    .map_err(envoy_error)?;
    envoy
        .wait_healthy(PICKER_CLUSTER, READY_WITHIN)
        .await
        .map_err(envoy_error)?;
    Ok(envoy)
}

/// What one picker replica read, from its `/metrics`.
struct Read {
    /// `cachepick_decisions_total` over every pool and reason.
    decisions: u64,
    /// `cachepick_scrapes_total` by outcome.
    scrapes: BTreeMap<String, u64>,
    /// The largest `cachepick_pool_dispatch_share`.
    share: Option<f64>,
    /// The peers' announcements it accepted (`replica_sync`); `None` without the sync.
    synced: Option<u64>,
}

/// One picker replica's [`Read`] from its `/metrics`; `None` when they cannot be read.
async fn decisions(metrics: std::net::SocketAddr) -> Option<Read> {
    let text = crate::scrape_metrics(metrics, Duration::from_secs(5)).await?;
    let share = text
        .lines()
        .filter(|line| line.starts_with("cachepick_pool_dispatch_share{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(f64::max);
    let synced = text
        .lines()
        .find(|line| {
            line.starts_with("cachepick_replica_sync_received_total{outcome=\"accepted\"}")
        })
        .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64);
    Some(Read {
        decisions: decision_total(&text),
        scrapes: scrape_outcomes(&text),
        share,
        synced,
    })
}

/// Σ `cachepick_scrapes_total{…}` by its `outcome` label in a Prometheus exposition.
fn scrape_outcomes(exposition: &str) -> BTreeMap<String, u64> {
    let mut outcomes = BTreeMap::new();
    for line in exposition
        .lines()
        .filter(|line| line.starts_with("cachepick_scrapes_total{"))
    {
        let outcome = line
            .split("outcome=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (Some(outcome), Some(value)) = (outcome, value) {
            *outcomes.entry(outcome.to_owned()).or_insert(0) += value as u64;
        }
    }
    outcomes
}

/// Σ `cachepick_decisions_total{…}` in a Prometheus exposition.
fn decision_total(exposition: &str) -> u64 {
    exposition
        .lines()
        .filter(|line| line.starts_with("cachepick_decisions_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64)
        .sum()
}

/// Makes every pool of `config` a prefill/decode pool: its first `prefill` workers prefill, the rest
/// decode. A pool the fleet already wrote as one (SGLang's, with its bootstrap ports) keeps its
/// handshake; any other gets NIXL's with the default bounds.
fn disaggregate(config: &mut cachepick::config::Config, prefill: usize) {
    for pool in &mut config.pools {
        for (index, worker) in pool.workers.iter_mut().enumerate() {
            worker.role = if index < prefill {
                cachepick::worker::Role::Prefill
            } else {
                cachepick::worker::Role::Decode
            };
        }
        pool.pd
            .get_or_insert_with(cachepick::config::PdConfig::default);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pickers_decisions_are_summed_over_pools_and_reasons() {
        let exposition = "# HELP cachepick_decisions_total decisions\n\
            cachepick_decisions_total{pool=\"a\",reason=\"cache_hit\"} 7\n\
            cachepick_decisions_total{pool=\"a\",reason=\"cache_miss\"} 3\n\
            cachepick_decisions_total{pool=\"b\",reason=\"cache_hit\"} 0\n\
            cachepick_refusals_total{pool=\"a\",reason=\"no_workers\"} 5\n";
        assert_eq!(decision_total(exposition), 10);
    }
}

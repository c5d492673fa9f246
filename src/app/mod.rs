//! Process wiring: binds what a configuration names and runs the services until shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::BearerToken;
use crate::config::{Config, Discovery, IndexMode, PoolConfig, ReplicaSyncConfig};
use crate::discovery::SourceStatus;
use crate::discovery::dns::DnsSource;
use crate::discovery::kubernetes::KubernetesSource;
use crate::events::EventFeeds;
use crate::extproc;
use crate::health::Readiness;
use crate::load::{
    HttpClient, PoolLoad, PoolView, ReplicaSync, ScrapeTlsClient, Scraper, SyncKeys,
};
use crate::metrics::Metrics;
use crate::metrics_server::{self, DebugSource, ExplainFuture};
use crate::prefix::EventIndex;
/// Re-exported where `cachepick explain` has always found them; they live in `route`.
pub use crate::route::Explanation;
use crate::route::{ExplainInput, Picker, PickerError, PoolReport, Refusal, Service};
use crate::tls::TlsError;
use http::HeaderMap;
pub use reload::{READ_TIMEOUT, Reload, restart_only_changes};
pub use startup::{Prepared, StartError, prepare};

mod reload;
mod startup;
mod warm;

#[derive(Debug, Error)]
pub enum AppError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error(transparent)]
    Serve(#[from] extproc::ServeError),
    #[error(transparent)]
    Picker(#[from] PickerError),
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Start(#[from] StartError),
}

/// Warns of debug endpoints that anyone who can connect may use.
fn warn_exposed_debug(config: &Config) {
    for (key, addr) in config.exposed_debug() {
        tracing::warn!(
            %addr,
            "debug_endpoints: true serves the debug endpoints on {key}, which is not loopback, to anyone \
             who can connect: set debug_token_file, or bind {key} to loopback"
        );
    }
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), AppError> {
    let bind_error = |source| AppError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// A scraper and its shared state for every pool of `config`, scraping through `tls` when given.
fn pools(
    config: &Config,
    metrics: &Arc<Metrics>,
    tls: Option<&ScrapeTlsClient>,
) -> Vec<(Arc<PoolLoad>, Scraper)> {
    config
        .pools
        .iter()
        .map(|pool| {
            let load = PoolLoad::new(pool, &config.load);
            let scraper = Scraper::new(pool, &config.load, Arc::clone(&load), metrics.clone());
            let scraper = match tls {
                Some(tls) => scraper.with_tls(tls),
                None => scraper,
            };
            (load, scraper)
        })
        .collect()
}

/// Runs cachepick with `config` until `shutdown` resolves, its file's workers fixed.
pub async fn run(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AppError> {
    serve(config, None, shutdown).await
}

/// Runs cachepick with `config` until `shutdown` resolves. With `reload`, the file `config` came from
/// is read again when it changes and on SIGHUP (see [`reload`]).
pub async fn serve(
    config: &Config,
    reload: Option<Reload>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AppError> {
    // The files first: a bad certificate, token or tokenizer stops the process before it listens.
    let prepared = prepare(config)?;
    serve_prepared(config, prepared, reload, shutdown).await
}

/// [`serve`] with the configuration's files already loaded by [`prepare`].
pub async fn serve_prepared(
    config: &Config,
    prepared: Prepared,
    reload: Option<Reload>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AppError> {
    warn_exposed_debug(config);
    let Prepared {
        tls,
        token,
        scrape_tls,
        sync_keys,
        tokenizers,
    } = prepared;
    let (listener, bound) = bind(config.listen).await?;
    let (metrics_listener, metrics_bound) = bind(config.metrics_listen).await?;
    let metrics = Arc::new(Metrics::new()?);
    let (stop, stopped) = watch::channel(false);
    let stopped_future = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }
    };

    let pools = pools(config, &metrics, scrape_tls.as_ref());
    let loads: Vec<Arc<PoolLoad>> = pools.iter().map(|(load, _)| Arc::clone(load)).collect();
    // Every tokenizer and template was loaded up front: a bad file is a start-up error, not a 400 later.
    let picker = Picker::with_tokenizers(config, &loads, tokenizers);
    let service = Service::with_overload(picker, Arc::clone(&metrics), &config.overload);
    service.set_effective_config(config);
    let mut tasks = tokio::task::JoinSet::new();
    let replica = match (&config.replica_sync, sync_keys) {
        (Some(sync), Some(keys)) => Some(start_replica_sync(
            config,
            (sync, keys),
            (&loads, &service, &metrics),
            &mut tasks,
            &stopped_future,
        )?),
        _ => None,
    };
    start_scrapers(pools, &service, &mut tasks, &stopped_future);
    let client = HttpClient::new(&config.load, scrape_tls.as_ref());
    let feeds = service.start_event_feeds(stopped_future.clone(), client);
    // Ready once warm: the siblings asked, the event streams replayed (`warm.rs`).
    let (warmed_sender, warmed) = watch::channel(false);
    let warm_up = warm::warm_up(
        replica,
        Arc::clone(&service),
        warmed_sender,
        stopped_future(),
    );
    tasks.spawn(warm_up);
    let sources = start_sources(config, &loads, Some(&service), &mut tasks, &stopped_future);
    if let Some(reload) = reload {
        let targets = reload::Targets {
            loads: loads.clone(),
            service: Arc::clone(&service),
            metrics: Arc::clone(&metrics),
            sources,
        };
        tasks.spawn(reload::watch(
            reload,
            config.clone(),
            targets,
            stopped_future(),
        ));
    }
    // Readiness as the gRPC health service decides it, for the HTTP probes on metrics_listen.
    let readiness = Readiness::default();
    let access = metrics_access(config, &service, token.clone(), readiness.clone());
    tasks.spawn(metrics_server::serve(
        metrics_listener,
        Arc::clone(&metrics),
        access,
        stopped_future(),
    ));
    log_started(config, bound, metrics_bound);
    let options = extproc::ServeOptions {
        access: extproc::Access {
            debug: config.debug_on_listen(),
            token,
            tls,
        },
        overload: config.overload,
        feedback: config.feedback,
        freshness: config.load.freshness,
        silent_after: config.load.silent_after,
        readiness,
        warmed,
    };
    // The scrapers, sources and the metrics listener keep running through the drain, so the picker
    // decides on fresh load until its last answer; they stop once the gRPC server has.
    let served = extproc::serve(listener, service, options, shutdown).await;
    let _ = stop.send(true);
    tasks.join_all().await;
    for feed in feeds {
        let _ = feed.await;
    }
    tracing::info!("cachepick stopped");
    Ok(served?)
}

/// What `metrics_listen` serves beside `/metrics`: the debug endpoints when they are on there, and
/// readiness as the gRPC health service decides it.
fn metrics_access(
    config: &Config,
    service: &Arc<Service>,
    token: Option<BearerToken>,
    readiness: Readiness,
) -> metrics_server::Access {
    let debug = config
        .debug_on_metrics()
        .then(|| Arc::new(Debug(Arc::clone(service))) as Arc<dyn DebugSource>);
    metrics_server::Access {
        debug,
        token,
        limits: config.metrics_http,
        readiness,
    }
}

/// The start line, with the addresses bound (tests and operators read the ports the system chose).
fn log_started(config: &Config, bound: SocketAddr, metrics_bound: SocketAddr) {
    tracing::info!(
        listen = %bound,
        metrics_listen = %metrics_bound,
        pools = config.pools.len(),
        file_workers = config.pools.iter().map(|pool| pool.workers.len()).sum::<usize>(),
        "cachepick started"
    );
}

/// Starts each pool's scraper, handing it the pool's roster observer.
fn start_scrapers<F>(
    pools: Vec<(Arc<PoolLoad>, Scraper)>,
    service: &Service,
    tasks: &mut tokio::task::JoinSet<()>,
    stopped: &impl Fn() -> F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    for (index, (_, scraper)) in pools.into_iter().enumerate() {
        let scraper = match service.roster(index) {
            Some(roster) => scraper.with_roster(roster),
            None => scraper,
        };
        tasks.spawn(scraper.run(stopped()));
    }
}

/// Binds the replica-sync socket, announces every pool's dispatches through it and starts its
/// receiver, resolver and the siblings' warm-start listener.
fn start_replica_sync<F>(
    config: &Config,
    (sync, keys): (&ReplicaSyncConfig, SyncKeys),
    (loads, service, metrics): (&[Arc<PoolLoad>], &Arc<Service>, &Metrics),
    tasks: &mut tokio::task::JoinSet<()>,
    stopped: &impl Fn() -> F,
) -> Result<Arc<ReplicaSync>, AppError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let bind_error = |source| AppError::Bind {
        addr: sync.listen,
        source,
    };
    let (replica, listener) = ReplicaSync::bind(sync, keys).map_err(bind_error)?;
    for load in loads {
        load.announce_through(Arc::clone(&replica) as Arc<dyn crate::load::Announce>);
    }
    metrics.watch_replica_sync(replica.stats());
    let bounds = config
        .pools
        .iter()
        .zip(loads)
        .map(|(pool, load)| (Arc::clone(load), pool.max_model_len.get()))
        .collect();
    tracing::info!(
        listen = %replica.local_addr(),
        peers = sync.peers.len(),
        signed = if sync.key_file.is_some() { "key_file" } else { "loopback only" },
        "replica sync on: dispatches are announced to the peers"
    );
    tasks.spawn(Arc::clone(&replica).receive(bounds, stopped()));
    tasks.spawn(Arc::clone(&replica).refresh(stopped()));
    serve_snapshots(&replica, listener, service, tasks, stopped)?;
    Ok(replica)
}

/// Answers the siblings' warm-start requests on `listener`, TCP at the sync's address.
fn serve_snapshots<F>(
    replica: &Arc<ReplicaSync>,
    listener: std::net::TcpListener,
    service: &Arc<Service>,
    tasks: &mut tokio::task::JoinSet<()>,
    stopped: &impl Fn() -> F,
) -> Result<(), AppError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let addr = replica.local_addr();
    let listener = listener
        .set_nonblocking(true)
        .and_then(|()| TcpListener::from_std(listener))
        .map_err(|source| AppError::Bind { addr, source })?;
    tasks.spawn(Arc::clone(replica).serve_snapshots(listener, warm::source(service), stopped()));
    Ok(())
}

/// Starts each pool's source of workers: a `dns` or `kubernetes` pool's task, publishing to the pool's
/// scraper; a file pool's workers come from the file (and its reloads). Returns the file pools'
/// statuses, by pool position, for the reloads to report to. `service`, when given, reports every
/// source in the snapshot and the metrics.
fn start_sources<F>(
    config: &Config,
    loads: &[Arc<PoolLoad>],
    service: Option<&Arc<Service>>,
    tasks: &mut tokio::task::JoinSet<()>,
    shutdown: &(impl Fn() -> F + Send + Sync + Clone + 'static),
) -> Vec<Option<Arc<SourceStatus>>>
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut files = Vec::new();
    for (pool, load) in config.pools.iter().zip(loads) {
        let status = SourceStatus::new(pool.discovery.kind());
        if let Some(service) = service {
            service.watch_source(load.label(), Arc::clone(&status));
        }
        let publish = load.desired().clone();
        match &pool.discovery {
            Discovery::Static => {
                status.updated(pool.workers.len());
                files.push(Some(status));
                continue;
            }
            Discovery::Dns(dns) => {
                let source = DnsSource::new(dns, &pool.template, status);
                tasks.spawn(source.run(publish, shutdown()));
            }
            Discovery::Kubernetes(kubernetes) => {
                let kubernetes = kubernetes.clone();
                let template = pool.template.clone();
                let stopped = shutdown();
                // The client is inferred on the task (in-cluster service account or KUBECONFIG): a
                // picker whose API server is not reachable yet still serves its other pools, and the
                // source counts the failure until it can start.
                tasks.spawn(async move {
                    match KubernetesSource::infer(&kubernetes, &template, Arc::clone(&status)).await {
                        Ok(source) => source.run(publish, stopped).await,
                        Err(error) => {
                            tracing::error!(%error, "the kubernetes source cannot start; the pool has no workers");
                            status.failed(&error);
                        }
                    }
                });
            }
        }
        files.push(None);
    }
    files
}

/// The debug endpoints' view of the request service: the HTTP server on `metrics_listen` asks through
/// [`DebugSource`], so the request path itself depends on no server.
struct Debug(Arc<Service>);

impl DebugSource for Debug {
    fn config_yaml(&self) -> Vec<u8> {
        self.0.effective_config().as_bytes().to_vec()
    }

    fn snapshot_json(&self) -> Vec<u8> {
        let snapshot = serde_json::json!({
            "pools": self.0.report(),
            "admission": self.0.admission_view(),
        });
        serde_json::to_vec_pretty(&snapshot).unwrap_or_default()
    }

    fn explain_json(&self, path: String, headers: &HeaderMap, body: Bytes) -> ExplainFuture {
        let service = Arc::clone(&self.0);
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let input = ExplainInput {
            path,
            body,
            content_encoding: header(http::header::CONTENT_ENCODING.as_str()),
            tenant: service.salt_header().and_then(header),
        };
        Box::pin(async move {
            match service.explain_admitted(input).await {
                Ok(explanation) => Ok(serde_json::to_vec_pretty(&explanation).unwrap_or_default()),
                Err(refusal) => Err((refusal.status(), refusal.body())),
            }
        })
    }

    fn max_body_bytes(&self) -> usize {
        self.0.max_body_bytes()
    }
}

/// Scrapes every pool `rounds` times, `scrape_interval` apart, and returns what cachepick then sees;
/// meanwhile (and for at least [`EVENTS_LOOK`]) it subscribes to the `events` pools' KV event streams,
/// so their state shows whether the engines publish.
pub async fn snapshot(config: &Config, rounds: u32) -> Result<Vec<PoolReport>, AppError> {
    let indexes: Vec<(&PoolConfig, Arc<EventIndex>)> = config
        .pools
        .iter()
        .filter(|pool| pool.index.mode == IndexMode::Events)
        .map(|pool| {
            let capacity = vec![pool.default_cache_blocks.get(); pool.workers.len()];
            (pool, Arc::new(EventIndex::for_pool(pool, &capacity)))
        })
        .collect();
    let feeds = EventFeeds::new(indexes);
    let (stop, stopped) = watch::channel(false);
    let tls = scrape_tls(config)?;
    let client = HttpClient::new(&config.load, tls.as_ref());
    let tasks = feeds.start(
        move || {
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }
        },
        client,
    );
    let started = Instant::now();
    let loads = scraped(config, rounds, tls.as_ref()).await?;
    if !tasks.is_empty() {
        tokio::time::sleep(EVENTS_LOOK.saturating_sub(started.elapsed())).await;
    }
    let now = Instant::now();
    let views = loads
        .iter()
        .map(|load| PoolView::new(load.label(), &load.snapshot(), now))
        .collect();
    let reports = PoolReport::join(views, feeds.views(now));
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
    Ok(reports)
}

/// `load.tls`, read once: the scrapers' client and the KV event feeds' questions share it.
fn scrape_tls(config: &Config) -> Result<Option<ScrapeTlsClient>, AppError> {
    Ok(config
        .load
        .tls
        .as_ref()
        .map(ScrapeTlsClient::load)
        .transpose()?)
}

/// How long `cachepick snapshot` listens to KV event streams at least: enough to connect and replay.
pub const EVENTS_LOOK: Duration = Duration::from_secs(1);

/// Every pool's load after `rounds` scrape rounds, `scrape_interval` apart: what the one-shot commands
/// read instead of a running scraper.
async fn scraped(
    config: &Config,
    rounds: u32,
    tls: Option<&ScrapeTlsClient>,
) -> Result<Vec<Arc<PoolLoad>>, AppError> {
    let metrics = Arc::new(Metrics::new()?);
    let mut pools = pools(config, &metrics, tls);
    discover_once(config, &mut pools).await;
    for round in 0..rounds {
        if round > 0 {
            tokio::time::sleep(config.load.scrape_interval).await;
        }
        futures_util::future::join_all(pools.iter_mut().map(|(_, scraper)| scraper.round())).await;
    }
    Ok(pools.into_iter().map(|(load, _)| load).collect())
}

/// How long the one-shot commands wait for a `dns` or `kubernetes` pool's source to answer.
pub const DISCOVERY_LOOK: Duration = Duration::from_secs(5);

/// Runs each discovered pool's source until it answers (for at most [`DISCOVERY_LOOK`]) and brings the
/// pool's roster to what it said, so the one-shot commands see the workers `serve` would.
async fn discover_once(config: &Config, pools: &mut [(Arc<PoolLoad>, Scraper)]) {
    if config
        .pools
        .iter()
        .all(|pool| pool.discovery == Discovery::Static)
    {
        return;
    }
    let (stop, stopped) = watch::channel(false);
    let stopped = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }
    };
    let loads: Vec<Arc<PoolLoad>> = pools.iter().map(|(load, _)| Arc::clone(load)).collect();
    let mut tasks = tokio::task::JoinSet::new();
    start_sources(config, &loads, None, &mut tasks, &stopped);
    let deadline = Instant::now() + DISCOVERY_LOOK;
    for (pool, (_, scraper)) in config.pools.iter().zip(pools.iter_mut()) {
        if pool.discovery == Discovery::Static {
            continue;
        }
        while !scraper.follow_discovery() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let _ = stop.send(true);
    tasks.join_all().await;
}

/// Scrapes every pool once and explains how `input` would be routed by a picker that has this load and
/// has not routed anything yet (so its owner index is empty): the request pipeline's dry run, as the
/// running picker's explain is.
pub async fn explain(
    config: &Config,
    input: &ExplainInput<Vec<u8>>,
) -> Result<Result<Explanation, Refusal>, AppError> {
    let loads = scraped(config, 1, scrape_tls(config)?.as_ref()).await?;
    let picker = Picker::new(config, &loads)?;
    let service = Service::new(picker, Arc::new(Metrics::new()?));
    Ok(service.explain(&input.inbound()))
}

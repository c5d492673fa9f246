//! Process wiring: binds what a configuration names and runs the services until shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::load::{PoolLoad, PoolView, Scraper};
use crate::metrics::Metrics;
use crate::{admin, extproc};

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
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), AppError> {
    let bind_error = |source| AppError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// A scraper and its shared state for every pool of `config`.
fn pools(config: &Config, metrics: &Arc<Metrics>) -> Vec<(Arc<PoolLoad>, Scraper)> {
    config
        .pools
        .iter()
        .map(|pool| {
            let load = PoolLoad::new(pool, &config.load);
            let scraper = Scraper::new(pool, &config.load, Arc::clone(&load), Arc::clone(metrics));
            (load, scraper)
        })
        .collect()
}

/// Runs cachepick with `config` until `shutdown` resolves.
pub async fn run(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AppError> {
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

    let mut tasks = tokio::task::JoinSet::new();
    for (_, scraper) in pools(config, &metrics) {
        tasks.spawn(scraper.run(stopped_future()));
    }
    tasks.spawn(admin::serve(
        metrics_listener,
        Arc::clone(&metrics),
        stopped_future(),
    ));
    tracing::info!(
        listen = %bound,
        metrics_listen = %metrics_bound,
        pools = config.pools.len(),
        workers = config.pools.iter().map(|pool| pool.workers.len()).sum::<usize>(),
        "cachepick started"
    );
    let served = extproc::serve(listener, async move {
        shutdown.await;
        let _ = stop.send(true);
    })
    .await;
    tasks.join_all().await;
    tracing::info!("cachepick stopped");
    Ok(served?)
}

/// Scrapes every pool `rounds` times, `scrape_interval` apart, and returns what cachepick then sees.
pub async fn snapshot(config: &Config, rounds: u32) -> Result<Vec<PoolView>, AppError> {
    let metrics = Arc::new(Metrics::new()?);
    let mut pools = pools(config, &metrics);
    for round in 0..rounds {
        if round > 0 {
            tokio::time::sleep(config.load.scrape_interval).await;
        }
        futures_util::future::join_all(pools.iter_mut().map(|(_, scraper)| scraper.round())).await;
    }
    let now = Instant::now();
    Ok(pools
        .iter()
        .map(|(load, _)| PoolView::new(load.label(), &load.snapshot(), now))
        .collect())
}

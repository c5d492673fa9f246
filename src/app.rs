//! Process wiring: binds what a configuration names and runs the services until shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use thiserror::Error;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::extproc;

#[derive(Debug, Error)]
pub enum AppError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Serve(#[from] extproc::ServeError),
}

/// Runs cachepick with `config` until `shutdown` resolves.
pub async fn run(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AppError> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| AppError::Bind {
            addr: config.listen,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| AppError::Bind {
        addr: config.listen,
        source,
    })?;
    tracing::info!(
        listen = %bound,
        pools = config.pools.len(),
        workers = config.pools.iter().map(|pool| pool.workers.len()).sum::<usize>(),
        "cachepick started"
    );
    extproc::serve(listener, shutdown).await?;
    tracing::info!("cachepick stopped");
    Ok(())
}

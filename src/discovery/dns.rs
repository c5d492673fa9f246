//! The `dns` source: a name's A and AAAA records, re-resolved every `interval`, each address one worker
//! at the pool's port (a headless Service lists one record per ready pod).
//!
//! An answer is the truth, even an empty one: NXDOMAIN or no records publishes the empty set and the
//! pool drains. A failure (timeout, SERVFAIL, refused, network error) is not an answer: the last set
//! stays, the failure is counted on the [`SourceStatus`], and a warning is logged at most once a minute
//! so a DNS outage does not flood the log at every interval.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{
    ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RecordType;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

use super::{Members, SourceStatus, members, publish};
use crate::config::{DnsDiscovery, WorkerTemplate};

/// The longest one resolution may take, whatever the interval: a slow server must not hold the
/// source past the next few rounds.
const MAX_RESOLUTION: Duration = Duration::from_secs(5);

/// Why a resolution did not answer.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("no resolver for `{name}`: {source}")]
    Resolver { name: String, source: NetError },
    #[error("resolving `{name}` took longer than {timeout:?}")]
    Timeout { name: String, timeout: Duration },
    #[error("resolving `{name}` ({record}): {source}")]
    Lookup {
        name: String,
        record: RecordType,
        source: NetError,
    },
}

/// A pool's DNS source: build it with [`DnsSource::new`], then [`DnsSource::run`] it on its own task.
pub struct DnsSource {
    name: String,
    port: u16,
    interval: Duration,
    server: Option<SocketAddr>,
    template: WorkerTemplate,
    status: Arc<SourceStatus>,
    /// Built on the first resolution, and again after a failure to build one (a missing
    /// `/etc/resolv.conf` may appear later).
    resolver: Option<TokioResolver>,
}

impl DnsSource {
    /// A source resolving `dns.name` with the system's resolver configuration, or only `dns.server`
    /// when it is given; every address found becomes `template.worker(address:dns.port)`.
    pub fn new(dns: &DnsDiscovery, template: &WorkerTemplate, status: Arc<SourceStatus>) -> Self {
        DnsSource {
            name: dns.name.clone(),
            port: dns.port,
            interval: dns.interval,
            server: dns.server,
            template: template.clone(),
            status,
            resolver: None,
        }
    }

    /// Resolves at once, then every `interval`, publishing each answer's workers on `publish` (only
    /// when they changed), until `shutdown` completes.
    pub async fn run(
        mut self,
        publish: watch::Sender<Members>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = pin!(shutdown);
        let mut ticker = tokio::time::interval(self.interval);
        // A resolution that outlasts the interval delays the next one rather than bunching them.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = ticker.tick() => {}
            }
            let result = tokio::select! {
                () = &mut shutdown => return,
                result = self.resolve() => result,
            };
            match result {
                Ok(addresses) => self.answered(addresses, &publish),
                Err(error) => self.failed(&error),
            }
        }
    }

    fn answered(&mut self, addresses: Vec<IpAddr>, sender: &watch::Sender<Members>) {
        let next = members(
            addresses
                .into_iter()
                .map(|ip| self.template.worker(SocketAddr::new(ip, self.port)))
                .collect(),
        );
        let count = next.len();
        if publish(sender, next) {
            tracing::info!(name = %self.name, workers = count, "dns: the name's workers changed");
        }
        if self.status.updated(count) {
            tracing::info!(name = %self.name, "dns: the name resolves again");
        }
    }

    fn failed(&mut self, error: &DnsError) {
        if self.status.failed(error) {
            tracing::warn!(%error, "dns: keeping the last workers");
        }
    }

    /// The name's addresses, A then AAAA; both queries must answer (records or none), so a failed
    /// AAAA query cannot drop the IPv6 workers while the A query succeeds.
    async fn resolve(&mut self) -> Result<Vec<IpAddr>, DnsError> {
        let timeout = self.interval.min(MAX_RESOLUTION);
        let resolver = match &self.resolver {
            Some(resolver) => resolver.clone(),
            None => {
                let resolver = self.build(timeout)?;
                self.resolver = Some(resolver.clone());
                resolver
            }
        };
        // The cache would hide a change until the record's TTL ran out; the interval is the
        // operator's freshness, so every round asks the server.
        resolver.clear_cache();
        let lookups = async {
            let (v4, v6) = tokio::join!(
                self.lookup(&resolver, RecordType::A),
                self.lookup(&resolver, RecordType::AAAA),
            );
            let mut addresses = v4?;
            addresses.extend(v6?);
            Ok(addresses)
        };
        tokio::time::timeout(timeout, lookups)
            .await
            .unwrap_or_else(|_| {
                Err(DnsError::Timeout {
                    name: self.name.clone(),
                    timeout,
                })
            })
    }

    async fn lookup(
        &self,
        resolver: &TokioResolver,
        record: RecordType,
    ) -> Result<Vec<IpAddr>, DnsError> {
        match resolver.lookup(self.name.as_str(), record).await {
            Ok(lookup) => Ok(lookup
                .answers()
                .iter()
                .filter(|answer| answer.record_type() == record)
                .filter_map(|answer| answer.data.ip_addr())
                .collect()),
            // NXDOMAIN and NODATA are answers: the name has no such workers.
            Err(error) if error.is_no_records_found() => Ok(Vec::new()),
            Err(source) => Err(DnsError::Lookup {
                name: self.name.clone(),
                record,
                source,
            }),
        }
    }

    fn build(&self, timeout: Duration) -> Result<TokioResolver, DnsError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match self.server {
            Some(server) => {
                let mut udp = ConnectionConfig::udp();
                udp.port = server.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = server.port();
                let config = ResolverConfig::from_name_servers(vec![NameServerConfig::new(
                    server.ip(),
                    true,
                    vec![udp, tcp],
                )]);
                let mut builder = TokioResolver::builder_with_config(config, provider);
                // Only the named server answers: not the hosts file either.
                builder.options_mut().use_hosts_file = ResolveHosts::Never;
                builder
            }
            None => TokioResolver::builder(provider).map_err(|source| DnsError::Resolver {
                name: self.name.clone(),
                source,
            })?,
        };
        let options: &mut ResolverOpts = builder.options_mut();
        // Two tries fit in one resolution's time; the next round is the real retry.
        options.timeout = timeout / 2;
        options.attempts = 1;
        options.try_tcp_on_error = true;
        options.positive_max_ttl = Some(Duration::ZERO);
        options.negative_max_ttl = Some(Duration::ZERO);
        builder.build().map_err(|source| DnsError::Resolver {
            name: self.name.clone(),
            source,
        })
    }
}

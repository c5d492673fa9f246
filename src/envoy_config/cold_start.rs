//! Serving before cachepick's EDS has answered. An EDS cluster starts empty and Envoy 1.40 ignores a
//! `load_assignment` on it, so an Envoy that starts (or restarts) while no picker answers would have
//! no workers at all. The bootstrap therefore also carries the workers it can know without a picker —
//! the file's workers as written, and the `dns:` pools' names, which Envoy resolves itself — in a
//! cluster of their own, [`BOOTSTRAP_CLUSTER`], and an aggregate cluster, [`FAIL_OPEN_CLUSTER`], that
//! serves from cachepick's roster whenever it has one and from the bootstrap's list otherwise.
//!
//! The aggregate cannot carry cachepick's steering: it hands its child clusters a load-balancer context
//! without the request's stream info, and `override_host` needs it (without it, it uses its fallback
//! policy: a destination sent through the aggregate is ignored, as Envoy 1.40 shows). So the route splits on
//! whether cachepick answered: a request with cachepick's destination in the `envoy.lb` dynamic
//! metadata (which a client cannot set, unlike a header) goes to the EDS cluster, where
//! `override_host` steers it; every other request — picker down, shed, timed out — goes to the
//! aggregate, by least-request.

use std::net::SocketAddr;

use super::WORKERS_CLUSTER;
use super::yaml::{Yaml, duration, socket_address};
use crate::config::{Config, Discovery, DnsDiscovery};

/// The workers the bootstrap names itself (the configured ones, or the DNS names), for a cold start.
pub const BOOTSTRAP_CLUSTER: &str = "workers_bootstrap";
/// The route of the requests cachepick did not answer: cachepick's roster if Envoy has it, else the
/// bootstrap's workers.
pub const FAIL_OPEN_CLUSTER: &str = "workers_fail_open";

/// What Envoy can serve from with no picker: the file's workers that take requests and the names of the
/// `dns:` pools whose workers do, and how many pools (Kubernetes) it cannot find workers for by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColdStart<'a> {
    pub endpoints: Vec<SocketAddr>,
    pub names: Vec<&'a DnsDiscovery>,
    pub kubernetes_pools: usize,
}

impl<'a> ColdStart<'a> {
    /// `None` when there is nothing to serve from (every pool is Kubernetes, or its workers are all
    /// decode-only): the bootstrap is then EDS alone, as before.
    pub fn of(config: &'a Config) -> Option<Self> {
        let mut cold = ColdStart {
            endpoints: Vec::new(),
            names: Vec::new(),
            kubernetes_pools: 0,
        };
        for pool in &config.pools {
            match &pool.discovery {
                Discovery::Static => cold.endpoints.extend(
                    pool.workers
                        .iter()
                        .filter(|worker| worker.role.serves_prefill())
                        .map(|worker| worker.endpoint),
                ),
                Discovery::Dns(dns) if pool.template.role.serves_prefill() => cold.names.push(dns),
                Discovery::Dns(_) => {}
                Discovery::Kubernetes(_) => cold.kubernetes_pools += 1,
            }
        }
        cold.endpoints.sort_unstable();
        cold.endpoints.dedup();
        (!cold.endpoints.is_empty() || !cold.names.is_empty()).then_some(cold)
    }
}

/// The bootstrap's own list of workers: STATIC, or STRICT_DNS when some pool is `dns:` (a STRICT_DNS
/// cluster takes IP literals too). Least-request, outlier detection and circuit breakers as on the
/// EDS cluster, written by `write_common`.
pub(super) fn bootstrap_cluster(
    out: &mut Yaml,
    cold: &ColdStart<'_>,
    write_common: impl Fn(&mut Yaml),
) {
    out.line(2, &format!("- name: {BOOTSTRAP_CLUSTER}"));
    let mut comment = vec![
        "The workers this file names, for the requests cachepick did not answer while Envoy has no roster from",
        "cachepick's EDS (it started, or restarted, with no picker up): the file's workers that take requests",
        "as they were when this file was generated, and the dns: pools' names, resolved by Envoy itself.",
        "Reached only through workers_fail_open, and only while the workers cluster is empty. A worker added",
        "to the file since is missing here, one removed since is tried and skipped (connect failure, retry).",
    ];
    if cold.kubernetes_pools > 0 {
        comment.push(
            "The kubernetes pools have no workers here: Envoy cannot watch pods, so until a picker answers",
        );
        comment.push(
            "their workers are not served. Give such a pool a headless Service and `dns:` discovery instead",
        );
        comment.push("if it must serve from a cold start.");
    }
    out.comment(4, &comment);
    if cold.names.is_empty() {
        out.line(4, "type: STATIC");
    }
    out.line(4, "connect_timeout: 2s");
    write_common(out);
    if !cold.names.is_empty() {
        dns_cluster_type(out, &cold.names);
    }
    let endpoints = cold
        .endpoints
        .iter()
        .map(|endpoint| socket_address(endpoint.ip(), endpoint.port()));
    let names = cold
        .names
        .iter()
        .map(|dns| socket_address(&dns.name, dns.port));
    out.load_assignment(BOOTSTRAP_CLUSTER, endpoints.chain(names));
    out.line(4, "load_balancing_policy:");
    out.load_balancing_policy(
        6,
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    );
}

/// The aggregate the unanswered requests go to: the EDS cluster first, the bootstrap's list when the
/// EDS cluster has no healthy worker.
pub(super) fn fail_open_cluster(out: &mut Yaml, max_retries: u32) {
    out.line(2, &format!("- name: {FAIL_OPEN_CLUSTER}"));
    out.comment(
        4,
        &[
            &format!(
                "The requests cachepick did not answer (picker down, shed, timed out): {WORKERS_CLUSTER} (cachepick's roster)"
            ),
            &format!(
                "while it has a healthy worker, else {BOOTSTRAP_CLUSTER}. The child cluster's own load balancer picks the"
            ),
            "worker: least-request (override_host finds no destination and falls back to it). Circuit breakers",
            "apply per child cluster, except max_retries, which is the aggregate's: the route's retries count",
            "here (cluster.workers_fail_open.upstream_rq_retry), connections and their failures on the child.",
        ],
    );
    out.block(
        4,
        "
        connect_timeout: 2s
        lb_policy: CLUSTER_PROVIDED
        circuit_breakers:
          thresholds:
        ",
    );
    out.line(6, &format!("- {{max_retries: {max_retries}}}"));
    out.typed_extension(
        4,
        "cluster_type",
        "envoy.clusters.aggregate",
        "envoy.extensions.clusters.aggregate.v3.ClusterConfig",
    );
    out.line(
        8,
        &format!("clusters: [{WORKERS_CLUSTER}, {BOOTSTRAP_CLUSTER}]"),
    );
}

/// The `cluster_type` of a STRICT_DNS cluster over `names`, in the DnsCluster form (the Cluster's own
/// dns_* fields are deprecated), re-resolved as often as cachepick does (the shortest interval), with
/// the DNS servers the pools name.
pub(super) fn dns_cluster_type(out: &mut Yaml, names: &[&DnsDiscovery]) {
    let interval = names
        .iter()
        .map(|dns| dns.interval)
        .min()
        .unwrap_or(DnsDiscovery::DEFAULT_INTERVAL);
    out.comment(
        4,
        &[
            "STRICT_DNS, in the DnsCluster form (the Cluster's own dns_* fields are deprecated): every address",
            "each name resolves to is a worker, A and AAAA records alike (ALL), as for cachepick. Re-resolved every",
            "pools[].dns.interval (the shortest, if the pools differ), as cachepick does, and regardless of the",
            "records' TTL, which cachepick ignores too.",
        ],
    );
    out.typed_extension(
        4,
        "cluster_type",
        "envoy.cluster.dns",
        "envoy.extensions.clusters.dns.v3.DnsCluster",
    );
    out.line(8, &format!("dns_refresh_rate: {}", duration(interval)));
    out.line(8, "respect_dns_ttl: false");
    out.line(8, "dns_lookup_family: ALL");
    let mut servers: Vec<SocketAddr> = names.iter().filter_map(|dns| dns.server).collect();
    servers.sort_unstable();
    servers.dedup();
    if !servers.is_empty() {
        out.comment(
            8,
            &["The DNS servers the pools name (pools[].dns.server), so Envoy asks what cachepick asks."],
        );
        out.typed_extension(
            8,
            "typed_dns_resolver_config",
            "envoy.network.dns_resolver.cares",
            "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
        );
        out.line(12, "resolvers:");
        for server in servers {
            out.line(
                12,
                &format!("- {}", socket_address(server.ip(), server.port())),
            );
        }
    }
}

//! `cachepick envoy-config`: the Envoy bootstrap that puts cachepick in front of a fleet, generated from
//! the same validated [`Config`] cachepick runs with, so the two never drift.
//!
//! [`render`] writes a complete, static Envoy v3 bootstrap (checked against the real Envoy 1.40 by
//! `tests/envoy_config.rs`, which also keeps the shipped `envoy/*.yaml` equal to this output):
//!
//! - a listener whose connection manager has receive-side deadlines ([`REQUEST_HEADERS_TIMEOUT`],
//!   [`REQUEST_TIMEOUT`]), and a route whose body buffer limit is `max_body_bytes` and which puts no
//!   deadline on the response (generations run for minutes);
//! - a virtual host `llm` with one virtual cluster per decision [`Reason`] plus [`PASSTHROUGH`], matched
//!   on [`DECISION_HEADER`], so Envoy's `/stats` count requests and latencies per decision;
//! - a filter chain `header_mutation` (drops every client-sent `x-cachepick-*` header and
//!   [`DESTINATION`]) → `ext_proc` (cachepick) → `router`;
//! - the `workers` cluster, with the `override_host` load-balancing policy that follows [`DESTINATION`]
//!   (or the `envoy.lb` metadata) and falls back to least-request, outlier detection and a retry policy
//!   that walks cachepick's fallbacks. Its endpoints come from where the pools' workers come from
//!   ([`WorkersSource`]): cachepick's own EDS (file and Kubernetes pools, and any mix), or Envoy's DNS
//!   resolution of the same names cachepick resolves (every pool `dns:`). In
//!   [`BodyMode::OriginalDst`] it is an `ORIGINAL_DST` cluster instead, the form GIE gateways use;
//! - the `cachepick` cluster (gRPC, so HTTP/2) at the picker's address, or at several picker replicas'
//!   addresses, round-robined per request (Envoy opens one ext_proc stream per request, so each request
//!   is decided by one replica); with EDS, the `cachepick_xds` cluster at the same addresses, which
//!   carries the EDS subscription.
//!
//! The output is deterministic: the same configuration and options give the same bytes.
//!
//! This file is the model (modes, options, the fixed names and deadlines); `yaml.rs` is the writer,
//! `listener.rs` and `clusters.rs` the sections it writes.
//!
//! [`Reason`]: crate::policy::Reason
//! [`PASSTHROUGH`]: crate::protocol::PASSTHROUGH
//! [`DECISION_HEADER`]: crate::protocol::DECISION_HEADER
//! [`DESTINATION`]: crate::protocol::DESTINATION

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::config::{Config, Discovery, DnsDiscovery};

mod access_log;
mod clusters;
mod cold_start;
mod flags;
mod listener;
mod ready;
mod routes;
mod yaml;

pub use access_log::ACCESS_LOG_FIELDS;
pub use cold_start::{BOOTSTRAP_CLUSTER, ColdStart, FAIL_OPEN_CLUSTER};
pub use flags::{EnvoyFlags, PickerAddr, command_line};
pub use ready::READY_PATH;

use clusters::{original_dst_cluster, picker_cluster, worker_limits, workers_cluster, xds_cluster};
use cold_start::{bootstrap_cluster, fail_open_cluster};
use listener::{admin, header, listener, node};
use ready::ready_listener;
use yaml::Yaml;

/// Envoy's name for the ext_proc filter, also the key of its per-route config.
pub const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";
/// The HTTP connection manager's `request_headers_timeout`: a client has this long to send its request
/// headers (from their first byte).
pub const REQUEST_HEADERS_TIMEOUT: Duration = Duration::from_secs(10);
/// The HTTP connection manager's `request_timeout`: a client has this long to send its whole request,
/// body included. Envoy disarms it once the request has gone upstream or the response has begun, so it
/// never cuts a generation (`tests/envoy_config.rs` checks both sides against a live Envoy).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The cluster of picker replicas Envoy sends its ext_proc streams to and health-checks.
pub const PICKER_CLUSTER: &str = "cachepick";
/// The workers cluster of the override_host modes; with EDS, also the resource name Envoy subscribes
/// to (cachepick's `extproc::eds::WORKERS_CLUSTER`, which `tests/envoy_config.rs` keeps equal).
pub const WORKERS_CLUSTER: &str = "workers";
/// The cluster that carries Envoy's EDS subscription to the picker replicas.
pub const XDS_CLUSTER: &str = "cachepick_xds";
/// How long Envoy waits at start-up for the first EDS answer before it starts its listener anyway (with
/// an empty workers cluster, filled as soon as a picker answers). A picker that is up answers within
/// milliseconds, since EDS does not wait for its first scrape round.
pub const EDS_INITIAL_FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Envoy's workers cluster learns its endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkersSource<'a> {
    /// cachepick's EDS: the roster the picker routes over (the file's list as reloaded, DNS answers,
    /// Kubernetes pods), pushed on every change. Used whenever some pool is not `dns:`.
    Eds,
    /// Every pool is `dns:`: Envoy resolves the same names itself (`STRICT_DNS`), one per pool.
    Dns(Vec<&'a DnsDiscovery>),
}

impl<'a> WorkersSource<'a> {
    pub fn of(config: &'a Config) -> Self {
        let names: Vec<&DnsDiscovery> = config
            .pools
            .iter()
            .filter_map(|pool| match &pool.discovery {
                Discovery::Dns(dns) => Some(dns),
                Discovery::Static | Discovery::Kubernetes(_) => None,
            })
            .collect();
        if !names.is_empty() && names.len() == config.pools.len() {
            WorkersSource::Dns(names)
        } else {
            WorkersSource::Eds
        }
    }
}

/// How Envoy hands the request body to cachepick, and how it steers to the chosen worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BodyMode {
    /// Envoy buffers the whole body (up to `max_body_bytes`) and sends it in one message;
    /// `override_host` steers, least-request is the fallback.
    Buffered,
    /// `FULL_DUPLEX_STREAMED`: the body streams to cachepick, which buffers it and streams it back, so
    /// Envoy holds no copy; `override_host` steers. The Endpoint Picker Protocol's required mode.
    Duplex,
    /// `STREAMED` with `send_body_without_waiting_for_header_response`: the body's chunks go to cachepick
    /// without waiting for its headers response, which cachepick holds until the body is whole and
    /// which carries the decision; Envoy keeps the body and cachepick answers each chunk with CONTINUE.
    /// Saves buffered mode's wait for the headers response, and duplex mode's echo of the body;
    /// `override_host` steers.
    Streamed,
    /// Buffered body, but an `ORIGINAL_DST` cluster that connects to whatever address the header names
    /// (the GIE gateway form). Envoy does not know the fleet, so there is no fallback: without a picker
    /// answer the request gets 503.
    OriginalDst,
}

impl BodyMode {
    pub const ALL: [BodyMode; 4] = [
        BodyMode::Buffered,
        BodyMode::Duplex,
        BodyMode::Streamed,
        BodyMode::OriginalDst,
    ];

    /// The `--mode` value.
    pub fn as_str(self) -> &'static str {
        match self {
            BodyMode::Buffered => "buffered",
            BodyMode::Duplex => "duplex",
            BodyMode::Streamed => "streamed",
            BodyMode::OriginalDst => "original-dst",
        }
    }

    /// The file under `envoy/` that ships this mode's configuration for `examples/cachepick.yaml`.
    pub fn shipped_file(self) -> &'static str {
        match self {
            BodyMode::Buffered => "envoy.yaml",
            BodyMode::Duplex => "envoy-duplex.yaml",
            BodyMode::Streamed => "envoy-streamed.yaml",
            BodyMode::OriginalDst => "envoy-original-dst.yaml",
        }
    }
}

impl fmt::Display for BodyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BodyMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        BodyMode::ALL
            .into_iter()
            .find(|mode| mode.as_str() == text)
            .ok_or_else(|| {
                format!("expected buffered, duplex, streamed or original-dst, got `{text}`")
            })
    }
}

/// What the generated bootstrap needs beyond the cachepick configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyOptions {
    pub mode: BodyMode,
    /// Envoy's HTTP listener, where clients send LLM requests.
    pub listen: SocketAddr,
    /// Envoy's admin interface (`/stats`, `/ready`); it can reconfigure and stop Envoy, so keep it local.
    pub admin: SocketAddr,
    /// `--envoy-ready`: a listener answering `GET` [`READY_PATH`] with 200 once Envoy counts a picker
    /// replica healthy, 503 before, for a start-up probe; `None`, the default, writes none.
    pub ready: Option<SocketAddr>,
    /// Where Envoy reaches cachepick's ext_proc server: one address, [`picker_address`] of
    /// `config.listen`, by default; several are replicas of the picker, which Envoy round-robins per
    /// request; a DNS name (a Kubernetes Service) is resolved by Envoy, every address it answers being a
    /// replica. Never empty in a useful bootstrap ([`render`] falls back to the default when it is).
    pub pickers: Vec<PickerAddr>,
    /// Per-message ext_proc deadline (not used by [`BodyMode::Duplex`], where Envoy applies none).
    pub message_timeout: Duration,
    /// The command line that generated the file ([`command_line`]), echoed in the header comment so the
    /// file says how to regenerate itself exactly; `None` writes a command from these options, with a
    /// placeholder for the configuration file.
    pub command: Option<String>,
    /// TLS from Envoy to the pickers (the ext_proc and EDS clusters), for a cachepick with `tls:`;
    /// `None` is plain text.
    pub picker_tls: Option<PickerTls>,
    /// Where Envoy writes a JSON access log line per request ([`ACCESS_LOG_FIELDS`]); `None`, the
    /// default, writes none.
    pub access_log: Option<PathBuf>,
}

/// How Envoy connects to a picker serving TLS: the CA that signed the picker's certificate, the name to
/// send and check, and Envoy's own certificate when the picker requires one (`tls.client_ca_file`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickerTls {
    /// `--picker-ca`: the CA bundle the picker's certificate must chain to.
    pub ca_file: PathBuf,
    /// `--picker-client-cert` and `--picker-client-key`: Envoy's certificate and key, for mTLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// `--picker-sni`: sent as SNI and required among the certificate's DNS names. Without it the
    /// certificate is checked against the CA only, so the CA must sign pickers and nothing else.
    pub sni: Option<String>,
}

/// Why the pickers' TLS options do not fit the configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PickerTlsError {
    #[error(
        "the configuration serves TLS on listen (tls:): give --picker-ca, the CA Envoy verifies the picker with"
    )]
    CaMissing,
    #[error(
        "the configuration requires client certificates (tls.client_ca_file): give --picker-client-cert and --picker-client-key"
    )]
    ClientCertMissing,
    #[error("--picker-client-cert and --picker-client-key go together: give both or neither")]
    HalfPair,
    #[error(
        "the configuration serves plain text on listen (no tls:): the --picker-* TLS flags do not apply"
    )]
    NotTls,
}

impl PickerTls {
    /// The pickers' TLS from the `--picker-*` flags, checked against the configuration's `tls`.
    pub fn from_flags(
        config: &Config,
        ca_file: Option<PathBuf>,
        client_cert: Option<PathBuf>,
        client_key: Option<PathBuf>,
        sni: Option<String>,
    ) -> Result<Option<PickerTls>, PickerTlsError> {
        let client_cert = match (client_cert, client_key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => return Err(PickerTlsError::HalfPair),
        };
        let Some(tls) = &config.tls else {
            return if ca_file.is_some() || client_cert.is_some() || sni.is_some() {
                Err(PickerTlsError::NotTls)
            } else {
                Ok(None)
            };
        };
        let ca_file = ca_file.ok_or(PickerTlsError::CaMissing)?;
        if tls.client_ca_file.is_some() && client_cert.is_none() {
            return Err(PickerTlsError::ClientCertMissing);
        }
        Ok(Some(PickerTls {
            ca_file,
            client_cert,
            sni,
        }))
    }
}

impl EnvoyOptions {
    /// Loopback, as everything cachepick binds by default: exposing the gateway is a deliberate choice
    /// (`--envoy-listen 0.0.0.0:10000`).
    pub const DEFAULT_LISTEN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10000));
    pub const DEFAULT_ADMIN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9901));
    /// Envoy's own default is 200 ms, which tokenizing a prompt of a few MiB can exceed; the value
    /// written is the configuration's `overload.message_timeout`, whose default this is.
    pub const DEFAULT_MESSAGE_TIMEOUT: Duration =
        crate::config::OverloadConfig::DEFAULT_MESSAGE_TIMEOUT;

    /// The defaults for `config`: buffered mode, loopback listener and admin, the picker at
    /// [`picker_address`] of `config.listen`. Change a field with struct-update syntax.
    pub fn for_config(config: &Config) -> Self {
        EnvoyOptions {
            mode: BodyMode::Buffered,
            listen: Self::DEFAULT_LISTEN,
            admin: Self::DEFAULT_ADMIN,
            ready: None,
            pickers: vec![picker_address(config.listen).into()],
            // The picker's decision deadline is derived from the same value, so it ends first. A
            // prefill/decode pool's answer also waits for its prefill leg (`pd.prefill_timeout`).
            message_timeout: config.overload.message_timeout
                + config
                    .pools
                    .iter()
                    .filter_map(|pool| pool.pd.as_ref())
                    .map(|pd| pd.prefill_timeout)
                    .max()
                    .unwrap_or_default(),
            command: None,
            picker_tls: None,
            access_log: None,
        }
    }
}

/// The address Envoy dials for a cachepick listening on `listen`: an unspecified address (`0.0.0.0`,
/// `::`) means "every interface", and loopback is the one Envoy can certainly reach.
pub fn picker_address(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    }
}

/// The complete Envoy bootstrap YAML for `config`.
pub fn render(config: &Config, options: &EnvoyOptions) -> String {
    let defaulted;
    let options = if options.pickers.is_empty() {
        defaulted = EnvoyOptions {
            pickers: vec![picker_address(config.listen).into()],
            ..options.clone()
        };
        &defaulted
    } else {
        options
    };
    let mut out = Yaml::default();
    header(&mut out, config, options);
    if uses_eds(config, options.mode) {
        node(&mut out);
    }
    admin(&mut out, options);
    out.line(0, "");
    out.line(0, "static_resources:");
    listener(&mut out, config, options);
    ready_listener(&mut out, options);
    out.line(2, "clusters:");
    match options.mode {
        BodyMode::Buffered | BodyMode::Duplex | BodyMode::Streamed => {
            let cold = cold_start(config, options.mode);
            workers_cluster(&mut out, config, cold.as_ref());
            if let Some(cold) = &cold {
                bootstrap_cluster(&mut out, cold, worker_limits);
                fail_open_cluster(&mut out, clusters::MAX_RETRIES);
            }
        }
        BodyMode::OriginalDst => original_dst_cluster(&mut out, config),
    }
    picker_cluster(&mut out, options, uses_eds(config, options.mode));
    if uses_eds(config, options.mode) {
        xds_cluster(&mut out, options);
    }
    out.text
}

/// Whether the bootstrap subscribes to cachepick's EDS.
fn uses_eds(config: &Config, mode: BodyMode) -> bool {
    mode != BodyMode::OriginalDst && WorkersSource::of(config) == WorkersSource::Eds
}

/// What the bootstrap serves from before cachepick's EDS has answered, when it subscribes to EDS and
/// some pool's workers can be named without a picker.
fn cold_start(config: &Config, mode: BodyMode) -> Option<ColdStart<'_>> {
    uses_eds(config, mode)
        .then(|| ColdStart::of(config))
        .flatten()
}

/// Name of the cluster the route sends the requests cachepick answered to.
fn upstream_cluster(mode: BodyMode) -> &'static str {
    match mode {
        BodyMode::Buffered | BodyMode::Duplex | BodyMode::Streamed => WORKERS_CLUSTER,
        BodyMode::OriginalDst => "workers_original_dst",
    }
}

/// The cluster the route sends the requests cachepick did not answer to, when it is not
/// [`upstream_cluster`]: the cold-start aggregate.
fn fail_open_route(config: &Config, mode: BodyMode) -> Option<&'static str> {
    cold_start(config, mode).map(|_| FAIL_OPEN_CLUSTER)
}

#[cfg(test)]
mod tests {
    use super::yaml::duration;
    use super::*;
    use crate::config::{self, Overrides};

    fn config(yaml: &str) -> Config {
        config::parse(yaml, "test.yaml", &Overrides::default()).expect("valid config")
    }

    const TWO: &str = "listen: 0.0.0.0:9002\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n      - {endpoint: \"127.0.0.1:8002\", role: decode}\n      - {endpoint: \"[::1]:8003\"}\n";

    #[test]
    fn the_filter_waits_as_long_as_the_configured_message_timeout() {
        let config = config(&format!("overload: {{message_timeout: 3500ms}}\n{TWO}"));
        let yaml = render(&config, &EnvoyOptions::for_config(&config));
        assert!(yaml.contains("message_timeout: 3.500s\n"), "{yaml}");
        assert!(config.overload.decision_deadline < Duration::from_millis(3500));
    }

    #[test]
    fn modes_round_trip_through_their_names() {
        for mode in BodyMode::ALL {
            assert_eq!(mode.as_str().parse::<BodyMode>(), Ok(mode));
        }
        assert!("streaming".parse::<BodyMode>().is_err());
    }

    #[test]
    fn the_picker_is_dialled_on_loopback_when_cachepick_listens_everywhere() {
        let options = EnvoyOptions::for_config(&config(TWO));
        assert_eq!(options.pickers, ["127.0.0.1:9002".parse().expect("addr")]);
        assert_eq!(
            picker_address("[::]:7".parse().expect("addr")),
            "[::1]:7".parse().expect("addr")
        );
        let specific: SocketAddr = "10.1.1.1:9002".parse().expect("addr");
        assert_eq!(picker_address(specific), specific);
    }

    #[test]
    fn file_pools_get_their_workers_from_cachepicks_eds() {
        let yaml = render(&config(TWO), &EnvoyOptions::for_config(&config(TWO)));
        let workers = yaml
            .split("- name: workers\n")
            .nth(1)
            .and_then(|rest| rest.split("\n  - name: ").next())
            .expect("the workers cluster");
        assert!(workers.contains("type: EDS\n"));
        assert!(workers.contains("cluster_name: cachepick_xds\n"));
        assert!(workers.contains("initial_fetch_timeout: 5s\n"));
        // An EDS cluster takes no static endpoints: none are written.
        assert!(!workers.contains("load_assignment:"));
        assert!(!workers.contains("port_value: 8001"));
        assert!(yaml.contains("node: {id: cachepick-gateway, cluster: cachepick-gateway}\n"));
        let xds = yaml
            .split("- name: cachepick_xds\n")
            .nth(1)
            .expect("the EDS cluster");
        assert!(xds.contains("port_value: 9002}"));
        assert!(!xds.contains("health_checks:"));
        // ORIGINAL_DST needs no roster, so no subscription.
        let original = render(
            &config(TWO),
            &EnvoyOptions {
                mode: BodyMode::OriginalDst,
                ..EnvoyOptions::for_config(&config(TWO))
            },
        );
        assert!(!original.contains("cachepick_xds") && !original.contains("node:"));
        let comments: Vec<&str> = yaml
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix('#'))
            .collect();
        let comments = comments
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert!(comments.contains(
            "of cachepick's EDS, decode-only (cachepick never sends a request there, so the fallback must not): 127.0.0.1:8002."
        ));
    }

    /// The section of `yaml` from `- name: <name>` to the next cluster.
    fn cluster_section<'a>(yaml: &'a str, name: &str) -> Option<&'a str> {
        yaml.split(&format!("  - name: {name}\n"))
            .nth(1)
            .and_then(|rest| rest.split("\n  - name: ").next())
    }

    #[test]
    fn a_cold_start_serves_from_the_workers_the_file_names_unless_cachepick_answered() {
        let yaml = render(&config(TWO), &EnvoyOptions::for_config(&config(TWO)));
        let bootstrap = cluster_section(&yaml, BOOTSTRAP_CLUSTER).expect("the bootstrap cluster");
        assert!(bootstrap.contains("type: STATIC\n"));
        assert!(bootstrap.contains("port_value: 8001}") && bootstrap.contains("port_value: 8003}"));
        // Decode-only workers never take a request, not even from a cold start.
        assert!(!bootstrap.contains("port_value: 8002}"));
        assert!(
            bootstrap.contains("outlier_detection:") && bootstrap.contains("max_retries: 1024")
        );
        let aggregate = cluster_section(&yaml, FAIL_OPEN_CLUSTER).expect("the aggregate");
        assert!(aggregate.contains("clusters: [workers, workers_bootstrap]"));
        assert!(aggregate.contains("- {max_retries: 1024}\n"));
        // Answered requests (cachepick's metadata, which no client sets) go where override_host steers;
        // the others to the aggregate; the route is matched again after cachepick's answer.
        let routes = yaml
            .split("routes:\n")
            .nth(1)
            .and_then(|rest| rest.split("virtual_clusters:").next())
            .expect("the routes");
        let answered = routes
            .find("cluster: workers\n")
            .expect("the answered route");
        let unanswered = routes
            .find("cluster: workers_fail_open\n")
            .expect("the other");
        assert!(answered < unanswered);
        assert!(routes.contains(
            "- filter: envoy.lb\n                    path: [{key: x-gateway-destination-endpoint}]\n                    value: {present_match: true}\n"
        ));
        assert!(yaml.contains("route_cache_action: CLEAR\n"));
        // The EDS subscription retries at most every 0.5 s, and the picker must pass twice after a failure:
        // a picker that starts after Envoy has sent its roster before it decides.
        assert!(yaml.contains("retry_back_off: {base_interval: 0.25s, max_interval: 0.5s}"));
        let picker = cluster_section(&yaml, "cachepick").expect("the picker cluster");
        assert!(picker.contains("healthy_threshold: 2\n"));

        // dns: pools beside file pools: a STRICT_DNS bootstrap list with both.
        let mixed = config(
            "pools:\n  - model: a\n    engine: vllm\n    dns: {name: a.llm.svc, port: 8000, interval: 2s}\n  - model: b\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n  - model: c\n    engine: vllm\n    kubernetes: {namespace: llm, selector: \"app=vllm\", ports: [8000]}\n",
        );
        let yaml = render(&mixed, &EnvoyOptions::for_config(&mixed));
        let bootstrap = cluster_section(&yaml, BOOTSTRAP_CLUSTER).expect("the bootstrap cluster");
        assert!(
            !bootstrap.contains("type: STATIC") && bootstrap.contains("name: envoy.cluster.dns\n")
        );
        assert!(bootstrap.contains("dns_refresh_rate: 2s\n"));
        assert!(bootstrap.contains("socket_address: {address: \"a.llm.svc\", port_value: 8000}"));
        assert!(bootstrap.contains("socket_address: {address: \"127.0.0.1\", port_value: 8001}"));
        assert!(bootstrap.contains("kubernetes pools have no workers here"));

        // Nothing to name without a picker (Kubernetes only), or no EDS at all: one route, as before.
        let kubernetes = config(
            "pools:\n  - model: a\n    engine: vllm\n    kubernetes: {namespace: llm, selector: \"app=vllm\", ports: [8000]}\n",
        );
        let dns = config(
            "pools:\n  - model: a\n    engine: vllm\n    dns: {name: a.llm.svc, port: 8000}\n",
        );
        for (config, mode) in [
            (&kubernetes, BodyMode::Buffered),
            (&dns, BodyMode::Duplex),
            (&config(TWO), BodyMode::OriginalDst),
        ] {
            let yaml = render(
                config,
                &EnvoyOptions {
                    mode,
                    ..EnvoyOptions::for_config(config)
                },
            );
            assert!(
                !yaml.contains(&format!("- name: {BOOTSTRAP_CLUSTER}\n"))
                    && !yaml.contains(&format!("cluster: {FAIL_OPEN_CLUSTER}\n")),
                "{mode}"
            );
            assert!(!yaml.contains("route_cache_action"), "{mode}");
        }
    }

    #[test]
    fn the_output_is_deterministic_and_sized_from_the_config() {
        let config = config(TWO);
        let options = EnvoyOptions {
            mode: BodyMode::Duplex,
            ..EnvoyOptions::for_config(&config)
        };
        let yaml = render(&config, &options);
        assert_eq!(yaml, render(&config, &options));
        assert!(yaml.contains(&format!(
            "request_body_buffer_limit: {}",
            Config::DEFAULT_MAX_BODY_BYTES
        )));
        // The listener keeps Envoy's default per-connection buffer (only the comment names the field).
        assert!(!yaml.lines().any(|line| {
            line.trim_start()
                .starts_with("per_connection_buffer_limit_bytes:")
        }));
        assert!(yaml.contains("request_headers_timeout: 10s\n"));
        assert!(yaml.contains("request_timeout: 60s\n"));
        assert!(yaml.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(
            !yaml
                .lines()
                .any(|line| line.trim_start().starts_with("message_timeout:"))
        );
        // max_fallbacks 2 (the default): the list's three addresses, then one least-request attempt.
        assert!(yaml.contains("num_retries: 3"));
        assert!(yaml.contains("max_ejection_percent: 50\n"));
    }

    #[test]
    fn all_dns_pools_make_a_strict_dns_cluster_and_anything_else_eds() {
        let dns = config(
            "pools:\n  - model: a\n    engine: vllm\n    dns: {name: a.llm.svc, port: 8000, interval: 3s, server: \"10.96.0.10:53\"}\n  - model: b\n    engine: vllm\n    dns: {name: b.llm.svc, port: 8001}\n",
        );
        assert!(matches!(WorkersSource::of(&dns), WorkersSource::Dns(names) if names.len() == 2));
        let yaml = render(&dns, &EnvoyOptions::for_config(&dns));
        assert!(!yaml.contains("type: EDS") && !yaml.contains("cachepick_xds"));
        assert!(yaml.contains("name: envoy.cluster.dns\n"));
        assert!(yaml.contains("dns_refresh_rate: 3s\n"));
        assert!(yaml.contains("socket_address: {address: \"a.llm.svc\", port_value: 8000}"));
        assert!(yaml.contains("socket_address: {address: \"b.llm.svc\", port_value: 8001}"));
        assert!(yaml.contains("- socket_address: {address: \"10.96.0.10\", port_value: 53}"));
        let mixed = config(
            "pools:\n  - model: a\n    engine: vllm\n    dns: {name: a.llm.svc, port: 8000}\n  - model: b\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n",
        );
        assert_eq!(WorkersSource::of(&mixed), WorkersSource::Eds);
        let kubernetes = config(
            "pools:\n  - model: a\n    engine: vllm\n    kubernetes: {namespace: llm, selector: \"app=vllm\", ports: [8000]}\n",
        );
        assert_eq!(WorkersSource::of(&kubernetes), WorkersSource::Eds);
    }

    #[test]
    fn several_pickers_are_one_round_robin_cluster_and_none_is_the_default() {
        let config = config(TWO);
        let one = render(&config, &EnvoyOptions::for_config(&config));
        assert!(!one.contains("lb_policy: ROUND_ROBIN"));
        let none = EnvoyOptions {
            pickers: Vec::new(),
            ..EnvoyOptions::for_config(&config)
        };
        assert_eq!(render(&config, &none), one);
        let pickers: Vec<PickerAddr> = ["127.0.0.1:9101", "127.0.0.1:9102", "[::1]:9103"]
            .iter()
            .map(|addr| addr.parse().expect("addr"))
            .collect();
        let yaml = render(
            &config,
            &EnvoyOptions {
                pickers,
                ..EnvoyOptions::for_config(&config)
            },
        );
        let picker_cluster = yaml
            .split("- name: cachepick\n")
            .nth(1)
            .expect("the picker cluster");
        assert!(picker_cluster.contains("lb_policy: ROUND_ROBIN"));
        for port in [9101, 9102, 9103] {
            assert!(
                picker_cluster.contains(&format!("port_value: {port}}}")),
                "{port}"
            );
        }
        assert!(!picker_cluster.contains("port_value: 9002}"));
        assert!(
            yaml.contains("--picker 127.0.0.1:9101 --picker 127.0.0.1:9102 --picker '[::1]:9103'")
        );
    }

    #[test]
    fn picker_tls_flags_follow_the_configuration_and_write_both_picker_clusters() {
        let plain = config(TWO);
        assert_eq!(
            PickerTls::from_flags(&plain, None, None, None, None),
            Ok(None)
        );
        assert_eq!(
            PickerTls::from_flags(&plain, Some("ca.crt".into()), None, None, None),
            Err(PickerTlsError::NotTls)
        );
        let mtls = config(&format!(
            "tls: {{cert_file: p.crt, key_file: p.key, client_ca_file: clients.crt}}\n{TWO}"
        ));
        assert_eq!(
            PickerTls::from_flags(&mtls, None, None, None, None),
            Err(PickerTlsError::CaMissing)
        );
        assert_eq!(
            PickerTls::from_flags(&mtls, Some("ca.crt".into()), None, None, None),
            Err(PickerTlsError::ClientCertMissing)
        );
        assert_eq!(
            PickerTls::from_flags(
                &mtls,
                Some("ca.crt".into()),
                Some("e.crt".into()),
                None,
                None
            ),
            Err(PickerTlsError::HalfPair)
        );
        let tls = PickerTls::from_flags(
            &mtls,
            Some("/etc/envoy/ca.crt".into()),
            Some("/etc/envoy/e.crt".into()),
            Some("/etc/envoy/e.key".into()),
            Some("cachepick.llm.svc".into()),
        )
        .expect("valid flags");
        let yaml = render(
            &mtls,
            &EnvoyOptions {
                picker_tls: tls,
                ..EnvoyOptions::for_config(&mtls)
            },
        );
        for cluster in ["- name: cachepick\n", "- name: cachepick_xds\n"] {
            let section = yaml
                .split(cluster)
                .nth(1)
                .and_then(|rest| rest.split("\n  - name: ").next())
                .expect("the cluster");
            for expected in [
                "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni: \"cachepick.llm.svc\"",
                "trusted_ca: {filename: \"/etc/envoy/ca.crt\"}",
                "- {san_type: DNS, matcher: {exact: \"cachepick.llm.svc\"}}",
                "- certificate_chain: {filename: \"/etc/envoy/e.crt\"}",
                "private_key: {filename: \"/etc/envoy/e.key\"}",
                "alpn_protocols: [h2]",
            ] {
                assert!(
                    section.contains(expected),
                    "{cluster}: {expected} in\n{section}"
                );
            }
        }
        assert!(yaml.contains(
            "--picker-ca /etc/envoy/ca.crt --picker-client-cert /etc/envoy/e.crt --picker-client-key /etc/envoy/e.key --picker-sni cachepick.llm.svc"
        ));
        // Without TLS options the bootstrap has no transport socket at all.
        let plain_yaml = render(&plain, &EnvoyOptions::for_config(&plain));
        assert!(!plain_yaml.contains("transport_socket"));
    }

    #[test]
    fn durations_use_envoys_json_form() {
        assert_eq!(duration(Duration::from_secs(2)), "2s");
        assert_eq!(duration(Duration::from_millis(250)), "0.250s");
        assert_eq!(duration(Duration::from_millis(1500)), "1.500s");
    }
}

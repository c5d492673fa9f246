//! The bootstrap's clusters: the workers (`override_host` over EDS or DNS, or `ORIGINAL_DST`), the
//! picker, and the picker again as the EDS server.

use std::net::SocketAddr;

use super::cold_start::{ColdStart, dns_cluster_type};
use super::yaml::{Yaml, duration, socket_address};
use super::{
    EDS_INITIAL_FETCH_TIMEOUT, EnvoyOptions, PICKER_CLUSTER, PickerAddr, WORKERS_CLUSTER,
    WorkersSource, XDS_CLUSTER,
};
use crate::config::{Config, DnsDiscovery};
use crate::protocol::{DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, SELECTED_HEADER};

/// The concurrent retries a cluster of workers allows (Envoy's default is 3).
pub(super) const MAX_RETRIES: u32 = 1024;

/// Generous limits: Envoy's defaults (1024 connections, pending and active requests, 3 concurrent
/// retries per cluster) are reached quickly when each request lasts a whole generation.
fn circuit_breakers(out: &mut Yaml, comment: &[&str]) {
    out.comment(4, comment);
    out.line(4, "circuit_breakers:");
    out.line(6, "thresholds:");
    out.line(
        6,
        &format!(
            "- {{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: {MAX_RETRIES}}}"
        ),
    );
}

/// The circuit breakers of a cluster of workers, explained; `retries`: Envoy retries on the cluster, so
/// its default of 3 concurrent retries is one of the limits lifted.
fn generation_limits(out: &mut Yaml, retries: bool) {
    circuit_breakers(
        out,
        &[
            "Each request holds its connection for a whole generation: Envoy's default limit of 1024 connections,",
            if retries {
                "pending and active requests (and 3 concurrent retries)"
            } else {
                "pending and active requests"
            },
            "per cluster is soon reached, and the excess would be refused by Envoy.",
        ],
    );
}

/// The endpoints of the workers that take requests (role prefill or both, and every worker of a
/// prefill/decode pool), or of those that do not (an aggregated pool's decode-only workers), in
/// configuration order.
fn endpoints(config: &Config, takes_requests: bool) -> impl Iterator<Item = SocketAddr> + '_ {
    config
        .pools
        .iter()
        .flat_map(|pool| pool.workers.iter().map(move |worker| (pool, worker)))
        .filter(move |(pool, worker)| {
            (worker.role.serves_prefill() || pool.pd.is_some()) == takes_requests
        })
        .map(|(_, worker)| worker.endpoint)
}

pub(super) fn workers_cluster(out: &mut Yaml, config: &Config, cold: Option<&ColdStart<'_>>) {
    out.line(2, &format!("- name: {WORKERS_CLUSTER}"));
    let source = WorkersSource::of(config);
    match &source {
        WorkersSource::Eds => out.comment(
            4,
            &[
                "Endpoints from cachepick's EDS: every worker that takes requests (role prefill or both) and is not",
                "draining, as cachepick's roster holds them (the file's workers as last loaded, DNS answers, Kubernetes",
                "pods), pushed on every change, so a new or removed worker reaches Envoy with no restart.",
            ],
        ),
        WorkersSource::Dns(_) => out.comment(
            4,
            &[
                "Every pool is `dns:`, so Envoy resolves the same names itself. Envoy and cachepick resolve",
                "independently, each on its own timer: for up to one interval they can disagree. A worker that",
                "cachepick names and Envoy does not hold yet is skipped by override_host (the next listed address,",
                "or least-request, serves it); one that Envoy holds and cachepick has not seen yet is reached only by",
                "the fallback. Use EDS (any pool not `dns:`) where that window matters.",
            ],
        ),
    }
    decode_only_comment(out, config, source == WorkersSource::Eds);
    if config.pools.len() > 1 {
        out.comment(
            4,
            &[
                "The pools share this cluster (the route cannot know a request's pool: the model is in the body).",
                "cachepick always picks within the request's pool, but the fallback (picker down) knows no models: it",
                "may send a request to another pool's worker, which refuses it.",
            ],
        );
    }
    if source == WorkersSource::Eds {
        out.line(4, "type: EDS");
    }
    out.line(4, "connect_timeout: 2s");
    generation_limits(out, true);
    match source {
        WorkersSource::Eds => eds_config(out, cold.is_some()),
        WorkersSource::Dns(names) => dns_config(out, &names),
    }
    outlier_detection(out);
    out.comment(
        4,
        &[
            &format!(
                "Steering: the first address of {DESTINATION} (else of the {LB_NAMESPACE} metadata cachepick"
            ),
            "also writes) that is a member of this cluster; later ones serve retries. Addresses outside the cluster",
            "are skipped, so no header can send a request outside the fleet. No usable address (picker down) means",
            "least-request over the workers.",
        ],
    );
    out.line(4, "load_balancing_policy:");
    out.load_balancing_policy(
        6,
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
    );
    out.line(12, "override_host_sources:");
    out.line(12, &format!("- header: {DESTINATION}"));
    out.line(
        12,
        &format!("- metadata: {{key: {LB_NAMESPACE}, path: [{{key: {DESTINATION}}}]}}"),
    );
    out.line(12, "fallback_policy:");
    out.load_balancing_policy(
        14,
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    );
}

/// Names the decode-only workers, which are not upstream hosts, and says why.
fn decode_only_comment(out: &mut Yaml, config: &Config, eds: bool) {
    let decode_only: Vec<String> = endpoints(config, false)
        .map(|endpoint| endpoint.to_string())
        .collect();
    if !decode_only.is_empty() {
        out.comment(
            4,
            &[&format!(
                "Left out{}, decode-only (cachepick never sends a request there, so the fallback must not): {}.",
                if eds { " of cachepick's EDS" } else { "" },
                decode_only.join(", ")
            )],
        );
    }
}

pub(super) fn original_dst_cluster(out: &mut Yaml, config: &Config) {
    let workers: Vec<String> = endpoints(config, true)
        .map(|endpoint| endpoint.to_string())
        .collect();
    out.line(2, "- name: workers_original_dst");
    out.comment(
        4,
        &[
            &format!(
                "Connects to the ip:port in {SELECTED_HEADER}, whatever it is: Envoy does not check it against the fleet"
            ),
            &format!("({}).", workers.join(", ")),
            "That is safe only because the header_mutation filter drops a client-sent value and cachepick then sets",
            &format!(
                "it. ORIGINAL_DST reads one address, so it reads {SELECTED_HEADER} (the selected worker alone), not"
            ),
            &format!(
                "the list in {DESTINATION} (selected worker, then fallbacks); Envoy cannot retry elsewhere."
            ),
        ],
    );
    decode_only_comment(out, config, false);
    out.block(
        4,
        "
        type: ORIGINAL_DST
        lb_policy: CLUSTER_PROVIDED
        connect_timeout: 2s
        ",
    );
    generation_limits(out, false);
    out.line(4, "original_dst_lb_config:");
    out.line(6, "use_http_header: true");
    out.line(6, &format!("http_header_name: {SELECTED_HEADER}"));
}

/// `eds_first`: a picker that answers must have sent its roster first (the EDS cluster is otherwise
/// empty at a cold start), so its health check passes twice before the picker decides again.
pub(super) fn picker_cluster(out: &mut Yaml, options: &EnvoyOptions, eds_first: bool) {
    out.line(2, &format!("- name: {PICKER_CLUSTER}"));
    if options.pickers.len() > 1 {
        out.comment(
            4,
            &[
                "Replicas of cachepick's ext_proc server, each with an owner index of its own. Envoy opens one",
                "ext_proc stream per request and round-robins the streams over the replicas, so each request is",
                "decided by one replica; an unhealthy replica is skipped (health check below).",
            ],
        );
    } else {
        out.comment(4, &["cachepick's ext_proc server (its `listen`)."]);
    }
    picker_discovery(out, options);
    out.line(4, "connect_timeout: 1s");
    circuit_breakers(
        out,
        &[
            "Envoy keeps one ext_proc stream open per request for the request's whole life, generation included:",
            "the default limit of 1024 active requests would cap the fleet's concurrency, and requests beyond it",
            "would silently skip the picker (fail open).",
        ],
    );
    out.comment(
        4,
        &[
            &format!(
                "Active health check of cachepick's gRPC health service {}, SERVING once every pool has had a",
                EXT_PROC_SERVICE
            ),
            "scrape round. With panic routing off, Envoy does not try an unhealthy picker at all: requests fail",
            "open at once instead of each waiting for a refused connection or message_timeout. In duplex mode this",
            "is what makes failing open work at all (see failure_mode_allow above). no_traffic_interval: Envoy",
            "would otherwise check a cluster that has had no traffic only once a minute, and a picker that starts",
            "after Envoy would be bypassed that long. Two failed checks, not one, mark it down, so one slow answer",
            "from a busy picker does not send a second of traffic past it.",
        ],
    );
    out.block(
        4,
        "
        health_checks:
        - timeout: 1s
          interval: 1s
          no_traffic_interval: 1s
          unhealthy_threshold: 2
        ",
    );
    if eds_first {
        out.comment(
            6,
            &[
                "Two passes after a failure (Envoy needs one only for its very first check): a picker that starts",
                "after Envoy has sent its roster over EDS (retried every 0.5 s at most) before it decides.",
            ],
        );
    }
    out.line(
        6,
        &format!("healthy_threshold: {}", if eds_first { 2 } else { 1 }),
    );
    out.line(
        6,
        &format!("grpc_health_check: {{service_name: {}}}", EXT_PROC_SERVICE),
    );
    out.line(4, "common_lb_config:");
    out.line(6, "healthy_panic_threshold: {value: 0}");
    picker_http2(out);
    picker_tls(out, options);
    picker_endpoints(out, PICKER_CLUSTER, options);
}

/// `eds_cluster_config`: the workers' endpoints from cachepick's EDS over [`XDS_CLUSTER`]; `cold` says
/// whether the bootstrap also lists workers to serve from before the first answer.
fn eds_config(out: &mut Yaml, cold: bool) {
    out.comment(
        4,
        &[
            &format!(
                "Subscribed over {XDS_CLUSTER} (the same picker replicas; any one serves the same roster). At start-up"
            ),
            &format!(
                "Envoy holds its listener back until the first answer, for at most initial_fetch_timeout ({}): a",
                duration(EDS_INITIAL_FETCH_TIMEOUT)
            ),
            "picker that is up answers at once; with none up Envoy starts with this cluster empty and fills it as",
            "soon as a picker answers. An EDS cluster takes no static endpoints (Envoy ignores a load_assignment",
            if cold {
                "here): until then the requests are served from workers_bootstrap, through workers_fail_open."
            } else {
                "here), and no pool's workers can be listed without a picker: until then every request gets 503."
            },
            "Once Envoy has the roster it keeps it through a picker outage. The subscription retries every 0.25 s",
            "to 0.5 s while no picker answers: a picker that starts after Envoy sends its roster before Envoy's",
            "health check (two passes 1 s apart after a failure) lets it decide, so no decision names a worker",
            "this cluster does not hold yet.",
        ],
    );
    out.line(4, "eds_cluster_config:");
    out.line(6, &format!("service_name: {WORKERS_CLUSTER}"));
    out.line(6, "eds_config:");
    out.line(8, "resource_api_version: V3");
    out.line(
        8,
        &format!(
            "initial_fetch_timeout: {}",
            duration(EDS_INITIAL_FETCH_TIMEOUT)
        ),
    );
    out.block(
        8,
        "
        api_config_source:
          api_type: GRPC
          transport_api_version: V3
          set_node_on_first_message_only: true
          grpc_services:
          - envoy_grpc:
        ",
    );
    out.line(14, &format!("cluster_name: {XDS_CLUSTER}"));
    out.line(
        14,
        "retry_policy: {retry_back_off: {base_interval: 0.25s, max_interval: 0.5s}}",
    );
}

/// `STRICT_DNS` on each pool's name and port, re-resolved as often as cachepick does.
fn dns_config(out: &mut Yaml, names: &[&DnsDiscovery]) {
    dns_cluster_type(out, names);
    out.load_assignment(
        WORKERS_CLUSTER,
        names.iter().map(|dns| socket_address(&dns.name, dns.port)),
    );
}

/// The circuit breakers and outlier detection of a cluster of workers, without their explanations
/// (the workers cluster above carries them).
pub(super) fn worker_limits(out: &mut Yaml) {
    circuit_breakers(
        out,
        &["Circuit breakers and outlier detection as on the workers cluster."],
    );
    outlier_detection_fields(out);
}

/// Outlier detection on the workers: a worker that stops accepting connections is ejected after a few
/// consecutive failures, so the least-request fallback stops choosing it.
fn outlier_detection(out: &mut Yaml) {
    out.comment(
        4,
        &[
            "Outlier detection, sized for pools of 2 to 8 workers. Local-origin failures (connect failure, reset,",
            "timeout) count apart from the workers' answers (split_external_local_origin_errors): 3 in a row eject a",
            "worker at once; 5 gateway errors (502/503/504) in a row do too. Other 5xx never eject (an engine's 500",
            "is usually about one request), nor does success-rate statistics (too few requests per worker to mean",
            "anything). Ejection lasts base_ejection_time times the number of ejections, at most 60 s; interval",
            "is how often Envoy re-examines (and returns ejected workers). max_ejection_percent 50 never ejects a",
            "whole pool: of 2 workers at most 1, of 3 at most 1, of 4 at most 2, of 8 at most 4, and a lone worker",
            "never. The percentage is of the cluster, which all pools share: with several pools of unequal size a",
            "small pool can still lose every worker to ejection. Ejection steers least-request (the fallback, and",
            "retries past cachepick's list); cachepick itself moves off a worker whose scrapes fail.",
        ],
    );
    outlier_detection_fields(out);
}

/// The `outlier_detection` section [`outlier_detection`] explains.
pub(super) fn outlier_detection_fields(out: &mut Yaml) {
    out.block(
        4,
        "
        outlier_detection:
          split_external_local_origin_errors: true
          consecutive_local_origin_failure: 3
          enforcing_consecutive_local_origin_failure: 100
          consecutive_gateway_failure: 5
          enforcing_consecutive_gateway_failure: 100
          enforcing_consecutive_5xx: 0
          enforcing_success_rate: 0
          enforcing_local_origin_success_rate: 0
          interval: 2s
          base_ejection_time: 10s
          max_ejection_time: 60s
          max_ejection_percent: 50
        ",
    );
}

/// The cluster that carries the EDS subscription: the picker replicas without the readiness health
/// check, since the roster is valid before the picker's first scrape round makes it ready.
pub(super) fn xds_cluster(out: &mut Yaml, options: &EnvoyOptions) {
    out.line(2, &format!("- name: {XDS_CLUSTER}"));
    out.comment(
        4,
        &[
            "cachepick's EDS, on the same gRPC listener as ext_proc. A cluster of its own because the ext_proc",
            "cluster's health check follows readiness (a first scrape round), and the roster is good before that.",
            "Envoy keeps one EDS stream open; if it breaks, it reconnects to the next replica, which serves the same",
            "roster under the same version.",
        ],
    );
    picker_discovery(out, options);
    out.line(4, "connect_timeout: 1s");
    picker_http2(out);
    picker_tls(out, options);
    picker_endpoints(out, XDS_CLUSTER, options);
}

/// How a cluster of pickers finds its endpoints: the addresses as given (`STATIC`), or, when any is a
/// name, Envoy's own resolution of it (`STRICT_DNS`: every address a name answers is an endpoint, so a
/// headless Service lists each replica), and round robin over more than one.
fn picker_discovery(out: &mut Yaml, options: &EnvoyOptions) {
    if options.pickers.iter().any(PickerAddr::is_name) {
        out.comment(
            4,
            &[
                "STRICT_DNS (the DnsCluster form): Envoy resolves the picker's name itself, again every 5 s (or at the",
                "answer's TTL, if sooner), and every address in the answer is an endpoint, health-checked on its own.",
                "Behind a headless Service that is one endpoint per ready picker pod; behind a ClusterIP it is the",
                "one virtual IP, kube-proxy spreads the connections, and the health check asks whichever pod it",
                "reaches, so prefer a headless Service.",
            ],
        );
        out.typed_extension(
            4,
            "cluster_type",
            "envoy.cluster.dns",
            "envoy.extensions.clusters.dns.v3.DnsCluster",
        );
        out.line(8, "dns_refresh_rate: 5s");
        out.line(8, "respect_dns_ttl: true");
        out.comment(
            8,
            &["IPv4 when the name has it, else IPv6: a dual-stack pod is one endpoint, not two."],
        );
        out.line(8, "dns_lookup_family: V4_PREFERRED");
    } else {
        out.line(4, "type: STATIC");
    }
    if options.pickers.len() > 1 || options.pickers.iter().any(PickerAddr::is_name) {
        out.line(4, "lb_policy: ROUND_ROBIN");
    }
}

fn picker_endpoints(out: &mut Yaml, cluster_name: &str, options: &EnvoyOptions) {
    out.load_assignment(
        cluster_name,
        options.pickers.iter().map(|picker| {
            let (host, port) = picker.host_and_port();
            socket_address(host, port)
        }),
    );
}

/// The HTTP/2 options of a cluster of pickers (ext_proc and EDS both speak gRPC to them).
fn picker_http2(out: &mut Yaml) {
    out.comment(
        4,
        &["gRPC needs HTTP/2; keepalive pings find a dead connection to the picker within seconds."],
    );
    out.line(4, "typed_extension_protocol_options:");
    out.line(6, "envoy.extensions.upstreams.http.v3.HttpProtocolOptions:");
    out.type_url(8, "envoy.extensions.upstreams.http.v3.HttpProtocolOptions");
    out.block(
        8,
        "
        explicit_http_config:
          http2_protocol_options:
            connection_keepalive: {interval: 30s, timeout: 5s}
        ",
    );
}

/// The `transport_socket` of a cluster of pickers serving TLS (`--picker-ca` and the rest); nothing for
/// plain text.
fn picker_tls(out: &mut Yaml, options: &EnvoyOptions) {
    let Some(tls) = &options.picker_tls else {
        return;
    };
    let mut comment = vec![
        "TLS to the picker (its tls: section): the picker's certificate must chain to the CA below",
    ];
    match &tls.sni {
        Some(_) => comment.push("and name the SNI among its DNS names."),
        None => comment.push(
            "(no --picker-sni: any certificate that CA signed is accepted, so it must sign pickers only).",
        ),
    }
    if tls.client_cert.is_some() {
        comment.push(
            "Envoy presents its own certificate: the picker requires one (tls.client_ca_file).",
        );
    }
    comment.push(
        "The files are read by Envoy, which reloads them when they change on disk (a mounted Secret).",
    );
    out.comment(4, &comment);
    out.typed_extension(
        4,
        "transport_socket",
        "envoy.transport_sockets.tls",
        "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
    );
    if let Some(sni) = &tls.sni {
        out.line(8, &format!("sni: {}", quoted(sni)));
    }
    out.block(
        8,
        "
        common_tls_context:
          alpn_protocols: [h2]
          validation_context:
        ",
    );
    out.line(
        12,
        &format!(
            "trusted_ca: {{filename: {}}}",
            quoted(&tls.ca_file.display().to_string())
        ),
    );
    if let Some(sni) = &tls.sni {
        out.line(12, "match_typed_subject_alt_names:");
        out.line(
            12,
            &format!("- {{san_type: DNS, matcher: {{exact: {}}}}}", quoted(sni)),
        );
    }
    if let Some((cert, key)) = &tls.client_cert {
        out.line(10, "tls_certificates:");
        out.line(
            10,
            &format!(
                "- certificate_chain: {{filename: {}}}",
                quoted(&cert.display().to_string())
            ),
        );
        out.line(
            12,
            &format!(
                "private_key: {{filename: {}}}",
                quoted(&key.display().to_string())
            ),
        );
    }
}

/// A YAML double-quoted scalar (JSON string syntax is valid YAML).
fn quoted(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| format!("{text:?}"))
}

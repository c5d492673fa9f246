//! The bootstrap's clusters: the workers (`override_host`, or `ORIGINAL_DST`) and the picker.

use std::net::SocketAddr;

use super::EnvoyOptions;
use super::yaml::Yaml;
use crate::config::Config;
use crate::protocol::{DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, SELECTED_HEADER};

/// Generous limits: Envoy's defaults (1024 connections, pending and active requests, 3 concurrent
/// retries per cluster) are reached quickly when each request lasts a whole generation.
fn circuit_breakers(out: &mut Yaml, comment: &[&str]) {
    out.comment(4, comment);
    out.line(4, "circuit_breakers:");
    out.line(6, "thresholds:");
    out.line(
        6,
        "- {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1024}",
    );
}

/// The endpoints of the workers that take requests (role prefill or both), or of those that do not
/// (decode-only), in configuration order.
fn endpoints(config: &Config, takes_requests: bool) -> impl Iterator<Item = SocketAddr> + '_ {
    config
        .pools
        .iter()
        .flat_map(|pool| &pool.workers)
        .filter(move |worker| worker.role.serves_prefill() == takes_requests)
        .map(|worker| worker.endpoint)
}

/// A cluster's static `load_assignment`: one locality of `endpoints`.
fn load_assignment(
    out: &mut Yaml,
    cluster_name: &str,
    endpoints: impl IntoIterator<Item = SocketAddr>,
) {
    out.line(4, "load_assignment:");
    out.line(6, &format!("cluster_name: {cluster_name}"));
    out.line(6, "endpoints:");
    out.line(6, "- lb_endpoints:");
    for endpoint in endpoints {
        out.line(8, "- endpoint:");
        out.line(12, "address:");
        out.socket_address(14, endpoint);
    }
}

/// A `policies:` list of one load-balancing policy at `indent`; its fields, if any, follow at
/// `indent + 6`.
fn load_balancing_policy(out: &mut Yaml, indent: usize, name: &str, type_name: &str) {
    out.line(indent, "policies:");
    out.line(indent, "- typed_extension_config:");
    out.line(indent + 4, &format!("name: {name}"));
    out.line(indent + 4, "typed_config:");
    out.type_url(indent + 6, type_name);
}

pub(super) fn workers_cluster(out: &mut Yaml, config: &Config) {
    out.line(2, "- name: workers");
    out.comment(
        4,
        &["Every worker that takes requests (role prefill or both), in configuration order."],
    );
    decode_only_comment(out, config);
    if config.pools.len() > 1 {
        out.comment(
            4,
            &[
                "The pools share this cluster. cachepick always picks within the request's pool, but the fallback",
                "(picker down) knows no models: it may send a request to another pool's worker, which refuses it.",
            ],
        );
    }
    out.line(4, "type: STATIC");
    out.line(4, "connect_timeout: 2s");
    circuit_breakers(
        out,
        &[
            "Each request holds its connection for a whole generation: Envoy's default limit of 1024 connections,",
            "pending and active requests (and 3 concurrent retries) per cluster is soon reached, and the excess",
            "would be refused by Envoy itself.",
        ],
    );
    load_assignment(out, "workers", endpoints(config, true));
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
    load_balancing_policy(
        out,
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
    load_balancing_policy(
        out,
        14,
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    );
}

/// Names the decode-only workers, which are not upstream hosts, and says why.
fn decode_only_comment(out: &mut Yaml, config: &Config) {
    let decode_only: Vec<String> = endpoints(config, false)
        .map(|endpoint| endpoint.to_string())
        .collect();
    if !decode_only.is_empty() {
        out.comment(
            4,
            &[&format!(
                "Left out, decode-only (cachepick never sends a request there, so the fallback must not): {}.",
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
    decode_only_comment(out, config);
    out.line(4, "type: ORIGINAL_DST");
    out.line(4, "lb_policy: CLUSTER_PROVIDED");
    out.line(4, "connect_timeout: 2s");
    circuit_breakers(
        out,
        &[
            "Each request holds its connection for a whole generation: Envoy's default limit of 1024 connections,",
            "pending and active requests per cluster is soon reached, and the excess would be refused by Envoy.",
        ],
    );
    out.line(4, "original_dst_lb_config:");
    out.line(6, "use_http_header: true");
    out.line(6, &format!("http_header_name: {SELECTED_HEADER}"));
}

pub(super) fn picker_cluster(out: &mut Yaml, options: &EnvoyOptions) {
    out.line(2, "- name: cachepick");
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
    out.line(4, "type: STATIC");
    if options.pickers.len() > 1 {
        out.line(4, "lb_policy: ROUND_ROBIN");
    }
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
    out.line(4, "health_checks:");
    out.line(4, "- timeout: 1s");
    out.line(6, "interval: 1s");
    out.line(6, "no_traffic_interval: 1s");
    out.line(6, "unhealthy_threshold: 2");
    out.line(6, "healthy_threshold: 1");
    out.line(
        6,
        &format!("grpc_health_check: {{service_name: {}}}", EXT_PROC_SERVICE),
    );
    out.line(4, "common_lb_config:");
    out.line(6, "healthy_panic_threshold: {value: 0}");
    out.comment(
        4,
        &["gRPC needs HTTP/2; keepalive pings find a dead connection to the picker within seconds."],
    );
    out.line(4, "typed_extension_protocol_options:");
    out.line(6, "envoy.extensions.upstreams.http.v3.HttpProtocolOptions:");
    out.type_url(8, "envoy.extensions.upstreams.http.v3.HttpProtocolOptions");
    out.line(8, "explicit_http_config:");
    out.line(10, "http2_protocol_options:");
    out.line(12, "connection_keepalive: {interval: 30s, timeout: 5s}");
    load_assignment(out, "cachepick", options.pickers.iter().copied());
}

//! The `llm` listener's route configuration: how a request reaches the worker ext_proc chose, with
//! its body limit and retry policy.

use super::yaml::Yaml;
use super::{BodyMode, EnvoyOptions, fail_open_route, upstream_cluster};
use crate::config::Config;
use crate::policy::Reason;
use crate::protocol::{DECISION_HEADER, DESTINATION, LB_NAMESPACE, PASSTHROUGH};

/// The `llm` route configuration: its virtual host, the routes to the workers (and to the fail-open
/// cluster when there is one) and the virtual clusters.
pub(super) fn route_config(out: &mut Yaml, config: &Config, options: &EnvoyOptions) {
    out.block(
        10,
        "
        route_config:
          name: llm
          virtual_hosts:
          - name: llm
            domains: [\"*\"]
            routes:
        ",
    );
    match fail_open_route(config, options.mode) {
        None => {
            out.line(14, "- match: {prefix: \"/\"}");
            route(out, config, options, upstream_cluster(options.mode), true);
        }
        Some(fail_open) => {
            out.comment(
                14,
                &[
                    &format!(
                        "Two routes, on whether cachepick answered: its destination is in the {LB_NAMESPACE} dynamic metadata"
                    ),
                    &format!(
                        "({DESTINATION}), which no client can set (a header would be matched before the filter below"
                    ),
                    "drops a client's copy). Envoy matches the route again after ext_proc has changed the headers.",
                    &format!(
                        "Answered: {} (cachepick's roster), steered by override_host. Not answered (picker down, shed, timed",
                        upstream_cluster(options.mode)
                    ),
                    &format!(
                        "out): {fail_open}, which serves from that roster too once Envoy has it, and from the workers this"
                    ),
                    "file names before (a cold start: Envoy up, no picker yet). The aggregate cannot steer (it gives",
                    "override_host no request to read), hence the split.",
                ],
            );
            out.block(
                14,
                "
                - match:
                    prefix: \"/\"
                    dynamic_metadata:
                ",
            );
            out.line(18, &format!("- filter: {LB_NAMESPACE}"));
            out.line(20, &format!("path: [{{key: {DESTINATION}}}]"));
            out.line(20, "value: {present_match: true}");
            route(out, config, options, upstream_cluster(options.mode), true);
            out.line(14, "- match: {prefix: \"/\"}");
            route(out, config, options, fail_open, false);
        }
    }
    out.comment(
        14,
        &[
            &format!(
                "One virtual cluster per decision reason, matched on the {DECISION_HEADER} header cachepick sets, so /stats"
            ),
            "shows vhost.llm.vcluster.<reason>.upstream_rq_{total,2xx,5xx,time,...}. The router matches them after",
            "ext_proc has run; requests without the header (picker down) count under vhost.llm.vcluster.other.",
            &format!(
                "The last, {PASSTHROUGH}, is not a routing reason: it counts requests without a prompt (header-only GETs"
            ),
            "such as /v1/models, POSTs to paths like /v1/embeddings), which cachepick sends by load alone.",
        ],
    );
    out.line(14, "virtual_clusters:");
    let names = Reason::ALL
        .iter()
        .map(|reason| reason.as_str())
        .chain([PASSTHROUGH]);
    for name in names {
        out.line(14, &format!("- name: {name}"));
        out.line(
            16,
            &format!("headers: [{{name: {DECISION_HEADER}, string_match: {{exact: {name}}}}}]"),
        );
    }
}

/// One route's action to `cluster`: the body limit, no deadline, the retry policy; `explain` writes the
/// comments (the second route refers to the first).
fn route(out: &mut Yaml, config: &Config, options: &EnvoyOptions, cluster: &str, explain: bool) {
    let limit = config.max_body_bytes.get();
    match options.mode {
        _ if !explain => out.comment(16, &["As the route above."]),
        BodyMode::Buffered | BodyMode::OriginalDst => out.comment(
            16,
            &[
                "cachepick's max_body_bytes: Envoy buffers the whole request body for cachepick up to this many bytes",
                "(it overrides the listener's 1 MiB for this route's requests), and answers 413 itself to an HTTP/1.1",
                "body above it, as cachepick would. It is also the retry buffer: a larger body (possible only while",
                "failing open) is not kept for retries, so if its first worker refuses it, Envoy answers 507.",
            ],
        ),
        BodyMode::Streamed => out.comment(
            16,
            &[
                "cachepick's max_body_bytes: Envoy holds the body's chunks until cachepick has answered (up to",
                "this many bytes, it overrides the listener's 1 MiB for this route's requests); cachepick refuses a",
                "body over the limit itself (413). It is also the retry buffer: a larger body (possible only while",
                "failing open) is not kept for retries, so if its first worker refuses it, Envoy answers 507.",
            ],
        ),
        BodyMode::Duplex => out.comment(
            16,
            &[
                "cachepick's max_body_bytes. The body streams through cachepick, which refuses one over the limit",
                "itself, so this bounds only what Envoy buffers for retries: a larger body (possible only while",
                "failing open) is not kept, so if its first worker refuses it, Envoy answers 507.",
            ],
        ),
    }
    out.line(16, &format!("request_body_buffer_limit: {limit}"));
    out.line(16, "route:");
    out.line(18, &format!("cluster: {cluster}"));
    if explain {
        out.comment(
        18,
        &[
            "No deadline: a generation can run for minutes, and a non-streaming one sends nothing until it ends,",
            "so neither the 15 s route timeout nor the 5 min stream idle timeout may apply.",
        ],
    );
    }
    out.line(18, "timeout: 0s");
    out.line(18, "idle_timeout: 0s");
    let fallbacks = config.most_fallbacks();
    if options.mode != BodyMode::OriginalDst {
        if explain {
            out.comment(
            18,
            &[
                &format!(
                    "cachepick lists the selected worker and up to {fallbacks} fallbacks (max_fallbacks); override_host takes"
                ),
                "the next listed address that is a member of the cluster on each retry, and once the list is used up",
                "it hands the choice to least-request, which skips outlier-ejected workers",
                &format!(
                    "and, through previous_hosts, every worker already tried. Hence num_retries is {fallbacks} + 1: a worker"
                ),
                "dying between cachepick's decision and Envoy's connect costs one retry per dead listed worker, and one",
                "more attempt goes wherever least-request finds room. Only failures that happened before the worker saw",
                "the request are retried, so a generation never runs twice.",
            ],
        );
        }
        out.line(18, "retry_policy:");
        out.line(
            20,
            "retry_on: connect-failure,refused-stream,reset-before-request",
        );
        out.line(20, &format!("num_retries: {}", fallbacks.saturating_add(1)));
        out.line(20, "retry_host_predicate:");
        out.typed_entry(
            20,
            "envoy.retry_host_predicates.previous_hosts",
            "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
        );
        out.line(20, "host_selection_retry_max_attempts: 5");
    }
}

//! `cachepick envoy-config`: the Envoy bootstrap that puts cachepick in front of a fleet, generated from
//! the same validated [`Config`] cachepick runs with, so the two never drift.
//!
//! [`render`] writes a complete, static Envoy v3 bootstrap (checked against the real Envoy 1.40 by
//! `tests/envoy_config.rs`, which also keeps the shipped `envoy/*.yaml` equal to this output):
//!
//! - a listener whose connection manager has receive-side deadlines ([`REQUEST_HEADERS_TIMEOUT`],
//!   [`REQUEST_TIMEOUT`]), and a route whose body buffer limit is `max_body_bytes` and which puts no
//!   deadline on the response (generations run for minutes);
//! - a virtual host `llm` with one virtual cluster per decision [`Reason`] plus
//!   [`PASSTHROUGH`], matched on [`DECISION_HEADER`], so Envoy's `/stats`
//!   count requests and latencies per decision;
//! - a filter chain `header_mutation` (drops every client-sent `x-cachepick-*` header and
//!   [`DESTINATION`]) → `ext_proc` (cachepick) → `router`;
//! - the `workers` cluster: every prefill-capable worker, with the `override_host` load-balancing policy
//!   that follows [`DESTINATION`] (or the `envoy.lb` metadata) and falls back to least-request —
//!   or, in [`BodyMode::OriginalDst`], an `ORIGINAL_DST` cluster, the form GIE gateways use;
//! - the `cachepick` cluster (gRPC, so HTTP/2) at the picker's address.
//!
//! The output is deterministic: the same configuration and options give the same bytes.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::str::FromStr;
use std::time::Duration;

use crate::config::Config;
use crate::policy::Reason;
use crate::protocol::{
    DECISION_HEADER, DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, OWNED_PREFIX, PASSTHROUGH,
    SELECTED_HEADER,
};

/// Envoy's name for the ext_proc filter, also the key of its per-route config.
pub const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";
/// The HTTP connection manager's `request_headers_timeout`: a client has this long to send its request
/// headers (from their first byte).
pub const REQUEST_HEADERS_TIMEOUT: Duration = Duration::from_secs(10);
/// The HTTP connection manager's `request_timeout`: a client has this long to send its whole request,
/// body included. Envoy disarms it once the request has gone upstream or the response has begun, so it
/// never cuts a generation (`tests/envoy_config.rs` checks both sides against a live Envoy).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How Envoy hands the request body to cachepick, and how it steers to the chosen worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BodyMode {
    /// Envoy buffers the whole body (up to `max_body_bytes`) and sends it in one message;
    /// `override_host` steers, least-request is the fallback.
    Buffered,
    /// `FULL_DUPLEX_STREAMED`: the body streams to cachepick, which buffers it and streams it back, so
    /// Envoy holds no copy; `override_host` steers. The Endpoint Picker Protocol's required mode.
    Duplex,
    /// Buffered body, but an `ORIGINAL_DST` cluster that connects to whatever address the header names
    /// (the GIE gateway form). Envoy does not know the fleet, so there is no fallback: without a picker
    /// answer the request gets 503.
    OriginalDst,
}

impl BodyMode {
    pub const ALL: [BodyMode; 3] = [BodyMode::Buffered, BodyMode::Duplex, BodyMode::OriginalDst];

    /// The `--mode` value.
    pub fn as_str(self) -> &'static str {
        match self {
            BodyMode::Buffered => "buffered",
            BodyMode::Duplex => "duplex",
            BodyMode::OriginalDst => "original-dst",
        }
    }

    /// The file under `envoy/` that ships this mode's configuration for `examples/cachepick.yaml`.
    pub fn shipped_file(self) -> &'static str {
        match self {
            BodyMode::Buffered => "envoy.yaml",
            BodyMode::Duplex => "envoy-duplex.yaml",
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
            .ok_or_else(|| format!("expected buffered, duplex or original-dst, got `{text}`"))
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
    /// Where Envoy reaches cachepick's ext_proc server; [`picker_address`] of `config.listen` by default.
    pub picker: SocketAddr,
    /// Per-message ext_proc deadline (not used by [`BodyMode::Duplex`], where Envoy applies none).
    pub message_timeout: Duration,
    /// How the configuration file was named on the command line, echoed in the header comment so the
    /// file says how to regenerate it; `None` writes a placeholder.
    pub source: Option<String>,
}

impl EnvoyOptions {
    /// Loopback, as everything cachepick binds by default: exposing the gateway is a deliberate choice
    /// (`--envoy-listen 0.0.0.0:10000`).
    pub const DEFAULT_LISTEN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10000));
    pub const DEFAULT_ADMIN: SocketAddr =
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9901));
    /// Envoy's own default is 200 ms, which tokenizing a prompt of a few MiB can exceed.
    pub const DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);

    /// The defaults for `config`: buffered mode, loopback listener and admin, the picker at
    /// [`picker_address`] of `config.listen`. Change a field with struct-update syntax.
    pub fn for_config(config: &Config) -> Self {
        EnvoyOptions {
            mode: BodyMode::Buffered,
            listen: Self::DEFAULT_LISTEN,
            admin: Self::DEFAULT_ADMIN,
            picker: picker_address(config.listen),
            message_timeout: Self::DEFAULT_MESSAGE_TIMEOUT,
            source: None,
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
    let mut out = Yaml::default();
    header(&mut out, config, options);
    admin(&mut out, options);
    out.line(0, "");
    out.line(0, "static_resources:");
    listener(&mut out, config, options);
    out.line(2, "clusters:");
    match options.mode {
        BodyMode::Buffered | BodyMode::Duplex => workers_cluster(&mut out, config),
        BodyMode::OriginalDst => original_dst_cluster(&mut out, config),
    }
    picker_cluster(&mut out, options);
    out.text
}

/// Name of the cluster the route sends requests to.
fn upstream_cluster(mode: BodyMode) -> &'static str {
    match mode {
        BodyMode::Buffered | BodyMode::Duplex => "workers",
        BodyMode::OriginalDst => "workers_original_dst",
    }
}

/// Comment lines are wrapped to this many columns, indentation included.
const COMMENT_WIDTH: usize = 108;

#[derive(Default)]
struct Yaml {
    text: String,
}

impl Yaml {
    fn line(&mut self, indent: usize, text: &str) {
        for _ in 0..indent {
            self.text.push(' ');
        }
        self.text.push_str(text);
        self.text.push('\n');
    }

    /// A comment block. Consecutive entries form one paragraph, re-wrapped to [`COMMENT_WIDTH`]; an empty
    /// entry separates paragraphs; an entry starting with a space is kept verbatim on its own line.
    fn comment(&mut self, indent: usize, entries: &[&str]) {
        let width = COMMENT_WIDTH.saturating_sub(indent + 2).max(40);
        let mut paragraph: Vec<&str> = Vec::new();
        for entry in entries {
            if entry.is_empty() || entry.starts_with(' ') {
                self.paragraph(indent, width, &paragraph);
                paragraph.clear();
                if entry.is_empty() {
                    self.line(indent, "#");
                } else {
                    self.line(indent, &format!("#{entry}"));
                }
            } else {
                paragraph.extend(entry.split_whitespace());
            }
        }
        self.paragraph(indent, width, &paragraph);
    }

    fn paragraph(&mut self, indent: usize, width: usize, words: &[&str]) {
        let mut current = String::new();
        for word in words {
            if !current.is_empty() && current.len() + 1 + word.len() > width {
                self.line(indent, &format!("# {current}"));
                current.clear();
            }
            if !current.is_empty() {
                current.push(' ');
            }
            current.push_str(word);
        }
        if !current.is_empty() {
            self.line(indent, &format!("# {current}"));
        }
    }

    fn socket_address(&mut self, indent: usize, addr: SocketAddr) {
        self.line(
            indent,
            &format!(
                "socket_address: {{address: \"{}\", port_value: {}}}",
                addr.ip(),
                addr.port()
            ),
        );
    }
}

/// Printable on one comment line: no control characters.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// An Envoy `Duration` in its JSON form: whole seconds, or seconds with milliseconds.
fn duration(value: Duration) -> String {
    match value.subsec_millis() {
        0 => format!("{}s", value.as_secs()),
        millis => format!("{}.{millis:03}s", value.as_secs()),
    }
}

fn header(out: &mut Yaml, config: &Config, options: &EnvoyOptions) {
    let source = options
        .source
        .as_deref()
        .map(one_line)
        .unwrap_or_else(|| "CACHEPICK.YAML".to_owned());
    let mut command = format!(
        "cachepick envoy-config --config {source} --mode {}",
        options.mode
    );
    if options.listen != EnvoyOptions::DEFAULT_LISTEN {
        command.push_str(&format!(" --envoy-listen {}", options.listen));
    }
    if options.admin != EnvoyOptions::DEFAULT_ADMIN {
        command.push_str(&format!(" --envoy-admin {}", options.admin));
    }
    let summary = match options.mode {
        BodyMode::Buffered => {
            "Mode buffered: Envoy buffers each request body and sends it to cachepick in one message; \
             cachepick's answer names the worker. A picker outage falls back to least-request over the same \
             workers."
        }
        BodyMode::Duplex => {
            "Mode duplex: the body streams to cachepick (FULL_DUPLEX_STREAMED), which buffers it and streams \
             it back, so Envoy holds no copy; cachepick's answer names the worker. A picker outage falls back \
             to least-request over the same workers once the health check marks the picker down (a body \
             already streaming to a picker that dies gets a 500: Envoy cannot fail open mid-body)."
        }
        BodyMode::OriginalDst => {
            "Mode original-dst: Envoy connects to whatever ip:port cachepick names (the GIE gateway form). \
             Envoy does not know the fleet, so a picker outage means 503s: prefer buffered or duplex."
        }
    };
    let addresses = format!(
        "Clients send LLM requests to {}. cachepick's ext_proc server (its `listen`) is at {}. \
         Envoy's admin interface is at {}. From the cachepick configuration: max_body_bytes {}, \
         max_fallbacks (largest of any pool) {}.",
        options.listen,
        options.picker,
        options.admin,
        config.max_body_bytes,
        config.most_fallbacks()
    );
    out.comment(
        0,
        &[
            "Envoy v3 bootstrap for cachepick, generated by `cachepick envoy-config`. Do not edit; regenerate with",
            &format!("   {command} > FILE"),
            "and check with `envoy --mode validate -c FILE` (written for Envoy 1.40).",
            "",
            summary,
            "",
            &addresses,
        ],
    );
    out.line(0, "");
}

fn admin(out: &mut Yaml, options: &EnvoyOptions) {
    out.comment(
        0,
        &["The admin interface can reconfigure and stop Envoy: keep it on loopback."],
    );
    out.line(0, "admin:");
    out.line(2, "address:");
    out.socket_address(4, options.admin);
    out.line(0, "");
    out.comment(
        0,
        &[
            "A bound on downstream connections, so a connection flood exhausts a limit instead of memory (Envoy",
            "warns at start-up without one).",
            "",
            "No memory-based overload action: Envoy's fixed_heap monitor needs max_heap_size_bytes, Envoy's memory",
            "budget, which only the deployment knows (Envoy refuses the monitor without it). Where you know it, add",
            "that monitor with actions such as envoy.overload_actions.shrink_heap and stop_accepting_requests.",
        ],
    );
    out.line(0, "overload_manager:");
    out.line(2, "resource_monitors:");
    out.line(
        2,
        "- name: envoy.resource_monitors.global_downstream_max_connections",
    );
    out.line(4, "typed_config:");
    out.line(
        6,
        "\"@type\": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
    );
    out.line(6, "max_active_downstream_connections: 50000");
}

fn listener(out: &mut Yaml, config: &Config, options: &EnvoyOptions) {
    out.line(2, "listeners:");
    out.line(2, "- name: llm");
    out.line(4, "address:");
    out.socket_address(6, options.listen);
    out.comment(
        4,
        &[
            "No per_connection_buffer_limit_bytes: Envoy's default (1 MiB) bounds each downstream connection's read",
            "and write buffers (flow control: Envoy stops reading there; it does not cap a body). Raising it to",
            "max_body_bytes would let every connection, whatever it sends, make Envoy buffer that much. The body",
            "limit is the route's request_body_buffer_limit below.",
        ],
    );
    out.line(4, "filter_chains:");
    out.line(4, "- filters:");
    out.line(6, "- name: envoy.filters.network.http_connection_manager");
    out.line(8, "typed_config:");
    out.line(
        10,
        "\"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    );
    out.comment(
        10,
        &["Filter stats appear under http.ingress_http.*, ext_proc's under http.ingress_http.ext_proc.*."],
    );
    out.line(10, "stat_prefix: ingress_http");
    out.line(10, "codec_type: AUTO");
    out.comment(
        10,
        &[
            "Receive-side deadlines, since the route below has none: a client that trickles its request (a slow",
            "upload, or one that stops sending) would otherwise hold a stream, its buffered body and a picker",
            "stream for as long as it likes. request_headers_timeout: the headers must arrive within this",
            "of their first byte. request_timeout: the whole request, body included, within this, else 408. Envoy",
            "disarms it once the router has the whole request (after cachepick's decision) or the response has",
            "begun, so it never cuts a generation or an SSE stream, however long. A client that cannot upload",
            "max_body_bytes in this time gets 408.",
        ],
    );
    out.line(
        10,
        &format!(
            "request_headers_timeout: {}",
            duration(REQUEST_HEADERS_TIMEOUT)
        ),
    );
    out.line(
        10,
        &format!("request_timeout: {}", duration(REQUEST_TIMEOUT)),
    );
    route_config(out, config, options);
    http_filters(out, options);
}

fn route_config(out: &mut Yaml, config: &Config, options: &EnvoyOptions) {
    let limit = config.max_body_bytes.get();
    out.line(10, "route_config:");
    out.line(12, "name: llm");
    out.line(12, "virtual_hosts:");
    out.line(12, "- name: llm");
    out.line(14, "domains: [\"*\"]");
    out.line(14, "routes:");
    out.line(14, "- match: {prefix: \"/\"}");
    match options.mode {
        BodyMode::Buffered | BodyMode::OriginalDst => out.comment(
            16,
            &[
                "cachepick's max_body_bytes: Envoy buffers the whole request body for cachepick up to this many bytes",
                "(it overrides the listener's 1 MiB for this route's requests), and answers 413 itself to an HTTP/1.1",
                "body above it, as cachepick would. It is also the retry buffer: a larger body (possible only while",
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
    out.line(18, &format!("cluster: {}", upstream_cluster(options.mode)));
    out.comment(
        18,
        &[
            "No deadline: a generation can run for minutes, and a non-streaming one sends nothing until it ends,",
            "so neither the 15 s route timeout nor the 5 min stream idle timeout may apply.",
        ],
    );
    out.line(18, "timeout: 0s");
    out.line(18, "idle_timeout: 0s");
    let retries = config.most_fallbacks();
    if options.mode != BodyMode::OriginalDst && retries > 0 {
        out.comment(
            18,
            &[
                &format!(
                    "cachepick lists the selected worker and up to {retries} fallbacks (max_fallbacks); override_host walks"
                ),
                "that list on retries. Only failures that happened before the worker saw the request are retried, so a",
                "generation never runs twice; previous_hosts keeps the least-request fallback off a failed worker.",
            ],
        );
        out.line(18, "retry_policy:");
        out.line(
            20,
            "retry_on: connect-failure,refused-stream,reset-before-request",
        );
        out.line(20, &format!("num_retries: {retries}"));
        out.line(20, "retry_host_predicate:");
        out.line(20, "- name: envoy.retry_host_predicates.previous_hosts");
        out.line(22, "typed_config:");
        out.line(
            24,
            "\"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
        );
        out.line(20, "host_selection_retry_max_attempts: 5");
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

fn http_filters(out: &mut Yaml, options: &EnvoyOptions) {
    out.line(10, "http_filters:");
    out.comment(
        10,
        &[
            &format!(
                "1. Drop the routing headers a client sent: {DESTINATION} and every {OWNED_PREFIX}* header"
            ),
            "(the prefix is cachepick's). cachepick overwrites its own when it answers, but with the picker down",
            "a client could otherwise pick its worker (or, with ORIGINAL_DST, any address at all), forge the",
            "per-decision stats, or pass a worker any header that looks like cachepick's.",
        ],
    );
    out.line(10, "- name: envoy.filters.http.header_mutation");
    out.line(12, "typed_config:");
    out.line(
        14,
        "\"@type\": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
    );
    out.line(14, "mutations:");
    out.line(16, "request_mutations:");
    out.line(16, &format!("- remove: {DESTINATION}"));
    out.line(
        16,
        &format!("- remove_on_match: {{key_matcher: {{prefix: \"{OWNED_PREFIX}\"}}}}"),
    );
    out.comment(
        10,
        &["2. cachepick: reads the request, picks the worker, sets the headers above. Must precede the router."],
    );
    out.line(10, &format!("- name: {EXT_PROC_FILTER}"));
    out.line(12, "typed_config:");
    ext_proc_config(out, 14, options.mode, options.message_timeout);
    out.line(10, "- name: envoy.filters.http.router");
    out.line(12, "typed_config:");
    out.line(
        14,
        "\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
    );
}

/// The ext_proc filter's `typed_config` body at `indent`, pointing at the `cachepick` cluster.
fn ext_proc_config(out: &mut Yaml, indent: usize, mode: BodyMode, message_timeout: Duration) {
    out.line(
        indent,
        "\"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
    );
    out.line(indent, "grpc_service:");
    out.line(indent + 2, "envoy_grpc: {cluster_name: cachepick}");
    match mode {
        BodyMode::Buffered => out.comment(
            indent,
            &[
                "Fail open: if cachepick is down, errs or times out, the request continues without the routing header",
                "and override_host falls back to least-request: cache affinity is lost for a while, service is not.",
                "With `false` every request would fail (500, or 504 on a timeout) until the picker is back.",
            ],
        ),
        BodyMode::Duplex => out.comment(
            indent,
            &[
                "Fail open: if cachepick is down or errs, the request continues without the routing header and",
                "override_host falls back to least-request. In FULL_DUPLEX_STREAMED Envoy can fail open only until",
                "the first body chunk has gone to cachepick: a request whose body is already on its way when the",
                "stream fails (a picker that just died, before the health check below notices) can get 500. Once the",
                "health check has marked the picker down, requests fail open at once.",
            ],
        ),
        BodyMode::OriginalDst => out.comment(
            indent,
            &[
                "Fail open, as the GIE chart does; but ORIGINAL_DST has no fallback, so a request the picker did not",
                "answer gets 503 \"no healthy upstream\" (with `false`: 500, or 504 on a timeout).",
            ],
        ),
    }
    out.line(indent, "failure_mode_allow: true");
    match mode {
        BodyMode::Duplex => out.comment(
            indent,
            &[
                "No message_timeout: Envoy applies none in FULL_DUPLEX_STREAMED. What bounds a request's time in",
                "cachepick instead: the HCM's request_timeout above (the whole request, decision included), and",
                "cachepick's own per-stream deadline of 60 s on a body that stops arriving; cachepick decides on its",
                "blocking thread pool, so a long tokenization does not stall other streams.",
            ],
        ),
        BodyMode::Buffered | BodyMode::OriginalDst => {
            out.comment(
                indent,
                &[
                    "Per message. Envoy's default, 200 ms, is less than tokenizing a prompt of a few MiB can take.",
                ],
            );
            out.line(
                indent,
                &format!("message_timeout: {}", duration(message_timeout)),
            );
        }
    }
    out.line(indent, "processing_mode:");
    out.comment(
        indent + 2,
        &[
            "Headers must be sent (not skipped): Envoy then holds them until cachepick has seen the body and answered,",
            "and only then picks the upstream host. Nothing of the response is needed, so it streams straight through.",
        ],
    );
    out.line(indent + 2, "request_header_mode: SEND");
    out.line(indent + 2, "response_header_mode: SKIP");
    match mode {
        BodyMode::Buffered | BodyMode::OriginalDst => {
            out.line(indent + 2, "request_body_mode: BUFFERED");
            out.line(indent + 2, "request_trailer_mode: SKIP");
        }
        BodyMode::Duplex => {
            out.comment(
                indent + 2,
                &[
                    "Envoy rejects FULL_DUPLEX_STREAMED unless request trailers are sent too. The upstream then gets the",
                    "body with transfer-encoding: chunked (Envoy drops content-length, since the body may change).",
                ],
            );
            out.line(indent + 2, "request_body_mode: FULL_DUPLEX_STREAMED");
            out.line(indent + 2, "request_trailer_mode: SEND");
        }
    }
    out.line(indent + 2, "response_body_mode: NONE");
    out.line(indent + 2, "response_trailer_mode: SKIP");
    out.comment(
        indent,
        &[&format!(
            "Envoy drops dynamic metadata in namespaces not listed here; cachepick writes {LB_NAMESPACE}/{DESTINATION}."
        )],
    );
    out.line(indent, "metadata_options:");
    out.line(indent + 2, "receiving_namespaces:");
    out.line(indent + 4, &format!("untyped: [{LB_NAMESPACE}]"));
}

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

fn workers_cluster(out: &mut Yaml, config: &Config) {
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
    out.line(4, "load_assignment:");
    out.line(6, "cluster_name: workers");
    out.line(6, "endpoints:");
    out.line(6, "- lb_endpoints:");
    for pool in &config.pools {
        for worker in pool.workers.iter().filter(|w| w.role.serves_prefill()) {
            out.line(8, "- endpoint:");
            out.line(12, "address:");
            out.socket_address(14, worker.endpoint);
        }
    }
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
    out.line(6, "policies:");
    out.line(6, "- typed_extension_config:");
    out.line(10, "name: envoy.load_balancing_policies.override_host");
    out.line(10, "typed_config:");
    out.line(
        12,
        "\"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
    );
    out.line(12, "override_host_sources:");
    out.line(12, &format!("- header: {DESTINATION}"));
    out.line(
        12,
        &format!("- metadata: {{key: {LB_NAMESPACE}, path: [{{key: {DESTINATION}}}]}}"),
    );
    out.line(12, "fallback_policy:");
    out.line(14, "policies:");
    out.line(14, "- typed_extension_config:");
    out.line(18, "name: envoy.load_balancing_policies.least_request");
    out.line(18, "typed_config:");
    out.line(
        20,
        "\"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    );
}

/// Names the decode-only workers, which are not upstream hosts, and says why.
fn decode_only_comment(out: &mut Yaml, config: &Config) {
    let decode_only: Vec<String> = config
        .pools
        .iter()
        .flat_map(|pool| &pool.workers)
        .filter(|worker| !worker.role.serves_prefill())
        .map(|worker| worker.endpoint.to_string())
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

fn original_dst_cluster(out: &mut Yaml, config: &Config) {
    let workers: Vec<String> = config
        .pools
        .iter()
        .flat_map(|pool| &pool.workers)
        .filter(|worker| worker.role.serves_prefill())
        .map(|worker| worker.endpoint.to_string())
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

fn picker_cluster(out: &mut Yaml, options: &EnvoyOptions) {
    out.line(2, "- name: cachepick");
    out.comment(4, &["cachepick's ext_proc server (its `listen`)."]);
    out.line(4, "type: STATIC");
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
    out.line(
        8,
        "\"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    );
    out.line(8, "explicit_http_config:");
    out.line(10, "http2_protocol_options:");
    out.line(12, "connection_keepalive: {interval: 30s, timeout: 5s}");
    out.line(4, "load_assignment:");
    out.line(6, "cluster_name: cachepick");
    out.line(6, "endpoints:");
    out.line(6, "- lb_endpoints:");
    out.line(8, "- endpoint:");
    out.line(12, "address:");
    out.socket_address(14, options.picker);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, Overrides};

    fn config(yaml: &str) -> Config {
        config::parse(yaml, "test.yaml", &Overrides::default()).expect("valid config")
    }

    const TWO: &str = "listen: 0.0.0.0:9002\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n      - {endpoint: \"127.0.0.1:8002\", role: decode}\n      - {endpoint: \"[::1]:8003\"}\n";

    #[test]
    fn modes_round_trip_through_their_names() {
        for mode in BodyMode::ALL {
            assert_eq!(mode.as_str().parse::<BodyMode>(), Ok(mode));
        }
        assert!("streamed".parse::<BodyMode>().is_err());
    }

    #[test]
    fn the_picker_is_dialled_on_loopback_when_cachepick_listens_everywhere() {
        let options = EnvoyOptions::for_config(&config(TWO));
        assert_eq!(options.picker, "127.0.0.1:9002".parse().expect("addr"));
        assert_eq!(
            picker_address("[::]:7".parse().expect("addr")),
            "[::1]:7".parse().expect("addr")
        );
        let specific: SocketAddr = "10.1.1.1:9002".parse().expect("addr");
        assert_eq!(picker_address(specific), specific);
    }

    #[test]
    fn only_prefill_capable_workers_are_upstream_hosts() {
        let yaml = render(&config(TWO), &EnvoyOptions::for_config(&config(TWO)));
        assert!(yaml.contains("socket_address: {address: \"127.0.0.1\", port_value: 8001}"));
        assert!(yaml.contains("socket_address: {address: \"::1\", port_value: 8003}"));
        assert!(!yaml.contains("port_value: 8002}"));
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
            "decode-only (cachepick never sends a request there, so the fallback must not): 127.0.0.1:8002."
        ));
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
        assert!(yaml.contains("num_retries: 2"));
    }

    #[test]
    fn cachepicks_headers_all_carry_the_prefix_envoy_strips() {
        for header in [
            DECISION_HEADER,
            SELECTED_HEADER,
            crate::protocol::PREFIX_TOKENS_HEADER,
            crate::protocol::REJECT_HEADER,
        ] {
            assert!(header.starts_with(OWNED_PREFIX), "{header}");
        }
        assert!(!DESTINATION.starts_with(OWNED_PREFIX));
    }

    #[test]
    fn durations_use_envoys_json_form() {
        assert_eq!(duration(Duration::from_secs(2)), "2s");
        assert_eq!(duration(Duration::from_millis(250)), "0.250s");
        assert_eq!(duration(Duration::from_millis(1500)), "1.500s");
    }
}

//! The optional access log (`envoy-config --access-log PATH`): one JSON object per request, written by
//! Envoy's file logger, joining Envoy's account of a request to cachepick's decision and to the log
//! lines of cachepick's `serve` (both carry `x-request-id`). Off unless asked: operators choose where
//! their access logs go.

use super::EnvoyOptions;
use super::yaml::{Yaml, one_line};

/// Each field and the Envoy command operator that fills it, in the order written.
pub const ACCESS_LOG_FIELDS: [(&str, &str); 15] = [
    ("start_time", "%START_TIME%"),
    ("request_id", "%REQ(X-REQUEST-ID)%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(:PATH)%"),
    ("status", "%RESPONSE_CODE%"),
    ("flags", "%RESPONSE_FLAGS%"),
    ("details", "%RESPONSE_CODE_DETAILS%"),
    ("decision", "%REQ(X-CACHEPICK-DECISION)%"),
    ("selected_host", "%REQ(X-CACHEPICK-ENDPOINT)%"),
    ("prefix_tokens", "%REQ(X-CACHEPICK-PREFIX-TOKENS)%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("attempts", "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
    ("duration_ms", "%DURATION%"),
    ("first_byte_ms", "%RESPONSE_DURATION%"),
    (
        "upstream_service_ms",
        "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    ),
];

/// The HTTP connection manager's `access_log`, when `options.access_log` names a file.
pub(super) fn access_log(out: &mut Yaml, options: &EnvoyOptions) {
    let Some(path) = &options.access_log else {
        return;
    };
    out.comment(
        10,
        &[
            "One JSON line per request (--access-log): x-request-id, which cachepick's decision log lines carry",
            "too; the decision, the worker cachepick selected and the prompt tokens it credited that worker",
            "with, as the request left Envoy; the worker that answered (upstream_host: another one after a",
            "retry) and how many tries; the status, Envoy's flags and details (UF, URX, ...); the whole",
            "request's time and the time to the response's first byte.",
        ],
    );
    out.line(10, "access_log:");
    out.line(10, "- name: envoy.access_loggers.file");
    out.line(12, "typed_config:");
    out.line(
        14,
        "\"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
    );
    out.line(
        14,
        &format!(
            "path: \"{}\"",
            one_line(&path.display().to_string()).replace('"', "\\\"")
        ),
    );
    out.line(14, "log_format:");
    out.line(16, "json_format:");
    for (field, operator) in ACCESS_LOG_FIELDS {
        out.line(18, &format!("{field}: \"{operator}\""));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{DECISION_HEADER, SELECTED_HEADER};

    #[test]
    fn the_log_reads_the_headers_cachepick_sets() {
        for header in [DECISION_HEADER, SELECTED_HEADER, "x-request-id"] {
            let operator = format!("%REQ({})%", header.to_ascii_uppercase());
            assert!(
                ACCESS_LOG_FIELDS.iter().any(|(_, used)| *used == operator),
                "{operator}"
            );
        }
    }
}

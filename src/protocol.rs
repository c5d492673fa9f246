//! The names cachepick speaks on the wire, in one place: the Endpoint Picker Protocol's header and
//! metadata keys, cachepick's own `x-cachepick-*` headers, the gRPC health service names, and the
//! `passthrough` decision label.
//!
//! `extproc` writes them, the Envoy bootstrap generator (`envoy_config`) configures Envoy to read them,
//! and the tests read them back; none of those owns them, so none defines them. No protobuf here: these
//! are plain strings.

/// The Endpoint Picker Protocol's destination header and metadata key: the selected worker, then its
/// fallbacks, `ip:port[,ip:port…]`; `override_host` and `ORIGINAL_DST` read it.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Dynamic metadata namespace Envoy's `override_host` and ORIGINAL_DST read the destination from.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace and key of the proxy's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Every request header with this prefix is cachepick's to set: a client's copies never reach a worker.
pub const OWNED_PREFIX: &str = "x-cachepick-";
/// The decision's reason (or [`PASSTHROUGH`]); Envoy's virtual clusters match on it.
pub const DECISION_HEADER: &str = "x-cachepick-decision";
/// The selected worker alone (no fallbacks): what an ORIGINAL_DST cluster, which reads one address,
/// connects to.
pub const SELECTED_HEADER: &str = "x-cachepick-endpoint";
/// Leading prompt tokens the selected worker is credited with holding.
pub const PREFIX_TOKENS_HEADER: &str = "x-cachepick-prefix-tokens";
/// The stable label of a refusal, on cachepick's own (immediate) answers.
pub const REJECT_HEADER: &str = "x-cachepick-reject-reason";

/// The [`DECISION_HEADER`] of a request without a prompt (a GET, or a POST to a non-generation API
/// such as `/v1/embeddings`): routed by load alone, not a decision of the ladder.
pub const PASSTHROUGH: &str = "passthrough";

/// gRPC health service names, as the Gateway API Inference Extension expects them.
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The JSON error body cachepick answers with: `{"error": {"message", "type"}}`, OpenAI's shape.
pub fn error_json(kind: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "error": { "message": message, "type": kind }
    }))
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cachepicks_headers_carry_the_prefix_envoy_strips() {
        for header in [
            DECISION_HEADER,
            SELECTED_HEADER,
            PREFIX_TOKENS_HEADER,
            REJECT_HEADER,
        ] {
            assert!(header.starts_with(OWNED_PREFIX), "{header}");
        }
        assert!(!DESTINATION.starts_with(OWNED_PREFIX));
    }
}

//! The names cachepick speaks on the wire, in one place: the Endpoint Picker Protocol's header and
//! metadata keys, cachepick's own `x-cachepick-*` headers, the gRPC health service names, and the
//! `passthrough` decision label, and the reasons (status and label) cachepick refuses a request with.
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

/// The gRPC metadata (the ext_proc filter's `initial_metadata`) by which a filter announces that it sends
/// the response phase: only such a stream waits for the report after its answer.
pub const FEEDBACK_METADATA: &str = "x-cachepick-feedback";
/// The ext_proc response attribute with the address of the upstream host that served a request
/// (`response_attributes`; cachepick's feedback reads it in the response phase).
pub const UPSTREAM_ADDRESS_ATTRIBUTE: &str = "upstream.address";
/// The ext_proc response attribute with the response's status (the `:status` header is read first).
pub const RESPONSE_CODE_ATTRIBUTE: &str = "response.code";

/// Every request header with this prefix is cachepick's to set: a client's copies never reach a worker.
pub const OWNED_PREFIX: &str = "x-cachepick-";
/// The decision's reason (or [`PASSTHROUGH`]); Envoy's virtual clusters match on it.
pub const DECISION_HEADER: &str = "x-cachepick-decision";
/// The selected worker alone (no fallbacks): what an ORIGINAL_DST cluster, which reads one address,
/// connects to.
pub const SELECTED_HEADER: &str = "x-cachepick-endpoint";
/// Leading prompt tokens the selected worker is credited with holding.
pub const PREFIX_TOKENS_HEADER: &str = "x-cachepick-prefix-tokens";
/// The prefill-time policies' predicted time to first token on the selected (prefill) worker, in
/// milliseconds with three decimals: its queue ahead plus the request's own uncached prefill, each
/// divided by the worker's learned rate. Absent where no prediction was made.
pub const PREDICTED_TTFT_HEADER: &str = "x-cachepick-predicted-ttft-ms";
/// A prefill/decode request's decode pressure: the decode worker's waiting and running requests by its
/// reading, plus those sent to it since.
pub const DECODE_PRESSURE_HEADER: &str = "x-cachepick-decode-pressure";
/// A prefill/decode request's prefill worker (`ip:port`), chosen by the ladder; the destination is
/// its decode worker.
pub const PREFILL_HEADER: &str = "x-cachepick-prefill-endpoint";
/// Why a prefill/decode request's decode worker was chosen (`decode_hit`, `decode_pressure`, ...).
pub const DECODE_DECISION_HEADER: &str = "x-cachepick-decode-decision";
/// llm-d's decode sidecar reads the prefill worker (`ip:port`) from this header (`pd.handshake:
/// sidecar`); a client's copy is always removed.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// What became of a prefill/decode request's prefill leg (`remote_prefill`, `local_prefill_failed`, ...).
pub const PD_HEADER: &str = "x-cachepick-pd";
/// The stable label of a refusal, on cachepick's own (immediate) answers.
pub const REFUSAL_HEADER: &str = "x-cachepick-refusal-reason";

/// The gRPC metadata key of a shed's reason ([`RefusalReason::SHED`]), on the error cachepick ends a stream
/// with when it gives a request up.
pub const SHED_METADATA: &str = "x-cachepick-shed-reason";

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

/// Why cachepick does not route a request by a decision of its own: the one vocabulary of every surface
/// (ext_proc, the admin API, the debug endpoints, the CLI), each reason with its HTTP status and its
/// stable label. Most are answers to the client: the label appears in [`REFUSAL_HEADER`], as the JSON
/// error's `type`, in the ImmediateResponse's details (`cachepick_<label>`) and in
/// `cachepick_refusals_total{reason}`. The rest fail open ([`RefusalReason::fails_open`]): the request
/// is given up (shed) with a gRPC error that Envoy's `failure_mode_allow: true` turns into routing by its
/// own load balancing, so it is still served; their labels are `cachepick_shed_total{reason}`'s and
/// [`SHED_METADATA`]'s. The labels are part of the public interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    // The body (`request::BodyError`).
    /// The body is larger than `max_body_bytes` (read whole, or streamed past it in duplex mode).
    TooLarge,
    NotUtf8,
    InvalidJson,
    TooDeep,
    WrongType,
    MissingField,
    EmptyPrompt,
    /// The request names no model and no pool is the default (`*`).
    MissingModel,
    /// No pool serves the model the request names.
    UnknownModel,
    // The request path.
    /// A generation API requested without a body.
    MissingBody,
    /// The chat template cannot render the request, or its tools are not JSON: the request's doing.
    Untokenizable,
    /// The tokenizer failed on the prompt: ours.
    TokenizerFailed,
    /// No routable worker in the pool (within the proxy's subset hint, if any).
    NoWorkers,
    // The wire (`extproc`).
    /// The rest of the request did not arrive within the per-message deadline.
    BodyTimeout,
    /// The ext_proc filter sends the body in a mode cachepick cannot decide on.
    UnsupportedBodyMode,
    /// cachepick failed to decide (a panic, a tokenizer failure): failed open.
    Internal,
    // Sheds: given up without a decision, failed open.
    /// The admission queue was full when the request completed.
    QueueFull,
    /// The decision could not be made (or finished) before the decision deadline.
    Deadline,
    /// Holding the request's body would take the buffered bytes of all streams over `max_buffered_bytes`.
    BodyBudget,
    /// The stream outlived `stream_deadline` before it could be answered.
    StreamDeadline,
    /// Envoy closed the stream while the decision waited or ran: nothing is answered or committed.
    Cancelled,
    // The operator surfaces.
    /// An explain call over `overload.explain_rate`, or with every explain slot busy.
    ExplainRefused,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 22] = [
        RefusalReason::TooLarge,
        RefusalReason::NotUtf8,
        RefusalReason::InvalidJson,
        RefusalReason::TooDeep,
        RefusalReason::WrongType,
        RefusalReason::MissingField,
        RefusalReason::EmptyPrompt,
        RefusalReason::MissingModel,
        RefusalReason::UnknownModel,
        RefusalReason::MissingBody,
        RefusalReason::Untokenizable,
        RefusalReason::TokenizerFailed,
        RefusalReason::NoWorkers,
        RefusalReason::BodyTimeout,
        RefusalReason::UnsupportedBodyMode,
        RefusalReason::Internal,
        RefusalReason::QueueFull,
        RefusalReason::Deadline,
        RefusalReason::BodyBudget,
        RefusalReason::StreamDeadline,
        RefusalReason::Cancelled,
        RefusalReason::ExplainRefused,
    ];

    /// The reasons a request is shed for: the labels of `cachepick_shed_total{reason}`.
    pub const SHED: [RefusalReason; 6] = [
        RefusalReason::QueueFull,
        RefusalReason::Deadline,
        RefusalReason::BodyBudget,
        RefusalReason::StreamDeadline,
        RefusalReason::Cancelled,
        RefusalReason::Internal,
    ];

    /// The HTTP status the client gets.
    pub fn status(self) -> u16 {
        match self {
            RefusalReason::NotUtf8
            | RefusalReason::InvalidJson
            | RefusalReason::TooDeep
            | RefusalReason::WrongType
            | RefusalReason::MissingField
            | RefusalReason::EmptyPrompt
            | RefusalReason::MissingModel
            | RefusalReason::MissingBody
            | RefusalReason::Untokenizable => 400,
            RefusalReason::UnknownModel => 404,
            RefusalReason::BodyTimeout => 408,
            RefusalReason::TooLarge => 413,
            RefusalReason::TokenizerFailed
            | RefusalReason::UnsupportedBodyMode
            | RefusalReason::Internal => 500,
            RefusalReason::ExplainRefused => 429,
            // Never sent to a client (they fail open); what an HTTP surface would say of them.
            RefusalReason::Cancelled => 499,
            RefusalReason::QueueFull | RefusalReason::BodyBudget => 503,
            RefusalReason::Deadline | RefusalReason::StreamDeadline => 504,
            RefusalReason::NoWorkers => 503,
        }
    }

    /// The stable snake_case label.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::TooLarge => "too_large",
            RefusalReason::NotUtf8 => "not_utf8",
            RefusalReason::InvalidJson => "invalid_json",
            RefusalReason::TooDeep => "too_deep",
            RefusalReason::WrongType => "wrong_type",
            RefusalReason::MissingField => "missing_field",
            RefusalReason::EmptyPrompt => "empty_prompt",
            RefusalReason::MissingModel => "missing_model",
            RefusalReason::UnknownModel => "unknown_model",
            RefusalReason::MissingBody => "missing_body",
            RefusalReason::Untokenizable => "untokenizable",
            RefusalReason::TokenizerFailed => "tokenizer_failed",
            RefusalReason::NoWorkers => "no_workers",
            RefusalReason::BodyTimeout => "body_timeout",
            RefusalReason::UnsupportedBodyMode => "unsupported_body_mode",
            RefusalReason::Internal => "internal",
            RefusalReason::ExplainRefused => "explain_refused",
            RefusalReason::QueueFull => "queue_full",
            RefusalReason::Deadline => "deadline",
            RefusalReason::BodyBudget => "body_budget",
            RefusalReason::StreamDeadline => "stream_deadline",
            RefusalReason::Cancelled => "cancelled",
        }
    }
}

impl RefusalReason {
    /// Whether this refusal is cachepick's own failure rather than an answer about the request: it is
    /// then not sent as a 5xx but as a gRPC error, so Envoy's `failure_mode_allow` routes the request
    /// by its own load balancing (fail open).
    pub fn fails_open(self) -> bool {
        matches!(
            self,
            RefusalReason::Internal | RefusalReason::TokenizerFailed
        ) || self.sheds()
    }

    /// Whether this reason gives the request up without a decision (shedding): the request is not
    /// answered by cachepick but routed by the proxy's own load balancing.
    pub fn sheds(self) -> bool {
        matches!(
            self,
            RefusalReason::QueueFull
                | RefusalReason::Deadline
                | RefusalReason::BodyBudget
                | RefusalReason::StreamDeadline
                | RefusalReason::Cancelled
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_labels_are_distinct_snake_case_and_serialize_as_themselves() {
        let labels: std::collections::BTreeSet<&str> = RefusalReason::ALL
            .iter()
            .map(|reason| reason.as_str())
            .collect();
        assert_eq!(labels.len(), RefusalReason::ALL.len());
        for reason in RefusalReason::ALL {
            let label = reason.as_str();
            assert!(
                label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{label}"
            );
            assert_eq!(
                serde_json::to_value(reason).ok(),
                Some(serde_json::Value::from(label))
            );
        }
    }

    #[test]
    fn the_shed_reasons_are_the_ones_that_fail_open_without_a_decision() {
        for reason in RefusalReason::ALL {
            let shed = RefusalReason::SHED.contains(&reason);
            assert_eq!(
                reason.sheds(),
                shed && reason != RefusalReason::Internal,
                "{reason:?}"
            );
            if shed {
                assert!(
                    reason.fails_open(),
                    "{reason:?} is given up, so it fails open"
                );
            }
        }
        assert!(RefusalReason::TokenizerFailed.fails_open());
        assert!(!RefusalReason::InvalidJson.fails_open());
        assert!(!RefusalReason::NoWorkers.fails_open());
    }

    #[test]
    fn cachepicks_headers_carry_the_prefix_envoy_strips() {
        for header in [
            DECISION_HEADER,
            SELECTED_HEADER,
            PREFIX_TOKENS_HEADER,
            REFUSAL_HEADER,
        ] {
            assert!(header.starts_with(OWNED_PREFIX), "{header}");
        }
        assert!(!DESTINATION.starts_with(OWNED_PREFIX));
    }
}

//! W3C trace context and the span of each request's decision.
//!
//! A request's ext_proc stream gets one span, `cachepick.decision` (target [`TRACE_TARGET`]), made when
//! its headers arrive: the child of the request's `traceparent` (the client's, or Envoy's when Envoy
//! traces), carrying its `x-request-id`, so every log line the decision writes names the request. The
//! span ends with the stream; the decision's own steps (`parse`, `tokenize`, `match`, `policy`,
//! `commit`) are its children, at debug level, in `route`. Once decided, it records the pool, reason,
//! worker, prefix and prompt tokens, the predicted time to first token and the decision's measured
//! time.
//!
//! With an OpenTelemetry layer installed (`tracing.otlp_endpoint`), the engine receives a `traceparent`
//! naming this span as its parent, so one trace runs client → Envoy → cachepick → engine. Without one,
//! no span has an OpenTelemetry context and the header reaches the engine as it came.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::route::{Answer, TRACE_TARGET};

/// The W3C trace context header.
pub(super) const TRACEPARENT: &str = "traceparent";

/// The span of one request, child of `traceparent` when it is a valid W3C trace context.
pub(super) fn request_span(request_id: Option<&str>, traceparent: Option<&[u8]>) -> Span {
    let span = tracing::info_span!(
        target: TRACE_TARGET,
        "cachepick.decision",
        otel.kind = "server",
        request_id = Empty,
        pool = Empty,
        reason = Empty,
        worker = Empty,
        prefix_tokens = Empty,
        prompt_tokens = Empty,
        predicted_ttft_ms = Empty,
        decision_us = Empty,
    );
    if let Some(id) = request_id {
        span.record("request_id", tracing::field::display(id));
    }
    if let Some(parent) = traceparent.and_then(parse_traceparent) {
        // Fails only without an OpenTelemetry layer, when there is no trace to join.
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
    }
    span
}

/// Records what was decided, and how long it took, on the request's span.
pub(super) fn record(span: &Span, answer: &Answer, decision_us: u64) {
    span.record("decision_us", decision_us);
    match answer {
        Answer::Route(routed) => {
            span.record("pool", tracing::field::display(&routed.pool));
            span.record("reason", routed.label());
            if let Some(worker) = routed.endpoints.first() {
                span.record("worker", tracing::field::display(worker));
            }
            span.record("prefix_tokens", routed.matched_tokens);
            span.record("prompt_tokens", routed.prompt_tokens);
            if let Some(us) = routed.predicted_ttft_us {
                span.record("predicted_ttft_ms", us as f64 / 1000.0);
            }
        }
        Answer::Refuse(refusal) => {
            if let Some(pool) = &refusal.pool {
                span.record("pool", pool.as_str());
            }
            span.record("reason", refusal.reason.as_str());
        }
        Answer::Shed(reason) => {
            span.record("reason", reason.as_str());
        }
    }
}

/// The `traceparent` the engine gets: this span as the parent, in the span's trace; `None` when the
/// span has no OpenTelemetry context (tracing off), which leaves the request's header as it came.
pub(super) fn traceparent_of(span: &Span) -> Option<String> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            span_context.trace_id(),
            span_context.span_id(),
            span_context.trace_flags().to_u8()
        )
    })
}

/// A `traceparent` value: `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all zero.
/// A later version is read by its first four fields, as the W3C recommendation says; version `ff` and
/// anything malformed are ignored (the request then starts a trace of its own).
fn parse_traceparent(value: &[u8]) -> Option<SpanContext> {
    let text = std::str::from_utf8(value).ok()?.trim();
    let mut fields = text.split('-');
    let (version, trace, parent, flags) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let hex = |field: &str, len: usize| {
        field.len() == len
            && field
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !hex(version, 2) || version == "ff" || (version == "00" && fields.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(parent, 16) || !hex(flags, 2) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(parent).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & TraceFlags::SAMPLED.to_u8());
    Some(SpanContext::new(
        trace_id,
        span_id,
        flags,
        true,
        TraceState::default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_is_read_and_anything_else_is_not() {
        let context = parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the W3C example");
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled() && context.is_remote());
        // A later version with more fields is read by its first four.
        assert!(
            parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra")
                .is_some_and(|context| !context.is_sampled())
        );
        for bad in [
            &b""[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"\xff\xfe",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn without_an_opentelemetry_layer_nothing_is_injected() {
        let span = request_span(
            Some("req-1"),
            Some(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        assert_eq!(traceparent_of(&span), None);
    }
}

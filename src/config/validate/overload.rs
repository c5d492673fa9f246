//! The `overload:` section: admission, deadlines, stream and memory bounds, the shutdown grace.
//!
//! Each value is checked on its own, then against the others: the decision deadline must end before
//! Envoy's `message_timeout` (else answers arrive after Envoy gave up and routed elsewhere), a stream
//! must be allowed at least one message's time, and the global body budget must hold at least one body
//! of `max_body_bytes` (else every large request is shed). Every problem is reported at once.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use super::Validator;
use crate::config::{OverloadConfig, Overrides};
use cachepick_decode::duration;
use cachepick_decode::{Decode, Map, Origin, Phase, Res, Val, blame, overridden, with_default};

pub(super) const OVERLOAD_KEYS: &[&str] = &[
    "message_timeout",
    "decision_deadline",
    "max_queued_decisions",
    "max_buffered_bytes",
    "max_concurrent_streams",
    "max_connections",
    "idle_timeout",
    "first_stream_timeout",
    "stream_deadline",
    "explain_rate",
    "shutdown_grace",
];

impl Validator<'_> {
    /// `overload:` (all defaults when absent); `max_body_bytes` is the top level's, which one body may
    /// reach.
    ///
    /// Over 100 lines: each key of `overload:` read once, then the pairs checked against each
    /// other, which needs every key's result at hand.
    pub(super) fn overload(
        &mut self,
        root: &Map,
        overrides: &Overrides,
        max_body_bytes: &Res<Val<NonZeroUsize>>,
    ) -> Res<OverloadConfig> {
        let map = self.section(root, "overload", OVERLOAD_KEYS)?;
        let defaults = OverloadConfig::default();
        let message_timeout =
            self.positive_duration(&map, "message_timeout", defaults.message_timeout);
        let deadline = self.opt(&map, "decision_deadline", Self::duration);
        let deadline = self.check_opt(deadline, positive);
        let queued = self.positive_count(
            &map,
            "max_queued_decisions",
            OverloadConfig::DEFAULT_MAX_QUEUED_DECISIONS,
        );
        // Unset, the budget is at least one body of max_body_bytes, so raising that alone stays valid.
        let buffered = self
            .positive_size(
                &map,
                "max_buffered_bytes",
                OverloadConfig::DEFAULT_MAX_BUFFERED_BYTES,
            )
            .map(|mut budget| {
                if let (Origin::Default, Ok(body)) = (&budget.at, max_body_bytes) {
                    budget.value = budget.value.max(body.value);
                }
                budget
            });
        let streams = self.opt(&map, "max_concurrent_streams", Self::integer);
        let streams = self.check(
            with_default(
                streams,
                u64::from(OverloadConfig::DEFAULT_MAX_CONCURRENT_STREAMS),
            ),
            |count| {
                u32::try_from(count)
                    .ok()
                    .and_then(NonZeroU32::new)
                    .ok_or_else(|| "must be between 1 and 4294967295".to_owned())
            },
        );
        let connections = self.positive_count(
            &map,
            "max_connections",
            OverloadConfig::DEFAULT_MAX_CONNECTIONS,
        );
        let idle = self.positive_duration(&map, "idle_timeout", defaults.idle_timeout);
        // Unset, the first stream's wait is at most the idle timeout, so shortening that alone stays
        // valid.
        let first_stream = self
            .positive_duration(&map, "first_stream_timeout", defaults.first_stream_timeout)
            .map(|mut first| {
                if let (Origin::Default, Ok(idle)) = (&first.at, &idle) {
                    first.value = first.value.min(idle.value);
                }
                first
            });
        // Unset, a stream may last at least one message_timeout, so raising that alone stays valid.
        let stream_deadline = self
            .positive_duration(&map, "stream_deadline", defaults.stream_deadline)
            .map(|mut stream| {
                if let (Origin::Default, Ok(timeout)) = (&stream.at, &message_timeout) {
                    stream.value = stream.value.max(timeout.value);
                }
                stream
            });
        let rate = self.opt(&map, "explain_rate", Self::integer);
        let rate = self.check(
            with_default(rate, u64::from(OverloadConfig::DEFAULT_EXPLAIN_RATE)),
            |rate| {
                u32::try_from(rate)
                    .ok()
                    .and_then(NonZeroU32::new)
                    .ok_or_else(|| "must be at least 1 (requests per second)".to_owned())
            },
        );
        // 0 is allowed: stop without a drain (a picker no proxy health-checks).
        let grace = self.opt(&map, "shutdown_grace", Self::duration);
        let grace = with_default(
            overridden(grace, overrides.shutdown_grace, "--shutdown-grace"),
            defaults.shutdown_grace,
        );

        let deadline = match (&message_timeout, deadline) {
            (Ok(timeout), Ok(Some(deadline))) if deadline.value >= timeout.value => {
                let message = format!(
                    "decision_deadline ({}) must be shorter than message_timeout ({}): an answer after \
                     Envoy stops waiting is routed elsewhere and its commit credits the wrong worker",
                    duration::format(deadline.value),
                    duration::format(timeout.value),
                );
                Err(self.report(Phase::Cross, blame(&deadline, timeout), message))
            }
            (_, Ok(Some(deadline))) => Ok(deadline.value),
            (Ok(timeout), Ok(None)) => Ok(OverloadConfig::derived_deadline(timeout.value)),
            (Err(reported), Ok(None)) => Err(*reported),
            (_, Err(reported)) => Err(reported),
        };
        let stream_fits = match (&message_timeout, &stream_deadline) {
            (Ok(timeout), Ok(stream)) if stream.value < timeout.value => {
                let message = format!(
                    "stream_deadline ({}) must be at least message_timeout ({}): a stream would be cut \
                     while Envoy still waits for its answer",
                    duration::format(stream.value),
                    duration::format(timeout.value),
                );
                Err(self.report(Phase::Cross, blame(stream, timeout), message))
            }
            _ => Ok(()),
        };
        let budget_fits = match (&buffered, max_body_bytes) {
            (Ok(budget), Ok(body)) if budget.value < body.value => {
                let message = format!(
                    "max_buffered_bytes ({}) must be at least max_body_bytes ({}): a body the picker \
                     accepts could never be held",
                    budget.value, body.value,
                );
                Err(self.report(Phase::Cross, blame(budget, body), message))
            }
            _ => Ok(()),
        };
        let first_fits = match (&first_stream, &idle) {
            (Ok(first), Ok(idle)) if first.value > idle.value => {
                let message = format!(
                    "first_stream_timeout ({}) must be at most idle_timeout ({}): a connection that \
                     never opened a stream is idle from its start",
                    duration::format(first.value),
                    duration::format(idle.value),
                );
                Err(self.report(Phase::Cross, blame(first, idle), message))
            }
            _ => Ok(()),
        };
        stream_fits?;
        budget_fits?;
        first_fits?;
        Ok(OverloadConfig {
            message_timeout: message_timeout?.value,
            decision_deadline: deadline?,
            max_queued_decisions: queued?,
            max_buffered_bytes: buffered?.value,
            max_concurrent_streams: streams?.value,
            max_connections: connections?,
            idle_timeout: idle?.value,
            first_stream_timeout: first_stream?.value,
            stream_deadline: stream_deadline?.value,
            explain_rate: rate?.value,
            shutdown_grace: grace?.value,
        })
    }
}

fn positive(duration: Duration) -> Result<Duration, String> {
    if duration.is_zero() {
        Err("must be greater than 0".to_owned())
    } else {
        Ok(duration)
    }
}

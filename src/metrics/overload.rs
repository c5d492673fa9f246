//! `cachepick_shed_total`, the admission gauges and the answer-time histogram: what overload costs.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use crate::connections::CloseReason;
use crate::protocol::RefusalReason;

/// Buckets of `cachepick_answer_seconds`: fine around the deadlines operators set (100 ms to a few
/// seconds), so a p99 can be read against the configured `decision_deadline`.
const ANSWER_BUCKETS: [f64; 24] = [
    0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.6, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 3.0, 5.0,
];

/// Buckets of `cachepick_decision_overrun_seconds`: how long past its deadline a slot stayed busy.
const OVERRUN_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Why a commit was not made although a decision was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusedCommit {
    /// The decision finished after its deadline.
    Deadline,
    /// The stream closed while the decision ran.
    Cancelled,
}

impl RefusedCommit {
    pub const ALL: [RefusedCommit; 2] = [RefusedCommit::Deadline, RefusedCommit::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusedCommit::Deadline => "deadline",
            RefusedCommit::Cancelled => "cancelled",
        }
    }
}

/// The overload metrics, registered once with the rest.
#[derive(Clone, Debug)]
pub struct OverloadMetrics {
    /// `cachepick_shed_total{reason}`.
    pub shed: IntCounterVec,
    /// `cachepick_commits_refused_total{reason}`.
    pub commits_refused: IntCounterVec,
    /// `cachepick_decisions_queued`.
    pub queued: IntGauge,
    /// `cachepick_decisions_in_flight`.
    pub in_flight: IntGauge,
    /// `cachepick_buffered_body_bytes`.
    pub buffered_bytes: IntGauge,
    /// `cachepick_grpc_connections`.
    pub connections: IntGauge,
    /// `cachepick_grpc_connections_closed_total{reason}`.
    pub connections_closed: IntCounterVec,
    /// `cachepick_explain_refused_total{reason}`.
    pub explain_refused: IntCounterVec,
    /// `cachepick_answer_seconds{outcome}`.
    pub answer_seconds: HistogramVec,
    /// `cachepick_decision_overrun_seconds`.
    pub overrun_seconds: Histogram,
    /// `cachepick_tokenize_interrupted_total`.
    pub tokenize_interrupted: IntCounter,
    /// `cachepick_tokenize_over_budget_total`.
    pub tokenize_over_budget: IntCounter,
}

impl OverloadMetrics {
    /// Over 100 lines because each family is declared once here with its help text and its labels
    /// pre-set to zero.
    pub(super) fn new() -> Result<Self, prometheus::Error> {
        let shed = IntCounterVec::new(
            Opts::new(
                "cachepick_shed_total",
                "Requests cachepick gave up without a decision, answered with a gRPC error so Envoy's \
                 failure_mode_allow routes them by its own load balancing, by reason: queue_full, \
                 deadline, body_budget, stream_deadline, cancelled (the proxy closed the stream first), \
                 internal (a failure inside the decision).",
            ),
            &["reason"],
        )?;
        for reason in RefusalReason::SHED {
            shed.with_label_values(&[reason.as_str()]);
        }
        let commits_refused = IntCounterVec::new(
            Opts::new(
                "cachepick_commits_refused_total",
                "Decisions made but not committed to the owner index and dispatch counts, because they \
                 finished after their deadline or after the proxy closed the stream; such requests are \
                 shed, never routed late.",
            ),
            &["reason"],
        )?;
        for reason in RefusedCommit::ALL {
            commits_refused.with_label_values(&[reason.as_str()]);
        }
        let explain_refused = IntCounterVec::new(
            Opts::new(
                "cachepick_explain_refused_total",
                "Explain calls (/debug/explain, admin Explain) refused before any work: rate (over \
                 overload.explain_rate), busy (its admission share was taken).",
            ),
            &["reason"],
        )?;
        for reason in ["rate", "busy"] {
            explain_refused.with_label_values(&[reason]);
        }
        let connections_closed = IntCounterVec::new(
            Opts::new(
                "cachepick_grpc_connections_closed_total",
                "gRPC connections cachepick closed (HTTP/2 GOAWAY) because they held no stream, by \
                 reason: idle (none for overload.idle_timeout), first_stream (none within \
                 overload.first_stream_timeout of the connection), evicted (at \
                 overload.max_connections, to make room for a new connection: it was idle longest).",
            ),
            &["reason"],
        )?;
        for reason in CloseReason::ALL {
            connections_closed.with_label_values(&[reason.as_str()]);
        }
        Ok(OverloadMetrics {
            shed,
            commits_refused,
            queued: IntGauge::new(
                "cachepick_decisions_queued",
                "Complete requests waiting for a decision slot (bounded by overload.max_queued_decisions).",
            )?,
            in_flight: IntGauge::new(
                "cachepick_decisions_in_flight",
                "Decisions running on the blocking pool now.",
            )?,
            buffered_bytes: IntGauge::new(
                "cachepick_buffered_body_bytes",
                "Request body bytes held by all ext_proc streams, with the tokenizing charges of running \
                 decisions (bounded by overload.max_buffered_bytes).",
            )?,
            connections: IntGauge::new(
                "cachepick_grpc_connections",
                "Connections open on the gRPC listener: at most overload.max_connections, plus those \
                 being closed to make room for a new one (at most as many again, each for about a \
                 round trip).",
            )?,
            connections_closed,
            explain_refused,
            answer_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "cachepick_answer_seconds",
                    "Time from the request's last message to cachepick's answer, by outcome: routed, \
                     refused (an immediate response) or shed (a gRPC error). Its buckets are fine around \
                     decision deadlines; cachepick_decision_seconds has the fine low end.",
                )
                .buckets(ANSWER_BUCKETS.to_vec()),
                &["outcome"],
            )?,
            overrun_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "cachepick_decision_overrun_seconds",
                    "How long past its deadline a decision slot stayed busy, observed for each slot \
                     released after its decision's deadline (tokenizing stops at the deadline, so this \
                     stays within one bounded chunk of work).",
                )
                .buckets(OVERRUN_BUCKETS.to_vec()),
            )?,
            tokenize_interrupted: IntCounter::new(
                "cachepick_tokenize_interrupted_total",
                "Decisions whose tokenizing stopped part-way because their deadline passed or their \
                 stream closed; the request is shed, its slot freed.",
            )?,
            tokenize_over_budget: IntCounter::new(
                "cachepick_tokenize_over_budget_total",
                "Prompts not tokenized because the memory tokenizing them would take did not fit in \
                 overload.max_buffered_bytes beside the buffered bodies; each is routed by load, as a miss.",
            )?,
        })
    }

    pub(super) fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.shed.clone()))?;
        registry.register(Box::new(self.commits_refused.clone()))?;
        registry.register(Box::new(self.queued.clone()))?;
        registry.register(Box::new(self.in_flight.clone()))?;
        registry.register(Box::new(self.buffered_bytes.clone()))?;
        registry.register(Box::new(self.connections.clone()))?;
        registry.register(Box::new(self.connections_closed.clone()))?;
        registry.register(Box::new(self.explain_refused.clone()))?;
        registry.register(Box::new(self.answer_seconds.clone()))?;
        registry.register(Box::new(self.overrun_seconds.clone()))?;
        registry.register(Box::new(self.tokenize_interrupted.clone()))?;
        registry.register(Box::new(self.tokenize_over_budget.clone()))?;
        Ok(())
    }

    /// One request shed for `reason`.
    pub fn shed(&self, reason: RefusalReason) {
        self.shed.with_label_values(&[reason.as_str()]).inc();
    }

    pub fn commit_refused(&self, reason: RefusedCommit) {
        self.commits_refused
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// An answer `outcome` (`routed`, `refused`, `shed`) sent `seconds` after it was owed.
    pub fn observe_answer(&self, outcome: &str, seconds: f64) {
        if !seconds.is_nan() {
            self.answer_seconds
                .with_label_values(&[outcome])
                .observe(seconds.max(0.0));
        }
    }

    /// A gRPC connection closed by cachepick for `reason`.
    pub fn connection_closed(&self, reason: CloseReason) {
        self.connections_closed
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// The current count of `cachepick_shed_total{reason}`.
    pub fn shed_count(&self, reason: RefusalReason) -> u64 {
        self.shed.with_label_values(&[reason.as_str()]).get()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn answer_buckets_ascend() {
        let buckets = super::ANSWER_BUCKETS;
        assert!(
            buckets
                .iter()
                .zip(buckets.iter().skip(1))
                .all(|(a, b)| a < b)
        );
    }
}

//! `overload:`: how much work the picker takes on, how long a decision may take, and how it stops.
//!
//! Every bound here exists so that too much work turns into shedding (a gRPC error, which Envoy's
//! `failure_mode_allow` turns into routing by its own load balancing) instead of into unbounded queues,
//! memory or late answers. The defaults follow from Envoy's side: the generated ext_proc filter's
//! `message_timeout` is this section's, so the decision deadline always ends before Envoy gives up.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

/// The validated `overload:` section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverloadConfig {
    /// Envoy's per-message ext_proc timeout; `cachepick envoy-config` writes this value.
    pub message_timeout: Duration,
    /// From the moment a decision is owed (the request's last message arrived) to its answer, queueing
    /// included; shorter than `message_timeout`, so the answer reaches Envoy before Envoy stops waiting.
    pub decision_deadline: Duration,
    /// Complete requests waiting for a decision slot; one more is shed (`queue_full`).
    pub max_queued_decisions: NonZeroUsize,
    /// Request body bytes held by all streams together (buffered bodies waiting for a decision, duplex
    /// chunks being collected); a stream that would go over is shed (`body_budget`).
    pub max_buffered_bytes: NonZeroUsize,
    /// HTTP/2 streams per connection (the SETTINGS Envoy obeys).
    pub max_concurrent_streams: NonZeroU32,
    /// gRPC connections held open at once; at the cap a newcomer takes the place of the connection
    /// that has held no stream for longest, and waits only while every connection holds one.
    pub max_connections: NonZeroUsize,
    /// A gRPC connection that has held no stream this long is closed (GOAWAY).
    pub idle_timeout: Duration,
    /// A gRPC connection that opens no stream this long after it was accepted is closed.
    pub first_stream_timeout: Duration,
    /// The longest an ext_proc stream may take from its first message to its answer.
    pub stream_deadline: Duration,
    /// `/debug/explain` and the admin `Explain` together, per second (and the burst allowed).
    pub explain_rate: NonZeroU32,
    /// After SIGTERM/SIGINT: readiness is withdrawn at once, requests are answered for this long (so
    /// Envoy's health check moves traffic to other replicas), then the process stops. 0 stops at once.
    pub shutdown_grace: Duration,
}

impl OverloadConfig {
    /// Envoy's own default (200 ms) is shorter than tokenizing a prompt of a few MiB takes.
    pub const DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);
    /// A backstop, not the working limit: what the slots cannot clear within the deadline is shed as
    /// `deadline` on arrival, and the queued bodies count against `max_buffered_bytes`. 1024 absorbs a
    /// burst of a few hundred ordinary requests arriving at once (about 1 ms of decision each), which a
    /// cap near the slot count would shed although every one of them would have made its deadline.
    pub const DEFAULT_MAX_QUEUED_DECISIONS: usize = 1024;
    /// 32 bodies at the default `max_body_bytes` (8 MiB): a few hundred ordinary prompts in flight, and
    /// a ceiling a pod's memory limit can be sized from.
    pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 256 << 20;
    /// Envoy opens one connection per worker thread and one stream per in-flight request: 1024 streams
    /// per connection is more than a worker thread's concurrent requests need, and bounded.
    pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 1024;
    /// Envoys (one connection per worker thread each), health checkers and operators: 256 is many
    /// gateways, and far below the file-descriptor limit.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
    /// Envoy's ext_proc and health-check connections carry a stream every request or every second; a
    /// minute without one is a connection nobody uses, and Envoy reconnects in one round trip.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// Envoy, `grpc_health_probe` and the kubelet open their stream right after the HTTP/2 preface; the
    /// same 10 s a TLS handshake is given.
    pub const DEFAULT_FIRST_STREAM_TIMEOUT: Duration = Duration::from_secs(10);
    /// A stream is headers, a body, and an answer: 30 s covers an 8 MiB body at 300 KB/s.
    pub const DEFAULT_STREAM_DEADLINE: Duration = Duration::from_secs(30);
    /// Explain is for people and probes, not traffic.
    pub const DEFAULT_EXPLAIN_RATE: u32 = 5;
    /// Envoy's generated health check asks every 1 s and needs 2 failures: 5 s moves its traffic
    /// with room to spare, well inside Kubernetes' default 30 s termination grace.
    pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

    /// The decision deadline derived from `message_timeout`: a quarter of it, at most 250 ms, is kept
    /// for the answer to travel and for the time Envoy's timer ran before cachepick read the message.
    pub fn derived_deadline(message_timeout: Duration) -> Duration {
        let margin = (message_timeout / 4).min(Duration::from_millis(250));
        message_timeout.saturating_sub(margin)
    }
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            message_timeout: Self::DEFAULT_MESSAGE_TIMEOUT,
            decision_deadline: Self::derived_deadline(Self::DEFAULT_MESSAGE_TIMEOUT),
            max_queued_decisions: NonZeroUsize::new(Self::DEFAULT_MAX_QUEUED_DECISIONS)
                .unwrap_or(NonZeroUsize::MIN),
            max_buffered_bytes: NonZeroUsize::new(Self::DEFAULT_MAX_BUFFERED_BYTES)
                .unwrap_or(NonZeroUsize::MIN),
            max_concurrent_streams: NonZeroU32::new(Self::DEFAULT_MAX_CONCURRENT_STREAMS)
                .unwrap_or(NonZeroU32::MIN),
            max_connections: NonZeroUsize::new(Self::DEFAULT_MAX_CONNECTIONS)
                .unwrap_or(NonZeroUsize::MIN),
            idle_timeout: Self::DEFAULT_IDLE_TIMEOUT,
            first_stream_timeout: Self::DEFAULT_FIRST_STREAM_TIMEOUT,
            stream_deadline: Self::DEFAULT_STREAM_DEADLINE,
            explain_rate: NonZeroU32::new(Self::DEFAULT_EXPLAIN_RATE).unwrap_or(NonZeroU32::MIN),
            shutdown_grace: Self::DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

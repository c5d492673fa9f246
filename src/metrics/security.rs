//! `cachepick_metrics_http_*`, `cachepick_debug_unauthorized_total` and `cachepick_tls_*`: the bounds of
//! the HTTP listener, refused debug calls, and the ext_proc listener's TLS.

use prometheus::core::Collector;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Why the HTTP listener on `metrics_listen` closed a connection it did not serve to the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpRefusal {
    /// `metrics_http.max_connections` were open, each with a request in progress: accepted and closed
    /// at once.
    ConnectionCap,
    /// A newcomer at the cap took its place: of the connections waiting for a request's headers, it had
    /// waited longest.
    Evicted,
    /// The request headers did not arrive within `metrics_http.header_read_timeout` (also an idle
    /// keep-alive connection).
    HeaderTimeout,
    /// The body did not arrive, or the answer was not ready, within `metrics_http.request_timeout`.
    RequestTimeout,
    /// The connection reached `metrics_http.connection_lifetime`.
    Lifetime,
}

impl HttpRefusal {
    pub const ALL: [HttpRefusal; 5] = [
        HttpRefusal::ConnectionCap,
        HttpRefusal::Evicted,
        HttpRefusal::HeaderTimeout,
        HttpRefusal::RequestTimeout,
        HttpRefusal::Lifetime,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HttpRefusal::ConnectionCap => "connection_cap",
            HttpRefusal::Evicted => "evicted",
            HttpRefusal::HeaderTimeout => "header_timeout",
            HttpRefusal::RequestTimeout => "request_timeout",
            HttpRefusal::Lifetime => "lifetime",
        }
    }
}

/// The listener a refused debug call came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugListener {
    /// `/debug/*` on `metrics_listen`.
    Http,
    /// The admin gRPC API and reflection on `listen`.
    Grpc,
}

impl DebugListener {
    fn as_str(self) -> &'static str {
        match self {
            DebugListener::Http => "http",
            DebugListener::Grpc => "grpc",
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct SecurityMetrics {
    http_connections: IntGauge,
    http_refused: IntCounterVec,
    debug_unauthorized: IntCounterVec,
    tls_handshake_failures: IntCounter,
    tls_reloads: IntCounterVec,
}

impl SecurityMetrics {
    pub(super) fn new() -> prometheus::Result<Self> {
        let metrics = SecurityMetrics {
            http_connections: IntGauge::new(
                "cachepick_metrics_http_connections",
                "Connections open now on the HTTP listener (metrics_listen), at most metrics_http.max_connections.",
            )?,
            http_refused: IntCounterVec::new(
                Opts::new(
                    "cachepick_metrics_http_refused_total",
                    "Connections the HTTP listener (metrics_listen) closed without serving them to the end: \
                     connection_cap (accepted and closed at once: every connection had a request in \
                     progress), evicted (closed at the cap to make room: it had waited longest for a \
                     request's headers), header_timeout (headers too slow, or idle keep-alive), \
                     request_timeout (body or answer too slow), lifetime.",
                ),
                &["reason"],
            )?,
            debug_unauthorized: IntCounterVec::new(
                Opts::new(
                    "cachepick_debug_unauthorized_total",
                    "Debug calls refused for a missing or wrong bearer token (debug_token_file), by \
                     listener: http (/debug/* on metrics_listen) or grpc (the admin API on listen).",
                ),
                &["listener"],
            )?,
            tls_handshake_failures: IntCounter::new(
                "cachepick_tls_handshake_failures_total",
                "Connections to listen that failed or timed out in the TLS handshake (a plain-text client, \
                 a client without an accepted certificate under mTLS, one naming none of \
                 tls.allowed_client_identities, a wrong CA), or were closed at once \
                 because 128 handshakes were already in progress.",
            )?,
            tls_reloads: IntCounterVec::new(
                Opts::new(
                    "cachepick_tls_reloads_total",
                    "Re-reads of listen's TLS files that found them changed: ok (new connections get the new \
                     certificate) or error (unusable; the previous certificate stays).",
                ),
                &["outcome"],
            )?,
        };
        for refusal in HttpRefusal::ALL {
            metrics.http_refused.with_label_values(&[refusal.as_str()]);
        }
        Ok(metrics)
    }

    pub(super) fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        let collectors: [Box<dyn Collector>; 5] = [
            Box::new(self.http_connections.clone()),
            Box::new(self.http_refused.clone()),
            Box::new(self.debug_unauthorized.clone()),
            Box::new(self.tls_handshake_failures.clone()),
            Box::new(self.tls_reloads.clone()),
        ];
        for collector in collectors {
            registry.register(collector)?;
        }
        Ok(())
    }
}

impl super::Metrics {
    /// The gauge of open connections on the HTTP listener.
    pub fn http_connections(&self) -> &IntGauge {
        &self.security.http_connections
    }

    pub fn http_refused(&self, reason: HttpRefusal) {
        self.security
            .http_refused
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    pub fn debug_unauthorized(&self, listener: DebugListener) {
        self.security
            .debug_unauthorized
            .with_label_values(&[listener.as_str()])
            .inc();
    }

    pub fn tls_handshake_failed(&self) {
        self.security.tls_handshake_failures.inc();
    }

    pub fn tls_reloaded(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.security
            .tls_reloads
            .with_label_values(&[outcome])
            .inc();
    }
}

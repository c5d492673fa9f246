//! `tracing:`: OpenTelemetry spans of every decision, exported over OTLP/gRPC; off unless an endpoint
//! is given.

/// The validated `tracing:` section.
#[derive(Clone, Debug, PartialEq)]
pub struct TracingConfig {
    /// The OTLP/gRPC collector, `http://host:port` or `https://host:port`; `None` exports nothing and
    /// leaves a request's `traceparent` as the client sent it.
    pub otlp_endpoint: Option<String>,
    /// The share of requests without a sampled parent that are traced (OpenTelemetry's
    /// `parentbased_traceidratio`): a request whose `traceparent` is sampled is always traced, one
    /// whose parent is not sampled never is.
    pub sample_ratio: f64,
    /// `service.name` of the exported spans.
    pub service_name: String,
}

impl TracingConfig {
    pub const DEFAULT_SAMPLE_RATIO: f64 = 1.0;
    pub const DEFAULT_SERVICE_NAME: &str = "cachepick";

    /// Whether spans are exported at all.
    pub fn enabled(&self) -> bool {
        self.otlp_endpoint.is_some()
    }
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            sample_ratio: Self::DEFAULT_SAMPLE_RATIO,
            service_name: Self::DEFAULT_SERVICE_NAME.to_owned(),
        }
    }
}

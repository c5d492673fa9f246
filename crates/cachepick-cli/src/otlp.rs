//! `tracing.otlp_endpoint`: the OpenTelemetry SDK behind the decision spans, exporting them over
//! OTLP/gRPC in batches.
//!
//! The SDK's batch processor exports from a thread of its own, which the tonic exporter cannot run on
//! (it needs a Tokio reactor: "there is no reactor running"). Each export is therefore handed to a
//! one-thread runtime kept for the purpose ([`OnRuntime`]), which also keeps exporting off the
//! runtime that serves decisions. Spans are sampled parent-based: a request whose `traceparent` is
//! sampled is always traced, one without a parent at `tracing.sample_ratio`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cachepick::config::TracingConfig;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter, Tracer};

/// The longest one export may take before it is given up (the batch is dropped, and counted by the SDK).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the last spans may hold the process after the server has stopped: a collector that is
/// reachable takes milliseconds; one that accepts and never answers would otherwise keep a stopping
/// replica alive for the SDK's 5 s shutdown and an export's 5 s timeout, past its drain.
const SHUTDOWN_WITHIN: Duration = Duration::from_secs(1);

/// The running exporter: flushed and stopped by [`Otlp::shutdown`].
pub struct Otlp {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

impl Otlp {
    /// The SDK exporting to `config.otlp_endpoint`, and the tracer the `tracing` layer records with;
    /// `None` when tracing is off.
    pub fn start(config: &TracingConfig) -> Result<Option<(Otlp, Tracer)>, String> {
        let Some(endpoint) = &config.otlp_endpoint else {
            return Ok(None);
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cachepick-otlp")
            .enable_all()
            .build()
            .map_err(|error| format!("cannot start the OTLP exporter's runtime: {error}"))?;
        let exporter = {
            // The channel is made on the runtime it is used from; it connects lazily, so a collector
            // that is down at start-up costs nothing but the batches it misses.
            let _entered = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|error| format!("tracing.otlp_endpoint {endpoint}: {error}"))?
        };
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .with_batch_exporter(OnRuntime {
                inner: Arc::new(exporter),
                runtime: runtime.handle().clone(),
            })
            .build();
        let tracer = provider.tracer("cachepick");
        Ok(Some((Otlp { provider, runtime }, tracer)))
    }

    /// Exports what is still queued within [`SHUTDOWN_WITHIN`], and stops without waiting for an
    /// export still under way.
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown_with_timeout(SHUTDOWN_WITHIN) {
            eprintln!("cachepick: the last spans were not exported: {error}");
        }
        self.runtime.shutdown_background();
    }
}

/// A span exporter whose exports run on `runtime`.
struct OnRuntime {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
}

impl fmt::Debug for OnRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnRuntime").finish_non_exhaustive()
    }
}

impl SpanExporter for OnRuntime {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let inner = Arc::clone(&self.inner);
        let export = self.runtime.spawn(async move { inner.export(batch).await });
        async move {
            export
                .await
                .unwrap_or_else(|error| Err(OTelSdkError::InternalFailure(error.to_string())))
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once, while the provider is built and this is the only reference.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

//! `serve`'s log output: text lines for people or one JSON record per line for pipelines, coloured
//! only on a terminal, with the HTTP/2, gRPC and TLS stacks held at `info` unless `RUST_LOG` names
//! them (at `debug` they write hundreds of lines a second beside a handful of decisions).

use std::io::IsTerminal;

use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How each log record is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `timestamp LEVEL target: message field=value ...`
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and every field at the top
    /// level (reload errors included).
    Json,
}

/// Dependencies whose `debug` and `trace` output is transport noise, not routing.
const QUIET: [&str; 7] = [
    "h2",
    "hyper",
    "hyper_util",
    "tower",
    "tonic",
    "rustls",
    "mio",
];

/// The filter for `spec` (`RUST_LOG`, `info` when unset): each [`QUIET`] crate it does not name is
/// held at `info`. A spec that does not parse is refused with the parser's reason.
pub fn filter(spec: Option<&str>) -> Result<EnvFilter, String> {
    let spec = spec.unwrap_or("info");
    let mut directives = spec.to_owned();
    for name in QUIET {
        if !spec.split(',').any(|directive| {
            directive.split(['=', '[']).next().is_some_and(|target| {
                target.trim() == name || target.trim().starts_with(&format!("{name}::"))
            })
        }) {
            directives.push_str(&format!(",{name}=info"));
        }
    }
    EnvFilter::builder()
        .parse(&directives)
        .map_err(|error| format!("RUST_LOG={spec:?}: {error}"))
}

/// Installs the subscriber. Records go to stdout; colour only when stdout is a terminal and
/// `NO_COLOR` is unset. A log line written during a request's decision carries the request's span
/// (`cachepick.decision{request_id=...}`; in JSON, its `span`). With `tracer` (`tracing.otlp_endpoint`),
/// the decision spans and their steps are also exported, whatever `filter` says of the log.
pub fn init(
    format: LogFormat,
    filter: EnvFilter,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) {
    let ansi = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let log = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer().with_ansi(ansi).boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .boxed(),
    };
    let spans = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(
                Targets::new().with_target(cachepick::route::TRACE_TARGET, tracing::Level::DEBUG),
            )
    });
    tracing_subscriber::registry()
        .with(log.with_filter(filter))
        .with(spans)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_crates_stay_at_info_unless_named() {
        let quiet = filter(Some("debug")).unwrap().to_string();
        for name in QUIET {
            assert!(quiet.contains(&format!("{name}=info")), "{quiet}");
        }
        // A crate the operator names keeps the operator's level.
        let named = filter(Some("info,h2=trace")).unwrap().to_string();
        assert!(
            named.contains("h2=trace") && !named.contains("h2=info"),
            "{named}"
        );
        assert!(named.contains("tonic=info"), "{named}");
        assert!(filter(None).unwrap().to_string().contains("info"));
        let bad = filter(Some("cachepick=loud")).unwrap_err();
        assert!(bad.contains("cachepick=loud"), "{bad}");
    }
}

//! The `tracing:` section: where OpenTelemetry spans go, and how many requests are traced.

use super::Validator;
use crate::config::TracingConfig;
use cachepick_decode::{Decode, Map, Res};

const TRACING_KEYS: &[&str] = &["otlp_endpoint", "sample_ratio", "service_name"];

impl Validator<'_> {
    /// `tracing:` (off when absent).
    pub(super) fn tracing(&mut self, root: &Map) -> Res<TracingConfig> {
        let map = self.section(root, "tracing", TRACING_KEYS)?;
        let endpoint = self.opt(&map, "otlp_endpoint", Self::string);
        let endpoint = self.check_opt(endpoint, otlp_endpoint);
        let ratio = self.opt(&map, "sample_ratio", Self::number);
        let ratio = self.check_opt(ratio, sample_ratio);
        let name = self.opt(&map, "service_name", Self::string);
        let name = self.check_opt(name, service_name);
        Ok(TracingConfig {
            otlp_endpoint: endpoint?.map(|given| given.value),
            sample_ratio: ratio?.map_or(TracingConfig::DEFAULT_SAMPLE_RATIO, |given| given.value),
            service_name: name?.map_or_else(
                || TracingConfig::DEFAULT_SERVICE_NAME.to_owned(),
                |given| given.value,
            ),
        })
    }
}

/// `http://host:port` or `https://host:port`, nothing after the authority: OTLP/gRPC has no path.
fn otlp_endpoint(url: String) -> Result<String, String> {
    let authority = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| {
            format!("must be http://HOST:PORT or https://HOST:PORT (OTLP over gRPC), got `{url}`")
        })?;
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    let port = authority.rsplit_once(':').map(|(_, port)| port);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return Err(format!(
            "must be http://HOST:PORT with no path, query or credentials, got `{url}`"
        ));
    }
    if port.is_none_or(|port| port.parse::<u16>().is_err()) {
        return Err(format!(
            "must name its port (the OTLP/gRPC default is 4317), got `{url}`"
        ));
    }
    Ok(url)
}

fn sample_ratio(ratio: f64) -> Result<f64, String> {
    if (0.0..=1.0).contains(&ratio) {
        Ok(ratio)
    } else {
        Err(format!("must be between 0 and 1, got {ratio}"))
    }
}

fn service_name(name: String) -> Result<String, String> {
    if name.trim().is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
        Err("must be 1 to 255 printable characters".to_owned())
    } else {
        Ok(name)
    }
}

//! The `ready` listener (`--envoy-ready`): Envoy's own readiness said the way a probe needs it.
//!
//! Envoy's admin `/ready` answers `LIVE` once initialisation is done, and initialisation waits for one
//! round of the picker cluster's health check, whatever its result. A picker that starts with Envoy (one
//! pod, or both restarting) is usually not `SERVING` at that first check — it is still scraping its
//! first round — so Envoy says `LIVE` while it counts no picker healthy, and until the next passing check
//! (1–2 s later) every request fails open, undecided. This listener answers `GET /ready` with 200 only
//! while Envoy counts at least one picker replica healthy, 503 before (and while Envoy drains), so a
//! start-up probe on it closes that window. `tests/envoy_e2e.rs` holds it against the real Envoy.

use super::yaml::{Yaml, duration};
use super::{EnvoyOptions, PICKER_CLUSTER, REQUEST_HEADERS_TIMEOUT};

/// The path the `ready` listener answers; any other path gets 404.
pub const READY_PATH: &str = "/ready";

/// The `ready` listener, after the `llm` listener, when `options.ready` asks for one.
pub(super) fn ready_listener(out: &mut Yaml, options: &EnvoyOptions) {
    let Some(addr) = options.ready else {
        return;
    };
    out.comment(
        2,
        &[
            &format!(
                "Readiness for a start-up probe: GET {READY_PATH} answers 200 once Envoy counts a picker replica healthy"
            ),
            "(its health check has passed), 503 before and while Envoy drains. Admin /ready says LIVE as soon as",
            "the first health check round is over, passed or not, and until the next one passes requests skip",
            "the picker. Probe it at start-up only: later, a picker outage is what failing open is for, and a",
            "gateway that took itself out of rotation then would turn degraded routing into none.",
        ],
    );
    out.line(2, "- name: ready");
    out.line(4, "address:");
    out.socket_address(6, addr);
    out.line(4, "filter_chains:");
    out.line(4, "- filters:");
    out.typed_entry(
        6,
        "envoy.filters.network.http_connection_manager",
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    );
    out.line(10, "stat_prefix: ready");
    out.line(10, "codec_type: AUTO");
    out.line(
        10,
        &format!(
            "request_headers_timeout: {}",
            duration(REQUEST_HEADERS_TIMEOUT)
        ),
    );
    out.comment(
        10,
        &[&format!(
            "No routes: a path other than {READY_PATH} gets 404."
        )],
    );
    out.line(10, "route_config: {name: ready}");
    out.line(10, "http_filters:");
    out.typed_entry(
        10,
        "envoy.filters.http.health_check",
        "envoy.extensions.filters.http.health_check.v3.HealthCheck",
    );
    out.line(14, "pass_through_mode: false");
    out.line(14, "headers:");
    out.line(
        14,
        &format!("- {{name: \":path\", string_match: {{exact: \"{READY_PATH}\"}}}}"),
    );
    out.comment(
        14,
        &[
            "Envoy truncates the percentage to a whole number and needs healthy >= total x percent / 100: 1% is",
            "\"at least one replica healthy\" for up to 100 replicas, and no replica at all is never ready.",
        ],
    );
    out.line(14, "cluster_min_healthy_percentages:");
    out.line(16, &format!("{PICKER_CLUSTER}: {{value: 1}}"));
    out.typed_entry(
        10,
        "envoy.filters.http.router",
        "envoy.extensions.filters.http.router.v3.Router",
    );
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::*;
    use crate::config::{self, Overrides};

    #[test]
    fn the_ready_listener_is_written_only_when_asked_and_counts_the_picker_cluster() {
        let config = config::parse(
            "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n",
            "test.yaml",
            &Overrides::default(),
        )
        .expect("valid config");
        let plain = render(&config, &EnvoyOptions::for_config(&config));
        assert!(!plain.contains("- name: ready\n"), "{plain}");
        let options = EnvoyOptions {
            ready: Some("0.0.0.0:9902".parse().expect("addr")),
            ..EnvoyOptions::for_config(&config)
        };
        let yaml = render(&config, &options);
        let ready = yaml
            .split("  - name: ready\n")
            .nth(1)
            .and_then(|rest| rest.split("\n  clusters:\n").next())
            .expect("the ready listener, before the clusters");
        assert!(ready.contains("port_value: 9902}"), "{ready}");
        assert!(ready.contains("pass_through_mode: false\n"), "{ready}");
        assert!(
            ready.contains(&format!("{PICKER_CLUSTER}: {{value: 1}}\n")),
            "{ready}"
        );
        assert!(yaml.contains(&format!("\n  - name: {PICKER_CLUSTER}\n")));
        assert!(
            yaml.contains("--envoy-ready 0.0.0.0:9902 "),
            "the header's command"
        );
    }
}

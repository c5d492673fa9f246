//! `tracing:` decoded: off without the section, its keys and defaults, the emitted form, and every
//! problem of a bad section reported at once.

use super::super::*;

const POOL: &str =
    "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";

fn config(head: &str) -> Config {
    super::accepted(&format!("{head}{POOL}"), &Overrides::default())
}

fn messages(head: &str) -> Vec<String> {
    super::messages(&format!("{head}{POOL}"), &Overrides::default())
}

#[test]
fn without_the_section_nothing_is_exported() {
    let tracing = config("").tracing;
    assert!(!tracing.enabled());
    assert_eq!(tracing, TracingConfig::default());
}

#[test]
fn the_section_names_the_collector_the_ratio_and_the_service() {
    let config = config(
        "tracing: {otlp_endpoint: \"http://otel-collector.monitoring:4317\", sample_ratio: 0.25, service_name: picker-a}\n",
    );
    assert_eq!(
        config.tracing,
        TracingConfig {
            otlp_endpoint: Some("http://otel-collector.monitoring:4317".to_owned()),
            sample_ratio: 0.25,
            service_name: "picker-a".to_owned(),
        }
    );
    let yaml = config.to_yaml();
    assert!(
        yaml.contains("otlp_endpoint: http://otel-collector.monitoring:4317"),
        "{yaml}"
    );
    let again = super::accepted(&yaml, &Overrides::default());
    assert_eq!(again.tracing, config.tracing);
}

#[test]
fn every_problem_of_a_bad_section_is_reported() {
    let problems = messages(
        "tracing: {otlp_endpoint: \"otel:4317\", sample_ratio: 1.5, service_name: \"\", exporter: zipkin}\n",
    );
    let all = problems.join("\n");
    for expected in [
        "tracing.otlp_endpoint",
        "tracing.sample_ratio",
        "tracing.service_name",
        "tracing.exporter",
    ] {
        assert!(all.contains(expected), "{expected} missing from:\n{all}");
    }
    for bad in [
        "http://otel",
        "http://otel:4317/v1/traces",
        "http://user:pw@otel:4317",
    ] {
        let all = messages(&format!("tracing: {{otlp_endpoint: \"{bad}\"}}\n")).join("\n");
        assert!(all.contains("tracing.otlp_endpoint"), "{bad}: {all}");
    }
}

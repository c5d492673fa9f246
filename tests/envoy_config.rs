//! cachepick's Envoy configuration against the real Envoy (1.40, provisioned by
//! `scripts/provision-envoy` through `support/envoy.rs`): every shipped file validates and equals the
//! generator's output, the generator's output for other fleets validates and says what it should, the CLI
//! prints it, the Istio filter validates inside a bootstrap, and a live Envoy in front of two loopback
//! workers keeps serving when the picker is down (and ignores client-sent routing headers).
//!
//! None of these tests skips: without Envoy they fail, saying why.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod shell;
}

use support::{envoy, shell};

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use serde_yaml::Value;
use tokio::net::TcpListener;

use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode, EXT_PROC_FILTER, EnvoyOptions, FAIL_OPEN_CLUSTER};
use cachepick::extproc::eds;
use cachepick::load::PoolLoad;
use cachepick::policy::Reason;
use cachepick::protocol::{
    DECISION_HEADER, DESTINATION, OWNED_PREFIX, PASSTHROUGH, SELECTED_HEADER,
};

const EXAMPLE: &str = "examples/cachepick.yaml";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn example() -> Config {
    config::load(&root().join(EXAMPLE), &Overrides::default()).expect("the example config is valid")
}

fn parse_config(yaml: &str) -> Config {
    config::parse(yaml, "test.yaml", &Overrides::default()).expect("valid test config")
}

/// The options the shipped files were generated with: defaults, and the example named as on the
/// command line from the repository root.
fn shipped_options(config: &Config, mode: BodyMode) -> EnvoyOptions {
    EnvoyOptions {
        mode,
        command: Some(format!(
            "cachepick envoy-config --config {EXAMPLE} --mode {mode}"
        )),
        ..EnvoyOptions::for_config(config)
    }
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).expect("the generated configuration is YAML")
}

/// Every YAML document of a file.
fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|document| Value::deserialize(document).expect("a YAML document"))
        .collect()
}

fn seq(value: &Value) -> &Vec<Value> {
    value.as_sequence().expect("a YAML sequence")
}

fn str_of(value: &Value) -> &str {
    value.as_str().expect("a YAML string")
}

fn hcm(bootstrap: &Value) -> &Value {
    &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

fn http_filter<'a>(bootstrap: &'a Value, name: &str) -> &'a Value {
    seq(&hcm(bootstrap)["http_filters"])
        .iter()
        .find(|filter| filter["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no http filter {name}"))
}

fn cluster<'a>(bootstrap: &'a Value, name: &str) -> Option<&'a Value> {
    seq(&bootstrap["static_resources"]["clusters"])
        .iter()
        .find(|cluster| cluster["name"].as_str() == Some(name))
}

fn socket(value: &Value) -> SocketAddr {
    let address = &value["socket_address"];
    SocketAddr::new(
        str_of(&address["address"]).parse().expect("an IP"),
        address["port_value"]
            .as_u64()
            .and_then(|port| u16::try_from(port).ok())
            .expect("a port"),
    )
}

/// The endpoints of a STATIC cluster, in order.
fn endpoints(cluster: &Value) -> Vec<SocketAddr> {
    seq(&cluster["load_assignment"]["endpoints"])
        .iter()
        .flat_map(|locality| seq(&locality["lb_endpoints"]))
        .map(|endpoint| socket(&endpoint["endpoint"]["address"]))
        .collect()
}

/// The text of a YAML file's comments, whitespace-normalised (the generator wraps comment lines).
fn comment_text(text: &str) -> String {
    let comments: Vec<&str> = text
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix('#'))
        .collect();
    comments
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------------------
// The shipped files

#[test]
fn every_shipped_envoy_file_passes_envoy_validation() {
    let dir = root().join("envoy");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("envoy/ is readable")
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    for mode in BodyMode::ALL {
        assert!(
            files.contains(&dir.join(mode.shipped_file())),
            "envoy/{} is missing",
            mode.shipped_file()
        );
    }
    let failures: Vec<String> = files
        .iter()
        .filter_map(|file| envoy::validate(file).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn shipped_files_are_exactly_the_generators_output_for_the_example() {
    let config = example();
    for mode in BodyMode::ALL {
        let path = root().join("envoy").join(mode.shipped_file());
        let shipped = std::fs::read_to_string(&path).expect("the shipped file is readable");
        let generated = envoy_config::render(&config, &shipped_options(&config, mode));
        assert!(
            shipped == generated,
            "{} differs from the generator's output; regenerate it from the repository root with\n  \
             cargo run -q -- envoy-config --config {EXAMPLE} --mode {mode} > envoy/{}",
            path.display(),
            mode.shipped_file()
        );
    }
}

// ---------------------------------------------------------------------------------------------------
// The generator

const LOOPBACK_FLEET: &str = "\
listen: 127.0.0.1:19002
max_body_bytes: 1MiB
policy: {max_fallbacks: 3}
pools:
  - model: a
    engine: vllm
    workers:
      - {endpoint: \"127.0.0.1:18001\"}
      - {endpoint: \"127.0.0.1:18002\", role: prefill}
      - {endpoint: \"127.0.0.1:18003\", role: decode}
  - model: b
    engine: sglang
    workers:
      - {endpoint: \"[::1]:18004\"}
";

#[test]
fn generated_configs_validate_and_name_every_worker_and_every_reason() {
    let config = parse_config(LOOPBACK_FLEET);
    let routable: Vec<SocketAddr> = ["127.0.0.1:18001", "127.0.0.1:18002", "[::1]:18004"]
        .iter()
        .map(|addr| addr.parse().unwrap())
        .collect();
    for mode in BodyMode::ALL {
        let text = envoy_config::render(
            &config,
            &EnvoyOptions {
                mode,
                ..EnvoyOptions::for_config(&config)
            },
        );
        if let Err(error) = envoy::validate_yaml(&text) {
            panic!("mode {mode}: {error}\n{text}");
        }
        let bootstrap = yaml(&text);

        // Addresses: defaults on loopback; the picker is cachepick's `listen`.
        assert_eq!(
            socket(&bootstrap["admin"]["address"]),
            EnvoyOptions::DEFAULT_ADMIN
        );
        let listener = &bootstrap["static_resources"]["listeners"][0];
        assert_eq!(socket(&listener["address"]), EnvoyOptions::DEFAULT_LISTEN);
        let picker = cluster(&bootstrap, "cachepick").expect("the cachepick cluster");
        assert_eq!(endpoints(picker), vec![config.listen]);

        // Sizes from the configuration: the route's body limit; the listener keeps Envoy's default
        // per-connection buffer.
        assert!(
            listener["per_connection_buffer_limit_bytes"].is_null(),
            "mode {mode}"
        );
        let vhost = &hcm(&bootstrap)["route_config"]["virtual_hosts"][0];
        let route = &vhost["routes"][0];
        assert_eq!(route["request_body_buffer_limit"].as_u64(), Some(1 << 20));
        // Receive-side deadlines on the connection manager; none on the route (generations).
        assert_eq!(str_of(&hcm(&bootstrap)["request_headers_timeout"]), "10s");
        assert_eq!(str_of(&hcm(&bootstrap)["request_timeout"]), "60s");
        assert_eq!(str_of(&route["route"]["timeout"]), "0s");
        assert_eq!(str_of(&route["route"]["idle_timeout"]), "0s");

        // One virtual cluster per reason, in Reason::ALL order, then `passthrough`, matched on the
        // decision header.
        assert_eq!(str_of(&vhost["name"]), "llm");
        let vclusters = seq(&vhost["virtual_clusters"]);
        let expected: Vec<&str> = Reason::ALL
            .iter()
            .map(|reason| reason.as_str())
            .chain([PASSTHROUGH])
            .collect();
        assert_eq!(vclusters.len(), expected.len());
        for (vcluster, name) in vclusters.iter().zip(expected) {
            assert_eq!(str_of(&vcluster["name"]), name);
            let header = &vcluster["headers"][0];
            assert_eq!(str_of(&header["name"]), DECISION_HEADER);
            assert_eq!(str_of(&header["string_match"]["exact"]), name);
        }

        // Filters: strip client routing headers, then cachepick, then the router.
        let names: Vec<&str> = seq(&hcm(&bootstrap)["http_filters"])
            .iter()
            .map(|filter| str_of(&filter["name"]))
            .collect();
        assert_eq!(
            names,
            [
                "envoy.filters.http.header_mutation",
                EXT_PROC_FILTER,
                "envoy.filters.http.router"
            ]
        );
        // The client-header filter drops the destination and every x-cachepick-* header (the
        // decision and the selected endpoint among them).
        let mutations = seq(
            &http_filter(&bootstrap, "envoy.filters.http.header_mutation")["typed_config"]["mutations"]
                ["request_mutations"],
        );
        assert_eq!(mutations.len(), 2, "{mutations:?}");
        assert_eq!(str_of(&mutations[0]["remove"]), DESTINATION);
        assert_eq!(
            str_of(&mutations[1]["remove_on_match"]["key_matcher"]["prefix"]),
            OWNED_PREFIX
        );
        for owned in [DECISION_HEADER, SELECTED_HEADER] {
            assert!(owned.starts_with(OWNED_PREFIX), "{owned}");
        }
        let ext_proc = &http_filter(&bootstrap, EXT_PROC_FILTER)["typed_config"];
        assert_eq!(
            str_of(&ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"]),
            "cachepick"
        );
        assert_eq!(ext_proc["failure_mode_allow"].as_bool(), Some(true));
        assert_eq!(
            str_of(&ext_proc["metadata_options"]["receiving_namespaces"]["untyped"][0]),
            "envoy.lb"
        );
        let processing = &ext_proc["processing_mode"];
        assert_eq!(str_of(&processing["request_header_mode"]), "SEND");
        // Feedback (on by default): the response headers go to cachepick with the served upstream,
        // and the stream announces it; the body streams straight through.
        assert_eq!(str_of(&processing["response_header_mode"]), "SEND");
        assert_eq!(
            str_of(&ext_proc["response_attributes"][0]),
            "upstream.address"
        );
        assert_eq!(
            str_of(&ext_proc["grpc_service"]["initial_metadata"][0]["key"]),
            "x-cachepick-feedback"
        );
        assert_eq!(str_of(&processing["response_body_mode"]), "NONE");
        match mode {
            BodyMode::Duplex => {
                assert_eq!(
                    str_of(&processing["request_body_mode"]),
                    "FULL_DUPLEX_STREAMED"
                );
                assert_eq!(str_of(&processing["request_trailer_mode"]), "SEND");
                assert!(ext_proc["message_timeout"].is_null());
            }
            BodyMode::Buffered | BodyMode::OriginalDst => {
                assert_eq!(str_of(&processing["request_body_mode"]), "BUFFERED");
                assert_eq!(str_of(&processing["request_trailer_mode"]), "SKIP");
                assert_eq!(str_of(&ext_proc["message_timeout"]), "2s");
                assert!(ext_proc["send_body_without_waiting_for_header_response"].is_null());
            }
            BodyMode::Streamed => {
                assert_eq!(str_of(&processing["request_body_mode"]), "STREAMED");
                assert_eq!(str_of(&processing["request_trailer_mode"]), "SEND");
                assert_eq!(str_of(&ext_proc["message_timeout"]), "2s");
                assert_eq!(
                    ext_proc["send_body_without_waiting_for_header_response"].as_bool(),
                    Some(true)
                );
            }
        }

        // Upstream: the prefill-capable workers of every pool (never the decode-only one), steered by
        // override_host; or ORIGINAL_DST on the header.
        match mode {
            BodyMode::Buffered | BodyMode::Duplex | BodyMode::Streamed => {
                assert_eq!(str_of(&route["route"]["cluster"]), "workers");
                let workers = cluster(&bootstrap, "workers").expect("the workers cluster");
                // The endpoints come from cachepick's EDS (tests/eds.rs runs it against Envoy), over
                // a cluster of its own at the picker's address, without the readiness health check.
                assert_eq!(str_of(&workers["type"]), "EDS");
                assert!(workers["load_assignment"].is_null());
                let eds = &workers["eds_cluster_config"];
                assert_eq!(str_of(&eds["service_name"]), eds::WORKERS_CLUSTER);
                let source = &eds["eds_config"]["api_config_source"];
                assert_eq!(str_of(&source["api_type"]), "GRPC");
                assert_eq!(str_of(&source["transport_api_version"]), "V3");
                assert_eq!(
                    str_of(&source["grpc_services"][0]["envoy_grpc"]["cluster_name"]),
                    envoy_config::XDS_CLUSTER
                );
                assert_eq!(str_of(&eds["eds_config"]["initial_fetch_timeout"]), "5s");
                let xds = cluster(&bootstrap, envoy_config::XDS_CLUSTER).expect("the EDS cluster");
                assert_eq!(endpoints(xds), vec![config.listen]);
                assert!(xds["health_checks"].is_null());
                assert_outlier_detection(workers);
                let policy =
                    &workers["load_balancing_policy"]["policies"][0]["typed_extension_config"];
                assert_eq!(
                    str_of(&policy["name"]),
                    "envoy.load_balancing_policies.override_host"
                );
                let sources = &policy["typed_config"]["override_host_sources"];
                assert_eq!(str_of(&sources[0]["header"]), DESTINATION);
                assert_eq!(str_of(&sources[1]["metadata"]["key"]), "envoy.lb");
                assert_eq!(
                    str_of(&sources[1]["metadata"]["path"][0]["key"]),
                    DESTINATION
                );
                let fallback = &policy["typed_config"]["fallback_policy"]["policies"][0];
                assert_eq!(
                    str_of(&fallback["typed_extension_config"]["name"]),
                    "envoy.load_balancing_policies.least_request"
                );
                // max_fallbacks 3: the four listed addresses, then one least-request attempt.
                let retry = &route["route"]["retry_policy"];
                assert_eq!(retry["num_retries"].as_u64(), Some(4));
                assert_eq!(
                    str_of(&retry["retry_on"]),
                    "connect-failure,refused-stream,reset-before-request"
                );
                assert_eq!(
                    str_of(&retry["retry_host_predicate"][0]["name"]),
                    "envoy.retry_host_predicates.previous_hosts"
                );
            }
            BodyMode::OriginalDst => {
                assert_eq!(str_of(&route["route"]["cluster"]), "workers_original_dst");
                assert!(cluster(&bootstrap, "workers").is_none());
                let original = cluster(&bootstrap, "workers_original_dst").expect("the cluster");
                assert_eq!(str_of(&original["type"]), "ORIGINAL_DST");
                assert_eq!(
                    original["original_dst_lb_config"]["use_http_header"].as_bool(),
                    Some(true)
                );
                assert_eq!(
                    str_of(&original["original_dst_lb_config"]["http_header_name"]),
                    SELECTED_HEADER
                );
                assert!(route["route"]["retry_policy"].is_null());
                assert!(cluster(&bootstrap, envoy_config::XDS_CLUSTER).is_none());
            }
        }
        // The workers Envoy does not route to are still named, in a comment saying why: the decode-only
        // one always, and in ORIGINAL_DST mode (which lists no endpoints) every worker.
        let comments = comment_text(&text);
        assert!(
            comments.contains(
                "decode-only (cachepick never sends a request there, so the fallback must not): 127.0.0.1:18003."
            ),
            "mode {mode}: the decode-only worker is not explained"
        );
        if mode == BodyMode::OriginalDst {
            for worker in &routable {
                assert!(comments.contains(&worker.to_string()), "{worker} not named");
            }
        }
        // ORIGINAL_DST reads the single selected endpoint, so fallbacks need no warning in any mode.
        assert!(!comments.contains("WARNING"), "{comments}");

        // The picker is health-checked, and never tried when unhealthy (what lets duplex mode fail open).
        assert_eq!(
            str_of(&picker["health_checks"][0]["grpc_health_check"]["service_name"]),
            "envoy.service.ext_proc.v3.ExternalProcessor"
        );
        assert_eq!(
            picker["common_lb_config"]["healthy_panic_threshold"]["value"].as_u64(),
            Some(0)
        );
    }
}

/// The workers cluster's outlier detection: local-origin failures apart, never the whole pool.
fn assert_outlier_detection(workers: &Value) {
    let outlier = &workers["outlier_detection"];
    assert_eq!(
        outlier["split_external_local_origin_errors"].as_bool(),
        Some(true)
    );
    assert_eq!(
        outlier["consecutive_local_origin_failure"].as_u64(),
        Some(3)
    );
    assert_eq!(outlier["consecutive_gateway_failure"].as_u64(), Some(5));
    assert_eq!(outlier["enforcing_consecutive_5xx"].as_u64(), Some(0));
    assert_eq!(outlier["enforcing_success_rate"].as_u64(), Some(0));
    assert_eq!(str_of(&outlier["interval"]), "2s");
    assert_eq!(str_of(&outlier["base_ejection_time"]), "10s");
    let percent = outlier["max_ejection_percent"].as_u64().unwrap();
    // Ejections Envoy allows in a pool of n: the largest k with 100 k / n <= percent. Never all of 2 to 8.
    for n in 2..=8u64 {
        let most = (1..=n)
            .filter(|k| 100 * k <= percent * n)
            .max()
            .unwrap_or(0);
        assert!(most < n, "{n} workers could all be ejected");
    }
}

const DNS_FLEET: &str = "\
listen: 127.0.0.1:19002
pools:
  - model: a
    engine: vllm
    dns: {name: localhost, port: 18001, interval: 3s, server: \"127.0.0.1:19053\"}
  - model: b
    engine: sglang
    dns: {name: vllm-b.llm.svc.cluster.local, port: 8000, interval: 10s}
";

#[test]
fn dns_kubernetes_and_mixed_fleets_validate_with_their_workers_source() {
    // Every pool `dns:` → STRICT_DNS (the DnsCluster extension) on the same names, no EDS.
    let config = parse_config(DNS_FLEET);
    for mode in [BodyMode::Buffered, BodyMode::Duplex] {
        let text = envoy_config::render(
            &config,
            &EnvoyOptions {
                mode,
                ..EnvoyOptions::for_config(&config)
            },
        );
        if let Err(error) = envoy::validate_yaml(&text) {
            panic!("mode {mode}: {error}\n{text}");
        }
        let bootstrap = yaml(&text);
        let workers = cluster(&bootstrap, "workers").unwrap();
        assert!(workers["type"].is_null() && workers["eds_cluster_config"].is_null());
        assert!(cluster(&bootstrap, envoy_config::XDS_CLUSTER).is_none());
        let dns = &workers["cluster_type"];
        assert_eq!(str_of(&dns["name"]), "envoy.cluster.dns");
        assert_eq!(str_of(&dns["typed_config"]["dns_refresh_rate"]), "3s");
        assert_eq!(
            dns["typed_config"]["respect_dns_ttl"].as_bool(),
            Some(false)
        );
        assert_eq!(str_of(&dns["typed_config"]["dns_lookup_family"]), "ALL");
        let resolver = &dns["typed_config"]["typed_dns_resolver_config"]["typed_config"];
        assert_eq!(
            socket(&resolver["resolvers"][0]),
            "127.0.0.1:19053".parse().unwrap()
        );
        let names: Vec<(&str, u64)> =
            seq(&workers["load_assignment"]["endpoints"][0]["lb_endpoints"])
                .iter()
                .map(|endpoint| {
                    let address = &endpoint["endpoint"]["address"]["socket_address"];
                    (
                        str_of(&address["address"]),
                        address["port_value"].as_u64().unwrap(),
                    )
                })
                .collect();
        assert_eq!(
            names,
            [("localhost", 18001), ("vllm-b.llm.svc.cluster.local", 8000)]
        );
        assert_outlier_detection(workers);
    }

    // A Kubernetes pool, and a mix of sources: EDS from cachepick, which holds every pool's roster.
    for fleet in [
        "listen: 127.0.0.1:19002\npools:\n  - model: a\n    engine: vllm\n    kubernetes: {namespace: llm, selector: \"app=vllm\", ports: [8000]}\n",
        "listen: 127.0.0.1:19002\npools:\n  - model: a\n    engine: vllm\n    dns: {name: localhost, port: 18001}\n  - model: b\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:18002\"}\n",
    ] {
        let config = parse_config(fleet);
        let text = envoy_config::render(&config, &EnvoyOptions::for_config(&config));
        if let Err(error) = envoy::validate_yaml(&text) {
            panic!("{error}\n{text}");
        }
        let bootstrap = yaml(&text);
        assert_eq!(
            str_of(&cluster(&bootstrap, "workers").unwrap()["type"]),
            "EDS"
        );
        assert!(cluster(&bootstrap, envoy_config::XDS_CLUSTER).is_some());
    }
}

/// Envoy's complaint about `yaml` with `from` replaced by `to` (which must change it); panics with
/// `what` if Envoy accepts the edit.
fn refused_edit(yaml: &str, from: &str, to: &str, what: &str) -> String {
    let edited = yaml.replace(from, to);
    assert_ne!(edited, yaml, "{from:?} is not in the configuration");
    envoy::validate_yaml(&edited).expect_err(what)
}

#[test]
fn envoy_validation_rejects_what_envoy_rejects() {
    // The validation above means something only if Envoy does refuse bad configurations.
    let config = parse_config(LOOPBACK_FLEET);
    let good = envoy_config::render(&config, &EnvoyOptions::for_config(&config));
    let error = refused_edit(
        &good,
        "failure_mode_allow: true",
        "failure_mode_allow: true\n              no_such_field: 1",
        "an unknown field is refused",
    );
    assert!(error.contains("no_such_field"), "{error}");
    // FULL_DUPLEX_STREAMED needs request trailers: the reason duplex mode sends them.
    let duplex = envoy_config::render(
        &config,
        &EnvoyOptions {
            mode: BodyMode::Duplex,
            ..EnvoyOptions::for_config(&config)
        },
    );
    refused_edit(
        &duplex,
        "request_trailer_mode: SEND",
        "request_trailer_mode: SKIP",
        "FULL_DUPLEX_STREAMED without trailers is refused",
    );
    // A heap-based overload action needs Envoy's heap budget, which the generator cannot know: the
    // reason it ships none (the generated comment says so).
    let error = refused_edit(
        &good,
        "  resource_monitors:\n",
        "  resource_monitors:\n  - name: envoy.resource_monitors.fixed_heap\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig\n",
        "fixed_heap without a size is refused",
    );
    assert!(error.contains("max heap size"), "{error}");
}

// ---------------------------------------------------------------------------------------------------
// The CLI

fn cachepick(args: &[&str]) -> std::process::Output {
    Command::new(cachepick_rig::cachepick_binary())
        .args(args)
        .output()
        .expect("the cachepick binary runs")
}

/// The regeneration command the CLI writes for `args`: the command line itself, shell-quoted.
fn command_for(args: &[&str]) -> Option<String> {
    Some(envoy_config::command_line(
        std::iter::once("cachepick")
            .chain(args.iter().copied())
            .map(str::to_owned),
    ))
}

#[test]
fn the_cli_prints_what_render_returns() {
    let config = example();
    let path = root().join(EXAMPLE);
    let path = path.to_str().expect("a UTF-8 path");
    for mode in BodyMode::ALL {
        let args = ["envoy-config", "--config", path, "--mode", mode.as_str()];
        let output = cachepick(&args);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let expected = envoy_config::render(
            &config,
            &EnvoyOptions {
                mode,
                command: command_for(&args),
                ..EnvoyOptions::for_config(&config)
            },
        );
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            expected,
            "mode {mode}"
        );
    }

    // Without --mode: buffered. The flags move Envoy's listener and admin, and --listen (cachepick's
    // own address, as in every other command) moves the picker cluster.
    let args = [
        "envoy-config",
        "--config",
        path,
        "--envoy-listen",
        "0.0.0.0:8080",
        "--envoy-admin",
        "127.0.0.1:19901",
        "--listen",
        "0.0.0.0:9102",
    ];
    let output = cachepick(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let moved = config::load(
        Path::new(path),
        &Overrides {
            listen: Some("0.0.0.0:9102".parse().unwrap()),
            ..Overrides::default()
        },
    )
    .unwrap();
    let expected = envoy_config::render(
        &moved,
        &EnvoyOptions {
            listen: "0.0.0.0:8080".parse().unwrap(),
            admin: "127.0.0.1:19901".parse().unwrap(),
            command: command_for(&args),
            ..EnvoyOptions::for_config(&moved)
        },
    );
    assert_eq!(stdout, expected);
    let bootstrap = yaml(&stdout);
    assert_eq!(
        endpoints(cluster(&bootstrap, "cachepick").unwrap()),
        vec!["127.0.0.1:9102".parse::<SocketAddr>().unwrap()],
        "cachepick listening everywhere is dialled on loopback"
    );
    // The regeneration line keeps every flag, --listen included (without it the file it regenerates
    // would point Envoy at the wrong port, and fail-open would hide the loss).
    assert!(stdout.contains(
        "--envoy-listen 0.0.0.0:8080 --envoy-admin 127.0.0.1:19901 --listen 0.0.0.0:9102 > FILE"
    ));
}

/// Following a file's "regenerate with" line gives the file back byte for byte: for the shipped files,
/// and for a command with every kind of flag (cachepick's own `--listen` and policy overrides, a
/// `--flag=value`, a path a shell must quote, a picker by name and one by IPv6 literal).
#[test]
fn the_regenerate_line_reproduces_the_file_exactly() {
    for mode in BodyMode::ALL {
        let shipped = std::fs::read_to_string(root().join("envoy").join(mode.shipped_file()))
            .expect("the shipped file is readable");
        let command = shell::regenerate_command(&shipped);
        let again = shell::run(command, root());
        assert!(
            String::from_utf8_lossy(&again.stdout) == shipped,
            "`{command}` does not give envoy/{} back",
            mode.shipped_file()
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("the fleet's config.yaml");
    std::fs::write(&file, LOOPBACK_FLEET).unwrap();
    let file = file.to_str().unwrap();
    let output = cachepick(&[
        "envoy-config",
        "--config",
        file,
        "--mode=duplex",
        "--listen",
        "0.0.0.0:19555",
        "--worker-queue-limit",
        "7",
        "--envoy-listen",
        "127.0.0.1:10555",
        "--picker",
        "localhost:19555",
        "--picker",
        "[::1]:19556",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let first = String::from_utf8(output.stdout).unwrap();
    let command = shell::regenerate_command(&first);
    assert!(
        command.contains(" --listen 0.0.0.0:19555 ") && command.contains("'[::1]:19556'"),
        "{command}"
    );
    let again = shell::run(command, dir.path());
    assert_eq!(String::from_utf8_lossy(&again.stdout), first, "`{command}`");

    // The named picker makes both picker clusters resolve by DNS, and Envoy takes the result.
    let bootstrap = yaml(&first);
    for name in ["cachepick", "cachepick_xds"] {
        let picker_cluster = cluster(&bootstrap, name).expect("a picker cluster");
        assert_eq!(
            str_of(&picker_cluster["cluster_type"]["name"]),
            "envoy.cluster.dns",
            "{name}"
        );
    }
    if let Err(error) = envoy::validate_yaml(&first) {
        panic!("{error}");
    }
}

/// Picker replicas behind one Envoy: the `cachepick` cluster lists every replica, round-robins them, and
/// the real Envoy accepts it in every mode; `--picker` (repeated) on the command line gives the same.
#[test]
fn several_pickers_are_listed_round_robined_and_accepted_by_envoy() {
    let config = parse_config(LOOPBACK_FLEET);
    let pickers: Vec<SocketAddr> = ["127.0.0.1:19101", "127.0.0.1:19102", "[::1]:19103"]
        .iter()
        .map(|addr| addr.parse().unwrap())
        .collect();
    for mode in BodyMode::ALL {
        let text = envoy_config::render(
            &config,
            &EnvoyOptions {
                mode,
                pickers: pickers.iter().copied().map(Into::into).collect(),
                ..EnvoyOptions::for_config(&config)
            },
        );
        let bootstrap = yaml(&text);
        let cluster = cluster(&bootstrap, "cachepick").expect("the cachepick cluster");
        assert_eq!(endpoints(cluster), pickers, "mode {mode}");
        assert_eq!(str_of(&cluster["lb_policy"]), "ROUND_ROBIN", "mode {mode}");
        // Every replica is health-checked: an unhealthy one is skipped, not tried.
        assert!(cluster["health_checks"][0]["grpc_health_check"].is_mapping());
        assert!(
            comment_text(&text).contains("3 replicas of the picker round-robined per request"),
            "mode {mode}"
        );
        if let Err(error) = envoy::validate_yaml(&text) {
            panic!("mode {mode}: {error}");
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fleet.yaml");
    std::fs::write(&file, LOOPBACK_FLEET).unwrap();
    let file = file.to_str().unwrap();
    let mut args = vec!["envoy-config", "--config", file];
    let addresses: Vec<String> = pickers.iter().map(ToString::to_string).collect();
    for address in &addresses {
        args.extend(["--picker", address.as_str()]);
    }
    let output = cachepick(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let expected = envoy_config::render(
        &config,
        &EnvoyOptions {
            pickers: pickers.iter().copied().map(Into::into).collect(),
            command: command_for(&args),
            ..EnvoyOptions::for_config(&config)
        },
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout, expected);
    // The header's regeneration command names the replicas.
    assert!(
        stdout.contains("--picker 127.0.0.1:19101 --picker 127.0.0.1:19102 --picker '[::1]:19103'"),
        "{stdout}"
    );
}

#[test]
fn the_cli_exits_2_on_a_bad_config_or_mode() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "policy: {worker_queue_limit: 0}\npools: []\n").unwrap();
    let output = cachepick(&["envoy-config", "--config", bad.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(output.stdout.is_empty(), "nothing printed for a bad config");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("worker_queue_limit"), "{stderr}");

    let missing = dir.path().join("missing.yaml");
    let output = cachepick(&["envoy-config", "--config", missing.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");

    let example = root().join(EXAMPLE);
    let output = cachepick(&[
        "envoy-config",
        "--config",
        example.to_str().unwrap(),
        "--mode",
        "streaming",
    ]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let every_mode = "[possible values: buffered, duplex, streamed, original-dst]";
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(every_mode), "{stderr}");
    // --help lists every mode too, streamed included.
    let help = cachepick(&["envoy-config", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains(every_mode), "{help}");
}

// ---------------------------------------------------------------------------------------------------
// Istio

fn envoyfilter_patches() -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("envoy/istio/envoyfilter.yaml")).unwrap();
    let docs = documents(&text);
    assert_eq!(docs.len(), 1);
    assert_eq!(str_of(&docs[0]["kind"]), "EnvoyFilter");
    seq(&docs[0]["spec"]["configPatches"]).clone()
}

fn to_json(value: &Value) -> serde_json::Value {
    serde_json::to_value(value).expect("YAML with string keys converts to JSON")
}

#[test]
fn the_istio_filter_validates_in_an_envoy_bootstrap_and_matches_the_generator() {
    let patches = envoyfilter_patches();
    assert_eq!(patches.len(), 3);

    // Patch 1: ext_proc before the router, on the gateway.
    let ext_proc = &patches[0];
    assert_eq!(str_of(&ext_proc["applyTo"]), "HTTP_FILTER");
    assert_eq!(str_of(&ext_proc["match"]["context"]), "GATEWAY");
    let filter_match = &ext_proc["match"]["listener"]["filterChain"]["filter"];
    assert_eq!(
        str_of(&filter_match["name"]),
        "envoy.filters.network.http_connection_manager"
    );
    assert_eq!(
        str_of(&filter_match["subFilter"]["name"]),
        "envoy.filters.http.router"
    );
    assert_eq!(str_of(&ext_proc["patch"]["operation"]), "INSERT_BEFORE");
    let ext_proc_filter = &ext_proc["patch"]["value"];
    assert_eq!(str_of(&ext_proc_filter["name"]), EXT_PROC_FILTER);
    let picker_cluster =
        str_of(&ext_proc_filter["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]);
    assert_eq!(
        picker_cluster,
        "outbound|9002||cachepick.llm.svc.cluster.local"
    );

    // Patch 2: the header filter, before ext_proc.
    let strip = &patches[1];
    assert_eq!(str_of(&strip["applyTo"]), "HTTP_FILTER");
    assert_eq!(str_of(&strip["match"]["context"]), "GATEWAY");
    assert_eq!(
        str_of(&strip["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]),
        EXT_PROC_FILTER
    );
    assert_eq!(str_of(&strip["patch"]["operation"]), "INSERT_BEFORE");
    let strip_filter = &strip["patch"]["value"];

    // Patch 3: override_host merged into the workers' cluster.
    let steer = &patches[2];
    assert_eq!(str_of(&steer["applyTo"]), "CLUSTER");
    assert_eq!(str_of(&steer["patch"]["operation"]), "MERGE");
    let workers_cluster = format!(
        "outbound|{}||{}",
        steer["match"]["cluster"]["portNumber"].as_u64().unwrap(),
        str_of(&steer["match"]["cluster"]["service"])
    );

    // The same settings as the generator's buffered mode: same keys, same values except the cluster.
    let config = example();
    let generated = yaml(&envoy_config::render(
        &config,
        &EnvoyOptions::for_config(&config),
    ));
    let ours = &http_filter(&generated, EXT_PROC_FILTER)["typed_config"];
    let theirs = &ext_proc_filter["typed_config"];
    let keys = |value: &Value| -> BTreeSet<String> {
        value
            .as_mapping()
            .unwrap()
            .keys()
            .map(|key| str_of(key).to_owned())
            .collect()
    };
    // route_cache_action belongs to the bootstrap's two routes (answered by cachepick or not); Istio's
    // route has the one cluster, so nothing needs matching again.
    let mut ours_keys = keys(ours);
    assert!(ours_keys.remove("route_cache_action"));
    assert_eq!(keys(theirs), ours_keys);
    for key in ours_keys.iter().filter(|key| *key != "grpc_service") {
        assert_eq!(
            theirs[key.as_str()],
            ours[key.as_str()],
            "ext_proc `{key}` differs from the generator's"
        );
    }
    assert_eq!(
        *strip_filter,
        *http_filter(&generated, "envoy.filters.http.header_mutation")
    );
    assert_eq!(
        steer["patch"]["value"]["load_balancing_policy"],
        cluster(&generated, "workers").unwrap()["load_balancing_policy"]
    );

    // Embedded in a minimal static bootstrap, as the gateway would carry them, they validate.
    let mut workers = json!({
        "name": workers_cluster,
        "type": "STATIC",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": workers_cluster,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}
            ]}]
        }
    });
    for (key, value) in to_json(&steer["patch"]["value"]).as_object().unwrap() {
        workers[key] = value.clone();
    }
    let bootstrap = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19901}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"virtual_hosts": [{
                            "name": "llm",
                            "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": workers_cluster}}]
                        }]},
                        "http_filters": [
                            to_json(strip_filter),
                            to_json(ext_proc_filter),
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                            }}
                        ]
                    }
                }]}]
            }],
            "clusters": [
                workers,
                {
                    "name": picker_cluster,
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}
                        }
                    },
                    "load_assignment": {
                        "cluster_name": picker_cluster,
                        "endpoints": [{"lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9002}}}}
                        ]}]
                    }
                }
            ]
        }
    });
    // JSON is YAML: Envoy reads it as such.
    let text = serde_json::to_string_pretty(&bootstrap).unwrap();
    if let Err(error) = envoy::validate_yaml(&text) {
        panic!("{error}\n{text}");
    }
}

#[test]
fn the_inferencepool_sketch_points_at_a_valid_cachepick() {
    let text = std::fs::read_to_string(root().join("envoy/istio/inferencepool.yaml")).unwrap();
    let docs = documents(&text);
    let by_kind: BTreeMap<&str, &Value> =
        docs.iter().map(|doc| (str_of(&doc["kind"]), doc)).collect();
    let pool = by_kind["InferencePool"];
    assert_eq!(
        str_of(&pool["apiVersion"]),
        "inference.networking.k8s.io/v1"
    );
    let picker = &pool["spec"]["endpointPickerRef"];
    assert_eq!(str_of(&picker["kind"]), "Service");
    assert_eq!(str_of(&picker["name"]), "cachepick");
    let port = picker["port"]["number"].as_u64().unwrap();
    assert_eq!(port, 9002);
    assert_eq!(
        seq(&pool["spec"]["targetPorts"]).len(),
        1,
        "v1 allows exactly one target port"
    );

    let route = by_kind["HTTPRoute"];
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(str_of(&backend["kind"]), "InferencePool");
    assert_eq!(str_of(&backend["group"]), "inference.networking.k8s.io");
    assert_eq!(str_of(&backend["name"]), str_of(&pool["metadata"]["name"]));

    let service = by_kind["Service"];
    assert_eq!(str_of(&service["metadata"]["name"]), "cachepick");
    assert_eq!(service["spec"]["ports"][0]["port"].as_u64(), Some(port));

    // The ConfigMap holds a configuration cachepick accepts, listening where the Service sends traffic.
    let cachepick_yaml = str_of(&by_kind["ConfigMap"]["data"]["cachepick.yaml"]);
    let config = config::parse(
        cachepick_yaml,
        "inferencepool.yaml ConfigMap",
        &Overrides::default(),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(u64::from(config.listen.port()), port);
    assert_eq!(
        service["spec"]["ports"][0]["targetPort"].as_u64(),
        Some(u64::from(config.listen.port()))
    );
    // It follows the InferencePool the route names (its pods), as the gateway's cluster does, with
    // the Deployment's ServiceAccount (the one rbac.yaml grants).
    match &config.pools[0].discovery {
        config::Discovery::Kubernetes(kubernetes) => assert_eq!(
            kubernetes.pods,
            config::PodSelection::InferencePool(str_of(&pool["metadata"]["name"]).to_owned())
        ),
        other => panic!("the ConfigMap's pool is not a kubernetes: pool: {other:?}"),
    }
    assert_eq!(
        str_of(&by_kind["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]),
        "cachepick"
    );
    // It listens on the pod network, so the debug endpoints are off...
    assert!(config.listen.ip().is_unspecified());
    assert!(
        !config.debug_on_listen() && !config.debug_on_metrics(),
        "the debug endpoints must be off on the pod network"
    );

    // ...and a NetworkPolicy admits only the gateway's pods to the ext_proc port and only the
    // monitoring namespace to the metrics port.
    let policy = by_kind["NetworkPolicy"];
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"]
    );
    let types: Vec<&str> = seq(&policy["spec"]["policyTypes"])
        .iter()
        .map(str_of)
        .collect();
    assert_eq!(types, ["Ingress"]);
    let rules = seq(&policy["spec"]["ingress"]);
    assert_eq!(rules.len(), 2);
    let only_port = |rule: &Value| -> u64 {
        let ports = seq(&rule["ports"]);
        assert_eq!(ports.len(), 1, "{rule:?}");
        assert_eq!(str_of(&ports[0]["protocol"]), "TCP");
        ports[0]["port"].as_u64().unwrap()
    };
    let sources = |rule: &Value| -> Vec<Value> { seq(&rule["from"]).clone() };
    assert_eq!(only_port(&rules[0]), port);
    let gateway_pods = sources(&rules[0]);
    assert_eq!(gateway_pods.len(), 1);
    assert!(gateway_pods[0]["namespaceSelector"].is_null());
    assert_eq!(
        str_of(
            &gateway_pods[0]["podSelector"]["matchLabels"]["gateway.networking.k8s.io/gateway-name"]
        ),
        str_of(&by_kind["Gateway"]["metadata"]["name"])
    );
    assert_eq!(
        only_port(&rules[1]),
        u64::from(config.metrics_listen.port())
    );
    let monitoring = sources(&rules[1]);
    assert_eq!(monitoring.len(), 1);
    assert!(monitoring[0]["podSelector"].is_null());
    assert_eq!(
        str_of(&monitoring[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]),
        "monitoring"
    );
}

// ---------------------------------------------------------------------------------------------------
// A live Envoy with the picker down

/// A worker stand-in: answers every request with 200 and says who it is and which routing headers and
/// how many body bytes reached it (`x-seen-cachepick`: the names of every `x-cachepick-*` header it
/// received, comma-separated, or `-`).
async fn echo_worker() -> SocketAddr {
    serve_loopback(|addr, request| async move {
        let seen = |name: &str| {
            request
                .headers()
                .get(name)
                .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                .unwrap_or_else(|| "-".to_owned())
        };
        let destination = seen(DESTINATION);
        let decision = seen(DECISION_HEADER);
        let owned: Vec<&str> = request
            .headers()
            .keys()
            .map(|name| name.as_str())
            .filter(|name| name.starts_with(OWNED_PREFIX))
            .collect();
        let owned = if owned.is_empty() {
            "-".to_owned()
        } else {
            owned.join(",")
        };
        let bytes = request
            .into_body()
            .collect()
            .await
            .map(|body| body.to_bytes().len())
            .unwrap_or(0);
        Response::builder()
            .header("x-served-by", addr.to_string())
            .header("x-seen-destination", destination)
            .header("x-seen-decision", decision)
            .header("x-seen-cachepick", owned)
            .header("x-body-bytes", bytes.to_string())
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    })
    .await
}

/// A stand-in HTTP/1.1 server on a fresh loopback port: every request gets `answer(its address, the
/// request)`. Returns the address; the server runs until the test's runtime ends.
async fn serve_loopback<F, Fut, B>(answer: F) -> SocketAddr
where
    F: Fn(SocketAddr, Request<Incoming>) -> Fut + Copy + Send + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = service_fn(move |request: Request<Incoming>| {
                let answered = answer(addr, request);
                async move { Ok::<_, Infallible>(answered.await) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

struct Answer {
    status: StatusCode,
    headers: hyper::HeaderMap,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }
}

async fn post(envoy: &envoy::Envoy, headers: &[(&str, &str)], body: Vec<u8>) -> Answer {
    let mut request = Request::post(format!(
        "http://{}/v1/chat/completions",
        envoy.listener_addr()
    ))
    .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body))).unwrap();
    let response = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        envoy::client().request(request),
    )
    .await
    .expect("Envoy answers within 10 s")
    .unwrap_or_else(|error| {
        panic!(
            "request through Envoy failed: {error}\n{}",
            envoy.log_tail()
        )
    });
    let status = response.status();
    let headers = response.headers().clone();
    let _ = response.into_body().collect().await;
    Answer { status, headers }
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;

/// Two live workers, one dead one (unless `dead` is false), and a picker address where nothing listens
/// once Envoy has started ([`start`] serves the roster's EDS there until then).
struct Fleet {
    config: Config,
    live: Vec<SocketAddr>,
    dead: SocketAddr,
    /// The picker's port, bound but not listening until [`start`] takes it.
    picker: Option<tokio::net::TcpSocket>,
    /// Keeps the dead worker's port bound but not listening: connections to it are refused, and no
    /// other process can take it while the test runs.
    _dead: tokio::net::TcpSocket,
}

fn reserve() -> (tokio::net::TcpSocket, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, addr)
}

async fn fleet_down_picker(max_body: &str, dead: bool) -> Fleet {
    let live = vec![echo_worker().await, echo_worker().await];
    let (dead_socket, dead_addr) = reserve();
    let (picker_socket, picker) = reserve();
    let mut yaml = format!(
        "listen: \"{picker}\"\nmax_body_bytes: {max_body}\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {{endpoint: \"{}\"}}\n      - {{endpoint: \"{}\"}}\n",
        live[0], live[1]
    );
    if dead {
        yaml.push_str(&format!("      - {{endpoint: \"{dead_addr}\"}}\n"));
    }
    Fleet {
        config: parse_config(&yaml),
        live,
        dead: dead_addr,
        picker: Some(picker_socket),
        _dead: dead_socket,
    }
}

/// cachepick's EDS alone on `socket` (no ext_proc, no health: to Envoy's ext_proc the picker is down),
/// serving `config`'s roster as the app would, until the returned task is aborted.
fn roster_only_picker(
    socket: tokio::net::TcpSocket,
    config: &Config,
) -> tokio::task::JoinHandle<()> {
    let (assignments, follower) = eds::follow(PoolLoad::for_pools(config));
    let listener = socket.listen(64).unwrap();
    tokio::spawn(async move {
        let _follower = follower;
        let _ = tonic::transport::Server::builder()
            .add_service(eds::server(assignments))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    })
}

/// Envoy in front of `fleet` in `mode`. In the override_host modes the workers cluster is EDS: the
/// picker's address serves the roster until Envoy has it (Envoy's listener waits for the first answer),
/// then stops listening, so the picker is down for every request, as it is when a picker dies after
/// Envoy has its roster (Envoy keeps the last roster through the outage).
async fn start(fleet: &mut Fleet, mode: BodyMode) -> envoy::Envoy {
    let config = &fleet.config;
    let options = EnvoyOptions {
        mode,
        listen: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        admin: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        ..EnvoyOptions::for_config(config)
    };
    let picker = (mode != BodyMode::OriginalDst)
        .then(|| roster_only_picker(fleet.picker.take().unwrap(), config));
    let envoy = envoy::Envoy::start(&envoy_config::render(config, &options)).await;
    if let Some(picker) = picker {
        picker.abort();
    }
    envoy
}

/// The promise of the override_host modes: with the picker down, Envoy still serves every request from
/// the fleet (least-request, retried off a dead worker), and a client's routing headers steer nothing.
async fn picker_outage_degrades_to_load_balancing(mode: BodyMode) {
    let mut fleet = fleet_down_picker("64KiB", true).await;
    let envoy = start(&mut fleet, mode).await;
    let (live, dead) = (&fleet.live, fleet.dead);
    let live_names: BTreeSet<String> = live.iter().map(ToString::to_string).collect();
    let mut served: BTreeMap<String, usize> = BTreeMap::new();
    let mut total = 0;

    for _ in 0..20 {
        let answer = post(&envoy, &[], CHAT.to_vec()).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "mode {mode}: {}",
            envoy.log_tail()
        );
        assert!(
            live_names.contains(answer.header("x-served-by")),
            "served by {}",
            answer.header("x-served-by")
        );
        assert_eq!(answer.header("x-body-bytes"), CHAT.len().to_string());
        *served
            .entry(answer.header("x-served-by").to_owned())
            .or_default() += 1;
        total += 1;
    }

    // A client naming a host outside the pool (and forging a decision, cachepick's other headers, and
    // any header in cachepick's prefix) is served from the pool, and none of those headers reaches the
    // worker.
    for _ in 0..10 {
        let answer = post(
            &envoy,
            &[
                (DESTINATION, "10.1.2.3:80"),
                (DECISION_HEADER, "cache_hit"),
                (SELECTED_HEADER, "10.1.2.3:80"),
                ("x-cachepick-prefix-tokens", "4096"),
                ("x-cachepick-anything", "forged"),
                ("X-CachePick-Mixed-Case", "forged"),
            ],
            CHAT.to_vec(),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert!(live_names.contains(answer.header("x-served-by")));
        assert_eq!(answer.header("x-seen-destination"), "-");
        assert_eq!(answer.header("x-seen-decision"), "-");
        assert_eq!(answer.header("x-seen-cachepick"), "-");
        total += 1;
    }
    // Naming a member (or the dead worker) steers nothing either: the header is gone before the
    // load balancer looks.
    let steer_to = live[0].to_string();
    let mut steered = BTreeMap::<String, usize>::new();
    for _ in 0..20 {
        let answer = post(&envoy, &[(DESTINATION, steer_to.as_str())], CHAT.to_vec()).await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.header("x-seen-destination"), "-");
        *steered
            .entry(answer.header("x-served-by").to_owned())
            .or_default() += 1;
        *served
            .entry(answer.header("x-served-by").to_owned())
            .or_default() += 1;
        total += 1;
    }
    assert!(
        steered.len() == 2,
        "a client header steered every request: {steered:?}"
    );
    let answer = post(
        &envoy,
        &[(DESTINATION, dead.to_string().as_str())],
        CHAT.to_vec(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    total += 1;
    assert_eq!(
        served.keys().cloned().collect::<BTreeSet<_>>(),
        live_names,
        "both workers serve: {served:?}"
    );

    // Envoy's own account: every request failed open, none carried a decision, so all are `other`.
    let stats = envoy.stats().await;
    let stat = |name: &str| envoy::parse_stat(&stats, name);
    assert_eq!(
        stat("http.ingress_http.ext_proc.failure_mode_allowed"),
        Some(total),
        "{stats}"
    );
    assert_eq!(
        stat("vhost.llm.vcluster.other.upstream_rq_total"),
        Some(total)
    );
    for decision in Reason::ALL
        .iter()
        .map(|reason| reason.as_str())
        .chain([PASSTHROUGH])
    {
        let name = format!("vhost.llm.vcluster.{decision}.upstream_rq_total");
        assert_eq!(stat(&name).unwrap_or(0), 0, "{name}");
    }
    // Unanswered requests take the fail-open route: its aggregate counts the retries, the workers
    // cluster under it the connections that failed.
    assert_eq!(
        stat("cluster.workers.upstream_cx_connect_fail").unwrap_or(0),
        stat(&format!("cluster.{FAIL_OPEN_CLUSTER}.upstream_rq_retry")).unwrap_or(0),
        "{}",
        stats
            .lines()
            .filter(|line| line.contains("retry") || line.contains("connect_fail"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let prometheus = envoy.prometheus().await;
    assert!(
        prometheus.contains("envoy_virtual_cluster=\"other\""),
        "no per-vcluster series in /stats/prometheus"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_serves_through_a_picker_outage() {
    picker_outage_degrades_to_load_balancing(BodyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplex_mode_serves_through_a_picker_outage() {
    picker_outage_degrades_to_load_balancing(BodyMode::Duplex).await;
}

/// With the picker down nothing buffers the body, so a body above max_body_bytes reaches a worker too:
/// neither Envoy's 413 (buffered mode) nor cachepick's applies. Fail-open is pass-through. (Such a body
/// is also beyond the route's retry buffer: Envoy cannot retry it, which is why this fleet has no dead
/// worker.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_open_passes_bodies_above_max_body_bytes_through() {
    for mode in [BodyMode::Buffered, BodyMode::Duplex] {
        let mut fleet = fleet_down_picker("64KiB", false).await;
        let envoy = start(&mut fleet, mode).await;
        let live = &fleet.live;
        let answer = post(&envoy, &[], vec![b' '; 100 << 10]).await;
        assert_eq!(answer.status, StatusCode::OK, "mode {mode}");
        assert!(
            live.iter()
                .any(|addr| addr.to_string() == answer.header("x-served-by"))
        );
        assert_eq!(answer.header("x-body-bytes"), (100 << 10).to_string());
    }
}

/// A worker stand-in that answers every request with an SSE stream of `events` events, `gap` apart.
async fn streaming_worker(events: usize, gap: Duration) -> SocketAddr {
    serve_loopback(move |_, request| async move {
        let _ = request.into_body().collect().await;
        let frames = futures_util::stream::unfold(0, move |sent| async move {
            if sent == events {
                return None;
            }
            if sent > 0 {
                tokio::time::sleep(gap).await;
            }
            let event = Bytes::from(format!("data: {sent}\n\n"));
            Some((Ok::<_, Infallible>(Frame::data(event)), sent + 1))
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(StreamBody::new(frames))
            .unwrap()
    })
    .await
}

/// Writes `head` to Envoy's listener, then `drip` one chunk every 300 ms (ignoring write errors: Envoy
/// may close first), and returns what Envoy answered within 5 s after the last write, and when.
async fn trickle(
    addr: SocketAddr,
    head: &'static [u8],
    drip: Vec<&'static [u8]>,
) -> (String, Duration) {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let started = Instant::now();
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.write_all(head).unwrap();
        for chunk in &drip {
            std::thread::sleep(Duration::from_millis(300));
            if stream.write_all(chunk).is_err() {
                break;
            }
        }
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        (
            String::from_utf8_lossy(&answer).into_owned(),
            started.elapsed(),
        )
    })
    .await
    .unwrap()
}

/// The connection manager's receive-side deadlines bound only receiving the request. A response that
/// streams for longer than request_timeout is not cut (Envoy disarms it once the request has gone
/// upstream), while a client that trickles its body gets 408 and one that trickles its headers is cut
/// off. Shown with the deadlines shortened to 2 s (request) and 1 s (headers): apart, so that a client
/// trickling its headers meets the headers deadline first, rather than racing the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_deadlines_cut_slow_clients_but_not_long_responses() {
    let worker = streaming_worker(7, Duration::from_millis(500)).await;
    let (picker_socket, picker) = reserve();
    let config = parse_config(&format!(
        "listen: \"{picker}\"\nmax_body_bytes: 64KiB\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {{endpoint: \"{worker}\"}}\n"
    ));
    let _roster = roster_only_picker(picker_socket, &config);
    let options = EnvoyOptions {
        listen: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        admin: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        ..EnvoyOptions::for_config(&config)
    };
    let generated = envoy_config::render(&config, &options);
    let shortened = generated
        .replace("request_timeout: 60s\n", "request_timeout: 2s\n")
        .replace(
            "request_headers_timeout: 10s\n",
            "request_headers_timeout: 1s\n",
        );
    assert_eq!(
        shortened.len() + 2,
        generated.len(),
        "both deadlines shortened"
    );
    let envoy = envoy::Envoy::start(&shortened).await;

    // A 3 s stream, longer than request_timeout, arrives whole.
    let request = Request::post(format!(
        "http://{}/v1/chat/completions",
        envoy.listener_addr()
    ))
    .header("content-type", "application/json")
    .body(Full::new(Bytes::from_static(CHAT)))
    .unwrap();
    let started = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(10), envoy::client().request(request))
        .await
        .expect("Envoy answers within 10 s")
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK, "{}", envoy.log_tail());
    let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
        .await
        .expect("the stream ends within 10 s")
        .expect("the stream is not cut")
        .to_bytes();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(2_900),
        "the stream took {elapsed:?}"
    );
    let text = String::from_utf8_lossy(&body);
    assert_eq!(text.matches("data: ").count(), 7, "{text}");
    assert!(text.ends_with("data: 6\n\n"), "{text}");

    // A body that trickles in over 3 s: 408 after about 2 s, and the worker never sees it.
    let (answer, took) = trickle(
        envoy.listener_addr(),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
        vec![&b"\"a\": 1,"[..]; 10],
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Headers that trickle in: the connection is closed after about 1 s.
    let (_, took) = trickle(
        envoy.listener_addr(),
        b"POST /v1/chat/completions HTTP/1.1\r\n",
        vec![&b"x-slow: 1\r\n"[..]; 10],
    )
    .await;
    assert!(took < Duration::from_secs(5), "{took:?}");

    let stats = envoy.stats().await;
    let stat = |name: &str| envoy::parse_stat(&stats, name);
    assert_eq!(
        stat("http.ingress_http.downstream_rq_timeout"),
        Some(1),
        "{stats}"
    );
    assert_eq!(
        stat("http.ingress_http.downstream_rq_header_timeout"),
        Some(1),
        "{stats}"
    );
    assert_eq!(
        stat("http.ingress_http.downstream_rq_2xx"),
        Some(1),
        "{stats}"
    );
}

/// ORIGINAL_DST has no fallback: with the picker down, requests get 503 — and a client-sent destination,
/// even a live worker, is dropped before Envoy could connect to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_mode_fails_closed_without_the_picker_and_ignores_client_destinations() {
    let mut fleet = fleet_down_picker("64KiB", false).await;
    let envoy = start(&mut fleet, BodyMode::OriginalDst).await;
    let live = &fleet.live;
    let answer = post(&envoy, &[], CHAT.to_vec()).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    let answer = post(
        &envoy,
        &[(DESTINATION, live[0].to_string().as_str())],
        CHAT.to_vec(),
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a client steered ORIGINAL_DST"
    );
    assert_eq!(
        envoy
            .stat("http.ingress_http.ext_proc.failure_mode_allowed")
            .await,
        Some(2)
    );
}

/// ORIGINAL_DST connects to a single `ip:port`: it reads the selected worker alone from
/// `x-cachepick-endpoint`, never the list in `x-gateway-destination-endpoint` (selected worker, then
/// fallbacks), which it could not parse. Shown with the client-header filter disarmed (it removes a
/// header nobody sends instead), so the test can play cachepick's part and set both headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_reads_the_selected_endpoint_not_the_fallback_list() {
    let fleet = fleet_down_picker("64KiB", false).await;
    let (config, live) = (&fleet.config, &fleet.live);
    let options = EnvoyOptions {
        mode: BodyMode::OriginalDst,
        listen: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        admin: format!("127.0.0.1:{}", envoy::free_port()).parse().unwrap(),
        ..EnvoyOptions::for_config(config)
    };
    let generated = envoy_config::render(config, &options);
    let guards = [
        format!("- remove: {DESTINATION}\n"),
        format!("- remove_on_match: {{key_matcher: {{prefix: \"{OWNED_PREFIX}\"}}}}\n"),
    ];
    let mut unguarded = generated.clone();
    for guard in &guards {
        assert_eq!(generated.matches(guard.as_str()).count(), 1, "{guard}");
        unguarded = unguarded.replace(guard.as_str(), "- remove: x-not-sent-by-anyone\n");
    }
    let envoy = envoy::Envoy::start(&unguarded).await;

    let one = live[1].to_string();
    let list = format!("{},{}", live[0], live[1]);
    let answer = post(
        &envoy,
        &[
            (SELECTED_HEADER, one.as_str()),
            (DESTINATION, list.as_str()),
        ],
        CHAT.to_vec(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.header("x-served-by"),
        one,
        "the selected endpoint, not the list's first"
    );
}

//! The security keys: `tls`, `load.tls` and https scrape URLs, `debug_endpoints` by listener,
//! `debug_token_file`, and `metrics_http`, decoded, emitted back and every problem reported at once.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use super::super::*;

const POOL: &str =
    "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";

fn config(head: &str) -> Config {
    super::accepted(&format!("{head}{POOL}"), &Overrides::default())
}

/// Every problem of `source`, as `path (line n): message`.
fn messages(source: &str) -> Vec<String> {
    super::messages(source, &Overrides::default())
}

fn round_trips(config: &Config) {
    let yaml = config.to_yaml();
    assert_eq!(
        &parse(&yaml, "emitted", &Overrides::default()).unwrap(),
        config,
        "{yaml}"
    );
}

#[test]
fn listener_tls_is_off_by_default_and_read_whole() {
    let plain = config("");
    assert_eq!(plain.tls, None);
    assert_eq!(plain.load.tls, None);
    assert_eq!(plain.debug_token_file, None);
    assert_eq!(plain.metrics_http, HttpLimits::default());

    let tls = config(
        "tls:\n  cert_file: /tls/tls.crt\n  key_file: /tls/tls.key\n  client_ca_file: /tls/ca.crt\n",
    );
    assert_eq!(
        tls.tls,
        Some(ServerFiles {
            cert_file: PathBuf::from("/tls/tls.crt"),
            key_file: PathBuf::from("/tls/tls.key"),
            client_ca_file: Some(PathBuf::from("/tls/ca.crt")),
            allowed_client_identities: Vec::new(),
            reload_interval: Duration::from_secs(60),
        })
    );
    round_trips(&tls);
    let no_mtls = config("tls: {cert_file: a.crt, key_file: a.key, reload_interval: 10s}\n");
    let no_mtls = no_mtls.tls.unwrap();
    assert_eq!(no_mtls.client_ca_file, None);
    assert_eq!(no_mtls.reload_interval, Duration::from_secs(10));

    let problems = messages(&format!(
        "tls:\n  cert_file: a.crt\n  client_ca: ca.crt\n{POOL}"
    ));
    assert!(
        problems
            .iter()
            .any(|p| p.contains("tls.client_ca (line 3): unknown key")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("tls.key_file (line 1): missing required key")),
        "{problems:?}"
    );
}

#[test]
fn allowed_client_identities_need_client_certificates_and_are_listed_whole() {
    let listed = config(
        "tls:\n  cert_file: t.crt\n  key_file: t.key\n  client_ca_file: ca.crt\n  allowed_client_identities: [spiffe://cluster.local/ns/gateway/sa/envoy, envoy.gateway.svc, 10.0.0.7]\n",
    );
    let tls = listed.tls.as_ref().unwrap();
    assert_eq!(
        tls.allowed_client_identities,
        [
            "spiffe://cluster.local/ns/gateway/sa/envoy",
            "envoy.gateway.svc",
            "10.0.0.7"
        ]
    );
    round_trips(&listed);

    let problems = messages(&format!(
        "tls:\n  cert_file: t.crt\n  key_file: t.key\n  allowed_client_identities: [envoy.gateway.svc]\n{POOL}"
    ));
    assert!(
        problems
            .iter()
            .any(|p| p.contains("allowed_client_identities needs client_ca_file")),
        "{problems:?}"
    );
    let many: Vec<String> = (0..=32).map(|n| format!("c{n}.test")).collect();
    for (list, expected) in [
        ("[]".to_owned(), "list 1 to 32 identities"),
        (format!("[{}]", many.join(", ")), "list 1 to 32 identities"),
        (
            "[\"envoy gateway\", \"\"]".to_owned(),
            "`envoy gateway` is not an identity",
        ),
        (
            "envoy.gateway.svc".to_owned(),
            "a list of certificate identities",
        ),
    ] {
        let problems = messages(&format!(
            "tls:\n  cert_file: t.crt\n  key_file: t.key\n  client_ca_file: ca.crt\n  allowed_client_identities: {list}\n{POOL}"
        ));
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{list}: {problems:?}"
        );
    }
    // Both bad entries are reported, not only the first.
    let problems = messages(&format!(
        "tls:\n  cert_file: t.crt\n  key_file: t.key\n  client_ca_file: ca.crt\n  allowed_client_identities: [\"a b\", ok.test, \"c d\"]\n{POOL}"
    ));
    assert_eq!(
        problems
            .iter()
            .filter(|p| p.contains("is not an identity"))
            .count(),
        2,
        "{problems:?}"
    );
}

#[test]
fn https_scrape_urls_need_load_tls_and_name_the_worker() {
    let https_worker = "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n        metrics_url: https://10.0.0.1:8443/metrics\n";
    let problems = messages(https_worker);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with(
            "pools[0].workers[0].metrics_url (line 6): `https://10.0.0.1:8443/metrics` is https"
        ) && problems[0].contains("load.tls.ca_file"),
        "{problems:?}"
    );

    let source = format!(
        "load:\n  tls:\n    ca_file: /ca/bundle.pem\n    cert_file: /ca/c.crt\n    key_file: /ca/c.key\n    server_name: vllm.llm.svc\n{https_worker}"
    );
    let config = parse(&source, "t", &Overrides::default()).unwrap();
    assert_eq!(
        config.pools[0].workers[0].metrics_url,
        "https://10.0.0.1:8443/metrics"
    );
    let tls = config.load.tls.clone().unwrap();
    assert_eq!(tls.files.ca_file, PathBuf::from("/ca/bundle.pem"));
    assert_eq!(
        tls.files.identity,
        Some((PathBuf::from("/ca/c.crt"), PathBuf::from("/ca/c.key")))
    );
    assert_eq!(tls.server_name.as_deref(), Some("vllm.llm.svc"));
    round_trips(&config);

    let problems = messages(&format!(
        "load:\n  tls:\n    cert_file: c.crt\n    server_name: \"not a name\"\n{POOL}"
    ));
    for expected in [
        "load.tls.ca_file (line 2): missing required key",
        "load.tls.cert_file (line 3): cert_file needs key_file",
        "load.tls.server_name (line 4): `not a name` is not a DNS name or IP address",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected} not in {problems:?}"
        );
    }
}

#[test]
fn debug_endpoints_default_to_loopback_listeners_only() {
    let local = config("");
    assert_eq!(local.debug_endpoints, None);
    assert!(local.debug_on_listen() && local.debug_on_metrics());
    assert!(local.exposed_debug().is_empty());

    let pod = config("listen: 0.0.0.0:9002\nmetrics_listen: 0.0.0.0:9090\n");
    assert!(!pod.debug_on_listen() && !pod.debug_on_metrics());
    let mixed = config("listen: 0.0.0.0:9002\n");
    assert!(!mixed.debug_on_listen() && mixed.debug_on_metrics());
    let v6 = config("listen: \"[::1]:9002\"\nmetrics_listen: \"[::]:9090\"\n");
    assert!(v6.debug_on_listen() && !v6.debug_on_metrics());

    let forced = config("listen: 0.0.0.0:9002\ndebug_endpoints: true\n");
    assert!(forced.debug_on_listen() && forced.debug_on_metrics());
    assert_eq!(
        forced.exposed_debug(),
        [("listen", "0.0.0.0:9002".parse().unwrap())]
    );
    round_trips(&forced);
    let guarded = config(
        "listen: 0.0.0.0:9002\ndebug_endpoints: true\ndebug_token_file: /secrets/debug-token\n",
    );
    assert!(guarded.exposed_debug().is_empty());
    assert_eq!(
        guarded.debug_token_file,
        Some(PathBuf::from("/secrets/debug-token"))
    );
    round_trips(&guarded);
    let off = config("debug_endpoints: false\n");
    assert!(!off.debug_on_listen() && !off.debug_on_metrics());
}

#[test]
fn metrics_http_bounds_are_checked() {
    let given = config(
        "metrics_http:\n  max_connections: 8\n  header_read_timeout: 2s\n  request_timeout: 10s\n  connection_lifetime: 1m\n",
    );
    assert_eq!(
        given.metrics_http,
        HttpLimits {
            max_connections: NonZeroUsize::new(8).unwrap(),
            header_read_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            connection_lifetime: Duration::from_secs(60),
        }
    );
    round_trips(&given);
    let problems = messages(&format!(
        "metrics_http:\n  max_connections: 5000\n  header_read_timeout: 0s\n  request_timeout: 1m\n  connection_lifetime: 30s\n  idle: 1s\n{POOL}"
    ));
    for expected in [
        "metrics_http.max_connections (line 2): must be at most 512",
        "metrics_http.header_read_timeout (line 3): must be greater than 0",
        "metrics_http.connection_lifetime (line 5): connection_lifetime must be at least request_timeout (1m)",
        "metrics_http.idle (line 6): unknown key",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected} not in {problems:?}"
        );
    }
}

#[test]
fn discovered_workers_are_scraped_over_https_with_scrape_scheme() {
    let dns = "pools:\n  - model: m\n    engine: sglang\n    dns: {name: sglang.llm.svc, port: 30000}\n    template: {scrape_scheme: https, load_source: loads}\n";
    let problems = messages(dns);
    assert_eq!(
        problems,
        [
            "pools[0].template.scrape_scheme (line 5): scrape_scheme: https needs load.tls (a ca_file to verify the engines with)"
        ]
    );
    let source = format!("load: {{tls: {{ca_file: /ca.crt, server_name: sglang.llm.svc}}}}\n{dns}");
    let config = parse(&source, "t", &Overrides::default()).unwrap();
    let worker = config.pools[0]
        .template
        .worker("10.1.2.3:30000".parse().unwrap());
    assert_eq!(worker.metrics_url, "https://10.1.2.3:30000/metrics");
    assert_eq!(
        worker.loads_url.as_deref(),
        Some("https://10.1.2.3:30000/v1/loads")
    );
    round_trips(&config);
    let plain = parse(
        "pools:\n  - model: m\n    engine: vllm\n    dns: {name: v.llm.svc, port: 8000}\n",
        "t",
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(
        plain.pools[0]
            .template
            .worker("10.1.2.3:8000".parse().unwrap())
            .metrics_url,
        "http://10.1.2.3:8000/metrics"
    );
    let bad = messages(
        "pools:\n  - model: m\n    engine: vllm\n    dns: {name: v.llm.svc, port: 8000}\n    template: {scrape_scheme: ftp}\n",
    );
    assert!(bad[0].contains("expected one of: http, https"), "{bad:?}");
}

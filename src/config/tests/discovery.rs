//! Discovery in the configuration: `dns:`, `kubernetes:`, `template:` and `max_workers` decoded, and
//! every problem they can have reported with its path and line.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use super::super::*;
use crate::worker::Role;

const HEAD: &str = "pools:\n  - model: m\n    engine: vllm\n";

fn pool(extra: &str) -> PoolConfig {
    super::accepted(&format!("{HEAD}{extra}"), &Overrides::default())
        .pools
        .remove(0)
}

/// Every problem of `HEAD` + `extra`, as `path (line n): message`.
fn messages(extra: &str) -> Vec<String> {
    super::messages(&format!("{HEAD}{extra}"), &Overrides::default())
}

#[test]
fn a_dns_pool_takes_its_defaults() {
    let pool = pool("    dns: {name: vllm.llm.svc.cluster.local, port: 8000}\n");
    assert_eq!(
        pool.discovery,
        Discovery::Dns(DnsDiscovery {
            name: "vllm.llm.svc.cluster.local".into(),
            port: 8000,
            interval: DnsDiscovery::DEFAULT_INTERVAL,
            server: None,
        })
    );
    assert_eq!(pool.discovery.kind(), "dns");
    assert!(
        pool.workers.is_empty(),
        "a discovered pool lists no workers"
    );
    assert_eq!(pool.template, WorkerTemplate::default());
    assert_eq!(pool.max_workers.get(), PoolConfig::DEFAULT_MAX_WORKERS);
}

#[test]
fn a_dns_pool_reads_every_key_and_its_template() {
    let pool = pool(
        "    dns: {name: vllm.llm.svc, port: 8000, interval: 2s, server: 127.0.0.1:5353}\n    \
         template: {role: prefill, dp_size: 2, load_source: metrics, max_running_requests: 64, \
         max_total_tokens: 100000}\n    index: {port: 6000, replay_port: 6001}\n    max_workers: 8\n",
    );
    assert_eq!(
        pool.discovery,
        Discovery::Dns(DnsDiscovery {
            name: "vllm.llm.svc".into(),
            port: 8000,
            interval: Duration::from_secs(2),
            server: Some("127.0.0.1:5353".parse::<SocketAddr>().unwrap()),
        })
    );
    assert_eq!(
        pool.template,
        WorkerTemplate {
            load_source: LoadSource::Metrics,
            role: Role::Prefill,
            dp_size: NonZeroU32::new(2).unwrap(),
            max_running_requests: NonZeroU64::new(64),
            max_total_tokens: NonZeroU64::new(100_000),
            kv_events_port: 6000,
            kv_replay_port: Some(6001),
            kv_events_from: KvEventsFrom::Engine,
            scrape_https: false,
        }
    );
    assert_eq!(pool.max_workers, NonZeroUsize::new(8).unwrap());
}

#[test]
fn a_kubernetes_pool_takes_a_selector_with_ports_or_an_inference_pool() {
    let by_selector =
        pool("    kubernetes: {selector: 'app=vllm,tier=gpu', ports: [8000, 8001]}\n");
    assert_eq!(
        by_selector.discovery,
        Discovery::Kubernetes(KubernetesDiscovery {
            namespace: None,
            pods: PodSelection::Selector("app=vllm,tier=gpu".into()),
            ports: vec![8000, 8001],
        })
    );
    assert_eq!(by_selector.discovery.kind(), "kubernetes");

    let by_pool = pool("    kubernetes: {namespace: llm, inference_pool: chat}\n");
    assert_eq!(
        by_pool.discovery,
        Discovery::Kubernetes(KubernetesDiscovery {
            namespace: Some("llm".into()),
            pods: PodSelection::InferencePool("chat".into()),
            ports: Vec::new(),
        })
    );
    let with_ports = pool("    kubernetes: {inference_pool: chat, ports: [7000]}\n");
    assert!(matches!(
        with_ports.discovery,
        Discovery::Kubernetes(KubernetesDiscovery { ref ports, .. }) if *ports == [7000]
    ));
}

#[test]
fn an_sglang_template_may_read_loads() {
    let source = "pools:\n  - model: m\n    engine: sglang\n    dns: {name: a, port: 30000}\n    \
                  template: {load_source: loads}\n";
    let config = parse(source, "t", &Overrides::default()).unwrap();
    let template = &config.pools[0].template;
    assert_eq!(template.load_source, LoadSource::Loads);
    let worker = template.worker("127.0.0.1:30000".parse().unwrap());
    assert_eq!(
        worker.loads_url.as_deref(),
        Some("http://127.0.0.1:30000/v1/loads")
    );
}

#[test]
fn the_file_pool_still_defaults_to_its_workers() {
    let pool = pool("    workers: [{endpoint: 10.0.0.1:8000}]\n    max_workers: 4\n");
    assert_eq!(pool.discovery, Discovery::Static);
    assert_eq!(pool.discovery.kind(), "file");
    assert_eq!(pool.workers.len(), 1);
    assert_eq!(pool.max_workers.get(), 4);
}

#[test]
fn every_discovery_problem_is_reported_with_its_place() {
    let sources = "a pool's workers come from exactly one of workers, dns or kubernetes";
    #[rustfmt::skip]
    let cases: &[(&str, &str, &[&str])] = &[
        ("dns and kubernetes",
         "    dns: {name: a, port: 8000}\n    kubernetes: {selector: app=vllm, ports: [8000]}\n",
         &["pools[0] (line 2): dns and kubernetes are given: "]),
        ("workers and dns",
         "    workers: [{endpoint: 10.0.0.1:8000}]\n    dns: {name: a, port: 8000}\n",
         &["pools[0] (line 2): workers and dns are given: "]),
        ("selector and inference_pool",
         "    kubernetes: {selector: app=vllm, inference_pool: chat, ports: [8000]}\n",
         &["pools[0].kubernetes.selector (line 4): selector and inference_pool are both given: the \
            InferencePool's own selector chooses its pods"]),
        ("selector without ports",
         "    kubernetes: {selector: app=vllm}\n",
         &["pools[0].kubernetes.ports (line 4): missing: the engines' ports on each pod (an \
            InferencePool names its targetPorts; a selector does not)"]),
        ("neither selector nor inference_pool",
         "    kubernetes: {namespace: llm}\n",
         &["pools[0].kubernetes.selector (line 4): missing: a label selector (selector) or an \
            InferencePool's name (inference_pool)"]),
        ("template on a file pool",
         "    workers: [{endpoint: 10.0.0.1:8000}]\n    template: {role: prefill}\n",
         &["pools[0].template (line 5): template is read only for discovered workers (dns or \
            kubernetes); give the file's workers their keys each"]),
        ("template role decode",
         "    dns: {name: a, port: 8000}\n    template: {role: decode}\n",
         &["pools[0].template (line 5): role decode for every discovered worker: every request to \
            this pool would be refused"]),
        ("dns port 0",
         "    dns: {name: a, port: 0}\n",
         &["pools[0].dns.port (line 4): expected a port from 1 to 65535, got `0`"]),
        ("dns port too large",
         "    dns: {name: a, port: 70000}\n",
         &["pools[0].dns.port (line 4): expected a port from 1 to 65535, got `70000`"]),
        ("kubernetes port by name",
         "    kubernetes: {selector: app=vllm, ports: [8000, http]}\n",
         &["pools[0].kubernetes.ports[1] (line 4): expected a non-negative integer, got `http`"]),
        ("kubernetes ports not a list",
         "    kubernetes: {selector: app=vllm, ports: 8000}\n",
         &["pools[0].kubernetes.ports (line 4): expected a list of ports, got `8000`"]),
        ("dns without name",
         "    dns: {port: 8000}\n",
         &["pools[0].dns.name (line 4): missing required key"]),
        ("dns interval zero",
         "    dns: {name: a, port: 8000, interval: 0s}\n",
         &["pools[0].dns.interval (line 4): must be greater than 0"]),
        ("dns server by name",
         "    dns: {name: a, port: 8000, server: dns.local}\n",
         &["pools[0].dns.server (line 4): expected ip:port such as 10.0.0.11:8000 (an IP address, \
            not a host name), got `dns.local`"]),
        ("unknown dns key",
         "    dns: {name: a, port: 8000, ttl: 5}\n",
         &["pools[0].dns.ttl (line 4): unknown key; expected one of: name, port, interval, server"]),
        ("unknown template key",
         "    dns: {name: a, port: 8000}\n    template: {endpoint: 10.0.0.1:8000}\n",
         &["pools[0].template.endpoint (line 5): unknown key; expected one of: load_source, role, \
            dp_size, max_running_requests, max_total_tokens, scrape_scheme"]),
        ("template loads on vllm",
         "    dns: {name: a, port: 8000}\n    template: {load_source: loads}\n",
         &["pools[0].template.load_source (line 5): load_source: loads reads SGLang's /v1/loads; \
            engine vllm has no such endpoint"]),
        ("max_workers zero",
         "    dns: {name: a, port: 8000}\n    max_workers: 0\n",
         &["pools[0].max_workers (line 5): must be at least 1"]),
        ("more file workers than max_workers",
         "    workers: [{endpoint: 10.0.0.1:8000}, {endpoint: 10.0.0.2:8000}]\n    max_workers: 1\n",
         &["pools[0].workers (line 4): 2 workers listed, more than max_workers (1)"]),
    ];
    for (what, extra, expected) in cases {
        let got = messages(extra);
        assert_eq!(got.len(), expected.len(), "{what}: {got:#?}");
        for (got, expected) in got.iter().zip(expected.iter()) {
            // A message ending in `: ` is a prefix, checked whole below; the rest must match exactly.
            if expected.ends_with(": ") {
                assert!(
                    got.starts_with(expected),
                    "{what}:\n got: {got}\nwant: {expected}…"
                );
            } else {
                assert_eq!(got, expected, "{what}");
            }
        }
        if what.contains(" and ") && !what.contains("selector") {
            assert!(got[0].ends_with(sources), "{what}: {}", got[0]);
        }
    }
}

//! The `kubernetes` discovery source against a fake API server on loopback (`support/fake_kube.rs`):
//! kube's own client and watcher list and watch it over real HTTP.
//!
//! Covered, always by what the source publishes on its watch channel: the first list; a pod turning
//! Ready (joins), flapping NotReady (leaves) and Ready again (rejoins), deleted or terminating (leaves);
//! pods without an IP, terminating, or outside the selector (never workers); a watch expired with 410
//! (the source lists again and catches a change made meanwhile); an InferencePool (its selector and
//! target ports, two ports making two workers per pod, a changed selector or ports, its deletion), in
//! `v1` and, where only that is served, `v1alpha2`; an API server that is down at start (failures
//! counted, nothing published) and then comes up.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
    pub mod fake_kube;
    pub mod serve;
}

use support::{engine, fake_kube, serve};

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use cachepick::config::{KubernetesDiscovery, PodSelection, WorkerTemplate};
use cachepick::discovery::kubernetes::KubernetesSource;
use cachepick::discovery::{Members, SourceState, SourceStatus, endpoints};
use cachepick::worker::Role;
use fake_kube::{
    FakeKube, POOL_V1, POOL_V1ALPHA2, client_for, inference_pool_v1, inference_pool_v1alpha2, pod,
    terminating,
};

/// Far above the watcher's first backoff (0.8 s, jittered); every wait is bounded by it.
const DEADLINE: Duration = Duration::from_secs(20);
const VLLM: &[(&str, &str)] = &[("app", "vllm")];

fn ip(last: u8) -> String {
    format!("127.0.1.{last}")
}

fn at(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port)
}

struct Running {
    members: watch::Receiver<Members>,
    status: Arc<SourceStatus>,
    _stop: oneshot::Sender<()>,
}

fn start_source(
    client: kube::Client,
    namespace: Option<&str>,
    pods: PodSelection,
    ports: &[u16],
    template: &WorkerTemplate,
) -> Running {
    let discovery = KubernetesDiscovery {
        namespace: namespace.map(str::to_owned),
        pods,
        ports: ports.to_vec(),
    };
    let status = SourceStatus::new("kubernetes");
    let source = KubernetesSource::new(&discovery, template, status.clone(), client);
    let (sender, members) = watch::channel(Members::from(Vec::new()));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(source.run(sender, async {
        let _ = stopped.await;
    }));
    Running {
        members,
        status,
        _stop: stop,
    }
}

impl Running {
    /// Waits until the published endpoints are `expected` (in any order).
    async fn published(&mut self, expected: &[SocketAddr]) -> Members {
        let mut want = expected.to_vec();
        want.sort();
        let seen = tokio::time::timeout(
            DEADLINE,
            self.members.wait_for(|members| endpoints(members) == want),
        )
        .await;
        let seen = seen
            .ok()
            .and_then(Result::ok)
            .map(|members| members.clone());
        match seen {
            Some(members) => members,
            None => panic!(
                "expected {want:?} to be published; the set is {:?}, the source {:?}",
                endpoints(&self.members.borrow()),
                self.status.state()
            ),
        }
    }

    async fn status_until(&self, what: &str, done: impl Fn(&SourceState) -> bool) -> SourceState {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let state = self.status.state();
            if done(&state) {
                return state;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: the source's status stayed {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn ready_pods_of_the_selector_are_workers_and_follow_their_readiness() {
    let fake = FakeKube::start().await;
    fake.apply_pod("default", pod("a", VLLM, Some(&ip(1)), true));
    fake.apply_pod("default", pod("b", VLLM, Some(&ip(2)), false));
    fake.apply_pod(
        "default",
        pod("other", &[("app", "sglang")], Some(&ip(9)), true),
    );
    // No namespace configured: the client's default.
    let selector = PodSelection::Selector("app=vllm".to_owned());
    let mut source = start_source(
        fake.client(),
        None,
        selector,
        &[8000],
        &WorkerTemplate::default(),
    );

    let members = source.published(&[at(&ip(1), 8000)]).await;
    assert_eq!(
        *members,
        [WorkerTemplate::default().worker(at(&ip(1), 8000))]
    );
    assert!(
        fake.pod_selectors().iter().all(|s| s == "app=vllm"),
        "{:?}",
        fake.pod_selectors()
    );

    fake.apply_pod("default", pod("b", VLLM, Some(&ip(2)), true));
    source
        .published(&[at(&ip(1), 8000), at(&ip(2), 8000)])
        .await;

    fake.apply_pod("default", pod("b", VLLM, Some(&ip(2)), false));
    source.published(&[at(&ip(1), 8000)]).await;

    fake.apply_pod("default", pod("b", VLLM, Some(&ip(2)), true));
    source
        .published(&[at(&ip(1), 8000), at(&ip(2), 8000)])
        .await;

    fake.delete_pod("default", "a");
    source.published(&[at(&ip(2), 8000)]).await;

    // Never workers: Ready without an IP, Ready but terminating. The pod after them proves they were
    // seen, since a watch delivers in order.
    fake.apply_pod("default", pod("no-ip", VLLM, None, true));
    fake.apply_pod(
        "default",
        terminating(pod("leaving", VLLM, Some(&ip(3)), true)),
    );
    fake.apply_pod("default", pod("c", VLLM, Some(&ip(4)), true));
    source
        .published(&[at(&ip(2), 8000), at(&ip(4), 8000)])
        .await;

    // A worker being deleted leaves as soon as it is terminating.
    fake.apply_pod("default", terminating(pod("b", VLLM, Some(&ip(2)), true)));
    source.published(&[at(&ip(4), 8000)]).await;

    let state = source.status.state();
    assert_eq!(state.errors, 0, "{state:?}");
    assert_eq!(state.members, 1);
    assert_eq!(fake.lists("pods"), 1, "no error, so no second list");
}

#[tokio::test]
async fn an_expired_watch_lists_again_and_catches_up() {
    let fake = FakeKube::start().await;
    fake.apply_pod("llm", pod("a", VLLM, Some(&ip(11)), true));
    let selector = PodSelection::Selector("app=vllm".to_owned());
    let mut source = start_source(
        fake.client(),
        Some("llm"),
        selector,
        &[8000],
        &WorkerTemplate::default(),
    );
    source.published(&[at(&ip(11), 8000)]).await;
    assert_eq!(fake.lists("pods"), 1);

    // The watch expires and, before the client is back, the pods change: only a new list shows it.
    fake.expire_watches();
    fake.apply_pod("llm", pod("b", VLLM, Some(&ip(12)), true));
    fake.delete_pod("llm", "a");
    source.published(&[at(&ip(12), 8000)]).await;
    assert!(fake.lists("pods") >= 2, "lists: {}", fake.lists("pods"));

    // The watch resumed from the new list follows changes again.
    fake.apply_pod("llm", pod("c", VLLM, Some(&ip(13)), true));
    source
        .published(&[at(&ip(12), 8000), at(&ip(13), 8000)])
        .await;
    let state = source.status.state();
    assert_eq!(state.errors, 0, "an expiry is not a failure: {state:?}");
}

#[tokio::test]
async fn an_inference_pool_names_the_pods_and_their_ports() {
    let fake = FakeKube::start().await;
    let gpu: &[(&str, &str)] = &[("app", "vllm"), ("tier", "gpu")];
    fake.apply_pool(
        POOL_V1,
        "llm",
        inference_pool_v1("chat", gpu, &[8000, 8001]),
    );
    fake.apply_pool(POOL_V1, "llm", inference_pool_v1("other", VLLM, &[9000]));
    fake.apply_pod("llm", pod("p1", gpu, Some(&ip(21)), true));
    fake.apply_pod("llm", pod("p2", VLLM, Some(&ip(22)), true));
    let template = WorkerTemplate {
        role: Role::Prefill,
        dp_size: NonZeroU32::new(2).unwrap(),
        ..WorkerTemplate::default()
    };
    let pool = PodSelection::InferencePool("chat".to_owned());
    let mut source = start_source(fake.client(), Some("llm"), pool, &[], &template);

    // Two target ports: two workers on the one matching pod, each with the template.
    let members = source
        .published(&[at(&ip(21), 8000), at(&ip(21), 8001)])
        .await;
    for worker in members.iter() {
        assert_eq!(*worker, template.worker(worker.endpoint));
        assert_eq!(worker.kv_events.live.ip(), worker.endpoint.ip());
    }
    assert!(
        fake.pod_selectors()
            .iter()
            .all(|s| s == "app=vllm,tier=gpu"),
        "{:?}",
        fake.pod_selectors()
    );

    // New ports republish the same pods.
    fake.apply_pool(POOL_V1, "llm", inference_pool_v1("chat", gpu, &[8002]));
    source.published(&[at(&ip(21), 8002)]).await;

    // A wider selector watches the pods again.
    fake.apply_pool(POOL_V1, "llm", inference_pool_v1("chat", VLLM, &[8002]));
    source
        .published(&[at(&ip(21), 8002), at(&ip(22), 8002)])
        .await;

    // A pod of the pool flaps like any other.
    fake.apply_pod("llm", pod("p2", VLLM, Some(&ip(22)), false));
    source.published(&[at(&ip(21), 8002)]).await;

    // The pool is deleted: its pods are nobody's workers.
    fake.delete_pool(POOL_V1, "llm", "chat");
    source.published(&[]).await;
    assert_eq!(source.status.state().errors, 0);
}

#[tokio::test]
async fn configured_ports_override_the_pool_and_v1alpha2_is_read_where_only_it_is_served() {
    let fake = FakeKube::start().await;
    fake.serve_pool_versions(&[POOL_V1ALPHA2]);
    fake.apply_pool(
        POOL_V1ALPHA2,
        "llm",
        inference_pool_v1alpha2("chat", VLLM, 8000),
    );
    fake.apply_pod("llm", pod("p1", VLLM, Some(&ip(31)), true));
    let pool = PodSelection::InferencePool("chat".to_owned());

    let mut from_pool = start_source(
        fake.client(),
        Some("llm"),
        pool.clone(),
        &[],
        &WorkerTemplate::default(),
    );
    from_pool.published(&[at(&ip(31), 8000)]).await;

    let mut configured = start_source(
        fake.client(),
        Some("llm"),
        pool,
        &[7000, 7001],
        &WorkerTemplate::default(),
    );
    configured
        .published(&[at(&ip(31), 7000), at(&ip(31), 7001)])
        .await;
}

#[tokio::test]
async fn an_api_server_down_at_start_is_a_failure_until_it_answers() {
    let addr = cachepick_rig::free_port().unwrap();
    let template = WorkerTemplate::default();
    let selector = PodSelection::Selector("app=vllm".to_owned());
    let mut by_selector = start_source(client_for(addr), None, selector, &[8000], &template);
    let pool = PodSelection::InferencePool("chat".to_owned());
    let mut by_pool = start_source(client_for(addr), None, pool, &[], &template);

    for source in [&by_selector, &by_pool] {
        let state = source
            .status_until("the refused request counted", |s| s.errors >= 1)
            .await;
        assert!(state.last_error.is_some(), "{state:?}");
        assert!(
            !source.members.has_changed().unwrap(),
            "published with no answer"
        );
        assert!(source.members.borrow().is_empty());
    }

    let fake = FakeKube::start_on(addr).await;
    fake.apply_pod("default", pod("a", VLLM, Some(&ip(41)), true));
    fake.apply_pool(POOL_V1, "default", inference_pool_v1("chat", VLLM, &[9000]));
    by_selector.published(&[at(&ip(41), 8000)]).await;
    by_pool.published(&[at(&ip(41), 9000)]).await;
    for source in [&by_selector, &by_pool] {
        let state = source
            .status_until("the error cleared", |s| s.last_error.is_none())
            .await;
        assert_eq!(state.members, 1);
    }
}

/// The whole picker on a `kubernetes` pool, as `cachepick serve` runs in a cluster: the client comes
/// from `KUBECONFIG` (in a pod, the service account), the ready pods are scraped and listed in the
/// snapshot, and a pod that turns not ready drains and leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_the_ready_pods_of_a_kubernetes_pool() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let port = std::net::TcpListener::bind(format!("{}:0", ip(2)))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = || engine::Mode::Body("text/plain", engine::vllm_metrics(&[(0, 0, 0, 0.1)]));
    let _first = engine::FakeEngine::start_at(at(&ip(2), port), metrics()).await;
    let _second = engine::FakeEngine::start_at(at(&ip(3), port), metrics()).await;
    let kube = FakeKube::start().await;
    kube.apply_pod("llm", pod("vllm-a", VLLM, Some(&ip(2)), true));
    kube.apply_pod("llm", pod("vllm-b", VLLM, Some(&ip(3)), true));

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"http://{}\"}}}}]\n\
             users: [{{name: picker, user: {{}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: picker, namespace: llm}}}}]\n\
             current-context: fake\n",
            kube.addr
        ),
    )
    .unwrap();
    let config = dir.path().join("cachepick.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n\
             load: {{scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s}}\n\
             pools:\n  - model: m\n    engine: vllm\n    tokenizer: {{kind: bytes}}\n\
             \x20   kubernetes: {{selector: app=vllm, ports: [{port}]}}\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(cachepick_rig::cachepick_binary())
        .args(["serve", "--config", config.to_str().unwrap()])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve starts");
    let stdout = child.stdout.take().unwrap();
    let _child = Killed(child);
    // The log is echoed (visible with --nocapture, and in a failure's output) while the addresses are
    // read off it.
    let (found, address) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            eprintln!("serve: {line}");
            if let Some(rest) = line.split(" metrics_listen=").nth(1) {
                let addr = rest
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<SocketAddr>();
                let _ = found.send(addr.unwrap());
            }
        }
    });
    let metrics_listen = tokio::task::spawn_blocking(move || {
        address
            .recv_timeout(DEADLINE)
            .expect("serve logs its addresses")
    })
    .await
    .unwrap();

    let workers = || async {
        let (status, body) = cachepick_rig::http_exchange(
            http::Method::GET,
            metrics_listen,
            "/debug/snapshot",
            "",
            DEADLINE,
        )
        .await
        .expect("the snapshot answers");
        assert_eq!(status, 200);
        let snapshot: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            snapshot["pools"][0]["source"]["kind"], "kubernetes",
            "{snapshot:#}"
        );
        serve::snapshot_workers(&snapshot)
    };
    let until = |want: Vec<(String, String)>| async move {
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            let now = workers().await;
            if now == want {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{now:?}, wanted {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let healthy = |last: u8| (at(&ip(last), port).to_string(), "healthy".to_owned());
    until(vec![healthy(2), healthy(3)]).await;
    // b stops being ready: it drains (idle, so it leaves at its next scrape).
    kube.apply_pod("llm", pod("vllm-b", VLLM, Some(&ip(3)), false));
    until(vec![healthy(2)]).await;
}

/// A child process killed when the test ends, passed or failed.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

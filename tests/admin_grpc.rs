//! The `cachepick.v1.Admin` gRPC API end to end: a real picker (`app::run`) on loopback ports, its two
//! workers at addresses where nothing listens, queried with the generated tonic client.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cachepick::config::{self, Overrides};
use cachepick::extproc::admin_api::admin_client::AdminClient;
use cachepick::extproc::admin_api::{
    ConfigRequest, Decision, ExplainRequest, ExplainResponse, SnapshotRequest, SnapshotResponse,
    explain_response,
};
use tonic::Code;
use tonic::transport::Channel;

/// A loopback port that was free a moment ago: bound to port 0, then released. Nothing listens there
/// afterwards, so a worker at such an address refuses connections at once.
fn free_addr() -> SocketAddr {
    cachepick_rig::free_port().expect("bind an ephemeral port")
}

struct Picker {
    client: AdminClient<Channel>,
    /// The connection, for other services on `listen`.
    channel: Channel,
    workers: [SocketAddr; 2],
    /// `app::run`, stopped through its shutdown.
    running: cachepick_rig::stage::Picker,
}

/// Starts a picker with one pool (`m`, byte tokenizer, 16-token blocks) and two dead workers, and
/// connects to its `listen` address once it accepts connections.
async fn start() -> Picker {
    let listen = free_addr();
    let metrics_listen = free_addr();
    let workers = [free_addr(), free_addr()];
    let yaml = format!(
        "listen: {listen}\n\
         metrics_listen: {metrics_listen}\n\
         load: {{scrape_interval: 100ms, scrape_timeout: 100ms}}\n\
         pools:\n\
         \x20 - model: m\n\
         \x20   engine: vllm\n\
         \x20   block_size: 16\n\
         \x20   tokenizer: {{kind: bytes}}\n\
         \x20   workers:\n\
         \x20     - endpoint: {}\n\
         \x20     - {{endpoint: {}, metrics_url: \"http://scraper:s3cret@{}/metrics?key=k3y\"}}\n",
        workers[0], workers[1], workers[1]
    );
    let config = config::parse(&yaml, "admin_grpc.yaml", &Overrides::default()).expect("valid");
    let running = cachepick_rig::stage::Picker::spawn(config);
    let deadline = Instant::now() + Duration::from_secs(10);
    let endpoint = Channel::from_shared(format!("http://{listen}")).expect("a valid URI");
    let channel = loop {
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(error) => {
                assert!(
                    Instant::now() < deadline && !running.has_ended(),
                    "the picker never accepted connections on {listen}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    Picker {
        client: AdminClient::new(channel.clone()),
        channel,
        workers,
        running,
    }
}

impl Picker {
    async fn stop(self) {
        let ended = tokio::time::timeout(Duration::from_secs(10), self.running.stop())
            .await
            .expect("the picker stops on shutdown");
        ended.expect("the picker ran cleanly (its task did not panic)");
    }

    async fn explain(&mut self, body: &[u8]) -> Result<ExplainResponse, tonic::Status> {
        self.client
            .explain(ExplainRequest {
                path: String::new(),
                body: body.to_vec(),
                ..Default::default()
            })
            .await
            .map(tonic::Response::into_inner)
    }

    async fn snapshot(&mut self, pool: Option<&str>) -> Result<SnapshotResponse, tonic::Status> {
        self.client
            .snapshot(SnapshotRequest {
                pool: pool.map(str::to_owned),
            })
            .await
            .map(tonic::Response::into_inner)
    }
}

/// Asserts a refused call's gRPC code, and that its message names `needle`.
fn assert_refused(status: &tonic::Status, code: Code, needle: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert!(status.message().contains(needle), "{}", status.message());
}

fn chat_body(model: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You answer questions about cities. ".repeat(4)},
            {"role": "user", "content": "Tell me about Lyon."},
        ],
    }))
    .expect("JSON")
}

#[tokio::test]
async fn snapshot_lists_every_worker_with_why_it_is_not_fresh() {
    let mut picker = start().await;
    // Wait (bounded) for each worker's first failed scrape, so the reason names the error.
    let deadline = Instant::now() + Duration::from_secs(10);
    let snapshot = loop {
        let snapshot = picker.snapshot(None).await.expect("snapshot");
        let scraped = snapshot
            .pools
            .iter()
            .flat_map(|pool| &pool.workers)
            .all(|worker| worker.scrapes > 0);
        if scraped {
            break snapshot;
        }
        assert!(Instant::now() < deadline, "no scrape round: {snapshot:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(snapshot.pools.len(), 1);
    let pool = &snapshot.pools[0];
    assert_eq!(pool.pool, "m");
    assert!(pool.freshness_seconds > 0.0);
    let endpoints: Vec<String> = pool.workers.iter().map(|w| w.endpoint.clone()).collect();
    assert_eq!(
        endpoints,
        picker.workers.map(|worker| worker.to_string()).to_vec()
    );
    for worker in &pool.workers {
        assert!(!worker.fresh, "{worker:?}");
        assert_eq!(worker.role, "both");
        let why = worker.why_not_fresh.as_deref().expect("a reason");
        assert!(why.starts_with("no reading yet"), "{why}");
        // Nothing was read, so nothing is reported as zero.
        assert_eq!(
            (worker.waiting, worker.running, worker.age_seconds),
            (None, None, None)
        );
        assert_eq!(worker.last_outcome.as_deref(), Some("connect_error"));
        assert!(worker.last_error.is_some());
    }

    // The pool filter: by name, and NOT_FOUND for a pool that does not exist.
    let only = picker.snapshot(Some("m")).await.expect("snapshot of m");
    assert_eq!(only.pools.len(), 1);
    // Admission beside the pools: its slots, deadline and every shed reason, counted from zero.
    let admission = only.admission.expect("admission");
    assert!(admission.decision_slots > 0);
    assert_eq!(admission.decision_deadline_ms, 1750);
    assert_eq!(admission.shed.get("queue_full"), Some(&0));
    let missing = picker
        .snapshot(Some("other"))
        .await
        .expect_err("unknown pool");
    assert_refused(&missing, Code::NotFound, "other");
    picker.stop().await;
}

/// `Config`: the configuration the picker runs, every key with its effective value, and the
/// credentials and query string of a worker's metrics URL redacted.
#[tokio::test]
async fn config_shows_the_running_configuration_with_secrets_redacted() {
    let mut picker = start().await;
    let yaml = picker
        .client
        .config(ConfigRequest {})
        .await
        .expect("config")
        .into_inner()
        .yaml;
    let config: serde_yaml::Value = serde_yaml::from_str(&yaml).expect("YAML");
    let workers = &config["pools"][0]["workers"];
    assert_eq!(
        workers[1]["endpoint"].as_str(),
        Some(picker.workers[1].to_string().as_str())
    );
    assert_eq!(
        workers[1]["metrics_url"].as_str(),
        Some(format!("http://REDACTED@{}/metrics?REDACTED", picker.workers[1]).as_str()),
        "{yaml}"
    );
    // Defaults are shown too: a key the file never set.
    assert_eq!(
        config["policy"]["min_match_tokens"].as_u64(),
        Some(1024),
        "{yaml}"
    );
    assert!(!yaml.contains("s3cret") && !yaml.contains("k3y"), "{yaml}");
    picker.stop().await;
}

#[tokio::test]
async fn explain_routes_a_valid_body_without_committing_it() {
    let mut picker = start().await;
    let body = chat_body("m");
    let explained = picker.explain(&body).await.expect("explained");
    assert_eq!(explained.pool, "m");
    assert_eq!(explained.model.as_deref(), Some("m"));
    assert_eq!(explained.block_size, 16);
    assert!(explained.prompt_tokens > 0);
    assert_eq!(explained.full_blocks, explained.prompt_tokens / 16);
    let workers: Vec<String> = picker.workers.map(|worker| worker.to_string()).to_vec();
    assert_eq!(explained.endpoints, workers);
    // Nothing was routed yet: no worker holds a block.
    assert!(explained.owners.is_empty());
    // The workers have no reading, yet the picker still routes: an unknown queue fails the gate open
    // and unknown capacity never fails hard admission, so with no owner the off-owner rung samples the
    // fleet by load (waiting + running + dispatched, all unknown or zero here) and the reason is a plain
    // cache miss. The other worker is the fallback Envoy may retry on.
    let Some(explain_response::Outcome::Decision(Decision {
        reason,
        selected,
        fallbacks,
        matched_tokens,
        diverted_tokens,
    })) = explained.outcome.clone()
    else {
        panic!("a decision: {explained:?}");
    };
    assert_eq!(reason, "cache_miss");
    assert!(workers.contains(&selected), "{selected}");
    assert_eq!(fallbacks.len(), 1);
    assert_ne!(fallbacks[0], selected);
    assert!(workers.contains(&fallbacks[0]));
    assert_eq!((matched_tokens, diverted_tokens), (0, None));
    let trace: serde_json::Value = serde_json::from_str(&explained.trace_json).expect("JSON");
    assert_eq!(trace["fleet"], 2);
    assert_eq!(trace["fresh"], 0);
    assert_eq!(trace["rung"], "off_owner_gate_and_admission");
    assert_eq!(trace["owners"], serde_json::json!([]));
    // Power-of-k sampling drew both workers; with no reading and no dispatch, each has load 0.
    assert_eq!(
        trace["sampled"],
        serde_json::json!([{"worker": 0, "load": 0}, {"worker": 1, "load": 0}])
    );

    // Explain commits nothing: asked again, the body still has no owner.
    let again = picker.explain(&body).await.expect("explained again");
    assert!(again.owners.is_empty());
    assert!(matches!(
        again.outcome,
        Some(explain_response::Outcome::Decision(Decision { ref reason, .. })) if reason == "cache_miss"
    ));
    picker.stop().await;
}

#[tokio::test]
async fn explain_refuses_bad_bodies_with_grpc_codes() {
    let mut picker = start().await;

    let wrong_type = picker
        .explain(br#"{"messages": 3}"#)
        .await
        .expect_err("messages is not an array");
    assert_refused(&wrong_type, Code::InvalidArgument, "messages");
    assert_eq!(
        wrong_type
            .metadata()
            .get("x-cachepick-refusal-reason")
            .and_then(|value| value.to_str().ok()),
        Some("wrong_type")
    );

    let not_json = picker.explain(b"{not json").await.expect_err("not JSON");
    assert_refused(&not_json, Code::InvalidArgument, "JSON");

    let unknown = picker
        .explain(&chat_body("gpt-unknown"))
        .await
        .expect_err("no pool serves it");
    assert_refused(&unknown, Code::NotFound, "gpt-unknown");
    picker.stop().await;
}

/// What `grpcurl -plaintext <listen> list` and `describe` ask: server reflection, without the protos.
#[tokio::test]
async fn reflection_lists_and_describes_the_admin_service() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

    let picker = start().await;
    let mut reflection = ServerReflectionClient::new(picker.channel.clone());
    let ask = |request: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let requests = tokio_stream::iter([
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "cachepick.v1.Admin".to_owned(),
        )),
    ]);
    let mut answers = reflection
        .server_reflection_info(requests)
        .await
        .expect("reflection is served")
        .into_inner();
    let mut next = async || -> MessageResponse {
        let answer: ServerReflectionResponse = answers
            .message()
            .await
            .expect("an answer")
            .expect("not the end of the stream");
        answer.message_response.expect("a response")
    };

    let MessageResponse::ListServicesResponse(list) = next().await else {
        panic!("a service list");
    };
    let services: Vec<String> = list
        .service
        .into_iter()
        .map(|service| service.name)
        .collect();
    for expected in [
        "cachepick.v1.Admin",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(services.iter().any(|name| name == expected), "{services:?}");
    }

    let MessageResponse::FileDescriptorResponse(files) = next().await else {
        panic!("a file descriptor");
    };
    let file = String::from_utf8_lossy(&files.file_descriptor_proto.concat()).into_owned();
    assert!(file.contains("cachepick/v1/admin.proto"));
    assert!(file.contains("ExplainRequest") && file.contains("WorkerLoad"));
    picker.stop().await;
}

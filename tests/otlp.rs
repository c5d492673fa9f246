//! OpenTelemetry tracing end to end: the real `cachepick serve` binary with `tracing.otlp_endpoint`
//! set, a simulated vLLM fleet, a real Envoy 1.40, and an OTLP/gRPC receiver (opentelemetry-proto's
//! generated `TraceService` server, the protocol a collector speaks). A request that arrives with a
//! client's `traceparent` and `x-request-id` must give:
//! - one `cachepick.decision` span in the client's trace, the child of the client's span, with the
//!   request id, pool, reason, worker, prefix and prompt tokens and the decision's time;
//! - the pipeline's steps (`parse`, `tokenize`, `match`, `policy`, `commit`) as its children;
//! - a `traceparent` at the engine naming the decision span as its parent;
//! - the decision's log line carrying the same request id, and Envoy's access log line
//!   (`envoy-config --access-log`) too, with the decision and the worker.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod serve;
    pub mod sim_client;
    pub mod sim_fleet;
}

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Method;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;

use cachepick::config::{self, Overrides};
use cachepick::envoy_config::{self, BodyMode};
use cachepick_sim::Engine;
use support::serve;
use support::sim_client::{self, CHAT, Client, MODEL};
use support::{envoy, sim_fleet};

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const REQUEST_ID: &str = "req-otlp-7f3a";

/// Every span the receiver was sent, with its service name.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<(String, Span)>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|resource| &resource.attributes)
                .find(|attribute| attribute.key == "service.name")
                .and_then(|attribute| attribute.value.as_ref())
                .and_then(|value| match &value.value {
                    Some(AnyValue::StringValue(name)) => Some(name.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for scope in resource.scope_spans {
                spans.extend(scope.spans.into_iter().map(|span| (service.clone(), span)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// A span's attributes as text.
fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|attribute| {
            let value = match attribute
                .value
                .as_ref()
                .and_then(|value| value.value.as_ref())
            {
                Some(AnyValue::StringValue(text)) => text.clone(),
                Some(AnyValue::IntValue(number)) => number.to_string(),
                Some(AnyValue::DoubleValue(number)) => number.to_string(),
                Some(AnyValue::BoolValue(flag)) => flag.to_string(),
                other => format!("{other:?}"),
            };
            (attribute.key.clone(), value)
        })
        .collect()
}

/// Two simulated vLLM workers, the real `serve` binary in front of them with `tracing.otlp_endpoint`
/// set to `collector` (and `env` set for it), ready, and a generated Envoy in front of that.
struct Traced {
    server: serve::Server,
    lines: std::sync::mpsc::Receiver<String>,
    gateway: std::net::SocketAddr,
    access_log: std::path::PathBuf,
    _envoy: envoy::Envoy,
    _fleet: cachepick_sim::fleet::Fleet,
    _dir: tempfile::TempDir,
}

impl Traced {
    async fn start(collector: std::net::SocketAddr, env: &[(&str, &str)]) -> Traced {
        let fleet = sim_fleet::start(&sim_fleet::config(Engine::Vllm, 2)).await;
        let listen = envoy::free_addr();
        let metrics = envoy::free_addr();
        let text = format!(
            "{}tracing: {{otlp_endpoint: \"http://{collector}\", service_name: cachepick-e2e}}\n",
            fleet.cachepick_config()
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cachepick.yaml");
        std::fs::write(&file, &text).unwrap();
        let flags = [
            "--listen".to_owned(),
            listen.to_string(),
            "--metrics-listen".to_owned(),
            metrics.to_string(),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut command = serve::command(&file, &flags, "info,cachepick::route=debug");
        command.envs(env.iter().copied());
        let (server, lines) = serve::spawn_logged(&mut command);
        serve::logged_field(&lines, "metrics_listen");
        let sim = Client::new();
        let ready_by = Instant::now() + Duration::from_secs(30);
        while sim
            .try_exchange(Method::GET, metrics, "/readyz", None)
            .await
            .map_or(true, |reply| reply.status != http::StatusCode::OK)
        {
            assert!(Instant::now() < ready_by, "cachepick never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let config = config::parse(
            &text,
            "otlp.yaml",
            &Overrides {
                listen: Some(listen),
                metrics_listen: Some(metrics),
                ..Overrides::default()
            },
        )
        .unwrap();
        let access_log = dir.path().join("access.log");
        let options = envoy_config::EnvoyOptions {
            access_log: Some(access_log.clone()),
            ..envoy::free_options(&config, BodyMode::Buffered)
        };
        let gateway = options.listen;
        let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
        Traced {
            server,
            lines,
            gateway,
            access_log,
            _envoy: envoy,
            _fleet: fleet,
            _dir: dir,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_is_one_span_in_the_client_s_trace_and_the_engine_continues_it() {
    // The OTLP receiver.
    let receiver = Receiver::default();
    let collector = cachepick_rig::free_port().unwrap();
    let serving = receiver.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(serving))
            .serve(collector)
            .await
            .unwrap();
    });

    // Two simulated vLLM workers, the real binary in front of them exporting to the receiver (batches
    // leave every 100 ms rather than every 5 s), and Envoy in front of it.
    let traced = Traced::start(collector, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]).await;
    let (sim, gateway, lines, access_log) = (
        Client::new(),
        traced.gateway,
        &traced.lines,
        traced.access_log.clone(),
    );

    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Where does this request go, and why?"}],
        "max_tokens": 4,
    });
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let reply = sim_client::read_whole(
        sim.send_raw(
            Method::POST,
            gateway,
            CHAT,
            &[
                ("content-type", "application/json"),
                ("traceparent", traceparent.as_str()),
                ("x-request-id", REQUEST_ID),
            ],
            serde_json::to_vec(&body).unwrap(),
        )
        .await,
    )
    .await
    .unwrap();
    assert_eq!(reply.status, http::StatusCode::OK, "{}", reply.text());
    let header = |name: &str| {
        reply
            .header(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", reply.headers))
            .to_owned()
    };
    let decision = header("x-sim-echo-x-cachepick-decision");
    let served_by = header("x-served-by");

    // The engine was told the client's trace, with cachepick's span as the parent.
    let at_engine = reply
        .header("x-sim-echo-traceparent")
        .expect("the worker received a traceparent")
        .to_owned();
    let fields: Vec<&str> = at_engine.split('-').collect();
    assert_eq!(fields.len(), 4, "{at_engine}");
    assert_eq!(
        (fields[0], fields[1], fields[3]),
        ("00", CLIENT_TRACE, "01")
    );
    assert_ne!(
        fields[2], CLIENT_SPAN,
        "the engine's parent is cachepick's span"
    );
    let engine_parent = fields[2].to_owned();
    assert_eq!(reply.header("x-sim-echo-x-request-id"), Some(REQUEST_ID));

    // The receiver gets the decision span and its steps.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (root, steps) = loop {
        let spans = receiver.0.lock().unwrap().clone();
        let root = spans.iter().find(|(_, span)| {
            span.name == "cachepick.decision" && hex(&span.trace_id) == CLIENT_TRACE
        });
        if let Some((service, root)) = root {
            assert_eq!(service, "cachepick-e2e");
            let steps: Vec<Span> = spans
                .iter()
                .map(|(_, span)| span)
                .filter(|span| span.parent_span_id == root.span_id)
                .cloned()
                .collect();
            if steps.len() >= 5 {
                break (root.clone(), steps);
            }
        }
        assert!(
            Instant::now() < deadline,
            "no decision span with its 5 steps in the client's trace; received: {:?}",
            spans
                .iter()
                .map(|(_, span)| (&span.name, hex(&span.trace_id), hex(&span.parent_span_id)))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        hex(&root.parent_span_id),
        CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(
        hex(&root.span_id),
        engine_parent,
        "the engine continues the decision span"
    );
    let seen = attributes(&root);
    assert_eq!(
        seen.get("request_id").map(String::as_str),
        Some(REQUEST_ID),
        "{seen:?}"
    );
    assert_eq!(seen.get("reason"), Some(&decision), "{seen:?}");
    assert_eq!(seen.get("worker"), Some(&served_by), "{seen:?}");
    assert_eq!(
        seen.get("pool").map(String::as_str),
        Some(MODEL),
        "{seen:?}"
    );
    for key in ["prefix_tokens", "prompt_tokens", "decision_us"] {
        assert!(seen.contains_key(key), "{key} missing: {seen:?}");
    }
    let mut names: Vec<&str> = steps.iter().map(|span| span.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names, ["commit", "match", "parse", "policy", "tokenize"]);

    // The decision's log line names the request.
    let log_by = Instant::now() + Duration::from_secs(5);
    let mut log = Vec::new();
    let routed = loop {
        match lines.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains("routed") && line.contains("cachepick::route") => break line,
            Ok(line) => log.push(line),
            Err(_) => assert!(
                Instant::now() < log_by,
                "no `routed` line in:\n{}",
                log.join("\n")
            ),
        }
    };
    assert!(
        routed.contains(&format!("request_id={REQUEST_ID}")),
        "{routed}"
    );

    // Envoy's access log (`envoy-config --access-log`) joins the same request id to the decision, the
    // selected and the actual worker, the status and the durations.
    let logged_by = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let text = std::fs::read_to_string(&access_log).unwrap_or_default();
        if let Some(line) = text.lines().find(|line| line.contains(REQUEST_ID)) {
            break line.to_owned();
        }
        assert!(
            Instant::now() < logged_by,
            "no access log line for {REQUEST_ID}: {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let entry: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(entry["request_id"], REQUEST_ID, "{entry}");
    assert_eq!(entry["decision"], decision.as_str(), "{entry}");
    assert_eq!(entry["selected_host"], served_by.as_str(), "{entry}");
    assert_eq!(entry["upstream_host"], served_by.as_str(), "{entry}");
    assert_eq!(entry["status"], 200, "{entry}");
    assert!(entry["duration_ms"].is_number(), "{entry}");
    drop(traced);
}

/// A collector that accepts the connection and never answers must not keep a stopping replica alive:
/// after SIGTERM `serve` drains for its grace, logs `cachepick stopped`, gives its queued spans a
/// bounded moment (1 s) and exits. Before the bound the SDK's shutdown waited 5 s behind an export
/// that waited 5 s for the silent collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_does_not_hold_up_shutdown() {
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let collector = hole.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for connection in hole.incoming() {
            held.push(connection);
        }
    });
    // The batch's default delay (5 s): the decision's spans are still queued at the signal.
    let mut traced = Traced::start(collector, &[]).await;
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "A span for a collector that never answers."}],
        "max_tokens": 2,
    });
    let reply = sim_client::read_whole(
        Client::new()
            .send_raw(
                Method::POST,
                traced.gateway,
                CHAT,
                &[("content-type", "application/json")],
                serde_json::to_vec(&body).unwrap(),
            )
            .await,
    )
    .await
    .unwrap();
    assert_eq!(reply.status, http::StatusCode::OK, "{}", reply.text());

    let pid = traced.server.0.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    // The drain's grace is the configuration's; what follows `stopped` is the exporter's.
    let stop_by = Instant::now() + Duration::from_secs(30);
    loop {
        let line = traced
            .lines
            .recv_timeout(stop_by.saturating_duration_since(Instant::now()))
            .expect("serve logs `cachepick stopped` after its drain");
        if line.contains("cachepick stopped") {
            break;
        }
    }
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = traced.server.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "serve still running 10 s after `cachepick stopped`"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = stopped.elapsed();
    eprintln!("serve exited {took:?} after `cachepick stopped`");
    assert!(status.success(), "serve exits cleanly: {status:?}");
    assert!(
        took < Duration::from_secs(3),
        "serve took {took:?} to exit after `cachepick stopped`"
    );
}

//! TLS and mTLS on the ext_proc listener, end to end: a simulated fleet, cachepick (`app::run`) with
//! `tls:`, and a real Envoy 1.40 running the bootstrap `envoy-config` generates with the `--picker-*`
//! TLS options, over certificates generated in the test.
//!
//! What it shows: requests through Envoy are routed by cachepick over TLS (the worker saw the decision
//! header, so the ext_proc stream worked; the workers cluster got its endpoints from cachepick's EDS over
//! the same TLS); under mTLS a client without a certificate is refused while the same client with one is
//! served; a plain-text client of the TLS listener fails; and a certificate rotated on disk is served to
//! new connections without a restart.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod picker;
    pub mod pki;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, picker, pki, sim_client, sim_fleet};

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use cachepick::config::{Config, Overrides};
use cachepick::envoy_config::{self, EnvoyOptions, PickerTls};
use cachepick::extproc::READINESS;
use cachepick_rig::stage::{Picker, on_free_ports};
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};
use pki::{Ca, Leaf, SERVER_NAME};
use sim_client::{CHAT, Client, DEADLINE, MODEL, bounded, metric_sum, read_whole};

/// Envoy's identity in its client certificate: the SPIFFE ID Istio gives a gateway's service account.
const ENVOY_ID: &str = "spiffe://cluster.local/ns/gateway/sa/envoy";

/// The header a simulated worker echoes for cachepick's decision header.
const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The certificates of one stack.
struct Certs {
    dir: tempfile::TempDir,
    ca: Ca,
    server: Leaf,
    /// Envoy's client certificate, signed by `clients`.
    envoy: Leaf,
    clients: Ca,
}

impl Certs {
    fn new() -> Certs {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "server");
        let server = ca.server(dir.path(), "picker");
        let clients = Ca::new(dir.path(), "clients");
        let envoy = clients.client_named(dir.path(), "envoy", "envoy-gateway", &[], &[ENVOY_ID]);
        Certs {
            dir,
            ca,
            server,
            envoy,
            clients,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// A fleet, a picker with `tls:` (mTLS with `mtls`) and Envoy in front with the matching bootstrap.
struct Stack {
    fleet: Fleet,
    config: Config,
    certs: Certs,
    gateway: SocketAddr,
    _envoy: envoy::Envoy,
    _picker: Picker,
}

impl Stack {
    async fn start(mtls: bool) -> Stack {
        Stack::start_allowing(mtls, &[]).await
    }

    /// [`Stack::start`] with `tls.allowed_client_identities` when `identities` is not empty.
    async fn start_allowing(mtls: bool, identities: &[&str]) -> Stack {
        let certs = Certs::new();
        let sim = sim_fleet::config(Engine::Vllm, 2);
        let fleet = sim_fleet::start(&sim).await;
        let mut client_ca = if mtls {
            format!("\n  client_ca_file: {}", certs.clients.file.display())
        } else {
            String::new()
        };
        if !identities.is_empty() {
            client_ca += &format!("\n  allowed_client_identities: [{}]", identities.join(", "));
        }
        let yaml = format!(
            "tls:\n  cert_file: {}\n  key_file: {}{client_ca}\n{}",
            certs.server.cert_file.display(),
            certs.server.key_file.display(),
            fleet.cachepick_config()
        );
        let config = on_free_ports(&yaml, "the TLS test configuration", Overrides::default())
            .unwrap_or_else(|error| panic!("{error}\n{yaml}"));
        assert!(config.tls.is_some());
        let picker = Picker::spawn(config.clone());
        let identity = mtls.then_some(&certs.envoy);
        wait_ready(config.listen, &certs.ca, identity).await;

        let picker_tls = PickerTls::from_flags(
            &config,
            Some(certs.ca.file.clone()),
            mtls.then(|| certs.envoy.cert_file.clone()),
            mtls.then(|| certs.envoy.key_file.clone()),
            Some(SERVER_NAME.to_owned()),
        )
        .expect("the flags fit the configuration");
        let gateway = loopback(envoy::free_port());
        let options = EnvoyOptions {
            listen: gateway,
            admin: loopback(envoy::free_port()),
            picker_tls,
            ..EnvoyOptions::for_config(&config)
        };
        let bootstrap = envoy_config::render(&config, &options);
        assert!(bootstrap.contains("UpstreamTlsContext"), "{bootstrap}");
        let envoy = envoy::Envoy::start(&bootstrap).await;
        Stack {
            fleet,
            config,
            certs,
            gateway,
            _envoy: envoy,
            _picker: picker,
        }
    }

    /// A chat through Envoy: its status and the decision the worker saw.
    async fn chat(&self, seed: u64) -> (StatusCode, Option<String>) {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": format!("request {seed}: {}", "lorem ipsum ".repeat(200))}],
            "max_tokens": 4,
        });
        let client = Client::new();
        let reply = bounded("a chat through Envoy", DEADLINE, async {
            read_whole(
                client
                    .send_raw(
                        Method::POST,
                        self.gateway,
                        CHAT,
                        &[("content-type", "application/json")],
                        serde_json::to_vec(&body).unwrap(),
                    )
                    .await,
            )
            .await
        })
        .await
        .expect("Envoy answers");
        (reply.status, reply.header(ECHO_DECISION).map(str::to_owned))
    }

    /// Envoy routes through the picker: several requests, each served with the picker's decision.
    async fn assert_routed_by_the_picker(&self) {
        // Envoy's health check marks the picker up within a second or two of its start; until then a
        // request fails open (served, but without a decision). Wait for the first decided one.
        let deadline = Instant::now() + DEADLINE;
        let mut seed = 0;
        loop {
            let (status, decision) = self.chat(seed).await;
            seed += 1;
            assert_eq!(status, StatusCode::OK);
            if decision.is_some() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no request through Envoy was decided by the picker within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for _ in 0..5 {
            let (status, decision) = self.chat(seed).await;
            seed += 1;
            assert_eq!(status, StatusCode::OK);
            let decision = decision.expect("every request is decided by the picker over TLS");
            assert_ne!(decision, "passthrough");
        }
        let metrics = Client::new()
            .get(self.config.metrics_listen, "/metrics")
            .await;
        assert!(
            metric_sum(&metrics.text(), "cachepick_decisions_total", &[]) >= 6.0,
            "{}",
            metrics.text()
        );
    }
}

fn client_tls(ca: &Ca, identity: Option<&Leaf>) -> ClientTlsConfig {
    let config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca.pem))
        .domain_name(SERVER_NAME);
    match identity {
        Some(leaf) => config.identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem)),
        None => config,
    }
}

/// A health check of `readiness` on a fresh connection; the transport or gRPC error as text.
async fn readiness(endpoint: Endpoint) -> Result<ServingStatus, String> {
    let check = async {
        let channel: Channel = endpoint
            .connect()
            .await
            .map_err(|error| format!("{error:?}"))?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: READINESS.to_owned(),
            })
            .await
            .map_err(|status| format!("{status:?}"))?;
        Ok(ServingStatus::try_from(reply.into_inner().status).unwrap())
    };
    bounded("a health check", DEADLINE, check).await
}

fn tls_endpoint(addr: SocketAddr, ca: &Ca, identity: Option<&Leaf>) -> Endpoint {
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .tls_config(client_tls(ca, identity))
        .unwrap()
}

fn plain_endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
}

async fn wait_ready(addr: SocketAddr, ca: &Ca, identity: Option<&Leaf>) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match readiness(tls_endpoint(addr, ca, identity)).await {
            Ok(ServingStatus::Serving) => return,
            other => assert!(
                Instant::now() < deadline,
                "the picker on {addr} is not ready over TLS within {DEADLINE:?}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const HANDSHAKE_FAILURES: &str = "cachepick_tls_handshake_failures_total";
/// Reports that named a worker other than the chosen one.
const MOVED: (&str, &[(&str, &str)]) = ("cachepick_feedback_total", &[("outcome", "moved")]);

/// The picker's counter `name{labels}`, summed over its other labels.
async fn counter(config: &Config, name: &str, labels: &[(&str, &str)]) -> f64 {
    let metrics = Client::new().get(config.metrics_listen, "/metrics").await;
    metric_sum(&metrics.text(), name, labels)
}

async fn handshake_failures(config: &Config) -> f64 {
    counter(config, HANDSHAKE_FAILURES, &[]).await
}

/// Waits until the picker's counter `name{labels}` is at least `count`. What a client sees (a refusal's
/// alert, an answer) comes before the picker counts it, so the count may trail by a moment.
async fn wait_counter(config: &Config, name: &str, labels: &[(&str, &str)], count: f64, why: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let counted = counter(config, name, labels).await;
        if counted >= count {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{why}: {name} {counted}, expected at least {count}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the picker has counted at least `count` failed handshakes.
async fn wait_handshake_failures(config: &Config, count: f64, why: &str) {
    wait_counter(config, HANDSHAKE_FAILURES, &[], count, why).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_routes_through_a_picker_serving_tls_and_plain_text_is_refused() {
    let stack = Stack::start(false).await;
    stack.assert_routed_by_the_picker().await;

    // A client that trusts the picker's CA is served; a plain-text (h2c) client gets no answer.
    let listen = stack.config.listen;
    assert_eq!(
        readiness(tls_endpoint(listen, &stack.certs.ca, None)).await,
        Ok(ServingStatus::Serving)
    );
    let before = handshake_failures(&stack.config).await;
    let plain = readiness(plain_endpoint(listen)).await;
    assert!(plain.is_err(), "plain text was answered: {plain:?}");
    // A client that trusts another CA refuses the picker's certificate.
    let other = Ca::new(stack.certs.path(), "other");
    let untrusted = readiness(tls_endpoint(listen, &other, None)).await;
    assert!(untrusted.is_err(), "{untrusted:?}");
    wait_handshake_failures(
        &stack.config,
        before + 2.0,
        "the plain-text and the untrusting client each failed a handshake",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_routes_envoy_with_its_certificate_and_refuses_clients_without_one() {
    let stack = Stack::start(true).await;
    stack.assert_routed_by_the_picker().await;

    let listen = stack.config.listen;
    let before = handshake_failures(&stack.config).await;
    // The same client, without a certificate: refused (TLS 1.3 reports it on the first read).
    let anonymous = readiness(tls_endpoint(listen, &stack.certs.ca, None)).await;
    assert!(
        anonymous.is_err(),
        "a client without a certificate was served: {anonymous:?}"
    );
    // With a certificate the client CA did not sign: refused.
    let stranger = stack
        .certs
        .ca
        .client(stack.certs.path(), "stranger", "stranger");
    let strange = readiness(tls_endpoint(listen, &stack.certs.ca, Some(&stranger))).await;
    assert!(strange.is_err(), "{strange:?}");
    // With one it did: served.
    let admitted = stack
        .certs
        .clients
        .client(stack.certs.path(), "operator", "operator");
    assert_eq!(
        readiness(tls_endpoint(listen, &stack.certs.ca, Some(&admitted))).await,
        Ok(ServingStatus::Serving)
    );
    let plain = readiness(plain_endpoint(listen)).await;
    assert!(plain.is_err(), "plain text was answered: {plain:?}");
    wait_handshake_failures(
        &stack.config,
        before + 3.0,
        "each refused client failed its handshake",
    )
    .await;
}

/// A client's report of which worker served a request moves the prefix's owner there (feedback), so only
/// Envoy may give one: with `allowed_client_identities`, a certificate the client CA signed for another
/// identity fails the handshake, and its forged report never arrives; the same report from a listed
/// identity (the control) moves the owner, so the test would see the forgery if it got through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_listed_client_identities_may_connect_and_report_where_a_request_went() {
    let stack = Stack::start_allowing(true, &[ENVOY_ID, "operator.test"]).await;
    // Envoy's certificate names its SPIFFE ID: it routes through the picker as before.
    stack.assert_routed_by_the_picker().await;

    let listen = stack.config.listen;
    let dir = stack.certs.path();
    let intruder = stack.certs.clients.client_named(
        dir,
        "intruder",
        "envoy-gateway",
        &["intruder.test"],
        &["spiffe://cluster.local/ns/tenant/sa/app"],
    );
    let operator =
        stack
            .certs
            .clients
            .client_named(dir, "operator", "operator", &["operator.test"], &[]);
    let before = handshake_failures(&stack.config).await;
    let refused = forged_report(&stack, &intruder).await;
    assert!(
        refused.is_err(),
        "an unlisted identity reported: {refused:?}"
    );
    let unlisted = readiness(tls_endpoint(listen, &stack.certs.ca, Some(&intruder))).await;
    assert!(unlisted.is_err(), "{unlisted:?}");
    wait_handshake_failures(
        &stack.config,
        before + 2.0,
        "the unlisted identity failed its handshakes",
    )
    .await;
    assert_eq!(
        counter(&stack.config, MOVED.0, MOVED.1).await,
        0.0,
        "no forged report counted"
    );

    // The control: the same forgery from a listed identity is taken.
    let served_by = forged_report(&stack, &operator)
        .await
        .expect("a listed identity connects");
    wait_counter(
        &stack.config,
        MOVED.0,
        MOVED.1,
        1.0,
        &format!("the listed identity's report to {served_by} was not taken"),
    )
    .await;
}

/// A direct client of the picker with `identity` asks for a decision as Envoy would (its filter's
/// feedback metadata on) and then reports that another worker served the request. The worker named, or
/// the error that kept the client from reporting.
async fn forged_report(stack: &Stack, identity: &Leaf) -> Result<SocketAddr, String> {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpHeaders, ProcessingRequest, processing_request,
    };
    use envoy_types::pb::google::protobuf::{Struct, Value, value};
    use picker::{body, post_headers, raw_header};

    let channel = tls_endpoint(stack.config.listen, &stack.certs.ca, Some(identity))
        .connect()
        .await
        .map_err(|error| format!("connect: {error:?}"))?;
    let (sender, receiver) = tokio::sync::mpsc::channel(4);
    let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
    call.metadata_mut().insert(
        cachepick::protocol::FEEDBACK_METADATA,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    let chat = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("forged: {}", "lorem ipsum ".repeat(300))}],
        "max_tokens": 4,
    });
    sender.send(post_headers(CHAT)).await.unwrap();
    sender
        .send(body(&serde_json::to_vec(&chat).unwrap(), true))
        .await
        .unwrap();
    let mut responses = ExternalProcessorClient::new(channel)
        .process(call)
        .await
        .map_err(|status| format!("process: {status:?}"))?
        .into_inner();
    // The headers' answer, then the body's, which carries the route.
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(
            bounded("an answer", DEADLINE, responses.message())
                .await
                .map_err(|status| format!("answer: {status:?}"))?
                .ok_or("the stream ended before the route")?,
        );
    }
    let chosen = picker::route_of(&answers[1]).endpoints[0];
    let served_by = stack
        .fleet
        .endpoints()
        .into_iter()
        .find(|worker| *worker != chosen)
        .unwrap();
    let attributes = Struct {
        fields: [(
            "upstream.address".to_owned(),
            Value {
                kind: Some(value::Kind::StringValue(served_by.to_string())),
            },
        )]
        .into(),
    };
    sender
        .send(ProcessingRequest {
            attributes: [("envoy.filters.http.ext_proc".to_owned(), attributes)].into(),
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(envoy_types::pb::envoy::config::core::v3::HeaderMap {
                    headers: vec![raw_header(":status", "200")],
                }),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        })
        .await
        .unwrap();
    bounded("the response phase's answer", DEADLINE, responses.message())
        .await
        .map_err(|status| format!("response phase: {status:?}"))?;
    Ok(served_by)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_reaches_new_connections_without_a_restart() {
    let certs = Certs::new();
    let mut sim = SimConfig::new(Engine::Vllm, NonZeroU32::new(1).unwrap());
    sim.tokenizer = TokenizerConfig::Bytes;
    let fleet = sim_fleet::start(&sim).await;
    let yaml = format!(
        "tls: {{cert_file: \"{}\", key_file: \"{}\", reload_interval: 100ms}}\n{}",
        certs.server.cert_file.display(),
        certs.server.key_file.display(),
        fleet.cachepick_config()
    );
    let config = on_free_ports(&yaml, "the rotation test", Overrides::default())
        .unwrap_or_else(|error| panic!("{error}\n{yaml}"));
    let _picker = Picker::spawn(config.clone());
    let listen = config.listen;
    wait_ready(listen, &certs.ca, None).await;

    // cert-manager renews: a certificate from a new CA replaces the files in place.
    let renewed = Ca::new(certs.path(), "renewed");
    let next = renewed.server(certs.path(), "next");
    std::fs::write(&certs.server.cert_file, &next.cert_pem).unwrap();
    std::fs::write(&certs.server.key_file, &next.key_pem).unwrap();

    // New connections get it within a few reload intervals: a client trusting only the new CA is
    // served, and one trusting only the old CA no longer is.
    wait_ready(listen, &renewed, None).await;
    let old = readiness(tls_endpoint(listen, &certs.ca, None)).await;
    assert!(old.is_err(), "the old certificate is still served: {old:?}");
    let metrics = Client::new().get(config.metrics_listen, "/metrics").await;
    assert!(
        metric_sum(
            &metrics.text(),
            "cachepick_tls_reloads_total",
            &[("outcome", "ok")]
        ) >= 1.0,
        "{}",
        metrics.text()
    );
}

//! The overhead bench's stage, shared by `cachepick overhead`, `tests/overhead.rs` and
//! `benches/overhead.rs`: one worker, one cachepick, one no-op ext_proc server and an Envoy per arm and
//! body mode, all on loopback, and [`Rig::send`], one timed request through one of them.
//!
//! The arms' Envoy bootstraps all come from cachepick's own generator
//! ([`cachepick::envoy_config::render`]) for the same configuration, so they differ only where the arm
//! says: (b) is the generated bootstrap without the ext_proc filter (the same listener, header
//! stripping, route and workers cluster, which then falls back to least-request over the one worker);
//! (c) is the generated bootstrap of its mode with the ext_proc cluster's endpoint moved to the no-op
//! server, and (c′) the same moved to the no-op server that answers as cachepick with a decision made
//! in advance; (d) is the generated bootstrap of its mode as is. The workers cluster is fed by cachepick's
//! EDS in every arm.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_yaml::Value;

use cachepick::config::{Config, Overrides};
use cachepick::envoy_config::{BodyMode, EXT_PROC_FILTER, EnvoyOptions, picker_address, render};
use cachepick::extproc::DECISION_HEADER;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;

use super::OverheadError;
use super::bodies::CHAT_PATH;
use super::noop::{NoopServer, Received, Reply};
use super::worker::Worker;
use crate::envoy::Envoy;
use crate::stage::{Picker, READY_WITHIN, on_free_ports};

/// The model the worker serves and the bodies name.
pub const MODEL: &str = "overhead-model";
/// How long one request may take before the bench calls it failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The ways a request reaches the worker: the four, and (c′) between (c) and (d).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// (a) the client to the worker.
    Direct,
    /// (b) through Envoy without ext_proc.
    Envoy,
    /// (c) through Envoy and the no-op ext_proc server.
    Noop,
    /// (c′) through Envoy and the no-op server that answers with cachepick's decision, made in advance.
    Routing,
    /// (d) through Envoy and cachepick.
    Cachepick,
}

impl Arm {
    pub const ALL: [Arm; 5] = [
        Arm::Direct,
        Arm::Envoy,
        Arm::Noop,
        Arm::Routing,
        Arm::Cachepick,
    ];

    /// `a` to `d`, and `c′`, as the report names them.
    pub fn letter(self) -> &'static str {
        match self {
            Arm::Direct => "a",
            Arm::Envoy => "b",
            Arm::Noop => "c",
            Arm::Routing => "c′",
            Arm::Cachepick => "d",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Arm::Direct => "worker directly",
            Arm::Envoy => "Envoy, no ext_proc",
            Arm::Noop => "Envoy + no-op ext_proc",
            Arm::Routing => "Envoy + no-op ext_proc that routes",
            Arm::Cachepick => "Envoy + cachepick",
        }
    }

    /// Whether the arm goes through ext_proc, so its bootstrap depends on the body mode.
    pub fn has_mode(self) -> bool {
        matches!(self, Arm::Noop | Arm::Routing | Arm::Cachepick)
    }
}

/// How the ext_proc arms' bootstraps are changed from the generated ones, to answer the round-trip
/// question (`BENCHMARKS.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// `cachepick envoy-config`'s output as it is.
    #[default]
    Generated,
    /// `request_header_mode: SKIP`, with the path and headers asked for as `request_attributes`
    /// (`request.path`, `request.headers`) instead: Envoy would send the body without a headers round
    /// trip first.
    SkipRequestHeaders,
    /// `request_body_mode: STREAMED` with `send_body_without_waiting_for_header_response: true`
    /// (request trailers skipped): Envoy sends the body's chunks without waiting for the headers
    /// answer, which a body-deciding processor holds until the last chunk. Derived from whichever
    /// mode's bootstrap; run it with `--modes buffered`.
    StreamedNoWait,
    /// The generated bootstraps and cachepick with `feedback: {enabled: false}`: no response phase, so
    /// the stream ends at the answer. Against `generated`, what the served-endpoint report costs.
    NoFeedback,
}

impl Variant {
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Generated => "generated",
            Variant::SkipRequestHeaders => "skip-request-headers",
            Variant::StreamedNoWait => "streamed-no-wait",
            Variant::NoFeedback => "no-feedback",
        }
    }

    /// Whether the ext_proc protocol is the generated one (with or without the response phase): the
    /// arms that answer as cachepick does then run.
    fn generated(self) -> bool {
        matches!(self, Variant::Generated | Variant::NoFeedback)
    }
}

impl std::str::FromStr for Variant {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        [
            Variant::Generated,
            Variant::SkipRequestHeaders,
            Variant::StreamedNoWait,
            Variant::NoFeedback,
        ]
        .into_iter()
        .find(|variant| variant.as_str() == text)
        .ok_or_else(|| {
            format!(
                "expected generated, skip-request-headers, streamed-no-wait or no-feedback, got `{text}`"
            )
        })
    }
}

/// One arm in one body mode (`None` for the arms without ext_proc, which have no mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cell {
    pub arm: Arm,
    pub mode: Option<BodyMode>,
}

impl Cell {
    pub fn name(self) -> String {
        match self.mode {
            Some(mode) => format!("({}) {} [{mode}]", self.arm.letter(), self.arm.label()),
            None => format!("({}) {}", self.arm.letter(), self.arm.label()),
        }
    }
}

/// One request's outcome as the client saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub status: u16,
    /// From sending the request to the last byte of the answer.
    pub latency: Duration,
    /// cachepick's decision as the worker received it (`x-cachepick-decision`, echoed back).
    pub decision: Option<String>,
}

/// Worker, picker, no-op servers and Envoys; dropping it stops them all.
pub struct Rig {
    worker: Worker,
    picker: Picker,
    noop: NoopServer,
    /// Arm (c′)'s server; only with the generated bootstrap (the variants are about the protocol).
    routing: Option<NoopServer>,
    envoys: Vec<(Cell, Envoy)>,
    client: HttpClient<HttpConnector, Full<Bytes>>,
    variant: Variant,
}

impl Rig {
    /// Starts everything, the Envoys from the binary at `envoy`, for the body `modes`, and waits until
    /// every cell answers: (c′) and (d) with a decision.
    pub async fn start(
        envoy: &Path,
        modes: &[BodyMode],
        variant: Variant,
    ) -> Result<Rig, OverheadError> {
        if let Some(mode) = modes.iter().find(|mode| **mode == BodyMode::OriginalDst) {
            return Err(OverheadError::Mode(*mode));
        }
        let worker = Worker::start(crate::free_port().map_err(OverheadError::Io)?, MODEL)
            .await
            .map_err(OverheadError::Io)?;
        let mut config = picker_config(worker.addr())?;
        config.feedback.enabled = variant != Variant::NoFeedback;
        let mut picker = Picker::spawn(config.clone());
        picker.ready(READY_WITHIN).await?;
        let reply = if variant.generated() {
            Reply::Continue
        } else {
            Reply::Probe
        };
        let noop = NoopServer::start(crate::free_port().map_err(OverheadError::Io)?, reply)
            .await
            .map_err(OverheadError::Io)?;
        let routing = if variant.generated() {
            let at = crate::free_port().map_err(OverheadError::Io)?;
            Some(
                NoopServer::start(at, Reply::Route(worker.addr()))
                    .await
                    .map_err(OverheadError::Io)?,
            )
        } else {
            None
        };
        let mut client = HttpClient::builder(TokioExecutor::new());
        client.pool_idle_timeout(Duration::from_secs(300));
        let mut rig = Rig {
            worker,
            picker,
            noop,
            routing,
            envoys: Vec::new(),
            client: client.build_http(),
            variant,
        };
        let picker_at = picker_address(rig.picker.listen());
        let noop_at = rig.noop.addr();
        let routing_at = rig.routing.as_ref().map(NoopServer::addr);
        let mut cells = vec![Cell {
            arm: Arm::Envoy,
            mode: None,
        }];
        for mode in modes {
            for arm in [Arm::Noop, Arm::Routing, Arm::Cachepick] {
                if arm == Arm::Routing && routing_at.is_none() {
                    continue;
                }
                cells.push(Cell {
                    arm,
                    mode: Some(*mode),
                });
            }
        }
        // Started together: each takes a second or two to come up.
        let started = futures_util::future::join_all(cells.iter().map(|cell| {
            let config = &config;
            Envoy::start_rendered(envoy, None, move |listen, admin| {
                let options = EnvoyOptions {
                    mode: cell.mode.unwrap_or(BodyMode::Buffered),
                    listen,
                    admin,
                    pickers: vec![picker_at.into()],
                    ..EnvoyOptions::for_config(config)
                };
                let server = match cell.arm {
                    Arm::Routing => routing_at.unwrap_or(noop_at),
                    _ => noop_at,
                };
                bootstrap(&render(config, &options), cell.arm, server, variant)
            })
        }))
        .await;
        for (cell, started) in cells.into_iter().zip(started) {
            let envoy = started.map_err(|message| OverheadError::Envoy {
                path: envoy.display().to_string(),
                message,
            })?;
            rig.envoys.push((cell, envoy));
        }
        rig.wait_answering().await?;
        Ok(rig)
    }

    /// Every cell this rig serves: (a), (b), then (c), (c′) and (d) per mode.
    pub fn cells(&self) -> Vec<Cell> {
        let mut cells = vec![Cell {
            arm: Arm::Direct,
            mode: None,
        }];
        cells.extend(self.envoys.iter().map(|(cell, _)| *cell));
        cells
    }

    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// What the no-op server received from the streams in `mode`.
    pub fn noop_received(&self, mode: BodyMode) -> Received {
        self.noop.received(match mode {
            BodyMode::Duplex => Some(BodySendMode::FullDuplexStreamed),
            BodyMode::Streamed => Some(BodySendMode::Streamed),
            BodyMode::Buffered | BodyMode::OriginalDst => Some(BodySendMode::Buffered),
        })
    }

    /// The picker's decision and rejection counters and its decision time's sum and count (`/metrics`
    /// lines), empty if it does not answer.
    pub async fn picker_decisions(&self) -> Vec<String> {
        crate::scrape_metrics(self.picker.metrics_listen(), Duration::from_secs(2))
            .await
            .map(|text| {
                text.lines()
                    .filter(|line| {
                        line.starts_with("cachepick_decisions_total")
                            || line.starts_with("cachepick_refusals_total")
                            || line.starts_with("cachepick_decision_seconds_sum")
                            || line.starts_with("cachepick_decision_seconds_count")
                    })
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What arm (c′)'s server received from the streams in `mode` (none without that arm).
    pub fn routing_received(&self, mode: BodyMode) -> Option<Received> {
        let mode = match mode {
            BodyMode::Duplex => BodySendMode::FullDuplexStreamed,
            BodyMode::Streamed => BodySendMode::Streamed,
            BodyMode::Buffered | BodyMode::OriginalDst => BodySendMode::Buffered,
        };
        self.routing
            .as_ref()
            .map(|server| server.received(Some(mode)))
    }

    /// What the no-op server received from STREAMED streams (the `streamed-no-wait` variant).
    pub fn noop_received_streamed(&self) -> Received {
        self.noop.received(Some(BodySendMode::Streamed))
    }

    /// Generation requests the worker answered.
    pub fn worker_served(&self) -> u64 {
        self.worker.served()
    }

    /// The Envoy serving `cell` (none for the direct arm).
    pub fn envoy(&self, cell: Cell) -> Option<&Envoy> {
        self.envoys
            .iter()
            .find(|(served, _)| *served == cell)
            .map(|(_, envoy)| envoy)
    }

    fn target(&self, cell: Cell) -> Option<SocketAddr> {
        match cell.arm {
            Arm::Direct => Some(self.worker.addr()),
            _ => self.envoy(cell).map(|envoy| envoy.listen),
        }
    }

    /// One POST of `body` to the chat API through `cell`, timed from sending to the answer's last byte.
    pub async fn send(&self, cell: Cell, body: Vec<u8>) -> Result<Sample, OverheadError> {
        let target = self
            .target(cell)
            .ok_or(OverheadError::NoSuchCell(cell.name()))?;
        let request = http::Request::post(format!("http://{target}{CHAT_PATH}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|error| OverheadError::Request(error.to_string()))?;
        let started = Instant::now();
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|error| OverheadError::Request(format!("{}: {error}", cell.name())))?;
            let status = response.status().as_u16();
            let decision =
                crate::header_text(response.headers(), &format!("x-sim-echo-{DECISION_HEADER}"));
            response
                .into_body()
                .collect()
                .await
                .map_err(|error| OverheadError::Request(format!("{}: {error}", cell.name())))?;
            Ok::<_, OverheadError>((status, decision))
        };
        let (status, decision) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                OverheadError::Request(format!("{}: no answer within 10 s", cell.name()))
            })??;
        Ok(Sample {
            status,
            latency: started.elapsed(),
            decision,
        })
    }

    /// Waits until every cell answers 200, (c) through the no-op server and (d) with a decision: Envoy's
    /// health check of its ext_proc cluster may mark the server healthy a moment after Envoy reports
    /// ready, and until then requests fail open.
    async fn wait_answering(&self) -> Result<(), OverheadError> {
        let deadline = Instant::now() + READY_WITHIN;
        let body = super::bodies::Bodies::new(MODEL, 1_024, 0).body(0);
        for cell in self.cells() {
            loop {
                let asked = self.noop.total_messages();
                let routed_before = self.routing.as_ref().map_or(0, NoopServer::total_messages);
                let sample = self.send(cell, body.clone()).await;
                // A request Envoy sent past an ext_proc server it does not yet think healthy (failing
                // open) is answered 200 too: (c) counts once the no-op server saw it.
                let ready = match &sample {
                    // The round-trip experiment's variants may not route at all; what they answer is
                    // the finding, so any answer will do.
                    Ok(_) if cell.arm == Arm::Cachepick && !self.variant.generated() => true,
                    Ok(sample) => {
                        sample.status == 200
                            && match cell.arm {
                                Arm::Cachepick => sample.decision.is_some(),
                                Arm::Noop => self.noop.total_messages() > asked,
                                Arm::Routing => {
                                    sample.decision.as_deref() == Some(super::noop::ROUTE_LABEL)
                                        && self.routing.as_ref().is_some_and(|server| {
                                            server.total_messages() > routed_before
                                        })
                                }
                                Arm::Direct | Arm::Envoy => true,
                            }
                    }
                    Err(_) => false,
                };
                if ready {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(OverheadError::NotAnswering {
                        cell: cell.name(),
                        last: format!("{sample:?}"),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Stops the Envoys, then the picker, the no-op servers and the worker.
    pub async fn stop(self) -> Result<(), OverheadError> {
        let Rig {
            worker,
            picker,
            noop,
            routing,
            envoys,
            ..
        } = self;
        drop(envoys);
        let stopped = picker.stop().await;
        drop(noop);
        drop(routing);
        drop(worker);
        Ok(stopped?)
    }
}

/// cachepick's configuration for one pool of the one worker, on free loopback ports.
fn picker_config(worker: SocketAddr) -> Result<Config, OverheadError> {
    let text = format!(
        "load:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n  freshness: 1s\n\
         pools:\n  - model: {MODEL}\n    engine: vllm\n    block_size: 16\n    \
         tokenizer: {{kind: tiktoken, encoding: o200k_base}}\n    workers:\n      - endpoint: {worker}\n"
    );
    Ok(on_free_ports(
        &text,
        "the overhead bench",
        Overrides::default(),
    )?)
}

/// The bootstrap of `arm` from the generated `yaml` (see the module's documentation).
fn bootstrap(yaml: &str, arm: Arm, noop: SocketAddr, variant: Variant) -> Result<String, String> {
    let mut root: Value = serde_yaml::from_str(yaml)
        .map_err(|error| format!("the bootstrap is not YAML: {error}"))?;
    match arm {
        Arm::Direct => return Err("the direct arm has no Envoy".to_owned()),
        Arm::Envoy => remove_ext_proc(&mut root)?,
        Arm::Noop | Arm::Routing => {
            point_cluster(&mut root, "cachepick", noop)?;
            apply(&mut root, variant)?;
            // The no-op servers speak the request phase only (in duplex mode a CONTINUE to the
            // headers and then a clean close make Envoy 1.40 answer 500 when the response phase is
            // on): cachepick's response report is part of what (d) − (c) measures.
            skip_response_phase(&mut root);
        }
        Arm::Cachepick => apply(&mut root, variant)?,
    }
    serde_yaml::to_string(&root).map_err(|error| error.to_string())
}

/// Every HTTP filter list of the bootstrap.
fn http_filters(root: &mut Value) -> Vec<&mut Vec<Value>> {
    crate::envoy::network_filters(root)
        .into_iter()
        .filter_map(|filter| {
            filter
                .get_mut("typed_config")
                .and_then(|config| config.get_mut("http_filters"))
                .and_then(Value::as_sequence_mut)
        })
        .collect()
}

fn is_ext_proc(filter: &Value) -> bool {
    filter.get("name").and_then(Value::as_str) == Some(EXT_PROC_FILTER)
}

fn remove_ext_proc(root: &mut Value) -> Result<(), String> {
    let mut removed = 0;
    for list in http_filters(root) {
        let before = list.len();
        list.retain(|filter| !is_ext_proc(filter));
        removed += before - list.len();
    }
    if removed == 0 {
        return Err("the bootstrap has no ext_proc filter".to_owned());
    }
    Ok(())
}

/// Points the static cluster `name` at `addr` alone.
fn point_cluster(root: &mut Value, name: &str, addr: SocketAddr) -> Result<(), String> {
    let clusters = root
        .get_mut("static_resources")
        .and_then(|resources| resources.get_mut("clusters"))
        .and_then(Value::as_sequence_mut)
        .ok_or("the bootstrap has no clusters")?;
    let cluster = clusters
        .iter_mut()
        .find(|cluster| cluster.get("name").and_then(Value::as_str) == Some(name))
        .ok_or_else(|| format!("the bootstrap has no cluster {name}"))?;
    let endpoint: Value = serde_yaml::from_str(&format!(
        "cluster_name: {name}\nendpoints:\n- lb_endpoints:\n  - endpoint:\n      address:\n        \
         socket_address: {{address: \"{}\", port_value: {}}}\n",
        addr.ip(),
        addr.port()
    ))
    .map_err(|error| error.to_string())?;
    if let Value::Mapping(cluster) = cluster {
        cluster.insert("load_assignment".into(), endpoint);
    }
    Ok(())
}

/// Turns the ext_proc filters' response phase (cachepick's feedback) off.
fn skip_response_phase(root: &mut Value) {
    for list in http_filters(root) {
        for filter in list.iter_mut().filter(|filter| is_ext_proc(filter)) {
            let Some(Value::Mapping(config)) = filter.get_mut("typed_config") else {
                continue;
            };
            config.remove("response_attributes");
            if let Some(Value::Mapping(mode)) = config.get_mut("processing_mode") {
                mode.insert("response_header_mode".into(), "SKIP".into());
            }
            if let Some(Value::Mapping(grpc)) = config.get_mut("grpc_service") {
                grpc.remove("initial_metadata");
            }
        }
    }
}

/// The ext_proc filter's changes `variant` asks for.
fn apply(root: &mut Value, variant: Variant) -> Result<(), String> {
    if variant.generated() {
        return Ok(());
    }
    let mut changed = 0;
    for list in http_filters(root) {
        for filter in list.iter_mut().filter(|filter| is_ext_proc(filter)) {
            let Some(Value::Mapping(config)) = filter.get_mut("typed_config") else {
                continue;
            };
            let set_mode = |config: &mut serde_yaml::Mapping, key: &str, value: &str| {
                if let Some(Value::Mapping(mode)) = config.get_mut("processing_mode") {
                    mode.insert(key.into(), value.into());
                }
            };
            match variant {
                Variant::Generated | Variant::NoFeedback => {}
                Variant::SkipRequestHeaders => {
                    set_mode(config, "request_header_mode", "SKIP");
                    config.insert(
                        "request_attributes".into(),
                        Value::Sequence(vec!["request.path".into(), "request.headers".into()]),
                    );
                }
                Variant::StreamedNoWait => {
                    set_mode(config, "request_body_mode", "STREAMED");
                    set_mode(config, "request_trailer_mode", "SKIP");
                    config.insert(
                        "send_body_without_waiting_for_header_response".into(),
                        true.into(),
                    );
                }
            }
            changed += 1;
        }
    }
    if changed == 0 {
        return Err("the bootstrap has no ext_proc filter".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generated(mode: BodyMode) -> (Config, String) {
        let config = picker_config("127.0.0.1:8000".parse().expect("addr")).expect("config");
        let options = EnvoyOptions {
            mode,
            ..EnvoyOptions::for_config(&config)
        };
        let yaml = render(&config, &options);
        (config, yaml)
    }

    #[test]
    fn the_arms_differ_from_the_generated_bootstrap_only_where_they_say() {
        let noop: SocketAddr = "127.0.0.1:7777".parse().expect("addr");
        let (_, yaml) = generated(BodyMode::Duplex);
        let generated: Value = serde_yaml::from_str(&yaml).expect("YAML");
        let envoy_only = bootstrap(&yaml, Arm::Envoy, noop, Variant::Generated).expect("b");
        assert!(!envoy_only.contains(EXT_PROC_FILTER));
        assert!(envoy_only.contains("envoy.filters.http.header_mutation"));
        let with_noop = bootstrap(&yaml, Arm::Noop, noop, Variant::Generated).expect("c");
        let with_noop: Value = serde_yaml::from_str(&with_noop).expect("YAML");
        let clusters = |root: &Value| root["static_resources"]["clusters"].clone();
        let (before, after) = (clusters(&generated), clusters(&with_noop));
        let names = |clusters: &Value| -> Vec<String> {
            clusters
                .as_sequence()
                .expect("clusters")
                .iter()
                .map(|cluster| cluster["name"].as_str().expect("name").to_owned())
                .collect()
        };
        assert_eq!(names(&before), names(&after));
        for (old, new) in before
            .as_sequence()
            .expect("clusters")
            .iter()
            .zip(after.as_sequence().expect("clusters"))
        {
            if old["name"] == "cachepick" {
                assert_ne!(old, new);
                assert_eq!(
                    new["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                        ["socket_address"]["port_value"]
                        .as_u64(),
                    Some(7777)
                );
                assert_eq!(old["health_checks"], new["health_checks"]);
            } else {
                assert_eq!(old, new, "{:?}", old["name"]);
            }
        }
        // The listeners differ in the ext_proc filter's response phase alone, which the no-op
        // arm turns off.
        let ext_proc = |root: &Value| -> Value {
            root["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                ["typed_config"]["http_filters"]
                .as_sequence()
                .expect("filters")
                .iter()
                .find(|filter| is_ext_proc(filter))
                .expect("ext_proc")["typed_config"]
                .clone()
        };
        assert_eq!(
            ext_proc(&generated)["processing_mode"]["response_header_mode"].as_str(),
            Some("SEND")
        );
        assert_eq!(
            ext_proc(&with_noop)["processing_mode"]["response_header_mode"].as_str(),
            Some("SKIP")
        );
        assert!(ext_proc(&with_noop).get("response_attributes").is_none());
        let mut expected = generated.clone();
        skip_response_phase(&mut expected);
        assert_ne!(expected, generated);
        assert_eq!(
            expected["static_resources"]["listeners"],
            with_noop["static_resources"]["listeners"]
        );
        let with_cachepick = bootstrap(&yaml, Arm::Cachepick, noop, Variant::Generated).expect("d");
        assert_eq!(
            serde_yaml::from_str::<Value>(&with_cachepick).expect("YAML"),
            generated
        );
    }

    #[test]
    fn the_skip_variant_skips_the_request_headers_and_asks_for_them_as_attributes() {
        let (_, yaml) = generated(BodyMode::Buffered);
        let noop: SocketAddr = "127.0.0.1:7777".parse().expect("addr");
        for arm in [Arm::Noop, Arm::Cachepick] {
            let skipped =
                bootstrap(&yaml, arm, noop, Variant::SkipRequestHeaders).expect("bootstrap");
            assert!(skipped.contains("request_header_mode: SKIP"), "{skipped}");
            assert!(skipped.contains("- request.path\n"), "{skipped}");
            assert!(skipped.contains("- request.headers\n"), "{skipped}");
        }
        assert_eq!(
            "skip-request-headers".parse(),
            Ok(Variant::SkipRequestHeaders)
        );
        assert!("skip".parse::<Variant>().is_err());
    }
}

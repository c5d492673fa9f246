//! cachepick (`serve`, the real binary) and a real Envoy in front of the shared vLLM engines, with
//! Envoy's JSON access log: what each request was decided and which worker served it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode};

use crate::support::vllm::{self, Engine, Fleet, MODEL};
use crate::support::{envoy, serve};

/// How the picker's pool learns who holds what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Index {
    /// The engines' KV events (with the replay sockets), each worker's sockets named in the file.
    Events,
    /// The engines' KV events at the sockets each engine advertises (`/kv_event_sources`): the
    /// workers name none, and the pool's port is one where nobody publishes.
    EventsAdvertised,
    /// The picker's own decisions.
    Approximate,
}

/// The picker and Envoy over some of the fleet's engines. Dropping it stops both.
pub struct Stack {
    pub config: Config,
    pub gateway: SocketAddr,
    pub metrics: SocketAddr,
    pub envoy: envoy::Envoy,
    access_log: PathBuf,
    /// Killed when the stack is dropped.
    _server: serve::Server,
    lines: Mutex<(Receiver<String>, Vec<String>)>,
    _dir: tempfile::TempDir,
}

/// One answer through Envoy.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// vLLM's own count of the prompt tokens its prefix cache served.
    pub fn cached_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
    }
}

/// The picker's configuration over `engines`, with `load` as the `load:` section's extra lines.
pub fn config_text(engines: &[&Engine], index: Index, load: &str) -> String {
    let install = vllm::install();
    let mut workers = String::new();
    for engine in engines {
        workers.push_str(&format!("      - endpoint: {}\n", engine.http));
        if index == Index::Events {
            workers.push_str(&format!(
                "        kv_events: {{endpoint: \"tcp://{}\", replay_endpoint: \"tcp://{}\"}}\n",
                engine.kv_events, engine.replay
            ));
        }
    }
    let mode = match index {
        Index::Events => "events".to_owned(),
        Index::EventsAdvertised => {
            let nobody = envoy::free_addr();
            format!("events, sockets: advertised, port: {}", nobody.port())
        }
        Index::Approximate => "approximate".to_owned(),
    };
    format!(
        "load:\n  scrape_interval: 1s\n{load}\
         pools:\n  - model: {MODEL}\n    engine: vllm\n    block_size: 16\n    max_model_len: 8192\n\
         \x20   tokenizer: {{kind: huggingface, path: {tokenizer:?}}}\n    chat_template: {template:?}\n\
         \x20   index: {{mode: {mode}}}\n    workers:\n{workers}",
        tokenizer = install.tokenizer().display().to_string(),
        template = install.tokenizer_config().display().to_string(),
    )
}

impl Stack {
    /// cachepick in `index` mode over every engine of `fleet`, Envoy in front, both ready.
    pub async fn start(fleet: &Fleet, index: Index, load: &str) -> Stack {
        let engines: Vec<&Engine> = fleet.engines.iter().collect();
        Stack::over(&engines, index, load).await
    }

    /// cachepick over `engines` (a text of [`config_text`]), Envoy in front, both ready.
    pub async fn over(engines: &[&Engine], index: Index, load: &str) -> Stack {
        Stack::with_config(config_text(engines, index, load)).await
    }

    pub async fn with_config(text: String) -> Stack {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("cachepick.yaml");
        std::fs::write(&config_path, &text).unwrap();
        let listen = envoy::free_addr();
        let metrics = envoy::free_addr();
        let mut command = serve::command(
            &config_path,
            &[
                "--listen",
                &listen.to_string(),
                "--metrics-listen",
                &metrics.to_string(),
            ],
            "info",
        );
        let (server, lines) = serve::spawn_logged(&mut command);
        let config = config::parse(
            &text,
            "vllm.yaml",
            &Overrides {
                listen: Some(listen),
                metrics_listen: Some(metrics),
                ..Overrides::default()
            },
        )
        .unwrap_or_else(|error| panic!("{error}\n{text}"));
        let access_log = dir.path().join("access.log");
        let options = envoy_config::EnvoyOptions {
            access_log: Some(access_log.clone()),
            ..envoy::free_options(&config, BodyMode::Buffered)
        };
        let gateway = options.listen;
        let ready = options
            .ready
            .expect("free_options asks for a ready listener");
        let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
        let stack = Stack {
            config,
            gateway,
            metrics,
            envoy,
            access_log,
            _server: server,
            lines: Mutex::new((lines, Vec::new())),
            _dir: dir,
        };
        stack.wait_ready(Duration::from_secs(60)).await;
        // The picker and Envoy start together, as in one pod: Envoy's admin says LIVE before its health
        // check has seen the picker SERVING, so wait as a start-up probe would, on the ready listener.
        envoy::until_ready(ready, Duration::from_secs(60)).await;
        stack
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Ok((200, _)) = vllm::get(self.metrics, "/readyz", Duration::from_secs(2)).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cachepick was not ready within {within:?}:\n{}",
                self.log().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every line the picker logged so far.
    pub fn log(&self) -> Vec<String> {
        let mut lines = self.lines.lock().unwrap();
        let (receiver, seen) = &mut *lines;
        seen.extend(receiver.try_iter());
        seen.clone()
    }

    /// POSTs `body` to `path` through Envoy with `x-request-id: id`.
    pub async fn send(&self, path: &str, body: &Value, id: &str) -> Reply {
        send(self.gateway, path, body, id).await
    }

    /// A chat of `messages` through Envoy.
    pub async fn chat(&self, messages: &Value, max_tokens: u64, id: &str) -> Reply {
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens});
        self.send("/v1/chat/completions", &body, id).await
    }

    /// Envoy's access-log entry for request `id`: `decision`, `selected_host`, `upstream_host`,
    /// `status`; waits for it.
    pub async fn access(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&self.access_log).unwrap_or_default();
            if let Some(line) = text
                .lines()
                .find(|line| line.contains(&format!("\"{id}\"")))
            {
                return serde_json::from_str(line).unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "no access log line for {id} in:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `/debug/snapshot`.
    pub async fn snapshot(&self) -> Value {
        let (status, body) = vllm::get(self.metrics, "/debug/snapshot", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// `/debug/explain` of a chat or completion body at `path`.
    pub async fn explain(&self, path: &str, body: &Value) -> Value {
        let (status, text) = vllm::post(
            self.metrics,
            &format!("/debug/explain?path={path}"),
            body,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// The picker's `/metrics`.
    pub async fn picker_metrics(&self) -> String {
        let (status, body) = vllm::get(self.metrics, "/metrics", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        body
    }

    /// The snapshot's worker of `endpoint`.
    pub async fn worker(&self, endpoint: SocketAddr) -> Value {
        let snapshot = self.snapshot().await;
        snapshot["pools"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|worker| worker["endpoint"] == endpoint.to_string())
            .cloned()
            .unwrap_or_else(|| panic!("no worker {endpoint} in {snapshot}"))
    }
}

/// POSTs `body` to `path` at `gateway` with `x-request-id: id`; a request may take a minute under a
/// burst on two CPU cores.
pub async fn send(gateway: SocketAddr, path: &str, body: &Value, id: &str) -> Reply {
    use http_body_util::{BodyExt, Full};
    let request = hyper::Request::post(format!("http://{gateway}{path}"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let response = tokio::time::timeout(Duration::from_secs(120), client.request(request))
        .await
        .unwrap_or_else(|_| panic!("{id}: no answer within 120 s"))
        .unwrap_or_else(|error| panic!("{id}: {error}"));
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| json!({"text": String::from_utf8_lossy(&bytes)}));
    Reply { status, body }
}

/// The `x-gateway-destination-endpoint` an access-log entry says was selected, as an address.
pub fn selected(entry: &Value) -> Option<SocketAddr> {
    entry["selected_host"].as_str()?.parse().ok()
}

/// The worker that served, per Envoy.
pub fn upstream(entry: &Value) -> Option<SocketAddr> {
    entry["upstream_host"].as_str()?.parse().ok()
}

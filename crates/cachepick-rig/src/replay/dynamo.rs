//! NVIDIA Dynamo's own KV router as a replay arm, beside its re-implementation ([`super::peers`]): the
//! standalone selection service (`python -m dynamo.select_service` from PyPI `ai-dynamo-runtime`, pinned
//! by `scripts/provision-peers`), started per arm on the arm's fresh fleet, told every worker and the
//! sockets its KV events come from, and asked for every request.
//!
//! The service picks and books but does not forward: the runtime in front of it asks, sends and
//! reports. Here that runtime is the replay's ext_proc server behind Envoy ([`super::behind`]), so the
//! arm pays the same proxy as cachepick's. Per request it tokenizes the prompt as the workers do
//! (Dynamo's frontend tokenizes with the model's tokenizer), calls `POST /select_and_reserve` with the
//! token ids (the service books the request's load before it answers), and routes to the worker named;
//! the driver reports `prefill_complete` at the first chunk and `DELETE`s the reservation at the end.
//! The service's cache view is its own index of the workers' vLLM KV events over ZeroMQ (live and
//! replay sockets), its load view its own bookings, its scoring its defaults (the settings it logs at
//! start). Every figure in the row comes from the fleet, as for every arm.
//!
//! One worker is one Dynamo worker of one rank: the replay has no way to send a request to the rank
//! the service names, so a fleet of data-parallel workers is refused.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::front::{FrontError, Process};
use cachepick_sim::fleet::Fleet;

/// The arm's row label.
pub const LABEL: &str = "dynamo/select_service";
/// How long the service may take to answer `/health` and then count every registered worker
/// schedulable (`/ready`): a Python import and a ZeroMQ connection per worker.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// One selection or lifecycle call; a request whose selection does not answer in time is undecided.
const CALL_WITHIN: Duration = Duration::from_secs(10);
/// The model and routing group every worker is registered under.
const ROUTING_GROUP: &str = "default";

#[derive(Debug, thiserror::Error)]
pub enum SelectorError {
    #[error(
        "--dynamo-selector `{0}` names no `{{port}}`: the template must put the service on the port the \
         replay gives it"
    )]
    NoPort(String),
    #[error(
        "the Dynamo selection service needs every worker's KV events, and worker {0} publishes none"
    )]
    NoEvents(usize),
    #[error(
        "worker {worker} runs {ranks} data-parallel ranks; the replay cannot send a request to the rank \
         the Dynamo selection service names, so its arm takes one rank per worker"
    )]
    Ranks { worker: usize, ranks: usize },
    #[error(
        "--dynamo-selector routes aggregated fleets: the replay drives no prefill/decode form of \
         Dynamo's service (drop --pd)"
    )]
    Disaggregated,
    #[error(transparent)]
    Process(#[from] FrontError),
    #[error("the Dynamo selection service (`{command}`) exited ({status}); its output is in {log}")]
    Exited {
        command: String,
        status: std::process::ExitStatus,
        log: String,
    },
    #[error("the Dynamo selection service {step} within {within:?}: {last} (its output: {log})")]
    NotReady {
        step: &'static str,
        within: Duration,
        last: String,
        log: String,
    },
}

/// The arm's command template: it must name `{port}`.
pub fn check_template(template: &str) -> Result<(), SelectorError> {
    if template.contains("{port}") {
        Ok(())
    } else {
        Err(SelectorError::NoPort(template.to_owned()))
    }
}

/// The selection service in front of one arm's fleet.
pub struct DynamoRouter {
    fleet: Arc<Fleet>,
    service: Service,
    model: String,
    next: AtomicU64,
    // Held for its drop, which kills the service.
    _process: Process,
}

/// A pooled client to the service: the selection is on every request's path, so it keeps its
/// connections.
struct Service {
    addr: SocketAddr,
    http: HttpClient<HttpConnector, Full<Bytes>>,
}

/// Where the service sent a request: its reservation stays booked until this is dropped, and
/// [`Reservation::first_token`] reports its prefill complete.
pub struct Reservation {
    router: Arc<DynamoRouter>,
    id: String,
    pub worker: SocketAddr,
    /// The prompt's tokens the service matched in the worker's cache (its `overlap.gpu`).
    pub cached_tokens: u64,
    prefilling: bool,
}

impl DynamoRouter {
    /// Starts the service from `template` (`{port}` filled with a free loopback port), its output in
    /// `dir`, registers `fleet`'s workers and waits until it counts all of them schedulable.
    pub async fn start(
        template: &str,
        fleet: Arc<Fleet>,
        model: &str,
        dir: &Path,
    ) -> Result<DynamoRouter, SelectorError> {
        check_template(template)?;
        let registrations = registrations(&fleet, model)?;
        let addr = crate::free_port().map_err(FrontError::Port)?;
        let command = template.replace("{port}", &addr.port().to_string());
        let mut process = Process::spawn(&command, LABEL, dir)?;
        let service = Service {
            addr,
            http: HttpClient::builder(TokioExecutor::new()).build_http(),
        };
        wait_for(&mut process, &command, "did not answer /health", || {
            service.call(http::Method::GET, "/health", String::new())
        })
        .await?;
        for registration in registrations {
            let answer = service
                .call(http::Method::POST, "/workers", registration.clone())
                .await;
            if !matches!(answer, Some((200 | 201, _))) {
                return Err(SelectorError::NotReady {
                    step: "did not register a worker",
                    within: CALL_WITHIN,
                    last: format!("{registration} → {answer:?}"),
                    log: process.log.display().to_string(),
                });
            }
        }
        wait_for(
            &mut process,
            &command,
            "did not count every worker ready",
            || service.ready(fleet.workers().len()),
        )
        .await?;
        Ok(DynamoRouter {
            fleet,
            service,
            model: model.to_owned(),
            next: AtomicU64::new(0),
            _process: process,
        })
    }

    /// Asks the service for the worker of a completion whose prompt is `text`, booking it; why not,
    /// when it cannot.
    pub async fn choose(self: &Arc<Self>, text: &str) -> Result<Reservation, String> {
        // A prompt of 100k tokens takes milliseconds to tokenize: off the runtime's threads, as the
        // re-implemented peers decide.
        let fleet = Arc::clone(&self.fleet);
        let prompt = text.to_owned();
        let tokens = tokio::task::spawn_blocking(move || fleet.tokenize(&prompt))
            .await
            .map_err(|error| format!("the tokenizing task failed: {error}"))??;
        let id = format!("replay-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let body = serde_json::json!({
            "selection_id": id,
            "model_name": self.model,
            "routing_group": ROUTING_GROUP,
            "token_ids": tokens,
        })
        .to_string();
        let answer = self
            .service
            .call(http::Method::POST, "/select_and_reserve", body)
            .await;
        let (status, text) = answer.ok_or("the selection service did not answer")?;
        if status != 200 {
            return Err(format!("the selection service answered {status}: {text}"));
        }
        let selected: serde_json::Value = serde_json::from_str(&text)
            .map_err(|error| format!("the selection service's answer is not JSON: {error}"))?;
        let worker = selected
            .get("worker_id")
            .and_then(serde_json::Value::as_u64)
            .and_then(|id| usize::try_from(id).ok())
            .and_then(|index| self.fleet.worker(index))
            .ok_or_else(|| format!("the selection service named no worker of the fleet: {text}"))?;
        let cached_tokens = selected
            .pointer("/overlap/gpu")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        Ok(Reservation {
            router: Arc::clone(self),
            id,
            worker: worker.addr(),
            cached_tokens,
            prefilling: true,
        })
    }

    /// Reports a reservation's lifecycle without holding up the request it belongs to.
    fn report(self: &Arc<Self>, method: http::Method, path: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let router = Arc::clone(self);
        runtime.spawn(async move {
            let _ = router.service.call(method, &path, String::new()).await;
        });
    }
}

impl Reservation {
    /// The first response chunk arrived: the request's prefill no longer loads its worker.
    pub fn first_token(&mut self) {
        if std::mem::take(&mut self.prefilling) {
            let path = format!("/reservations/{}/prefill_complete", self.id);
            self.router.report(http::Method::POST, path);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let path = format!("/reservations/{}", self.id);
        self.router.report(http::Method::DELETE, path);
    }
}

impl Service {
    /// One call to the service: its status and body, `None` when it does not answer in time.
    async fn call(&self, method: http::Method, path: &str, body: String) -> Option<(u16, String)> {
        let request = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .ok()?;
        let exchange = async {
            let response = self.http.request(request).await.ok()?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.ok()?.to_bytes();
            Some((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(CALL_WITHIN, exchange).await.ok()?
    }

    /// `/ready` answered 200 with every one of `workers` schedulable.
    async fn ready(&self, workers: usize) -> Option<(u16, String)> {
        let (status, text) = self
            .call(http::Method::GET, "/ready", String::new())
            .await?;
        let schedulable = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|ready| ready.get("schedulable_workers")?.as_u64());
        let all = schedulable.is_some_and(|count| count == workers as u64);
        Some((if all { status } else { 503 }, text))
    }
}

/// Polls `probe` until it answers 200, the process exits or [`READY_WITHIN`] passes.
async fn wait_for<F, Fut>(
    process: &mut Process,
    command: &str,
    step: &'static str,
    mut probe: F,
) -> Result<(), SelectorError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<(u16, String)>>,
{
    let started = Instant::now();
    let mut last = "no answer yet".to_owned();
    while started.elapsed() < READY_WITHIN {
        if let Some(status) = process.exited() {
            return Err(SelectorError::Exited {
                command: command.to_owned(),
                status,
                log: process.log.display().to_string(),
            });
        }
        match probe().await {
            Some((200, _)) => return Ok(()),
            Some((status, text)) => {
                last = format!(
                    "HTTP {status}: {}",
                    text.chars().take(200).collect::<String>()
                );
            }
            None => last = "no answer".to_owned(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(SelectorError::NotReady {
        step,
        within: READY_WITHIN,
        last,
        log: process.log.display().to_string(),
    })
}

/// The `POST /workers` body of each of `fleet`'s workers: worker `i` is Dynamo's worker `i`, its KV
/// events its live socket and the replay socket a restarted subscriber asks for what it missed.
fn registrations(fleet: &Fleet, model: &str) -> Result<Vec<String>, SelectorError> {
    let block_size = fleet.config().block_size.get();
    fleet
        .workers()
        .iter()
        .enumerate()
        .map(|(index, worker)| {
            let events = worker.kv_events().ok_or(SelectorError::NoEvents(index))?;
            let [rank] = events.ranks.as_slice() else {
                return Err(SelectorError::Ranks {
                    worker: index,
                    ranks: events.ranks.len(),
                });
            };
            let mut body = serde_json::json!({
                "worker_id": index,
                "model_name": model,
                "routing_group": ROUTING_GROUP,
                "endpoint": format!("http://{}", worker.addr()),
                "block_size": block_size,
                "kv_events_endpoints": {"0": format!("tcp://{}", rank.live)},
            });
            if let (Some(replay), Some(fields)) = (rank.replay, body.as_object_mut()) {
                fields.insert(
                    "replay_endpoint".to_owned(),
                    format!("tcp://{replay}").into(),
                );
            }
            Ok(body.to_string())
        })
        .collect()
}

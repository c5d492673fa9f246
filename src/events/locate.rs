//! Where an engine publishes its KV events, asked of the engine: vLLM's `GET /kv_event_sources` (0.32:
//! each data-parallel rank's publisher configuration, with the port the OS chose when it bound port
//! 0) and, where that path is not found, the `kv_events` block of SGLang's `GET /server_info` (a host
//! and a base port, rank `r` at base + `r`).
//!
//! An advertised socket is used only on the worker's own IP: a wildcard bind (`*`, `0.0.0.0`, `::`)
//! is the worker's address, the worker's IP itself (an IPv4-mapped form too) is taken, and any other
//! host is refused, so an engine — or whatever answers on its port — cannot point the picker at
//! another machine. A publisher that connects out (vLLM's centralised mode names the collector's
//! address) and `ipc://` sockets are refused the same way; the worker's own `kv_events:` is the
//! override for all of these.
//!
//! The answer is bounded: [`ASK_TIMEOUT`] per request, [`MAX_ANSWER_BYTES`] per body (SGLang's
//! `/server_info` carries every server argument, a few kilobytes).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use serde_json::Value;
use thiserror::Error;

use crate::config::{KvEventEndpoints, WorkerConfig};
use crate::load::HttpClient;

/// How long one question may take: the API server that answers also tokenizes every request, and
/// under a burst its `/metrics` took seconds (issue 28); a slow answer is asked again later.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes an answer may have.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Why an engine's answer gave no sockets.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum LocateError {
    /// Neither path exists: an engine that predates the advertisement.
    #[error(
        "the engine does not advertise its KV event sockets (no /kv_event_sources or /server_info kv_events)"
    )]
    NotAdvertised,
    /// The engine answered that it publishes no events.
    #[error("the engine publishes no KV events")]
    NotPublishing,
    /// An advertised socket this picker will not subscribe to.
    #[error("refused the advertised socket {endpoint:?}: {why}")]
    Refused { endpoint: String, why: &'static str },
    #[error("undecodable answer from {path}: {why}")]
    Malformed { path: &'static str, why: String },
    #[error("asking {path} failed: {why}")]
    Failed { path: &'static str, why: String },
}

impl LocateError {
    /// The engine answered, and its answer stands until it changes: ask again at the slow pace.
    pub fn is_answer(&self) -> bool {
        !matches!(self, LocateError::Failed { .. })
    }

    /// A short label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            LocateError::NotAdvertised => "not_advertised",
            LocateError::NotPublishing => "not_publishing",
            LocateError::Refused { .. } => "refused",
            LocateError::Malformed { .. } => "malformed",
            LocateError::Failed { .. } => "failed",
        }
    }
}

/// Each rank's advertised sockets, by rank (`None`: the engine named none for that rank).
pub type RankSockets = Vec<Option<KvEventEndpoints>>;

const VLLM_PATH: &str = "/kv_event_sources";
const SGLANG_PATH: &str = "/server_info";

/// Asks `worker`'s engine where each of its ranks publishes: vLLM's path first, SGLang's where that
/// one is not found.
pub async fn ask(client: &HttpClient, worker: &WorkerConfig) -> Result<RankSockets, LocateError> {
    let ip = worker.endpoint.ip();
    let ranks = worker.dp_size.get();
    match get(client, worker, VLLM_PATH).await? {
        Some(body) => vllm(&body, ip, ranks),
        None => match get(client, worker, SGLANG_PATH).await? {
            Some(body) => sglang(&body, ip, ranks),
            None => Err(LocateError::NotAdvertised),
        },
    }
}

/// The body of `path` on the worker's API port; `None` when the engine has no such path.
async fn get(
    client: &HttpClient,
    worker: &WorkerConfig,
    path: &'static str,
) -> Result<Option<Bytes>, LocateError> {
    let failed = |why: String| LocateError::Failed { path, why };
    // The API server is the endpoint Envoy sends requests to, on the scheme it is scraped with.
    let scheme = if worker.metrics_url.starts_with("https://") {
        "https"
    } else {
        "http"
    };
    let uri: Uri = format!("{scheme}://{}{path}", worker.endpoint)
        .parse()
        .map_err(|error: http::uri::InvalidUri| failed(error.to_string()))?;
    let request = Request::get(uri)
        .header(header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|error| failed(error.to_string()))?;
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|error| failed(innermost(&error)))?;
        match response.status() {
            // FastAPI answers 405 for a path some other method serves; neither is this one.
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => return Ok(None),
            status if !status.is_success() => {
                return Err(failed(format!("answered HTTP {status}")));
            }
            _ => {}
        }
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|error| failed(error.to_string()))?;
        Ok(Some(body.to_bytes()))
    };
    tokio::time::timeout(ASK_TIMEOUT, exchange)
        .await
        .map_err(|_| failed(format!("no answer within {ASK_TIMEOUT:?}")))?
}

fn innermost(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

fn json(body: &[u8], path: &'static str) -> Result<Value, LocateError> {
    serde_json::from_slice(body).map_err(|error| LocateError::Malformed {
        path,
        why: error.to_string(),
    })
}

/// vLLM's `/kv_event_sources`: `{"<rank>": {"publisher": "zmq", "endpoint": ..., "replay_endpoint":
/// ..., ...}}`, one entry per rank that publishes (an empty map when none does).
pub fn vllm(body: &[u8], ip: IpAddr, ranks: u32) -> Result<RankSockets, LocateError> {
    let malformed = |why: String| LocateError::Malformed {
        path: VLLM_PATH,
        why,
    };
    let Value::Object(sources) = json(body, VLLM_PATH)? else {
        return Err(malformed("not a JSON object of ranks".to_owned()));
    };
    let mut sockets: RankSockets = vec![None; ranks as usize];
    for (rank, source) in &sources {
        let rank: u32 = rank
            .parse()
            .map_err(|_| malformed(format!("{rank:?} is not a rank")))?;
        // A rank beyond the configured dp_size is not subscribed to; dp_size says how many there are.
        let Some(slot) = sockets.get_mut(rank as usize) else {
            continue;
        };
        if source.get("publisher").and_then(Value::as_str) != Some("zmq") {
            continue;
        }
        let text = |key: &str| source.get(key).and_then(Value::as_str);
        let live =
            text("endpoint").ok_or_else(|| malformed(format!("rank {rank} has no endpoint")))?;
        *slot = Some(KvEventEndpoints {
            live: socket(live, ip)?,
            replay: text("replay_endpoint")
                .map(|replay| socket(replay, ip))
                .transpose()?,
        });
    }
    if sockets.iter().all(Option::is_none) {
        return Err(LocateError::NotPublishing);
    }
    Ok(sockets)
}

/// SGLang's `/server_info`: its `kv_events` block (`null` when it publishes nothing) names a host and
/// a base port per socket; rank `r` is at base + `r`.
pub fn sglang(body: &[u8], ip: IpAddr, ranks: u32) -> Result<RankSockets, LocateError> {
    let malformed = |why: String| LocateError::Malformed {
        path: SGLANG_PATH,
        why,
    };
    let info = json(body, SGLANG_PATH)?;
    let block = match info.get("kv_events") {
        None => return Err(LocateError::NotAdvertised),
        Some(Value::Null) => return Err(LocateError::NotPublishing),
        Some(block) => block,
    };
    if block.get("publisher").and_then(Value::as_str) != Some("zmq") {
        return Err(LocateError::NotPublishing);
    }
    let base = |host: &str, port: &str| -> Result<Option<(String, u64)>, LocateError> {
        match (block.get(host), block.get(port)) {
            (Some(Value::String(host)), Some(port)) => port
                .as_u64()
                .map(|port| Some((host.clone(), port)))
                .ok_or_else(|| malformed(format!("{port} is not a port"))),
            (None | Some(Value::Null), None | Some(Value::Null)) => Ok(None),
            _ => Err(malformed(format!("{host} and {port} come together"))),
        }
    };
    let live = base("endpoint_host", "endpoint_port_base")?
        .ok_or_else(|| malformed("no endpoint_host".to_owned()))?;
    let replay = base("replay_endpoint_host", "replay_endpoint_port_base")?;
    let at = |(host, port): &(String, u64), rank: u32| -> Result<SocketAddr, LocateError> {
        let port = port.saturating_add(u64::from(rank));
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        socket(&format!("tcp://{host}:{port}"), ip)
    };
    (0..ranks)
        .map(|rank| {
            Ok(Some(KvEventEndpoints {
                live: at(&live, rank)?,
                replay: replay.as_ref().map(|replay| at(replay, rank)).transpose()?,
            }))
        })
        .collect()
}

/// An advertised ZeroMQ endpoint, as a socket on the worker's IP `ip`.
pub fn socket(endpoint: &str, ip: IpAddr) -> Result<SocketAddr, LocateError> {
    let refused = |why: &'static str| LocateError::Refused {
        endpoint: endpoint.to_owned(),
        why,
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| refused("not a TCP endpoint"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| refused("no port"))?;
    let port: u16 = match port.parse() {
        Ok(0) => {
            return Err(refused(
                "port 0: the engine did not say which port it bound",
            ));
        }
        Ok(port) => port,
        Err(_) => return Err(refused("not a port from 1 to 65535")),
    };
    let host = host
        .strip_prefix('[')
        .and_then(|host| host.strip_suffix(']'))
        .unwrap_or(host);
    let own = ip.to_canonical();
    let at = if host == "*" {
        own
    } else {
        let advertised: IpAddr = host
            .parse()
            .map_err(|_| refused("not an IP address (names are not resolved)"))?;
        let advertised = advertised.to_canonical();
        if advertised.is_unspecified() {
            own
        } else if advertised == own {
            advertised
        } else {
            return Err(refused("not the worker's own IP"));
        }
    };
    Ok(SocketAddr::new(at, port))
}

#[cfg(test)]
mod tests;

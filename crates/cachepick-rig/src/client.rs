//! An ext_proc client that asks a running picker for a decision the way Envoy does (request headers
//! with `protocol_config` BUFFERED, then the whole body), for the demo, the replay tool and tests that
//! drive the picker without a proxy.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    external_processor_client::ExternalProcessorClient, processing_request, processing_response,
};
use tonic::transport::{Channel, Endpoint};

use cachepick::extproc::{DECISION_HEADER, DESTINATION, PREFIX_TOKENS_HEADER, REFUSAL_HEADER};

/// The picker's answer, as Envoy would apply it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Send the request to `endpoints[0]` (the rest are fallbacks).
    Route {
        endpoints: Vec<SocketAddr>,
        reason: String,
        prefix_tokens: u64,
    },
    /// Answer the client locally with this status and JSON body.
    Refuse {
        status: u16,
        reason: String,
        body: Vec<u8>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the picker at {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: tonic::transport::Error,
    },
    #[error("the ext_proc stream failed: {0}")]
    Stream(#[from] tonic::Status),
    #[error("the picker ended the stream without a decision")]
    NoDecision,
    #[error("the picker is not ready: some pool has not completed a scrape round")]
    NotReady,
    #[error("no answer from the picker within {0:?}")]
    Timeout(Duration),
}

/// How long [`Client::decide`] waits for the whole exchange (sending the request, the decision).
pub const DECIDE_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to a picker's ext_proc service; cheap to clone (one HTTP/2 connection).
#[derive(Clone, Debug)]
pub struct Client {
    inner: ExternalProcessorClient<Channel>,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Result<Client, ClientError> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|source| ClientError::Connect { addr, source })?
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .map_err(|source| ClientError::Connect { addr, source })?;
        Ok(Client {
            inner: ExternalProcessorClient::new(channel).max_decoding_message_size(usize::MAX),
        })
    }

    /// Asks for the destination of a POST of `body` to `path`; [`ClientError::Timeout`] after
    /// [`DECIDE_TIMEOUT`].
    pub async fn decide(&self, path: &str, body: &[u8]) -> Result<Verdict, ClientError> {
        self.decide_within(path, body, DECIDE_TIMEOUT).await
    }

    /// [`Client::decide`] with `headers` added to the request's (a test's fault injection, say).
    pub async fn decide_with(
        &self,
        path: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<Verdict, ClientError> {
        let mut request = buffered_request(path, body);
        if let Some(processing_request::Request::RequestHeaders(sent)) = &mut request[0].request
            && let Some(map) = &mut sent.headers
        {
            map.headers
                .extend(headers.iter().map(|(key, value)| raw(key, value)));
        }
        tokio::time::timeout(DECIDE_TIMEOUT, self.send(request))
            .await
            .map_err(|_| ClientError::Timeout(DECIDE_TIMEOUT))?
    }

    /// [`Client::decide`] with its own deadline for the whole exchange.
    pub async fn decide_within(
        &self,
        path: &str,
        body: &[u8],
        limit: Duration,
    ) -> Result<Verdict, ClientError> {
        tokio::time::timeout(limit, self.exchange(path, body))
            .await
            .map_err(|_| ClientError::Timeout(limit))?
    }

    async fn exchange(&self, path: &str, body: &[u8]) -> Result<Verdict, ClientError> {
        self.send(buffered_request(path, body)).await
    }

    async fn send(&self, request: [ProcessingRequest; 2]) -> Result<Verdict, ClientError> {
        let mut client = self.inner.clone();
        let mut responses = client
            .process(futures_util::stream::iter(request))
            .await?
            .into_inner();
        let mut decided = None;
        while let Some(response) = responses.message().await? {
            if decided.is_none() {
                decided = verdict(response);
            }
        }
        // Read to the end of the stream (the picker ends it right after its answer): a stream dropped
        // before its trailers arrive is reset, and h2 closes a connection after 1,024 such resets.
        decided.ok_or(ClientError::NoDecision)
    }
}

/// The two messages Envoy sends in BUFFERED mode for a JSON POST of `body` to `path`: the request
/// headers (with `protocol_config`), then the whole body. What [`Client::decide`] sends.
pub fn buffered_request(path: &str, body: &[u8]) -> [ProcessingRequest; 2] {
    let headers = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            ..ProtocolConfiguration::default()
        }),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    raw(":method", "POST"),
                    raw(":path", path),
                    raw("content-type", "application/json"),
                ],
            }),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    };
    let body = ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    };
    [headers, body]
}

fn raw(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

/// The decision in a response, if it carries one.
fn verdict(response: ProcessingResponse) -> Option<Verdict> {
    let common = match response.response? {
        processing_response::Response::RequestHeaders(headers) => headers.response?,
        processing_response::Response::RequestBody(body) => body.response?,
        processing_response::Response::ImmediateResponse(immediate) => {
            let header = |name: &str| {
                immediate
                    .headers
                    .iter()
                    .flat_map(|mutation| &mutation.set_headers)
                    .filter_map(|option| option.header.as_ref())
                    .find(|header| header.key == name)
                    .map(|header| String::from_utf8_lossy(&header.raw_value).into_owned())
            };
            return Some(Verdict::Refuse {
                status: immediate
                    .status
                    .and_then(|status| u16::try_from(status.code).ok())
                    .unwrap_or(500),
                reason: header(REFUSAL_HEADER).unwrap_or_default(),
                body: immediate.body,
            });
        }
        _ => return None,
    };
    let set = common.header_mutation?.set_headers;
    let header = |name: &str| {
        set.iter()
            .filter_map(|option| option.header.as_ref())
            .find(|header| header.key == name)
            .map(|header| String::from_utf8_lossy(&header.raw_value).into_owned())
    };
    let destination = header(DESTINATION)?;
    Some(Verdict::Route {
        endpoints: destination
            .split(',')
            .filter_map(|entry| entry.trim().parse().ok())
            .collect(),
        reason: header(DECISION_HEADER).unwrap_or_default(),
        prefix_tokens: header(PREFIX_TOKENS_HEADER)
            .and_then(|tokens| tokens.parse().ok())
            .unwrap_or(0),
    })
}

/// Waits until the picker at `addr` reports `readiness` SERVING over gRPC health (every pool has
/// completed a scrape round), or `timeout` passes: each attempt's connect and health check are bounded
/// by the time left, so a peer that accepts and never answers cannot hold it past `timeout`.
pub async fn wait_ready(addr: SocketAddr, timeout: Duration) -> Result<(), ClientError> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|source| ClientError::Connect { addr, source })?;
    let deadline = tokio::time::Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    loop {
        let last = match tokio::time::timeout(left(), endpoint.connect()).await {
            Err(_) => Err(ClientError::Timeout(timeout)),
            Ok(Err(source)) => Err(ClientError::Connect { addr, source }),
            Ok(Ok(channel)) => {
                let mut health = HealthClient::new(channel);
                let check = health.check(HealthCheckRequest {
                    service: cachepick::extproc::READINESS.to_owned(),
                });
                match tokio::time::timeout(left(), check).await {
                    Err(_) => Err(ClientError::Timeout(timeout)),
                    Ok(answer) => answer
                        .map(|response| {
                            response.into_inner().status == ServingStatus::Serving as i32
                        })
                        .map_err(ClientError::Stream),
                }
            }
        };
        match last {
            Ok(true) => return Ok(()),
            Ok(false) if left().is_zero() => return Err(ClientError::NotReady),
            Err(error) if left().is_zero() => return Err(error),
            _ => tokio::time::sleep(left().min(Duration::from_millis(50))).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A peer that accepts connections and never says a word.
    async fn silent_peer() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        addr
    }

    #[tokio::test]
    async fn decide_gives_up_on_a_picker_that_never_answers() {
        let addr = silent_peer().await;
        let client = Client::connect(addr).await.expect("TCP connects");
        let limit = Duration::from_millis(200);
        let started = std::time::Instant::now();
        let outcome = client.decide_within("/v1/completions", b"{}", limit).await;
        assert!(
            matches!(outcome, Err(ClientError::Timeout(d)) if d == limit),
            "{outcome:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn wait_ready_returns_in_time_when_the_peer_never_answers() {
        let addr = silent_peer().await;
        let started = std::time::Instant::now();
        let outcome = wait_ready(addr, Duration::from_millis(300)).await;
        assert!(outcome.is_err(), "{outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "took {:?}",
            started.elapsed()
        );
    }
}

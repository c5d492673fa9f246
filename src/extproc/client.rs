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

use super::{DECISION_HEADER, DESTINATION, PREFIX_TOKENS_HEADER, REJECT_HEADER};

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
}

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

    /// Asks for the destination of a POST of `body` to `path`.
    pub async fn decide(&self, path: &str, body: &[u8]) -> Result<Verdict, ClientError> {
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
        let mut client = self.inner.clone();
        let mut responses = client
            .process(futures_util::stream::iter([headers, body]))
            .await?
            .into_inner();
        while let Some(response) = responses.message().await? {
            if let Some(verdict) = verdict(response) {
                return Ok(verdict);
            }
        }
        Err(ClientError::NoDecision)
    }
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
                reason: header(REJECT_HEADER).unwrap_or_default(),
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
/// completed a scrape round), or `timeout` passes.
pub async fn wait_ready(addr: SocketAddr, timeout: Duration) -> Result<(), ClientError> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match Endpoint::from_shared(format!("http://{addr}")) {
            Ok(endpoint) => match endpoint.connect().await {
                Ok(channel) => HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: super::READINESS.to_owned(),
                    })
                    .await
                    .map(|response| response.into_inner().status == ServingStatus::Serving as i32)
                    .map_err(ClientError::Stream),
                Err(source) => Err(ClientError::Connect { addr, source }),
            },
            Err(source) => return Err(ClientError::Connect { addr, source }),
        };
        match last {
            Ok(true) => return Ok(()),
            Ok(false) if tokio::time::Instant::now() >= deadline => {
                return Err(ClientError::NotReady);
            }
            Err(error) if tokio::time::Instant::now() >= deadline => return Err(error),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

//! One scrape of one worker: the HTTP request, its body under the cap, the body read into a [`Report`],
//! and [`ScrapeError`], every way that can fail. The caller bounds it in time.

use std::num::NonZeroUsize;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use thiserror::Error;

use super::engine::{self, ExtractError, Report};
use super::snapshot::ScrapeOutcome;
use super::tls::HttpClient;
use crate::config::{LoadSource, WorkerConfig};
use crate::worker::Engine;

/// Why one scrape produced no report.
#[derive(Debug, Error)]
pub enum ScrapeError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("invalid scrape URL: {0}")]
    Url(String),
    #[error("answered HTTP {0}")]
    Status(http::StatusCode),
    #[error("request failed: {0}")]
    Request(String),
    #[error("body larger than the {limit}-byte cap (load.max_body_bytes)")]
    BodyTooLarge { limit: usize },
    #[error("reading the body failed: {0}")]
    Body(String),
    #[error("body is not UTF-8 text")]
    NotUtf8,
    #[error(transparent)]
    Extract(#[from] ExtractError),
}

impl ScrapeError {
    pub fn outcome(&self) -> ScrapeOutcome {
        match self {
            ScrapeError::Timeout(_) => ScrapeOutcome::Timeout,
            ScrapeError::Connect(_) | ScrapeError::Url(_) => ScrapeOutcome::ConnectError,
            ScrapeError::Status(_)
            | ScrapeError::Request(_)
            | ScrapeError::BodyTooLarge { .. }
            | ScrapeError::Body(_) => ScrapeOutcome::HttpError,
            ScrapeError::NotUtf8 | ScrapeError::Extract(_) => ScrapeOutcome::ParseError,
        }
    }
}

/// What a request needs to know about its worker; shared with the in-flight future.
pub(super) struct Target {
    url: Result<Uri, String>,
    source: LoadSource,
    engine: Engine,
    dp_size: u32,
}

impl Target {
    pub(super) fn new(worker: &WorkerConfig, engine: Engine) -> Self {
        let url = worker.scrape_url();
        Target {
            url: url
                .parse::<Uri>()
                .map_err(|error| format!("{url}: {error}")),
            source: worker.load_source,
            engine,
            dp_size: worker.dp_size.get(),
        }
    }
}

impl Target {
    /// A body the worker answered, read into a report: the `/metrics` text or SGLang's `/v1/loads`.
    pub(super) fn read(&self, body: &[u8]) -> Result<Report, ScrapeError> {
        let report = match self.source {
            LoadSource::Metrics => {
                let text = std::str::from_utf8(body).map_err(|_| ScrapeError::NotUtf8)?;
                engine::from_metrics(self.engine, text, self.dp_size)?
            }
            LoadSource::Loads => engine::from_loads_json(body, self.dp_size)?,
        };
        Ok(report)
    }
}

/// One HTTP request and the extraction of its body; the caller bounds it in time.
pub(super) async fn fetch(
    client: &HttpClient,
    target: &Target,
    max_body: NonZeroUsize,
) -> Result<Report, ScrapeError> {
    let uri = target.url.clone().map_err(ScrapeError::Url)?;
    let accept = match target.source {
        LoadSource::Metrics => "text/plain;version=0.0.4",
        LoadSource::Loads => "application/json",
    };
    let request = Request::get(uri)
        .header(header::ACCEPT, accept)
        .body(Empty::<Bytes>::new())
        .map_err(|error| ScrapeError::Url(error.to_string()))?;
    let response = client.request(request).await.map_err(|error| {
        if error.is_connect() {
            ScrapeError::Connect(source_message(&error))
        } else {
            ScrapeError::Request(source_message(&error))
        }
    })?;
    if !response.status().is_success() {
        return Err(ScrapeError::Status(response.status()));
    }
    let limit = max_body.get();
    let declared = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ScrapeError::BodyTooLarge { limit });
    }
    let body = Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|error| {
            if error.downcast_ref::<LengthLimitError>().is_some() {
                ScrapeError::BodyTooLarge { limit }
            } else {
                ScrapeError::Body(error.to_string())
            }
        })?
        .to_bytes();
    target.read(&body)
}

/// The innermost cause, which is where hyper puts the useful text ("Connection refused").
fn source_message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

//! An HTTP client for the simulator tests: plain requests, SSE streams parsed by a standard SSE parser
//! (`eventsource-stream`) with the arrival time of every event, a reader of Prometheus text that shares
//! no code with cachepick's, and helpers over the simulator's admin routes.

#![allow(dead_code)] // not every test uses every helper

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as Legacy;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// How long any one exchange may take before the test fails instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(10);

pub const MODEL: &str = cachepick_sim::SimConfig::DEFAULT_MODEL;
pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";

/// Awaits `future` for at most `limit`, panicking with `what` on expiry.
pub async fn bounded<T>(what: &str, limit: Duration, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: nothing within {limit:?}"),
    }
}

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The simulator's `x-cached-tokens` header.
    pub fn cached_header(&self) -> u64 {
        cached_header(&self.headers)
    }

    /// `usage` of an OpenAI response.
    pub fn usage(&self) -> Usage {
        Usage::of(&self.json()["usage"])
    }
}

/// The token counts an OpenAI response reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    pub fn of(usage: &Value) -> Usage {
        let field = |value: &Value, name: &str| {
            value
                .as_u64()
                .unwrap_or_else(|| panic!("usage has no integer {name}: {usage}"))
        };
        Usage {
            prompt_tokens: field(&usage["prompt_tokens"], "prompt_tokens"),
            completion_tokens: field(&usage["completion_tokens"], "completion_tokens"),
            cached_tokens: field(
                &usage["prompt_tokens_details"]["cached_tokens"],
                "prompt_tokens_details.cached_tokens",
            ),
        }
    }

    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_tokens += other.cached_tokens;
    }
}

/// One SSE event and when it was parsed.
#[derive(Clone, Debug)]
pub struct TimedEvent {
    pub at: Instant,
    pub event: String,
    pub data: String,
}

impl TimedEvent {
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }
}

/// A streamed response read to its end (or to its transport error).
#[derive(Debug)]
pub struct Streamed {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// When the request was sent.
    pub sent: Instant,
    pub events: Vec<TimedEvent>,
    /// Why the stream ended early, if it did.
    pub error: Option<String>,
}

impl Streamed {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    pub fn cached_header(&self) -> u64 {
        cached_header(&self.headers)
    }

    /// Whether the last event is `[DONE]`.
    pub fn done(&self) -> bool {
        self.events
            .last()
            .is_some_and(|event| event.data == "[DONE]")
    }

    /// The JSON of every event before `[DONE]`; panics on an event that is not JSON.
    pub fn payloads(&self) -> Vec<Value> {
        self.events
            .iter()
            .filter(|event| event.data != "[DONE]")
            .map(|event| {
                event
                    .json()
                    .unwrap_or_else(|| panic!("event data is not JSON: {:?}", event.data))
            })
            .collect()
    }

    /// Time from sending the request to the first event whose `choices[0]` carries text (OpenAI APIs)
    /// or whose `text` is not empty (`/generate`).
    pub fn ttft(&self) -> Duration {
        self.events
            .iter()
            .find(|event| {
                event
                    .json()
                    .is_some_and(|value| !content_of(&value).is_empty())
            })
            .map(|event| event.at.duration_since(self.sent))
            .unwrap_or_else(|| panic!("no event with content: {:?}", self.events))
    }

    /// The usage of the final usage chunk (`choices: []`), with `include_usage`.
    pub fn usage(&self) -> Usage {
        let chunk = self
            .payloads()
            .into_iter()
            .rev()
            .find(|value| value["usage"].is_object())
            .unwrap_or_else(|| panic!("no usage chunk: {:?}", self.events));
        assert_eq!(
            chunk["choices"].as_array().map(Vec::len),
            Some(0),
            "the usage chunk has no choices: {chunk}"
        );
        Usage::of(&chunk["usage"])
    }
}

/// Header `name` as text, if present and text.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

/// The simulator's `x-cached-tokens` header; panics when it is missing.
fn cached_header(headers: &HeaderMap) -> u64 {
    header(headers, "x-cached-tokens")
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no x-cached-tokens header: {headers:?}"))
}

/// The text an event adds: the chat delta, the completion text, or SGLang's text so far.
pub fn content_of(value: &Value) -> String {
    let choice = &value["choices"][0];
    let piece = choice["delta"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str())
        .or_else(|| value["text"].as_str());
    piece.unwrap_or_default().to_owned()
}

/// A client to loopback servers. It keeps no idle connections, so a killed and restarted worker is
/// always reached on a fresh connection.
#[derive(Clone)]
pub struct Client {
    inner: Legacy<HttpConnector, Full<Bytes>>,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl Client {
    pub fn new() -> Client {
        let inner = Legacy::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(HttpConnector::new());
        Client { inner }
    }

    /// Sends one request; the error is the transport's.
    pub async fn send(
        &self,
        method: Method,
        addr: SocketAddr,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        match body {
            Some(body) => {
                let bytes = serde_json::to_vec(body).expect("JSON body");
                let json = [(CONTENT_TYPE.as_str(), "application/json")];
                self.send_raw(method, addr, path, &json, bytes).await
            }
            None => self.send_raw(method, addr, path, &[], Vec::new()).await,
        }
    }

    /// Sends one request with `headers` and a `body` of any bytes; the error is the transport's.
    pub async fn send_raw(
        &self,
        method: Method,
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::from(body)))
            .expect("a valid request");
        self.inner.request(request).await
    }

    /// One exchange read whole; the error is the transport's, as text.
    pub async fn try_exchange(
        &self,
        method: Method,
        addr: SocketAddr,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, String> {
        read_whole(self.send(method, addr, path, body).await).await
    }

    async fn exchange(
        &self,
        method: Method,
        addr: SocketAddr,
        path: &str,
        body: Option<&Value>,
    ) -> Reply {
        let what = format!("{method} http://{addr}{path}");
        match tokio::time::timeout(DEADLINE, self.try_exchange(method, addr, path, body)).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => panic!("{what}: {error}"),
            Err(_) => panic!("{what}: no answer within {DEADLINE:?}"),
        }
    }

    pub async fn get(&self, addr: SocketAddr, path: &str) -> Reply {
        self.exchange(Method::GET, addr, path, None).await
    }

    pub async fn post(&self, addr: SocketAddr, path: &str, body: &Value) -> Reply {
        self.exchange(Method::POST, addr, path, Some(body)).await
    }

    /// Sends a streaming request and returns once the response head arrived: a streamed response's
    /// head comes as soon as the request is admitted, before its prefill.
    pub async fn open_stream(&self, addr: SocketAddr, path: &str, body: &Value) -> Opened {
        let sent = Instant::now();
        let response =
            tokio::time::timeout(DEADLINE, self.send(Method::POST, addr, path, Some(body)))
                .await
                .unwrap_or_else(|_| panic!("POST {path}: no response head within {DEADLINE:?}"))
                .unwrap_or_else(|error| panic!("POST {path}: {error:?}"));
        Opened { sent, response }
    }

    /// Sends a streaming request and reads every event until the stream ends.
    pub async fn stream(&self, addr: SocketAddr, path: &str, body: &Value) -> Streamed {
        let opened = self.open_stream(addr, path, body).await;
        tokio::time::timeout(DEADLINE, opened.read())
            .await
            .unwrap_or_else(|_| panic!("POST {path}: stream not over within {DEADLINE:?}"))
    }
}

/// A response read to the end of its body; the error is the transport's, as text.
pub async fn read_whole(
    response: Result<Response<Incoming>, hyper_util::client::legacy::Error>,
) -> Result<Reply, String> {
    let (parts, body) = response.map_err(|error| format!("{error:?}"))?.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|error| format!("{error:?}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// A streamed response whose head arrived and whose body is not read yet.
pub struct Opened {
    pub sent: Instant,
    pub response: Response<Incoming>,
}

impl Opened {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(self.response.headers(), name)
    }

    /// The body as a stream of SSE events, read one at a time.
    pub fn events(self) -> Events {
        let (parts, body) = self.response.into_parts();
        Events {
            status: parts.status,
            headers: parts.headers,
            sent: self.sent,
            stream: Box::pin(body.into_data_stream().eventsource()),
            events: Vec::new(),
            error: None,
        }
    }

    /// Reads the body as SSE to its end or its first error.
    pub async fn read(self) -> Streamed {
        self.events().finish().await
    }

    /// Reads `count` events (fewer if the stream ends first), then drops the body: the client goes away.
    pub async fn take(self, count: usize) -> Vec<TimedEvent> {
        let mut events = self.events();
        for _ in 0..count {
            if events.next().await.is_none() {
                break;
            }
        }
        events.events
    }
}

type EventItem =
    Result<eventsource_stream::Event, eventsource_stream::EventStreamError<hyper::Error>>;

/// A streamed body being read event by event; every event read is kept.
pub struct Events {
    status: StatusCode,
    headers: HeaderMap,
    sent: Instant,
    stream: std::pin::Pin<Box<dyn futures_util::Stream<Item = EventItem> + Send>>,
    events: Vec<TimedEvent>,
    error: Option<String>,
}

impl Events {
    /// The next event; `None` at the end of the body or at its first error (kept for `finish`).
    /// Panics when nothing arrives within `DEADLINE`.
    pub async fn next(&mut self) -> Option<TimedEvent> {
        if self.error.is_some() {
            return None;
        }
        let item = tokio::time::timeout(DEADLINE, self.stream.next())
            .await
            .unwrap_or_else(|_| panic!("no event within {DEADLINE:?}"))?;
        match item {
            Ok(event) => {
                let timed = TimedEvent {
                    at: Instant::now(),
                    event: event.event,
                    data: event.data,
                };
                self.events.push(timed.clone());
                Some(timed)
            }
            Err(problem) => {
                self.error = Some(problem.to_string());
                None
            }
        }
    }

    /// Reads the rest of the body and returns everything read.
    pub async fn finish(mut self) -> Streamed {
        while self.next().await.is_some() {}
        Streamed {
            status: self.status,
            headers: self.headers,
            sent: self.sent,
            events: self.events,
            error: self.error,
        }
    }
}

// Prometheus text, read without cachepick's parser.

/// One sample line: its name, labels and value.
#[derive(Clone, Debug, PartialEq)]
pub struct PromSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl PromSample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Every sample of an exposition; panics on a line that is not a comment, blank or sample.
pub fn prom_samples(text: &str) -> Vec<PromSample> {
    text.lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| parse_sample(line).unwrap_or_else(|| panic!("not a sample line: {line:?}")))
        .collect()
}

fn parse_sample(line: &str) -> Option<PromSample> {
    let name_end = line.find(['{', ' '])?;
    let name = line.get(..name_end)?.to_owned();
    let mut rest = line.get(name_end..)?;
    let mut labels = Vec::new();
    if let Some(list) = rest.strip_prefix('{') {
        let mut chars = list.char_indices();
        let mut current = String::new();
        let mut close = None;
        while let Some((index, c)) = chars.next() {
            match c {
                '}' if current.is_empty() => {
                    close = Some(index);
                    break;
                }
                ',' if current.is_empty() => {}
                '=' => {
                    let (_, quote) = chars.next()?;
                    if quote != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        let (_, c) = chars.next()?;
                        match c {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut current), value));
                }
                c => current.push(c),
            }
        }
        rest = list.get(close? + 1..)?;
    }
    let value = match rest.trim() {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        number => number.parse().ok()?,
    };
    Some(PromSample {
        name,
        labels,
        value,
    })
}

/// The samples named `name` whose labels include `labels`.
fn samples(text: &str, name: &str, labels: &[(&str, &str)]) -> Vec<PromSample> {
    prom_samples(text)
        .into_iter()
        .filter(|sample| {
            sample.name == name
                && labels
                    .iter()
                    .all(|(label, value)| sample.label(label) == Some(value))
        })
        .collect()
}

/// The value of the one sample named `name` whose labels include `labels`; panics unless exactly one.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found = samples(text, name, labels);
    match found.as_slice() {
        [one] => one.value,
        other => panic!("expected one {name}{labels:?}, found {other:?} in:\n{text}"),
    }
}

/// `name{labels…}` summed over the samples whose labels include `labels`; 0 when there is none.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(text, name, labels)
        .iter()
        .map(|sample| sample.value)
        .sum()
}

// The simulator's admin routes.

/// `/admin/state`, with running and waiting summed over ranks.
pub struct State {
    pub json: Value,
}

impl State {
    fn sum(&self, field: &str) -> u64 {
        self.ranks()
            .iter()
            .map(|rank| rank[field].as_u64().unwrap_or(0))
            .sum()
    }

    pub fn ranks(&self) -> Vec<Value> {
        self.json["ranks"].as_array().cloned().unwrap_or_default()
    }

    pub fn running(&self) -> u64 {
        self.sum("running")
    }

    pub fn waiting(&self) -> u64 {
        self.sum("waiting")
    }

    pub fn field(&self, field: &str) -> u64 {
        self.sum(field)
    }
}

impl Client {
    pub async fn state(&self, addr: SocketAddr) -> State {
        let reply = self.get(addr, "/admin/state").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        State { json: reply.json() }
    }

    /// Polls `/admin/state` until `done` holds; panics after `DEADLINE`.
    pub async fn wait_state(
        &self,
        addr: SocketAddr,
        what: &str,
        done: impl Fn(&State) -> bool,
    ) -> State {
        let start = Instant::now();
        loop {
            let state = self.state(addr).await;
            if done(&state) {
                return state;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "waited {DEADLINE:?} for {what}; state: {}",
                state.json
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `count` requests are running or waiting on the worker.
    /// Waits until the worker holds `count` requests, running or waiting (under the step model's
    /// SGLang a prefill under way is in neither reported count, so the held count is read).
    pub async fn wait_accounted(&self, addr: SocketAddr, count: u64) -> State {
        self.wait_state(
            addr,
            &format!("{count} requests running or waiting"),
            |state| state.field("requests") == count,
        )
        .await
    }

    /// Waits until nothing runs or waits on the worker.
    pub async fn wait_idle(&self, addr: SocketAddr) -> State {
        self.wait_accounted(addr, 0).await
    }

    pub async fn admin(&self, addr: SocketAddr, path: &str, body: &Value) -> Reply {
        let reply = self.post(addr, path, body).await;
        assert!(
            reply.status.is_success(),
            "POST {path} {body}: {} {}",
            reply.status,
            reply.text()
        );
        reply
    }

    pub async fn pause(&self, addr: SocketAddr) {
        self.admin(addr, "/admin/pause", &serde_json::json!({}))
            .await;
    }

    pub async fn resume(&self, addr: SocketAddr) {
        self.admin(addr, "/admin/resume", &serde_json::json!({}))
            .await;
    }
}

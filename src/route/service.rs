//! The request service between the wire and the picker: one call per request that prepares, decides,
//! commits, counts and logs, and answers in domain terms that `extproc` translates into Envoy's.
//!
//! It never sees a protobuf type: `extproc` hands it the request's path, its body (or none, for a
//! header-only request) and the proxy's subset hint as addresses, and gets back an [`Answer`]: a
//! [`Routed`] request or a [`Refusal`], whose [`RefusalReason`] carries the status and label.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::Serialize;

use super::admission::{Admission, AdmissionView, Admitted, CommitGate};
use super::credit::{Credit, ServedReport, Settled};
use super::explain::{Explanation, WorkerTiers};
use super::picker::{Allowance, Picker, Pinned, RequestError};
use super::prepared::Prepared;
use crate::config::{OverloadConfig, UnknownSubset};
use crate::discovery::{SourceState, SourceStatus};
use crate::events::EventFeeds;
use crate::events::stream::StreamView;
use crate::load::{PoolView, RosterObserver};
use crate::metrics::Metrics;
use crate::policy::{Decision, Gate, Outcome, Reason, RejectReason};
use crate::protocol::{PASSTHROUGH, RefusalReason, ShedReason};
use crate::request::{self, ApiPath, charset, encoding};
use crate::tokenize::TokenizeError;

/// Info-level events (pins, blind gates) are logged for one request in this many, so a saturated
/// fleet cannot flood the log; the metrics count every one.
const LOG_SAMPLE: u64 = 64;

/// One request as the wire hands it in: everything routing reads, none of it a protobuf type.
#[derive(Clone, Copy, Debug, Default)]
pub struct Inbound<'a> {
    /// `:path` as sent, query string included.
    pub path: &'a str,
    /// `:method`, when the wire knows it: only a POST is read for a prompt and learned from.
    pub method: Option<&'a str>,
    /// `None` for a request without one.
    pub body: Option<&'a [u8]>,
    /// The proxy's subset hint: the only endpoints the request may go to.
    pub subset: Option<&'a [SocketAddr]>,
    /// The request's `content-encoding`, as sent.
    pub content_encoding: Option<&'a str>,
    /// The value of the configured tenant header (`cache_salt_header`), when it was sent.
    pub tenant: Option<&'a str>,
}

impl<'a> Inbound<'a> {
    /// A request to `path` with `body` and nothing else.
    pub fn new(path: &'a str, body: Option<&'a [u8]>) -> Inbound<'a> {
        Inbound {
            path,
            body,
            ..Inbound::default()
        }
    }
}

/// Where a request goes, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Routed {
    pub pool: String,
    /// The selected worker first, then the fallbacks Envoy may retry on.
    pub endpoints: Vec<SocketAddr>,
    pub reason: Reason,
    /// Leading prompt tokens the selected worker is credited with holding.
    pub matched_tokens: u64,
    pub prompt_tokens: u64,
    /// No prompt: routed by load alone ([`PASSTHROUGH`]), not counted as a decision.
    pub passthrough: bool,
    /// What the commit credited, for the response's report to settle (`feedback.enabled`).
    #[serde(skip)]
    pub credit: Option<Credit>,
}

impl Routed {
    /// The `x-cachepick-decision` value: the reason, or [`PASSTHROUGH`].
    pub fn label(&self) -> &'static str {
        if self.passthrough {
            PASSTHROUGH
        } else {
            self.reason.as_str()
        }
    }

    /// The Endpoint Picker Protocol's value: `ip:port[,ip:port...]`.
    pub fn destination(&self) -> String {
        let endpoints: Vec<String> = self.endpoints.iter().map(ToString::to_string).collect();
        endpoints.join(",")
    }
}

/// A request answered by cachepick itself instead of a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// The status and the stable label (also the JSON error `type` and `x-cachepick-reject-reason`).
    pub reason: RefusalReason,
    pub message: String,
    /// The pool, when one was selected.
    pub pool: Option<String>,
}

impl Refusal {
    /// The HTTP status for the client.
    pub fn status(&self) -> u16 {
        self.reason.status()
    }
}

/// What cachepick answers a request with: route it, refuse it, or give it up (shed) so that the proxy
/// routes it by its own load balancing.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Route(Routed),
    Refuse(Refusal),
    /// Decided too late, or for a stream that is gone: nothing was committed.
    Shed(ShedReason),
}

impl Answer {
    pub fn pool(&self) -> Option<&str> {
        match self {
            Answer::Route(routed) => Some(&routed.pool),
            Answer::Refuse(refusal) => refusal.pool.as_deref(),
            Answer::Shed(_) => None,
        }
    }
}

impl From<RejectReason> for RefusalReason {
    /// The policy's reasons for routing nowhere, as the wire answers them.
    fn from(reason: RejectReason) -> Self {
        match reason {
            RejectReason::NoWorkers => RefusalReason::NoWorkers,
        }
    }
}

/// Why an explain call did not explain.
#[derive(Debug)]
pub enum ExplainError {
    /// Refused before any work (rate, busy).
    Refused(super::admission::ExplainRefused),
    /// The body cannot be routed: what a request with it would be answered.
    Request(RequestError),
    /// The explanation failed inside cachepick.
    Failed(String),
}

/// A pool as the operator commands show it: its load snapshot and, in `events` mode, its KV event
/// streams.
#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    #[serde(flatten)]
    pub view: PoolView,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kv_events: Vec<StreamView>,
    /// Where the pool's workers come from, and how that source is doing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceReport>,
}

/// A pool's source of workers as the operator commands show it.
#[derive(Clone, Debug, Serialize)]
pub struct SourceReport {
    /// `file`, `dns` or `kubernetes`.
    pub kind: &'static str,
    #[serde(flatten)]
    pub state: SourceState,
}

impl PoolReport {
    /// Each pool's view with its streams, matched by pool label.
    pub fn join(
        views: Vec<PoolView>,
        mut streams: Vec<(String, Vec<StreamView>)>,
    ) -> Vec<PoolReport> {
        views
            .into_iter()
            .map(|view| {
                let kv_events = streams
                    .iter_mut()
                    .find(|(pool, _)| *pool == view.pool)
                    .map(|(_, streams)| std::mem::take(streams))
                    .unwrap_or_default();
                PoolReport {
                    view,
                    kv_events,
                    source: None,
                }
            })
            .collect()
    }
}

/// The request path for a running picker.
pub struct Service {
    picker: Picker,
    metrics: Arc<Metrics>,
    /// The KV event streams of the `events` pools; started by [`Service::start_event_feeds`].
    feeds: Arc<EventFeeds>,
    /// Counts info-level events for sampling.
    sampled: AtomicU64,
    /// Each pool's source of workers, by pool label, once the app has started them.
    sources: Mutex<Vec<(String, Arc<SourceStatus>)>>,
    /// Decision slots, queue, deadline, explain's share and the body budget.
    admission: Admission,
}

impl Service {
    /// The service with `overload`'s default bounds.
    pub fn new(picker: Picker, metrics: Arc<Metrics>) -> Arc<Service> {
        Service::with_overload(picker, metrics, &OverloadConfig::default())
    }

    /// The service with the bounds of `overload`.
    pub fn with_overload(
        picker: Picker,
        metrics: Arc<Metrics>,
        overload: &OverloadConfig,
    ) -> Arc<Service> {
        for load in picker.loads() {
            metrics.init_pool(load.label());
        }
        let feeds = Arc::new(EventFeeds::new(picker.event_indexes()));
        for load in picker.loads() {
            feeds.report_restarts(load.label(), Arc::clone(load));
        }
        let streams = Arc::clone(&feeds);
        metrics.watch_kv_events(Arc::new(move |now| streams.views(now)));
        let admission = Admission::new(
            overload,
            Admission::default_slots(),
            metrics.overload.clone(),
        );
        let service = Arc::new(Service {
            picker,
            metrics,
            feeds,
            sampled: AtomicU64::new(0),
            sources: Mutex::new(Vec::new()),
            admission,
        });
        let weak = Arc::downgrade(&service);
        service.metrics.watch_index(Arc::new(move || {
            weak.upgrade()
                .map(|service| service.picker.index_stats())
                .unwrap_or_default()
        }));
        let weak = Arc::downgrade(&service);
        service.metrics.watch_segment_cache(Arc::new(move || {
            weak.upgrade()
                .map(|service| service.picker.segment_cache_bytes())
                .unwrap_or_default()
        }));
        service
    }

    pub fn picker(&self) -> &Picker {
        &self.picker
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Decision slots, queue, deadline, explain's share and the body budget.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Admission's state as the debug snapshot shows it.
    /// A decision slot for a request with `body` (see [`Admission::admit`]).
    pub async fn admit(
        &self,
        deadline: Instant,
        body: Option<&[u8]>,
    ) -> Result<Admitted, ShedReason> {
        self.admission.admit(deadline, body).await
    }

    pub fn admission_view(&self) -> AdmissionView {
        self.admission.view()
    }

    /// A refusal made before any pool was selected, counted like every other: the wire's own refusals
    /// (a stalled or oversized body, an unsupported body mode) come through here too.
    pub fn refuse(&self, reason: RefusalReason, message: String) -> Refusal {
        self.metrics.record_rejection("none", reason);
        Refusal {
            reason,
            message,
            pool: None,
        }
    }

    /// Routes one request: its body is `None` for a request without one; its subset is the proxy's
    /// hint, the only endpoints it may pick.
    ///
    /// Generation requests (`/v1/chat/completions`, `/v1/completions`, `/generate`) must carry a readable
    /// prompt. Anything else — a GET, a POST to another API — is routed by load alone to the pool its
    /// `model` names (else the default pool): a passthrough, neither a decision nor a prefix to learn.
    pub fn route(&self, inbound: &Inbound<'_>) -> Answer {
        self.route_gated(inbound, &CommitGate::open())
    }

    /// [`route`](Self::route), committing only while `gate` allows it (the decision's deadline has not
    /// passed and its stream is still there): a decision the gate refuses is [`Answer::Shed`], and
    /// nothing of it reaches the owner index or the dispatch counts.
    pub fn route_gated(&self, inbound: &Inbound<'_>, gate: &CommitGate) -> Answer {
        let Inbound { body, subset, .. } = *inbound;
        let path = ApiPath::new(inbound.path);
        // Only a POST makes an engine generate: a GET or DELETE with a chat body leaves nothing in its
        // cache, so it is routed by load and never learned; OPTIONS and HEAD pass through too.
        let generates = inbound.method.is_none_or(|method| method == "POST");
        let decoded = body.map(|body| self.decode(inbound.content_encoding, body));
        let prepared = match decoded {
            _ if !generates => self
                .picker
                .prepare_passthrough(body.and_then(request::model_of).as_deref())
                .map(|prepared| (prepared, true)),
            // A compressed body cachepick cannot read: routed by load, like a request without a prompt.
            Some(None) => self
                .picker
                .prepare_passthrough(None)
                .map(|prepared| (prepared, true)),
            Some(Some(body)) => self.prepare(path, &body, inbound.tenant, gate),
            None if path.api.is_some() => {
                let message = format!("a request to {} needs a JSON body with a prompt", path.path);
                return Answer::Refuse(self.refuse(RefusalReason::MissingBody, message));
            }
            None => self
                .picker
                .prepare_passthrough(None)
                .map(|prepared| (prepared, true)),
        };
        let (prepared, passthrough) = match prepared {
            Ok(prepared) => prepared,
            Err(RequestError::Tokenize(TokenizeError::Interrupted)) => {
                // The gate closed while the prompt was tokenized: the slot is given back now, and the
                // request is shed as it would have been at its commit.
                self.metrics.overload.tokenize_interrupted.inc();
                return Answer::Shed(gate.check().err().map_or(ShedReason::Deadline, Into::into));
            }
            Err(error) => return self.refuse_request(&error),
        };
        let Some(pinned) = self.picker.pin(&prepared) else {
            // `prepare` only names pools that exist.
            return self.no_workers(&prepared, subset);
        };
        let allowed = subset.map(|subset| pinned.workers_in(subset));
        if let (Some(subset), Some(allowed)) = (subset, &allowed)
            && allowed.is_empty()
            && !subset.is_empty()
        {
            self.metrics.record_unknown_subset(&prepared.pool_label);
            return match self.picker.unknown_subset() {
                UnknownSubset::Refuse => {
                    self.rejected(&prepared, RefusalReason::NoWorkers, Some(subset))
                }
                UnknownSubset::RouteWithin => self.unknown_subset(&pinned, subset, passthrough),
            };
        }
        match pinned.decide(allowed.as_deref(), Instant::now(), &mut rand::rng()) {
            Outcome::Route(decision) if passthrough => self.passed_through(&pinned, &decision),
            Outcome::Route(decision) => self.routed(&pinned, decision, gate),
            Outcome::Reject(reject) => self.rejected(&prepared, reject.reason.into(), subset),
        }
    }

    /// The body with its content-encoding undone and its text as UTF-8 (`request::charset`: a
    /// byte-order mark skipped, UTF-16 and UTF-32 transcoded, as the engines read them), within
    /// `max_body_bytes` of output; `None` when it cannot be (the request is then routed by load: never
    /// refused for it).
    fn decode<'b>(&self, content_encoding: Option<&str>, body: &'b [u8]) -> Option<Cow<'b, [u8]>> {
        let limit = self.picker.max_body_bytes();
        match self.decode_content(content_encoding, body)? {
            Cow::Borrowed(body) => charset::to_utf8(body, limit),
            Cow::Owned(body) => {
                let text = match charset::to_utf8(&body, limit)? {
                    // UTF-8 as decoded; after a byte-order mark, the rest of it.
                    Cow::Borrowed(text) if text.len() == body.len() => None,
                    Cow::Borrowed(text) => Some(text.to_vec()),
                    Cow::Owned(text) => Some(text),
                };
                Some(Cow::Owned(text.unwrap_or(body)))
            }
        }
    }

    /// The body with its content-encoding undone, within `max_body_bytes` of output; `None` when it
    /// cannot be (counted).
    fn decode_content<'b>(
        &self,
        content_encoding: Option<&str>,
        body: &'b [u8],
    ) -> Option<Cow<'b, [u8]>> {
        let decoded = encoding::decode(content_encoding, body, self.picker.max_body_bytes());
        let label = || {
            content_encoding
                .and_then(|header| encoding::codings(header).ok())
                .and_then(|codings| codings.last().map(|coding| coding.as_str()))
                .unwrap_or("other")
        };
        match decoded {
            Ok(Cow::Borrowed(body)) => Some(Cow::Borrowed(body)),
            Ok(owned) => {
                self.metrics.record_compressed_body(label(), "decoded");
                Some(owned)
            }
            Err(error) => {
                self.metrics.record_compressed_body(label(), error.as_str());
                tracing::debug!(%error, "compressed body not decoded; routed by load");
                None
            }
        }
    }

    /// The body → a prepared request, and whether it is a passthrough. Only a generation request
    /// leaves its prompt in a worker's cache, so only one is read for a prompt and learned from:
    /// anything else (a tokenizer endpoint, embeddings, a path of the gateway's own) is routed by load to
    /// the pool of the `model` it names, whatever prompt-shaped members it carries.
    fn prepare(
        &self,
        path: ApiPath<'_>,
        body: &[u8],
        tenant: Option<&str>,
        gate: &CommitGate,
    ) -> Result<(Prepared, bool), RequestError> {
        if path.api.is_none() {
            return self
                .picker
                .prepare_passthrough(request::model_of(body).as_deref())
                .map(|prepared| (prepared, true));
        }
        let read = request::read(path.api, body, self.picker.max_body_bytes())?;
        let allowance = Allowance {
            stop: gate.stop(),
            budget: Some(Arc::clone(self.admission.budget())),
        };
        self.picker
            .prepare_read(read, tenant, &allowance)
            .map(|prepared| (prepared, false))
    }

    /// The policy found no worker: 503, counted under the pool.
    fn rejected(
        &self,
        prepared: &Prepared,
        reason: RefusalReason,
        subset: Option<&[SocketAddr]>,
    ) -> Answer {
        self.metrics.record_rejection(&prepared.pool_label, reason);
        let message = match subset {
            Some(subset) => format!(
                "no routable worker of pool {} among the {} endpoint(s) the proxy allowed",
                prepared.pool_label,
                subset.len()
            ),
            None => format!("no routable worker in pool {}", prepared.pool_label),
        };
        tracing::debug!(pool = %prepared.pool_label, reason = reason.as_str(), "request rejected");
        Answer::Refuse(Refusal {
            reason,
            message,
            pool: Some(prepared.pool_label.clone()),
        })
    }

    fn no_workers(&self, prepared: &Prepared, subset: Option<&[SocketAddr]>) -> Answer {
        self.rejected(prepared, RefusalReason::NoWorkers, subset)
    }

    /// A request without a prompt: routed to the least-loaded sample, nothing committed (it leaves no
    /// prefix behind), counted apart from decisions so it does not dilute the hit-rate metrics.
    fn passed_through(&self, pinned: &Pinned<'_>, decision: &Decision) -> Answer {
        let prepared = pinned.prepared();
        self.metrics.record_passthrough(&prepared.pool_label);
        let endpoints = pinned.endpoints(decision);
        tracing::debug!(pool = %prepared.pool_label, selected = ?endpoints.first(), "passthrough");
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: decision.reason,
            matched_tokens: 0,
            prompt_tokens: 0,
            passthrough: true,
            credit: None,
        })
    }

    /// The proxy allows only endpoints the pool does not know (yet), and `unknown_subset: route_within`
    /// asks for a request anyway: a gateway whose discovery is ahead of cachepick's, where a refusal
    /// would be a 503 that Envoy's fail-open cannot rescue. The request goes within the subset, to a
    /// random endpoint, the others as fallbacks: a miss, nothing committed.
    fn unknown_subset(
        &self,
        pinned: &Pinned<'_>,
        subset: &[SocketAddr],
        passthrough: bool,
    ) -> Answer {
        let prepared = pinned.prepared();
        if self
            .sampled
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(LOG_SAMPLE)
        {
            tracing::warn!(pool = %prepared.pool_label, subset = ?subset,
                "the proxy's subset names no worker cachepick knows; routed within it blind (logged 1 in 64)");
        }
        let mut endpoints = subset.to_vec();
        endpoints.dedup();
        let first = rand::random_range(0..endpoints.len());
        endpoints.rotate_left(first);
        endpoints.truncate(pinned.max_fallbacks().saturating_add(1));
        if !passthrough {
            self.metrics.record_decision(
                &prepared.pool_label,
                Reason::CacheMiss,
                prepared.prompt_tokens,
                0,
                None,
            );
        }
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: Reason::CacheMiss,
            matched_tokens: 0,
            prompt_tokens: prepared.prompt_tokens,
            passthrough,
            credit: None,
        })
    }

    /// Settles a routed request's credit by Envoy's report of its response (`None`: no report came),
    /// counted under `cachepick_feedback_total`.
    pub fn settle(&self, pool: &str, credit: &Credit, report: Option<ServedReport>) -> Settled {
        let settled = match report {
            Some(report) => self.picker.settle(credit, report),
            None => Settled::Unreported,
        };
        self.metrics.record_feedback(pool, settled.as_str());
        tracing::debug!(pool, outcome = settled.as_str(), report = ?report,
            selected = %credit.endpoint(), "response reported");
        settled
    }

    /// Body received → answer sent, measured by the wire.
    pub fn observe_latency(&self, answer: &Answer, seconds: f64) {
        self.metrics
            .observe_decision_seconds(answer.pool().unwrap_or("none"), seconds);
    }

    /// A request refused before its pool decided: the client gets [`RequestError::client_message`];
    /// a tokenizer or template failure, whose details are the server's, is logged with them (1 in
    /// [`LOG_SAMPLE`], so a client repeating it cannot flood the log; the metrics count every one).
    fn refuse_request(&self, error: &RequestError) -> Answer {
        let reason = error.reason();
        if matches!(error, RequestError::Tokenize(_))
            && self
                .sampled
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(LOG_SAMPLE)
        {
            tracing::warn!(reason = reason.as_str(), %error,
                "request refused: the client gets the reason only (logged 1 in 64)");
        } else {
            tracing::debug!(reason = reason.as_str(), %error, "request refused");
        }
        Answer::Refuse(self.refuse(reason, error.client_message()))
    }

    fn routed(&self, pinned: &Pinned<'_>, decision: Decision, gate: &CommitGate) -> Answer {
        let prepared = pinned.prepared();
        // Right before the commit: a decision finished after its deadline, or for a stream that is gone,
        // would credit a worker the request never reaches.
        if let Err(refused) = gate.check() {
            self.metrics.overload.commit_refused(refused);
            return Answer::Shed(refused.into());
        }
        let credit = pinned.commit(&decision);
        let endpoints = pinned.endpoints(&decision);
        let block_size = pinned.block_size().max(1);
        let diverted_blocks = decision
            .diverted_tokens()
            .map(|tokens| tokens / u64::from(block_size));
        self.metrics.record_decision(
            &prepared.pool_label,
            decision.reason,
            prepared.prompt_tokens,
            decision.matched_tokens,
            diverted_blocks,
        );
        self.log(prepared, &decision, &endpoints);
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: decision.reason,
            matched_tokens: decision.matched_tokens,
            prompt_tokens: prepared.prompt_tokens,
            passthrough: false,
            credit,
        })
    }

    fn log(&self, prepared: &Prepared, decision: &Decision, endpoints: &[SocketAddr]) {
        let selected = endpoints
            .first()
            .map(ToString::to_string)
            .unwrap_or_default();
        let trace = &decision.trace;
        tracing::debug!(
            pool = %prepared.pool_label,
            reason = decision.reason.as_str(),
            selected = %selected,
            matched_tokens = decision.matched_tokens,
            prompt_tokens = prepared.prompt_tokens,
            owners = trace.owners.len(),
            fleet = trace.fleet,
            fresh = trace.fresh,
            snapshot = trace.snapshot_version,
            "routed"
        );
        // Blind: the selected owner passed the gate only because its queue was unknown.
        let blind = trace
            .owners
            .iter()
            .any(|owner| owner.worker == decision.selected && owner.gate == Gate::Unread);
        let notable = decision.reason == Reason::SaturationPin || blind;
        if notable
            && self
                .sampled
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(LOG_SAMPLE)
        {
            tracing::info!(
                pool = %prepared.pool_label,
                reason = decision.reason.as_str(),
                selected = %selected,
                blind_gate = blind,
                fleet = trace.fleet,
                fresh = trace.fresh,
                sample = LOG_SAMPLE,
                "{}",
                if blind {
                    "routed to an owner whose queue is unknown (no fresh reading)"
                } else {
                    "fleet saturated: pinned to the least-pressured owner instead of diverting"
                }
            );
        }
    }

    /// How a body would be routed now, without routing it: the live owner index and load.
    pub fn explain(&self, path: &str, body: &[u8]) -> Result<Explanation, RequestError> {
        let mut explanation = self.picker.explain(path, body, &mut rand::rng())?;
        if explanation.depth_sources.is_some() {
            explanation.tiers = self.tiers(&explanation.prepared.pool_label);
        }
        Ok(explanation)
    }

    /// [`explain`](Self::explain) through admission: refused at once over `explain_rate` or when
    /// explain's share of slots is taken, else run on the blocking pool (tokenizing a long prompt is CPU
    /// work that must not hold a runtime thread).
    pub async fn explain_admitted<B: AsRef<[u8]> + Send + 'static>(
        self: &Arc<Self>,
        path: String,
        body: B,
    ) -> Result<Explanation, ExplainError> {
        let permit = self.admission.explain().map_err(ExplainError::Refused)?;
        let service = Arc::clone(self);
        let explained = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            service.explain(&path, body.as_ref())
        })
        .await;
        match explained {
            Ok(Ok(explanation)) => Ok(explanation),
            Ok(Err(error)) => Err(ExplainError::Request(error)),
            Err(error) => Err(ExplainError::Failed(error.to_string())),
        }
    }

    /// Each worker's blocks per tier in `pool`, summed over its ranks' streams.
    fn tiers(&self, pool: &str) -> Vec<WorkerTiers> {
        let mut tiers: Vec<WorkerTiers> = Vec::new();
        let views = self.feeds.views(Instant::now());
        let Some((_, streams)) = views.into_iter().find(|(label, _)| label == pool) else {
            return tiers;
        };
        for stream in streams {
            let at = match tiers.iter().position(|found| found.worker == stream.worker) {
                Some(at) => at,
                None => {
                    tiers.push(WorkerTiers {
                        worker: stream.worker,
                        blocks: stream
                            .tiers
                            .iter()
                            .map(|(medium, _)| (*medium, 0))
                            .collect(),
                    });
                    tiers.len() - 1
                }
            };
            if let Some(found) = tiers.get_mut(at) {
                for ((_, total), (_, blocks)) in found.blocks.iter_mut().zip(stream.tiers) {
                    *total += blocks;
                }
            }
        }
        tiers
    }

    /// Subscribes to every KV event stream of the `events` pools, until `shutdown()` completes.
    pub fn start_event_feeds<F>(
        &self,
        shutdown: impl Fn() -> F + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.feeds.start(shutdown)
    }

    /// What keeps pool `pool`'s owner index and KV event streams in step with its roster; the app hands
    /// it to the pool's scraper.
    pub fn roster(&self, pool: usize) -> Option<Arc<dyn RosterObserver>> {
        self.picker.roster(pool, &self.feeds)
    }

    /// Reports `status` as pool `pool`'s source of workers in the snapshot and the metrics.
    pub fn watch_source(&self, pool: &str, status: Arc<SourceStatus>) {
        self.metrics.watch_source(pool, Arc::clone(&status));
        self.sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((pool.to_owned(), status));
    }

    /// Every pool's load snapshot, its source of workers and, in `events` mode, its KV event streams:
    /// `/debug/snapshot`.
    pub fn report(&self) -> Vec<PoolReport> {
        let mut reports = PoolReport::join(self.snapshot(), self.feeds.views(Instant::now()));
        let sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        for report in &mut reports {
            report.source = sources
                .iter()
                .find(|(pool, _)| *pool == report.view.pool)
                .map(|(_, status)| SourceReport {
                    kind: status.kind,
                    state: status.state(),
                });
        }
        reports
    }

    /// Every pool's current snapshot as an operator reads it.
    pub fn snapshot(&self) -> Vec<PoolView> {
        let now = Instant::now();
        self.picker
            .loads()
            .map(|load| PoolView::new(load.label(), &load.snapshot(), now))
            .collect()
    }

    /// The pools' scrape-round counters, for readiness: ready once every pool has completed one.
    pub fn rounds(&self) -> Vec<tokio::sync::watch::Receiver<u64>> {
        self.picker.loads().map(|load| load.rounds()).collect()
    }

    /// Whether any pool has a worker whose reading is fresh at `now`: what readiness means.
    pub fn has_fresh_reading(&self, now: Instant) -> bool {
        self.picker.loads().any(|load| {
            let snapshot = load.snapshot();
            snapshot.workers().iter().any(|worker| {
                worker
                    .reading
                    .as_ref()
                    .is_some_and(|reading| snapshot.is_fresh(reading, now))
            })
        })
    }

    /// The request header whose value salts the prefix hashes (tenant isolation), if one is configured.
    pub fn salt_header(&self) -> Option<&str> {
        self.picker.salt_header()
    }

    /// Largest body accepted.
    pub fn max_body_bytes(&self) -> usize {
        self.picker.max_body_bytes()
    }
}

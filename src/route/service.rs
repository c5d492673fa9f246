//! The request service between the wire and the picker: one call per request that prepares, decides,
//! commits, counts and logs, and answers in domain terms that `extproc` translates into Envoy's.
//!
//! It never sees a protobuf type: `extproc` hands it the request's path, its body (or none, for a
//! header-only request) and the proxy's subset hint as addresses, and gets back an [`Answer`]: a
//! [`Routed`] request or a [`Refusal`], whose [`RefusalReason`] carries the status and label.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::admission::{Admission, AdmissionView, Admitted, CommitGate};
use super::answer::{Answer, Commit, ExplainInput, Inbound, Moment, Refusal, Routed, Routing};
use super::credit::{Credit, ServedReport, Settled};
use super::explain::Explanation;
use super::picker::{Allowance, Picker, Pinned, RequestError};
use super::prepared::Prepared;
use crate::config::{OverloadConfig, UnknownSubset};
use crate::discovery::SourceStatus;
use crate::events::EventFeeds;
use crate::load::RosterObserver;
use crate::metrics::Metrics;
use crate::policy::{Decision, Outcome, Reason};
use crate::protocol::RefusalReason;
use crate::request::{self, ApiPath, charset, encoding};
use crate::tokenize::TokenizeError;

use super::log::LOG_SAMPLE;

/// The request path for a running picker.
pub struct Service {
    pub(super) picker: Picker,
    pub(super) metrics: Arc<Metrics>,
    /// The KV event streams of the `events` pools; started by [`Service::start_event_feeds`].
    pub(super) feeds: Arc<EventFeeds>,
    /// Counts info-level events for sampling.
    sampled: AtomicU64,
    /// Each pool's source of workers, by pool label, once the app has started them.
    pub(super) sources: Mutex<Vec<(String, Arc<SourceStatus>)>>,
    /// Decision slots, queue, deadline, explain's share and the body budget.
    admission: Admission,
    /// The running configuration as `/debug/config` and the admin API show it (secrets redacted);
    /// replaced whole by each applied reload.
    effective_config: arc_swap::ArcSwap<String>,
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
            effective_config: arc_swap::ArcSwap::from_pointee(String::new()),
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

    /// Records `config` as the one running, for [`Service::effective_config`].
    pub fn set_effective_config(&self, config: &crate::config::Config) {
        self.effective_config
            .store(Arc::new(config.to_redacted_yaml()));
    }

    /// The running configuration, every key with its effective value, secrets redacted; empty until
    /// the app records one.
    pub fn effective_config(&self) -> Arc<String> {
        self.effective_config.load_full()
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
    ) -> Result<Admitted, RefusalReason> {
        self.admission.admit(deadline, body).await
    }

    pub fn admission_view(&self) -> AdmissionView {
        self.admission.view()
    }

    /// A refusal made before any pool was selected, counted like every other: the wire's own refusals
    /// (a stalled or oversized body, an unsupported body mode) come through here too.
    pub fn refuse(&self, reason: RefusalReason, message: String) -> Refusal {
        self.refusal(reason, message, true)
    }

    /// A refusal before any pool was selected; counted when `live`.
    fn refusal(&self, reason: RefusalReason, message: String, live: bool) -> Refusal {
        if live {
            self.metrics.record_refusal("none", reason);
        }
        Refusal {
            reason,
            message,
            pool: None,
        }
    }

    /// Routes one request live at `moment`, committing only while `gate` allows it:
    /// [`route`](Self::route) with [`Commit::Live`].
    pub fn answer(&self, inbound: &Inbound<'_>, gate: &CommitGate, moment: Moment) -> Answer {
        self.route(inbound, Commit::Live(gate), moment).answer
    }

    /// The request pipeline, one pass per request and per explanation: decode the body, select the
    /// pool, read and tokenize the prompt, match its blocks, take the pool's load snapshot, map the
    /// proxy's subset hint, run the policy, then commit or not. `commit` says what happens to the
    /// decision ([`Commit`]); every step before it is the same, so an explanation is the routing.
    ///
    /// Generation requests (`/v1/chat/completions`, `/v1/completions`, `/generate`) must carry a readable
    /// prompt. Anything else — a GET, a POST to another API — is routed by load alone to the pool its
    /// `model` names (else the default pool): a passthrough, neither a decision nor a prefix to learn.
    /// A live decision the gate refuses is [`Answer::Shed`], and nothing of it reaches the owner index
    /// or the dispatch counts. The request's time and its decision's randomness are `moment`'s: the
    /// pipeline reads neither the clock nor a global generator.
    pub fn route(&self, inbound: &Inbound<'_>, commit: Commit<'_>, moment: Moment) -> Routing {
        let open = CommitGate::open();
        let (gate, live) = match commit {
            Commit::Live(gate) => (gate, true),
            Commit::DryRun => (&open, false),
        };
        let subset = inbound.subset;
        let (prepared, passthrough) = match self.prepare(inbound, gate, live, moment.at) {
            Ok(prepared) => prepared,
            Err(answer) => return Routing::answered(*answer),
        };
        let Some(pinned) = self.picker.pin(&prepared, moment.at) else {
            // `prepare` only names pools that exist.
            let answer = self.refused(&prepared, RefusalReason::NoWorkers, subset, live);
            return Routing::answered(answer);
        };
        let allowed = subset.map(|subset| pinned.workers_in(subset));
        if let (Some(subset), Some(allowed)) = (subset, &allowed)
            && allowed.is_empty()
            && !subset.is_empty()
        {
            if live {
                self.metrics.record_unknown_subset(&prepared.pool_label);
            }
            let answer = match self.picker.unknown_subset() {
                UnknownSubset::Refuse => {
                    self.refused(&prepared, RefusalReason::NoWorkers, Some(subset), live)
                }
                UnknownSubset::RouteWithin => {
                    self.unknown_subset(&pinned, subset, passthrough, live)
                }
            };
            return Routing::answered(answer);
        }
        let mut rng = SmallRng::seed_from_u64(moment.seed);
        let outcome = tracing::debug_span!(target: super::TRACE_TARGET, "policy")
            .in_scope(|| pinned.decide_in_turn(allowed.as_deref(), live, &mut rng));
        let answer = match &outcome {
            Outcome::Route(decision) if passthrough => self.passed_through(&pinned, decision, live),
            Outcome::Route(decision) => self.routed(&pinned, decision, commit, &mut rng),
            Outcome::Refuse(refused) => {
                self.refused(&prepared, refused.reason.into(), subset, live)
            }
        };
        let explanation = (!live).then(|| {
            let label = match &answer {
                Answer::Route(routed) => routed.label(),
                Answer::Refuse(refusal) => refusal.reason.as_str(),
                Answer::Shed(reason) => reason.as_str(),
            };
            let streams = self.streams(&prepared.pool_label);
            let depth_sources = self.picker.depth_sources(&prepared);
            let mut explanation = Explanation::new(
                &pinned,
                outcome,
                label,
                passthrough,
                depth_sources,
                streams,
                moment.at,
            );
            if let Answer::Route(Routed { pd: Some(pd), .. }) = &answer {
                explanation.decode = Some(pd.decode.clone());
                explanation.local_prefill = pd.local;
            }
            explanation
        });
        Routing {
            answer,
            explanation,
        }
    }

    /// The request → a prepared request, and whether it is a passthrough; or the answer it gets before
    /// any pool decides (a refusal, or a shed when the gate closed while its prompt was tokenized).
    fn prepare(
        &self,
        inbound: &Inbound<'_>,
        gate: &CommitGate,
        live: bool,
        now: Instant,
    ) -> Result<(Prepared, bool), Box<Answer>> {
        let Inbound { body, .. } = *inbound;
        let path = ApiPath::new(inbound.path);
        // Only a POST makes an engine generate: a GET or DELETE with a chat body leaves nothing in its
        // cache, so it is routed by load and never learned; OPTIONS and HEAD pass through too.
        let generates = inbound.method.is_none_or(|method| method == "POST");
        let decoded = body.map(|body| self.decode(inbound.content_encoding, body, live));
        let prepared = match decoded {
            _ if !generates => self.passthrough(body.and_then(request::model_of).as_deref()),
            // A compressed body cachepick cannot read: routed by load, like a request without a prompt.
            Some(None) => self.passthrough(None),
            Some(Some(body)) => self.prepare_body(path, &body, inbound.tenant, gate, now),
            None if path.api.is_some() => {
                let message = format!("a request to {} needs a JSON body with a prompt", path.path);
                let refusal = self.refusal(RefusalReason::MissingBody, message, live);
                return Err(Box::new(Answer::Refuse(refusal)));
            }
            None => self.passthrough(None),
        };
        match prepared {
            Ok(prepared) => Ok(prepared),
            Err(RequestError::Tokenize(TokenizeError::Interrupted)) => {
                // The gate closed while the prompt was tokenized: the slot is given back now, and the
                // request is shed as it would have been at its commit.
                if live {
                    self.metrics.overload.tokenize_interrupted.inc();
                }
                Err(Box::new(Answer::Shed(
                    gate.check()
                        .err()
                        .map_or(RefusalReason::Deadline, Into::into),
                )))
            }
            Err(error) => Err(Box::new(self.refuse_request(&error, live))),
        }
    }

    /// A request routed by load alone, to the pool `model` names.
    fn passthrough(&self, model: Option<&str>) -> Result<(Prepared, bool), RequestError> {
        self.picker
            .prepare_passthrough(model)
            .map(|prepared| (prepared, true))
    }

    /// The body with its content-encoding undone and its text as UTF-8 (`request::charset`: a
    /// byte-order mark skipped, UTF-16 and UTF-32 transcoded, as the engines read them), within
    /// `max_body_bytes` of output; `None` when it cannot be (the request is then routed by load: never
    /// refused for it).
    fn decode<'b>(
        &self,
        content_encoding: Option<&str>,
        body: &'b [u8],
        live: bool,
    ) -> Option<Cow<'b, [u8]>> {
        let limit = self.picker.max_body_bytes();
        match self.decode_content(content_encoding, body, live)? {
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
    /// cannot be (counted when `live`).
    fn decode_content<'b>(
        &self,
        content_encoding: Option<&str>,
        body: &'b [u8],
        live: bool,
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
                if live {
                    self.metrics.record_compressed_body(label(), "decoded");
                }
                Some(owned)
            }
            Err(error) => {
                if live {
                    self.metrics.record_compressed_body(label(), error.as_str());
                }
                tracing::debug!(%error, "compressed body not decoded; routed by load");
                None
            }
        }
    }

    /// A decoded body → a prepared request, and whether it is a passthrough. Only a generation request
    /// leaves its prompt in a worker's cache, so only one is read for a prompt and learned from:
    /// anything else (a tokenizer endpoint, embeddings, a path of the gateway's own) is routed by load to
    /// the pool of the `model` it names, whatever prompt-shaped members it carries.
    fn prepare_body(
        &self,
        path: ApiPath<'_>,
        body: &[u8],
        tenant: Option<&str>,
        gate: &CommitGate,
        now: Instant,
    ) -> Result<(Prepared, bool), RequestError> {
        if path.api.is_none() {
            return self.passthrough(request::model_of(body).as_deref());
        }
        let read = request::read(path.api, body, self.picker.max_body_bytes())?;
        let allowance = Allowance {
            stop: gate.stop(),
            budget: Some(Arc::clone(self.admission.budget())),
        };
        self.picker
            .prepare_read(read, tenant, &allowance, now)
            .map(|prepared| (prepared, false))
    }

    /// The policy found no worker: 503, counted under the pool when `live`.
    fn refused(
        &self,
        prepared: &Prepared,
        reason: RefusalReason,
        subset: Option<&[SocketAddr]>,
        live: bool,
    ) -> Answer {
        if live {
            self.metrics.record_refusal(&prepared.pool_label, reason);
            tracing::debug!(pool = %prepared.pool_label, reason = reason.as_str(), "request refused");
        }
        let message = match subset {
            Some(subset) => format!(
                "no routable worker of pool {} among the {} endpoint(s) the proxy allowed",
                prepared.pool_label,
                subset.len()
            ),
            None => format!("no routable worker in pool {}", prepared.pool_label),
        };
        Answer::Refuse(Refusal {
            reason,
            message,
            pool: Some(prepared.pool_label.clone()),
        })
    }

    /// A request without a prompt: routed to the least-loaded sample, nothing committed (it leaves no
    /// prefix behind), counted apart from decisions so it does not dilute the hit-rate metrics.
    fn passed_through(&self, pinned: &Pinned<'_>, decision: &Decision, live: bool) -> Answer {
        let prepared = pinned.prepared();
        let endpoints = pinned.endpoints(decision);
        if live {
            self.metrics.record_passthrough(&prepared.pool_label);
            tracing::debug!(pool = %prepared.pool_label, selected = ?endpoints.first(), "passthrough");
        }
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: decision.reason,
            matched_tokens: 0,
            prompt_tokens: 0,
            passthrough: true,
            predicted_ttft_us: None,
            credit: None,
            pd: None,
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
        live: bool,
    ) -> Answer {
        let prepared = pinned.prepared();
        if live
            && self
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
        if live && !passthrough {
            self.metrics.record_decision(
                &prepared.pool_label,
                &endpoints
                    .first()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
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
            predicted_ttft_us: None,
            credit: None,
            pd: None,
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
    fn refuse_request(&self, error: &RequestError, live: bool) -> Answer {
        let reason = error.reason();
        if live
            && matches!(error, RequestError::Tokenize(_))
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
        Answer::Refuse(self.refusal(reason, error.client_message(), live))
    }

    /// A decision of the ladder. Live, it is committed right before it is answered — a decision
    /// finished after its deadline, or for a stream that is gone, would credit a worker the request
    /// never reaches, so the gate is asked first — then counted and logged.
    fn routed(
        &self,
        pinned: &Pinned<'_>,
        decision: &Decision,
        commit: Commit<'_>,
        rng: &mut SmallRng,
    ) -> Answer {
        let prepared = pinned.prepared();
        // A PD pool's request has a second pick: its decode worker, where Envoy sends it.
        let decode = pinned.decide_decode(decision, rng);
        // A request its decode worker prefills itself never reaches the prefill worker: not credited.
        let prefilled_remotely = decode
            .as_ref()
            .is_none_or(|(route, _)| route.local.is_none());
        let committing = tracing::debug_span!(target: super::TRACE_TARGET, "commit").entered();
        let credit = match commit {
            Commit::Live(gate) => {
                if let Err(refused) = gate.check() {
                    self.metrics.overload.commit_refused(refused);
                    return Answer::Shed(refused.into());
                }
                if prefilled_remotely {
                    pinned.commit(decision)
                } else {
                    None
                }
            }
            Commit::DryRun => None,
        };
        drop(committing);
        let mut endpoints = pinned.endpoints(decision);
        // The decided worker (a PD pool's prefill worker), before the decode pick takes its place.
        let selected = endpoints.first().copied();
        let pd = decode.map(|(route, decode)| {
            if commit.is_live() {
                pinned.commit_decode(&route.decode);
                self.metrics
                    .pd
                    .record_decode(&prepared.pool_label, route.decode.reason);
            }
            endpoints = decode;
            Box::new(route)
        });
        // The response comes from the decode worker, which the credit (the prefill worker's) does not
        // name: a PD request is learned from its decisions and the engines' events, not from reports.
        let credit = if pd.is_some() { None } else { credit };
        if commit.is_live() {
            let block_size = pinned.block_size().max(1);
            let diverted_blocks = decision
                .diverted_tokens()
                .map(|tokens| tokens / u64::from(block_size));
            self.metrics.record_decision(
                &prepared.pool_label,
                &selected
                    .map(|worker| worker.to_string())
                    .unwrap_or_default(),
                decision.reason,
                prepared.prompt_tokens,
                decision.matched_tokens,
                diverted_blocks,
            );
            super::log::routed(&self.sampled, prepared, decision, &endpoints);
        }
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: decision.reason,
            matched_tokens: decision.matched_tokens,
            prompt_tokens: prepared.prompt_tokens,
            passthrough: false,
            predicted_ttft_us: decision
                .trace
                .predictions
                .iter()
                .find(|predicted| predicted.worker == decision.selected)
                .map(|predicted| predicted.ttft_us),
            credit,
            pd,
        })
    }

    /// How a request would be routed now, without routing it: [`route`](Self::route) as a dry run on
    /// the live owner index and load, so it reads the path, the method, the content-encoding and the
    /// tenant header as routing does. The answer's refusal is explain's error. The proxy's subset hint
    /// is not part of an explanation (no caller of explain has one).
    pub fn explain(&self, inbound: &Inbound<'_>) -> Result<Explanation, Refusal> {
        let inbound = Inbound {
            subset: None,
            ..*inbound
        };
        let routing = self.route(&inbound, Commit::DryRun, Moment::now());
        match (routing.answer, routing.explanation) {
            (_, Some(explanation)) => Ok(explanation),
            (Answer::Refuse(refusal), None) => Err(refusal),
            (answer, None) => Err(Refusal {
                reason: RefusalReason::Internal,
                message: format!("the dry run answered without an explanation: {answer:?}"),
                pool: answer.pool().map(str::to_owned),
            }),
        }
    }

    /// [`explain`](Self::explain) through admission: refused at once over `explain_rate` or when
    /// explain's share of slots is taken, else run on the blocking pool (tokenizing a long prompt is CPU
    /// work that must not hold a runtime thread).
    pub async fn explain_admitted<B: AsRef<[u8]> + Send + 'static>(
        self: &Arc<Self>,
        request: ExplainInput<B>,
    ) -> Result<Explanation, Refusal> {
        let permit = self.admission.explain().map_err(|refused| Refusal {
            reason: RefusalReason::ExplainRefused,
            message: refused.message().to_owned(),
            pool: None,
        })?;
        let service = Arc::clone(self);
        let explained = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            service.explain(&request.inbound())
        })
        .await;
        explained.unwrap_or_else(|error| {
            Err(Refusal {
                reason: RefusalReason::Internal,
                message: format!("the explanation failed: {error}"),
                pool: None,
            })
        })
    }

    /// The KV event streams of pool `pool` (none in an `approximate` pool).
    fn streams(&self, pool: &str) -> Vec<crate::events::stream::StreamView> {
        self.feeds
            .views(Instant::now())
            .into_iter()
            .find(|(label, _)| label == pool)
            .map(|(_, streams)| streams)
            .unwrap_or_default()
    }

    /// Subscribes to every KV event stream of the `events` pools, until `shutdown()` completes;
    /// engines are asked where they publish with `client` (the scrapers').
    pub fn start_event_feeds<F>(
        &self,
        shutdown: impl Fn() -> F + Send + Sync + 'static,
        client: crate::load::HttpClient,
    ) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.feeds.start(shutdown, client)
    }

    /// KV event streams whose first connection has replayed the engine's ring (or failed), and all
    /// of them: a starting replica is ready once they are equal.
    pub fn event_streams_settled(&self) -> (usize, usize) {
        self.feeds.settled()
    }

    /// What keeps pool `pool`'s owner index and KV event streams in step with its roster; the app hands
    /// it to the pool's scraper.
    pub fn roster(&self, pool: usize) -> Option<Arc<dyn RosterObserver>> {
        self.picker.roster(pool, &self.feeds)
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

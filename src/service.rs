//! The request service between the wire and the picker: one call per request that prepares, decides,
//! commits, counts and logs, and answers in domain terms that `extproc` translates into Envoy's.
//!
//! It never sees a protobuf type: `extproc` hands it the request's path, its body (or none, for a
//! header-only request) and the proxy's subset hint as addresses, and gets back an [`Answer`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::load::PoolView;
use crate::metrics::Metrics;
use crate::picker::{Explanation, Picker, Prepared, RequestError};
use crate::policy::{Decision, Gate, Outcome, Reason};
use crate::protocol::PASSTHROUGH;
use crate::request::{self, Api};

/// Info-level events (pins, blind gates) are logged for one request in this many, so a saturated
/// fleet cannot flood the log; the metrics count every one.
const LOG_SAMPLE: u64 = 64;

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

/// Why a request is answered by cachepick itself instead of a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// HTTP status for the client: 400 bad body, 404 unknown model, 413 too large, 503 no worker.
    pub status: u16,
    /// Stable label, also the JSON error `type` and the `x-cachepick-reject-reason` header.
    pub reason: &'static str,
    pub message: String,
    /// The pool, when one was selected.
    pub pool: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Route(Routed),
    Refuse(Refusal),
}

impl Answer {
    pub fn pool(&self) -> Option<&str> {
        match self {
            Answer::Route(routed) => Some(&routed.pool),
            Answer::Refuse(refusal) => refusal.pool.as_deref(),
        }
    }
}

/// The request path for a running picker.
pub struct Service {
    picker: Picker,
    metrics: Arc<Metrics>,
    /// Counts info-level events for sampling.
    sampled: AtomicU64,
}

impl Service {
    pub fn new(picker: Picker, metrics: Arc<Metrics>) -> Arc<Service> {
        for load in picker.loads() {
            metrics.init_pool(load.label());
        }
        let service = Arc::new(Service {
            picker,
            metrics,
            sampled: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&service);
        service.metrics.watch_index(Arc::new(move || {
            weak.upgrade()
                .map(|service| service.picker.index_stats())
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

    /// Routes one request: `body` is `None` for a request without one; `subset` is the proxy's hint, the
    /// only endpoints it may pick.
    ///
    /// Generation requests (`/v1/chat/completions`, `/v1/completions`, `/generate`) must carry a readable
    /// prompt. Anything else — a GET, a POST to another API — is routed by load alone to the pool its
    /// `model` names (else the default pool): a passthrough, neither a decision nor a prefix to learn.
    pub fn route(&self, path: &str, body: Option<&[u8]>, subset: Option<&[SocketAddr]>) -> Answer {
        let generation = Api::of_path(path).is_some();
        let prepared = match body {
            Some(body) => match self.picker.prepare(path, body) {
                Ok(prepared) => Ok((prepared, false)),
                Err(_) if !generation => self
                    .picker
                    .prepare_passthrough(request::model_of(body).as_deref())
                    .map(|prepared| (prepared, true)),
                Err(error) => Err(error),
            },
            None if generation => {
                let message = format!("a request to {path} needs a JSON body with a prompt");
                self.metrics.record_rejection("none", "missing_body");
                return Answer::Refuse(Refusal {
                    status: 400,
                    reason: "missing_body",
                    message,
                    pool: None,
                });
            }
            None => self
                .picker
                .prepare_passthrough(None)
                .map(|prepared| (prepared, true)),
        };
        let (prepared, passthrough) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => return self.refuse_request(&error),
        };
        let allowed = subset.map(|subset| self.picker.workers_in(prepared.pool, subset));
        let outcome = self.picker.decide(
            &prepared,
            allowed.as_deref(),
            Instant::now(),
            &mut rand::rng(),
        );
        match outcome {
            Outcome::Route(decision) if passthrough => self.passed_through(&prepared, &decision),
            Outcome::Route(decision) => self.routed(&prepared, decision),
            Outcome::Reject(reject) => {
                let reason = reject.reason.as_str();
                self.metrics.record_rejection(&prepared.pool_label, reason);
                let message = match subset {
                    Some(subset) => format!(
                        "no routable worker of pool {} among the {} endpoint(s) the proxy allowed",
                        prepared.pool_label,
                        subset.len()
                    ),
                    None => format!("no routable worker in pool {}", prepared.pool_label),
                };
                tracing::debug!(pool = %prepared.pool_label, reason, "request rejected");
                Answer::Refuse(Refusal {
                    status: 503,
                    reason,
                    message,
                    pool: Some(prepared.pool_label),
                })
            }
        }
    }

    /// A request without a prompt: routed to the least-loaded sample, nothing committed (it leaves no
    /// prefix behind), counted apart from decisions so it does not dilute the hit-rate metrics.
    fn passed_through(&self, prepared: &Prepared, decision: &Decision) -> Answer {
        self.metrics.record_passthrough(&prepared.pool_label);
        let endpoints = self.endpoints(prepared, decision);
        tracing::debug!(pool = %prepared.pool_label, selected = ?endpoints.first(), "passthrough");
        Answer::Route(Routed {
            pool: prepared.pool_label.clone(),
            endpoints,
            reason: decision.reason,
            matched_tokens: 0,
            prompt_tokens: 0,
            passthrough: true,
        })
    }

    fn endpoints(&self, prepared: &Prepared, decision: &Decision) -> Vec<SocketAddr> {
        std::iter::once(decision.selected)
            .chain(decision.fallbacks.iter().copied())
            .filter_map(|id| self.picker.endpoint(prepared.pool, id))
            .collect()
    }

    /// Body received → answer sent, measured by the wire.
    pub fn observe_latency(&self, answer: &Answer, seconds: f64) {
        self.metrics
            .observe_decision_seconds(answer.pool().unwrap_or("none"), seconds);
    }

    fn refuse_request(&self, error: &RequestError) -> Answer {
        let reason = error.kind();
        self.metrics.record_rejection("none", reason);
        tracing::debug!(reason, %error, "request refused");
        Answer::Refuse(Refusal {
            status: error.status(),
            reason,
            message: error.to_string(),
            pool: None,
        })
    }

    fn routed(&self, prepared: &Prepared, decision: Decision) -> Answer {
        self.picker.commit(prepared, &decision);
        let endpoints = self.endpoints(prepared, &decision);
        let block_size = self.picker.block_size(prepared.pool).max(1);
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
        self.picker.explain(path, body, &mut rand::rng())
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

    /// Largest body accepted.
    pub fn max_body_bytes(&self) -> usize {
        self.picker.max_body_bytes()
    }
}

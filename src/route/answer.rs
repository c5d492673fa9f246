//! The request path's inputs and answers in domain terms: the [`Inbound`] request as the wire hands it
//! in, what a pass through the pipeline does with its decision ([`Commit`]), and the [`Answer`] —
//! [`Routed`], [`Refusal`] or a shed — that each wire maps to its own form in one function (`extproc`
//! for Envoy and the admin API, `app` for the debug endpoints, the CLI for `explain`).

use std::net::SocketAddr;
use std::time::Instant;

use serde::Serialize;

use super::admission::CommitGate;
use super::credit::Credit;
use super::explain::Explanation;
use crate::policy::{Reason, RefuseReason};
use crate::protocol::{PASSTHROUGH, RefusalReason, error_json};

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

/// When a request is routed and the randomness its decision draws: passed in, so that routing is a
/// function of its inputs. The wire takes [`Moment::now`] once per request (the clock and the thread's
/// generator); a replay in virtual time passes its own clock and a seeded draw, and gets the same
/// decisions each time.
#[derive(Clone, Copy, Debug)]
pub struct Moment {
    pub at: Instant,
    /// Seeds the decision's generator (ties at random, power-of-k samples).
    pub seed: u64,
}

impl Moment {
    /// Now, with a fresh random seed: the live path's moment.
    pub fn now() -> Moment {
        Moment {
            at: Instant::now(),
            seed: rand::random(),
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
    /// The prefill-time unit's predicted time to first token on the selected (prefill) worker, in
    /// microseconds; `None` for the request-unit policies and a worker without a prediction.
    pub predicted_ttft_us: Option<u64>,
    /// What the commit credited, for the response's report to settle (`feedback.enabled`).
    #[serde(skip)]
    pub credit: Option<Credit>,
    /// In a prefill/decode pool: the prefill leg's workers and the decode pick. `endpoints` are then
    /// the decode worker and its fallbacks, and `reason` the prefill worker's.
    pub pd: Option<Box<super::PdRoute>>,
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
    /// The status and the stable label (also the JSON error `type` and `x-cachepick-refusal-reason`).
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
    Shed(RefusalReason),
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

impl From<RefuseReason> for RefusalReason {
    /// The policy's reasons for routing nowhere, as the wire answers them.
    fn from(reason: RefuseReason) -> Self {
        match reason {
            RefuseReason::NoWorkers => RefusalReason::NoWorkers,
        }
    }
}

impl Refusal {
    /// The JSON error body every HTTP surface answers a refusal with (OpenAI's shape, the label as its
    /// `type`).
    pub fn body(&self) -> Vec<u8> {
        error_json(self.reason.as_str(), &self.message)
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status(),
            self.reason.as_str(),
            self.message
        )
    }
}

/// What a pass through the request pipeline does with its decision. Routing and explaining run the
/// same steps in the same order (`Service::route`); only what happens to the decision differs.
#[derive(Clone, Copy, Debug)]
pub enum Commit<'g> {
    /// Routing: the decision is committed while `gate` allows it (else the request is shed), takes
    /// the pool's round-robin turn, and is counted and logged.
    Live(&'g CommitGate),
    /// Explaining: the decision is made on the live owner index and load, and nothing of it is
    /// committed, counted or logged; a round-robin pool's next turn is looked at, not taken.
    DryRun,
}

impl Commit<'_> {
    /// Whether the pass routes a request (and so commits, counts and logs).
    pub fn is_live(self) -> bool {
        matches!(self, Commit::Live(_))
    }
}

/// One pass through the pipeline: the answer, and for a dry run what the pipeline saw on the way to it
/// (none when it stopped before the policy ran: a refusal, a shed).
#[derive(Debug)]
pub struct Routing {
    pub answer: Answer,
    pub explanation: Option<Explanation>,
}

impl Routing {
    /// An answer given before the policy ran.
    pub(super) fn answered(answer: Answer) -> Routing {
        Routing {
            answer,
            explanation: None,
        }
    }

    /// The label routing puts on the request: the decision's (or `passthrough`), the refusal's, or
    /// the shed's — what explain must agree with.
    pub fn label(&self) -> &'static str {
        match &self.answer {
            Answer::Route(routed) => routed.label(),
            Answer::Refuse(refusal) => refusal.reason.as_str(),
            Answer::Shed(reason) => reason.as_str(),
        }
    }
}

/// An explain call's request, owned so that it can move to the blocking pool: what `explain` reads of
/// a request, as routing reads it.
#[derive(Clone, Debug)]
pub struct ExplainInput<B> {
    /// The API path the body is for.
    pub path: String,
    pub body: B,
    /// The body's `content-encoding`, as the request would send it.
    pub content_encoding: Option<String>,
    /// The value of the configured tenant header (`cache_salt_header`).
    pub tenant: Option<String>,
}

impl<B: AsRef<[u8]>> ExplainInput<B> {
    /// A body for `path`, uncompressed and without a tenant.
    pub fn new(path: impl Into<String>, body: B) -> Self {
        ExplainInput {
            path: path.into(),
            body,
            content_encoding: None,
            tenant: None,
        }
    }

    /// The request as routing would see it.
    pub fn inbound(&self) -> Inbound<'_> {
        Inbound {
            path: &self.path,
            method: None,
            body: Some(self.body.as_ref()),
            subset: None,
            content_encoding: self.content_encoding.as_deref(),
            tenant: self.tenant.as_deref(),
        }
    }
}

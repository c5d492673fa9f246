//! The decision hand-off: from the moment a request's decision is owed to its outcome.
//!
//! The decision has a deadline (`overload.decision_deadline` from now, or the stream's own deadline when
//! that is sooner) and commits a little before it ([`ANSWER_TIME`]), so that its answer still arrives
//! in time. It waits for a decision slot (admission and its bounded queue), runs on the blocking pool,
//! and is watched meanwhile: the stream closing cancels it, the deadline sheds it, and in both cases
//! its [`CommitGate`] keeps it from committing if it runs on. A panic in it, or a refusal that is
//! cachepick's own failure, fails the request open.
//!
//! The test-only fault hook (the `fault-injection` feature) acts here, inside the decision.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use tokio::task::JoinError;
use tokio::time::Instant;
use tonic::Streaming;

use super::answer::Sender;
use crate::protocol::ShedReason;
use crate::route::admission::Admission;
use crate::route::{Answer, CommitGate, Inbound, Refusal, Routed, Service};

/// The most of a decision's deadline kept, after its commit, for its answer to be sent (a tenth of the
/// deadline when that is less).
const ANSWER_TIME: Duration = Duration::from_millis(50);

/// Whether this build can inject faults into decisions (the `fault-injection` cargo feature, for tests
/// only): a request with `x-fault-injection: panic` then panics inside its decision, and one with
/// `x-fault-injection: sleep=<ms>` holds its decision slot that long before deciding (a slow decision).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// The request header that injects a fault, read only by builds with the `fault-injection` feature. Not
/// an `x-cachepick-*` header: the generated Envoy configuration strips those from clients.
#[cfg(feature = "fault-injection")]
pub(super) const FAULT_HEADER: &str = "x-fault-injection";

/// What a decision needs of the exchange, owned, so it can run on the blocking pool.
pub(super) struct Pending {
    pub path: String,
    pub method: String,
    pub subset: Option<Vec<SocketAddr>>,
    pub content_encoding: Option<String>,
    pub tenant: Option<String>,
    pub body: Option<Bytes>,
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
}

impl Pending {
    fn route(&self, service: &Service, gate: &CommitGate) -> Answer {
        #[cfg(feature = "fault-injection")]
        match self.fault {
            Some(Fault::Panic) => inject_panic(),
            Some(Fault::Sleep(pause)) => std::thread::sleep(pause),
            None => {}
        }
        service.route_gated(
            &Inbound {
                path: &self.path,
                // Envoy always sends `:method`; a client of another kind may not.
                method: Some(self.method.as_str()).filter(|method| !method.is_empty()),
                body: self.body.as_deref(),
                subset: self.subset.as_deref(),
                content_encoding: self.content_encoding.as_deref(),
                tenant: self.tenant.as_deref(),
            },
            gate,
        )
    }
}

/// How a decision ended.
#[derive(Debug)]
pub(super) enum Decided {
    Route(Routed),
    Refuse(Refusal),
    /// Given up: answered with a gRPC error (or, in duplex mode, continued without a destination).
    Shed(ShedReason),
    /// The stream closed while the decision waited or ran: there is no one to answer.
    Gone,
}

/// A decision's times, from the moment it is owed.
#[derive(Clone, Copy, Debug)]
struct Due {
    /// When the wire stops waiting for it.
    deadline: Instant,
    /// The shed at `deadline`: the stream's own deadline when that came first.
    late: ShedReason,
    /// Its last moment to commit: a little before the deadline, because what follows the commit (the
    /// answer built, queued and sent by a busy runtime) must still arrive by the deadline.
    commit_by: Instant,
}

impl Due {
    fn new(owed: Instant, decision_deadline: Duration, stream_end: Instant) -> Due {
        let deadline = owed + decision_deadline;
        let (deadline, late) = if stream_end < deadline {
            (stream_end, ShedReason::StreamDeadline)
        } else {
            (deadline, ShedReason::Deadline)
        };
        let answer_time = (decision_deadline / 10).min(ANSWER_TIME);
        let commit_by = deadline.checked_sub(answer_time).unwrap_or(deadline);
        Due {
            deadline,
            late,
            commit_by,
        }
    }
}

/// Decides `request` through admission, on the blocking pool, within the decision deadline, while
/// watching the stream: the decision is owed from now; it waits for a slot in the bounded queue, and is
/// shed when the queue is full, at its deadline, or (without an answer) when the stream closes. A
/// decision that ends after its deadline or its stream is not committed ([`CommitGate`]).
pub(super) async fn decide(
    service: &Arc<Service>,
    request: Pending,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &Sender,
    stream_end: Instant,
) -> Decided {
    let due = Due::new(
        Instant::now(),
        service.admission().decision_deadline(),
        stream_end,
    );
    let gate = CommitGate::until(due.commit_by.into_std());
    let work = {
        let service = Arc::clone(service);
        let gate = gate.clone();
        async move {
            let body = request.body.clone();
            let decider = Arc::clone(&service);
            let decision = move || request.route(&decider, &gate);
            run_admitted(
                service.admission(),
                due.commit_by,
                body.as_deref(),
                decision,
            )
            .await
        }
    };
    hand_off(due, &gate, closed(inbound, out), work).await
}

/// Waits for a decision slot until `commit_by`, then runs `decision` on the blocking pool; the slot is
/// held until the work ends, even when its answer was given up on.
async fn run_admitted<F>(
    admission: &Admission,
    commit_by: Instant,
    body: Option<&[u8]>,
    decision: F,
) -> Result<Result<Answer, JoinError>, ShedReason>
where
    F: FnOnce() -> Answer + Send + 'static,
{
    let admitted = admission.admit(commit_by.into_std(), body).await?;
    Ok(tokio::task::spawn_blocking(move || {
        let _admitted = admitted;
        decision()
    })
    .await)
}

/// The outcome of `work` (admission, then the decision), unless `gone` (the stream closed: `gate` is
/// cancelled) or the deadline comes first.
async fn hand_off(
    due: Due,
    gate: &CommitGate,
    gone: impl Future<Output = ()>,
    work: impl Future<Output = Result<Result<Answer, JoinError>, ShedReason>>,
) -> Decided {
    let decided = tokio::select! {
        biased;
        () = gone => {
            gate.cancel();
            return Decided::Gone;
        }
        // The gate closes by itself at the same instant: the decision, if it runs on, cannot commit.
        () = tokio::time::sleep_until(due.deadline) => return Decided::Shed(due.late),
        decided = work => decided,
    };
    match decided {
        Err(reason) => Decided::Shed(reason),
        Ok(Err(error)) => {
            // A panic in the decision: fail open, never a 5xx of cachepick's own.
            tracing::error!(%error, "the decision task failed; the request is failed open");
            Decided::Shed(ShedReason::Internal)
        }
        Ok(Ok(Answer::Shed(reason))) => Decided::Shed(if reason == ShedReason::Deadline {
            due.late
        } else {
            reason
        }),
        Ok(Ok(Answer::Refuse(refusal))) if refusal.reason.fails_open() => {
            tracing::warn!(reason = refusal.reason.as_str(), message = %refusal.message,
                "the decision failed inside cachepick; the request is failed open");
            Decided::Shed(ShedReason::Internal)
        }
        Ok(Ok(Answer::Refuse(refusal))) => Decided::Refuse(refusal),
        Ok(Ok(Answer::Route(routed))) => Decided::Route(routed),
    }
}

/// Resolves when the stream is gone: Envoy reset it (the client went away, or Envoy gave up waiting),
/// which shows as an error on the inbound side or as the response side being dropped. A half-close is
/// not that: a client that has sent everything still wants its answer. Messages a complete request
/// does not expect are skipped.
async fn closed(inbound: &mut Streaming<ProcessingRequest>, out: &Sender) {
    let reset = async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => {}
                Ok(None) => std::future::pending::<()>().await,
                Err(_) => return,
            }
        }
    };
    tokio::select! {
        () = reset => {}
        () = out.closed() => {}
    }
}

/// A fault injected into a decision (test builds only).
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug)]
pub(super) enum Fault {
    Panic,
    Sleep(Duration),
}

#[cfg(feature = "fault-injection")]
impl Fault {
    pub(super) fn parse(value: &[u8]) -> Option<Fault> {
        let value = std::str::from_utf8(value).ok()?;
        if value == "panic" {
            return Some(Fault::Panic);
        }
        let millis = value.strip_prefix("sleep=")?.parse().ok()?;
        Some(Fault::Sleep(Duration::from_millis(millis)))
    }
}

/// The injected fault: a panic inside the decision, as a bug would cause one.
#[cfg(feature = "fault-injection")]
#[allow(clippy::panic)]
fn inject_panic() {
    panic!("fault injected by {FAULT_HEADER}: panic");
}

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
use crate::protocol::RefusalReason;
use crate::route::admission::Admission;
use crate::route::{Answer, CommitGate, Inbound, Moment, Refusal, Routed, Service};

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
        service.answer(
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
            // The decision's time is when it runs, after admission: what the load it reads is aged
            // against.
            Moment::now(),
        )
    }
}

/// How a decision ended.
#[derive(Debug)]
pub(super) enum Decided {
    Route(Routed),
    Refuse(Refusal),
    /// Given up: answered with a gRPC error (or, in duplex mode, continued without a destination).
    Shed(RefusalReason),
    /// The stream closed while the decision waited or ran: there is no one to answer.
    Gone,
}

/// A decision's times, from the moment it is owed.
#[derive(Clone, Copy, Debug)]
struct Due {
    /// When the wire stops waiting for it.
    deadline: Instant,
    /// The shed at `deadline`: the stream's own deadline when that came first.
    late: RefusalReason,
    /// Its last moment to commit: a little before the deadline, because what follows the commit (the
    /// answer built, queued and sent by a busy runtime) must still arrive by the deadline.
    commit_by: Instant,
}

impl Due {
    fn new(owed: Instant, decision_deadline: Duration, stream_end: Instant) -> Due {
        let deadline = owed + decision_deadline;
        let (deadline, late) = if stream_end < deadline {
            (stream_end, RefusalReason::StreamDeadline)
        } else {
            (deadline, RefusalReason::Deadline)
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
) -> Result<Result<Answer, JoinError>, RefusalReason>
where
    F: FnOnce() -> Answer + Send + 'static,
{
    let admitted = admission.admit(commit_by.into_std(), body).await?;
    // The request's span follows the decision onto the blocking thread: its log lines and the
    // pipeline's step spans belong to the request.
    let span = tracing::Span::current();
    Ok(tokio::task::spawn_blocking(move || {
        let _admitted = admitted;
        let _span = span.enter();
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
    work: impl Future<Output = Result<Result<Answer, JoinError>, RefusalReason>>,
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
            Decided::Shed(RefusalReason::Internal)
        }
        Ok(Ok(Answer::Shed(reason))) => Decided::Shed(if reason == RefusalReason::Deadline {
            due.late
        } else {
            reason
        }),
        Ok(Ok(Answer::Refuse(refusal))) if refusal.reason.fails_open() => {
            tracing::warn!(reason = refusal.reason.as_str(), message = %refusal.message,
                "the decision failed inside cachepick; the request is failed open");
            Decided::Shed(RefusalReason::Internal)
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

#[cfg(test)]
mod tests {
    use futures_util::FutureExt as _;

    use super::*;
    use crate::config::OverloadConfig;
    use crate::metrics::{Metrics, RefusedCommit};
    use crate::protocol::RefusalReason;

    fn admission(slots: usize) -> Admission {
        let metrics = Metrics::new().unwrap().overload;
        Admission::new(&OverloadConfig::default(), slots, metrics)
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// A decision due 100 ms from `start`, on a stream with a minute left.
    fn due(start: Instant) -> Due {
        Due::new(start, ms(100), start + Duration::from_secs(60))
    }

    #[test]
    fn the_commit_comes_a_tenth_or_at_most_50_ms_before_the_sooner_deadline() {
        let start = Instant::now();
        let short = due(start);
        assert_eq!(short.deadline, start + ms(100));
        assert_eq!(short.late, RefusalReason::Deadline);
        assert_eq!(short.commit_by, start + ms(90));
        let long = Due::new(start, ms(2000), start + Duration::from_secs(60));
        assert_eq!(long.commit_by, start + ms(1950));
        // The stream's deadline comes first: it bounds the decision and names its shed.
        let bounded = Due::new(start, ms(2000), start + ms(300));
        assert_eq!(bounded.deadline, start + ms(300));
        assert_eq!(bounded.late, RefusalReason::StreamDeadline);
        assert_eq!(bounded.commit_by, start + ms(250));
    }

    #[tokio::test(start_paused = true)]
    async fn a_decision_still_running_at_its_deadline_is_shed_and_cannot_commit() {
        let admission = admission(2);
        let start = Instant::now();
        let due = due(start);
        let gate = CommitGate::until(due.commit_by.into_std());
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (checked, check) = tokio::sync::oneshot::channel();
        let decision = {
            let gate = gate.clone();
            move || {
                let _ = released.recv();
                let _ = checked.send(gate.check());
                Answer::Shed(RefusalReason::Internal)
            }
        };
        let work = run_admitted(&admission, due.commit_by, None, decision);
        let decided = hand_off(due, &gate, std::future::pending(), work);
        tokio::pin!(decided);
        assert!(decided.as_mut().now_or_never().is_none());
        assert_eq!(admission.view().in_flight, 1, "admitted, running");
        tokio::time::advance(ms(99)).await;
        assert!(
            decided.as_mut().now_or_never().is_none(),
            "within its deadline the wire waits"
        );
        tokio::time::advance(ms(1)).await;
        assert!(matches!(
            decided.await,
            Decided::Shed(RefusalReason::Deadline)
        ));
        assert_eq!(Instant::now(), start + ms(100), "shed at the deadline");
        // Given up on, the decision still holds its slot until its thread is free.
        assert_eq!(admission.view().in_flight, 1);
        release.send(()).unwrap();
        assert_eq!(check.await.unwrap(), Err(RefusedCommit::Deadline));
    }

    #[tokio::test(start_paused = true)]
    async fn a_decision_queued_past_its_commit_is_shed_before_the_deadline() {
        let admission = admission(1);
        let _held = admission
            .admit((Instant::now() + ms(1000)).into_std(), None)
            .await
            .unwrap();
        let start = Instant::now();
        let due = due(start);
        let gate = CommitGate::until(due.commit_by.into_std());
        let work = run_admitted(&admission, due.commit_by, None, || {
            Answer::Shed(RefusalReason::Internal)
        });
        let decided = hand_off(due, &gate, std::future::pending(), work);
        tokio::pin!(decided);
        assert!(decided.as_mut().now_or_never().is_none());
        assert_eq!(admission.view().queued, 1);
        tokio::time::advance(ms(89)).await;
        assert!(decided.as_mut().now_or_never().is_none());
        tokio::time::advance(ms(1)).await;
        // A slot that comes free after 90 ms could not commit in time: the queue gives it up there.
        assert!(matches!(
            decided.await,
            Decided::Shed(RefusalReason::Deadline)
        ));
        assert_eq!(Instant::now(), start + ms(90));
        assert_eq!(admission.view().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_stream_deadline_sheds_as_such_when_it_comes_first() {
        let start = Instant::now();
        let due = Due::new(start, ms(2000), start + ms(300));
        let gate = CommitGate::until(due.commit_by.into_std());
        let work = std::future::pending();
        let decided = hand_off(due, &gate, std::future::pending(), work);
        tokio::pin!(decided);
        tokio::time::advance(ms(299)).await;
        assert!(decided.as_mut().now_or_never().is_none());
        tokio::time::advance(ms(1)).await;
        assert!(matches!(
            decided.await,
            Decided::Shed(RefusalReason::StreamDeadline)
        ));
        assert_eq!(gate.check(), Err(RefusedCommit::Deadline));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_goes_away_cancels_its_decision() {
        let due = due(Instant::now());
        let gate = CommitGate::until(due.commit_by.into_std());
        let decided = hand_off(due, &gate, std::future::ready(()), std::future::pending()).await;
        assert!(matches!(decided, Decided::Gone));
        assert_eq!(gate.check(), Err(RefusedCommit::Cancelled));
    }

    #[tokio::test(start_paused = true)]
    async fn what_the_decision_returns_becomes_the_outcome_and_cachepicks_failures_fail_open() {
        let refusal = |reason| Refusal {
            reason,
            message: String::new(),
            pool: None,
        };
        let start = Instant::now();
        // On a stream whose deadline bounds the decision, a decision refused its commit late is shed
        // as the stream's deadline.
        let bounded = Due::new(start, ms(2000), start + ms(300));
        let cases = [
            (Err(RefusalReason::QueueFull), "queue_full"),
            (Ok(Answer::Shed(RefusalReason::Deadline)), "stream_deadline"),
            (Ok(Answer::Shed(RefusalReason::Cancelled)), "cancelled"),
            (
                Ok(Answer::Refuse(refusal(RefusalReason::Internal))),
                "internal",
            ),
            (
                Ok(Answer::Refuse(refusal(RefusalReason::TokenizerFailed))),
                "internal",
            ),
            (
                Ok(Answer::Refuse(refusal(RefusalReason::TooLarge))),
                "refused",
            ),
        ];
        for (returned, expected) in cases {
            let gate = CommitGate::until(bounded.commit_by.into_std());
            let work = std::future::ready(returned.map(Ok));
            let decided = hand_off(bounded, &gate, std::future::pending(), work).await;
            let outcome = match decided {
                Decided::Shed(reason) => reason.as_str(),
                Decided::Refuse(_) => "refused",
                Decided::Route(_) => "routed",
                Decided::Gone => "gone",
            };
            assert_eq!(outcome, expected);
        }
        // A panic in the decision (a join error) fails open too.
        let admission = admission(1);
        let gate = CommitGate::until(bounded.commit_by.into_std());
        let work = run_admitted(&admission, bounded.commit_by, None, || {
            panic!("a bug inside the decision")
        });
        let decided = hand_off(bounded, &gate, std::future::pending(), work).await;
        assert!(matches!(decided, Decided::Shed(RefusalReason::Internal)));
    }
}

//! Admission: how much decision work the picker takes on, and the rule that a decision is either
//! answered in time or shed — never committed late.
//!
//! - Decisions (tokenizing, hashing, the policy) run on the blocking pool, at most `slots` at once
//!   (twice the cores: a huge prompt occupies a blocking thread, never a runtime thread). A complete
//!   request waits for a slot in a bounded queue (`max_queued_decisions`); one more is shed at once
//!   (`queue_full`).
//! - Every decision has a deadline: the moment it became owed plus `decision_deadline`, which is shorter
//!   than Envoy's `message_timeout`. A request still queued at its deadline is shed (`deadline`); a
//!   decision that finishes after it is not committed ([`CommitGate`]) and is shed too.
//! - A body longer than [`HEAVY_BODY_BYTES`] is heavy: heavy decisions hold at most half the slots
//!   (at least one), so prompts that are large, or built to be slow, never take every slot from the
//!   ordinary ones. A heavy request waits for its share until its deadline, then is shed (`deadline`).
//! - A stream the proxy closes while its request waits or is decided cancels it: it leaves the queue, and
//!   a decision already running is not committed.
//! - Explain (`/debug/explain`, the admin `Explain`) has its own smaller share of blocking threads and a
//!   token bucket, so it can never take a slot from a decision.
//! - Bodies held by all streams together are bounded ([`BodyBudget`]), and so is the memory tokenizing
//!   them takes: a decision charges its prompt's tokenizing to the same budget before it starts
//!   ([`BodyBudget::charge`]), and a prompt that does not fit is routed by load without being tokenized.
//! - A decision's tokenizing asks its [`CommitGate`] between bounded chunks of work and stops once the
//!   gate closes, so a slot whose decision is past its deadline comes free within one chunk
//!   (`cachepick_decision_overrun_seconds` measures how far past).
//!
//! Nothing here sees a protobuf type: the wire maps a [`RefusalReason`] to its own error. Time is read
//! on tokio's clock, so tests drive deadlines and rates with paused time.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::OverloadConfig;
use crate::metrics::{OverloadMetrics, RefusedCommit};
use crate::protocol::RefusalReason;
use crate::tokenize::Stop;

/// Now, on tokio's clock: the same instant as [`Instant::now`] in a running picker, and the paused
/// clock in a test that pauses tokio's time, so that admission's deadlines and rates follow it.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Bodies longer than this are heavy (see the module documentation): about 250k tokens of prose, more
/// than most models' context.
pub const HEAVY_BODY_BYTES: usize = 1 << 20;

/// The admission of one picker: decision slots, the queue in front of them, the deadline, explain's
/// share and rate, and the body budget.
pub struct Admission {
    slots: usize,
    decisions: Arc<Semaphore>,
    /// The share of the slots heavy decisions may hold.
    heavy_slots: usize,
    heavy: Arc<Semaphore>,
    /// The recent time per decision, in microseconds (see [`Admission::per_decision`]).
    per_decision: Arc<AtomicU64>,
    queued: AtomicUsize,
    max_queued: usize,
    deadline: Duration,
    explain_slots: usize,
    explains: Arc<Semaphore>,
    explain_rate: Mutex<TokenBucket>,
    budget: Arc<BodyBudget>,
    metrics: OverloadMetrics,
}

impl Admission {
    /// Admission with `overload`'s bounds, `slots` decisions at once, counting into `metrics`.
    pub fn new(overload: &OverloadConfig, slots: usize, metrics: OverloadMetrics) -> Admission {
        let slots = slots.max(1);
        // A quarter of the decision slots, at least one: explain is for people and probes.
        let explain_slots = (slots / 4).max(1);
        let heavy_slots = (slots / 2).max(1);
        let rate = f64::from(overload.explain_rate.get());
        Admission {
            slots,
            decisions: Arc::new(Semaphore::new(slots)),
            heavy_slots,
            heavy: Arc::new(Semaphore::new(heavy_slots)),
            per_decision: Arc::new(AtomicU64::new(0)),
            queued: AtomicUsize::new(0),
            max_queued: overload.max_queued_decisions.get(),
            deadline: overload.decision_deadline,
            explain_slots,
            explains: Arc::new(Semaphore::new(explain_slots)),
            explain_rate: Mutex::new(TokenBucket::new(rate, rate, now())),
            budget: Arc::new(BodyBudget::new(
                overload.max_buffered_bytes.get(),
                metrics.clone(),
            )),
            metrics,
        }
    }

    /// Twice the cores: decisions are CPU work, and a second thread per core covers one blocked on a
    /// page fault or a lock.
    pub fn default_slots() -> usize {
        std::thread::available_parallelism()
            .map_or(2, usize::from)
            .saturating_mul(2)
    }

    /// How long a decision may take from the moment it is owed.
    pub fn decision_deadline(&self) -> Duration {
        self.deadline
    }

    /// The budget every stream's buffered body draws from.
    pub fn budget(&self) -> &Arc<BodyBudget> {
        &self.budget
    }

    pub fn metrics(&self) -> &OverloadMetrics {
        &self.metrics
    }

    /// Waits for a decision slot until `deadline`. Shed at once when the queue is full, or when the
    /// decisions ahead of it (at the recent time per decision) would take it past its deadline; shed
    /// at the deadline when no slot came free. Dropping the future (the stream closed) leaves the queue.
    ///
    /// Shedding what cannot make it on arrival keeps the queue as short as the deadline allows, so the
    /// requests that do wait are decided in time: a queue left to fill would make every request wait
    /// almost the whole deadline and most of them miss it.
    ///
    /// `deadline` is when the decision must have committed; a request admitted (from the queue) with
    /// less time left than a decision takes is shed then and there, so its slot goes to one that can
    /// make it instead of to work that would be refused its commit.
    ///
    /// A heavy `body` first waits, until `deadline`, for its share ([`HEAVY_BODY_BYTES`]).
    pub async fn admit(
        &self,
        deadline: Instant,
        body: Option<&[u8]>,
    ) -> Result<Admitted, RefusalReason> {
        let heavy = match body {
            Some(body) if body.len() > HEAVY_BODY_BYTES => {
                let share = Arc::clone(&self.heavy).acquire_owned();
                match tokio::time::timeout_at(deadline.into(), share).await {
                    Ok(Ok(permit)) => Some(permit),
                    Ok(Err(_)) | Err(_) => return Err(RefusalReason::Deadline),
                }
            }
            _ => None,
        };
        let in_time = |permit: OwnedSemaphorePermit, heavy| {
            if now() + self.per_decision() > deadline {
                Err(RefusalReason::Deadline)
            } else {
                Ok(self.admitted(permit, heavy, deadline))
            }
        };
        // Taken without waiting when a slot is free: the queue is only for those that must wait. The
        // recent time per decision is an average, not this decision's: with a slot free it is tried.
        if let Ok(permit) = Arc::clone(&self.decisions).try_acquire_owned() {
            return Ok(self.admitted(permit, heavy, deadline));
        }
        let per_decision = self.per_decision();
        if !per_decision.is_zero() {
            let ahead = self.queued.load(Ordering::Acquire).saturating_add(1);
            let rounds = u32::try_from(ahead.div_ceil(self.slots)).unwrap_or(u32::MAX);
            // Waiting for the rounds ahead, then its own decision.
            let expected = per_decision.saturating_mul(rounds.saturating_add(1));
            if now() + expected > deadline {
                return Err(RefusalReason::Deadline);
            }
        }
        if self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued < self.max_queued).then_some(queued + 1)
            })
            .is_err()
        {
            return Err(RefusalReason::QueueFull);
        }
        let _queued = Queued::enter(&self.queued, &self.metrics);
        let acquire = Arc::clone(&self.decisions).acquire_owned();
        match tokio::time::timeout_at(deadline.into(), acquire).await {
            Ok(Ok(permit)) => in_time(permit, heavy),
            // The semaphore is never closed; a slot that came free at the deadline is too late.
            Ok(_) | Err(_) => Err(RefusalReason::Deadline),
        }
    }

    fn admitted(
        &self,
        permit: OwnedSemaphorePermit,
        heavy: Option<OwnedSemaphorePermit>,
        deadline: Instant,
    ) -> Admitted {
        self.metrics.in_flight.inc();
        Admitted {
            _permit: permit,
            _heavy: heavy,
            metrics: self.metrics.clone(),
            since: now(),
            deadline,
            per_decision: Arc::clone(&self.per_decision),
        }
    }

    /// The recent time a decision holds its slot (an exponentially weighted average); zero before the
    /// first.
    pub fn per_decision(&self) -> Duration {
        Duration::from_micros(self.per_decision.load(Ordering::Acquire))
    }

    /// One explain call: refused when over `explain_rate` or when explain's share of slots is taken
    /// (it never waits, so it never holds a body in a queue).
    pub fn explain(&self) -> Result<ExplainPermit, ExplainRefused> {
        let allowed = self
            .explain_rate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(now());
        if !allowed {
            self.metrics
                .explain_refused
                .with_label_values(&["rate"])
                .inc();
            return Err(ExplainRefused::Rate);
        }
        match Arc::clone(&self.explains).try_acquire_owned() {
            Ok(permit) => Ok(ExplainPermit { _permit: permit }),
            Err(_) => {
                self.metrics
                    .explain_refused
                    .with_label_values(&["busy"])
                    .inc();
                Err(ExplainRefused::Busy)
            }
        }
    }

    /// Admission as the debug snapshot shows it.
    pub fn view(&self) -> AdmissionView {
        let shed = RefusalReason::SHED
            .iter()
            .map(|reason| (reason.as_str(), self.metrics.shed_count(*reason)))
            .collect();
        let commits_refused = RefusedCommit::ALL
            .iter()
            .map(|reason| {
                (
                    reason.as_str(),
                    self.metrics
                        .commits_refused
                        .with_label_values(&[reason.as_str()])
                        .get(),
                )
            })
            .collect();
        AdmissionView {
            decision_slots: self.slots,
            heavy_slots: self.heavy_slots,
            heavy_in_flight: self
                .heavy_slots
                .saturating_sub(self.heavy.available_permits()),
            in_flight: self
                .slots
                .saturating_sub(self.decisions.available_permits()),
            queued: self.queued.load(Ordering::Acquire),
            max_queued: self.max_queued,
            decision_deadline_ms: u64::try_from(self.deadline.as_millis()).unwrap_or(u64::MAX),
            per_decision_us: u64::try_from(self.per_decision().as_micros()).unwrap_or(u64::MAX),
            buffered_bytes: self.budget.held(),
            max_buffered_bytes: self.budget.limit,
            explain_slots: self.explain_slots,
            shed,
            commits_refused,
        }
    }
}

/// A complete request's place in the queue; leaving (admitted, shed or dropped) takes it off.
struct Queued<'a> {
    count: &'a AtomicUsize,
    metrics: &'a OverloadMetrics,
}

impl<'a> Queued<'a> {
    fn enter(count: &'a AtomicUsize, metrics: &'a OverloadMetrics) -> Queued<'a> {
        metrics.queued.inc();
        Queued { count, metrics }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.metrics.queued.dec();
    }
}

/// A decision slot, held until the decision's work ends (also when its answer was given up on, so a
/// slow decision keeps counting against the slots until its thread is free again).
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
    /// A heavy decision's place in its share.
    _heavy: Option<OwnedSemaphorePermit>,
    metrics: OverloadMetrics,
    since: Instant,
    /// When the decision must have committed; a slot released later is counted as overrun.
    deadline: Instant,
    per_decision: Arc<AtomicU64>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
        let overrun = now().saturating_duration_since(self.deadline);
        if !overrun.is_zero() {
            self.metrics.overrun_seconds.observe(overrun.as_secs_f64());
        }
        let sample = u64::try_from(now().saturating_duration_since(self.since).as_micros())
            .unwrap_or(u64::MAX);
        // An eighth of each new sample: a burst of slow decisions moves it within a few dozen.
        let _ = self
            .per_decision
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                Some(if old == 0 {
                    sample
                } else {
                    old - old / 8 + sample / 8
                })
            });
    }
}

/// Whether a decision may still commit: not after its deadline, not once its stream is gone. Shared
/// between the wire (which cancels it) and the decision (which asks it right before committing).
#[derive(Clone, Debug)]
pub struct CommitGate {
    deadline: Option<Instant>,
    cancelled: Arc<AtomicBool>,
}

impl CommitGate {
    /// A gate that refuses from `deadline` on, or once cancelled.
    pub fn until(deadline: Instant) -> CommitGate {
        CommitGate {
            deadline: Some(deadline),
            cancelled: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A gate that never refuses: for callers without a deadline (benchmarks, tools).
    pub fn open() -> CommitGate {
        CommitGate {
            deadline: None,
            cancelled: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The request is given up on (its stream closed, or the wire answered it shed): nothing commits.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    /// The stop the decision's tokenizing asks: it closes with the gate.
    pub fn stop(&self) -> Stop {
        Stop::new(self.deadline, Some(Arc::clone(&self.cancelled)))
    }

    /// `Ok` if the decision may commit now.
    pub fn check(&self) -> Result<(), RefusedCommit> {
        if self.cancelled.load(Ordering::Acquire) {
            return Err(RefusedCommit::Cancelled);
        }
        match self.deadline {
            Some(deadline) if now() >= deadline => Err(RefusedCommit::Deadline),
            _ => Ok(()),
        }
    }
}

impl From<RefusedCommit> for RefusalReason {
    fn from(refused: RefusedCommit) -> Self {
        match refused {
            RefusedCommit::Deadline => RefusalReason::Deadline,
            RefusedCommit::Cancelled => RefusalReason::Cancelled,
        }
    }
}

/// Why an explain call was refused before any work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExplainRefused {
    /// Over `overload.explain_rate`.
    Rate,
    /// Every explain slot is taken.
    Busy,
}

impl ExplainRefused {
    pub fn message(self) -> &'static str {
        match self {
            ExplainRefused::Rate => "explain is rate-limited (overload.explain_rate); retry later",
            ExplainRefused::Busy => "every explain slot is busy; retry later",
        }
    }
}

/// One of explain's slots, held while it runs.
pub struct ExplainPermit {
    _permit: OwnedSemaphorePermit,
}

/// A token bucket: `rate` tokens a second, at most `burst` saved.
#[derive(Debug)]
struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    fn new(rate: f64, burst: f64, now: Instant) -> TokenBucket {
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Request body bytes held by every stream together, bounded by `overload.max_buffered_bytes`.
#[derive(Debug)]
pub struct BodyBudget {
    held: AtomicUsize,
    limit: usize,
    metrics: OverloadMetrics,
}

impl BodyBudget {
    fn new(limit: usize, metrics: OverloadMetrics) -> BodyBudget {
        BodyBudget {
            held: AtomicUsize::new(0),
            limit,
            metrics,
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// `bytes` of the budget for one decision's tokenizing, given back when the share drops; `None`
    /// (counted in `cachepick_tokenize_over_budget_total`) when they do not fit beside what is held.
    pub fn charge(self: &Arc<Self>, bytes: usize) -> Option<BodyShare> {
        let mut share = self.share();
        if share.grow(bytes) {
            Some(share)
        } else {
            self.metrics.tokenize_over_budget.inc();
            None
        }
    }

    /// An empty share of the budget for one stream.
    pub fn share(self: &Arc<Self>) -> BodyShare {
        BodyShare {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }

    fn take(&self, bytes: usize) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok();
        if taken {
            self.metrics
                .buffered_bytes
                .add(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        taken
    }

    fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.metrics
            .buffered_bytes
            .sub(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

/// One stream's bytes of the [`BodyBudget`], given back when the stream ends.
#[derive(Debug)]
pub struct BodyShare {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyShare {
    /// Takes `bytes` more; `false` (nothing taken) if that would go over the budget.
    pub fn grow(&mut self, bytes: usize) -> bool {
        if bytes == 0 {
            return true;
        }
        let taken = self.budget.take(bytes);
        if taken {
            self.bytes += bytes;
        }
        taken
    }
}

impl BodyShare {
    /// Gives back everything held so far (the stream holds its body no longer).
    pub fn release(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
            self.bytes = 0;
        }
    }
}

impl Drop for BodyShare {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
        }
    }
}

/// Admission as `/debug/snapshot` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct AdmissionView {
    pub decision_slots: usize,
    /// The share of the slots heavy bodies may hold, and how much of it is held.
    pub heavy_slots: usize,
    pub heavy_in_flight: usize,
    pub in_flight: usize,
    pub queued: usize,
    pub max_queued: usize,
    pub decision_deadline_ms: u64,
    /// The recent time a decision holds its slot.
    pub per_decision_us: u64,
    pub buffered_bytes: usize,
    pub max_buffered_bytes: usize,
    pub explain_slots: usize,
    /// `cachepick_shed_total` by reason.
    pub shed: Vec<(&'static str, u64)>,
    /// `cachepick_commits_refused_total` by reason.
    pub commits_refused: Vec<(&'static str, u64)>,
}

#[cfg(test)]
mod tests {
    use std::num::{NonZeroU32, NonZeroUsize};

    use futures_util::FutureExt as _;

    use super::*;
    use crate::metrics::Metrics;

    fn admission(slots: usize, queue: usize, deadline_ms: u64, budget: usize) -> Admission {
        let overload = OverloadConfig {
            max_queued_decisions: NonZeroUsize::new(queue).unwrap(),
            decision_deadline: Duration::from_millis(deadline_ms),
            max_buffered_bytes: NonZeroUsize::new(budget).unwrap(),
            explain_rate: NonZeroU32::new(2).unwrap(),
            ..OverloadConfig::default()
        };
        Admission::new(&overload, slots, Metrics::new().unwrap().overload)
    }

    /// `ms` from now on tokio's clock (paused in the tests that pause it).
    fn soon(ms: u64) -> Instant {
        now() + Duration::from_millis(ms)
    }

    fn advance(ms: u64) -> impl Future<Output = ()> {
        tokio::time::advance(Duration::from_millis(ms))
    }

    /// Admission with one decision slot, taken by the slot returned beside it, and room for `queue`.
    async fn one_slot_taken(queue: usize) -> (Admission, Admitted) {
        let admission = admission(1, queue, 50, 1024);
        let taken = admission.admit(soon(1000), None).await.unwrap();
        (admission, taken)
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_queued_past_its_deadline_is_shed_then_and_leaves_the_queue() {
        let (admission, _taken) = one_slot_taken(4).await;
        let start = now();
        let waiting = admission.admit(soon(50), None);
        tokio::pin!(waiting);
        assert!(waiting.as_mut().now_or_never().is_none());
        assert_eq!(admission.view().queued, 1);
        advance(49).await;
        assert!(
            waiting.as_mut().now_or_never().is_none(),
            "it waits until its deadline"
        );
        assert_eq!(admission.view().queued, 1);
        advance(1).await;
        assert_eq!(waiting.await.err(), Some(RefusalReason::Deadline));
        assert_eq!(
            now(),
            start + Duration::from_millis(50),
            "shed at it, not later"
        );
        assert_eq!(admission.view().queued, 0);
        assert_eq!(admission.metrics().queued.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_holds_its_bound_and_the_next_request_is_shed_without_waiting() {
        let (admission, taken) = one_slot_taken(2).await;
        let start = now();
        let first = admission.admit(soon(1000), None);
        let second = admission.admit(soon(1000), None);
        tokio::pin!(first, second);
        assert!(first.as_mut().now_or_never().is_none());
        assert!(second.as_mut().now_or_never().is_none());
        assert_eq!(admission.view().queued, 2);
        // The third finds the queue full: shed on the spot, no time passes.
        let third = admission.admit(soon(1000), None).now_or_never();
        assert_eq!(
            third.map(|admitted| admitted.err()),
            Some(Some(RefusalReason::QueueFull))
        );
        assert_eq!(now(), start);
        // A slot coming free goes to the one queued first; the other keeps its place.
        drop(taken);
        let admitted = first.await.unwrap();
        assert_eq!(admission.view().queued, 1);
        assert!(second.as_mut().now_or_never().is_none());
        drop(admitted);
        assert!(second.await.is_ok());
        assert_eq!(admission.view().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn explain_refills_at_its_rate_on_the_clock_and_keeps_to_its_share() {
        // Four decision slots: one explain slot; a rate of two a second, two saved.
        let admission = admission(4, 1, 50, 100);
        let refused = |label: &str| {
            admission
                .metrics()
                .explain_refused
                .with_label_values(&[label])
                .get()
        };
        let running = admission.explain().unwrap();
        assert_eq!(admission.explain().err(), Some(ExplainRefused::Busy));
        drop(running);
        assert_eq!(admission.explain().err(), Some(ExplainRefused::Rate));
        advance(250).await;
        assert_eq!(
            admission.explain().err(),
            Some(ExplainRefused::Rate),
            "half a token"
        );
        advance(250).await;
        let running = admission.explain().unwrap();
        advance(500).await;
        assert_eq!(
            admission.explain().err(),
            Some(ExplainRefused::Busy),
            "a token, but no slot"
        );
        drop(running);
        // Ten idle seconds save two, not twenty.
        advance(10_000).await;
        assert!(admission.explain().is_ok());
        assert!(admission.explain().is_ok());
        assert_eq!(admission.explain().err(), Some(ExplainRefused::Rate));
        assert_eq!((refused("rate"), refused("busy")), (3, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_sheds_at_once_and_a_late_slot_sheds_at_the_deadline() {
        let admission = admission(1, 1, 50, 1024);
        let held = admission.admit(soon(1000), None).await.unwrap();
        let waiting = admission.admit(soon(200), None);
        tokio::pin!(waiting);
        // Polled once, it takes the one queue place.
        assert!(
            tokio::time::timeout(Duration::from_millis(10), &mut waiting)
                .await
                .is_err()
        );
        assert_eq!(admission.view().queued, 1);
        assert_eq!(
            admission.admit(soon(1000), None).await.err(),
            Some(RefusalReason::QueueFull)
        );
        assert_eq!(waiting.await.err(), Some(RefusalReason::Deadline));
        assert_eq!(admission.view().queued, 0);
        drop(held);
        assert_eq!(admission.view().in_flight, 0);
        assert!(admission.admit(soon(1000), None).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_leaves_the_queue() {
        let admission = admission(1, 4, 50, 1024);
        let _held = admission.admit(soon(1000), None).await.unwrap();
        let waiting =
            tokio::time::timeout(Duration::from_millis(20), admission.admit(soon(1000), None));
        assert!(waiting.await.is_err());
        assert_eq!(admission.view().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_the_queue_would_make_late_is_shed_on_arrival() {
        let admission = admission(1, 10, 50, 1024);
        let first = admission.admit(soon(1000), None).await.unwrap();
        advance(40).await;
        drop(first);
        assert_eq!(admission.per_decision(), Duration::from_millis(40));
        let _held = admission.admit(soon(1000), None).await.unwrap();
        // One decision ahead, then its own: about 80 ms, more than the 60 left.
        assert_eq!(
            admission.admit(soon(60), None).await.err(),
            Some(RefusalReason::Deadline)
        );
        assert_eq!(admission.view().queued, 0, "it never entered the queue");
        // With time for both, it waits.
        let waiting =
            tokio::time::timeout(Duration::from_millis(20), admission.admit(soon(1000), None));
        assert!(waiting.await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn heavy_bodies_hold_at_most_half_the_slots() {
        let admission = admission(4, 8, 50, 1024);
        let heavy = vec![b'a'; HEAVY_BODY_BYTES + 1];
        let first = admission.admit(soon(1000), Some(&heavy)).await.unwrap();
        let _second = admission.admit(soon(1000), Some(&heavy)).await.unwrap();
        assert_eq!(admission.view().heavy_in_flight, 2);
        // The third heavy body waits for the share until its deadline, though slots are free.
        assert_eq!(
            admission.admit(soon(30), Some(&heavy)).await.err(),
            Some(RefusalReason::Deadline)
        );
        // Ordinary bodies take the other two slots at once.
        let light = admission.admit(soon(1000), Some(b"{}")).await.unwrap();
        let _other = admission.admit(soon(1000), None).await.unwrap();
        assert_eq!(admission.view().in_flight, 4);
        drop(light);
        drop(first);
        assert!(admission.admit(soon(1000), Some(&heavy)).await.is_ok());
    }

    #[test]
    fn a_slot_released_after_its_deadline_is_counted_as_overrun() {
        let admission = admission(2, 1, 50, 1024);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let overrun = || admission.metrics().overrun_seconds.get_sample_count();
        let in_time = runtime.block_on(admission.admit(soon(1000), None)).unwrap();
        drop(in_time);
        assert_eq!(overrun(), 0);
        let late = runtime
            .block_on(admission.admit(Instant::now(), None))
            .unwrap();
        drop(late);
        assert_eq!(overrun(), 1);
    }

    #[test]
    fn a_charge_that_does_not_fit_is_refused_and_counted() {
        let admission = admission(1, 1, 50, 100);
        let budget = admission.budget();
        let held = budget.charge(80).unwrap();
        assert!(budget.charge(30).is_none());
        assert_eq!(admission.metrics().tokenize_over_budget.get(), 1);
        drop(held);
        assert!(budget.charge(100).is_some());
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn the_gate_refuses_after_the_deadline_or_a_cancel() {
        let gate = CommitGate::until(soon(1000));
        assert_eq!(gate.check(), Ok(()));
        gate.clone().cancel();
        assert_eq!(gate.check(), Err(RefusedCommit::Cancelled));
        let late = CommitGate::until(Instant::now());
        assert_eq!(late.check(), Err(RefusedCommit::Deadline));
        assert_eq!(CommitGate::open().check(), Ok(()));
        // The tokenizer's stop closes with the gate.
        let gate = CommitGate::until(soon(1000));
        let stop = gate.stop();
        assert!(!stop.stopped());
        gate.cancel();
        assert!(stop.stopped());
        assert!(CommitGate::until(Instant::now()).stop().stopped());
        assert!(!CommitGate::open().stop().stopped());
    }

    #[test]
    fn the_body_budget_is_shared_and_given_back() {
        let admission = admission(1, 1, 50, 100);
        let budget = admission.budget();
        let mut first = budget.share();
        let mut second = budget.share();
        assert!(first.grow(60));
        assert!(!second.grow(50), "60 + 50 is over 100");
        assert!(second.grow(40));
        assert_eq!(budget.held(), 100);
        drop(first);
        assert_eq!(budget.held(), 40);
        assert!(second.grow(60));
        drop(second);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn explain_is_rate_limited_and_has_its_own_slots() {
        let admission = admission(4, 1, 50, 100);
        let first = admission.explain().unwrap();
        // One explain slot for four decision slots: the second waits for none.
        assert_eq!(admission.explain().err(), Some(ExplainRefused::Busy));
        drop(first);
        // The burst (2) is spent.
        assert_eq!(admission.explain().err(), Some(ExplainRefused::Rate));
    }

    #[test]
    fn the_bucket_refills_at_its_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(2.0, 2.0, start);
        assert!(bucket.take(start));
        assert!(bucket.take(start));
        assert!(!bucket.take(start));
        assert!(bucket.take(start + Duration::from_millis(500)));
        assert!(!bucket.take(start + Duration::from_millis(600)));
    }
}

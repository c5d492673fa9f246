//! The discrete-event loop: one arm's run of a workload over a fleet of [`OfflineWorker`]s on one
//! virtual clock. Events are taken in time order, ties in the order they were scheduled, so the same
//! inputs give the same run. The clock is model seconds; no wall clock is read.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use cachepick::events::EventBatch;
use cachepick_sim::SimConfig;
use cachepick_sim::offline::{Happened, OfflineWorker};

use super::figures::{JoinFigures, Outcome, RunFigures};
use super::regret::Regret;
use super::{Prompt, Workload};
use crate::replay::report::percentile_index;

/// Something a router scheduled for itself.
#[derive(Debug)]
pub(super) enum Wake {
    /// Picker replica `replica`'s scrape interval came round.
    Tick { replica: usize },
    /// The answer to scrape `ticket` is ready at its worker.
    Scraped { ticket: u64 },
    /// A `replica_sync` datagram reaches replica `replica`.
    Announced { replica: usize, datagram: Vec<u8> },
    /// A KV event batch a worker's rank published reaches replica `replica`.
    KvEvents {
        replica: usize,
        worker: usize,
        rank: u32,
        batch: Arc<EventBatch>,
    },
}

#[derive(Debug)]
enum Event {
    /// Request `index` of the workload arrives at the router.
    Arrive(usize),
    /// Request `request` reaches worker `worker`'s scheduler.
    Submit {
        request: usize,
        worker: usize,
    },
    /// The step on a rank ends.
    StepEnd {
        worker: usize,
        rank: usize,
    },
    Router(Wake),
}

struct Entry {
    at: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// Reversed: the heap's top is the earliest, then the first scheduled.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// Model seconds as integer nanoseconds, the queue's key: exact comparisons, a total order.
fn nanos(seconds: f64) -> u64 {
    (seconds.max(0.0) * 1e9).round() as u64
}

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Entry>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.heap.push(Entry {
            at: nanos(at),
            seq: self.seq,
            event,
        });
    }

    fn pop(&mut self) -> Option<(f64, Event)> {
        self.heap
            .pop()
            .map(|entry| (entry.at as f64 / 1e9, entry.event))
    }
}

/// What a router decided for one request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Routed {
    pub worker: usize,
    /// The decision's reason as its router names it.
    pub reason: &'static str,
    /// What the router believed of the chosen worker, where it says (cachepick's arms): the prompt
    /// tokens it credited the worker with holding, and the first token it predicted there (model
    /// seconds from the decision, the front not included). [`super::regret`] holds them to the truth.
    pub belief: Option<Belief>,
    /// Which of the router's replicas decided (0 for a router of one).
    pub replica: usize,
}

/// A router's picture of the chosen worker at its decision.
#[derive(Clone, Copy, Debug)]
pub(super) struct Belief {
    pub credited_tokens: u64,
    pub predicted_s: Option<f64>,
}

/// One arm's router, driven by the loop. Every method gets the moment and the fleet in [`Cx`].
pub(super) trait Router {
    /// Schedules what the router does by itself (a picker's first scrape).
    fn start(&mut self, _cx: &mut Cx<'_>) {}
    /// Where request `request` goes; `None` refuses it.
    fn route(&mut self, request: usize, cx: &mut Cx<'_>) -> Option<Routed>;
    /// A wake the router scheduled.
    fn wake(&mut self, _wake: Wake, _cx: &mut Cx<'_>) {}
    /// Request `request` got its first token on `worker`.
    fn first_token(&mut self, _request: usize, _worker: usize, _cx: &mut Cx<'_>) {}
    /// Request `request` ended on `worker`.
    fn finished(&mut self, _request: usize, _worker: usize, _cx: &mut Cx<'_>) {}
    /// `worker`'s cache may have changed (a request was submitted, a step ended): what its engine
    /// publishes as KV events is the router's to take.
    fn published(&mut self, _worker: usize, _cx: &mut Cx<'_>) {}
}

/// The moment and the world a router sees.
pub(super) struct Cx<'a> {
    /// Model seconds.
    pub now: f64,
    pub workers: &'a mut [OfflineWorker],
    pub workload: &'a Workload,
    /// Per worker, the requests it received and has not yet submitted to a rank (in its front).
    pub fronts: &'a [Vec<usize>],
    /// The prompts (text and tokens) of the requests arriving or in a front, by request.
    live: &'a HashMap<usize, Prompt>,
    queue: &'a mut Queue,
}

impl Cx<'_> {
    pub fn schedule(&mut self, at: f64, wake: Wake) {
        self.queue.push(at.max(self.now), Event::Router(wake));
    }

    /// The tokens of request `request` while it arrives or waits in a front; empty after.
    pub fn tokens(&self, request: usize) -> &[u32] {
        self.live
            .get(&request)
            .map(|(_, tokens)| &tokens[..])
            .unwrap_or_default()
    }

    /// The prompt of request `request` while it arrives or waits in a front; empty after.
    pub fn text(&self, request: usize) -> &str {
        self.live
            .get(&request)
            .map(|(text, _)| &text[..])
            .unwrap_or_default()
    }
}

/// Runs `workload` through `router` over a fresh fleet of `sim`'s workers; the run's figures, with
/// the decisions' regret when `regret` is given to measure it.
///
/// With `joined` (when, in model seconds after the first arrival, which replica joined), the figures
/// also hold what followed, window by window ([`super::figures::JoinFigures`]).
pub(super) fn simulate(
    sim: &SimConfig,
    workload: &Workload,
    router: &mut dyn Router,
    regret: Option<Regret>,
    joined: Option<(f64, usize)>,
) -> RunFigures {
    let mut run = Run::start(sim, workload, router, regret);
    while run.advance(router).is_some() {}
    let figures = run.figures(sim);
    RunFigures {
        joined: joined.map(|joined| JoinFigures::of(workload, &run.outcomes, joined)),
        ..figures
    }
}

/// Whether `router` serves every request of `workload` with a TTFT p90 within `slo_ms` model
/// milliseconds: the goodput search's probe. The same run as [`simulate`]'s and the same verdict as
/// its figures give, but it stops as soon as the verdict is certain — a request lost, or more
/// requests past the SLO than the p90 can hold — since an overloaded probe's queues would otherwise
/// take the longest of all to drain for a verdict already known.
pub(super) fn within_slo(
    sim: &SimConfig,
    workload: &Workload,
    router: &mut dyn Router,
    slo_ms: f64,
) -> bool {
    let mut run = Run::start(sim, workload, router, None);
    let mut late = LateCount::new(workload, slo_ms);
    while let Some(now) = run.advance(router) {
        if run.lost > 0 || late.past(now, &run.outcomes) >= late.allowed {
            return false;
        }
    }
    let figures = run.figures(sim);
    figures.served == figures.requests && figures.ttft_p90_ms.is_some_and(|p90| p90 <= slo_ms)
}

/// The requests whose TTFT is certainly over an SLO by the moment `now`: they are taken in arrival
/// order as the SLO passes for each, so each is judged once, with its first token or without one.
struct LateCount {
    slo_ms: f64,
    /// (arrival, request) in arrival order.
    arrivals: Vec<(f64, usize)>,
    judged: usize,
    late: usize,
    /// How many late requests put the p90 over the SLO: the p90 is the sorted TTFTs' element at
    /// [`percentile_index`], so it is over once that many from the top are.
    allowed: usize,
}

impl LateCount {
    fn new(workload: &Workload, slo_ms: f64) -> LateCount {
        let mut arrivals: Vec<(f64, usize)> = workload
            .requests
            .iter()
            .enumerate()
            .map(|(index, request)| (request.at, index))
            .collect();
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let count = arrivals.len();
        LateCount {
            slo_ms,
            arrivals,
            judged: 0,
            late: 0,
            allowed: count - percentile_index(count, 0.9),
        }
    }

    /// Late requests so far. A request without a first token `slo_ms` after its arrival gets it later
    /// if at all, so its TTFT is over (computed as the figures compute it, so the verdicts agree).
    fn past(&mut self, now: f64, outcomes: &[Outcome]) -> usize {
        while let Some(&(at, request)) = self.arrivals.get(self.judged) {
            if (now - at) * 1e3 <= self.slo_ms {
                break;
            }
            let first = outcomes
                .get(request)
                .and_then(|outcome| outcome.first_token);
            if first.is_none_or(|first| (first - at) * 1e3 > self.slo_ms) {
                self.late += 1;
            }
            self.judged += 1;
        }
        self.late
    }
}

/// One run's state: the fleet, the queue, the requests' outcomes and the prompts in flight.
struct Run<'w> {
    workload: &'w Workload,
    workers: Vec<OfflineWorker>,
    /// Per worker, the requests it received and has not yet submitted to a rank.
    fronts: Vec<Vec<usize>>,
    /// The prompts of the requests arriving or in a front: a run holds no other.
    live: HashMap<usize, Prompt>,
    queue: Queue,
    outcomes: Vec<Outcome>,
    /// Requests not yet finished or refused.
    open: usize,
    /// Requests refused by a router or an engine: a run with one has not served every request.
    lost: usize,
    busy: BusyWindow,
    regret: Option<Regret>,
}

impl<'w> Run<'w> {
    /// A fresh fleet of `sim`'s workers with `workload`'s arrivals queued and `router` started.
    fn start(
        sim: &SimConfig,
        workload: &'w Workload,
        router: &mut dyn Router,
        regret: Option<Regret>,
    ) -> Run<'w> {
        let workers: Vec<OfflineWorker> = (0..sim.workers.get())
            .map(|index| OfflineWorker::new(sim, index))
            .collect();
        let mut run = Run {
            workload,
            fronts: vec![Vec::new(); workers.len()],
            workers,
            live: HashMap::new(),
            queue: Queue::default(),
            outcomes: vec![Outcome::default(); workload.requests.len()],
            open: workload.requests.len(),
            lost: 0,
            busy: BusyWindow::default(),
            regret,
        };
        for (index, request) in workload.requests.iter().enumerate() {
            run.queue.push(request.at, Event::Arrive(index));
        }
        router.start(&mut run.cx(0.0));
        run
    }

    /// Takes the next event; its moment, or `None` when every request has ended (or nothing is
    /// left to happen).
    fn advance(&mut self, router: &mut dyn Router) -> Option<f64> {
        if self.open == 0 {
            return None;
        }
        let (now, event) = self.queue.pop()?;
        match event {
            Event::Arrive(index) => self.arrive(now, index, router),
            Event::Submit { request, worker } => self.submit(now, request, worker, router),
            Event::StepEnd { worker, rank } => self.step_end(now, worker, rank, router),
            Event::Router(wake) => router.wake(wake, &mut self.cx(now)),
        }
        Some(now)
    }

    fn figures(&self, sim: &SimConfig) -> RunFigures {
        let ranks = self.workers.len() as f64 * f64::from(sim.dp_size.get());
        RunFigures {
            regret: self.regret.as_ref().map(Regret::figures),
            ..RunFigures::of(self.workload, &self.outcomes, self.busy.share(ranks), ranks)
        }
    }

    /// What a router sees at `now`.
    fn cx(&mut self, now: f64) -> Cx<'_> {
        Cx {
            now,
            workers: &mut self.workers,
            workload: self.workload,
            fronts: &self.fronts,
            live: &self.live,
            queue: &mut self.queue,
        }
    }

    /// A request that ends without reaching an engine.
    fn drop_request(&mut self, index: usize) {
        self.live.remove(&index);
        self.open -= 1;
        self.lost += 1;
    }

    /// Request `index` arrives: routed, then received by its worker, which queues it behind its
    /// front.
    fn arrive(&mut self, now: f64, index: usize, router: &mut dyn Router) {
        self.busy
            .arrival(now, &self.workers, index, self.workload.requests.len());
        self.live.insert(index, self.workload.prompt(index));
        let routed = router.route(index, &mut self.cx(now));
        let (Some(routed), Some(request)) = (routed, self.workload.requests.get(index)) else {
            self.drop_request(index);
            return;
        };
        if let Some(outcome) = self.outcomes.get_mut(index) {
            outcome.worker = Some(routed.worker);
            outcome.reason = Some(routed.reason);
            outcome.replica = routed.replica;
        }
        if let (Some(regret), Some((_, tokens))) = (&mut self.regret, self.live.get(&index)) {
            regret.routed(index, tokens, routed, &self.workers, &self.fronts);
        }
        let Some(worker) = self.workers.get_mut(routed.worker) else {
            self.drop_request(index);
            return;
        };
        let ready = worker.accept(now, request.prompt_len as usize);
        if let Some(front) = self.fronts.get_mut(routed.worker) {
            front.push(index);
        }
        let event = Event::Submit {
            request: index,
            worker: routed.worker,
        };
        self.queue.push(ready, event);
    }

    /// Request `request` leaves `worker`'s front for a rank's queue; a refusal ends it.
    fn submit(&mut self, now: f64, request: usize, worker: usize, router: &mut dyn Router) {
        if let Some(front) = self.fronts.get_mut(worker) {
            front.retain(|queued| *queued != request);
        }
        if let Some(regret) = &mut self.regret {
            regret.submitted(request);
        }
        let tokens = self.live.remove(&request).map(|(_, tokens)| tokens);
        let (Some(state), Some(item)) = (
            self.workers.get_mut(worker),
            self.workload.requests.get(request),
        ) else {
            return;
        };
        let tokens = tokens.as_deref().unwrap_or_default();
        let submitted = state.submit(now, request as u64, tokens, item.max_tokens, item.at);
        router.published(worker, &mut self.cx(now));
        match submitted {
            Ok(Some((rank, end))) => self.queue.push(end, Event::StepEnd { worker, rank }),
            Ok(None) => {}
            Err(_) => {
                if let Some(outcome) = self.outcomes.get_mut(request) {
                    outcome.refused = true;
                }
                self.open -= 1;
                self.lost += 1;
                router.finished(request, worker, &mut self.cx(now));
            }
        }
    }

    /// A step on `worker`'s rank `rank` ended: the next is formed, what the cache did is published,
    /// and first tokens and finished requests are told.
    fn step_end(&mut self, now: f64, worker: usize, rank: usize, router: &mut dyn Router) {
        let Some(state) = self.workers.get_mut(worker) else {
            return;
        };
        let (happened, next) = state.step_ended(rank, now);
        if let Some(end) = next {
            self.queue.push(end, Event::StepEnd { worker, rank });
        }
        router.published(worker, &mut self.cx(now));
        for happening in happened {
            match happening {
                Happened::FirstToken { id, cached } => {
                    let request = usize::try_from(id).unwrap_or(usize::MAX);
                    if let Some(outcome) = self.outcomes.get_mut(request) {
                        outcome.first_token = Some(now);
                        outcome.cached = cached;
                    }
                    if let Some(regret) = &mut self.regret {
                        regret.admitted(request, cached);
                    }
                    router.first_token(request, worker, &mut self.cx(now));
                }
                Happened::Finished { id } => {
                    let request = usize::try_from(id).unwrap_or(usize::MAX);
                    if let Some(outcome) = self.outcomes.get_mut(request) {
                        outcome.finished = Some(now);
                    }
                    router.finished(request, worker, &mut self.cx(now));
                    self.open -= 1;
                }
            }
        }
    }
}

/// The fleet's busy time over the arrival window, first arrival to last.
#[derive(Default)]
struct BusyWindow {
    first: Option<(f64, f64)>,
    last: Option<(f64, f64)>,
}

impl BusyWindow {
    fn arrival(&mut self, now: f64, workers: &[OfflineWorker], index: usize, count: usize) {
        let busy = || workers.iter().map(OfflineWorker::busy_seconds).sum::<f64>();
        if index == 0 {
            self.first = Some((now, busy()));
        }
        if index + 1 == count {
            self.last = Some((now, busy()));
        }
    }

    /// GPU-busy share of the window over `ranks` GPUs.
    fn share(&self, ranks: f64) -> Option<f64> {
        let ((start, before), (end, after)) = (self.first?, self.last?);
        let window = (end - start) * ranks;
        (window > 0.0).then(|| ((after - before) / window).clamp(0.0, 1.0))
    }
}

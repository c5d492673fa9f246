//! The routing limit: an arm that sends every request where the step model predicts the lowest time to
//! first token, from the simulator's true state read in the same process — every rank's cached prefix
//! of the prompt, its queued prefill work, its running decodes and its free KV
//! ([`cachepick_sim::server::Worker::outlook`]). No router in front of real engines can know this; it is
//! not a product policy but the yardstick on the same fleet and workload, so every other row is read as
//! a ratio to it. It is not a strict bound: it minimises each request's own TTFT and does not price the
//! evictions a cold prefill causes, so past a workload's knee rules that stay with the prefix owner beat
//! it (BENCHMARKS.md).
//!
//! It knows what it sent, too: a request it dispatched is not in a rank's queue until the worker's API
//! server has parsed it (the profile's front), so until the worker says it is queued (each dispatch is
//! tagged, [`cachepick_sim::server::DISPATCH_TAG`]) the oracle counts it ahead of the next ones it
//! sends to that worker, as it will be — without this, a burst of arrivals within one front would all
//! see the same idle worker and pile onto it.
//!
//! Greedy per request, like every router here: it does not plan for the requests after this one. A tie
//! (two idle ranks) goes to the one holding more of the prompt, then to the lower worker index.
//!
//! On a prefill/decode fleet ([`Oracle::disaggregated`]) it makes both picks from the same true state:
//! the prefill worker with the lowest predicted time to its one token, over the prefill workers, and
//! the decode worker where a one-token request would start soonest (its queue and its running batch),
//! over the decode workers. The decode pick does not see the link: a transfer queued on a decode
//! worker is invisible to it until it ends.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cachepick_sim::fleet::Fleet;

/// A dispatch the worker never reported (its worker crashed, its connection failed) stops counting
/// after this long.
const FORGET_AFTER: Duration = Duration::from_secs(30);

/// One dispatch not yet in its worker's queue.
struct Sent {
    worker: usize,
    tag: u64,
    at: Instant,
    tokens: Vec<u32>,
}

/// The oracle's row label.
pub const LABEL: &str = "oracle";

/// The oracle over one arm's fleet.
pub struct Oracle {
    fleet: Arc<Fleet>,
    /// Requests sent and not yet in their worker's queue, and the next tag.
    in_flight: Mutex<(Vec<Sent>, u64)>,
    /// A prefill/decode fleet: the first this many workers prefill, the rest decode.
    prefill: Option<usize>,
}

/// Both legs of a request on a prefill/decode fleet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdChoice {
    pub prefill: Choice,
    pub decode: Choice,
}

/// Where the oracle sends a request, and what it predicted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub worker: SocketAddr,
    /// The tag to send the request with ([`cachepick_sim::server::DISPATCH_TAG`]).
    pub tag: u64,
    pub cached_tokens: u32,
    /// Model seconds to the first token.
    pub predicted_ttft: f64,
}

impl Oracle {
    pub fn new(fleet: Arc<Fleet>) -> Oracle {
        Oracle {
            fleet,
            in_flight: Mutex::new((Vec::new(), 0)),
            prefill: None,
        }
    }

    /// The oracle of a prefill/decode fleet whose first `prefill` workers prefill.
    pub fn disaggregated(fleet: Arc<Fleet>, prefill: usize) -> Oracle {
        Oracle {
            prefill: Some(prefill),
            ..Oracle::new(fleet)
        }
    }

    /// The fleet's engine, whose handshake a prefill/decode fleet's legs follow.
    pub fn engine(&self) -> cachepick_sim::Engine {
        self.fleet.config().engine
    }

    /// The prefill workers' count on a prefill/decode fleet.
    pub fn prefill_workers(&self) -> Option<usize> {
        self.prefill
    }

    /// Both picks for a completion whose prompt is `text`, each counted as in flight to its worker;
    /// `None` on an aggregated fleet or when a side has no prediction.
    pub fn choose_pd(&self, text: &str) -> Option<PdChoice> {
        let prefill = self.prefill?;
        let tokens = self.fleet.tokenize(text).ok()?;
        let probe = tokens.get(..1).unwrap_or_default().to_vec();
        let mut guard = self.in_flight();
        let (in_flight, next_tag) = &mut *guard;
        let workers = self.fleet.workers().len();
        let now = Instant::now();
        let mut pick = |range: std::ops::Range<usize>, predicted: &[u32], tracked: Vec<u32>| {
            let tag = *next_tag;
            let (index, choice) = self.best(in_flight, predicted, tag, range)?;
            *next_tag = next_tag.wrapping_add(1);
            in_flight.push(Sent {
                worker: index,
                tag,
                at: now,
                tokens: tracked,
            });
            Some(choice)
        };
        let first = pick(0..prefill, &tokens, tokens.clone())?;
        let decode = pick(prefill..workers, &probe, probe.clone())?;
        Some(PdChoice {
            prefill: first,
            decode,
        })
    }

    /// The dispatches still in flight and the next tag, held for one decision at a time so two
    /// requests sent together see each other.
    fn in_flight(&self) -> std::sync::MutexGuard<'_, (Vec<Sent>, u64)> {
        let mut guard = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.forget_arrived(&mut guard.0);
        guard
    }

    /// Drops the dispatches their workers have queued, and those never reported.
    fn forget_arrived(&self, in_flight: &mut Vec<Sent>) {
        let now = Instant::now();
        for (index, worker) in self.fleet.workers().iter().enumerate() {
            let tags: Vec<u64> = in_flight
                .iter()
                .filter(|sent| sent.worker == index)
                .map(|sent| sent.tag)
                .collect();
            let arrived = worker.take_arrived(&tags);
            in_flight.retain(|sent| {
                !(sent.worker == index && arrived.contains(&sent.tag))
                    && now.duration_since(sent.at) < FORGET_AFTER
            });
        }
    }

    /// The worker of `range` with the lowest predicted TTFT for `tokens` behind what is in flight to
    /// it; a tie goes to the one holding more of them.
    fn best(
        &self,
        in_flight: &[Sent],
        tokens: &[u32],
        tag: u64,
        range: std::ops::Range<usize>,
    ) -> Option<(usize, Choice)> {
        self.fleet
            .workers()
            .iter()
            .enumerate()
            .filter(|(index, _)| range.contains(index))
            .flat_map(|(index, worker)| {
                let sent: Vec<&[u32]> = in_flight
                    .iter()
                    .filter(|sent| sent.worker == index)
                    .map(|sent| sent.tokens.as_slice())
                    .collect();
                let addr = worker.addr();
                worker.outlook(tokens, &sent).into_iter().map(move |rank| {
                    (
                        index,
                        Choice {
                            worker: addr,
                            tag,
                            cached_tokens: rank.cached_tokens,
                            predicted_ttft: rank.predicted_ttft,
                        },
                    )
                })
            })
            .min_by(|(_, a), (_, b)| {
                a.predicted_ttft
                    .total_cmp(&b.predicted_ttft)
                    .then(b.cached_tokens.cmp(&a.cached_tokens))
            })
    }

    /// The worker with the lowest predicted TTFT for a completion whose prompt is `text`, counted as in
    /// flight to it from now on; `None` when no worker predicts (none is up, or the fleet runs the slots
    /// model).
    pub fn choose(&self, text: &str) -> Option<Choice> {
        let tokens = self.fleet.tokenize(text).ok()?;
        let mut guard = self.in_flight();
        let (in_flight, next_tag) = &mut *guard;
        let tag = *next_tag;
        let workers = self.fleet.workers().len();
        let (index, choice) = self.best(in_flight, &tokens, tag, 0..workers)?;
        *next_tag = next_tag.wrapping_add(1);
        in_flight.push(Sent {
            worker: index,
            tag,
            at: Instant::now(),
            tokens,
        });
        Some(choice)
    }
}

//! The routing limit: an arm that sends every request where the step model predicts the lowest time to
//! first token, from the simulator's true state read in the same process — every rank's cached prefix
//! of the prompt, its queued prefill work, its running decodes and its free KV
//! ([`cachepick_sim::server::Worker::outlook`]). No router in front of real engines can know this; it is
//! not a product policy but the ceiling any router could reach on the same fleet and workload, so every
//! other row is read as a ratio to it.
//!
//! It knows what it sent, too: a request it dispatched is not in a rank's queue until the worker's API
//! server has parsed it (the profile's front), so until then the oracle counts it ahead of the next
//! ones it sends to that worker, as it will be — without this, a burst of arrivals within one front
//! would all see the same idle worker and pile onto it.
//!
//! Greedy per request, like every router here: it does not plan for the requests after this one. A tie
//! (two idle ranks) goes to the one holding more of the prompt, then to the lower worker index.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cachepick_sim::fleet::Fleet;

/// Beyond the modelled front, the loopback HTTP exchange before the worker starts its front.
const SEND_MARGIN: Duration = Duration::from_millis(2);

/// The oracle's row label.
pub const LABEL: &str = "oracle";

/// The oracle over one arm's fleet.
pub struct Oracle {
    fleet: Arc<Fleet>,
    /// Requests sent and not yet in their worker's queue: the worker's index, when they will be, and
    /// their tokens.
    in_flight: Mutex<Vec<(usize, Instant, Vec<u32>)>>,
}

/// Where the oracle sends a request, and what it predicted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub worker: SocketAddr,
    pub cached_tokens: u32,
    /// Model seconds to the first token.
    pub predicted_ttft: f64,
}

impl Oracle {
    pub fn new(fleet: Arc<Fleet>) -> Oracle {
        Oracle {
            fleet,
            in_flight: Mutex::new(Vec::new()),
        }
    }

    /// The worker with the lowest predicted TTFT for a completion whose prompt is `text`, counted as in
    /// flight to it from now on; `None` when no worker predicts (none is up, or the fleet runs the slots
    /// model).
    pub fn choose(&self, text: &str) -> Option<Choice> {
        let tokens = self.fleet.tokenize(text).ok()?;
        // One decision at a time, so two requests sent together see each other.
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        in_flight.retain(|(_, arrives, _)| *arrives > now);
        let (index, choice) = self
            .fleet
            .workers()
            .iter()
            .enumerate()
            .flat_map(|(index, worker)| {
                let sent: Vec<&[u32]> = in_flight
                    .iter()
                    .filter(|(to, _, _)| *to == index)
                    .map(|(_, _, tokens)| tokens.as_slice())
                    .collect();
                let addr = worker.addr();
                worker.outlook(&tokens, &sent).into_iter().map(move |rank| {
                    (
                        index,
                        Choice {
                            worker: addr,
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
            })?;
        let arrives = self
            .fleet
            .worker(index)
            .map_or(Duration::ZERO, |worker| worker.front_delay())
            + SEND_MARGIN;
        in_flight.push((index, now + arrives, tokens));
        Some(choice)
    }
}

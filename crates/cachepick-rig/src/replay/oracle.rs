//! The routing limit: an arm that sends every request where the step model predicts the lowest time to
//! first token, from the simulator's true state read in the same process — every rank's cached prefix
//! of the prompt, its queued prefill work, its running decodes and its free KV
//! ([`cachepick_sim::server::Worker::outlook`]). No router in front of real engines can know this; it is
//! not a product policy but the ceiling any router could reach on the same fleet and workload, so every
//! other row is read as a ratio to it.
//!
//! Greedy per request, like every router here: it does not plan for the requests after this one. A tie
//! (two idle ranks) goes to the one holding more of the prompt, then to the lower worker index.

use std::net::SocketAddr;
use std::sync::Arc;

use cachepick_sim::fleet::Fleet;

/// The oracle's row label.
pub const LABEL: &str = "oracle";

/// The oracle over one arm's fleet.
pub struct Oracle {
    fleet: Arc<Fleet>,
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
        Oracle { fleet }
    }

    /// The worker with the lowest predicted TTFT for a completion whose prompt is `text`; `None` when no
    /// worker predicts (none is up, or the fleet runs the slots model).
    pub fn choose(&self, text: &str) -> Option<Choice> {
        let tokens = self.fleet.tokenize(text).ok()?;
        self.fleet
            .workers()
            .iter()
            .flat_map(|worker| {
                let addr = worker.addr();
                worker.outlook(&tokens).into_iter().map(move |rank| Choice {
                    worker: addr,
                    cached_tokens: rank.cached_tokens,
                    predicted_ttft: rank.predicted_ttft,
                })
            })
            .min_by(|a, b| {
                a.predicted_ttft
                    .total_cmp(&b.predicted_ttft)
                    .then(b.cached_tokens.cmp(&a.cached_tokens))
            })
    }
}

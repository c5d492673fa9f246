//! Learning from what was served: a commit's credit is tentative until Envoy reports the response.
//!
//! [`Pinned::commit`](super::Pinned::commit) records the prompt's blocks for the selected worker at
//! once, so that the next decision sees the placement (a burst of identical prompts follows the first).
//! With `feedback.enabled` it also returns a [`Credit`]: what it recorded, where. When Envoy's
//! response-phase message arrives (`extproc::served`), [`Picker::settle`](super::Picker::settle)
//! (in `settle`) turns the report — the response's status and the upstream host that actually served
//! the request — into one of:
//!
//! - **confirmed**: a 2xx from the selected worker (or from no reported host): the blocks stay; if
//!   another request's refusal took them away meanwhile, they are recorded again;
//! - **moved**: a 2xx from another worker of the pool (Envoy retried on a fallback): the blocks this
//!   request added to the selected worker are taken back and recorded for the one that served it;
//! - **retracted**: any other status (the engine refused the request, it failed, or Envoy answered it
//!   itself), or a 2xx from an address the pool does not know: the blocks this request added are
//!   taken back, so a refused request credits nobody.
//!
//! Blocks the selected worker already held before the request (`held`) are never taken back: they
//! were there for other requests. A report that never comes (Envoy not configured for the response
//! phase, a client gone before the response, a response slower than `feedback.wait`) leaves the credit
//! as committed: today's behaviour without feedback.
//!
//! In an `events` pool the commit is a speculative guess that expires by itself (`speculative_ttl`)
//! and the engines' events say what they cached, so a refusal needs nothing; a move records the guess
//! for the worker that served.

use std::net::SocketAddr;

use crate::worker::WorkerId;

/// What one commit credited, kept until the response's report settles it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credit {
    pub(super) pool: usize,
    pub(super) worker: WorkerId,
    /// The occupant of the slot the credit is for: nothing is taken from, or given to, its successor.
    pub(super) generation: u64,
    /// The selected worker's address, as Envoy reports the upstream.
    pub(super) endpoint: SocketAddr,
    /// The chain as recorded (capped at `index.commit_share`).
    pub(super) chain: Vec<u64>,
    /// Leading blocks of `chain` the worker held before this request: never taken back.
    pub(super) held: usize,
}

impl Credit {
    /// The selected worker's address.
    pub fn endpoint(&self) -> SocketAddr {
        self.endpoint
    }

    /// Blocks the commit recorded.
    pub fn blocks(&self) -> usize {
        self.chain.len()
    }
}

/// What Envoy reported of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedReport {
    /// The response's `:status`.
    pub status: u16,
    /// The upstream host that served it (`upstream.address`), when Envoy said.
    pub upstream: Option<SocketAddr>,
    /// When the report arrived: the served worker was alive then.
    pub at: std::time::Instant,
}

/// How a report settled a credit (the `outcome` label of `cachepick_feedback_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    Confirmed,
    Moved,
    Retracted,
    /// No report within `feedback.wait`, or the stream ended without one: the credit stays.
    Unreported,
}

impl Settled {
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Confirmed => "confirmed",
            Settled::Moved => "moved",
            Settled::Retracted => "retracted",
            Settled::Unreported => "unreported",
        }
    }
}

//! Identity of a routable inference engine.
//!
//! Every other module names workers by [`WorkerId`], a dense index assigned in configuration order
//! within a pool. Dense ids let the load snapshot, the owner index and the policy keep per-worker data
//! in plain vectors, and make "ties by worker id" mean "ties by configuration order", which an operator
//! can predict from the YAML alone.

use std::fmt;

use serde::Serialize;

/// Index of a worker within its pool, in configuration order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct WorkerId(pub u32);

impl WorkerId {
    /// The position of this worker in its pool's worker list.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// What part of a request a worker serves in a prefill/decode (PD) deployment.
///
/// Only `Prefill` and `Both` workers receive requests from the picker: the prompt's prefix cache lives
/// where the prefill runs. `Decode` workers are listed so that scraping and stats cover them, and so that
/// an idle decode peer is visibly excluded from the saturation check instead of silently vetoing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    /// Whether the picker may send a request's prefill to a worker of this role.
    pub fn serves_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// The inference engine behind a worker, which fixes its metric names and load endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

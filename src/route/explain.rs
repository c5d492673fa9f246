//! What `cachepick explain`, the debug endpoint and the admin `Explain` report about one body: the
//! prepared request and the decision the picker would make now. Its text form is in `crate::render`.

use serde::Serialize;

use super::prepared::Prepared;
use crate::events::Medium;
use crate::policy::Outcome;
use crate::prefix::SourcedMatch;
use crate::worker::WorkerId;

/// What `cachepick explain` and the debug endpoints report about one request body.
#[derive(Debug, Serialize)]
pub struct Explanation {
    pub prepared: Prepared,
    pub block_size: u32,
    /// The decision the picker would make now (nothing is committed).
    pub outcome: Outcome,
    /// Endpoints by worker id, so the outcome's ids can be read.
    pub endpoints: Vec<String>,
    /// In an `events` pool, each owner's depth by the engine's events and by this replica's recent
    /// decisions (the deeper one counts); absent in an `approximate` pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub depth_sources: Option<Vec<SourcedMatch>>,
    /// In an `events` pool, the blocks each worker's engine reports per tier (summed over its ranks):
    /// only GPU blocks make an owner, but a prompt may still be in a CPU or disk tier.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<WorkerTiers>,
}

/// One worker's blocks per tier, as its engine's KV events report them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerTiers {
    pub worker: WorkerId,
    pub blocks: Vec<(Medium, u64)>,
}

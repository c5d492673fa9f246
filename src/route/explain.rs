//! What `cachepick explain`, the debug endpoint and the admin `Explain` report about one body: the
//! prepared request and the decision the picker would make now. Its text form is in `crate::render`.

use serde::Serialize;

use super::picker::Prepared;
use crate::policy::Outcome;
use crate::prefix::SourcedMatch;

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
}

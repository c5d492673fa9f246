//! What `cachepick explain`, the debug endpoint and the admin `Explain` report about one request: the
//! answer routing would give it now and what the pipeline saw on the way (`Service::route` in a dry
//! run: the same steps as routing, nothing committed). Its text form is in `crate::render`.

use std::time::Instant;

use serde::Serialize;

use super::picker::Pinned;
use super::prepared::Prepared;
use crate::events::Medium;
use crate::events::stream::StreamView;
use crate::load::{PoolSnapshot, PoolView, WorkerView};
use crate::policy::Outcome;
use crate::prefix::SourcedMatch;
use crate::worker::WorkerId;

/// What `cachepick explain` and the debug endpoints report about one request.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// The label routing would give the request (`x-cachepick-decision`): the decision's reason, or
    /// `passthrough` for a request routed by load alone.
    pub decision: &'static str,
    /// Routed by load alone, neither a decision nor a prefix to learn: not a generation request, or
    /// a body cachepick cannot read.
    pub passthrough: bool,
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
    /// In a prefill/decode pool, the decode pick routing would make beside the prefill decision (the
    /// prefill leg itself does not run in a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode: Option<crate::policy::DecodePick>,
    /// Conditional disaggregation: the decode worker would prefill the request itself, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_prefill: Option<crate::policy::LocalPrefill>,
    /// The cache-aware ladder's depth that makes an owner of this prompt: a worker holding fewer of
    /// its tokens is no owner (it is counted in the trace's `ignored_matches`). Absent for the other
    /// modes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_depth: Option<OwnerDepth>,
    /// The pool's workers as the decision saw them: state, reading (fresh or why not: a late one's
    /// gate fails open), the rates the predictions used and where they came from.
    pub workers: Vec<WorkerView>,
}

/// The leading tokens a worker must hold to own a prompt, and the two knobs that set it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OwnerDepth {
    pub tokens: u64,
    pub min_match_tokens: u64,
    pub min_match_share: f64,
    pub prompt_tokens: u64,
}

/// One worker's blocks per tier, as its engine's KV events report them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerTiers {
    pub worker: WorkerId,
    pub blocks: Vec<(Medium, u64)>,
}

impl Explanation {
    /// What a dry run saw: the request on its pinned snapshot, the policy's `outcome`, and routing's
    /// label for it. `depth_sources` and `streams` (the pool's KV event streams) come from an
    /// `events` pool only.
    pub(super) fn new(
        pinned: &Pinned<'_>,
        outcome: Outcome,
        decision: &'static str,
        passthrough: bool,
        depth_sources: Option<Vec<SourcedMatch>>,
        streams: Vec<StreamView>,
        now: Instant,
    ) -> Explanation {
        Explanation {
            decision,
            passthrough,
            prepared: pinned.prepared().clone(),
            block_size: pinned.block_size(),
            outcome,
            endpoints: endpoints_by_id(pinned.snapshot()),
            tiers: if depth_sources.is_some() {
                tiers(streams)
            } else {
                Vec::new()
            },
            depth_sources,
            decode: None,
            local_prefill: None,
            owner_depth: pinned.pool.policy.load().cache_aware().map(|knobs| {
                let prompt_tokens = pinned.prepared().prompt_tokens;
                OwnerDepth {
                    tokens: knobs.owner_depth(prompt_tokens),
                    min_match_tokens: knobs.min_match_tokens,
                    min_match_share: knobs.min_match_share.get(),
                    prompt_tokens,
                }
            }),
            workers: PoolView::new("", pinned.snapshot(), now).workers,
        }
    }
}

/// Each slot's endpoint, by worker id (empty for a slot nobody holds): what `explain` names workers by.
fn endpoints_by_id(snapshot: &PoolSnapshot) -> Vec<String> {
    let mut endpoints = vec![String::new(); snapshot.slots()];
    for worker in snapshot.workers() {
        if let Some(slot) = endpoints.get_mut(worker.id.index()) {
            *slot = worker.endpoint.to_string();
        }
    }
    endpoints
}

/// Each worker's blocks per tier, summed over its ranks' streams.
fn tiers(streams: Vec<StreamView>) -> Vec<WorkerTiers> {
    let mut tiers: Vec<WorkerTiers> = Vec::new();
    for stream in streams {
        let at = match tiers.iter().position(|found| found.worker == stream.worker) {
            Some(at) => at,
            None => {
                tiers.push(WorkerTiers {
                    worker: stream.worker,
                    blocks: stream
                        .tiers
                        .iter()
                        .map(|(medium, _)| (*medium, 0))
                        .collect(),
                });
                tiers.len() - 1
            }
        };
        if let Some(found) = tiers.get_mut(at) {
            for ((_, total), (_, blocks)) in found.blocks.iter_mut().zip(stream.tiers) {
                *total += blocks;
            }
        }
    }
    tiers
}

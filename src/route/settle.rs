//! Settling a [`Credit`] by Envoy's report of the response: confirmed, moved or retracted, by the rules
//! `credit`'s documentation gives. It reaches into the pools' indexes and loads, so it lives beside the
//! picker rather than with the credit's types, which the picker's commit returns.

use super::credit::{Credit, ServedReport, Settled};
use super::picker::{Picker, PoolRoute};

impl Picker {
    /// Confirms, moves or retracts `credit` by what Envoy reported (see the module documentation).
    pub fn settle(&self, credit: &Credit, report: ServedReport) -> Settled {
        let Some(pool) = self.pools.get(credit.pool) else {
            return Settled::Unreported;
        };
        if !(200..300).contains(&report.status) {
            retract(pool, credit);
            return Settled::Retracted;
        }
        let upstream = report.upstream.unwrap_or(credit.endpoint);
        if upstream == credit.endpoint {
            if same_occupant(pool, credit) {
                // A response it served: the worker is alive, however late its `/metrics`.
                pool.load.heard_from(credit.worker, report.at);
            }
            confirm(pool, credit);
            return Settled::Confirmed;
        }
        let snapshot = pool.load.snapshot();
        let Some(served) = snapshot
            .workers()
            .iter()
            .find(|worker| worker.endpoint == upstream && worker.routable())
        else {
            retract(pool, credit);
            return Settled::Retracted;
        };
        retract(pool, credit);
        pool.load.heard_from(served.id, report.at);
        pool.record(
            served.id,
            served.capacity.max_total_tokens,
            &credit.chain,
            &snapshot,
            report.at,
        );
        Settled::Moved
    }
}

/// Whether the slot still has the occupant the credit is for.
fn same_occupant(pool: &PoolRoute, credit: &Credit) -> bool {
    pool.load
        .snapshot()
        .worker(credit.worker)
        .is_some_and(|worker| worker.generation == credit.generation)
}

/// Takes back the blocks the request added to the selected worker, last first, so that what remains
/// is still a prefix of the chain.
fn retract(pool: &PoolRoute, credit: &Credit) {
    if !same_occupant(pool, credit) {
        return;
    }
    let added = credit.chain.get(credit.held..).unwrap_or_default();
    pool.index.retract(credit.worker, added);
}

/// The served request's blocks are on the selected worker: recorded again if something (another
/// request's retraction of the same blocks) took them away.
fn confirm(pool: &PoolRoute, credit: &Credit) {
    if same_occupant(pool, credit) {
        pool.index
            .confirm(credit.worker, &credit.chain, pool.config.block_size);
    }
}

//! A prefill/decode (PD) pool's second pick: the decode worker of a request whose prefill worker the
//! ladder chose, read off the same snapshot, and committed beside it.

use std::net::SocketAddr;

use rand::Rng;
use serde::Serialize;

use super::picker::Pinned;
use crate::config::{Handshake, PdConfig};
use crate::policy::{
    Decision, DecodePick, LoadView, LocalPrefill, LocalRule, RequestFacts, decide_decode,
    local_prefill,
};

/// The handoff of a request conditional disaggregation keeps on its decode worker.
pub fn local_handoff(local: LocalPrefill) -> crate::pd::Handoff {
    match local {
        LocalPrefill::ShortSuffix => crate::pd::Handoff::LocalPrefillShortSuffix,
        LocalPrefill::OwnerQueued => crate::pd::Handoff::LocalPrefillOwnerQueued,
    }
}

/// The conditional-disaggregation rule of `pd`; `None` where the decode worker cannot prefill
/// (SGLang's `bootstrap`).
fn local_rule(pd: &PdConfig) -> Option<LocalRule> {
    (pd.handshake != Handshake::Bootstrap).then_some(LocalRule {
        max_suffix_tokens: pd.local_prefill_tokens,
        max_suffix_share: pd.local_prefill_share.get(),
        when_owner_queued: pd.local_prefill_when_queued,
    })
}

/// The two legs of a request routed in a PD pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PdRoute {
    /// Who performs the handshake: cachepick (`nixl`) or the decode worker's sidecar.
    pub handshake: crate::config::Handshake,
    /// The chosen prefill worker, then the ladder's next best, which replaces it if it fails.
    pub prefill: Vec<SocketAddr>,
    /// The decode worker and why.
    pub decode: DecodePick,
    /// What became of the prefill leg, once it ran (`extproc` runs it before answering Envoy).
    pub handoff: Option<crate::pd::Handoff>,
    /// The prefill worker whose KV the decode worker pulls.
    pub prefilled_by: Option<SocketAddr>,
    /// Conditional disaggregation: the decode worker prefills the request itself, and why (no leg is
    /// sent).
    pub local: Option<LocalPrefill>,
}

impl Pinned<'_> {
    /// In a PD pool, the decode pick for the request whose prefill `decision` chose, with the decode
    /// endpoints (the selected one, then its fallbacks); `None` for an aggregated pool, or when the pool
    /// has no routable decode worker (the prefill worker then serves the request whole).
    pub(super) fn decide_decode<R: Rng + ?Sized>(
        &self,
        decision: &Decision,
        rng: &mut R,
    ) -> Option<(PdRoute, Vec<SocketAddr>)> {
        let pd = self.pool.config.pd.as_ref()?;
        let view = LoadView {
            snapshot: &self.snapshot,
            dispatches: self.pool.load.dispatches(),
            now: self.now,
        };
        let facts = RequestFacts {
            prompt_tokens: self.prepared.prompt_tokens,
            // The proxy's subset hint names the endpoints of the request's one upstream leg; the
            // decode fleet is the pool's own.
            allowed: None,
            sequence: 0,
        };
        let policy = self.pool.policy.load();
        let min_match = policy
            .cache_aware()
            .map_or(1, |knobs| knobs.min_match_tokens);
        let pick = decide_decode(
            &facts,
            &self.prepared.owners,
            &view,
            pd.decode_choices.get(),
            min_match,
            self.max_fallbacks(),
            rng,
        )?;
        let endpoints: Vec<SocketAddr> = std::iter::once(pick.selected)
            .chain(pick.fallbacks.iter().copied())
            .filter_map(|id| self.snapshot.worker(id).map(|worker| worker.endpoint))
            .collect();
        let prefill = self.endpoints(decision).into_iter().take(2).collect();
        let local = local_rule(pd).and_then(|rule| {
            local_prefill(self.prepared.prompt_tokens, &pick, decision.reason, &rule)
        });
        Some((
            PdRoute {
                handshake: pd.handshake,
                prefill,
                decode: pick,
                handoff: None,
                prefilled_by: None,
                local,
            },
            endpoints,
        ))
    }

    /// Records a decode leg: one more request in flight on the decode worker, and the prompt's blocks
    /// there, since vLLM's decode worker keeps the KV it pulls (or computes) in its prefix cache.
    pub(super) fn commit_decode(&self, pick: &DecodePick) {
        let Some(worker) = self
            .snapshot
            .worker(pick.selected)
            .filter(|worker| worker.routable())
        else {
            return;
        };
        let chain = self.pool.record(
            pick.selected,
            worker.capacity.max_total_tokens,
            &self.prepared.block_hashes,
            &self.snapshot,
            self.now,
        );
        self.pool.load.dispatched(
            pick.selected,
            worker.endpoint,
            self.prepared
                .prompt_tokens
                .saturating_sub(pick.matched_tokens),
            &self.pool.announced(chain),
        );
    }
}

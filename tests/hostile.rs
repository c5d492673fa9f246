//! Hostile clients and hostile deployment states against the real binary (and a real Envoy where the
//! attack goes through it), each asserting the bound RELIABILITY.md states. One module per attack.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "support/envoy.rs"]
mod envoy;
#[path = "support/provision.rs"]
mod provision;
#[path = "support/sim_client.rs"]
mod sim_client;

#[path = "hostile/cold.rs"]
mod cold;

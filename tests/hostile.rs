//! Hostile clients, feeds, files and deployment states against the real `cachepick serve` (and a real
//! Envoy where the attack goes through it): each attack of issue 23 runs here and asserts the bound
//! RELIABILITY.md states. One module per attack surface, in `tests/hostile/`; the shared support
//! modules are declared once, here.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

#[path = "support/envoy.rs"]
mod envoy;
#[path = "support/picker.rs"]
mod picker;
#[path = "support/provision.rs"]
mod provision;
#[path = "support/sim_client.rs"]
mod sim_client;

#[path = "hostile/cold.rs"]
mod cold;
#[path = "hostile/conn.rs"]
mod conn;
#[path = "hostile/feeds.rs"]
mod feeds;
#[path = "hostile/served.rs"]
mod served;
#[path = "hostile/tok.rs"]
mod tok;

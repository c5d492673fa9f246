//! Hostile clients, feeds, files and deployment states against the real `cachepick serve` (and a real
//! Envoy where the attack goes through it): each attack of issue 23 runs here and asserts the bound
//! RELIABILITY.md states. One module per attack surface, in `tests/hostile/`; the shared support
//! modules are declared once, here.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

// rustfmt resolves the modules of a root file that has a folder of its own name (`hostile/`) in that
// folder; naming `support/` keeps it finding the same files as rustc.
#[path = "support"]
mod support {
    pub mod engine;
    pub mod envoy;
    pub mod hostile_zmtp;
    pub mod picker;
    pub mod provision;
    pub mod serve;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, picker, sim_client, sim_fleet};

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

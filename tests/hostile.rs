//! Hostile clients, feeds and files against the real binary: each attack of issue 23 runs here and
//! asserts its bound. One module per area, in `tests/hostile/`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

#[path = "hostile/feeds.rs"]
mod feeds;

//! Hostile clients, feeds and files against the real `cachepick serve`: each attack of issue 23 runs
//! here and asserts the bound the picker holds under it. One module per attack surface, in
//! `tests/hostile/`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

#[path = "hostile/conn.rs"]
mod conn;
#[path = "hostile/feeds.rs"]
mod feeds;

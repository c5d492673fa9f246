//! Hostile clients against the real `cachepick serve`, one module per attack surface: each asserts the
//! bound the picker holds under its attack (issue 23). The modules live in `tests/hostile/`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "hostile/conn.rs"]
mod conn;

//! Shared helpers for the integration tests.
//!
//! The files in this folder panic, unwrap and index freely: every test file that includes one carries
//! the `#![allow(clippy::unwrap_used, …)]` that covers them.
pub mod engine;

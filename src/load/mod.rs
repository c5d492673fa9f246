//! Worker load: what every engine reported, when, and how much the picker has sent it since.
//!
//! The scraper (one task per pool) builds a fresh [`PoolSnapshot`] after each round and publishes it
//! whole; routing decisions read whichever snapshot is current and never wait on a scrape. A published
//! snapshot is never mutated. The only per-request mutable state is [`Dispatches`], the router-local count
//! of requests sent to each worker since its last fresh reading.

mod snapshot;

pub use snapshot::{
    Capacity, DispatchCounts, Dispatches, EngineLoad, PoolSnapshot, Reading, WorkerState,
};

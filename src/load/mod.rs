//! Worker load: what every engine reported, when, and how much the picker has sent it since.
//!
//! A [`Scraper`] task per pool reads every worker's `/metrics` (or SGLang's `/v1/loads`) each
//! `scrape_interval` and publishes a new [`PoolSnapshot`] whole; routing decisions read whichever
//! snapshot is current through [`PoolLoad`] and never wait on a scrape. A published snapshot is never
//! mutated. The only per-request mutable state is the [`DispatchTable`], the router-local count of
//! requests sent to each worker since its last complete reading.

mod dispatch;
mod driven;
mod engine;
mod fetch;
mod inspect;
mod pool;
mod prom;
mod rate;
mod roster;
mod samples;
mod scrape;
mod share;
mod snapshot;
mod sync;
mod tls;

pub use dispatch::{DispatchTable, RoutedQueue, Window};
pub use driven::{ScrapeDriver, ScrapeTicket};
pub use engine::{
    ExtractError, Identity, Progress, RankLoad, Report, from_loads_json, from_metrics,
};
pub use fetch::ScrapeError;
pub use inspect::{PoolView, WorkerView};
pub use pool::{Announce, PeerGuesses, PoolLoad, RosterObserver, ScrapeObserver};
pub use prom::{Labels, Sample, Samples, samples};
pub use scrape::Scraper;
pub use snapshot::{
    Capacity, DispatchCounts, Dispatches, EngineLoad, Lifecycle, PoolSnapshot, PrefillEstimate,
    Reading, ScrapeOutcome, ScrapeStatus, Tier, TokenDispatches, WorkerState,
};
pub use sync::{
    ASK_EACH_WITHIN, Announcement, FRESH_WITHIN, KeyError, MAX_CHECKPOINTS, MAX_SNAPSHOT_BYTES,
    MIN_KEY_BYTES, Received, ReplicaSync, Served, SnapshotSource, SyncKeys, SyncStats, Unanswered,
    Unopened, WARM_WITHIN, Warmed, take_announcement,
};
pub use tls::{HttpClient, ScrapeTlsClient};

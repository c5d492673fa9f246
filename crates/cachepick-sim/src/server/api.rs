//! The API server's one loop: prompts tokenized, every step's outputs processed and `/metrics`
//! rendered take turns on it (`Profile::api_token` and its neighbours say why and how long).

use std::time::Duration;

use super::{Shared, lock};
use crate::config::Timing;

/// Queues `seconds` (model time) of work on the API server's one loop, behind what it has queued
/// already, and returns when it is done: prompts tokenized, step outputs processed and `/metrics`
/// rendered take turns there, so a burst of long prompts or a crowd of streams makes `/metrics` late,
/// as it makes a real vLLM's (`Profile::api_token`). Under the step model only; the slots model has
/// none.
pub(super) fn api_work(shared: &Shared, seconds: f64) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    if shared.spec.timing != Timing::Step {
        return now;
    }
    let scale = shared.params.load().time_scale;
    let wall = Duration::try_from_secs_f64(seconds * scale).unwrap_or(Duration::ZERO);
    let mut free = lock(&shared.api_free);
    let done = (*free).max(now) + wall;
    *free = done;
    done
}

//! The sampling the request-path benches share, so their figures stay comparable run to run.

use std::time::Duration;

use criterion::Criterion;

/// Fifty samples over five seconds after a two-second warm-up.
pub fn fifty_samples() -> Criterion {
    Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5))
}

//! How long a simulated rank takes: the prefill before the first output token and the gap between two
//! output tokens, from the parameters, the rank's load and a seeded random source.
//!
//! Pure: the caller passes the random source, so a seeded worker replays the same durations. Every
//! result saturates (a non-finite or negative product becomes zero, an overflowing one
//! `Duration::MAX`), so no parameter value makes it panic.
use std::time::Duration;

use crate::config::SimParams;

/// Relative jitter never shrinks a duration below this share of its mean, so a wide jitter cannot
/// produce zero or negative times.
const MIN_JITTER_FACTOR: f64 = 0.05;
/// The approximately normal deviate is clamped to this many standard deviations.
const MAX_DEVIATIONS: f64 = 3.0;

/// Multiplier of every step with `running` requests on the rank: 1 with ≤1 running, growing linearly
/// to `params.load_slowdown` at `params.max_running` (and staying there beyond it, after a shrink).
pub fn slowdown(params: &SimParams, running: u64) -> f64 {
    let peak = if params.load_slowdown.is_finite() && params.load_slowdown > 0.0 {
        params.load_slowdown
    } else {
        1.0
    };
    let max_running = u64::from(params.max_running.get());
    if running <= 1 || max_running <= 1 {
        return 1.0;
    }
    let progress = (running.min(max_running) - 1) as f64 / (max_running - 1) as f64;
    1.0 + (peak - 1.0) * progress
}

/// Time from admission to the first output token:
/// (prefill_overhead + uncached_tokens × prefill_per_token) × slowdown × jitter × time_scale.
pub fn prefill(
    params: &SimParams,
    uncached_tokens: u32,
    running: u64,
    rng: &mut impl rand::Rng,
) -> Duration {
    let base = params
        .prefill_overhead
        .saturating_add(params.prefill_per_token.saturating_mul(uncached_tokens));
    let factor = slowdown(params, running) * jitter_factor(params.jitter, rng) * params.time_scale;
    scale(base, factor)
}

/// Time between two output tokens: inter_token_latency × slowdown × jitter × time_scale.
pub fn token_gap(params: &SimParams, running: u64, rng: &mut impl rand::Rng) -> Duration {
    let factor = slowdown(params, running) * jitter_factor(params.jitter, rng) * params.time_scale;
    scale(params.inter_token_latency, factor)
}

/// The factor one duration is multiplied by: `max(0.05, 1 + jitter × z)` with z approximately standard normal (Irwin–Hall: the sum of 12
/// uniforms minus 6) clamped to ±3. No jitter draws nothing, so exact runs leave the random stream
/// untouched.
pub fn jitter_factor(jitter: f64, rng: &mut impl rand::Rng) -> f64 {
    if !(jitter.is_finite() && jitter > 0.0) {
        return 1.0;
    }
    let sum: f64 = (0..12).map(|_| rng.random::<f64>()).sum();
    let z = (sum - 6.0).clamp(-MAX_DEVIATIONS, MAX_DEVIATIONS);
    (1.0 + jitter * z).max(MIN_JITTER_FACTOR)
}

/// `base × factor`, rounded to the nanosecond; NaN or negative → zero, too large → `Duration::MAX`.
fn scale(base: Duration, factor: f64) -> Duration {
    if factor == 1.0 {
        return base;
    }
    let nanos = base.as_nanos() as f64 * factor;
    if nanos.is_nan() || nanos <= 0.0 {
        return Duration::ZERO;
    }
    // Casting a float to an integer saturates; Duration::MAX needs more than u64 nanoseconds.
    let nanos = nanos.round() as u128;
    let Ok(secs) = u64::try_from(nanos / 1_000_000_000) else {
        return Duration::MAX;
    };
    let subsec = u32::try_from(nanos % 1_000_000_000).unwrap_or(0);
    Duration::new(secs, subsec)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn params() -> SimParams {
        SimParams {
            max_running: NonZeroU32::new(5).unwrap(),
            prefill_overhead: Duration::from_millis(10),
            prefill_per_token: Duration::from_micros(100),
            inter_token_latency: Duration::from_millis(20),
            load_slowdown: 3.0,
            jitter: 0.0,
            time_scale: 1.0,
            ..SimParams::default()
        }
    }

    #[test]
    fn exact_without_jitter() {
        let params = params();
        let mut rng = StdRng::seed_from_u64(7);
        assert_eq!(
            prefill(&params, 100, 1, &mut rng),
            Duration::from_millis(20)
        );
        assert_eq!(prefill(&params, 0, 0, &mut rng), Duration::from_millis(10));
        assert_eq!(token_gap(&params, 1, &mut rng), Duration::from_millis(20));
        // Three running of five: half way from 1 to 3.
        assert_eq!(
            prefill(&params, 100, 3, &mut rng),
            Duration::from_millis(40)
        );
        assert_eq!(token_gap(&params, 5, &mut rng), Duration::from_millis(60));
        // Nothing was drawn.
        let mut fresh = StdRng::seed_from_u64(7);
        assert_eq!(
            rand::Rng::random::<u64>(&mut rng),
            rand::Rng::random::<u64>(&mut fresh)
        );
    }

    #[test]
    fn slowdown_endpoints() {
        let params = params();
        assert_eq!(slowdown(&params, 0), 1.0);
        assert_eq!(slowdown(&params, 1), 1.0);
        assert_eq!(slowdown(&params, 2), 1.5);
        assert_eq!(slowdown(&params, 5), 3.0);
        assert_eq!(slowdown(&params, 500), 3.0);
        let single = SimParams {
            max_running: NonZeroU32::MIN,
            ..params.clone()
        };
        assert_eq!(slowdown(&single, 3), 1.0);
        let off = SimParams {
            load_slowdown: 1.0,
            ..params.clone()
        };
        assert_eq!(slowdown(&off, 5), 1.0);
        let broken = SimParams {
            load_slowdown: f64::NAN,
            ..params
        };
        assert_eq!(slowdown(&broken, 5), 1.0);
    }

    #[test]
    fn time_scale_scales_linearly() {
        let mut rng = StdRng::seed_from_u64(1);
        let fast = SimParams {
            time_scale: 0.01,
            ..params()
        };
        assert_eq!(prefill(&fast, 100, 1, &mut rng), Duration::from_micros(200));
        assert_eq!(token_gap(&fast, 1, &mut rng), Duration::from_micros(200));
        let slow = SimParams {
            time_scale: 2.5,
            ..params()
        };
        assert_eq!(token_gap(&slow, 1, &mut rng), Duration::from_millis(50));
        let stopped = SimParams {
            time_scale: 0.0,
            ..params()
        };
        assert_eq!(token_gap(&stopped, 1, &mut rng), Duration::ZERO);
    }

    #[test]
    fn jitter_averages_to_the_mean() {
        let jittery = SimParams {
            jitter: 0.2,
            ..params()
        };
        let mut rng = StdRng::seed_from_u64(42);
        let draws = 20_000;
        let samples: Vec<f64> = (0..draws)
            .map(|_| token_gap(&jittery, 1, &mut rng).as_secs_f64() / 0.02)
            .collect();
        let mean = samples.iter().sum::<f64>() / draws as f64;
        let variance = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / draws as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
        assert!(
            (variance.sqrt() - 0.2).abs() < 0.01,
            "sd {}",
            variance.sqrt()
        );
        assert!(
            samples
                .iter()
                .all(|s| (0.4 - 1e-6..=1.6 + 1e-6).contains(s))
        );
        // The same seed replays the same durations.
        let mut a = StdRng::seed_from_u64(3);
        let mut b = StdRng::seed_from_u64(3);
        assert_eq!(
            prefill(&jittery, 50, 2, &mut a),
            prefill(&jittery, 50, 2, &mut b)
        );
    }

    #[test]
    fn wide_jitter_keeps_a_floor() {
        let wild = SimParams {
            jitter: 0.5,
            ..params()
        };
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..2_000 {
            assert!(token_gap(&wild, 1, &mut rng) >= Duration::from_millis(1));
        }
    }

    #[test]
    fn extreme_values_saturate() {
        let mut rng = StdRng::seed_from_u64(0);
        let huge = SimParams {
            prefill_overhead: Duration::MAX,
            prefill_per_token: Duration::MAX,
            load_slowdown: f64::MAX,
            time_scale: f64::MAX,
            ..params()
        };
        assert_eq!(prefill(&huge, u32::MAX, 5, &mut rng), Duration::MAX);
        assert_eq!(token_gap(&huge, 5, &mut rng), Duration::MAX);
        let infinite = SimParams {
            time_scale: f64::INFINITY,
            ..params()
        };
        assert_eq!(token_gap(&infinite, 1, &mut rng), Duration::MAX);
        for time_scale in [f64::NAN, -1.0, f64::NEG_INFINITY] {
            let odd = SimParams {
                time_scale,
                jitter: f64::NAN,
                ..params()
            };
            assert_eq!(prefill(&odd, 10, 3, &mut rng), Duration::ZERO);
        }
        let zero_with_inf = SimParams {
            inter_token_latency: Duration::ZERO,
            time_scale: f64::INFINITY,
            ..params()
        };
        assert_eq!(token_gap(&zero_with_inf, 1, &mut rng), Duration::ZERO);
    }
}

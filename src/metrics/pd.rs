//! `cachepick_pd_*`: a prefill/decode pool's decode picks and prefill legs. The series of a pool exist
//! once it routed a PD request.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use crate::pd::Handoff;
use crate::policy::DecodeReason;

#[derive(Clone, Debug)]
pub struct PdMetrics {
    /// `cachepick_pd_decode_decisions_total{pool,reason}`.
    decode: IntCounterVec,
    /// `cachepick_pd_handoffs_total{pool,outcome}`.
    handoffs: IntCounterVec,
    /// `cachepick_pd_prefill_failures_total{pool}`.
    failures: IntCounterVec,
    /// `cachepick_pd_prefill_seconds{pool,outcome}`.
    prefill_seconds: HistogramVec,
}

impl PdMetrics {
    pub(super) fn new() -> Result<PdMetrics, prometheus::Error> {
        Ok(PdMetrics {
            decode: IntCounterVec::new(
                Opts::new(
                    "cachepick_pd_decode_decisions_total",
                    "Decode workers chosen in prefill/decode pools, by reason: decode_hit (the deepest \
                     decode worker holding the prefix, no more pressured than the sampled best), \
                     decode_pressure (the least pressured sampled worker), decode_capacity_fallback (no \
                     decode worker had room by its reading). The prefill worker's reason is in \
                     cachepick_decisions_total.",
                ),
                &["pool", "reason"],
            )?,
            handoffs: IntCounterVec::new(
                Opts::new(
                    "cachepick_pd_handoffs_total",
                    "Prefill legs of prefill/decode requests, by outcome: remote_prefill, \
                     remote_prefill_retried (the second prefill worker answered), or the decode worker \
                     prefilled locally: local_prefill_failed, local_prefill_no_params, \
                     local_prefill_saturated (pd.max_inflight_prefills), local_prefill_unreadable; or \
                     conditional disaggregation kept the request on its decode worker: \
                     local_prefill_short_suffix, local_prefill_owner_queued.",
                ),
                &["pool", "outcome"],
            )?,
            failures: IntCounterVec::new(
                Opts::new(
                    "cachepick_pd_prefill_failures_total",
                    "Prefill leg attempts that failed (unreachable, an error status, an unreadable \
                     answer, or the deadline).",
                ),
                &["pool"],
            )?,
            prefill_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "cachepick_pd_prefill_seconds",
                    "Time the prefill leg took, from its dispatch to the decode leg's answer to Envoy, \
                     by outcome: what a PD request waits before its decode worker starts.",
                )
                .buckets(prometheus::exponential_buckets(1e-3, 2.0, 16)?),
                &["pool", "outcome"],
            )?,
        })
    }

    pub(super) fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.decode.clone()))?;
        registry.register(Box::new(self.handoffs.clone()))?;
        registry.register(Box::new(self.failures.clone()))?;
        registry.register(Box::new(self.prefill_seconds.clone()))
    }

    pub fn record_decode(&self, pool: &str, reason: DecodeReason) {
        self.decode
            .with_label_values(&[pool, reason.as_str()])
            .inc();
    }

    /// An SGLang prefill leg, sent and not waited for, has ended: a failure is counted.
    pub fn record_leg_end(&self, pool: &str, ok: bool) {
        if !ok {
            self.failures.with_label_values(&[pool]).inc();
        }
    }

    /// One finished prefill leg and its failed attempts.
    pub fn record_handoff(&self, pool: &str, handoff: Handoff, failures: usize, seconds: f64) {
        self.handoffs
            .with_label_values(&[pool, handoff.as_str()])
            .inc();
        if failures > 0 {
            self.failures
                .with_label_values(&[pool])
                .inc_by(u64::try_from(failures).unwrap_or(u64::MAX));
        }
        self.prefill_seconds
            .with_label_values(&[pool, handoff.as_str()])
            .observe(seconds);
    }
}

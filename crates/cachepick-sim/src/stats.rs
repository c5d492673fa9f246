//! What a simulated rank reports: the state the engine's `/metrics` and `/v1/loads` expose. Filled in by
//! the model (`model::RankModel::stats`) and the server (latency histograms); rendered by `expo`.

/// One data-parallel rank's state and counters at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStats {
    pub rank: u32,
    /// Requests admitted and not finished (prefill or decode).
    pub running: u64,
    /// Requests in the FIFO queue.
    pub waiting: u64,
    /// Every request the rank holds, running or waiting. Equal to `running + waiting` but where the
    /// engine reports fewer (SGLang's `running` is its decode batch alone, so a prefill under way is
    /// in neither count).
    pub requests: u64,
    /// Uncached prompt tokens of the waiting requests, as far as the cache knows now (under the step
    /// model's SGLang, plus the prefill under way, as SGLang counts its chunked request).
    pub waiting_uncached_tokens: u64,
    /// Every token of the waiting requests, cached or not (SGLang's `num_total_tokens` adds them).
    pub waiting_tokens: u64,
    /// KV blocks occupied: held by running requests (pinned) plus blocks cached for reuse.
    pub kv_used_blocks: u64,
    /// KV blocks pinned by running requests: what engines report as used. vLLM's block pool and
    /// SGLang's radix cache both count a cached block nobody references as free (it is evictable), so
    /// a warm cache does not make a worker look full.
    pub kv_pinned_blocks: u64,
    pub kv_total_blocks: u64,
    pub block_size: u32,
    pub max_running: u64,
    /// Counters since start (or restart).
    pub counters: RankCounters,
    /// Model seconds the rank's GPU spent running steps (the step model; 0 under the slots model).
    pub busy_seconds: f64,
    /// Steps run (the step model).
    pub steps: u64,
    /// Wall seconds the rank's engine loop gave up because it fell too far behind its clock: nonzero
    /// means the machine could not keep the model's pace, and the run's timings are suspect.
    pub lagged_seconds: f64,
    /// Hit share of the latest prefill batch, SGLang's `cache_hit_rate` gauge; `None` reports the
    /// cumulative share instead (the slots model).
    pub last_prefill_hit_rate: Option<f64>,
    /// Latency histograms since start (or restart); bucket bounds in `LATENCY_BUCKETS`.
    pub ttft: Histogram,
    pub e2e: Histogram,
    /// vLLM V1's per-request histograms, observed when a request finishes
    /// (`vllm/v1/metrics/loggers.py`): the time from its arrival at the scheduler to its first
    /// scheduling, from then to its first token, and the prompt tokens its prefill computed (the
    /// prompt less what the cache held at its first lookup).
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub prefill_tokens: Histogram,
    /// When the worker's current run started, in seconds since the Unix epoch (0 when unknown): what
    /// the engines' `process_start_time_seconds` says, so a reader can tell a restart from a counter
    /// that went down.
    pub process_start_time: f64,
}

impl RankStats {
    /// KV usage in [0, 1] as engines report it: blocks pinned by requests over capacity (evictable
    /// cached blocks count as free).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            0.0
        } else {
            (self.kv_pinned_blocks as f64 / self.kv_total_blocks as f64).min(1.0)
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankCounters {
    /// Prompt tokens, counted as the engine counts them: under the step model vLLM's when a prompt's
    /// prefill completes, SGLang's when it is scheduled; under the slots model when it is admitted.
    pub prompt_tokens: u64,
    /// Output tokens produced.
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`).
    pub prefix_queried_tokens: u64,
    /// Prompt tokens found in the prefix cache (vLLM's `prefix_cache_hits`).
    pub prefix_hit_tokens: u64,
    /// Requests finished with all their tokens.
    pub finished_length: u64,
    /// Requests abandoned by their client before they finished.
    pub aborted: u64,
    /// Requests refused: full queue, too long, or an injected failure.
    pub rejected: u64,
    /// Cached blocks evicted to make room.
    pub evicted_blocks: u64,
    /// Running requests that lost their KV to make room (vLLM's recompute preemption, SGLang's
    /// retraction) and went back to the queue.
    pub preemptions: u64,
}

/// Upper bounds (seconds) of the latency histograms, as vLLM's TTFT buckets.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Upper bounds (seconds) of vLLM's per-request phase histograms (queue, prefill):
/// `REQUEST_LATENCY_BUCKETS` of `vllm/v1/metrics/buckets.py`.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Upper bounds of vLLM's per-request token histograms: the 1-2-5 series, which vLLM caps at the
/// model's context (`build_1_2_5_buckets`); the exposition leaves out the bounds above it.
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
    5e5, 1e6, 2e6, 5e6, 1e7,
];

/// A cumulative Prometheus histogram over a fixed list of bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    /// Observations at or below each bound, not cumulative; `counts.len() == bounds.len()` once
    /// anything was observed.
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

impl Default for Histogram {
    /// Over `LATENCY_BUCKETS`.
    fn default() -> Self {
        Histogram::over(LATENCY_BUCKETS)
    }
}

impl Histogram {
    pub fn over(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: Vec::new(),
            count: 0,
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        if self.counts.len() != self.bounds.len() {
            self.counts = vec![0; self.bounds.len()];
        }
        if let Some(slot) = self
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .and_then(|index| self.counts.get_mut(index))
        {
            *slot += 1;
        }
        self.count += 1;
        self.sum += value;
    }

    /// `(upper bound, cumulative count)` for every bucket, `+Inf` excluded (it is `count`).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        let mut running = 0;
        self.bounds.iter().enumerate().map(move |(index, bound)| {
            running += self.counts.get(index).copied().unwrap_or(0);
            (*bound, running)
        })
    }
}

/// `n` ranks with distinct, non-trivial numbers in every field: the fixture the tests of the
/// expositions share, the simulator's own and those that read them back with cachepick's readers
/// (`tests/sim.rs`), so both check the same numbers.
pub fn sample_ranks(n: u32) -> Vec<RankStats> {
    (0..n)
        .map(|rank| {
            let r = u64::from(rank);
            let mut stats = RankStats {
                rank,
                running: 3 + r,
                waiting: 7 * r + 1,
                waiting_uncached_tokens: 1000 + r,
                waiting_tokens: 1500 + 3 * r,
                kv_used_blocks: 300 + 17 * r,
                kv_pinned_blocks: 100,
                kv_total_blocks: 8192,
                block_size: 16,
                max_running: 64,
                counters: RankCounters {
                    prompt_tokens: 5000 + r,
                    generation_tokens: 900,
                    prefix_queried_tokens: 4000,
                    prefix_hit_tokens: 1000 * (r + 1),
                    finished_length: 40 + r,
                    aborted: r,
                    rejected: 0,
                    evicted_blocks: 0,
                    preemptions: 2 * r,
                },
                process_start_time: 1_764_500_000.25,
                ..RankStats::default()
            };
            for seconds in [0.0005, 0.03, 0.03, 0.7, 3.0, 5000.0] {
                stats.ttft.observe(seconds * (r as f64 + 1.0));
                stats.e2e.observe(seconds * 2.0);
            }
            stats
        })
        .collect()
}

//! The GPU a simulated rank runs on: how long one engine step takes, from what the scheduler packed into
//! it. Pure: a function of the profile and the step's shape.
//!
//! ```text
//! T_step = t0 + L(N) + a_attn · Σ_chunks [n·c + n(n+1)/2] + a_kv · Σ_decodes ctx + a_seq · S
//! L(N)   = (t_w^p + (τ·N)^p)^(1/p)
//! ```
//!
//! `N` is every token the step computes (prefill chunks and one per decode), a chunk of `n` new tokens
//! follows `c` tokens already in the KV cache, a decode reads its whole context `ctx`, and `S` is the
//! number of requests in the step. `L(N)` is the weight GEMMs: at small `N` the step still streams every
//! weight once (memory-bound, where decode sits), at large `N` it costs `τ` per token (compute-bound).
//! The attention term makes prefill super-linear, and a prefix hit does not remove the new tokens'
//! attention over the cached prefix. The KV term makes decode follow the summed context, not the
//! request count. Every request in a step sees the same duration: a long prefill chunk slows every
//! decode beside it.
//!
//! The named profiles' coefficients and their sources are listed in `crates/cachepick-sim/MODEL.md`.

/// The coefficients of one model on one GPU, in seconds (and tokens for the capacities).
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The profile's name, as the simulator's file and reports give it.
    pub name: String,
    /// `t0`: the step's fixed cost (scheduler, kernel launches, sampler).
    pub step_overhead: f64,
    /// `t_w`: reading every weight once, the floor of a step with few tokens.
    pub weight_read: f64,
    /// `τ`: compute per token once the GEMMs are compute-bound.
    pub per_token: f64,
    /// `p`: how sharply the weight-read floor turns into the per-token cost.
    pub blend: f64,
    /// `a_attn`: one (query, key) pair of prefill attention.
    pub attention_pair: f64,
    /// `a_kv`: reading one context token's KV in a decode step.
    pub kv_read: f64,
    /// `a_seq`: per request in the step.
    pub per_sequence: f64,
    /// `t_front`: the API server's HTTP parsing and tokenization before the scheduler sees a request.
    pub front: f64,
    /// The API server's one loop, which the work below shares in turn (FIFO): it tokenizes prompts (a
    /// single-thread executor, vLLM #25301), processes every step's outputs (vLLM #38157: "the entire
    /// server runs on a single asyncio event loop, and the output_handler ... saturates it") and
    /// answers `/metrics`, mounted on the same app. Seconds per prompt token tokenized.
    pub api_token: f64,
    /// Seconds of that loop per output token processed (detokenized and framed).
    pub api_output: f64,
    /// Seconds of that loop to render one `/metrics` answer.
    pub api_metrics: f64,
    /// KV blocks of 16 tokens the GPU holds for this model.
    pub kv_blocks: u32,
    /// vLLM's `max_num_batched_tokens` and `max_num_seqs` for the OpenAI server on this GPU.
    pub vllm_batch_tokens: u32,
    pub vllm_max_seqs: u32,
    /// SGLang's `chunked_prefill_size` and `max_prefill_tokens` on this GPU.
    pub sglang_chunk: u32,
    pub sglang_max_prefill: u32,
    /// KV bytes one token occupies on the whole worker: 2 (K and V) × layers × KV heads × head dim ×
    /// dtype bytes. What a prefill/decode transfer moves per token.
    pub kv_bytes_per_token: u64,
}

/// Llama-3.1-8B-Instruct, bf16, one H100 SXM 80GB: the default.
pub const LLAMA31_8B_H100: &str = "llama31-8b-h100-bf16";
/// Llama-3.1-8B-Instruct, bf16, one A100 SXM 80GB.
pub const LLAMA31_8B_A100: &str = "llama31-8b-a100-bf16";
/// Llama-3.1-70B, bf16, four H100s in tensor parallel: provisional (derived, no measured anchor).
pub const LLAMA31_70B_H100_TP4: &str = "llama31-70b-h100-tp4";

impl Profile {
    /// Every named profile, the default first.
    pub fn named() -> [Profile; 3] {
        [
            Profile::llama31_8b_h100(),
            Profile::llama31_8b_a100(),
            Profile::llama31_70b_h100_tp4(),
        ]
    }

    /// The named profile, or `None`.
    pub fn by_name(name: &str) -> Option<Profile> {
        Profile::named()
            .into_iter()
            .find(|profile| profile.name == name)
    }

    pub fn names() -> Vec<String> {
        Profile::named()
            .into_iter()
            .map(|profile| profile.name)
            .collect()
    }

    pub fn llama31_8b_h100() -> Profile {
        Profile {
            name: LLAMA31_8B_H100.to_owned(),
            step_overhead: 0.6e-3,
            weight_read: 6.5e-3,
            per_token: 21.2e-6,
            blend: 1.5,
            attention_pair: 1.06e-9,
            kv_read: 57e-9,
            per_sequence: 4.4e-6,
            front: 15e-3,
            api_token: 1.1e-6,
            api_output: 0.1e-3,
            api_metrics: 4.5e-3,
            kv_blocks: 29_205,
            vllm_batch_tokens: 8192,
            vllm_max_seqs: 1024,
            sglang_chunk: 8192,
            sglang_max_prefill: 16_384,
            // 2 × 32 layers × 8 KV heads × 128 × 2 bytes (bf16): 128 KiB.
            kv_bytes_per_token: 131_072,
        }
    }

    pub fn llama31_8b_a100() -> Profile {
        Profile {
            name: LLAMA31_8B_A100.to_owned(),
            weight_read: 10.4e-3,
            per_token: 66.5e-6,
            attention_pair: 3.05e-9,
            kv_read: 91e-9,
            vllm_batch_tokens: 2048,
            vllm_max_seqs: 256,
            ..Profile::llama31_8b_h100()
        }
    }

    pub fn llama31_70b_h100_tp4() -> Profile {
        Profile {
            name: LLAMA31_70B_H100_TP4.to_owned(),
            weight_read: 20.9e-3,
            per_token: 67e-6,
            attention_pair: 1.33e-9,
            kv_read: 36e-9,
            kv_blocks: 128_273,
            // 2 × 80 layers × 8 KV heads × 128 × 2 bytes (bf16): 320 KiB, over the four GPUs.
            kv_bytes_per_token: 327_680,
            ..Profile::llama31_8b_h100()
        }
    }

    /// `L(N)`: the weight GEMMs of a step computing `tokens` tokens.
    pub fn gemm(&self, tokens: u64) -> f64 {
        let compute = self.per_token * tokens as f64;
        let p = if self.blend.is_finite() && self.blend > 0.0 {
            self.blend
        } else {
            1.0
        };
        (self.weight_read.powf(p) + compute.powf(p)).powf(1.0 / p)
    }

    /// How long a step of this shape takes, in seconds; never negative or NaN.
    pub fn step_time(&self, work: &StepWork) -> f64 {
        let time = self.step_overhead
            + self.gemm(work.tokens)
            + self.attention_pair * work.attention_pairs
            + self.kv_read * work.decode_context as f64
            + self.per_sequence * work.sequences as f64;
        if time.is_finite() && time > 0.0 {
            time
        } else {
            0.0
        }
    }

    /// The attention pairs of a chunk of `new` tokens after `cached` tokens: each new token attends to
    /// the cached ones and, causally, to the chunk up to itself.
    pub fn chunk_pairs(new: u64, cached: u64) -> f64 {
        let n = new as f64;
        n * cached as f64 + n * (n + 1.0) / 2.0
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::llama31_8b_h100()
    }
}

/// What one step computes, as far as its duration depends on it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepWork {
    /// Tokens computed: every prefill chunk's plus one per decode.
    pub tokens: u64,
    /// Σ over prefill chunks of their (query, key) pairs ([`Profile::chunk_pairs`]).
    pub attention_pairs: f64,
    /// Σ over decoding requests of their context length.
    pub decode_context: u64,
    /// Requests in the step.
    pub sequences: u64,
}

impl StepWork {
    /// Adds a prefill chunk of `new` tokens after `cached`.
    pub fn chunk(&mut self, new: u64, cached: u64) {
        self.tokens = self.tokens.saturating_add(new);
        self.attention_pairs += Profile::chunk_pairs(new, cached);
        self.sequences = self.sequences.saturating_add(1);
    }

    /// Adds a decode over `context` tokens.
    pub fn decode(&mut self, context: u64) {
        self.tokens = self.tokens.saturating_add(1);
        self.decode_context = self.decode_context.saturating_add(context);
        self.sequences = self.sequences.saturating_add(1);
    }
}

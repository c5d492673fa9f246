//! Two routers that cannot be installed here, re-implemented as replay arms from their documented
//! selection rules, so their rows can sit beside cachepick's on the same fleet and workload. They are
//! re-implementations, labelled as such in every row (`… (re-impl)`), not the peers' code:
//!
//! - **llm-d "sticky until saturated"** (llm-d-router v0.10.0, `prefix-cache-affinity-filter` with
//!   the `token-load-scorer`): keep the endpoints whose prefix score (matched 64-token blocks ÷ the
//!   prompt's blocks) is at least 0.80, unless the best of them is predicted to start its prefill more
//!   than `maxTTFTPenaltyMs` (18 000 ms) later than the best other endpoint, the prediction being the
//!   endpoint's in-flight uncached tokens ÷ a calibrated peak prefill throughput; then take the
//!   highest `1 − min(1, (in-flight + this request's uncached tokens) / 4 Mi)`, ties at random. A
//!   request's uncached tokens are in flight from its dispatch to its first response chunk.
//! - **NVIDIA Dynamo's KV router** (`lib/kv-router` `DefaultWorkerSelector` at 8f6af06e, its defaults:
//!   overlap credit 1, credit decay 0, prefill load scale 1, temperature 0): the lowest
//!   `max(0, (active prefill tokens + prompt tokens) / block − overlap blocks) + active blocks`, ties at
//!   random. A request's uncached tokens are active prefill until its first token; its prompt's blocks
//!   are active until it ends, a prefix several active requests share counted once, and the active
//!   blocks include the request being placed.
//!
//! Both keep their load router-local, as the peers do (llm-d's in-flight producer lives in each EPP
//! process; Dynamo's replica sync is off by default): at `n` replicas each request goes to replica
//! `i mod n` and only that replica counts it. Both read the cache as an index fed by the engines' KV
//! events would, from the simulator's true state with no lag ([`Worker::cached_tokens`]) — the
//! freshest cache view either peer could have, so it can only flatter them. Neither sees the engines'
//! queues: neither rule reads them.
//!
//! The peak prefill throughput llm-d's operators calibrate is calibrated here the same way, once: the
//! profile's cold step of `batch_tokens` tokens, as a benchmark on the GPU would measure it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cachepick_sim::fleet::Fleet;
use cachepick_sim::server::Worker;
use cachepick_sim::step::profile::StepWork;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// llm-d's prefix blocks: the approximate producer's minimum, 64 tokens.
const LLMD_BLOCK: u64 = 64;
/// llm-d's `affinityThreshold`.
const LLMD_AFFINITY: f64 = 0.80;
/// llm-d's `maxTTFTPenaltyMs`, GPU time.
const LLMD_PENALTY: Duration = Duration::from_millis(18_000);
/// llm-d's token-load scorer saturates at 4 Mi in-flight tokens.
const LLMD_TOKEN_SCALE: f64 = 4_194_304.0;

/// A re-implemented peer's selection rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRule {
    LlmdSticky,
    DynamoKv,
}

impl PeerRule {
    /// Every rule, by the name `--peer` takes.
    pub const ALL: [(&'static str, PeerRule); 2] = [
        ("llm-d", PeerRule::LlmdSticky),
        ("dynamo", PeerRule::DynamoKv),
    ];

    pub fn parse(name: &str) -> Result<PeerRule, String> {
        PeerRule::ALL
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, rule)| *rule)
            .ok_or_else(|| {
                let known: Vec<&str> = PeerRule::ALL.iter().map(|(name, _)| *name).collect();
                format!("unknown peer `{name}`; known: {}", known.join(", "))
            })
    }

    /// The row label.
    pub fn label(self) -> &'static str {
        match self {
            PeerRule::LlmdSticky => "llm-d/sticky (re-impl)",
            PeerRule::DynamoKv => "dynamo/kv (re-impl)",
        }
    }
}

/// One worker as a rule sees it: what the cache holds of the prompt, and what this router replica has
/// sent it and not yet seen answered.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    pub cached_tokens: u64,
    /// Uncached prompt tokens sent and not yet at their first token.
    pub prefill_tokens: u64,
    /// Distinct KV blocks of the prompts sent and not yet ended, this request's included.
    pub active_blocks: u64,
}

/// The numbers a rule needs beyond the candidates, in the fleet's wall time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// The engines' KV block, tokens (Dynamo's `block_size`).
    pub block: u64,
    /// Peak prefill tokens per wall second of one worker (llm-d's `peakPrefillThroughput`).
    pub peak_tokens_per_s: f64,
    /// llm-d's `maxTTFTPenaltyMs` in wall time.
    pub penalty: Duration,
}

impl Calibration {
    /// From the fleet's profile, batch size and time scale.
    pub fn of(sim: &cachepick_sim::SimConfig) -> Calibration {
        let params = &sim.params;
        let batch = u64::from(params.batch_tokens.get());
        let mut work = StepWork::default();
        work.chunk(batch, 0);
        let step = params.profile.step_time(&work);
        let scale = if params.time_scale > 0.0 {
            params.time_scale
        } else {
            1.0
        };
        let model_rate = if step > 0.0 { batch as f64 / step } else { 1.0 };
        Calibration {
            block: u64::from(sim.block_size.get()).max(1),
            peak_tokens_per_s: model_rate / scale,
            penalty: LLMD_PENALTY.mul_f64(scale),
        }
    }
}

/// The candidate `rule` picks for a prompt of `prompt_tokens`; `tie` draws an index below its
/// argument among equally good ones. `None` when there is no candidate.
pub fn select(
    rule: PeerRule,
    candidates: &[Candidate],
    prompt_tokens: u64,
    calibration: &Calibration,
    tie: &mut dyn FnMut(usize) -> usize,
) -> Option<usize> {
    if candidates.is_empty() {
        return None;
    }
    let uncached = |c: &Candidate| prompt_tokens.saturating_sub(c.cached_tokens);
    let scores: Vec<f64> = match rule {
        PeerRule::LlmdSticky => {
            let kept = llmd_sticky(candidates, prompt_tokens, calibration);
            candidates
                .iter()
                .zip(&kept)
                .map(|(c, kept)| {
                    if *kept {
                        let load = (c.prefill_tokens + uncached(c)) as f64 / LLMD_TOKEN_SCALE;
                        1.0 - load.min(1.0)
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect()
        }
        PeerRule::DynamoKv => {
            let block = calibration.block as f64;
            candidates
                .iter()
                .map(|c| {
                    let raw = (c.prefill_tokens + prompt_tokens) as f64 / block;
                    let overlap = (c.cached_tokens / calibration.block) as f64;
                    // Lowest cost wins: negated so both rules take the highest score.
                    -((raw - overlap).max(0.0) + c.active_blocks as f64)
                })
                .collect()
        }
    };
    let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let tied: Vec<usize> = (0..)
        .zip(&scores)
        .filter(|(_, score)| **score == best)
        .map(|(index, _)| index)
        .collect();
    let pick = tie(tied.len()).min(tied.len().saturating_sub(1));
    tied.get(pick).copied()
}

/// llm-d's affinity filter: which candidates stay.
fn llmd_sticky(
    candidates: &[Candidate],
    prompt_tokens: u64,
    calibration: &Calibration,
) -> Vec<bool> {
    let blocks = prompt_tokens.div_ceil(LLMD_BLOCK).max(1);
    let sticky: Vec<bool> = candidates
        .iter()
        .map(|c| (c.cached_tokens / LLMD_BLOCK) as f64 / blocks as f64 >= LLMD_AFFINITY)
        .collect();
    let wait = |c: &Candidate| c.prefill_tokens as f64 / calibration.peak_tokens_per_s;
    let best = |want: bool| {
        candidates
            .iter()
            .zip(&sticky)
            .filter(|(_, s)| **s == want)
            .map(|(c, _)| wait(c))
            .fold(f64::INFINITY, f64::min)
    };
    let (best_sticky, best_other) = (best(true), best(false));
    let saturated =
        best_other.is_finite() && best_sticky - best_other > calibration.penalty.as_secs_f64();
    if best_sticky.is_infinite() || saturated {
        vec![true; candidates.len()]
    } else {
        sticky
    }
}

/// What one router replica has sent one worker and not yet seen answered.
#[derive(Clone, Debug, Default)]
pub(super) struct Load {
    prefill_tokens: u64,
    /// The active prompts' blocks by chained hash, with how many active prompts hold each: a prefix
    /// that several running requests share is one set of blocks, as Dynamo's active-sequence tracker
    /// counts it.
    active_blocks: HashMap<u64, u32>,
}

impl Load {
    /// A request routed here: its uncached prompt tokens in flight, its blocks active.
    pub(super) fn add(&mut self, prefill_tokens: u64, blocks: &[u64]) {
        self.prefill_tokens += prefill_tokens;
        for hash in blocks {
            *self.active_blocks.entry(*hash).or_default() += 1;
        }
    }

    /// Takes back what [`add`](Self::add) added (its prefill at the first token, its blocks at its end).
    pub(super) fn release(&mut self, prefill_tokens: u64, blocks: &[u64]) {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(prefill_tokens);
        for hash in blocks {
            if let Some(count) = self.active_blocks.get_mut(hash) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.active_blocks.remove(hash);
                }
            }
        }
    }

    /// The uncached prompt tokens in flight.
    pub(super) fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    /// Active blocks with `blocks` added.
    pub(super) fn blocks_with(&self, blocks: &[u64]) -> u64 {
        let new = blocks
            .iter()
            .filter(|hash| !self.active_blocks.contains_key(hash))
            .count();
        (self.active_blocks.len() + new) as u64
    }
}

/// A prompt's blocks of `block` tokens as chained hashes: equal only where the prompts agree up to the
/// block's end. The rig's own hashing; it shares none with the picker or the simulator.
pub(super) fn chained_blocks(tokens: &[u32], block: u64) -> Vec<u64> {
    let size = usize::try_from(block).unwrap_or(usize::MAX).max(1);
    let mut parent = 0_u64;
    tokens
        .chunks(size)
        .map(|chunk| {
            let mut hasher = std::hash::DefaultHasher::new();
            (parent, chunk).hash(&mut hasher);
            parent = hasher.finish();
            parent
        })
        .collect()
}

/// One router replica's loads, worker by worker.
type Local = Vec<Load>;

/// A re-implemented peer in front of one arm's fleet, with `replicas` router replicas.
pub struct PeerRouter {
    fleet: Arc<Fleet>,
    rule: PeerRule,
    calibration: Calibration,
    replicas: Vec<Mutex<Local>>,
    next: AtomicUsize,
    rng: Mutex<SmallRng>,
}

/// Where a peer sends a request. It holds the request's load on its replica until it is dropped;
/// [`Ticket::first_token`] ends the prefill part.
pub struct Ticket {
    router: Arc<PeerRouter>,
    pub worker: SocketAddr,
    pub cached_tokens: u64,
    replica: usize,
    index: usize,
    prefill_tokens: u64,
    /// The prompt's blocks while they count as active (Dynamo's rule only).
    blocks: Vec<u64>,
}

impl PeerRouter {
    pub fn new(fleet: Arc<Fleet>, rule: PeerRule, replicas: usize, seed: u64) -> PeerRouter {
        let workers = fleet.workers().len();
        let calibration = Calibration::of(fleet.config());
        PeerRouter {
            fleet,
            rule,
            calibration,
            replicas: (0..replicas.max(1))
                .map(|_| Mutex::new(vec![Load::default(); workers]))
                .collect(),
            next: AtomicUsize::new(0),
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
        }
    }

    pub fn rule(&self) -> PeerRule {
        self.rule
    }

    /// Routes a completion whose prompt is `text` on the next replica; `None` when no worker is up
    /// or the prompt cannot be tokenized.
    pub fn choose(self: &Arc<Self>, text: &str) -> Option<Ticket> {
        let tokens = self.fleet.tokenize(text).ok()?;
        let prompt_tokens = tokens.len() as u64;
        let replica = self.next.fetch_add(1, Ordering::Relaxed) % self.replicas.len();
        let workers: Vec<(usize, &Worker)> = self
            .fleet
            .workers()
            .iter()
            .enumerate()
            .filter(|(_, worker)| worker.is_up())
            .collect();
        let cached: Vec<u64> = workers
            .iter()
            .map(|(_, worker)| {
                worker
                    .cached_tokens(&tokens)
                    .into_iter()
                    .max()
                    .map_or(0, u64::from)
            })
            .collect();
        let blocks = match self.rule {
            PeerRule::DynamoKv => chained_blocks(&tokens, self.calibration.block),
            PeerRule::LlmdSticky => Vec::new(),
        };
        let mut local = lock(self.replicas.get(replica)?);
        let candidates: Vec<Candidate> = workers
            .iter()
            .zip(&cached)
            .map(|((index, _), cached)| {
                let (prefill_tokens, active_blocks) = local.get(*index).map_or((0, 0), |load| {
                    (load.prefill_tokens, load.blocks_with(&blocks))
                });
                Candidate {
                    cached_tokens: *cached,
                    prefill_tokens,
                    active_blocks,
                }
            })
            .collect();
        let mut rng = lock(&self.rng);
        let picked = select(
            self.rule,
            &candidates,
            prompt_tokens,
            &self.calibration,
            &mut |n| rng.random_range(0..n.max(1)),
        )?;
        drop(rng);
        let (index, worker) = *workers.get(picked)?;
        let cached_tokens = *cached.get(picked)?;
        let prefill_tokens = prompt_tokens.saturating_sub(cached_tokens);
        local.get_mut(index)?.add(prefill_tokens, &blocks);
        Some(Ticket {
            router: Arc::clone(self),
            worker: worker.addr(),
            cached_tokens,
            replica,
            index,
            prefill_tokens,
            blocks,
        })
    }
}

impl Ticket {
    /// The first response chunk arrived: the request's prefill is no longer in flight.
    pub fn first_token(&mut self) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        self.release(tokens, &[]);
    }

    fn release(&self, prefill_tokens: u64, blocks: &[u64]) {
        let Some(replica) = self.router.replicas.get(self.replica) else {
            return;
        };
        if let Some(load) = lock(replica).get_mut(self.index) {
            load.release(prefill_tokens, blocks);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.release(self.prefill_tokens, &blocks);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_active_once() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let (ha, hb) = (chained_blocks(&a, 16), chained_blocks(&b, 16));
        assert_eq!(
            (ha.len(), &ha[..2]),
            (4, &hb[..2]),
            "the first 32 tokens agree"
        );
        assert_ne!(ha[2..], hb[2..]);
        let mut load = Load::default();
        assert_eq!(load.blocks_with(&ha), 4);
        for hash in &ha {
            *load.active_blocks.entry(*hash).or_default() += 1;
        }
        assert_eq!(
            load.blocks_with(&ha),
            4,
            "the same prompt again adds nothing"
        );
        assert_eq!(load.blocks_with(&hb), 6, "two blocks shared, two new");
    }

    fn calibration() -> Calibration {
        Calibration {
            block: 16,
            peak_tokens_per_s: 10_000.0,
            penalty: Duration::from_secs(18),
        }
    }

    fn first(_: usize) -> usize {
        0
    }

    fn cand(cached: u64, prefill: u64, blocks: u64) -> Candidate {
        Candidate {
            cached_tokens: cached,
            prefill_tokens: prefill,
            active_blocks: blocks,
        }
    }

    #[test]
    fn dynamo_picks_the_guides_worked_example() {
        // docs/router/router_guide.md: a 10-block prompt; W1 overlaps 2 blocks with 10 active
        // (8 + 10 = 18), W2 5 with 5 (10), W3 8 with 9 (11): W2.
        let candidates = [cand(32, 0, 10), cand(80, 0, 5), cand(128, 0, 9)];
        let picked = select(
            PeerRule::DynamoKv,
            &candidates,
            160,
            &calibration(),
            &mut first,
        );
        assert_eq!(picked, Some(1));
    }

    #[test]
    fn dynamo_prices_a_workers_active_prefill() {
        // The same overlap, but 20 blocks of prefill already active on the first.
        let candidates = [cand(160, 320, 0), cand(0, 0, 0)];
        let picked = select(
            PeerRule::DynamoKv,
            &candidates,
            160,
            &calibration(),
            &mut first,
        );
        assert_eq!(picked, Some(1), "20 + 10 − 10 = 20 blocks against 10");
        let idle = [cand(160, 0, 0), cand(0, 0, 0)];
        assert_eq!(
            select(PeerRule::DynamoKv, &idle, 160, &calibration(), &mut first),
            Some(0)
        );
    }

    #[test]
    fn llmd_stays_with_the_owner_until_its_wait_exceeds_the_penalty() {
        // The owner holds 9 of 10 64-token blocks (0.9 ≥ 0.8); the other holds nothing.
        let prompt = 640;
        // 170k tokens in flight at 10k/s: 17 s behind, within the 18 s penalty — sticky, although the
        // token-load score alone would prefer the idle worker.
        let within = [cand(576, 170_000, 0), cand(0, 0, 0)];
        assert_eq!(
            select(
                PeerRule::LlmdSticky,
                &within,
                prompt,
                &calibration(),
                &mut first
            ),
            Some(0)
        );
        // 190k: 19 s behind — stickiness breaks and the token load decides.
        let beyond = [cand(576, 190_000, 0), cand(0, 0, 0)];
        assert_eq!(
            select(
                PeerRule::LlmdSticky,
                &beyond,
                prompt,
                &calibration(),
                &mut first
            ),
            Some(1)
        );
    }

    #[test]
    fn llmd_without_a_sticky_endpoint_scores_every_one_by_token_load() {
        // 0.7 of the prompt cached is below the threshold: both are scored, and the lighter load
        // (in flight + this request's uncached tokens) wins.
        let candidates = [cand(448, 0, 0), cand(0, 100, 0)];
        assert_eq!(
            select(
                PeerRule::LlmdSticky,
                &candidates,
                640,
                &calibration(),
                &mut first
            ),
            Some(0),
            "192 uncached against 740"
        );
        let loaded = [cand(448, 1_000, 0), cand(0, 100, 0)];
        assert_eq!(
            select(
                PeerRule::LlmdSticky,
                &loaded,
                640,
                &calibration(),
                &mut first
            ),
            Some(1)
        );
    }

    #[test]
    fn ties_are_drawn_among_the_equally_good_only() {
        let candidates = [cand(0, 5, 0), cand(0, 0, 0), cand(0, 0, 0)];
        for rule in [PeerRule::LlmdSticky, PeerRule::DynamoKv] {
            let mut offered = 0;
            let picked = select(rule, &candidates, 100, &calibration(), &mut |n| {
                offered = n;
                n - 1
            });
            assert_eq!((offered, picked), (2, Some(2)), "{rule:?}");
        }
        assert_eq!(
            select(PeerRule::DynamoKv, &[], 100, &calibration(), &mut first),
            None
        );
    }

    #[test]
    fn the_calibration_is_the_profiles_cold_batch_in_wall_time() {
        let mut sim = cachepick_sim::SimConfig::new(
            cachepick_sim::Engine::Vllm,
            std::num::NonZeroU32::new(2).unwrap(),
        );
        let fast = Calibration::of(&sim);
        sim.params.time_scale = 0.25;
        let scaled = Calibration::of(&sim);
        assert!((scaled.peak_tokens_per_s / fast.peak_tokens_per_s - 4.0).abs() < 1e-9);
        assert_eq!(scaled.penalty, Duration::from_millis(4_500));
        // An H100 computes a cold 8k batch at tens of thousands of tokens a second.
        assert!(
            (10_000.0..100_000.0).contains(&fast.peak_tokens_per_s),
            "{}",
            fast.peak_tokens_per_s
        );
    }
}

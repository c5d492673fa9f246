//! The request path, from body to decision: shared by the ext_proc server and `cachepick explain`.
//!
//! [`Picker::prepare`] parses the body, chooses the pool, tokenizes the prompt, hashes its full blocks
//! and asks the pool's owner index who holds them. [`Picker::decide`] runs the policy on the pool's
//! current snapshot. [`Picker::commit`] then records the decision synchronously — the selected worker
//! now holds the prompt's blocks, and one more request is in flight there — so that a burst of identical
//! prompts sees the first one's placement instead of all landing on the same idle worker.
//!
//! Each pool runs its own policy (`PoolConfig::policy`). The policy keeps no state, so a `round_robin`
//! pool's turn comes from here: a per-pool counter, advanced once per decision.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rand::Rng;
use serde::Serialize;
use thiserror::Error;

use crate::config::{Config, Mode, PoolConfig};
use crate::load::PoolLoad;
use crate::policy::{
    self, Decision, LoadView, Outcome, OwnerMatch, Reject, RejectReason, RequestFacts, Trace,
};
use crate::prefix::{OwnerIndex, block_hashes, prefix_seed};
use crate::request::{self, BodyError, Prompt};
use crate::tokenize::{ChatTurn, PoolTokenizer, TokenizeError};
use crate::worker::WorkerId;

/// Why a request cannot be routed before the policy even runs.
#[derive(Debug, Error)]
pub enum RequestError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(#[from] TokenizeError),
}

impl RequestError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> u16 {
        match self {
            RequestError::Body(error) => error.status(),
            // A template that cannot render this chat, or tools that are not JSON, are the request's
            // doing; a tokenizer failing on text is ours.
            RequestError::Tokenize(TokenizeError::Render { .. } | TokenizeError::Tools(_)) => 400,
            RequestError::Tokenize(_) => 500,
        }
    }

    /// A stable label for metrics and the JSON error `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::Body(error) => error.kind(),
            RequestError::Tokenize(TokenizeError::Render { .. } | TokenizeError::Tools(_)) => {
                "untokenizable"
            }
            RequestError::Tokenize(_) => "tokenizer_failed",
        }
    }
}

/// Why the picker cannot start.
#[derive(Debug, Error)]
pub enum PickerError {
    #[error("pool {pool}: {source}")]
    Tokenizer {
        pool: String,
        #[source]
        source: TokenizeError,
    },
}

/// One pool's runtime: its configuration, load, tokenizer and owner index.
struct PoolRoute {
    load: Arc<PoolLoad>,
    tokenizer: PoolTokenizer,
    index: OwnerIndex,
    /// Decisions taken so far under `round_robin`: the next request's turn.
    sequence: AtomicU64,
}

/// Everything the policy needs about one request, computed once.
#[derive(Clone, Debug, Serialize)]
pub struct Prepared {
    /// Index of the pool in the configuration.
    pub pool: usize,
    pub pool_label: String,
    pub model: Option<String>,
    pub prompt_tokens: u64,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<u64>,
    /// Every worker holding at least one leading block, deepest first.
    pub owners: Vec<OwnerMatch>,
}

/// What `cachepick explain` and the debug endpoints report about one request body.
#[derive(Debug, Serialize)]
pub struct Explanation {
    pub prepared: Prepared,
    pub block_size: u32,
    /// The decision the picker would make now (nothing is committed).
    pub outcome: Outcome,
    /// Endpoints by worker id, so the outcome's ids can be read.
    pub endpoints: Vec<String>,
}

/// The request path for every pool of a configuration.
pub struct Picker {
    /// The pools' configurations, index-aligned with `pools`.
    configs: Vec<PoolConfig>,
    pools: Vec<PoolRoute>,
    max_body_bytes: usize,
}

impl Picker {
    /// Loads every pool's tokenizer and creates empty owner indexes sized by the workers' capacities.
    /// `loads` are the pools' shared load states, in configuration order.
    pub fn new(config: &Config, loads: &[Arc<PoolLoad>]) -> Result<Self, PickerError> {
        let pools = config
            .pools
            .iter()
            .zip(loads)
            .map(|(pool, load)| {
                let tokenizer =
                    PoolTokenizer::new(pool).map_err(|source| PickerError::Tokenizer {
                        pool: load.label().to_owned(),
                        source,
                    })?;
                let snapshot = load.snapshot();
                let capacities: Vec<usize> = snapshot
                    .workers()
                    .iter()
                    .map(|worker| capacity_blocks(pool, worker.capacity.max_total_tokens))
                    .collect();
                Ok(PoolRoute {
                    load: Arc::clone(load),
                    tokenizer,
                    index: OwnerIndex::new(&capacities),
                    sequence: AtomicU64::new(0),
                })
            })
            .collect::<Result<_, PickerError>>()?;
        Ok(Picker {
            configs: config.pools.clone(),
            pools,
            max_body_bytes: config.max_body_bytes.get(),
        })
    }

    /// Body → pool, tokens, block hashes and owners.
    pub fn prepare(&self, path: &str, body: &[u8]) -> Result<Prepared, RequestError> {
        let parsed = request::parse(path, body, self.max_body_bytes)?;
        let (pool_index, config) = request::select_pool(&self.configs, parsed.model.as_deref())?;
        let Some(pool) = self.pools.get(pool_index) else {
            return Err(RequestError::Body(BodyError::MissingModel));
        };
        let tokens: Cow<'_, [u32]> = match &parsed.prompt {
            Prompt::Chat { messages, tools } => {
                let turns: Vec<ChatTurn<'_>> = messages
                    .iter()
                    .map(|message| ChatTurn {
                        role: &message.role,
                        parts: &message.content,
                    })
                    .collect();
                Cow::Owned(untokenized_as_empty(
                    pool.tokenizer
                        .tokens_for_chat(&turns, tools.map(|raw| raw.get())),
                )?)
            }
            Prompt::Text(text) => {
                Cow::Owned(untokenized_as_empty(pool.tokenizer.tokens_for_text(text))?)
            }
            Prompt::Tokens(tokens) => Cow::Borrowed(tokens.as_slice()),
        };
        let model = parsed.model.as_deref().unwrap_or(pool.load.label());
        let seed = prefix_seed(model, parsed.cache_salt.as_deref());
        let hashes = block_hashes(seed, &tokens, config.block_size);
        let owners = pool.index.matches(&hashes, config.block_size);
        Ok(Prepared {
            pool: pool_index,
            pool_label: pool.load.label().to_owned(),
            model: parsed.model.map(Cow::into_owned),
            prompt_tokens: tokens.len() as u64,
            block_hashes: hashes,
            owners,
        })
    }

    /// A request without a prompt (a GET, or a POST to a non-generation API): the pool `model` names,
    /// else the default pool (`*`), else the first; no tokens and so no owners.
    pub fn prepare_passthrough(&self, model: Option<&str>) -> Result<Prepared, RequestError> {
        let pool_index = match request::select_pool(&self.configs, model) {
            Ok((index, _)) => index,
            Err(error @ BodyError::UnknownModel { .. }) => return Err(error.into()),
            Err(_) => 0,
        };
        let Some(pool) = self.pools.get(pool_index) else {
            return Err(RequestError::Body(BodyError::MissingModel));
        };
        Ok(Prepared {
            pool: pool_index,
            pool_label: pool.load.label().to_owned(),
            model: model.map(str::to_owned),
            prompt_tokens: 0,
            block_hashes: Vec::new(),
            owners: Vec::new(),
        })
    }

    /// The workers of `pool` whose endpoints are in `subset` (the proxy's hint), in id order.
    pub fn workers_in(&self, pool: usize, subset: &[std::net::SocketAddr]) -> Vec<WorkerId> {
        self.pools.get(pool).map_or_else(Vec::new, |pool| {
            pool.load
                .snapshot()
                .workers()
                .iter()
                .filter(|worker| subset.contains(&worker.endpoint))
                .map(|worker| worker.id)
                .collect()
        })
    }

    /// The endpoint of worker `id` of `pool`.
    pub fn endpoint(&self, pool: usize, id: WorkerId) -> Option<std::net::SocketAddr> {
        let pool = self.pools.get(pool)?;
        pool.load
            .snapshot()
            .worker(id)
            .map(|worker| worker.endpoint)
    }

    /// The pool's prefix block size in tokens (0 for an unknown pool).
    pub fn block_size(&self, pool: usize) -> u32 {
        self.configs
            .get(pool)
            .map_or(0, |pool| pool.block_size.get())
    }

    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// Every pool's owner-index statistics, by pool label.
    pub fn index_stats(&self) -> Vec<(String, crate::prefix::IndexStats)> {
        self.pools
            .iter()
            .map(|pool| (pool.load.label().to_owned(), pool.index.stats()))
            .collect()
    }

    /// How `body` would be routed now, on the live owner index and load, without committing anything.
    pub fn explain<R: Rng + ?Sized>(
        &self,
        path: &str,
        body: &[u8],
        rng: &mut R,
    ) -> Result<Explanation, RequestError> {
        let prepared = self.prepare(path, body)?;
        // Looks at the next turn without taking it: explaining routes nothing.
        let outcome = self.decide_in_turn(&prepared, None, Instant::now(), false, rng);
        let config = self.configs.get(prepared.pool);
        Ok(Explanation {
            block_size: config.map_or(0, |pool| pool.block_size.get()),
            endpoints: config
                .map(|pool| {
                    pool.workers
                        .iter()
                        .map(|worker| worker.endpoint.to_string())
                        .collect()
                })
                .unwrap_or_default(),
            prepared,
            outcome,
        })
    }

    /// Runs the pool's policy for a prepared request on its pool's current snapshot. Under `round_robin`
    /// this takes the pool's next turn.
    pub fn decide<R: Rng + ?Sized>(
        &self,
        prepared: &Prepared,
        allowed: Option<&[WorkerId]>,
        now: Instant,
        rng: &mut R,
    ) -> Outcome {
        self.decide_in_turn(prepared, allowed, now, true, rng)
    }

    /// `decide`; `take_turn` false peeks at the round-robin turn instead of advancing it.
    fn decide_in_turn<R: Rng + ?Sized>(
        &self,
        prepared: &Prepared,
        allowed: Option<&[WorkerId]>,
        now: Instant,
        take_turn: bool,
        rng: &mut R,
    ) -> Outcome {
        let (Some(pool), Some(config)) = (
            self.pools.get(prepared.pool),
            self.configs.get(prepared.pool),
        ) else {
            // `prepare` only names pools that exist; a foreign `Prepared` has no workers here.
            return Outcome::Reject(Reject {
                reason: RejectReason::NoWorkers,
                trace: Trace::default(),
            });
        };
        let snapshot = pool.load.snapshot();
        let view = LoadView {
            snapshot: &snapshot,
            dispatches: pool.load.dispatches(),
            now,
        };
        // Only round robin reads the sequence; other pools leave the counter alone.
        let sequence = match config.policy.mode {
            Mode::RoundRobin if take_turn => pool.sequence.fetch_add(1, Ordering::Relaxed),
            Mode::RoundRobin => pool.sequence.load(Ordering::Relaxed),
            _ => 0,
        };
        let facts = RequestFacts {
            prompt_tokens: prepared.prompt_tokens,
            allowed,
            sequence,
        };
        policy::decide(&facts, &prepared.owners, &view, &config.policy, rng)
    }

    /// Records a routed request: its blocks now live on the selected worker, and one more request is in
    /// flight there.
    pub fn commit(&self, prepared: &Prepared, decision: &Decision) {
        let (Some(pool), Some(config)) = (
            self.pools.get(prepared.pool),
            self.configs.get(prepared.pool),
        ) else {
            return;
        };
        let snapshot = pool.load.snapshot();
        // A worker the current roster no longer routes to gets nothing recorded, so a decision made just
        // before its removal cannot bring its blocks back.
        let Some(worker) = snapshot
            .worker(decision.selected)
            .filter(|worker| worker.routable)
        else {
            return;
        };
        let capacity = capacity_blocks(config, worker.capacity.max_total_tokens);
        pool.index.set_capacity(decision.selected, capacity);
        pool.index.insert(decision.selected, &prepared.block_hashes);
        pool.load.dispatches().record(decision.selected);
    }

    /// The pools' shared load states, in configuration order.
    pub fn loads(&self) -> impl Iterator<Item = &Arc<PoolLoad>> {
        self.pools.iter().map(|pool| &pool.load)
    }
}

/// A prompt the tokenizer itself fails on (a regex backtracking limit on a megabyte of whitespace, say)
/// is still a servable request: it is routed without prefix information, as a miss, rather than refused.
/// Failures that are the request's fault (a chat the template cannot render) stay errors.
fn untokenized_as_empty(
    tokens: Result<Vec<u32>, TokenizeError>,
) -> Result<Vec<u32>, TokenizeError> {
    match tokens {
        Err(TokenizeError::Encode(error)) => {
            // One line in 64: a client can send such prompts on purpose.
            static FAILURES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            if FAILURES
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                .is_multiple_of(64)
            {
                tracing::warn!(%error, "the tokenizer failed on a prompt; routed without prefix information (logged 1 in 64)");
            }
            Ok(Vec::new())
        }
        other => other,
    }
}

/// A worker's capacity in our blocks: the engine's KV tokens divided by our block size, else the pool's
/// configured default.
fn capacity_blocks(pool: &PoolConfig, max_total_tokens: Option<u64>) -> usize {
    let block: u64 = NonZeroU32::get(pool.block_size).into();
    max_total_tokens
        .map(|tokens| usize::try_from(tokens / block).unwrap_or(usize::MAX).max(1))
        .unwrap_or(pool.default_cache_blocks.get())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::config::Overrides;
    use crate::policy::Reason;

    /// Pool `rr` runs round robin over three workers; pool `ca` inherits the top-level cache_aware.
    fn picker() -> Picker {
        let yaml = "\
policy: {min_match_tokens: 4}
pools:
  - model: rr
    engine: vllm
    tokenizer: {kind: bytes}
    policy: {mode: round_robin}
    workers:
      - endpoint: 127.0.0.1:1
      - endpoint: 127.0.0.1:2
      - endpoint: 127.0.0.1:3
  - model: ca
    engine: vllm
    tokenizer: {kind: bytes}
    workers:
      - endpoint: 127.0.0.1:4
      - endpoint: 127.0.0.1:5
";
        let config = crate::config::parse(yaml, "t", &Overrides::default()).unwrap();
        let loads: Vec<Arc<PoolLoad>> = config
            .pools
            .iter()
            .map(|pool| PoolLoad::new(pool, &config.load))
            .collect();
        Picker::new(&config, &loads).unwrap()
    }

    fn body(model: &str) -> Vec<u8> {
        let prompt = "the same prompt, long enough for a few blocks ".repeat(40);
        serde_json::to_vec(&serde_json::json!({"model": model, "prompt": prompt})).unwrap()
    }

    /// Routes and commits; (worker, reason).
    fn route(picker: &Picker, model: &str, rng: &mut SmallRng) -> (u32, Reason) {
        let prepared = picker.prepare("/v1/completions", &body(model)).unwrap();
        let Outcome::Route(decision) = picker.decide(&prepared, None, Instant::now(), rng) else {
            panic!("rejected")
        };
        picker.commit(&prepared, &decision);
        (decision.selected.0, decision.reason)
    }

    #[test]
    fn each_pool_runs_its_own_mode_and_round_robin_takes_one_turn_per_decision() {
        let picker = picker();
        let mut rng = SmallRng::seed_from_u64(1);
        let rr: Vec<_> = (0..4).map(|_| route(&picker, "rr", &mut rng)).collect();
        assert_eq!(
            rr,
            [
                (0, Reason::RoundRobin),
                (1, Reason::RoundRobin),
                (2, Reason::RoundRobin),
                (0, Reason::RoundRobin),
            ],
            "the same prompt each time: round robin ignores the owner it just made"
        );
        // The other pool's decisions do not move the turn, and follow the prefix.
        let first = route(&picker, "ca", &mut rng);
        assert_eq!(first.1, Reason::CacheMiss);
        assert_eq!(route(&picker, "ca", &mut rng), (first.0, Reason::CacheHit));
        // Explaining looks at the next turn without taking it.
        for _ in 0..2 {
            let explained = picker
                .explain("/v1/completions", &body("rr"), &mut rng)
                .unwrap();
            let decision = explained.outcome.decision().unwrap();
            assert_eq!(decision.selected.0, 1);
            assert_eq!(decision.trace.sequence, Some(4));
        }
        assert_eq!(route(&picker, "rr", &mut rng), (1, Reason::RoundRobin));
    }
}

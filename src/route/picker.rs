//! The picker: body → pool → tokens → block hashes → owners, then the policy and the commit, all on one
//! snapshot of the pool's load.
//!
//! [`Picker::prepare`] parses the body, chooses the pool, tokenizes the prompt, hashes its full blocks
//! and asks the pool's owner index who holds them. [`Picker::pin`] then takes the pool's current load
//! snapshot once, and every later step of the request reads that one: [`Pinned::workers_in`] maps the
//! proxy's subset hint, [`Pinned::decide`] runs the policy, [`Pinned::commit`] records the decision
//! synchronously — the selected worker now holds the prompt's blocks, and one more request is in flight
//! there — so that a burst of identical prompts sees the first one's placement instead of all landing
//! on the same idle worker — and [`Pinned::endpoints`] names the chosen workers.
//!
//! Each pool runs its own policy (`PoolConfig::policy`). The policy keeps no state, so a `round_robin`
//! pool's turn comes from here: a per-pool counter, advanced once per decision.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use rand::Rng;
use thiserror::Error;

use super::admission::BodyBudget;
use super::credit::Credit;
use super::index::{
    self, ChainStart, Feeds, Placement, PoolIndex, capacity_blocks, credited_chain,
};
use super::prepared::Prepared;
use crate::config::{Config, Mode, PolicyConfig, PoolConfig, UnknownSubset, WorkerConfig};
use crate::events::EventFeeds;
use crate::load::{PoolLoad, PoolSnapshot, RosterObserver};
use crate::policy::{self, Decision, LoadView, Outcome, RequestFacts};
use crate::prefix::{EventIndex, IndexStats, SourcedMatch, block_hashes};
use crate::protocol::RefusalReason;
use crate::request::{self, ApiPath, BodyError, Prompt, ReadBody};
use crate::tokenize::{Chat, ChatTurn, PoolTokenizer, Stop, TokenizeError};
use crate::worker::WorkerId;

/// What one decision's tokenizing may spend: the stop it asks between bounded chunks of work, and the
/// budget its memory is charged to while it runs (none: uncharged, for tools and explain).
#[derive(Clone, Debug, Default)]
pub struct Allowance {
    pub stop: Stop,
    pub budget: Option<Arc<BodyBudget>>,
}

/// Why a request cannot be routed before the policy even runs.
#[derive(Debug, Error)]
pub enum RequestError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(#[from] TokenizeError),
}

impl RequestError {
    /// Why the request is refused: the status and stable label it answers with.
    pub fn reason(&self) -> RefusalReason {
        match self {
            RequestError::Body(error) => error.reason(),
            // A template that cannot render this chat, or tools that are not JSON, are the request's
            // doing; a tokenizer failing on text is ours.
            RequestError::Tokenize(TokenizeError::Render { .. } | TokenizeError::Tools(_)) => {
                RefusalReason::Untokenizable
            }
            RequestError::Tokenize(_) => RefusalReason::TokenizerFailed,
        }
    }

    /// What the client is told. A body error describes the client's own bytes. A tokenizer or template
    /// error names the server's files and carries the template's exception text, so the client gets the
    /// reason alone; the details go to the log (`Service` logs them).
    pub fn client_message(&self) -> String {
        match self {
            RequestError::Body(error) => error.to_string(),
            RequestError::Tokenize(TokenizeError::Tools(error)) => {
                format!("the request's tools are not valid JSON: {error}")
            }
            RequestError::Tokenize(TokenizeError::Render { .. }) => {
                "the pool's chat template cannot render this chat".to_owned()
            }
            RequestError::Tokenize(_) => "the prompt could not be tokenized".to_owned(),
        }
    }

    /// The HTTP status the client gets: `reason().status()`.
    pub fn status(&self) -> u16 {
        self.reason().status()
    }

    /// The stable label: `reason().as_str()`.
    pub fn kind(&self) -> &'static str {
        self.reason().as_str()
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
pub(super) struct PoolRoute {
    pub(super) config: PoolConfig,
    pub(super) load: Arc<PoolLoad>,
    tokenizer: PoolTokenizer,
    pub(super) index: Arc<dyn PoolIndex>,
    /// The pool's policy; a reloaded file replaces it whole, and each decision reads one.
    pub(super) policy: ArcSwap<PolicyConfig>,
    /// Decisions taken so far under `round_robin`: the next request's turn.
    sequence: AtomicU64,
    /// A prefill/decode pool's handshake (`pools[].pd`); `None` for an aggregated pool.
    pub(super) relay: Option<Arc<crate::pd::Relay>>,
}

impl PoolRoute {
    /// Records `hashes` — as many leading blocks as one request may record — on `worker`, whose engine
    /// holds `max_total_tokens` (or the pool's default), in the pool's index; returns what it recorded.
    pub(super) fn record<'h>(
        &self,
        worker: WorkerId,
        max_total_tokens: Option<u64>,
        hashes: &'h [u64],
        snapshot: &PoolSnapshot,
        now: Instant,
    ) -> &'h [u64] {
        let capacity = capacity_blocks(&self.config, max_total_tokens);
        let chain = credited_chain(&self.config, hashes, capacity);
        self.index.commit(&Placement {
            worker,
            chain,
            capacity,
            snapshot,
            pool: &self.config,
            now,
        });
        chain
    }

    /// What of a recorded `chain` the other replicas are told: its checkpoints for an `events` pool,
    /// whose chains every replica computes alike from the engine's tokens; nothing for an
    /// `approximate` one, whose peers keep no guesses, or without `replica_sync`.
    pub(super) fn announced(&self, chain: &[u64]) -> Vec<u64> {
        if self.index.events().is_some() && self.load.announces() {
            crate::prefix::checkpoints(chain)
        } else {
            Vec::new()
        }
    }
}

/// The request path for every pool of a configuration.
pub struct Picker {
    /// In configuration order: `Prepared::pool` indexes it.
    pub(super) pools: Vec<PoolRoute>,
    /// `feedback.enabled`: a commit returns its [`Credit`], for Envoy's report to settle.
    feedback: bool,
    max_body_bytes: usize,
    /// `cache_salt_header`: the request header that salts an `approximate` pool's prefix hashes.
    salt_header: Option<String>,
    /// `unknown_subset`: what a subset hint naming no known worker gets.
    unknown_subset: UnknownSubset,
}

impl Picker {
    /// Loads every pool's tokenizer and creates empty owner indexes sized by the workers' capacities.
    /// `loads` are the pools' shared load states, in configuration order.
    pub fn new(config: &Config, loads: &[Arc<PoolLoad>]) -> Result<Self, PickerError> {
        let tokenizers = config
            .pools
            .iter()
            .zip(loads)
            .map(|(pool, load)| {
                PoolTokenizer::new(pool).map_err(|source| PickerError::Tokenizer {
                    pool: load.label().to_owned(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Picker::with_tokenizers(config, loads, tokenizers))
    }

    /// [`new`](Self::new) with the pools' tokenizers already loaded, in configuration order.
    pub fn with_tokenizers(
        config: &Config,
        loads: &[Arc<PoolLoad>],
        tokenizers: Vec<PoolTokenizer>,
    ) -> Self {
        let pools = config
            .pools
            .iter()
            .zip(loads)
            .zip(tokenizers)
            .map(|((pool, load), tokenizer)| {
                // One slot per worker the pool can hold; a slot nobody holds has no capacity, so
                // nothing is recorded there until a worker joins (`PoolRoster::joined`).
                let snapshot = load.snapshot();
                let mut capacities = vec![0; load.dispatches().len()];
                for worker in snapshot.workers() {
                    if let Some(slot) = capacities.get_mut(worker.id.index()) {
                        *slot = capacity_blocks(pool, worker.capacity.max_total_tokens);
                    }
                }
                let index = index::for_pool(pool, &capacities);
                // The other replicas' decisions are guesses here too, until the engines' events say.
                if let Some(events) = index.events() {
                    let guesses = index::PeerGuessesInto(Arc::clone(events));
                    load.take_guesses_through(Arc::new(guesses));
                }
                PoolRoute {
                    policy: ArcSwap::from_pointee(pool.policy.clone()),
                    config: pool.clone(),
                    load: Arc::clone(load),
                    tokenizer,
                    index,
                    sequence: AtomicU64::new(0),
                    // A sidecar performs its own handshake: cachepick sends no leg.
                    relay: pool
                        .pd
                        .as_ref()
                        .filter(|pd| pd.handshake != crate::config::Handshake::Sidecar)
                        .map(|pd| Arc::new(crate::pd::Relay::new(pd, &pool.workers))),
                }
            })
            .collect();
        Picker {
            pools,
            max_body_bytes: config.max_body_bytes.get(),
            salt_header: config.cache_salt_header.clone(),
            unknown_subset: config.unknown_subset,
            feedback: config.feedback.enabled,
        }
    }

    /// What a request gets when the proxy's subset hint names no worker of its pool (`unknown_subset`).
    pub fn unknown_subset(&self) -> UnknownSubset {
        self.unknown_subset
    }

    /// Body → pool, tokens, block hashes and owners.
    pub fn prepare(&self, path: &str, body: &[u8], now: Instant) -> Result<Prepared, RequestError> {
        let read = request::read(ApiPath::new(path).api, body, self.max_body_bytes)?;
        self.prepare_read(read, None, &Allowance::default(), now)
    }

    /// The request header whose value salts the prefix hashes, if one is configured.
    pub fn salt_header(&self) -> Option<&str> {
        self.salt_header.as_deref()
    }

    /// [`Picker::prepare`] of a body already read; `tenant` is the value of the salt header. The
    /// tokenizing stops when `allowance.stop` does ([`TokenizeError::Interrupted`]), and is skipped (the
    /// prompt is routed as a miss) when its memory does not fit in `allowance.budget`. `now` is the
    /// request's time, which the owner index's guesses are aged against.
    pub(super) fn prepare_read(
        &self,
        read: ReadBody<'_>,
        tenant: Option<&str>,
        allowance: &Allowance,
        now: Instant,
    ) -> Result<Prepared, RequestError> {
        let parsed = {
            let _step = tracing::debug_span!(target: super::TRACE_TARGET, "parse").entered();
            read.into_request()?
        };
        let model = parsed.model.as_deref();
        let (pool_index, pool) = self.select_pool(model)?;
        let config = &pool.config;
        let stop = &allowance.stop;
        // Held until the tokens are hashed: tokenizing takes memory beyond the buffered body.
        let charge = match (&allowance.budget, &parsed.prompt) {
            (Some(budget), Prompt::Chat { .. } | Prompt::Text(_)) => {
                let bytes = pool.tokenizer.memory_for(prompt_bytes(&parsed.prompt));
                Some(budget.charge(bytes))
            }
            _ => None,
        };
        let tokenizing = tracing::debug_span!(target: super::TRACE_TARGET, "tokenize").entered();
        let tokens: Cow<'_, [u32]> = match &parsed.prompt {
            _ if matches!(charge, Some(None)) => Cow::Owned(Vec::new()),
            Prompt::Chat { messages, tools } => {
                let turns: Vec<ChatTurn<'_>> = messages
                    .iter()
                    .map(|message| ChatTurn {
                        role: &message.role,
                        parts: &message.content,
                    })
                    .collect();
                let chat = Chat::new(&turns).with_tools(tools.map(|raw| raw.get()));
                let tokens = pool.index.chat_tokens(&pool.tokenizer, chat, stop);
                Cow::Owned(untokenized_as_empty(tokens)?)
            }
            Prompt::Text(text) => Cow::Owned(untokenized_as_empty(
                pool.tokenizer.tokens_for_text_within(text, stop),
            )?),
            Prompt::Tokens(tokens) => Cow::Borrowed(tokens.as_slice()),
        };
        drop(tokenizing);
        let _matching = tracing::debug_span!(target: super::TRACE_TARGET, "match").entered();
        let seed = pool.index.seed(&ChainStart {
            model,
            pool: pool.load.label(),
            body_salt: parsed.cache_salt.as_deref(),
            tenant,
        });
        let hashes = block_hashes(seed, &tokens, config.block_size);
        let prompt_tokens = tokens.len() as u64;
        drop(tokens);
        drop(charge);
        let owners = pool.index.matches(&hashes, config.block_size, now);
        Ok(Prepared {
            pool: pool_index,
            pool_label: pool.load.label().to_owned(),
            model: parsed.model.map(Cow::into_owned),
            prompt_tokens,
            max_output_tokens: parsed.max_output_tokens,
            block_hashes: hashes,
            owners,
        })
    }

    /// The pool serving `model`, and its index.
    fn select_pool(&self, model: Option<&str>) -> Result<(usize, &PoolRoute), BodyError> {
        let configs = self.pools.iter().map(|pool| &pool.config);
        let (index, _) = request::select_pool(configs, model)?;
        let pool = self.pools.get(index).ok_or(BodyError::MissingModel)?;
        Ok((index, pool))
    }

    /// A request without a prompt (a GET, or a POST to a non-generation API): the pool `model` names,
    /// else the default pool (`*`), else the first; no tokens and so no owners.
    pub fn prepare_passthrough(&self, model: Option<&str>) -> Result<Prepared, RequestError> {
        let (pool_index, pool) = match self.select_pool(model) {
            Ok(found) => found,
            Err(error @ BodyError::UnknownModel { .. }) => return Err(error.into()),
            Err(_) => (0, self.pools.first().ok_or(BodyError::MissingModel)?),
        };
        Ok(Prepared {
            pool: pool_index,
            pool_label: pool.load.label().to_owned(),
            model: model.map(str::to_owned),
            prompt_tokens: 0,
            max_output_tokens: None,
            block_hashes: Vec::new(),
            owners: Vec::new(),
        })
    }

    /// The pool `prepared` names with its current load snapshot, taken once: every later step of the
    /// request reads this one, at the request's time `now`. `None` for a `Prepared` of another picker,
    /// whose pool does not exist here.
    pub fn pin<'p>(&'p self, prepared: &'p Prepared, now: Instant) -> Option<Pinned<'p>> {
        let pool = self.pools.get(prepared.pool)?;
        Some(Pinned {
            pool,
            prepared,
            snapshot: pool.load.snapshot(),
            feedback: self.feedback,
            now,
        })
    }

    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// The handshake of the prefill/decode pool labelled `pool`; `None` for an aggregated pool.
    pub fn relay(&self, pool: &str) -> Option<Arc<crate::pd::Relay>> {
        self.pools
            .iter()
            .find(|route| route.load.label() == pool)
            .and_then(|route| route.relay.clone())
    }

    /// Bytes each pool's segment cache holds, by pool label.
    pub fn segment_cache_bytes(&self) -> Vec<(String, u64)> {
        self.pools
            .iter()
            .map(|pool| {
                (
                    pool.load.label().to_owned(),
                    pool.tokenizer.cache_stats().bytes,
                )
            })
            .collect()
    }

    /// Every pool's owner-index statistics, by pool label. An `events` pool's are its engines'.
    pub fn index_stats(&self) -> Vec<(String, IndexStats)> {
        self.pools
            .iter()
            .map(|pool| (pool.load.label().to_owned(), pool.index.stats()))
            .collect()
    }

    /// Each `events` pool's configuration and event-fed index.
    pub fn event_indexes(&self) -> Vec<(&PoolConfig, Arc<EventIndex>)> {
        self.pools
            .iter()
            .filter_map(|pool| Some((&pool.config, Arc::clone(pool.index.events()?))))
            .collect()
    }

    /// For an `events` pool, where each owner's depth of `prepared` comes from; `None` otherwise.
    pub fn depth_sources(&self, prepared: &Prepared) -> Option<Vec<SourcedMatch>> {
        self.pools
            .get(prepared.pool)?
            .index
            .depth_sources(&prepared.block_hashes, Instant::now())
    }

    /// Replaces pool `pool`'s policy (a reloaded file's); decisions already running finish with the old.
    pub fn set_policy(&self, pool: usize, policy: PolicyConfig) {
        if let Some(route) = self.pools.get(pool) {
            route.policy.store(Arc::new(policy));
        }
    }

    /// What keeps pool `pool`'s index and streams in step with its roster; handed to its scraper.
    pub fn roster(&self, pool: usize, feeds: &Arc<EventFeeds>) -> Option<Arc<dyn RosterObserver>> {
        let route = self.pools.get(pool)?;
        Some(Arc::new(PoolRoster {
            pool: route.config.clone(),
            label: route.load.label().to_owned(),
            index: Arc::clone(&route.index),
            feeds: Arc::clone(feeds),
        }))
    }

    /// The pools' shared load states, in configuration order.
    pub fn loads(&self) -> impl Iterator<Item = &Arc<PoolLoad>> {
        self.pools.iter().map(|pool| &pool.load)
    }
}

/// A prepared request on its pool's load snapshot, taken once by [`Picker::pin`]: the subset mapping,
/// the decision, the commit and the endpoints all read this snapshot, so they cannot disagree.
pub struct Pinned<'p> {
    pub(super) pool: &'p PoolRoute,
    pub(super) prepared: &'p Prepared,
    pub(super) snapshot: Arc<PoolSnapshot>,
    feedback: bool,
    /// The request's time: what the policy ages readings against and the index's guesses are stamped
    /// with. The live path reads the clock once per request; a replay in virtual time passes its own.
    pub(super) now: Instant,
}

impl<'p> Pinned<'p> {
    /// The request.
    pub fn prepared(&self) -> &'p Prepared {
        self.prepared
    }

    /// The snapshot every step of this request reads.
    pub fn snapshot(&self) -> &PoolSnapshot {
        &self.snapshot
    }

    /// How many fallbacks the pool's policy sends after the selected worker.
    pub fn max_fallbacks(&self) -> usize {
        self.pool.policy.load().max_fallbacks
    }

    /// The pool's prefix block size in tokens.
    pub fn block_size(&self) -> u32 {
        self.pool.config.block_size.get()
    }

    /// The pool's workers whose endpoints are in `subset` (the proxy's hint), in id order.
    pub fn workers_in(&self, subset: &[SocketAddr]) -> Vec<WorkerId> {
        self.snapshot
            .workers()
            .iter()
            .filter(|worker| subset.contains(&worker.endpoint))
            .map(|worker| worker.id)
            .collect()
    }

    /// Runs the pool's policy for the request. Under `round_robin` this takes the pool's next turn.
    pub fn decide<R: Rng + ?Sized>(&self, allowed: Option<&[WorkerId]>, rng: &mut R) -> Outcome {
        self.decide_in_turn(allowed, true, rng)
    }

    /// `decide`; `take_turn` false peeks at the round-robin turn instead of advancing it.
    pub(super) fn decide_in_turn<R: Rng + ?Sized>(
        &self,
        allowed: Option<&[WorkerId]>,
        take_turn: bool,
        rng: &mut R,
    ) -> Outcome {
        let pool = self.pool;
        let view = LoadView {
            snapshot: &self.snapshot,
            dispatches: pool.load.dispatches(),
            now: self.now,
        };
        // Only round robin reads the sequence; other pools leave the counter alone.
        let policy = pool.policy.load();
        let sequence = match policy.mode {
            Mode::RoundRobin if take_turn => pool.sequence.fetch_add(1, Ordering::Relaxed),
            Mode::RoundRobin => pool.sequence.load(Ordering::Relaxed),
            _ => 0,
        };
        let facts = RequestFacts {
            prompt_tokens: self.prepared.prompt_tokens,
            allowed,
            sequence,
        };
        policy::decide(&facts, &self.prepared.owners, &view, &policy, rng)
    }

    /// Records a routed request: its blocks now live on the selected worker, and one more request is in
    /// flight there. With `feedback` on, returns what was credited, for the response's report to
    /// confirm, move or retract ([`Picker::settle`]); `None` when nothing was.
    ///
    /// Only what the engine will cache is recorded: nothing for a worker the roster no longer routes
    /// to, nothing when the prompt and the output asked for exceed the pool's `max_model_len` (the
    /// engine refuses the request), and at most `index.commit_share` of the worker's capacity.
    pub fn commit(&self, decision: &Decision) -> Option<Credit> {
        // A worker the roster no longer routes to gets nothing recorded, so a decision cannot bring a
        // removed worker's blocks back.
        let pool = self.pool;
        let worker = self
            .snapshot
            .worker(decision.selected)
            .filter(|worker| worker.routable())?;
        // A prompt beyond the engine's context, or one whose requested output takes it beyond, is refused
        // by the engine: its blocks will never be cached there, and recording them would evict
        // prefixes that are.
        let prepared = self.prepared;
        let asked = prepared
            .prompt_tokens
            .saturating_add(prepared.max_output_tokens.unwrap_or(0));
        if asked > pool.config.max_model_len.get() {
            return None;
        }
        // The worker may have left since this request's snapshot, and its slot gone to another: what
        // was decided for the one must not be credited to the other.
        let current = pool.load.snapshot();
        if current
            .worker(decision.selected)
            .is_none_or(|now| now.generation != worker.generation)
        {
            return None;
        }
        let chain = pool.record(
            decision.selected,
            worker.capacity.max_total_tokens,
            &prepared.block_hashes,
            &self.snapshot,
            self.now,
        );
        let matched = prepared
            .owners
            .iter()
            .find(|owner| owner.worker == decision.selected)
            .map_or(0, |owner| owner.matched_tokens);
        // The tokens the worker will compute, as the index predicts them: its share of the queue ahead
        // of the next request until a reading covers it.
        pool.load.dispatched(
            decision.selected,
            worker.endpoint,
            prepared.prompt_tokens.saturating_sub(matched),
            &pool.announced(chain),
        );
        if decision.reason.is_off_owner() {
            pool.load.dispatches().record_cold(decision.selected);
        }
        let held = matched / u64::from(self.block_size().max(1));
        self.feedback.then(|| Credit {
            pool: prepared.pool,
            worker: decision.selected,
            generation: worker.generation,
            endpoint: worker.endpoint,
            held: usize::try_from(held).unwrap_or(usize::MAX).min(chain.len()),
            chain: chain.to_vec(),
        })
    }

    /// The selected worker's endpoint, then its fallbacks'.
    pub fn endpoints(&self, decision: &Decision) -> Vec<SocketAddr> {
        std::iter::once(decision.selected)
            .chain(decision.fallbacks.iter().copied())
            .filter_map(|id| self.snapshot.worker(id).map(|worker| worker.endpoint))
            .collect()
    }
}

/// Keeps one pool's owner index and KV event streams in step with its roster: the scraper calls it
/// before it publishes the snapshot that shows a change.
struct PoolRoster {
    pool: PoolConfig,
    label: String,
    index: Arc<dyn PoolIndex>,
    feeds: Arc<EventFeeds>,
}

impl PoolRoster {
    fn feeds(&self) -> Feeds<'_> {
        Feeds {
            feeds: &self.feeds,
            pool: &self.label,
        }
    }
}

impl RosterObserver for PoolRoster {
    fn joined(&self, id: WorkerId, worker: &WorkerConfig) {
        let capacity = capacity_blocks(&self.pool, worker.max_total_tokens.map(|max| max.get()));
        self.index.joined(id, worker, capacity, &self.feeds());
    }

    fn left(&self, id: WorkerId) {
        self.index.left(id, &self.feeds());
    }

    fn restarted(&self, id: WorkerId) {
        self.index.restarted(id, &self.pool);
    }
}

/// The bytes of text a prompt's tokenizing reads: its messages' roles and parts and its tools, or its
/// text.
fn prompt_bytes(prompt: &Prompt<'_>) -> usize {
    match prompt {
        Prompt::Chat { messages, tools } => messages
            .iter()
            .flat_map(|message| {
                std::iter::once(message.role.len())
                    .chain(message.content.iter().map(|part| part.len()))
            })
            .fold(
                tools.map_or(0, |tools| tools.get().len()),
                usize::saturating_add,
            ),
        Prompt::Text(text) => text.len(),
        Prompt::Tokens(_) => 0,
    }
}

/// A prompt the tokenizer itself fails on (a Hugging Face pre-tokenizer's regex backtracking limit, say)
/// is still a servable request: it is routed without prefix information, as a miss, rather than refused.
/// Failures that are the request's fault (a chat the template cannot render) stay errors.
fn untokenized_as_empty(
    tokens: Result<Vec<u32>, TokenizeError>,
) -> Result<Vec<u32>, TokenizeError> {
    match tokens {
        Err(TokenizeError::Encode(error)) => {
            // One line in 64: a client can send such prompts on purpose.
            static FAILURES: AtomicU64 = AtomicU64::new(0);
            if FAILURES.fetch_add(1, Ordering::Relaxed).is_multiple_of(64) {
                tracing::warn!(%error, "the tokenizer failed on a prompt; routed without prefix information (logged 1 in 64)");
            }
            Ok(Vec::new())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::config::Overrides;
    use crate::policy::Reason;
    use crate::route::{ServedReport, Settled};

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
        let loads = PoolLoad::for_pools(&config);
        Picker::new(&config, &loads).unwrap()
    }

    fn body(model: &str) -> Vec<u8> {
        let prompt = "the same prompt, long enough for a few blocks ".repeat(40);
        serde_json::to_vec(&serde_json::json!({"model": model, "prompt": prompt})).unwrap()
    }

    /// Routes and commits; (worker, reason).
    fn route(picker: &Picker, model: &str, rng: &mut SmallRng) -> (u32, Reason) {
        let prepared = picker
            .prepare("/v1/completions", &body(model), Instant::now())
            .unwrap();
        let pinned = picker.pin(&prepared, Instant::now()).unwrap();
        let Outcome::Route(decision) = pinned.decide(None, rng) else {
            panic!("refused")
        };
        pinned.commit(&decision);
        (decision.selected.0, decision.reason)
    }

    /// One cache_aware pool of two workers, with `extra` top-level lines and `pool` pool lines.
    fn one_pool(extra: &str, pool: &str) -> Picker {
        let yaml = format!(
            "{extra}policy: {{min_match_tokens: 4}}\npools:\n  - model: ca\n    engine: vllm\n    \
             tokenizer: {{kind: bytes}}\n{pool}    workers:\n      - endpoint: 127.0.0.1:4\n      \
             - endpoint: 127.0.0.1:5\n"
        );
        let config = crate::config::parse(&yaml, "t", &Overrides::default()).unwrap();
        let loads = PoolLoad::for_pools(&config);
        Picker::new(&config, &loads).unwrap()
    }

    /// Routes `read`'s body as `tenant` and commits; (reason, matched tokens).
    fn route_as(picker: &Picker, body: &[u8], tenant: Option<&str>) -> (Reason, u64) {
        let read = request::read(Some(request::Api::Completions), body, 1 << 20).unwrap();
        let prepared = picker
            .prepare_read(read, tenant, &Allowance::default(), Instant::now())
            .unwrap();
        let pinned = picker.pin(&prepared, Instant::now()).unwrap();
        let mut rng = SmallRng::seed_from_u64(3);
        let Outcome::Route(decision) = pinned.decide(None, &mut rng) else {
            panic!("refused")
        };
        pinned.commit(&decision);
        (decision.reason, decision.matched_tokens)
    }

    #[test]
    fn a_prompt_beyond_the_engines_context_is_routed_but_never_learned() {
        let picker = one_pool("", "    max_model_len: 500\n    block_size: 16\n");
        let prompt = |bytes: usize| {
            serde_json::to_vec(&serde_json::json!({"model": "ca", "prompt": "x".repeat(bytes)}))
                .unwrap()
        };
        // About 1,000 tokens: beyond the 500-token context, so the engine refuses it.
        let long = prompt(4000);
        assert!(
            picker
                .prepare("/v1/completions", &long, Instant::now())
                .unwrap()
                .prompt_tokens
                > 500
        );
        assert_eq!(route_as(&picker, &long, None).0, Reason::CacheMiss);
        assert_eq!(route_as(&picker, &long, None).0, Reason::CacheMiss);
        assert_eq!(picker.index_stats()[0].1.entries, 0, "nothing committed");
        let short = prompt(1600);
        route_as(&picker, &short, None);
        assert_eq!(route_as(&picker, &short, None).0, Reason::CacheHit);
    }

    /// Routes and commits `body` (a completion); the decision and its credit.
    fn commit_of(picker: &Picker, body: &serde_json::Value) -> (Decision, Option<Credit>) {
        let body = serde_json::to_vec(body).unwrap();
        let prepared = picker
            .prepare("/v1/completions", &body, Instant::now())
            .unwrap();
        let pinned = picker.pin(&prepared, Instant::now()).unwrap();
        let mut rng = SmallRng::seed_from_u64(5);
        let Outcome::Route(decision) = pinned.decide(None, &mut rng) else {
            panic!("refused")
        };
        let credit = pinned.commit(&decision);
        (decision, credit)
    }

    fn entries(picker: &Picker) -> usize {
        picker.index_stats()[0].1.entries
    }

    #[test]
    fn a_prompt_whose_requested_output_exceeds_the_context_is_never_learned() {
        let picker = one_pool(
            "",
            "    max_model_len: 2000
    block_size: 16
",
        );
        let prompt = "y".repeat(1600);
        let asked = |max_tokens: u64| serde_json::json!({"model": "ca", "prompt": prompt, "max_tokens": max_tokens});
        let (_, credit) = commit_of(&picker, &asked(1_000_000_000));
        assert!(credit.is_none());
        assert_eq!(
            entries(&picker),
            0,
            "the engine refuses it: nothing committed"
        );
        let (_, credit) = commit_of(&picker, &asked(16));
        assert!(credit.is_some());
        assert!(entries(&picker) > 0);
    }

    #[test]
    fn one_request_records_at_most_its_share_of_the_workers_capacity() {
        let picker = one_pool(
            "",
            "    block_size: 16
    default_cache_blocks: 100
    index: {commit_share: 0.2}
",
        );
        let (decision, credit) = commit_of(
            &picker,
            &serde_json::json!({"model": "ca", "prompt": (1..4000).collect::<Vec<u32>>()}),
        );
        assert_eq!(credit.unwrap().blocks(), 20, "a fifth of 100 blocks");
        assert_eq!(
            picker.index_stats()[0].1.held[decision.selected.index()],
            20
        );
    }

    #[test]
    fn the_report_confirms_moves_or_retracts_a_credit() {
        let picker = one_pool(
            "",
            "    block_size: 16
",
        );
        let body = |seed: u32| serde_json::json!({"model": "ca", "prompt": (seed..seed + 320).collect::<Vec<u32>>()});
        let (_, owner) = commit_of(&picker, &body(1));
        let owner = owner.unwrap();
        let held = entries(&picker);
        assert_eq!(held, 20);
        // A refused request: what it added is taken back, what the owner held before stays.
        let (_, refused) = commit_of(&picker, &body(1));
        let refused = refused.unwrap();
        assert_eq!(refused.endpoint(), owner.endpoint(), "a hit on the owner");
        let report = |status, upstream| ServedReport {
            status,
            upstream,
            at: Instant::now(),
        };
        assert_eq!(
            picker.settle(&refused, report(400, Some(refused.endpoint()))),
            Settled::Retracted
        );
        assert_eq!(entries(&picker), held, "the owner keeps what it held");
        let (_, fresh) = commit_of(&picker, &body(5000));
        let fresh = fresh.unwrap();
        assert_eq!(entries(&picker), 2 * held);
        assert_eq!(picker.settle(&fresh, report(503, None)), Settled::Retracted);
        assert_eq!(entries(&picker), held, "a refused newcomer credits nobody");
        // Served elsewhere: the worker that served holds it now, the selected one does not.
        let (_, retried) = commit_of(&picker, &body(9000));
        let retried = retried.unwrap();
        let other: SocketAddr = if retried.endpoint().port() == 4 {
            "127.0.0.1:5".parse().unwrap()
        } else {
            "127.0.0.1:4".parse().unwrap()
        };
        assert_eq!(
            picker.settle(&retried, report(200, Some(other))),
            Settled::Moved
        );
        let held_by = picker.index_stats()[0].1.held.clone();
        let by_port = |port: u16| held_by[usize::from(port - 4)];
        assert_eq!(by_port(other.port()), by_port(other.port()).max(20));
        assert_eq!(entries(&picker), 2 * held);
        let again = body(9000);
        let (decision, _) = commit_of(&picker, &again);
        assert_eq!(decision.reason, Reason::CacheHit);
        assert_eq!(
            picker
                .pin(
                    &picker
                        .prepare(
                            "/v1/completions",
                            &serde_json::to_vec(&again).unwrap(),
                            Instant::now()
                        )
                        .unwrap(),
                    Instant::now()
                )
                .unwrap()
                .endpoints(&decision)[0],
            other
        );
        // Confirmed: served by the selected worker; blocks another report took away come back.
        assert_eq!(
            picker.settle(&owner, report(200, Some(owner.endpoint()))),
            Settled::Confirmed
        );
        assert_eq!(picker.settle(&owner, report(200, None)), Settled::Confirmed);
        // An address the pool does not know served it: nobody here holds it.
        let (_, unknown) = commit_of(&picker, &body(20_000));
        let before = entries(&picker);
        let elsewhere = Some("10.9.9.9:80".parse().unwrap());
        assert_eq!(
            picker.settle(&unknown.unwrap(), report(200, elsewhere)),
            Settled::Retracted
        );
        assert_eq!(entries(&picker), before - 20);
    }

    #[test]
    fn tenants_salted_by_header_share_no_prefix() {
        let picker = one_pool("cache_salt_header: x-tenant\n", "");
        let prompt = body("ca");
        assert_eq!(route_as(&picker, &prompt, Some("a")).0, Reason::CacheMiss);
        assert_eq!(route_as(&picker, &prompt, Some("a")).0, Reason::CacheHit);
        assert_eq!(
            route_as(&picker, &prompt, Some("b")),
            (Reason::CacheMiss, 0),
            "tenant b matches nothing of tenant a's"
        );
        assert_eq!(route_as(&picker, &prompt, None), (Reason::CacheMiss, 0));
        // The body's own salt and the tenant's are two parts, not one string run together.
        let salted = |salt: &str| {
            let prompt = "z".repeat(600);
            serde_json::to_vec(
                &serde_json::json!({"model": "ca", "prompt": prompt, "cache_salt": salt}),
            )
            .unwrap()
        };
        route_as(&picker, &salted("c"), Some("ab"));
        assert_eq!(route_as(&picker, &salted("bc"), Some("a")).1, 0);
    }

    #[test]
    fn an_engine_reported_capacity_is_clamped() {
        let pool = crate::config::parse(
            "pools:\n  - model: m\n    engine: vllm\n    block_size: 1\n    workers:\n      - endpoint: 127.0.0.1:4\n",
            "t",
            &Overrides::default(),
        )
        .unwrap()
        .pools
        .remove(0);
        assert_eq!(
            capacity_blocks(&pool, Some(u64::MAX)),
            PoolConfig::MAX_REPORTED_CACHE_BLOCKS
        );
        assert_eq!(capacity_blocks(&pool, Some(0)), 1);
        assert_eq!(capacity_blocks(&pool, Some(1000)), 1000);
        assert_eq!(
            capacity_blocks(&pool, None),
            pool.default_cache_blocks.get()
        );
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
        // Looking at the next turn (explain's dry run) does not take it.
        let rr = body("rr");
        let prepared = picker
            .prepare("/v1/completions", &rr, Instant::now())
            .unwrap();
        let pinned = picker.pin(&prepared, Instant::now()).unwrap();
        for _ in 0..2 {
            let outcome = pinned.decide_in_turn(None, false, &mut rng);
            let decision = outcome.decision().unwrap();
            assert_eq!(decision.selected.0, 1);
            assert_eq!(decision.trace.sequence, Some(4));
        }
        assert_eq!(route(&picker, "rr", &mut rng), (1, Reason::RoundRobin));
    }
}

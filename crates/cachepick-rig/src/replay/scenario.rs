//! What `cachepick replay` replays — a Mooncake trace or one of the synthetic workloads, by the name
//! `--scenario` gives it — and the fleet it replays one on when no `--config` is given.

use std::path::{Path, PathBuf};

use cachepick_sim::{Engine, SimConfig, Timing};

use super::trace::{self, Item};
use super::{ReplayError, agents, chat, documents};
use crate::nz;

/// The workload.
#[derive(Clone, Debug, PartialEq)]
pub enum Scenario {
    /// A Mooncake JSONL trace.
    Trace(PathBuf),
    /// The synthetic burst: steady near capacity, a burst well above it, steady again.
    Burst,
    /// The prefill-heavy agent workload: long system prompts reused across multi-turn sessions, short
    /// outputs ([`agents`]).
    Agents,
    /// Multi-turn chat over long per-user contexts with think times between rounds, shaped on vLLM
    /// production-stack's multi-round QA benchmark ([`chat`]).
    Chat,
    /// Chat over long pasted documents: long, mostly new prompts and few follow-ups
    /// ([`documents`]).
    Documents,
}

/// The synthetic scenarios' `--scenario` names.
pub const SCENARIO_NAMES: [&str; 4] = ["burst", "agents", "chat", "documents"];

impl Scenario {
    /// A synthetic scenario by its `--scenario` name.
    pub fn named(name: &str) -> Option<Scenario> {
        match name {
            "burst" => Some(Scenario::Burst),
            "agents" => Some(Scenario::Agents),
            "chat" => Some(Scenario::Chat),
            "documents" => Some(Scenario::Documents),
            _ => None,
        }
    }

    /// What `--trace` and `--scenario` ask for: the trace when one is given, else the named synthetic
    /// scenario, `burst` when neither is.
    pub fn chosen(trace: Option<PathBuf>, name: Option<&str>) -> Result<Scenario, ReplayError> {
        if let Some(path) = trace {
            return Ok(Scenario::Trace(path));
        }
        let name = name.unwrap_or("burst");
        Scenario::named(name).ok_or_else(|| ReplayError::UnknownScenario(name.to_owned()))
    }

    /// The scenario's name in reports and output directories.
    pub fn name(&self) -> String {
        match self {
            Scenario::Trace(path) => path.display().to_string(),
            Scenario::Burst => "burst".to_owned(),
            Scenario::Agents => "agents".to_owned(),
            Scenario::Chat => "chat".to_owned(),
            Scenario::Documents => "documents".to_owned(),
        }
    }

    /// The scenario's requests: a synthetic one's for `seed`, their start times spread over `scale`
    /// times its span; a trace's as `read_trace` reads it (the wall-clock replay and the virtual one
    /// window a trace differently).
    pub fn requests(
        &self,
        seed: u64,
        scale: f64,
        read_trace: impl FnOnce(&Path) -> Result<Vec<Item>, ReplayError>,
    ) -> Result<Vec<Item>, ReplayError> {
        Ok(match self {
            Scenario::Trace(path) => return read_trace(path),
            Scenario::Burst => trace::burst(seed, scale),
            Scenario::Agents => agents::agents(seed, scale),
            Scenario::Chat => chat::chat(seed, scale),
            Scenario::Documents => documents::documents(seed, scale),
        })
    }

    /// Trace time is divided by this unless `--speedup` says otherwise.
    pub fn default_speedup(&self) -> f64 {
        match self {
            Scenario::Burst => 4.0,
            Scenario::Trace(_) | Scenario::Agents | Scenario::Chat | Scenario::Documents => 8.0,
        }
    }
}

/// The fleet replays run on when no `--config` is given: 4 vLLM workers, the `bytes` tokenizer (exact
/// token counts, cheap), running the model `speedup` times faster than real time.
///
/// Under the step model (the default) each worker is the default profile's GPU with vLLM's own
/// defaults there (29,205 KV blocks, 8,192 tokens a step, 1,024 sequences); only the burst keeps a
/// small KV pool (4,096 blocks, 65k tokens), because cache pressure is what that scenario is made of:
/// a worker holds about half of its 32 groups' 4k-token prefixes. Under the slots model the fleets are
/// the ones earlier figures were measured on.
pub fn default_fleet(scenario: &Scenario, speedup: f64, timing: Timing) -> SimConfig {
    let mut sim = SimConfig::new(Engine::Vllm, nz(4));
    sim.tokenizer = cachepick_sim::config::TokenizerConfig::Bytes;
    if timing == Timing::Slots {
        sim.timing = Timing::Slots;
        sim.params = cachepick_sim::SimParams::slots();
    }
    sim.params.max_model_len = nz(262_144);
    match (timing, scenario) {
        (Timing::Step, Scenario::Burst) => sim.params.kv_blocks = nz(4_096),
        (
            Timing::Step,
            Scenario::Trace(_) | Scenario::Agents | Scenario::Chat | Scenario::Documents,
        ) => {}
        (
            Timing::Slots,
            Scenario::Trace(_) | Scenario::Agents | Scenario::Chat | Scenario::Documents,
        ) => {
            // Mooncake's ~190 output tokens at 20 ms dominate a slot: 16 slots per worker serve its
            // ~3.7 requests/s near, not beyond, capacity.
            sim.params.max_running = nz(16);
            // 2M tokens per worker, about 150 of Mooncake's ~13k-token prompts: a few minutes of trace,
            // so a conversation's next turn can still find its prefix, but not everything fits.
            sim.params.kv_blocks = nz(131_072);
        }
        (Timing::Slots, Scenario::Burst) => {
            sim.params.max_running = nz(8);
            // 65k tokens: a quarter of the 32 groups' 4k-token prefixes fits with room to run; half
            // of them at most, so a fleet where every worker holds every prefix evicts.
            sim.params.kv_blocks = nz(4_096);
        }
    }
    sim.params.time_scale = 1.0 / speedup;
    sim
}

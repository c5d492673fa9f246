//! The cache-aware and balance keys of `policy:` as a catalogue: each key's name, the mode and gate
//! unit that read it, and the flag that sets it at the top level. Declared once here, read by
//! `policy.rs` to find keys given under the wrong mode or unit.

use crate::config::{GateUnit, ModeKind, Overrides};

/// The keys that belong to one mode; given under another, they are errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Knob {
    WorkerQueueLimit,
    SaturationQueueFloor,
    MinLoadChoices,
    MinMatchTokens,
    MinMatchShare,
    PinDepthRatio,
    GateUnit,
    DivertMargin,
    SaturationWaitFloor,
    PrefillTokensPerSecond,
    BalanceAbsThreshold,
    BalanceRelThreshold,
    CacheThreshold,
}

impl Knob {
    pub(super) const ALL: [Knob; 13] = [
        Knob::WorkerQueueLimit,
        Knob::SaturationQueueFloor,
        Knob::MinLoadChoices,
        Knob::MinMatchTokens,
        Knob::MinMatchShare,
        Knob::PinDepthRatio,
        Knob::GateUnit,
        Knob::DivertMargin,
        Knob::SaturationWaitFloor,
        Knob::PrefillTokensPerSecond,
        Knob::BalanceAbsThreshold,
        Knob::BalanceRelThreshold,
        Knob::CacheThreshold,
    ];

    pub(super) fn key(self) -> &'static str {
        match self {
            Knob::WorkerQueueLimit => "worker_queue_limit",
            Knob::SaturationQueueFloor => "saturation_queue_floor",
            Knob::MinLoadChoices => "min_load_choices",
            Knob::MinMatchTokens => "min_match_tokens",
            Knob::MinMatchShare => "min_match_share",
            Knob::PinDepthRatio => "pin_depth_ratio",
            Knob::GateUnit => "gate_unit",
            Knob::DivertMargin => "divert_margin",
            Knob::SaturationWaitFloor => "saturation_wait_floor",
            Knob::PrefillTokensPerSecond => "prefill_tokens_per_second",
            Knob::BalanceAbsThreshold => "balance_abs_threshold",
            Knob::BalanceRelThreshold => "balance_rel_threshold",
            Knob::CacheThreshold => "cache_threshold",
        }
    }

    /// The mode that reads it.
    pub(super) fn mode(self) -> ModeKind {
        match self {
            Knob::WorkerQueueLimit
            | Knob::SaturationQueueFloor
            | Knob::MinLoadChoices
            | Knob::MinMatchTokens
            | Knob::MinMatchShare
            | Knob::PinDepthRatio
            | Knob::GateUnit
            | Knob::DivertMargin
            | Knob::SaturationWaitFloor
            | Knob::PrefillTokensPerSecond => ModeKind::CacheAware,
            Knob::BalanceAbsThreshold | Knob::BalanceRelThreshold | Knob::CacheThreshold => {
                ModeKind::BalanceThreshold
            }
        }
    }

    /// The gate unit that reads it; `None` for a key every unit reads.
    pub(super) fn unit(self) -> Option<GateUnit> {
        match self {
            Knob::WorkerQueueLimit | Knob::SaturationQueueFloor => Some(GateUnit::Requests),
            Knob::DivertMargin | Knob::SaturationWaitFloor | Knob::PrefillTokensPerSecond => {
                Some(GateUnit::PrefillTime)
            }
            _ => None,
        }
    }

    /// The flag that sets it at the top level, and where the flags hold its value.
    pub(super) fn flag(self) -> Option<(&'static str, FlagValue)> {
        match self {
            Knob::WorkerQueueLimit => Some(("--worker-queue-limit", |o| o.worker_queue_limit)),
            Knob::SaturationQueueFloor => {
                Some(("--saturation-queue-floor", |o| o.saturation_queue_floor))
            }
            Knob::MinLoadChoices => Some(("--min-load-choices", |o| o.min_load_choices)),
            _ => None,
        }
    }
}

/// Reads a knob's flag from the flags given.
pub(super) type FlagValue = fn(&Overrides) -> Option<u64>;

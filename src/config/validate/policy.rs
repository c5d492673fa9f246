//! A scope's `policy:` and how a pool's inherits the top level's: which keys each mode reads (a key
//! given under a mode that ignores it is an error, wherever it was given), which a pool takes from the
//! top level when it does not set them, and where the queue gate's limit and floor are judged together.
//!
//! The top-level scope also takes the flags; a pool's does not. Each key is checked on its own first,
//! then against the mode in force, so one mistake gives one message, at the scope that made it.

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use super::Validator;
use super::knob::Knob;
use crate::config::{
    BalanceKnobs, CacheAwareKnobs, DepthRatio, GateUnit, Gating, Mode, ModeKind, Overrides,
    PolicyConfig, QueueGate, RelThreshold, WaitGate,
};
use cachepick_decode::{
    Decode, Field, Map, Origin, Phase, Reported, Res, Val, at_least_one, at_least_one_usize,
    overridden, value_or, with_default,
};

const POLICY_KEYS: &[&str] = &[
    "mode",
    "worker_queue_limit",
    "saturation_queue_floor",
    "min_load_choices",
    "min_match_tokens",
    "min_match_share",
    "pin_depth_ratio",
    "gate_unit",
    "divert_margin",
    "saturation_wait_floor",
    "prefill_tokens_per_second",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "cache_threshold",
    "max_fallbacks",
];

impl Validator<'_> {
    /// The policy of scope `key` in `map`: the top level's (with `overrides`, no `parent`) or a pool's
    /// (inheriting from `parent`). A section that is not a mapping fails every key, already reported.
    pub(super) fn policy(
        &mut self,
        map: &Map,
        overrides: Option<&Overrides>,
        parent: Option<&Resolved>,
    ) -> Resolved {
        match self.section(map, "policy", POLICY_KEYS) {
            Ok(section) => {
                let (keys, given) = self.policy_keys(&section, overrides);
                self.resolve_policy(keys, &given, parent)
            }
            Err(reported) => Resolved::failed(reported),
        }
    }

    /// One scope's policy keys (the top-level `policy` with the flags, or a pool's), each checked on its
    /// own, and where each mode-specific key was given, whether or not its value passed.
    fn policy_keys(&mut self, map: &Map, overrides: Option<&Overrides>) -> (PolicyKeys, Given) {
        let mode = self.opt(map, "mode", |v, node, at| {
            v.keyword(node, at, &ModeKind::ALL, ModeKind::as_str)
        });
        let limit = self.switchable(map, Knob::WorkerQueueLimit, overrides);
        let floor = self.switchable(map, Knob::SaturationQueueFloor, overrides);
        let choices = self.flagged(map, Knob::MinLoadChoices, overrides);
        let choices = self.check_opt(choices, at_least_one_usize);
        let min_match_tokens = self.opt(map, "min_match_tokens", Self::integer);
        let min_match_share = self.opt(map, "min_match_share", Self::number);
        let min_match_share = self.check_opt(min_match_share, share);
        let pin_depth_ratio = self.opt(map, "pin_depth_ratio", Self::number);
        let pin_depth_ratio = self.check_opt(pin_depth_ratio, share);
        let unit = self.opt(map, "gate_unit", |v, node, at| {
            v.keyword(node, at, &GateUnit::ALL, GateUnit::as_str)
        });
        let divert_margin = self.opt(map, "divert_margin", Self::duration);
        let wait_floor = match map.null_at("saturation_wait_floor") {
            Some(place) => Ok(Some(Val {
                value: None,
                at: place.origin(),
            })),
            None => self
                .opt(map, "saturation_wait_floor", Self::duration)
                .map(|floor| {
                    floor.map(|Val { value, at }| Val {
                        value: Some(value),
                        at,
                    })
                }),
        };
        let rate = self.opt(map, "prefill_tokens_per_second", Self::integer);
        let rate = self.check_opt(rate, at_least_one);
        let abs_threshold = self.opt(map, "balance_abs_threshold", Self::integer);
        let rel_threshold = self.opt(map, "balance_rel_threshold", Self::number);
        let rel_threshold = self.check_opt(rel_threshold, |factor| {
            RelThreshold::new(factor).ok_or_else(|| {
                format!(
                    "must be greater than 1, got {factor}: the rule compares max > factor × min"
                )
            })
        });
        let cache_threshold = self.opt(map, "cache_threshold", Self::number);
        let cache_threshold = self.check_opt(cache_threshold, share);
        let fallbacks = self.opt(map, "max_fallbacks", Self::integer);
        let fallbacks = self.check_opt(fallbacks, |n| {
            usize::try_from(n)
                .ok()
                .filter(|n| *n <= PolicyConfig::MAX_FALLBACKS_LIMIT)
                .ok_or_else(|| format!("must be at most {}", PolicyConfig::MAX_FALLBACKS_LIMIT))
        });
        let mut given = Vec::new();
        for knob in Knob::ALL {
            if let Some((name, value)) = knob.flag()
                && overrides.and_then(value).is_some()
            {
                given.push((knob, Origin::Flag(name)));
            }
            // `null` is given too: `worker_queue_limit: null` turns the request unit's gate off.
            if let Some((_, at)) = map.get(knob.key()) {
                given.push((knob, at.origin()));
            } else if let Some(place) = map.null_at(knob.key()) {
                given.push((knob, place.origin()));
            }
        }
        let keys = PolicyKeys {
            mode,
            limit,
            floor,
            min_load_choices: choices,
            min_match_tokens,
            min_match_share,
            pin_depth_ratio,
            unit,
            divert_margin,
            wait_floor,
            rate,
            abs_threshold,
            rel_threshold,
            cache_threshold,
            max_fallbacks: fallbacks,
        };
        (keys, given)
    }

    /// A gate threshold: at least 1, or `null` for off (a flag given still replaces the file's value).
    fn switchable(
        &mut self,
        map: &Map,
        knob: Knob,
        overrides: Option<&Overrides>,
    ) -> Field<Switch> {
        let flagged = knob
            .flag()
            .is_some_and(|(_, value)| overrides.and_then(value).is_some());
        if let (Some(place), false) = (map.null_at(knob.key()), flagged) {
            return Ok(Some(Val {
                value: Switch::Off,
                at: place.origin(),
            }));
        }
        let given = self.flagged(map, knob, overrides);
        let given = self.check_opt(given, at_least_one);
        given.map(|given| {
            given.map(|Val { value, at }| Val {
                value: Switch::On(value),
                at,
            })
        })
    }

    /// An integer key that the top level's flag replaces when given (`overrides` are the top level's).
    fn flagged(&mut self, map: &Map, knob: Knob, overrides: Option<&Overrides>) -> Field<u64> {
        let given = self.opt(map, knob.key(), Self::integer);
        match knob.flag() {
            Some((name, value)) => overridden(given, overrides.and_then(value), name),
            None => given,
        }
    }

    /// A scope's policy: its mode (its own, else the parent's, else the default), the mode-specific keys
    /// given here checked against that mode, then every key not given here taken from the parent, and
    /// the policy built from what is in force.
    ///
    /// Over 100 lines: mode, misplaced keys, unit, effective keys and gate resolve in one order,
    /// each step reading the ones before.
    fn resolve_policy(
        &mut self,
        keys: PolicyKeys,
        given: &Given,
        parent: Option<&Resolved>,
    ) -> Resolved {
        let inherits_mode = matches!(keys.mode, Ok(None)) && parent.is_some();
        let mode: Res<Val<ModeKind>> = match (keys.mode.clone(), parent) {
            (Ok(Some(mode)), _) => Ok(mode),
            // A resolved parent's mode is always set; the default stands in should it not be.
            (Ok(None), Some(parent)) => parent.keys.mode.clone().map(|mode| {
                mode.unwrap_or(Val {
                    value: ModeKind::default(),
                    at: Origin::Default,
                })
            }),
            (Ok(None), None) => Ok(Val {
                value: ModeKind::default(),
                at: Origin::Default,
            }),
            (Err(reported), _) => Err(reported),
        };

        // A key the mode does not read is a mistake wherever it was given (file or flag): the operator
        // believes it does something.
        let mut misplaced: Vec<(Knob, Reported)> = Vec::new();
        if let Ok(mode) = &mode {
            for (knob, at) in given.iter().filter(|(knob, _)| knob.mode() != mode.value) {
                let message = format!(
                    "ignored by {}: remove it (it only applies to {})",
                    mode_by(mode, inherits_mode),
                    knob.mode().as_str()
                );
                let reported = self.report(Phase::Cross, at.clone(), message);
                misplaced.push((*knob, reported));
            }
        }
        // The unit in force: this scope's `gate_unit`, else the parent's own; without either, a
        // request-unit key given here or in the parent implies the request unit (the seed's files and
        // flags keep their meaning), else the default. Under `cache_aware`, a gate key of the other unit
        // is the same mistake as a key of another mode.
        let implied = given
            .iter()
            .find(|(knob, _)| knob.unit() == Some(GateUnit::Requests))
            .map(|(knob, at)| (*knob, at.clone()))
            .or_else(|| parent.and_then(|parent| parent.implied.clone()));
        let unset = || Val {
            value: match implied {
                Some(_) => GateUnit::Requests,
                None => GateUnit::default(),
            },
            at: Origin::Default,
        };
        let unit: Res<Val<GateUnit>> = match (keys.unit.clone(), parent) {
            (Ok(Some(unit)), _) => Ok(unit),
            (Ok(None), Some(parent)) => parent.keys.unit.clone().map(|unit| match unit {
                Some(unit) if unit.at != Origin::Default => unit,
                _ => unset(),
            }),
            (Ok(None), None) => Ok(unset()),
            (Err(reported), _) => Err(reported),
        };
        let inherits_unit = matches!(keys.unit, Ok(None)) && parent.is_some();
        if let (Ok(mode), Ok(unit)) = (&mode, &unit)
            && mode.value == ModeKind::CacheAware
        {
            for (knob, at) in given
                .iter()
                .filter(|(knob, _)| knob.unit().is_some_and(|wanted| wanted != unit.value))
            {
                let wanted = knob.unit().map_or("", GateUnit::as_str);
                let message = format!(
                    "ignored by {}: remove it (it only applies to gate_unit {wanted})",
                    unit_by(unit, inherits_unit, implied.as_ref())
                );
                let reported = self.report(Phase::Cross, at.clone(), message);
                misplaced.push((*knob, reported));
            }
        }
        let own = |knob: Knob| misplaced.iter().find(|(k, _)| *k == knob).map(|(_, r)| *r);
        let limit_here = !matches!(keys.limit, Ok(None));
        let floor_here = !matches!(keys.floor, Ok(None));
        // `inherit` for one key, read from this scope and from the parent.
        macro_rules! inherit {
            ($key:ident, $misplaced:expr) => {
                inherit(keys.$key, $misplaced, parent.map(|p| &p.keys.$key))
            };
        }
        let effective = PolicyKeys {
            mode: mode.clone().map(Some),
            limit: inherit!(limit, own(Knob::WorkerQueueLimit)),
            floor: inherit!(floor, own(Knob::SaturationQueueFloor)),
            min_load_choices: inherit!(min_load_choices, own(Knob::MinLoadChoices)),
            min_match_tokens: inherit!(min_match_tokens, own(Knob::MinMatchTokens)),
            min_match_share: inherit!(min_match_share, own(Knob::MinMatchShare)),
            pin_depth_ratio: inherit!(pin_depth_ratio, own(Knob::PinDepthRatio)),
            unit: unit.clone().map(Some),
            divert_margin: inherit!(divert_margin, own(Knob::DivertMargin)),
            wait_floor: inherit!(wait_floor, own(Knob::SaturationWaitFloor)),
            rate: inherit!(rate, own(Knob::PrefillTokensPerSecond)),
            abs_threshold: inherit!(abs_threshold, own(Knob::BalanceAbsThreshold)),
            rel_threshold: inherit!(rel_threshold, own(Knob::BalanceRelThreshold)),
            cache_threshold: inherit!(cache_threshold, own(Knob::CacheThreshold)),
            max_fallbacks: inherit!(max_fallbacks, None),
        };
        // Checked where one of the two is given; a pool that sets neither takes its parent's verdict,
        // so a bad pair at the top level is reported once, not once per pool.
        let gate = match parent {
            Some(parent) if !limit_here && !floor_here => parent.gate,
            _ => self.gate(
                effective.limit.clone(),
                effective.floor.clone(),
                limit_here,
                floor_here,
            ),
        };
        let policy = self.build_policy(&effective, gate);
        Resolved {
            keys: effective,
            gate,
            policy,
            implied,
        }
    }

    /// The policy in force, from keys that each passed their checks (defaults for the absent ones).
    fn build_policy(
        &mut self,
        keys: &PolicyKeys,
        gate: Res<Option<QueueGate>>,
    ) -> Res<PolicyConfig> {
        let mode = keys
            .mode
            .clone()?
            .map_or(ModeKind::default(), |mode| mode.value);
        let max_fallbacks = with_default(
            keys.max_fallbacks.clone(),
            PolicyConfig::DEFAULT_MAX_FALLBACKS,
        )?
        .value;
        let mode = match mode {
            ModeKind::CacheAware => {
                let defaults = CacheAwareKnobs::default();
                let unit = keys
                    .unit
                    .clone()?
                    .map_or(GateUnit::default(), |unit| unit.value);
                let gating = match unit {
                    GateUnit::Requests => Gating::Requests(gate?),
                    GateUnit::PrefillTime => {
                        let wait = WaitGate::default();
                        Gating::PrefillTime(WaitGate {
                            divert_margin: value_or(
                                keys.divert_margin.clone(),
                                wait.divert_margin,
                            )?,
                            floor: value_or(keys.wait_floor.clone(), wait.floor)?,
                            fallback_rate: keys.rate.clone()?.map(|rate| rate.value),
                        })
                    }
                };
                Mode::CacheAware(CacheAwareKnobs {
                    gating,
                    min_load_choices: value_or(
                        keys.min_load_choices.clone(),
                        CacheAwareKnobs::default_min_load_choices(unit),
                    )?,
                    min_match_tokens: value_or(
                        keys.min_match_tokens.clone(),
                        defaults.min_match_tokens,
                    )?,
                    min_match_share: value_or(
                        keys.min_match_share.clone(),
                        CacheAwareKnobs::default_min_match_share(unit),
                    )?,
                    pin_depth_ratio: value_or(
                        keys.pin_depth_ratio.clone(),
                        defaults.pin_depth_ratio,
                    )?,
                })
            }
            ModeKind::RoundRobin => Mode::RoundRobin,
            ModeKind::LeastLoad => Mode::LeastLoad,
            ModeKind::BalanceThreshold => {
                let defaults = BalanceKnobs::default();
                Mode::BalanceThreshold(BalanceKnobs {
                    abs_threshold: value_or(keys.abs_threshold.clone(), defaults.abs_threshold)?,
                    rel_threshold: value_or(keys.rel_threshold.clone(), defaults.rel_threshold)?,
                    cache_threshold: value_or(
                        keys.cache_threshold.clone(),
                        defaults.cache_threshold,
                    )?,
                })
            }
        };
        Ok(PolicyConfig {
            mode,
            max_fallbacks,
        })
    }

    /// The queue gate, once the limit and the floor each passed their own checks. `limit_here` and
    /// `floor_here` say which of the two the scope gave itself (the other is inherited): a disagreement
    /// is reported at the one given here.
    ///
    /// Both are on by default ([`QueueGate::DEFAULT_LIMIT`] and [`QueueGate::DEFAULT_FLOOR`], the floor
    /// never above a limit that was given); `null` turns either off, and a floor without a limit is an
    /// error.
    fn gate(
        &mut self,
        limit: Field<Switch>,
        floor: Field<Switch>,
        limit_here: bool,
        floor_here: bool,
    ) -> Res<Option<QueueGate>> {
        let default = |value: u64| Val {
            value: NonZeroU64::new(value).unwrap_or(NonZeroU64::MIN),
            at: Origin::Default,
        };
        let limit = match limit? {
            None => Some(default(QueueGate::DEFAULT_LIMIT)),
            Some(Val {
                value: Switch::On(limit),
                at,
            }) => Some(Val { value: limit, at }),
            Some(Val {
                value: Switch::Off, ..
            }) => None,
        };
        let floor = match (floor?, &limit) {
            (None, Some(limit)) => Some(default(QueueGate::DEFAULT_FLOOR.min(limit.value.get()))),
            (None, None) => None,
            (
                Some(Val {
                    value: Switch::On(floor),
                    at,
                }),
                _,
            ) => Some(Val { value: floor, at }),
            (
                Some(Val {
                    value: Switch::Off, ..
                }),
                _,
            ) => None,
        };
        match (limit, floor) {
            (limit, None) => Ok(limit.and_then(|limit| QueueGate::new(limit.value, None))),
            (None, Some(floor)) => {
                let message = "requires a queue limit, but policy.worker_queue_limit is null (the gate is \
                               off, so there is no diversion to cancel)";
                Err(self.report(Phase::Cross, floor.at, message))
            }
            (Some(limit), Some(floor)) => match QueueGate::new(limit.value, Some(floor.value)) {
                Some(gate) => Ok(Some(gate)),
                None => {
                    let floor_blamed = floor_here || !limit_here;
                    let named = |val: &Val<NonZeroU64>, key: &str, here: bool| {
                        if here {
                            format!("{} ({})", val.name(key), val.value)
                        } else if val.at == Origin::Default {
                            format!("{key} ({}, the default)", val.value)
                        } else {
                            format!("{key} ({}, inherited from {})", val.value, val.at)
                        }
                    };
                    let message = format!(
                        "{} must be at most {}: a floor above the limit would declare the fleet saturated \
                         while the gate still admits some workers",
                        named(&floor, "saturation_queue_floor", floor_here),
                        named(&limit, "worker_queue_limit", limit_here),
                    );
                    let at = if floor_blamed { floor.at } else { limit.at };
                    Err(self.report(Phase::Cross, at, message))
                }
            },
        }
    }
}

fn share(value: f64) -> Result<DepthRatio, String> {
    DepthRatio::new(value).ok_or_else(|| format!("must be between 0 and 1, got {value}"))
}

/// A gate threshold as written: a value, or `null` for off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    Off,
    On(NonZeroU64),
}

/// Where each mode-specific key of a scope was given: its line, or its flag (both when a flag replaced
/// a key of the file).
type Given = Vec<(Knob, Origin)>;

/// The policy keys of one scope, each checked on its own; `Ok(None)` is absent.
#[derive(Clone)]
struct PolicyKeys {
    mode: Field<ModeKind>,
    limit: Field<Switch>,
    floor: Field<Switch>,
    min_load_choices: Field<NonZeroUsize>,
    min_match_tokens: Field<u64>,
    min_match_share: Field<DepthRatio>,
    pin_depth_ratio: Field<DepthRatio>,
    unit: Field<GateUnit>,
    divert_margin: Field<Duration>,
    /// `Some(None)` is `null`: the time floor off.
    wait_floor: Field<Option<Duration>>,
    rate: Field<NonZeroU64>,
    abs_threshold: Field<u64>,
    rel_threshold: Field<RelThreshold>,
    cache_threshold: Field<DepthRatio>,
    max_fallbacks: Field<usize>,
}

/// A scope's policy once resolved: the keys in force (a pool inherits them), the gate's verdict, and
/// the policy built from them.
pub(super) struct Resolved {
    keys: PolicyKeys,
    gate: Res<Option<QueueGate>>,
    pub(super) policy: Res<PolicyConfig>,
    /// The request-unit key, given here or inherited, that implies the request unit where no
    /// `gate_unit` is set.
    implied: Option<(Knob, Origin)>,
}

impl Resolved {
    /// A section that is not even a mapping: everything in it is already reported.
    fn failed(reported: Reported) -> Resolved {
        Resolved {
            keys: PolicyKeys {
                mode: Err(reported),
                limit: Err(reported),
                floor: Err(reported),
                min_load_choices: Err(reported),
                min_match_tokens: Err(reported),
                min_match_share: Err(reported),
                pin_depth_ratio: Err(reported),
                unit: Err(reported),
                divert_margin: Err(reported),
                wait_floor: Err(reported),
                rate: Err(reported),
                abs_threshold: Err(reported),
                rel_threshold: Err(reported),
                cache_threshold: Err(reported),
                max_fallbacks: Err(reported),
            },
            gate: Err(reported),
            policy: Err(reported),
            implied: None,
        }
    }
}

/// A key in force: the scope's own (rejected if `misplaced`), else the parent's.
fn inherit<T: Clone>(
    own: Field<T>,
    misplaced: Option<Reported>,
    parent: Option<&Field<T>>,
) -> Field<T> {
    if let Some(reported) = misplaced {
        return Err(reported);
    }
    match (own, parent) {
        (Ok(None), Some(parent)) => parent.clone(),
        (own, _) => own,
    }
}

/// How a misplaced key's message names the gate unit in force; `implied` is the request-unit key
/// that implies it where no `gate_unit` is set.
fn unit_by(unit: &Val<GateUnit>, inherited: bool, implied: Option<&(Knob, Origin)>) -> String {
    let name = unit.value.as_str();
    match (&unit.at, implied) {
        (Origin::Default, Some((knob, at))) if unit.value == GateUnit::Requests => {
            let by = match at {
                Origin::Yaml { path, line } => format!("{path} (line {line})"),
                Origin::Flag(flag) => (*flag).to_owned(),
                Origin::Default => knob.key().to_owned(),
            };
            return format!("policy.gate_unit {name}, implied by {by}");
        }
        _ => {}
    }
    match &unit.at {
        Origin::Yaml { path, line } if inherited => {
            format!("{path} {name} (line {line}), which this pool inherits")
        }
        Origin::Yaml { path, line } => format!("{path} {name} (line {line})"),
        Origin::Flag(flag) => format!("{flag} {name}"),
        Origin::Default => format!("policy.gate_unit {name} (the default)"),
    }
}

/// How a misplaced key's message names the mode in force: by its key and line, as the default, or as
/// the top level's when a pool inherits it.
fn mode_by(mode: &Val<ModeKind>, inherited: bool) -> String {
    let name = mode.value.as_str();
    match &mode.at {
        Origin::Yaml { path, line } if inherited => {
            format!("{path} {name} (line {line}), which this pool inherits")
        }
        Origin::Yaml { path, line } => format!("{path} {name} (line {line})"),
        Origin::Flag(flag) => format!("{flag} {name}"),
        Origin::Default => format!("policy.mode {name} (the default)"),
    }
}

//! The fault schedule: what fires when, as fractions of the run so a short run (the CI test) and a long
//! one (`cachepick chaos`) go through the same story, with the seed choosing the workers and jittering
//! the times. Pure: the runner in `super` carries it out.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// A malformed client's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Malformed {
    /// JSON cut off mid-object.
    InvalidJson,
    /// `prompt` an object.
    WrongType,
    /// Bytes that are not UTF-8 inside the prompt string.
    NotUtf8,
    /// Arrays nested far deeper than any request.
    TooDeep,
    /// A model no pool serves.
    UnknownModel,
    /// A body larger than `max_body_bytes`.
    Oversized,
    /// Bytes that are not HTTP at all.
    GarbageBytes,
}

impl Malformed {
    pub const ALL: [Malformed; 7] = [
        Malformed::InvalidJson,
        Malformed::WrongType,
        Malformed::NotUtf8,
        Malformed::TooDeep,
        Malformed::UnknownModel,
        Malformed::Oversized,
        Malformed::GarbageBytes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Malformed::InvalidJson => "invalid_json",
            Malformed::WrongType => "wrong_type",
            Malformed::NotUtf8 => "not_utf8",
            Malformed::TooDeep => "too_deep",
            Malformed::UnknownModel => "unknown_model",
            Malformed::Oversized => "oversized",
            Malformed::GarbageBytes => "garbage_bytes",
        }
    }

    /// Whether Envoy answers it itself, before cachepick sees it (its HTTP codec, its body limit).
    pub fn envoy_answers(self) -> bool {
        matches!(self, Malformed::Oversized | Malformed::GarbageBytes)
    }
}

/// A worker's `/metrics` fault (the simulator's `/admin/metrics` modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsFault {
    /// Accepts the scrape and never answers.
    Hang,
    /// 200 with bytes that are not an exposition.
    Garbage,
}

impl MetricsFault {
    pub fn mode(self) -> &'static str {
        match self {
            MetricsFault::Hang => "hang",
            MetricsFault::Garbage => "garbage",
        }
    }
}

/// One fault.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum Fault {
    /// The worker dies (`/admin/crash`: ports closed, cache and queue lost) and restarts by itself.
    CrashWorker {
        worker: usize,
        #[serde(rename = "down_for_s", serialize_with = "super::seconds")]
        down_for: Duration,
    },
    /// The worker's `/metrics` misbehaves for a while, then is live again.
    Metrics {
        worker: usize,
        mode: MetricsFault,
        #[serde(rename = "for_s", serialize_with = "super::seconds")]
        lasting: Duration,
    },
    /// SIGKILL to the picker process; a new one is started on the same ports after `down_for`.
    KillPicker {
        #[serde(rename = "down_for_s", serialize_with = "super::seconds")]
        down_for: Duration,
    },
    /// Connections to Envoy's listener that send a request's headers a line a second, never ending them.
    Slowloris { connections: usize },
    /// Well-formed requests whose body arrives in small pieces over `over`: slow, but whole.
    BodyTrickle {
        clients: usize,
        #[serde(rename = "over_s", serialize_with = "super::seconds")]
        over: Duration,
    },
    /// Requests that send part of their body and then nothing.
    StalledBody { clients: usize },
    /// One malformed request.
    Malformed { kind: Malformed },
}

/// A fault and when it fires, from the start of the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    #[serde(rename = "at_s", serialize_with = "super::seconds")]
    pub at: Duration,
    #[serde(flatten)]
    pub fault: Fault,
}

/// How big the hostile crowd is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crowd {
    pub slowloris: usize,
    pub trickles: usize,
    pub stalled: usize,
}

/// The schedule of a run of `length` over `workers` workers (at least 2: one is always left serving).
///
/// The story, as fractions of the run: a worker crashes (0.10); one worker's metrics hang (0.20) and
/// another's turn to garbage (0.25), each for 15 %; slowloris connections open (0.05); the picker is
/// killed (0.35) and stays down long enough for Envoy's health check to mark it down, and a worker
/// crashes while it is down (0.38); slow and stalled bodies (0.45); another worker crashes (0.55); the
/// picker is killed and restarted at once (0.70); and one malformed request every 5 % of the run from
/// 0.02, each kind in turn, so some land while the picker is down.
pub fn schedule(length: Duration, workers: usize, crowd: Crowd, seed: u64) -> Vec<Step> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xC4A0_5EED);
    let workers = workers.max(1);
    let at = |fraction: f64, rng: &mut SmallRng| {
        // ±1 % of the run, so seeds differ in timing as well as in workers.
        let jitter = rng.random_range(-0.01..=0.01);
        length.mul_f64((fraction + jitter).clamp(0.0, 1.0))
    };
    let spell = |fraction: f64, floor: Duration| length.mul_f64(fraction).max(floor);
    let pick = |rng: &mut SmallRng, not: &[usize]| -> usize {
        let choices: Vec<usize> = (0..workers).filter(|w| !not.contains(w)).collect();
        let index = rng.random_range(0..choices.len().max(1));
        choices.get(index).copied().unwrap_or(0)
    };
    let first = pick(&mut rng, &[]);
    let hung = pick(&mut rng, &[]);
    let garbled = pick(&mut rng, &[hung]);
    let while_picker_down = pick(&mut rng, &[]);
    let second = pick(&mut rng, &[while_picker_down]);
    let worker_down = spell(0.06, Duration::from_secs(1));
    let metrics = |worker: usize, mode: MetricsFault| Fault::Metrics {
        worker,
        mode,
        lasting: spell(0.15, Duration::from_secs(2)),
    };
    let crash = |worker: usize| Fault::CrashWorker {
        worker,
        down_for: worker_down,
    };
    // The story as (fraction of the run, fault); each time is jittered in this order.
    let story = [
        (
            0.05,
            Fault::Slowloris {
                connections: crowd.slowloris,
            },
        ),
        (0.10, crash(first)),
        (0.20, metrics(hung, MetricsFault::Hang)),
        (0.25, metrics(garbled, MetricsFault::Garbage)),
        // Envoy checks the picker's health every second and marks it down after two failures.
        (
            0.35,
            Fault::KillPicker {
                down_for: spell(0.10, Duration::from_secs(4)),
            },
        ),
        (0.38, crash(while_picker_down)),
        (
            0.45,
            Fault::BodyTrickle {
                clients: crowd.trickles,
                over: spell(0.05, Duration::from_secs(1)).min(Duration::from_secs(10)),
            },
        ),
        (
            0.45,
            Fault::StalledBody {
                clients: crowd.stalled,
            },
        ),
        (0.55, crash(second)),
        (
            0.70,
            Fault::KillPicker {
                down_for: Duration::ZERO,
            },
        ),
    ];
    let mut steps: Vec<Step> = story
        .into_iter()
        .map(|(fraction, fault)| Step {
            at: at(fraction, &mut rng),
            fault,
        })
        .collect();
    let mut kinds = Malformed::ALL.iter().cycle();
    let mut fraction = 0.02;
    while fraction < 0.95 {
        if let Some(&kind) = kinds.next() {
            steps.push(Step {
                at: length.mul_f64(fraction),
                fault: Fault::Malformed { kind },
            });
        }
        fraction += 0.05;
    }
    steps.retain(|step| match step.fault {
        Fault::Slowloris { connections } => connections > 0,
        Fault::BodyTrickle { clients, .. } | Fault::StalledBody { clients } => clients > 0,
        _ => true,
    });
    steps.sort_by_key(|step| step.at);
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    const CROWD: Crowd = Crowd {
        slowloris: 4,
        trickles: 2,
        stalled: 1,
    };

    #[test]
    fn a_seed_gives_one_schedule_and_every_fault_lies_inside_the_run() {
        let length = Duration::from_secs(20);
        let one = schedule(length, 4, CROWD, 7);
        assert_eq!(one, schedule(length, 4, CROWD, 7));
        assert!(one.windows(2).all(|pair| pair[0].at <= pair[1].at));
        assert!(one.iter().all(|step| step.at <= length));
        let kills = one
            .iter()
            .filter(|step| matches!(step.fault, Fault::KillPicker { .. }))
            .count();
        assert_eq!(kills, 2);
        let crashes = one
            .iter()
            .filter(|step| matches!(step.fault, Fault::CrashWorker { .. }))
            .count();
        assert_eq!(crashes, 3);
        let kinds: std::collections::BTreeSet<Malformed> = one
            .iter()
            .filter_map(|step| match step.fault {
                Fault::Malformed { kind } => Some(kind),
                _ => None,
            })
            .collect();
        assert_eq!(kinds.len(), Malformed::ALL.len(), "every kind is sent");
    }

    #[test]
    fn the_picker_stays_down_long_enough_for_envoys_health_check_and_metrics_faults_differ() {
        for seed in 0..20 {
            let steps = schedule(Duration::from_secs(10), 2, CROWD, seed);
            let first_kill = steps.iter().find_map(|step| match step.fault {
                Fault::KillPicker { down_for } if !down_for.is_zero() => Some(down_for),
                _ => None,
            });
            assert!(first_kill >= Some(Duration::from_secs(4)), "{first_kill:?}");
            let metrics: Vec<usize> = steps
                .iter()
                .filter_map(|step| match step.fault {
                    Fault::Metrics { worker, .. } => Some(worker),
                    _ => None,
                })
                .collect();
            assert_eq!(metrics.len(), 2);
            assert_ne!(metrics[0], metrics[1], "seed {seed}");
            assert!(steps.iter().all(|step| match step.fault {
                Fault::CrashWorker { worker, .. } | Fault::Metrics { worker, .. } => worker < 2,
                _ => true,
            }));
        }
        let quiet = Crowd {
            slowloris: 0,
            trickles: 0,
            stalled: 0,
        };
        assert!(
            schedule(Duration::from_secs(10), 4, quiet, 1)
                .iter()
                .all(|step| !matches!(
                    step.fault,
                    Fault::Slowloris { .. } | Fault::BodyTrickle { .. } | Fault::StalledBody { .. }
                ))
        );
    }
}

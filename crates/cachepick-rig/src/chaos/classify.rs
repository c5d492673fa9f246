//! Why a request ended as it did: what the client saw, joined with the line Envoy logged for it (by the
//! `x-chaos-id` header the client sends) and with the run's timeline of faults.
//!
//! The classification is a pure function of those three, so it is tested without a fleet. A cause says
//! whether the fleet *could have served* the request: a request on a worker that died while it was in
//! flight, or sent while no worker was up, could not (the generation was lost with the worker; Envoy
//! retries only what no worker has seen, so a generation never runs twice); anything else that did not
//! end in a served answer could have, and is a loss.

use std::time::Duration;

use serde::Serialize;

/// How a request ended, as its client saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// When it was sent and when its client stopped reading, from the start of the run.
    pub sent: Duration,
    pub ended: Duration,
    /// The response status, if a response began.
    pub status: Option<u16>,
    /// The picker's refusal reason (`x-cachepick-refusal-reason`), if it refused the request.
    pub refusal: Option<String>,
    /// The worker that served it (`x-served-by`), if a worker answered.
    pub served_by: Option<String>,
    /// A 200 whose body arrived whole (with usage).
    pub complete: bool,
    /// How the exchange failed on the client's side, if it did.
    pub failure: Option<ClientFailure>,
}

/// A failure only the client can see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientFailure {
    /// The client's deadline passed.
    Timeout,
    /// No connection to Envoy.
    Connect(String),
    /// The connection or the body broke.
    Broken(String),
}

/// The line Envoy's access log holds for a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Logged {
    pub code: u16,
    /// `%RESPONSE_CODE_DETAILS%`: `via_upstream` for a worker's answer, else why Envoy answered itself.
    pub details: String,
    /// `%RESPONSE_FLAGS%`, e.g. `UF` (upstream connection failure), `UH` (no healthy upstream).
    pub flags: String,
    /// `%UPSTREAM_HOST%`: the last worker Envoy tried.
    pub upstream: Option<String>,
    /// `%UPSTREAM_REQUEST_ATTEMPT_COUNT%`.
    pub attempts: u32,
}

impl Logged {
    /// Parses one line of the JSON access log [`super::stage`] configures, keyed by its `id`.
    pub fn parse(line: &str) -> Option<(String, Logged)> {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        let text = |key: &str| -> Option<String> {
            match value.get(key)? {
                serde_json::Value::String(text) if text != "-" && !text.is_empty() => {
                    Some(text.clone())
                }
                serde_json::Value::Number(number) => Some(number.to_string()),
                _ => None,
            }
        };
        let number = |key: &str| text(key).and_then(|text| text.parse::<u32>().ok());
        let id = text("id")?;
        Some((
            id,
            Logged {
                code: number("code")
                    .and_then(|code| u16::try_from(code).ok())
                    .unwrap_or(0),
                details: text("details").unwrap_or_default(),
                flags: text("flags").unwrap_or_default(),
                upstream: text("upstream"),
                attempts: number("attempts").unwrap_or(0),
            },
        ))
    }
}

/// How long after accepting `/admin/crash` a simulated worker closes its connections (it dies about
/// 20 ms after answering), with room for a loaded machine; where the run saw it die later, from then.
pub const DYING: Duration = Duration::from_millis(250);

/// How long after a worker is seen down its connections may still be closing: it is marked down first,
/// then its connection tasks are aborted, on a runtime a loaded machine may hold up.
pub const CLOSING: Duration = Duration::from_millis(100);

/// How long after a restarted picker is ready Envoy may still fail open past it: its health check of
/// the picker runs every second and one success brings it back, so a check in flight plus the next one,
/// with room for a loaded machine.
pub const ENVOY_NOTICES: Duration = Duration::from_secs(2);

/// A spell during which something was down: a worker (its endpoint) or the picker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Spell {
    pub what: String,
    /// From the start of the run.
    #[serde(rename = "from_s", serialize_with = "super::seconds")]
    pub from: Duration,
    /// When it was back (serving again); `None`: not back by the end of the run.
    #[serde(rename = "to_s", serialize_with = "super::seconds_opt")]
    pub to: Option<Duration>,
    /// A crashed worker: when the run first saw it down; `None` where nobody watched.
    #[serde(
        rename = "dead_s",
        serialize_with = "super::seconds_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub dead: Option<Duration>,
}

impl Spell {
    fn covers(&self, at: Duration) -> bool {
        self.from <= at && self.to.is_none_or(|to| at < to)
    }

    fn overlaps(&self, from: Duration, to: Duration) -> bool {
        self.from <= to && self.to.is_none_or(|end| end >= from)
    }
}

/// What went down and when, as the run carried it out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Timeline {
    /// Every worker's endpoint.
    pub workers: Vec<String>,
    /// Each worker crash: from the crash to the worker serving again.
    pub workers_down: Vec<Spell>,
    /// Each picker kill: from SIGKILL to the restarted picker's readiness.
    pub picker_down: Vec<Spell>,
}

impl Timeline {
    /// Whether `worker` died while a request on it was in flight (sent at `from`, over at `to`). A
    /// spell starts when the worker accepted its crash order; it dies within [`DYING`] of that, or
    /// within [`CLOSING`] of when the run saw it down if that is later (a loaded machine delays the
    /// death), so a request sent in that margin may still have reached it.
    pub fn worker_died_during(&self, worker: &str, from: Duration, to: Duration) -> bool {
        self.workers_down.iter().any(|spell| {
            let reached =
                (spell.from + DYING).max(spell.dead.map_or(spell.from, |dead| dead + CLOSING));
            spell.what == worker && from <= reached && spell.from <= to
        })
    }

    /// Whether at some instant in `[from, to]` every worker was down.
    pub fn no_worker_up_during(&self, from: Duration, to: Duration) -> bool {
        if self.workers.is_empty() {
            return true;
        }
        // Every-worker-down starts at `from` or at the start of some spell inside the window.
        let candidates = std::iter::once(from).chain(
            self.workers_down
                .iter()
                .map(|spell| spell.from)
                .filter(|&at| from <= at && at <= to),
        );
        candidates.into_iter().any(|at| {
            self.workers.iter().all(|worker| {
                self.workers_down
                    .iter()
                    .any(|spell| spell.what == *worker && spell.covers(at))
            })
        })
    }

    /// Whether the picker was out of Envoy's rotation at any time in `[from, to]`: from its kill until
    /// [`ENVOY_NOTICES`] after the restarted picker was ready.
    pub fn picker_down_during(&self, from: Duration, to: Duration) -> bool {
        self.picker_down.iter().any(|spell| {
            let back = spell.to.map(|to| to + ENVOY_NOTICES);
            Spell {
                to: back,
                ..spell.clone()
            }
            .overlaps(from, to)
        })
    }
}

/// Why a request ended as it did.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum Cause {
    /// A 200 read to the end.
    Served,
    /// The picker refused it on purpose: a 4xx with its reason header.
    PickerRefused { status: u16, reason: String },
    /// The picker answered an error of its own (5xx with its reason header, such as `no_workers`).
    PickerError { status: u16, reason: String },
    /// A worker answered a 4xx: the picker was not consulted (it was down, and Envoy failed open), so
    /// the engine refused the body itself.
    WorkerRefused { status: u16 },
    /// The worker that had it died while it was in flight.
    WorkerDied { worker: String },
    /// No worker of the pool was up while it was in flight.
    NoWorkerUp,
    /// Envoy answered it itself, with its response-code-details.
    EnvoyLocalReply { status: u16, details: String },
    /// A worker answered with a server error.
    WorkerError { status: u16 },
    /// A 200 cut off before its end while no worker death explains it.
    StreamCut { details: String },
    /// The client's deadline passed.
    Timeout { details: String },
    /// The client could not reach Envoy, or the connection broke before any response.
    Connection { error: String },
}

impl Cause {
    /// One line for tables: `envoy_local_reply 503 no_healthy_upstream`.
    pub fn label(&self) -> String {
        match self {
            Cause::Served => "served".to_owned(),
            Cause::PickerRefused { status, reason } => format!("picker_refused {status} {reason}"),
            Cause::PickerError { status, reason } => format!("picker_error {status} {reason}"),
            Cause::WorkerRefused { status } => format!("worker_refused {status}"),
            Cause::WorkerDied { .. } => "worker_died_in_flight".to_owned(),
            Cause::NoWorkerUp => "no_worker_up".to_owned(),
            Cause::EnvoyLocalReply { status, details } => {
                format!("envoy_local_reply {status} {details}")
            }
            Cause::WorkerError { status } => format!("worker_error {status}"),
            Cause::StreamCut { details } => format!("stream_cut {details}"),
            Cause::Timeout { details } => format!("timeout {details}"),
            Cause::Connection { error } => format!("connection_error {error}"),
        }
    }

    /// Whether a live worker could have served a well-formed request that ended this way: everything
    /// but a served one, a death of the worker that held it, and a spell with no worker up.
    pub fn servable_loss(&self) -> bool {
        !matches!(
            self,
            Cause::Served | Cause::WorkerDied { .. } | Cause::NoWorkerUp
        )
    }
}

/// The cause of a request's end: from what its client saw, what Envoy logged (`None` when Envoy logged
/// nothing under its id) and the run's timeline.
pub fn classify(seen: &Observed, logged: Option<&Logged>, timeline: &Timeline) -> Cause {
    if seen.complete && seen.status == Some(200) {
        return Cause::Served;
    }
    if let (Some(status), Some(reason)) = (seen.status, &seen.refusal) {
        return if (400..500).contains(&status) {
            Cause::PickerRefused {
                status,
                reason: reason.clone(),
            }
        } else {
            Cause::PickerError {
                status,
                reason: reason.clone(),
            }
        };
    }
    let details = logged.map_or_else(String::new, |logged| logged.details.clone());
    let worker = logged
        .and_then(|logged| logged.upstream.clone())
        .or_else(|| seen.served_by.clone());
    if let Some(worker) = worker
        && timeline.worker_died_during(&worker, seen.sent, seen.ended)
    {
        return Cause::WorkerDied { worker };
    }
    if timeline.no_worker_up_during(seen.sent, seen.ended)
        && (seen.status.is_none_or(|status| status >= 500))
    {
        return Cause::NoWorkerUp;
    }
    match (&seen.failure, seen.status) {
        (Some(ClientFailure::Timeout), _) => Cause::Timeout { details },
        (Some(ClientFailure::Connect(error)), None) => Cause::Connection {
            error: error.clone(),
        },
        (Some(ClientFailure::Broken(error)), None) => Cause::Connection {
            error: if details.is_empty() {
                error.clone()
            } else {
                details
            },
        },
        (_, Some(status)) => {
            let upstream_answered = logged.is_none_or(|logged| logged.details == "via_upstream");
            if status == 200 {
                Cause::StreamCut {
                    details: if details.is_empty() {
                        "no usage".to_owned()
                    } else {
                        details
                    },
                }
            } else if !upstream_answered {
                Cause::EnvoyLocalReply { status, details }
            } else if (400..500).contains(&status) {
                Cause::WorkerRefused { status }
            } else {
                Cause::WorkerError { status }
            }
        }
        (None, None) => Cause::Connection {
            error: "no response".to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "127.0.0.1:8001";
    const B: &str = "127.0.0.1:8002";

    fn s(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn timeline() -> Timeline {
        Timeline {
            workers: vec![A.to_owned(), B.to_owned()],
            workers_down: vec![
                Spell {
                    what: A.to_owned(),
                    from: s(1_000),
                    to: Some(s(2_000)),
                    dead: None,
                },
                Spell {
                    what: B.to_owned(),
                    from: s(1_500),
                    to: Some(s(1_800)),
                    // Seen down 600 ms after its crash order, on a loaded machine.
                    dead: Some(s(2_100)),
                },
            ],
            picker_down: vec![Spell {
                what: "picker".to_owned(),
                from: s(5_000),
                to: None,
                dead: None,
            }],
        }
    }

    fn seen(sent: u64, ended: u64) -> Observed {
        Observed {
            sent: s(sent),
            ended: s(ended),
            ..Observed::default()
        }
    }

    #[test]
    fn a_whole_200_is_served_and_a_picker_refusal_keeps_its_reason() {
        let served = Observed {
            status: Some(200),
            complete: true,
            ..seen(0, 10)
        };
        assert_eq!(classify(&served, None, &timeline()), Cause::Served);
        let refused = Observed {
            status: Some(400),
            refusal: Some("invalid_json".to_owned()),
            ..seen(0, 10)
        };
        let cause = classify(&refused, None, &timeline());
        assert_eq!(cause.label(), "picker_refused 400 invalid_json");
        assert!(cause.servable_loss(), "a good request refused is a loss");
        let no_workers = Observed {
            status: Some(503),
            refusal: Some("no_workers".to_owned()),
            ..seen(0, 10)
        };
        assert_eq!(
            classify(&no_workers, None, &timeline()).label(),
            "picker_error 503 no_workers"
        );
    }

    #[test]
    fn a_cut_stream_is_the_workers_death_only_when_that_worker_crashed_meanwhile() {
        let cut = Observed {
            status: Some(200),
            served_by: Some(A.to_owned()),
            failure: Some(ClientFailure::Broken("reset".to_owned())),
            ..seen(900, 1_100)
        };
        let logged = Logged {
            code: 200,
            details: "upstream_reset_after_response_started{connection_termination}".to_owned(),
            upstream: Some(A.to_owned()),
            ..Logged::default()
        };
        let cause = classify(&cut, Some(&logged), &timeline());
        assert_eq!(
            cause,
            Cause::WorkerDied {
                worker: A.to_owned()
            }
        );
        assert!(!cause.servable_loss());
        // The same cut on a worker that did not crash meanwhile is unexplained, so a loss.
        let later = Observed {
            sent: s(2_500),
            ended: s(2_600),
            ..cut
        };
        let cause = classify(&later, Some(&logged), &timeline());
        assert!(matches!(cause, Cause::StreamCut { .. }), "{cause:?}");
        assert!(cause.servable_loss());
    }

    #[test]
    fn a_request_reset_by_a_worker_that_died_late_on_a_loaded_machine_is_its_death() {
        // B accepted its crash at 1.5 s but was seen down only at 2.1 s: a request sent at 1.9 s,
        // past the usual margin, reached it alive and was reset when it died.
        let reset = Observed {
            status: Some(503),
            ..seen(1_900, 2_150)
        };
        let logged = Logged {
            code: 503,
            details: "upstream_reset_before_response_started{connection_termination}".to_owned(),
            upstream: Some(B.to_owned()),
            ..Logged::default()
        };
        let cause = classify(&reset, Some(&logged), &timeline());
        assert_eq!(
            cause,
            Cause::WorkerDied {
                worker: B.to_owned()
            }
        );
        // Sent after its death had been seen and its connections closed, the same reset is a loss.
        let after = Observed {
            sent: s(2_250),
            ended: s(2_300),
            ..reset
        };
        assert!(classify(&after, Some(&logged), &timeline()).servable_loss());
    }

    #[test]
    fn envoys_own_answers_carry_their_details_and_no_worker_up_is_checked_against_the_timeline() {
        let logged = Logged {
            code: 503,
            details: "no_healthy_upstream".to_owned(),
            flags: "UH".to_owned(),
            ..Logged::default()
        };
        // Both workers were down at 1.6 s.
        let down = Observed {
            status: Some(503),
            ..seen(1_550, 1_600)
        };
        assert_eq!(
            classify(&down, Some(&logged), &timeline()),
            Cause::NoWorkerUp
        );
        // At 3 s both were up: the same answer is a loss.
        let up = Observed {
            status: Some(503),
            ..seen(3_000, 3_050)
        };
        let cause = classify(&up, Some(&logged), &timeline());
        assert_eq!(cause.label(), "envoy_local_reply 503 no_healthy_upstream");
        assert!(cause.servable_loss());
        // A worker's own answers are told apart from Envoy's.
        let upstream = Logged {
            code: 400,
            details: "via_upstream".to_owned(),
            ..Logged::default()
        };
        let refused = Observed {
            status: Some(400),
            ..seen(3_000, 3_050)
        };
        assert_eq!(
            classify(&refused, Some(&upstream), &timeline()),
            Cause::WorkerRefused { status: 400 }
        );
    }

    #[test]
    fn client_side_failures_are_timeouts_or_connection_errors() {
        let timeout = Observed {
            failure: Some(ClientFailure::Timeout),
            ..seen(3_000, 9_000)
        };
        assert!(matches!(
            classify(&timeout, None, &timeline()),
            Cause::Timeout { .. }
        ));
        let refused = Observed {
            failure: Some(ClientFailure::Connect("refused".to_owned())),
            ..seen(3_000, 3_001)
        };
        assert_eq!(
            classify(&refused, None, &timeline()).label(),
            "connection_error refused"
        );
    }

    #[test]
    fn the_picker_down_window_is_open_until_it_is_ready_again() {
        let mut timeline = timeline();
        assert!(!timeline.picker_down_during(s(0), s(4_999)));
        assert!(timeline.picker_down_during(s(4_000), s(5_000)));
        assert!(timeline.picker_down_during(s(60_000), s(60_001)));
        assert!(!timeline.no_worker_up_during(s(0), s(1_400)));
        assert!(timeline.no_worker_up_during(s(1_400), s(1_600)));
        // Back at 6 s: Envoy may route past it until 8 s.
        timeline.picker_down[0].to = Some(s(6_000));
        assert!(timeline.picker_down_during(s(7_900), s(7_950)));
        assert!(!timeline.picker_down_during(s(8_100), s(9_000)));
    }

    #[test]
    fn envoys_json_lines_parse_with_numbers_or_strings_and_dashes_as_absent() {
        let line = r#"{"id":"17","code":503,"details":"upstream_reset_before_response_started{connection_termination}","flags":"UC","upstream":"127.0.0.1:8001","attempts":1}"#;
        let (id, logged) = Logged::parse(line).expect("parses");
        assert_eq!(id, "17");
        assert_eq!(logged.code, 503);
        assert_eq!(logged.upstream.as_deref(), Some("127.0.0.1:8001"));
        let line =
            r#"{"id":"18","code":"0","details":"-","flags":null,"upstream":null,"attempts":null}"#;
        let (_, logged) = Logged::parse(line).expect("parses");
        assert_eq!(logged.details, "");
        assert_eq!(logged.upstream, None);
        assert_eq!(Logged::parse("not json"), None);
        assert_eq!(Logged::parse(r#"{"id":null}"#), None);
    }
}

//! The roster as tables of steps: each step is something discovery, a scrape, a KV event stream or
//! the clock does, and each row says what the published snapshot and the observers show after it.
//! Unless a test says otherwise `unreachable_after` is 2, `freshness` 3s and `drain_timeout` 30s, and
//! workers are `10.0.0.1:<port>`.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus::IntCounter;

use super::*;
use crate::config::{self, Config, LoadConfig, Overrides};
use crate::load::DispatchCounts;
use crate::load::engine::{Progress, RankLoad};
use crate::load::snapshot::EngineLoad;

const FRESHNESS: Duration = Duration::from_secs(3);
const DRAIN: Duration = Duration::from_secs(30);
const SECOND: Duration = Duration::from_secs(1);
const MILLI: Duration = Duration::from_millis(1);

fn endpoint(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

/// A pool of the file's workers at `ports`, with `extra` pool keys.
fn config(ports: &[u16], extra: &str) -> Config {
    let mut yaml = String::from(
        "load: {freshness: 3s, drain_timeout: 30s, unreachable_after: 2}\npools:\n  - model: m\n    \
         engine: vllm\n",
    );
    yaml.push_str(extra);
    yaml.push_str("    workers:\n");
    for port in ports {
        yaml.push_str(&format!("      - {{endpoint: \"{}\"}}\n", endpoint(*port)));
    }
    config::parse(&yaml, "test.yaml", &Overrides::default()).expect("valid test config")
}

/// What an observer was told, and whether the published snapshot already showed it then.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Told {
    Joined(u32, u16),
    Left(u32),
    Restarted(u32),
    /// The metrics dropped the worker's counters.
    Forgotten(u16),
}

/// Both observers in one: records every call, and checks the snapshot is not ahead of it.
#[derive(Default)]
struct Recorder {
    told: Mutex<Vec<Told>>,
    pool: Mutex<Option<Arc<PoolLoad>>>,
    counters: Mutex<BTreeMap<(String, &'static str), IntCounter>>,
    /// Each restart's slot, and the restarts the published snapshot showed when it was told.
    incarnations: Mutex<Vec<(u32, u64)>>,
}

impl Recorder {
    fn take(&self) -> Vec<Told> {
        std::mem::take(&mut *self.told.lock().unwrap())
    }

    fn published(&self) -> Arc<PoolSnapshot> {
        self.pool.lock().unwrap().as_ref().unwrap().snapshot()
    }

    fn scrapes(&self, port: u16, outcome: ScrapeOutcome) -> u64 {
        self.counters.lock().unwrap()[&(endpoint(port).to_string(), outcome.as_str())].get()
    }
}

impl ScrapeObserver for Recorder {
    fn scrape_counter(&self, _: &str, worker: &str, outcome: ScrapeOutcome) -> IntCounter {
        let counter = IntCounter::new("scrapes", "scrapes").unwrap();
        self.counters
            .lock()
            .unwrap()
            .insert((worker.to_owned(), outcome.as_str()), counter.clone());
        counter
    }

    fn watch_pool(&self, _: Arc<PoolLoad>) {}

    fn worker_left(&self, _: &str, worker: &str) {
        let port = worker.parse::<SocketAddr>().unwrap().port();
        self.told.lock().unwrap().push(Told::Forgotten(port));
    }
}

impl RosterObserver for Recorder {
    fn joined(&self, id: WorkerId, worker: &WorkerConfig) {
        // Told before publication: a newcomer is not in the published snapshot yet, unless it was
        // there from the start (the file's workers, announced when the observer is attached).
        let published = self.published();
        let shown = published.by_endpoint(worker.endpoint);
        assert!(
            shown.is_none() || published.version == 0,
            "joined after publication"
        );
        let told = Told::Joined(id.0, worker.endpoint.port());
        self.told.lock().unwrap().push(told);
    }

    fn left(&self, id: WorkerId) {
        assert!(
            self.published().worker(id).is_some(),
            "left after publication"
        );
        self.told.lock().unwrap().push(Told::Left(id.0));
    }

    fn restarted(&self, id: WorkerId) {
        let published = self.published();
        let state = published.worker(id).expect("restarted worker is published");
        let seen = (id.0, state.incarnation);
        self.incarnations.lock().unwrap().push(seen);
        self.told.lock().unwrap().push(Told::Restarted(id.0));
    }
}

/// One thing that happens to the roster.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Discovery wants exactly these workers.
    Discover(&'static [u16]),
    /// A scrape sent now answers at once: `waiting` queued, `running` running, from the engine run
    /// that started at `run`.
    Answer {
        port: u16,
        waiting: u64,
        running: u64,
        run: f64,
    },
    /// A scrape sent now cannot connect.
    Refused(u16),
    /// A scrape sent now times out.
    TimedOut(u16),
    /// A scrape sent now times out, the worker having shown it is alive while it was out (a KV event
    /// batch, a response it served).
    TimedOutHeard(u16),
    /// A scrape sent now answers with a body that is not text.
    Garbled(u16),
    /// A scrape is sent now and answers later (`Finish`).
    Start(u16),
    /// The scrape `Start` sent answers now, idle, from the same run as before.
    Finish(u16),
    /// A KV event stream reports that the worker's engine restarted.
    EventRestart(u16),
    /// Time passes, and the roster's timers run.
    Wait(Duration),
}

use Lifecycle::{Draining, Healthy, Late, New, Restarted, Unreachable};
use Step::*;

/// One row of a published snapshot: port, slot, generation, state, restarts seen.
type Row = (u16, u32, u64, Lifecycle, u64);

/// A step and what follows from it: the published roster, and what the observers were told.
type Case = (Step, &'static [Row], &'static [Told]);

struct Harness {
    roster: Roster,
    recorder: Arc<Recorder>,
    config: Config,
    now: Instant,
    /// Scrapes sent by `Start`, by port.
    sent: BTreeMap<u16, (Scrape, Instant)>,
    /// The engine run each worker last answered from.
    runs: BTreeMap<u16, f64>,
}

impl Harness {
    fn new(ports: &[u16]) -> Harness {
        Harness::with(ports, "")
    }

    fn with(ports: &[u16], extra: &str) -> Harness {
        let config = config(ports, extra);
        let pool = PoolLoad::new(&config.pools[0], &config.load);
        let recorder = Arc::new(Recorder::default());
        *recorder.pool.lock().unwrap() = Some(Arc::clone(&pool));
        let now = Instant::now();
        let mut roster = Roster::new(&config.pools[0], &config.load, pool, recorder.clone(), now);
        roster.observe(recorder.clone());
        Harness {
            roster,
            recorder,
            config,
            now,
            sent: BTreeMap::new(),
            runs: BTreeMap::new(),
        }
    }

    fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.roster.pool.snapshot()
    }

    fn id(&self, port: u16) -> WorkerId {
        self.snapshot()
            .by_endpoint(endpoint(port))
            .unwrap_or_else(|| panic!("worker {port} is in the pool"))
            .id
    }

    fn rows(&self) -> Vec<Row> {
        self.snapshot()
            .workers()
            .iter()
            .map(|w| {
                let port = w.endpoint.port();
                (port, w.id.0, w.generation, w.lifecycle, w.incarnation)
            })
            .collect()
    }

    /// Applies a result for a scrape of `port` sent at `sent`.
    fn deliver(
        &mut self,
        port: u16,
        (scrape, sent): (Scrape, Instant),
        result: Result<Report, ScrapeError>,
    ) {
        let fetched = scrape.finished(sent, result);
        if let Ok(report) = &fetched.result {
            self.runs
                .insert(port, report.identity.start_time.unwrap_or_default());
        }
        self.roster.apply(fetched, self.now);
    }

    /// Starts a scrape of `port` now.
    fn begin(&mut self, port: u16) -> (Scrape, Instant) {
        let id = self.id(port);
        let scrape = self.roster.begin_scrape(id).expect("the slot has a worker");
        (scrape, self.now)
    }

    fn step(&mut self, step: Step) {
        match step {
            Discover(ports) => {
                let template = &self.config.pools[0].template;
                let desired: Vec<WorkerConfig> = ports
                    .iter()
                    .map(|port| template.worker(endpoint(*port)))
                    .collect();
                self.roster.reconcile(&desired, self.now);
            }
            Answer {
                port,
                waiting,
                running,
                run,
            } => {
                let scrape = self.begin(port);
                self.deliver(port, scrape, Ok(report(&[Some((waiting, running))], run)));
            }
            Refused(port) => {
                let scrape = self.begin(port);
                let error = ScrapeError::Connect("Connection refused".into());
                self.deliver(port, scrape, Err(error));
            }
            TimedOut(port) => {
                let scrape = self.begin(port);
                self.deliver(
                    port,
                    scrape,
                    Err(ScrapeError::Timeout(Duration::from_millis(500))),
                );
            }
            TimedOutHeard(port) => {
                let scrape = self.begin(port);
                let id = self.id(port);
                self.roster
                    .pool
                    .heard_from(id, self.now + Duration::from_millis(100));
                self.deliver(
                    port,
                    scrape,
                    Err(ScrapeError::Timeout(Duration::from_millis(500))),
                );
            }
            Garbled(port) => {
                let scrape = self.begin(port);
                self.deliver(port, scrape, Err(ScrapeError::NotUtf8));
            }
            Start(port) => {
                let scrape = self.begin(port);
                self.sent.insert(port, scrape);
            }
            Finish(port) => {
                let scrape = self.sent.remove(&port).expect("a scrape was sent");
                let run = self.runs.get(&port).copied().unwrap_or(1.0);
                self.deliver(port, scrape, Ok(report(&[Some((0, 0))], run)));
            }
            EventRestart(port) => {
                let id = self.id(port);
                self.roster.mark_restarted(id, self.now);
            }
            Wait(duration) => {
                self.now += duration;
                self.roster.expire(self.now);
            }
        }
        self.roster.publish();
    }

    /// Runs every case in order, checking the published snapshot and the observers after each.
    fn run(&mut self, cases: &[Case]) {
        // The file's workers, announced when the observer was attached.
        self.recorder.take();
        for (number, (step, rows, told)) in cases.iter().enumerate() {
            self.step(*step);
            assert_eq!(self.rows(), *rows, "roster after step {number} ({step:?})");
            assert_eq!(
                self.recorder.take(),
                *told,
                "observers after step {number} ({step:?})"
            );
            // Told before publication: the snapshot showed the restart only after.
            for (slot, seen) in std::mem::take(&mut *self.recorder.incarnations.lock().unwrap()) {
                let now = self.snapshot().worker(WorkerId(slot)).unwrap().incarnation;
                assert_eq!(
                    now,
                    seen + 1,
                    "restart of slot {slot} told before publication"
                );
            }
        }
    }
}

/// A report of `(waiting, running)` per rank (`None`: the rank is missing) from the run that started
/// at `run`.
fn report(ranks: &[Option<(u64, u64)>], run: f64) -> Report {
    Report {
        ranks: ranks
            .iter()
            .map(|rank| {
                rank.map(|(waiting, running)| RankLoad {
                    waiting,
                    running,
                    ..RankLoad::default()
                })
            })
            .collect(),
        malformed: 0,
        identity: Identity {
            start_time: Some(run),
            served: None,
        },
        progress: Progress::default(),
    }
}

fn answer(port: u16, waiting: u64, running: u64) -> Step {
    Answer {
        port,
        waiting,
        running,
        run: 1.0,
    }
}

#[test]
fn the_files_workers_start_new_in_their_positions_and_are_announced_as_joining() {
    let harness = Harness::new(&[8000, 8001]);
    assert_eq!(harness.rows(), [(8000, 0, 0, New, 0), (8001, 1, 0, New, 0)]);
    assert_eq!(
        harness.recorder.take(),
        [Told::Joined(0, 8000), Told::Joined(1, 8001)]
    );
}

#[test]
fn joiners_take_the_lowest_free_slots_with_new_generations_and_serve_once_they_answer() {
    Harness::new(&[8000]).run(&[
        (answer(8000, 0, 1), &[(8000, 0, 0, Healthy, 0)], &[]),
        (
            // By endpoint, so the order discovery lists them in does not matter.
            Discover(&[8000, 8002, 8001]),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 1, New, 0),
                (8002, 2, 2, New, 0),
            ],
            &[Told::Joined(1, 8001), Told::Joined(2, 8002)],
        ),
        (
            // A new worker stays new until it answers, however many scrapes fail...
            Refused(8001),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 1, New, 0),
                (8002, 2, 2, New, 0),
            ],
            &[],
        ),
        (
            // ...unless they are enough to make it unreachable.
            TimedOut(8001),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 1, Unreachable, 0),
                (8002, 2, 2, New, 0),
            ],
            &[],
        ),
        (
            answer(8002, 0, 0),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 1, Unreachable, 0),
                (8002, 2, 2, Healthy, 0),
            ],
            &[],
        ),
        (
            answer(8001, 0, 0),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 1, Healthy, 0),
                (8002, 2, 2, Healthy, 0),
            ],
            &[],
        ),
    ]);
}

#[test]
fn a_worker_is_unreachable_after_unreachable_after_unanswered_scrapes_in_a_row() {
    let silent = LoadConfig::DEFAULT_SILENT_AFTER + Duration::from_secs(1);
    Harness::new(&[8000]).run(&[
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Refused(8000), &[(8000, 0, 0, Healthy, 0)], &[]),
        // Any answer, even one that cannot be read, ends the run of failures.
        (Garbled(8000), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Refused(8000), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Refused(8000), &[(8000, 0, 0, Unreachable, 0)], &[]),
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
        // A scrape that times out is late: an owner still, however many in a row, while the worker
        // answered within silent_after.
        (TimedOut(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Late, 0)], &[]),
        // Silent for longer: its timeouts count, and two in a row is gone.
        (Wait(silent), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Unreachable, 0)], &[]),
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
    ]);
}

#[test]
fn a_worker_heard_from_otherwise_stays_late_past_its_silence() {
    let silent = LoadConfig::DEFAULT_SILENT_AFTER + Duration::from_secs(1);
    Harness::new(&[8000]).run(&[
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Wait(silent), &[(8000, 0, 0, Healthy, 0)], &[]),
        // A busy engine's `/metrics` answers last; its KV events and its responses still arrive.
        (TimedOutHeard(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOutHeard(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOutHeard(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (Wait(silent), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOutHeard(8000), &[(8000, 0, 0, Late, 0)], &[]),
        // Heard from no more: after its silence, two timeouts in a row make it unreachable.
        (Wait(silent), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Late, 0)], &[]),
        (TimedOut(8000), &[(8000, 0, 0, Unreachable, 0)], &[]),
        // Refused is gone whatever was heard: a closed port is no busy API server.
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Refused(8000), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Refused(8000), &[(8000, 0, 0, Unreachable, 0)], &[]),
    ]);
}

#[test]
fn a_drained_worker_leaves_when_idle_unreachable_or_out_of_time_and_frees_its_slot() {
    Harness::new(&[8000, 8001, 8002]).run(&[
        (
            answer(8000, 2, 1),
            &[
                (8000, 0, 0, Healthy, 0),
                (8001, 1, 0, New, 0),
                (8002, 2, 0, New, 0),
            ],
            &[],
        ),
        (
            Discover(&[]),
            &[
                (8000, 0, 0, Draining, 0),
                (8001, 1, 0, Draining, 0),
                (8002, 2, 0, Draining, 0),
            ],
            &[],
        ),
        (
            // Still busy: it keeps serving what it was sent.
            answer(8000, 1, 1),
            &[
                (8000, 0, 0, Draining, 0),
                (8001, 1, 0, Draining, 0),
                (8002, 2, 0, Draining, 0),
            ],
            &[],
        ),
        (
            Wait(SECOND),
            &[
                (8000, 0, 0, Draining, 0),
                (8001, 1, 0, Draining, 0),
                (8002, 2, 0, Draining, 0),
            ],
            &[],
        ),
        (
            // Idle in a newer reading: gone.
            answer(8000, 0, 0),
            &[(8001, 1, 0, Draining, 0), (8002, 2, 0, Draining, 0)],
            &[Told::Left(0), Told::Forgotten(8000)],
        ),
        (
            // Unreachable while draining: gone at the first unanswered scrape.
            Refused(8001),
            &[(8002, 2, 0, Draining, 0)],
            &[Told::Left(1), Told::Forgotten(8001)],
        ),
        (
            Wait(DRAIN - SECOND - MILLI),
            &[(8002, 2, 0, Draining, 0)],
            &[],
        ),
        (Wait(MILLI), &[], &[Told::Left(2), Told::Forgotten(8002)]),
    ]);
}

#[test]
fn a_worker_listed_again_while_draining_stays_and_one_listed_after_leaving_rejoins_as_new() {
    Harness::new(&[8000, 8001]).run(&[
        (
            answer(8000, 0, 1),
            &[(8000, 0, 0, Healthy, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        (
            Discover(&[8001]),
            &[(8000, 0, 0, Draining, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        // Back before it left: the same slot and generation, in the state its scrapes say.
        (
            Discover(&[8000, 8001]),
            &[(8000, 0, 0, Healthy, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        (
            Discover(&[8001]),
            &[(8000, 0, 0, Draining, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        (
            Wait(SECOND),
            &[(8000, 0, 0, Draining, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        (
            answer(8000, 0, 0),
            &[(8001, 1, 0, New, 0)],
            &[Told::Left(0), Told::Forgotten(8000)],
        ),
        (
            // Back after it left: a newcomer in the lowest free slot, with a new generation.
            Discover(&[8000, 8001]),
            &[(8000, 0, 1, New, 0), (8001, 1, 0, New, 0)],
            &[Told::Joined(0, 8000)],
        ),
    ]);
}

#[test]
fn a_restart_bumps_the_incarnation_and_ends_one_freshness_later() {
    Harness::new(&[8000, 8001]).run(&[
        (
            answer(8000, 0, 0),
            &[(8000, 0, 0, Healthy, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        // The same run answering again is no restart.
        (
            answer(8000, 1, 0),
            &[(8000, 0, 0, Healthy, 0), (8001, 1, 0, New, 0)],
            &[],
        ),
        (
            Answer {
                port: 8000,
                waiting: 0,
                running: 0,
                run: 2.0,
            },
            &[(8000, 0, 0, Restarted, 1), (8001, 1, 0, New, 0)],
            &[Told::Restarted(0)],
        ),
        (
            // A KV event stream saw it too, or again: each report is a restart.
            EventRestart(8000),
            &[(8000, 0, 0, Restarted, 2), (8001, 1, 0, New, 0)],
            &[Told::Restarted(0)],
        ),
        (
            EventRestart(8001),
            &[(8000, 0, 0, Restarted, 2), (8001, 1, 0, Restarted, 1)],
            &[Told::Restarted(1)],
        ),
        (
            // An unanswered scrape ends the restarted state early: the worker is judged by its
            // failures, as any other.
            Refused(8001),
            &[(8000, 0, 0, Restarted, 2), (8001, 1, 0, Healthy, 1)],
            &[],
        ),
        (
            Refused(8001),
            &[(8000, 0, 0, Restarted, 2), (8001, 1, 0, Unreachable, 1)],
            &[],
        ),
        (
            Wait(FRESHNESS - MILLI),
            &[(8000, 0, 0, Restarted, 2), (8001, 1, 0, Unreachable, 1)],
            &[],
        ),
        (
            Wait(MILLI),
            &[(8000, 0, 0, Healthy, 2), (8001, 1, 0, Unreachable, 1)],
            &[],
        ),
        (
            Discover(&[8001]),
            &[(8000, 0, 0, Draining, 2), (8001, 1, 0, Unreachable, 1)],
            &[],
        ),
        (
            // A draining worker's restart is not news: it is leaving anyway.
            EventRestart(8000),
            &[(8000, 0, 0, Draining, 2), (8001, 1, 0, Unreachable, 1)],
            &[],
        ),
    ]);
}

#[test]
fn a_restart_seen_in_a_scrape_drops_the_old_runs_samples() {
    let mut harness = Harness::new(&[8000]);
    harness.step(answer(8000, 5, 5));
    harness.step(Wait(SECOND));
    harness.step(Answer {
        port: 8000,
        waiting: 1,
        running: 0,
        run: 2.0,
    });
    let reading = harness.snapshot().workers()[0].reading.unwrap();
    assert_eq!((reading.load.waiting, reading.load.running), (1, 0));
    assert_eq!(
        reading.captured_at, harness.now,
        "only the new run's sample"
    );
}

#[test]
fn a_reading_requested_from_a_slots_earlier_occupant_is_discarded() {
    let mut harness = Harness::new(&[8000]);
    harness.run(&[
        (answer(8000, 0, 0), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Start(8000), &[(8000, 0, 0, Healthy, 0)], &[]),
        (Discover(&[]), &[(8000, 0, 0, Draining, 0)], &[]),
        (Wait(DRAIN), &[], &[Told::Left(0), Told::Forgotten(8000)]),
        (
            Discover(&[8001]),
            &[(8001, 0, 1, New, 0)],
            &[Told::Joined(0, 8001)],
        ),
        // The old occupant's scrape of slot 0 arrives: it says nothing of the new one.
        (Finish(8000), &[(8001, 0, 1, New, 0)], &[]),
    ]);
    let newcomer = harness.snapshot().workers()[0].clone();
    assert_eq!((newcomer.reading, newcomer.scrape.attempts), (None, 0));
    assert_eq!(harness.recorder.scrapes(8001, ScrapeOutcome::Ok), 0);
}

#[test]
fn a_worker_with_a_scrape_in_flight_is_not_started_again_and_failing_ones_go_last() {
    let mut harness = Harness::new(&[8000, 8001, 8002]);
    harness.step(Refused(8000));
    harness.step(answer(8002, 0, 0));
    assert_eq!(
        harness.roster.idle_healthy_first(),
        [WorkerId(1), WorkerId(2), WorkerId(0)],
        "never scraped and answered first, by slot; failing last"
    );
    harness.step(Start(8001));
    assert_eq!(
        harness.roster.idle_healthy_first(),
        [WorkerId(2), WorkerId(0)]
    );
    harness.step(Finish(8001));
    assert_eq!(
        harness.roster.idle_healthy_first(),
        [WorkerId(1), WorkerId(2), WorkerId(0)]
    );
}

#[test]
fn a_reading_is_fresh_for_one_freshness_and_a_failed_scrape_leaves_it_to_age_out() {
    let mut harness = Harness::new(&[8000]);
    let id = WorkerId(0);
    harness.step(answer(8000, 3, 1));
    let taken = harness.now;
    let load = |harness: &Harness, at: Instant| harness.snapshot().fresh_load(id, at).copied();
    let expected = EngineLoad {
        waiting: 3,
        running: 1,
        ..EngineLoad::default()
    };
    assert_eq!(load(&harness, taken), Some(expected));
    harness.step(Wait(SECOND));
    harness.step(Refused(8000));
    let worker = harness.snapshot().workers()[0].clone();
    assert_eq!(
        worker.reading.map(|reading| reading.captured_at),
        Some(taken),
        "the old samples stay"
    );
    assert_eq!(
        worker.scrape.last_outcome,
        Some(ScrapeOutcome::ConnectError)
    );
    assert_eq!(
        worker.scrape.last_error.as_deref(),
        Some("cannot connect: Connection refused")
    );
    assert_eq!(load(&harness, taken + FRESHNESS - MILLI), Some(expected));
    assert_eq!(load(&harness, taken + FRESHNESS), None, "aged out");
    assert_eq!(
        (
            harness.recorder.scrapes(8000, ScrapeOutcome::Ok),
            harness.recorder.scrapes(8000, ScrapeOutcome::ConnectError)
        ),
        (1, 1)
    );
}

#[test]
fn a_reading_missing_a_rank_is_incomplete_and_never_fresh() {
    let mut harness = Harness::new(&[8001]);
    let mut worker = harness.config.pools[0].template.worker(endpoint(8000));
    worker.dp_size = NonZeroU32::new(2).unwrap();
    harness.roster.reconcile(&[worker], harness.now);
    harness.roster.publish();
    let id = harness.id(8000);
    let scrape = harness.begin(8000);
    harness.deliver(8000, scrape, Ok(report(&[Some((1, 1)), None], 1.0)));
    harness.roster.publish();
    let snapshot = harness.snapshot();
    let state = snapshot.worker(id).unwrap();
    assert!(!state.reading.unwrap().complete);
    assert_eq!(
        state.scrape.last_error.as_deref(),
        Some("rank 1 missing from the last response")
    );
    assert_eq!(snapshot.fresh_load(id, harness.now), None);
    // The missing rank answers next time: the sum is complete, stamped with the older rank's time.
    let first = harness.now;
    harness.now += SECOND;
    let scrape = harness.begin(8000);
    harness.deliver(8000, scrape, Ok(report(&[None, Some((2, 0))], 1.0)));
    harness.roster.publish();
    let reading = harness.snapshot().worker(id).unwrap().reading.unwrap();
    assert_eq!(
        (
            reading.complete,
            reading.captured_at,
            reading.load.waiting,
            reading.load.running
        ),
        (true, first, 3, 1)
    );
}

#[test]
fn a_newer_complete_reading_forgets_the_dispatches_it_covers_and_a_restart_all_of_them() {
    let mut harness = Harness::new(&[8000]);
    let id = WorkerId(0);
    let record = |harness: &Harness, count: u64| {
        (0..count).for_each(|_| harness.roster.pool.dispatches().record(id, 0));
    };
    let counted = |harness: &Harness| harness.roster.pool.dispatches().since_reading(id);
    record(&harness, 3);
    harness.step(Start(8000));
    record(&harness, 2);
    harness.step(Finish(8000));
    assert_eq!(counted(&harness), 2, "sent while the scrape was out");
    // A reading no newer than the last (requested at the same instant) covers nothing more.
    harness.step(Start(8000));
    harness.step(Finish(8000));
    assert_eq!(counted(&harness), 2);
    harness.step(EventRestart(8000));
    assert_eq!(counted(&harness), 0);
}

#[test]
fn a_readings_waiting_count_is_priced_by_the_requests_routed_before_it_was_requested() {
    let mut harness = Harness::new(&[8000]);
    let id = WorkerId(0);
    let pool = Arc::clone(&harness.roster.pool);
    for tokens in [5_000, 200, 40_000] {
        pool.dispatches().record(id, tokens);
    }
    let scrape = harness.begin(8000);
    // Routed while the scrape was out: not among the two the reading counts as waiting.
    pool.dispatches().record(id, 90_000);
    harness.deliver(8000, scrape, Ok(report(&[Some((2, 1))], 1.0)));
    harness.roster.publish();
    let prefill = harness.snapshot().workers()[0].prefill;
    assert_eq!(
        (prefill.waiting_routed_tokens, prefill.routed_per_request),
        (Some(40_200), Some(15_066))
    );
    // A later idle reading prices an empty queue at nothing.
    harness.step(Wait(Duration::from_millis(100)));
    harness.step(answer(8000, 0, 0));
    let prefill = harness.snapshot().workers()[0].prefill;
    assert_eq!(prefill.waiting_routed_tokens, Some(0));
}

#[test]
fn arrivals_from_every_router_scale_the_time_units_window_but_never_the_request_count() {
    let mut harness = Harness::new(&[8000]);
    let id = WorkerId(0);
    // This replica sends one request of 100 uncached tokens per reading; the engine's first tokens
    // show three arrivals per reading: two other replicas send as many.
    for reading in 0..200_u32 {
        harness.roster.pool.dispatches().record(id, 100);
        let scrape = harness.begin(8000);
        let mut answered = report(&[Some((0, 0))], 1.0);
        answered.progress.first_tokens = Some(f64::from(reading) * 3.0);
        harness.deliver(8000, scrape, Ok(answered));
        harness.step(Wait(Duration::from_millis(10)));
    }
    let dispatches = harness.roster.pool.dispatches();
    assert!(
        (dispatches.share() - 3.0).abs() < 0.1,
        "{}",
        dispatches.share()
    );
    dispatches.record(id, 100);
    assert_eq!(
        dispatches.since_reading(id),
        1,
        "the seed's count is the replica's own"
    );
    let scaled = dispatches.uncached_since_reading(id);
    assert!((290..=310).contains(&scaled), "{scaled}");
    // A restart's counters start over: the share is kept, the worker's baseline is not.
    let scrape = harness.begin(8000);
    harness.deliver(8000, scrape, Ok(report(&[Some((0, 0))], 2.0)));
    assert!((harness.roster.pool.dispatches().share() - 3.0).abs() < 0.1);
}

#[test]
fn one_replica_alone_reads_a_share_of_one() {
    let mut harness = Harness::new(&[8000]);
    let id = WorkerId(0);
    for reading in 0..200_u32 {
        // Two sent per reading, two arrive; the queue grows and drains as readings fall late or early.
        (0..2).for_each(|_| harness.roster.pool.dispatches().record(id, 50));
        let waiting = [0, 1, 0, 0][reading as usize % 4];
        let scrape = harness.begin(8000);
        let mut answered = report(&[Some((waiting, 0))], 1.0);
        answered.progress.first_tokens = Some(f64::from(reading * 2) - waiting as f64);
        harness.deliver(8000, scrape, Ok(answered));
        harness.step(Wait(Duration::from_millis(10)));
    }
    let share = harness.roster.pool.dispatches().share();
    assert!((1.0..1.05).contains(&share), "{share}");
}

#[test]
fn followers_hear_of_a_roster_change_only_when_who_is_in_the_pool_or_their_state_changes() {
    let mut harness = Harness::new(&[8000]);
    let changes = harness.roster.pool.roster_changes();
    let version = harness.snapshot().version;
    harness.step(answer(8000, 0, 0));
    assert_eq!(*changes.borrow(), 1, "new to healthy");
    harness.step(answer(8000, 5, 5));
    harness.step(Wait(SECOND));
    assert_eq!(*changes.borrow(), 1, "a new reading is no roster change");
    assert_eq!(
        harness.snapshot().version,
        version + 3,
        "every publication is a new version"
    );
    harness.step(Discover(&[8000, 8001]));
    assert_eq!(*changes.borrow(), 2);
}

#[test]
fn each_finished_round_is_counted_for_readiness() {
    let mut harness = Harness::new(&[8000]);
    let rounds = harness.roster.pool.rounds();
    harness.roster.finish_round(harness.now);
    harness.roster.finish_round(harness.now);
    assert_eq!(*rounds.borrow(), 2);
}

#[test]
fn discovery_beyond_max_workers_leaves_the_rest_out_until_a_slot_frees() {
    Harness::with(&[8000], "    max_workers: 2\n").run(&[
        (
            Discover(&[8000, 8001, 8002]),
            &[(8000, 0, 0, New, 0), (8001, 1, 1, New, 0)],
            &[Told::Joined(1, 8001)],
        ),
        (
            Discover(&[8001, 8002]),
            &[(8000, 0, 0, Draining, 0), (8001, 1, 1, New, 0)],
            &[],
        ),
        (
            Refused(8000),
            &[(8001, 1, 1, New, 0)],
            &[Told::Left(0), Told::Forgotten(8000)],
        ),
        (
            Discover(&[8001, 8002]),
            &[(8002, 0, 2, New, 0), (8001, 1, 1, New, 0)],
            &[Told::Joined(0, 8002)],
        ),
    ]);
}

#[test]
fn a_changed_description_is_applied_in_place_and_a_new_rank_count_voids_the_reading() {
    let mut harness = Harness::new(&[8000]);
    harness.step(answer(8000, 1, 1));
    let mut worker = harness.config.pools[0].template.worker(endpoint(8000));
    worker.max_running_requests = std::num::NonZeroU64::new(7);
    harness
        .roster
        .reconcile(std::slice::from_ref(&worker), harness.now);
    harness.step(answer(8000, 1, 1));
    let state = harness.snapshot().workers()[0].clone();
    assert_eq!(
        (
            state.capacity.max_running,
            state.generation,
            state.lifecycle
        ),
        (Some(7), 0, Healthy),
        "the configured capacity wins from the next scrape on"
    );
    assert!(
        state.reading.is_some(),
        "the same ranks: the reading stands"
    );
    worker.dp_size = NonZeroU32::new(2).unwrap();
    harness.roster.reconcile(&[worker], harness.now);
    harness.roster.publish();
    assert_eq!(harness.snapshot().workers()[0].reading, None);
    assert_eq!(
        harness.recorder.take(),
        [Told::Joined(0, 8000)],
        "announced once, never left or joined again"
    );
}

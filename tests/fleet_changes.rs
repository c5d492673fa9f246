//! A fleet that changes under a running stack: simulated vLLM workers, cachepick serving in process
//! (reading its file again as `cachepick serve` does), and a real Envoy 1.40 whose workers cluster
//! cachepick keeps in step. Clients talk HTTP to Envoy only and must never see an error the engines did
//! not return:
//! - a worker added to the file serves within two scrape intervals, and one removed serves nothing once
//!   drained; the owner index survives both reloads;
//! - a worker killed between requests costs its conversations nothing: Envoy retries onto the fallbacks
//!   cachepick sent, and within `freshness` cachepick stops choosing it;
//! - a worker restarted with an empty cache is no longer credited with its old prefixes once the restart
//!   is seen (one scrape after it is back).

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{envoy, sim_client, sim_fleet};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use http::Method;
use http::header::CONTENT_TYPE;
use serde_json::{Value, json};

use cachepick::app::Reload;
use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode};
use cachepick_rig::stage::{Picker, READY_WITHIN};
use cachepick_sim::Engine;
use cachepick_sim::fleet::Fleet;
use sim_client::{CHAT, Client, DEADLINE, MODEL, Reply, bounded};

/// Long enough that the bounds below hold on a loaded two-core CI machine, short enough to be tested.
const SCRAPE_INTERVAL: Duration = Duration::from_millis(400);
const FRESHNESS: Duration = Duration::from_millis(1500);
const ECHO_DESTINATION: &str = "x-sim-echo-x-gateway-destination-endpoint";
const ECHO_DECISION: &str = "x-sim-echo-x-cachepick-decision";

/// Fleet + cachepick (reading its file again) + Envoy.
struct Stack {
    fleet: Fleet,
    /// The configuration with every fleet worker listed; the file lists a subset of them.
    full: Config,
    file: PathBuf,
    _dir: tempfile::TempDir,
    envoy: envoy::Envoy,
    gateway: SocketAddr,
    client: Client,
    picker: Picker,
}

impl Stack {
    /// Three workers; the file lists those at positions `listed`.
    async fn start(listed: &[usize]) -> Stack {
        let sim = sim_fleet::config(Engine::Vllm, 3);
        let fleet = sim_fleet::start(&sim).await;
        let overrides = envoy::free_listeners();
        let mut full = config::parse(&fleet.cachepick_config(), "fleet", &overrides).unwrap();
        for policy in full.policies_mut() {
            policy.cache_aware_mut().unwrap().min_match_tokens = 64;
        }
        full.load.scrape_interval = SCRAPE_INTERVAL;
        full.load.scrape_timeout = Duration::from_millis(300);
        full.load.freshness = FRESHNESS;
        full.load.drain_timeout = Duration::from_secs(5);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cachepick.yaml");
        let initial = Self::listing(&full, listed);
        std::fs::write(&file, initial.to_yaml()).unwrap();
        let config = config::load(&file, &Overrides::default()).unwrap();
        let reload = Reload {
            path: file.clone(),
            overrides: Overrides::default(),
        };
        let mut picker = Picker::spawn_serving(config.clone(), Some(reload));
        picker.ready(READY_WITHIN).await.unwrap();

        let options = envoy::free_options(&config, BodyMode::Buffered);
        let gateway = options.listen;
        let envoy = envoy::Envoy::start(&envoy_config::render(&config, &options)).await;
        Stack {
            fleet,
            full,
            file,
            _dir: dir,
            envoy,
            gateway,
            client: Client::new(),
            picker,
        }
    }

    /// The full configuration with only the workers at `listed`.
    fn listing(full: &Config, listed: &[usize]) -> Config {
        let mut config = full.clone();
        config.pools[0].workers = listed
            .iter()
            .map(|&i| full.pools[0].workers[i].clone())
            .collect();
        config
    }

    /// Rewrites the file with the workers at `listed`, atomically (a rename over it, as editors do).
    fn list(&self, listed: &[usize]) {
        let staged = self.file.with_extension("staged");
        std::fs::write(&staged, Self::listing(&self.full, listed).to_yaml()).unwrap();
        std::fs::rename(&staged, &self.file).unwrap();
    }

    fn worker(&self, index: usize) -> SocketAddr {
        self.fleet.endpoints()[index]
    }

    /// One turn of `conversation` through Envoy: (status, served by, decision, cachepick's destination).
    async fn turn(&self, conversation: &str, turn: usize) -> Turn {
        let mut messages =
            vec![json!({"role": "system", "content": format!("{conversation}. ").repeat(40)})];
        for n in 0..turn {
            messages.push(json!({"role": "user", "content": format!("question {n}")}));
            messages.push(json!({"role": "assistant", "content": format!("answer {n}")}));
        }
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        let reply: Reply = bounded("a turn through Envoy", DEADLINE, async {
            let response = self
                .client
                .send_raw(
                    Method::POST,
                    self.gateway,
                    CHAT,
                    &[(CONTENT_TYPE.as_str(), "application/json")],
                    serde_json::to_vec(&body).unwrap(),
                )
                .await;
            sim_client::read_whole(response).await
        })
        .await
        .unwrap_or_else(|error| panic!("transport error through Envoy: {error}"));
        let header = |name: &str| reply.header(name).unwrap_or_default().to_owned();
        Turn {
            status: reply.status.as_u16(),
            served_by: header("x-served-by").parse().ok(),
            decision: header(ECHO_DECISION),
            destination: header(ECHO_DESTINATION)
                .split(',')
                .next()
                .and_then(|first| first.trim().parse().ok()),
        }
    }

    /// Nine conversations of two turns each; the worker most of them settled on (its position in the
    /// fleet) and those conversations. Which worker that is depends on the scrapes' timing (an idle
    /// fleet ties, and requests dispatched since the last reading break the tie), so the tests below
    /// take whichever worker holds conversations rather than naming one.
    async fn settle(&self) -> (usize, Vec<String>) {
        let mut homes: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for talk in conversations(9) {
            self.turn(&talk, 0).await.ok();
            let served_by = self.turn(&talk, 1).await.ok().served_by;
            let home = self
                .fleet
                .endpoints()
                .iter()
                .position(|endpoint| served_by == Some(*endpoint));
            homes
                .entry(home.expect("a listed worker served the turn"))
                .or_default()
                .push(talk);
        }
        let sizes: Vec<(usize, usize)> = homes.iter().map(|(at, on)| (*at, on.len())).collect();
        eprintln!("conversations settled per worker: {sizes:?}");
        homes
            .into_iter()
            .max_by_key(|(_, settled)| settled.len())
            .expect("nine conversations settled somewhere")
    }

    /// The workers `/debug/snapshot` lists: endpoint → (state, restarts).
    async fn roster(&self) -> BTreeMap<SocketAddr, (String, u64)> {
        let reply = self
            .client
            .get(self.picker.metrics_listen(), "/debug/snapshot")
            .await;
        let pools: Value = reply.json();
        pools["pools"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|worker| {
                (
                    worker["endpoint"].as_str().unwrap().parse().unwrap(),
                    (
                        worker["state"].as_str().unwrap().to_owned(),
                        worker["restarts"].as_u64().unwrap(),
                    ),
                )
            })
            .collect()
    }
}

#[derive(Debug)]
struct Turn {
    status: u16,
    served_by: Option<SocketAddr>,
    decision: String,
    destination: Option<SocketAddr>,
}

impl Turn {
    /// A client-visible success; anything else fails the test with what Envoy answered.
    fn ok(self) -> Turn {
        assert_eq!(self.status, 200, "a client saw an error: {self:?}");
        self
    }
}

fn conversations(count: usize) -> Vec<String> {
    (0..count)
        .map(|n| format!("conversation {n} about a topic of its own"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_added_to_and_removed_from_the_file_serve_and_stop_serving_without_errors() {
    let stack = Stack::start(&[0, 1]).await;
    let (w0, w1, w2) = (stack.worker(0), stack.worker(1), stack.worker(2));
    // Conversations settle on the two listed workers.
    let talks = conversations(8);
    let mut home = BTreeMap::new();
    for (n, talk) in talks.iter().enumerate() {
        let first = stack.turn(talk, 0).await.ok();
        assert!([Some(w0), Some(w1)].contains(&first.served_by), "{first:?}");
        let second = stack.turn(talk, 1).await.ok();
        assert_eq!(second.decision, "cache_hit", "{second:?}");
        home.insert(n, second.served_by.unwrap());
    }

    // w2 joins the file: it serves new conversations within two scrape intervals.
    let added = Instant::now();
    stack.list(&[0, 1, 2]);
    let mut fresh = 0;
    let joined = loop {
        let turn = stack
            .turn(&format!("new conversation {fresh}"), 0)
            .await
            .ok();
        fresh += 1;
        if turn.served_by == Some(w2) {
            break added.elapsed();
        }
        assert!(
            added.elapsed() < SCRAPE_INTERVAL * 2,
            "w2 has served nothing {:?} after it was added ({fresh} requests; last {turn:?}); roster {:?}",
            added.elapsed(),
            stack.roster().await
        );
    };
    eprintln!("w2 served its first request {joined:?} after the file listed it");
    // The reload kept the index: every settled conversation still hits its worker.
    for (n, talk) in talks.iter().enumerate() {
        let turn = stack.turn(talk, 2).await.ok();
        assert_eq!(
            (turn.decision.as_str(), turn.served_by),
            ("cache_hit", Some(home[&n])),
            "{turn:?}"
        );
    }

    // w1 leaves the file: it drains (idle, so at once) and serves nothing after.
    stack.list(&[0, 2]);
    let removed = Instant::now();
    while stack.roster().await.contains_key(&w1) {
        assert!(
            removed.elapsed() < Duration::from_secs(5),
            "w1 never left: {:?}",
            stack.roster().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (n, talk) in talks.iter().enumerate() {
        for turn in 3..5 {
            let turn = stack.turn(talk, turn).await.ok();
            assert_ne!(turn.served_by, Some(w1), "conversation {n}: {turn:?}");
        }
    }
    let stats = stack.envoy.stats().await;
    assert!(
        envoy::parse_stat(&stats, "cluster.workers.membership_total") == Some(2),
        "Envoy's workers cluster holds exactly the two listed workers:\n{}",
        stats
            .lines()
            .filter(|line| line.starts_with("cluster.workers.membership"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_costs_its_conversations_nothing_and_stops_being_chosen_within_freshness() {
    let stack = Stack::start(&[0, 1, 2]).await;
    let (home, settled) = stack.settle().await;
    let victim = stack.worker(home);

    // Killed between requests: the next turns are routed to it until cachepick sees it gone, and
    // Envoy retries each of those onto the fallbacks.
    let killed = Instant::now();
    stack.fleet.workers()[home].kill().await;
    let mut last_chosen = None;
    let mut turn_number = 2;
    while killed.elapsed() < FRESHNESS * 2 {
        for talk in &settled {
            let turn = stack.turn(talk, turn_number).await.ok();
            assert_ne!(turn.served_by, Some(victim), "{turn:?}");
            if turn.destination == Some(victim) {
                last_chosen = Some(killed.elapsed());
            }
        }
        turn_number += 1;
    }
    if let Some(last) = last_chosen {
        assert!(
            last < FRESHNESS,
            "cachepick chose the dead worker {last:?} after it died"
        );
    }
    eprintln!("cachepick last chose the killed worker {last_chosen:?} after it died");
    // Every request cachepick sent there meanwhile was retried by Envoy, never failed.
    let retries = envoy::parse_stat(
        &stack.envoy.stats().await,
        "cluster.workers.upstream_rq_retry",
    )
    .unwrap_or(0);
    if last_chosen.is_some() {
        assert!(retries > 0, "chosen while dead, yet Envoy retried nothing");
    }
    let roster = stack.roster().await;
    assert_eq!(roster[&victim].0, "unreachable", "{roster:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_is_not_credited_with_its_old_prefixes_once_the_restart_is_seen() {
    let stack = Stack::start(&[0, 1, 2]).await;
    let (home, settled) = stack.settle().await;
    let victim = stack.worker(home);

    let worker = &stack.fleet.workers()[home];
    worker.kill().await;
    worker.restart().await.unwrap();
    let back = Instant::now();
    let detected = loop {
        if stack.roster().await[&victim].1 >= 1 {
            break back.elapsed();
        }
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "the restart was never seen: {:?}",
            stack.roster().await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!("the restart was seen {detected:?} after the worker was back");
    assert!(
        detected <= SCRAPE_INTERVAL * 2,
        "seen {detected:?} after it was back"
    );
    for talk in &settled {
        let turn = stack.turn(talk, 2).await.ok();
        assert!(
            !(turn.destination == Some(victim) && turn.decision == "cache_hit"),
            "credited with a prefix its new process does not hold: {turn:?}"
        );
    }
}

//! Another router in front of the simulated fleet instead of cachepick: the router an operator runs
//! today (the SGLang model gateway `smg`, vllm-router, …), so its rows sit in the same table as
//! cachepick's. It is either started per arm from a command template, on the arm's fresh fleet, or
//! already running at a URL (then the fleet must be on the fixed ports it was given).
//!
//! The replay drives a front exactly as it drives Envoy: the same requests, the same client, the same
//! fresh fleet and seed, hit rate from the workers' `usage`, TTFT at the client, worker share from the
//! workers' `x-served-by`. Nothing in a front's row comes from the front itself.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a started front may take to answer its first request.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// After the first answer, time for a router that registers its workers one by one (smg does, in
/// background jobs) to finish before the workload starts.
const SETTLE: Duration = Duration::from_secs(1);

/// One front arm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Front {
    /// The arm's row label: `smg/cache_aware` for `smg launch … --policy cache_aware`.
    pub label: String,
    pub target: Target,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A command template, run with `sh -c` once per arm with its placeholders filled ([`expand`]).
    Command(String),
    /// A router already running at this address, which must already know the fleet's workers.
    Url(SocketAddr),
}

#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error(
        "--front `{0}` names no `{{port}}`: the template must put the router on the port the replay gives it"
    )]
    NoPort(String),
    #[error(
        "--front `{0}` names no `{{workers}}`, `{{workers_csv}}` or `{{worker:N}}`: the router must be told the fleet's \
         workers, which are new for every arm"
    )]
    NoWorkers(String),
    #[error(
        "--front-url `{0}`: expected [NAME=]http://IP:PORT (a loopback router that already fronts the fleet)"
    )]
    BadUrl(String),
    #[error(
        "--front-url needs the fleet on fixed ports: give --config a simulator file with `base_port`, and \
         point the router at those workers"
    )]
    UrlNeedsFixedPorts,
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("cannot write the front's log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{command}` exited ({status}) before it answered; its output is in {log}")]
    Exited {
        command: String,
        status: std::process::ExitStatus,
        log: PathBuf,
    },
    #[error("{label} at {addr} did not answer a completion within {within:?}: {last}{log}")]
    NotReady {
        label: String,
        addr: SocketAddr,
        within: Duration,
        last: String,
        log: String,
    },
    #[error("no free port for the front: {0}")]
    Port(std::io::Error),
}

impl Front {
    /// A command-template front. The label is the program's name, then `/<policy>` when the command
    /// passes `--policy`; `taken` labels get `#2`, `#3`, … so every row stays distinct.
    pub fn command(template: &str, taken: &[String]) -> Result<Front, FrontError> {
        if !template.contains("{port}") {
            return Err(FrontError::NoPort(template.to_owned()));
        }
        if !["{workers}", "{workers_csv}", "{worker:"]
            .iter()
            .any(|placeholder| template.contains(placeholder))
        {
            return Err(FrontError::NoWorkers(template.to_owned()));
        }
        Ok(Front {
            label: distinct(command_label(template), taken),
            target: Target::Command(template.to_owned()),
        })
    }

    /// A running front: `[NAME=]http://IP:PORT`; the label is NAME, else `front@IP:PORT`.
    pub fn url(spec: &str, taken: &[String]) -> Result<Front, FrontError> {
        let bad = || FrontError::BadUrl(spec.to_owned());
        let (name, url) = match spec.split_once('=') {
            Some((name, url)) if !name.contains("://") && !name.is_empty() => {
                (Some(name.to_owned()), url)
            }
            _ => (None, spec),
        };
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let addr: SocketAddr = rest.trim_end_matches('/').parse().map_err(|_| bad())?;
        let label = name.unwrap_or_else(|| format!("front@{addr}"));
        Ok(Front {
            label: distinct(label, taken),
            target: Target::Url(addr),
        })
    }
}

/// `smg launch --worker-urls {workers} --port {port} --policy cache_aware` → `smg/cache_aware`.
fn command_label(template: &str) -> String {
    let words: Vec<&str> = template.split_whitespace().collect();
    let program = words
        .iter()
        .find(|word| !word.contains('='))
        .map_or("front", |word| word.rsplit('/').next().unwrap_or(word));
    let policy = words.iter().enumerate().find_map(|(index, word)| {
        if let Some(value) = word.strip_prefix("--policy=") {
            Some(value)
        } else if *word == "--policy" {
            words.get(index + 1).copied()
        } else {
            None
        }
    });
    match policy {
        Some(policy) => format!("{program}/{policy}"),
        None => program.to_owned(),
    }
}

fn distinct(label: String, taken: &[String]) -> String {
    if !taken.contains(&label) {
        return label;
    }
    (2..)
        .map(|n| format!("{label}#{n}"))
        .find(|candidate| !taken.contains(candidate))
        .unwrap_or(label)
}

/// Where each worker publishes its KV cache events, as a router is told them: one
/// `http://WORKER=tcp://RANK0[,tcp://RANK1…]` entry per worker, for the live sockets and (with replay
/// on) the replay sockets. Empty when the fleet publishes none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvSources {
    pub live: Vec<String>,
    pub replay: Vec<String>,
}

impl KvSources {
    /// The fleet's event endpoints, worker by worker.
    pub fn of(fleet: &cachepick_sim::fleet::Fleet) -> KvSources {
        let mut sources = KvSources::default();
        for worker in fleet.workers() {
            let Some(events) = worker.kv_events() else {
                continue;
            };
            let join = |addrs: Vec<String>| format!("http://{}={}", worker.addr(), addrs.join(","));
            sources.live.push(join(
                events
                    .ranks
                    .iter()
                    .map(|rank| format!("tcp://{}", rank.live))
                    .collect(),
            ));
            let replay: Vec<String> = events
                .ranks
                .iter()
                .filter_map(|rank| rank.replay.map(|addr| format!("tcp://{addr}")))
                .collect();
            if replay.len() == events.ranks.len() {
                sources.replay.push(join(replay));
            }
        }
        sources
    }
}

/// Whether a template names the workers' KV event endpoints, so its arm's fleet must publish them.
pub fn wants_kv_events(template: &str) -> bool {
    template.contains("{kv_events")
}

/// Replaces each `{NAME:I}` (`prefix` is `{NAME:`) by `values[I]`; one whose index is out of range or
/// unreadable is left as written, and so is everything after it.
fn fill_indexed(text: &mut String, prefix: &str, values: &[String]) {
    while let Some(start) = text.find(prefix) {
        let rest = text.get(start + prefix.len()..).unwrap_or_default();
        let Some((index, _)) = rest.split_once('}') else {
            break;
        };
        let Some(value) = index.parse::<usize>().ok().and_then(|i| values.get(i)) else {
            break;
        };
        let end = start + prefix.len() + index.len() + 1;
        text.replace_range(start..end, value);
    }
}

/// The template with its placeholders filled: `{workers}` the workers' URLs separated by spaces,
/// `{workers_csv}` by commas, `{port}` and `{metrics_port}` free loopback ports, `{host}` 127.0.0.1,
/// `{model}` the model the workers serve, `{worker:N}` worker N's URL alone and `{worker_port:N}` its port;
/// `{kv_events}` and `{kv_events_replay}` the workers' event endpoints ([`KvSources`]) separated by
/// spaces, and `{kv_events:FLAG}` / `{kv_events_replay:FLAG}` the same with `FLAG` before each entry,
/// for a router whose flag repeats once per worker (vllm-router's `--kv-event-source`). Other braces
/// (a JSON argument, say) are left alone.
pub fn expand(
    template: &str,
    workers: &[SocketAddr],
    port: u16,
    metrics_port: u16,
    kv: &KvSources,
    model: &str,
) -> String {
    let urls: Vec<String> = workers
        .iter()
        .map(|addr| format!("http://{addr}"))
        .collect();
    let mut text = template
        .replace("{workers_csv}", &urls.join(","))
        .replace("{workers}", &urls.join(" "))
        .replace("{metrics_port}", &metrics_port.to_string())
        .replace("{port}", &port.to_string())
        .replace("{host}", "127.0.0.1")
        .replace("{model}", model)
        .replace("{kv_events}", &kv.live.join(" "))
        .replace("{kv_events_replay}", &kv.replay.join(" "));
    // `{worker:N}`: worker N's URL alone, for a router given each worker's role (a PD fleet);
    // `{worker_port:N}`: its port alone (an SGLang prefill worker's bootstrap port in the simulator,
    // which serves the rendezvous on the worker's own port).
    let ports: Vec<String> = workers.iter().map(|addr| addr.port().to_string()).collect();
    fill_indexed(&mut text, "{worker_port:", &ports);
    fill_indexed(&mut text, "{worker:", &urls);
    for (name, entries) in [
        ("{kv_events_replay:", &kv.replay),
        ("{kv_events:", &kv.live),
    ] {
        while let Some(start) = text.find(name) {
            let Some((flag, _)) = text
                .get(start + name.len()..)
                .and_then(|rest| rest.split_once('}'))
            else {
                break;
            };
            let end = flag.len();
            let repeated: Vec<String> = entries
                .iter()
                .map(|entry| format!("{flag} {entry}"))
                .collect();
            text.replace_range(start..start + name.len() + end + 1, &repeated.join(" "));
        }
    }
    text
}

/// A front the arm started, killed (with anything it started) when dropped.
pub struct Running {
    pub addr: SocketAddr,
    /// Where the router's own metrics are, when its template put them on `{metrics_port}`.
    pub metrics: Option<SocketAddr>,
    pub label: String,
    process: Option<Process>,
}

impl Running {
    /// Starts `front` for `workers` (a command front) whose KV events are at `kv`, its output in
    /// `dir/<label>.log`, or adopts a running one; then waits until it answers a completion for `model`.
    pub async fn start(
        front: &Front,
        workers: &[SocketAddr],
        kv: &KvSources,
        model: &str,
        dir: &Path,
    ) -> Result<Running, FrontError> {
        let mut running = match &front.target {
            Target::Url(addr) => Running {
                addr: *addr,
                metrics: None,
                label: front.label.clone(),
                process: None,
            },
            Target::Command(template) => {
                let addr = crate::free_port().map_err(FrontError::Port)?;
                let metrics = crate::free_port().map_err(FrontError::Port)?;
                let command = expand(template, workers, addr.port(), metrics.port(), kv, model);
                Running {
                    addr,
                    metrics: template.contains("{metrics_port}").then_some(metrics),
                    label: front.label.clone(),
                    process: Some(Process::spawn(&command, &front.label, dir)?),
                }
            }
        };
        running.ready(model).await?;
        Ok(running)
    }

    /// The router's own routing counters after the run, as evidence beside the row: the non-comment
    /// lines of its `/metrics` that name decisions, routing or cache hits; empty when it has none.
    pub async fn routing_counters(&self) -> Vec<String> {
        let Some(metrics) = self.metrics else {
            return Vec::new();
        };
        crate::scrape_metrics(metrics, Duration::from_secs(5))
            .await
            .map(|text| routing_lines(&text))
            .unwrap_or_default()
    }

    /// Sends small completions until one is answered 200, then lets the router settle.
    async fn ready(&mut self, model: &str) -> Result<(), FrontError> {
        let started = Instant::now();
        let mut last = "no answer yet".to_owned();
        let mut attempt = 0u32;
        while started.elapsed() < READY_WITHIN {
            if let Some(process) = &mut self.process
                && let Some(status) = process.exited()
            {
                return Err(FrontError::Exited {
                    command: self.label.clone(),
                    status,
                    log: process.log.clone(),
                });
            }
            attempt += 1;
            let body = serde_json::json!({
                "model": model,
                "prompt": format!("cachepick replay readiness probe {attempt}"),
                "max_tokens": 1,
            })
            .to_string();
            match crate::http_exchange(
                http::Method::POST,
                self.addr,
                "/v1/completions",
                &body,
                Duration::from_secs(5),
            )
            .await
            {
                Some((200, _)) => {
                    tokio::time::sleep(SETTLE).await;
                    return Ok(());
                }
                Some((status, text)) => {
                    last = format!(
                        "HTTP {status}: {}",
                        text.chars().take(200).collect::<String>()
                    );
                }
                None => last = "no answer".to_owned(),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(FrontError::NotReady {
            label: self.label.clone(),
            addr: self.addr,
            within: READY_WITHIN,
            last,
            log: self.process.as_ref().map_or_else(String::new, |process| {
                format!(" (its output: {})", process.log.display())
            }),
        })
    }
}

/// A helper process the replay started from a command line (a router, a selection service), its
/// output in a log file; killed, with everything it started, when dropped.
pub struct Process {
    child: Child,
    pub log: PathBuf,
}

impl Process {
    /// Runs `command` with `sh -c`, its output in `dir/<label>.log`.
    pub fn spawn(command: &str, label: &str, dir: &Path) -> Result<Process, FrontError> {
        std::fs::create_dir_all(dir).map_err(|source| FrontError::Log {
            path: dir.to_owned(),
            source,
        })?;
        let log = dir.join(format!("{}.log", file_name(label)));
        let out = File::create(&log).map_err(|source| FrontError::Log {
            path: log.clone(),
            source,
        })?;
        let err = out.try_clone().map_err(|source| FrontError::Log {
            path: log.clone(),
            source,
        })?;
        // `exec` makes the program the child itself; its own process group lets the drop take anything
        // it starts with it.
        use std::os::unix::process::CommandExt as _;
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|source| FrontError::Spawn {
                command: command.to_owned(),
                source,
            })?;
        Ok(Process { child, log })
    }

    /// Its exit status, once it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // The whole group: a router may start helpers of its own.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of a Prometheus exposition about routing decisions and cache matches, at most 40.
fn routing_lines(exposition: &str) -> Vec<String> {
    const WORDS: [&str; 5] = ["decision", "routing", "cache_hit", "cache_miss", "policy"];
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            WORDS.iter().any(|word| name.contains(word))
        })
        .take(40)
        .map(str::to_owned)
        .collect()
}

/// `smg/cache_aware#2` → `smg_cache_aware_2`.
fn file_name(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_front_is_labelled_by_program_and_policy_and_kept_distinct() {
        let smg =
            "/opt/peers/bin/smg launch --worker-urls {workers} --port {port} --policy cache_aware";
        let front = Front::command(smg, &[]).expect("valid");
        assert_eq!(front.label, "smg/cache_aware");
        let again = Front::command(smg, std::slice::from_ref(&front.label)).expect("valid");
        assert_eq!(again.label, "smg/cache_aware#2");
        let plain = Front::command("vllm-router --worker-urls {workers} --port={port}", &[]);
        assert_eq!(plain.expect("valid").label, "vllm-router");
        let eq = Front::command(
            "smg launch --policy=round_robin --port {port} {workers}",
            &[],
        );
        assert_eq!(eq.expect("valid").label, "smg/round_robin");
    }

    #[test]
    fn a_template_without_port_or_workers_is_refused_saying_why() {
        let no_port = Front::command("smg launch --worker-urls {workers}", &[]);
        assert!(matches!(no_port, Err(FrontError::NoPort(_))), "{no_port:?}");
        let no_workers = Front::command("smg launch --port {port}", &[]);
        assert!(
            matches!(no_workers, Err(FrontError::NoWorkers(_))),
            "{no_workers:?}"
        );
    }

    #[test]
    fn placeholders_are_filled_and_other_braces_left_alone() {
        let workers: Vec<SocketAddr> = vec![
            "127.0.0.1:8001".parse().expect("addr"),
            "127.0.0.1:8002".parse().expect("addr"),
        ];
        let kv = KvSources {
            live: vec![
                "http://127.0.0.1:8001=tcp://127.0.0.1:5001".to_owned(),
                "http://127.0.0.1:8002=tcp://127.0.0.1:5003,tcp://127.0.0.1:5004".to_owned(),
            ],
            replay: vec!["http://127.0.0.1:8001=tcp://127.0.0.1:5002".to_owned()],
        };
        let text = expand(
            "r --worker-urls {workers} --csv {workers_csv} --host {host} --port {port} \
             --prometheus-port {metrics_port} --json '{\"a\":1}'",
            &workers,
            9000,
            9001,
            &kv,
            "m",
        );
        assert_eq!(
            text,
            "r --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 --csv \
             http://127.0.0.1:8001,http://127.0.0.1:8002 --host 127.0.0.1 --port 9000 \
             --prometheus-port 9001 --json '{\"a\":1}'"
        );
        let events = expand(
            "r --model {model} {kv_events:--kv-event-source} {kv_events_replay:--kv-event-replay-source} | {kv_events}",
            &workers,
            9000,
            9001,
            &kv,
            "sim-model",
        );
        assert_eq!(
            events,
            "r --model sim-model --kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:5001 --kv-event-source \
             http://127.0.0.1:8002=tcp://127.0.0.1:5003,tcp://127.0.0.1:5004 --kv-event-replay-source \
             http://127.0.0.1:8001=tcp://127.0.0.1:5002 | http://127.0.0.1:8001=tcp://127.0.0.1:5001 \
             http://127.0.0.1:8002=tcp://127.0.0.1:5003,tcp://127.0.0.1:5004"
        );
        assert!(wants_kv_events("x {kv_events:--f}") && !wants_kv_events("x {workers}"));
        // A PD front names each worker's role.
        let roles = expand(
            "r --prefill {worker:0} --decode {worker:1} {worker:9}",
            &workers,
            9000,
            9001,
            &kv,
            "m",
        );
        assert_eq!(
            roles,
            "r --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 {worker:9}"
        );
        // An SGLang PD front names each prefill worker's bootstrap port too.
        let sglang = expand(
            "smg --prefill {worker:0} {worker_port:0} --decode {worker:1} {worker_port:9}",
            &workers,
            9000,
            9001,
            &kv,
            "m",
        );
        assert_eq!(
            sglang,
            "smg --prefill http://127.0.0.1:8001 8001 --decode http://127.0.0.1:8002 {worker_port:9}"
        );
    }

    #[test]
    fn routing_counters_are_picked_out_of_a_routers_exposition() {
        let text = "# HELP x\nvllm_router_prefix_routing_decisions_total{outcome=\"missing_tokens\"} 12\n\
            vllm_router_requests_total 12\nsmg_router_cache_hits_total 3\n";
        assert_eq!(
            routing_lines(text),
            [
                "vllm_router_prefix_routing_decisions_total{outcome=\"missing_tokens\"} 12",
                "smg_router_cache_hits_total 3"
            ]
        );
    }

    #[test]
    fn a_url_front_takes_an_optional_name() {
        let named = Front::url("smg=http://127.0.0.1:9000/", &[]).expect("valid");
        assert_eq!(named.label, "smg");
        assert_eq!(
            named.target,
            Target::Url("127.0.0.1:9000".parse().expect("addr"))
        );
        let bare = Front::url("http://127.0.0.1:9000", &[]).expect("valid");
        assert_eq!(bare.label, "front@127.0.0.1:9000");
        assert!(matches!(
            Front::url("localhost:9000", &[]),
            Err(FrontError::BadUrl(_))
        ));
    }
}

//! The `cachepick` command line: parses arguments and calls into the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use cachepick::config::{self, Config, Overrides};

mod commands;
mod logs;
mod otlp;
mod remote;

/// Exit status for a configuration that cannot be used.
const EXIT_BAD_CONFIG: u8 = 2;

#[derive(Parser)]
#[command(
    name = "cachepick",
    version,
    about = "Envoy ext_proc picker that routes LLM requests to the worker holding their prompt prefix"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the external processor; the file is read again when it changes and on SIGHUP.
    Serve(ServeArgs),
    /// Validate the configuration and print the effective configuration as YAML.
    Check(ConfigArgs),
    /// Explain how a request body would be routed: pool, tokens, blocks, owners and the policy's trace.
    Explain {
        #[command(flatten)]
        config: ConfigArgs,
        /// The request path, which selects the API (`/v1/chat/completions`, `/v1/completions`, `/generate`).
        #[arg(long, default_value = "/v1/chat/completions")]
        path: String,
        /// File holding the request body.
        #[arg(long, value_name = "FILE")]
        body: PathBuf,
        /// The body's Content-Encoding (gzip, br, zstd, deflate), as the request would send it.
        #[arg(long, value_name = "CODING")]
        content_encoding: Option<String>,
        /// The value of the tenant header (`cache_salt_header`), as the request would send it.
        #[arg(long, value_name = "VALUE")]
        tenant: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Scrape every worker and print what cachepick sees: each worker's reading, and fresh or why not;
    /// or, with --from, what a running picker sees now.
    ///
    /// Exit status: 0 when every pool has a worker with a fresh reading; 3 when some pool has none
    /// (all its workers down or unreadable: nothing of it would be routed); 2 for a bad configuration;
    /// 1 when the snapshot cannot be taken.
    Snapshot {
        #[command(flatten)]
        config: Option<ConfigArgs>,
        /// Read a running picker's own snapshot from its metrics listener (`http://HOST:PORT`, its
        /// `/debug/snapshot`) instead of scraping the workers; no --config needed.
        #[arg(long, value_name = "URL", conflicts_with = "config")]
        from: Option<String>,
        /// Scrape rounds to run, `load.scrape_interval` apart.
        #[arg(long, default_value_t = 1, value_name = "N")]
        rounds: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run simulated vLLM or SGLang workers on loopback: try cachepick without GPUs.
    Sim(SimArgs),
    /// Print the Envoy bootstrap that puts cachepick in front of this configuration's workers.
    EnvoyConfig {
        #[command(flatten)]
        config: ConfigArgs,
        /// How Envoy hands bodies to cachepick: buffered (BUFFERED), duplex (FULL_DUPLEX_STREAMED),
        /// streamed (STREAMED, without waiting for the headers' answer) or original-dst (the GIE form).
        #[arg(long, default_value_t = cachepick::envoy_config::BodyMode::Buffered, value_parser = body_mode())]
        mode: cachepick::envoy_config::BodyMode,
        /// Envoy's HTTP listener, where clients send requests.
        #[arg(long, value_name = "IP:PORT", default_value_t = cachepick::envoy_config::EnvoyOptions::DEFAULT_LISTEN)]
        envoy_listen: SocketAddr,
        /// Envoy's admin interface.
        #[arg(long, value_name = "IP:PORT", default_value_t = cachepick::envoy_config::EnvoyOptions::DEFAULT_ADMIN)]
        envoy_admin: SocketAddr,
        /// Also a listener answering `GET /ready` with 200 once Envoy counts a picker healthy (503
        /// before and while draining), for a start-up probe; Envoy's admin `/ready` says LIVE earlier.
        #[arg(long, value_name = "IP:PORT")]
        envoy_ready: Option<SocketAddr>,
        /// A cachepick replica's ext_proc address, IP:PORT or NAME:PORT (a DNS name Envoy resolves,
        /// such as a Kubernetes Service: every address it answers is a replica); repeat for several
        /// replicas, which Envoy round-robins per request (default: the configuration's `listen`, on
        /// loopback if unspecified).
        #[arg(long = "picker", value_name = "IP:PORT|NAME:PORT")]
        pickers: Vec<cachepick::envoy_config::PickerAddr>,
        /// The CA bundle Envoy verifies the picker's certificate with (required when the configuration
        /// has `tls:`); a path on Envoy's side.
        #[arg(long, value_name = "FILE")]
        picker_ca: Option<PathBuf>,
        /// Envoy's client certificate for the picker (required with `tls.client_ca_file`).
        #[arg(long, value_name = "FILE")]
        picker_client_cert: Option<PathBuf>,
        /// The private key of --picker-client-cert.
        #[arg(long, value_name = "FILE")]
        picker_client_key: Option<PathBuf>,
        /// The name Envoy sends as SNI and requires among the picker certificate's DNS names.
        #[arg(long, value_name = "NAME")]
        picker_sni: Option<String>,
        /// Write a JSON access log line per request to this file, on Envoy's side (`/dev/stdout` for
        /// the container's log): request id, decision, selected and actual worker, status, durations.
        /// Off by default.
        #[arg(long, value_name = "FILE")]
        access_log: Option<PathBuf>,
    },
    /// One command to see cachepick work: a simulated fleet, the picker, and Envoy when installed,
    /// driven by a bursty shared-prefix workload; prints decision reasons, prefix-hit rate and TTFT.
    Demo(DemoArgs),
    /// Replay a Mooncake trace (or the synthetic burst scenario) once per routing policy against a
    /// simulated fleet; compare prefix-hit rate, TTFT, balance and decision reasons.
    Replay(ReplayArgs),
    /// Faults through a real Envoy while traffic flows — workers crash, their metrics hang or turn to
    /// garbage, the picker process is SIGKILLed and restarted, slow and malformed clients arrive — and
    /// every request that was not served, with its cause. Exits 1 if a request a live worker could have
    /// served was lost. With --soak: steady traffic alone, the picker's memory sampled.
    Chaos(ChaosArgs),
    /// What a request pays through Envoy and cachepick: the same requests to one worker directly (a),
    /// through Envoy (b), Envoy + a no-op ext_proc server (c), Envoy + the no-op server answering with a
    /// routing decision made in advance (c′) and Envoy + cachepick (d), interleaved in one run, per body
    /// size and mode; p50/p90/p99 and the differences, (d) − (c) being cachepick's own, (d) − (c′) its
    /// computing.
    Overhead(OverheadArgs),
}

/// `cachepick overhead`.
#[derive(Args)]
struct OverheadArgs {
    /// Measured requests per size, arm and mode (warm-up excluded).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    requests: usize,
    /// Requests per size, arm and mode sent first and not counted.
    #[arg(long, value_name = "N", default_value_t = 100)]
    warmup: usize,
    /// Requests an arm sends before the next arm's turn.
    #[arg(long, value_name = "N", default_value_t = 10)]
    batch: usize,
    /// Body sizes in KiB, comma-separated.
    #[arg(
        long,
        value_name = "KB",
        value_delimiter = ',',
        default_value = "1,4,45,200"
    )]
    sizes: Vec<usize>,
    /// Body modes of the ext_proc arms, comma-separated: buffered, duplex, streamed.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "buffered,duplex,streamed"
    )]
    modes: Vec<cachepick::envoy_config::BodyMode>,
    /// generated: the bootstraps `cachepick envoy-config` writes. The round-trip experiments of
    /// BENCHMARKS.md change the ext_proc arms: skip-request-headers (request_header_mode SKIP, the path
    /// and headers as request_attributes); streamed-no-wait (request_body_mode STREAMED with
    /// send_body_without_waiting_for_header_response; use with --modes buffered); no-feedback (the
    /// generated bootstraps with cachepick's feedback off: no response phase, the cost of feedback
    /// against generated).
    #[arg(long, default_value = "generated")]
    variant: cachepick_rig::overhead::Variant,
    /// The Envoy binary (default: CACHEPICK_ENVOY, target/envoy-1.40.0/bin/envoy, then PATH).
    #[arg(long, value_name = "PATH")]
    envoy: Option<PathBuf>,
    /// Seed of the bodies' text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory for report.json and table.md.
    #[arg(long, value_name = "DIR", default_value = "target/overhead")]
    out: PathBuf,
}

/// `cachepick chaos`.
#[derive(Args)]
struct ChaosArgs {
    /// How long the good traffic flows, seconds (the faults fire within it).
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    duration: f64,
    /// Good requests per second (a seeded conversation mix, Poisson arrivals).
    #[arg(long, value_name = "N", default_value_t = 20.0)]
    rate: f64,
    /// Simulated workers (at least 2).
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Seed of the fleet, the traffic and the fault schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Slowloris connections to Envoy's listener.
    #[arg(long, value_name = "N", default_value_t = 50)]
    slowloris: usize,
    /// Envoy's ext_proc body mode, as `cachepick envoy-config --mode` writes it.
    #[arg(long, default_value_t = cachepick::envoy_config::BodyMode::Buffered, value_parser = body_mode())]
    mode: cachepick::envoy_config::BodyMode,
    /// No faults: steady traffic, the picker's RSS sampled every second; reports its growth after
    /// --warmup.
    #[arg(long)]
    soak: bool,
    /// Soak: seconds of warm-up before the RSS baseline.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    warmup: f64,
    /// The Envoy binary (default: CACHEPICK_ENVOY, target/envoy-1.40.0/bin/envoy, then PATH).
    #[arg(long, value_name = "PATH")]
    envoy: Option<PathBuf>,
    /// Output directory for report.json, table.md, Envoy's access log and the picker's log (default
    /// target/chaos, or target/soak with --soak).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// `cachepick replay`.
#[derive(Args)]
struct ReplayArgs {
    /// Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids per line).
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "scenario",
        conflicts_with = "scenario"
    )]
    trace: Option<PathBuf>,
    /// A synthetic scenario instead of a trace: `burst` (steady, a burst well above capacity, steady),
    /// `agents` (prefill-heavy: 3k–100k-token system prompts reused across multi-turn sessions,
    /// outputs of at most 256 tokens), `chat` (multi-turn conversations over 2k–30k-token per-user
    /// contexts, 20 s think times, production-stack's multi-round QA shape) or `documents` (chat over
    /// long pasted documents: prompts of about 12k tokens, mostly new, 30% followed up 30 s later).
    #[arg(long, value_parser = cachepick_rig::replay::SCENARIO_NAMES)]
    scenario: Option<String>,
    /// Simulator YAML describing the fleet (as `cachepick sim --config`); default: 4 vLLM workers.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Comma-separated policies (round_robin, least_load, balance_threshold, affinity, gate, gate_floor,
    /// gate_floor_pressure_only, gate_floor_min_match_1block: the request unit; time_floor_all: the
    /// default policy, time_floor: it sampling two on a miss, time: without the floor;
    /// time_floor_all_profile_rate, time_floor_all_min_match_2k: diagnostics of the default;
    /// time_floor_all_share_0: the default before min_match_share); default:
    /// the scenario's list, or gate_floor,gate,affinity beside --front arms; `none` runs only the fronts.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Another router as one more arm, on a fresh fleet like every arm: a command template run with
    /// `sh -c`, where {workers} is the workers' URLs (space-separated; {workers_csv}: comma-separated),
    /// {port} the port it must listen on, {metrics_port} a spare port, {host} 127.0.0.1, {kv_events}
    /// each worker's KV event endpoints as URL=tcp://… (space-separated; {kv_events:FLAG} puts FLAG
    /// before each, {kv_events_replay} the replay sockets; naming them turns the fleet's events on).
    /// Repeatable.
    /// Example: 'smg launch --worker-urls {workers} --host {host} --port {port} --policy cache_aware
    /// --prometheus-host {host} --prometheus-port {metrics_port}'.
    #[arg(long, value_name = "TEMPLATE")]
    front: Vec<String>,
    /// A router already running at [NAME=]http://IP:PORT, as one more arm; it must front the fleet,
    /// so --config must fix the workers' ports (`base_port`). Repeatable.
    #[arg(long, value_name = "URL")]
    front_url: Vec<String>,
    /// NVIDIA Dynamo's own KV router as one more arm: its standalone selection service, started per
    /// arm from this command template ({port}: the HTTP port it must listen on), told the fleet's
    /// workers and their KV event sockets, and asked for each request by the replay's ext_proc server
    /// behind the same Envoy as cachepick (docs/simulator.md). Repeatable. Example:
    /// '.../bin/python -m dynamo.select_service --port {port} --threads 1' (scripts/provision-peers
    /// installs it).
    #[arg(long, value_name = "TEMPLATE")]
    dynamo_selector: Vec<String>,
    /// Run the fleet X times slower than the trace assumes, arrivals unchanged: below 1 the fleet has
    /// room, above 1 queues form. Every arm reports how busy the engines were and their queueing.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    load: f64,
    /// Divide arrival times by X (default 8 for a trace, 4 for burst); the default fleet also runs its
    /// model X times faster.
    #[arg(long, value_name = "X")]
    speedup: Option<f64>,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// envoy: through a real Envoy with the generated configuration; direct: over ext_proc, then to the
    /// chosen worker. Default: direct, or envoy when --replicas asks for more than one picker.
    #[arg(long, value_parser = ["envoy", "direct"])]
    via: Option<String>,
    /// Picker replicas behind one Envoy, which round-robins them per request; each learns its own owner
    /// index. Comma-separated counts run one arm each (1,3). More than one needs (and implies) --via envoy.
    #[arg(long, value_name = "N", value_delimiter = ',', default_value = "1")]
    replicas: Vec<usize>,
    /// Owner-index modes, one arm each: approximate (learned from the picker's own decisions) and/or
    /// events (from the engines' KV cache events), comma-separated.
    #[arg(
        long,
        value_name = "MODE",
        value_delimiter = ',',
        default_value = "approximate"
    )]
    index: Vec<cachepick_rig::replay::IndexMode>,
    /// Crash this worker (index from 0) mid-replay in every arm, and report the picker's stale credits
    /// on it after it restarts with an empty cache.
    #[arg(long, value_name = "I", requires = "crash_at")]
    crash_worker: Option<usize>,
    /// When the worker crashes, seconds of replay time from the first arrival.
    #[arg(long, value_name = "SECS", requires = "crash_worker")]
    crash_at: Option<f64>,
    /// How long the crashed worker stays down before it restarts, seconds.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 1.0,
        requires = "crash_worker"
    )]
    restart_after: f64,
    /// The Envoy binary for `--via envoy` (default: CACHEPICK_ENVOY, target/envoy-1.40.0/bin/envoy, PATH).
    #[arg(long, value_name = "PATH")]
    envoy: Option<PathBuf>,
    /// Output directory for report.json, table.md and the SVG charts (default target/replay/<scenario>).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Seed of the fleet and of the synthetic scenario.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A prefill/decode fleet: the first N workers prefill, the rest decode, and every cachepick arm
    /// runs its pool disaggregated (vLLM: NIXL; SGLang, from a --config naming `engine: sglang`: the
    /// bootstrap rendezvous), --via envoy. A front is told the roles with {worker:I} (worker I's URL)
    /// and {worker_port:I} (its port, an SGLang prefill worker's bootstrap port in the simulator).
    #[arg(long, value_name = "N")]
    pd: Option<usize>,
    /// With --pd: cachepick's `pd.local_prefill_tokens` (0: every prefill is remote).
    #[arg(long, value_name = "TOKENS", requires = "pd")]
    pd_local_prefill_tokens: Option<u64>,
    /// Synthetic scenarios: multiplies the workload's length (the burst's phases, the span over which
    /// agent sessions, chat users or document conversations start).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    duration_scale: f64,
    /// The default fleet's timing model: step (one token budget per engine step, priced by a GPU
    /// profile) or slots (the earlier per-request model, to reproduce earlier figures). A --config
    /// file names its own.
    #[arg(long, value_parser = parse_timing, default_value = "step")]
    timing: cachepick_sim::Timing,
    /// Re-implemented peers that cannot be installed here, one arm per --replicas count each, their
    /// load local to each router replica: llm-d (its "sticky until saturated" prefix-affinity filter
    /// with the token-load scorer), dynamo (its KV router's overlap-weighted cost), comma-separated.
    #[arg(long, value_name = "PEER", value_delimiter = ',', value_parser = cachepick_rig::replay::peers::PeerRule::parse)]
    peer: Vec<cachepick_rig::replay::peers::PeerRule>,
    /// Leave out the oracle's arm (the routing limit, run last under the step model).
    #[arg(long)]
    no_oracle: bool,
    /// cachepick's scrape interval in model time, e.g. `250ms` (default: the product's 1 s); the
    /// timeout and freshness keep their proportions to it.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    scrape_interval: Option<std::time::Duration>,
    /// Each cachepick arm of more than one replica also runs with `replica_sync` between its
    /// replicas (labelled `/x<n>+sync`).
    #[arg(long)]
    replica_sync: bool,
    /// wall: real processes on loopback in wall time (fleet, pickers, Envoy, other routers); virtual:
    /// one process on a virtual clock — the fleet in the step model, cachepick's own pipeline in
    /// process, the re-implemented peers and the oracle — deterministic for its seed, as fast as the
    /// CPU allows (docs/replay.md says what it models).
    #[arg(long, value_parser = ["wall", "virtual"], default_value = "wall")]
    clock: String,
    /// --clock virtual: how many seeds (from --seed) each arm runs; tables show the mean and its 95%
    /// confidence interval.
    #[arg(long, value_name = "N", default_value_t = 10)]
    seeds: usize,
    /// --clock virtual: workers in the fleet; the workload is scaled to it by merging copies with
    /// their own prefixes, one per 4 workers.
    #[arg(long, value_name = "N")]
    workers: Option<u32>,
    /// --clock virtual: runs at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    /// --clock virtual: also measure each decision's regret, its worker's predicted first token minus
    /// the soonest worker's from the true state (report.json: each run's `regret`, by reason).
    #[arg(long, conflicts_with = "goodput")]
    regret: bool,
    /// --clock virtual: the last replica of every cachepick arm of 2 or more replicas joins SECONDS
    /// of model time after the first arrival, once cold (`/join`) and once adopting its siblings'
    /// owner indexes (`/join+warm`); each run's `joined` holds the windows after it.
    #[arg(long, value_name = "SECONDS", conflicts_with = "goodput")]
    join_at: Option<f64>,
    /// --clock virtual: instead of one load, each arm's goodput: the highest load at which TTFT p90
    /// stays within the SLO, found by bisection on every seed (--load is not used).
    #[arg(long)]
    goodput: bool,
    /// With --goodput: the SLO on TTFT p90 in model milliseconds (default: twice the p90 of the
    /// workload's lone TTFTs, each request alone on an idle worker with a cold cache).
    #[arg(long, value_name = "MS", requires = "goodput")]
    slo_ms: Option<f64>,
}

/// `cachepick demo`.
#[derive(Args)]
struct DemoArgs {
    /// Simulated workers.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Engine kind the workers imitate: vllm or sglang.
    #[arg(long, value_parser = parse_engine, default_value = "vllm")]
    engine: cachepick_sim::Engine,
    /// The Envoy binary (default: CACHEPICK_ENVOY, target/envoy-1.40.0/bin/envoy, then PATH).
    #[arg(long, value_name = "PATH")]
    envoy: Option<PathBuf>,
    /// Drive the picker over ext_proc directly even when Envoy is available.
    #[arg(long)]
    no_envoy: bool,
    /// Keep the fleet, picker and Envoy running after the report, until Ctrl-C.
    #[arg(long)]
    hold: bool,
    /// Seed of the workload and the simulated fleet.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Multiplies the length of every workload phase (0.2 gives a 3-second run).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    duration_scale: f64,
    /// The picker's ext_proc address (default: a free loopback port).
    #[arg(long, value_name = "IP:PORT")]
    listen: Option<SocketAddr>,
    /// The picker's metrics and debug address, e.g. 127.0.0.1:9090 (default: a free loopback port).
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// Envoy's listener, where a client sends requests, e.g. 127.0.0.1:10000 (default: a free port).
    #[arg(long, value_name = "IP:PORT")]
    envoy_listen: Option<SocketAddr>,
    /// Envoy's admin interface (default: a free loopback port).
    #[arg(long, value_name = "IP:PORT")]
    envoy_admin: Option<SocketAddr>,
}

/// `cachepick sim`: a simulated fleet on loopback.
#[derive(Args)]
struct SimArgs {
    /// Simulator YAML file (every key is optional; flags override it).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Engine kind the workers imitate: vllm or sglang (overrides `engine`).
    #[arg(long, value_parser = parse_engine)]
    engine: Option<cachepick_sim::Engine>,
    /// Number of workers (overrides `workers`).
    #[arg(long, value_name = "N")]
    workers: Option<u64>,
    /// Loopback address the workers bind (overrides `host`).
    #[arg(long, value_name = "IP")]
    host: Option<std::net::IpAddr>,
    /// Worker i listens on BASE + i; ephemeral ports when absent (overrides `base_port`).
    #[arg(long, value_name = "BASE")]
    base_port: Option<u64>,
    /// Seed of every random draw (overrides `seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Multiplies every modelled duration; 0.01 runs 100 times faster (overrides `time_scale`).
    #[arg(long, value_name = "X")]
    time_scale: Option<f64>,
    /// Data-parallel ranks per worker (overrides `dp_size`).
    #[arg(long, value_name = "N")]
    dp_size: Option<u64>,
    /// Publish KV cache events in this engine format: vllm_array, vllm_map or sglang (turns
    /// `kv_events` on; its other keys still apply).
    #[arg(long, value_name = "FORMAT", value_parser = parse_kv_events)]
    kv_events: Option<cachepick_sim::KvEventsFormat>,
    /// Timing model: step (the default: one token budget per engine step, priced by a GPU profile) or
    /// slots (the earlier per-request model) (overrides `timing`).
    #[arg(long, value_parser = parse_timing)]
    timing: Option<cachepick_sim::Timing>,
    /// The step model's GPU profile by name (overrides `profile`); `llama31-8b-h100-bf16` by default.
    #[arg(long, value_name = "NAME")]
    profile: Option<String>,
    /// SGLang: the first N workers run `disaggregation_mode: prefill`, the rest `decode` (overrides
    /// `prefill_workers`); the emitted configuration is then a PD pool.
    #[arg(long, value_name = "N")]
    prefill_workers: Option<u64>,
    /// Write a cachepick configuration fronting the fleet to FILE, its thresholds explained in
    /// comments.
    #[arg(long, value_name = "FILE")]
    emit_config: Option<PathBuf>,
    /// The picker's ext_proc address the emitted configuration names (its `listen`).
    #[arg(long, value_name = "IP:PORT", default_value = cachepick_sim::fleet::EmitConfig::DEFAULT_LISTEN, requires = "emit_config")]
    picker_listen: SocketAddr,
    /// The picker's metrics address the emitted configuration names (its `metrics_listen`).
    #[arg(long, value_name = "IP:PORT", default_value = cachepick_sim::fleet::EmitConfig::DEFAULT_METRICS_LISTEN, requires = "emit_config")]
    picker_metrics_listen: SocketAddr,
    /// Address of the fleet control endpoint (kill and restart workers).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    control: SocketAddr,
}

fn parse_engine(text: &str) -> Result<cachepick_sim::Engine, String> {
    match text {
        "vllm" => Ok(cachepick_sim::Engine::Vllm),
        "sglang" => Ok(cachepick_sim::Engine::Sglang),
        other => Err(format!("expected vllm or sglang, got `{other}`")),
    }
}

fn parse_timing(text: &str) -> Result<cachepick_sim::Timing, String> {
    cachepick_sim::Timing::ALL
        .into_iter()
        .find(|timing| timing.as_str() == text)
        .ok_or_else(|| format!("expected step or slots, got `{text}`"))
}

fn parse_kv_events(text: &str) -> Result<cachepick_sim::KvEventsFormat, String> {
    cachepick_sim::KvEventsFormat::ALL
        .into_iter()
        .find(|format| format.as_str() == text)
        .ok_or_else(|| format!("expected vllm_array, vllm_map or sglang, got `{text}`"))
}

impl SimArgs {
    fn load(&self) -> Result<cachepick_sim::SimConfig, config::ConfigError> {
        let overrides = cachepick_sim::SimOverrides {
            engine: self.engine,
            workers: self.workers,
            host: self.host,
            base_port: self.base_port,
            seed: self.seed,
            time_scale: self.time_scale,
            dp_size: self.dp_size,
            kv_events: self.kv_events,
            timing: self.timing,
            profile: self.profile.clone(),
            prefill_workers: self.prefill_workers,
        };
        match &self.config {
            Some(path) => cachepick_sim::decode::load(path, &overrides),
            None => cachepick_sim::decode::parse("", "the command line", &overrides),
        }
    }
}

/// `serve`'s flags: the configuration's, and how it logs.
#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Log records as text lines or as one JSON object per line (`RUST_LOG` sets the level).
    #[arg(long, value_enum, default_value_t = logs::LogFormat::Text)]
    log_format: logs::LogFormat,
}

/// The configuration file and the flags that override it.
#[derive(Args)]
struct ConfigArgs {
    /// YAML configuration file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// ext_proc gRPC listen address (overrides `listen`).
    #[arg(long, value_name = "IP:PORT")]
    listen: Option<SocketAddr>,
    /// Prometheus and debug listen address (overrides `metrics_listen`).
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// Pass over a prefix owner with this many requests waiting (overrides `policy.worker_queue_limit`).
    #[arg(long, value_name = "N")]
    worker_queue_limit: Option<u64>,
    /// Pin to the owner when no worker is below this queue (overrides `policy.saturation_queue_floor`).
    #[arg(long, value_name = "N")]
    saturation_queue_floor: Option<u64>,
    /// Workers sampled for an off-owner pick (overrides `policy.min_load_choices`).
    #[arg(long, value_name = "K")]
    min_load_choices: Option<u64>,
    /// After SIGTERM/SIGINT, answer for this long with readiness withdrawn before stopping, e.g. `5s`
    /// or `0s` (overrides `overload.shutdown_grace`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    shutdown_grace: Option<std::time::Duration>,
}

/// `--mode`'s parser: every [`BodyMode`](cachepick::envoy_config::BodyMode), listed in `--help` and in
/// the error for a value that is none of them.
fn body_mode() -> impl clap::builder::TypedValueParser<Value = cachepick::envoy_config::BodyMode> {
    use cachepick::envoy_config::BodyMode;
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(BodyMode::ALL.map(BodyMode::as_str))
        .try_map(|mode| mode.parse::<BodyMode>())
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    cachepick::config::parse_duration(text)
        .ok_or_else(|| format!("{text:?} is not a duration such as 500ms, 5s or 1m"))
}

impl ConfigArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen,
            metrics_listen: self.metrics_listen,
            worker_queue_limit: self.worker_queue_limit,
            saturation_queue_floor: self.saturation_queue_floor,
            min_load_choices: self.min_load_choices,
            shutdown_grace: self.shutdown_grace,
        }
    }

    fn load(&self) -> Result<Config, config::ConfigError> {
        config::load(&self.config, &self.overrides())
    }

    /// Where `serve` reads the file again: the same path, with the same flags over it.
    fn reload(&self) -> cachepick::app::Reload {
        cachepick::app::Reload {
            path: self.config.clone(),
            overrides: self.overrides(),
        }
    }
}

// Over 100 lines: one arm per subcommand, each a call into the library, so the dispatch reads as
// the command list.
fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Sim(args) => match args.load() {
            Ok(config) => run("cachepick sim", commands::sim(config, &args)),
            Err(error) => bad_config(&error),
        },
        Command::Demo(args) => run("cachepick demo", commands::demo(&args)),
        Command::Replay(args) => {
            // The pickers' own logs, only when asked for: a replay's output is its report.
            if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
                tracing_subscriber::fmt()
                    .with_env_filter(filter)
                    .with_writer(std::io::stderr)
                    .init();
            }
            run("cachepick replay", commands::replay(&args))
        }
        Command::Chaos(args) => run("cachepick chaos", commands::chaos(&args)),
        Command::Overhead(args) => run("cachepick overhead", commands::overhead(&args)),
        // `check` runs every start-time check `serve` runs, with the same messages, and prints the
        // configuration as `/debug/config` serves it: its output lands in CI logs and tickets.
        Command::Check(args) => with_prepared(&args, |config, _| {
            print!("{}", config.to_redacted_yaml());
            print!("{}", commands::check_verdict(&config));
            ExitCode::SUCCESS
        }),
        Command::Serve(args) => with_prepared(&args.config, |config, prepared| {
            let spec = std::env::var("RUST_LOG").ok();
            let filter = match logs::filter(spec.as_deref()) {
                Ok(filter) => filter,
                Err(error) => {
                    eprintln!("cachepick: {error}");
                    return ExitCode::from(2);
                }
            };
            let otlp = match otlp::Otlp::start(&config.tracing) {
                Ok(otlp) => otlp,
                Err(error) => {
                    eprintln!("cachepick: {error}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            let (otlp, tracer) = otlp.unzip();
            logs::init(args.log_format, filter, tracer);
            let code = run("cachepick", async {
                cachepick::app::serve_prepared(
                    &config,
                    prepared,
                    Some(args.config.reload()),
                    shutdown_signal(),
                )
                .await?;
                Ok(())
            });
            // The spans of the last requests go out before the process ends.
            if let Some(otlp) = otlp {
                otlp.shutdown();
            }
            code
        }),
        Command::Snapshot {
            from: Some(url),
            json,
            ..
        } => match remote::fetch(&url) {
            Ok(snapshot) => {
                if json {
                    println!("{snapshot:#}");
                } else {
                    print!("{}", remote::render(&snapshot));
                }
                let unserved = remote::unserved(&snapshot);
                if unserved.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    eprintln!(
                        "cachepick snapshot: no worker with a fresh reading in pool(s) {}",
                        unserved.join(", ")
                    );
                    ExitCode::from(commands::SNAPSHOT_UNSERVED)
                }
            }
            Err(error) => {
                eprintln!("cachepick snapshot: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Snapshot { config: None, .. } => {
            eprintln!("cachepick snapshot: give --config FILE, or --from URL for a running picker");
            ExitCode::from(EXIT_BAD_CONFIG)
        }
        Command::Snapshot {
            config: Some(config),
            rounds,
            json,
            from: None,
        } => with_config(&config, |config| {
            let mut unserved = Vec::new();
            let code = run("cachepick", async {
                unserved = commands::snapshot(config, rounds, json).await?;
                Ok(())
            });
            if unserved.is_empty() {
                code
            } else {
                eprintln!(
                    "cachepick snapshot: no worker with a fresh reading in pool(s) {}",
                    unserved.join(", ")
                );
                ExitCode::from(commands::SNAPSHOT_UNSERVED)
            }
        }),
        Command::Explain {
            config,
            path,
            body,
            content_encoding,
            tenant,
            json,
        } => with_config(&config, |config| {
            let body =
                std::fs::read(&body).with_context(|| format!("cannot read {}", body.display()));
            let input = body.map(|body| cachepick::route::ExplainInput {
                path,
                body,
                content_encoding,
                tenant,
            });
            run("cachepick", async move {
                commands::explain(config, input?, json).await
            })
        }),
        Command::EnvoyConfig {
            config: args,
            mode,
            envoy_listen,
            envoy_admin,
            envoy_ready,
            pickers,
            picker_ca,
            picker_client_cert,
            picker_client_key,
            picker_sni,
            access_log,
        } => with_config(&args, |config| {
            let flags = cachepick::envoy_config::EnvoyFlags {
                mode,
                listen: envoy_listen,
                admin: envoy_admin,
                ready: envoy_ready,
                pickers,
                picker_ca,
                picker_client_cert,
                picker_client_key,
                picker_sni,
                access_log,
                // The header's "regenerate with" line: this very command, so following it reproduces
                // the file byte for byte whatever flags it was given.
                command: cachepick::envoy_config::command_line(
                    std::iter::once("cachepick".to_owned()).chain(
                        std::env::args_os()
                            .skip(1)
                            .map(|arg| arg.to_string_lossy().into_owned()),
                    ),
                ),
            };
            let options = match cachepick::envoy_config::EnvoyOptions::from_flags(&config, flags) {
                Ok(options) => options,
                Err(error) => {
                    eprintln!("{error}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            print!("{}", cachepick::envoy_config::render(&config, &options));
            ExitCode::SUCCESS
        }),
    }
}

/// Loads the configuration `args` names and runs `command` with it; a configuration that cannot be
/// used exits 2 with every problem listed.
fn with_config(args: &ConfigArgs, command: impl FnOnce(Config) -> ExitCode) -> ExitCode {
    match args.load() {
        Ok(config) => command(config),
        Err(error) => bad_config(&error),
    }
}

/// [`with_config`], and the files the configuration names loaded as `serve` loads them: a problem
/// with any of them exits 2, every problem listed.
fn with_prepared(
    args: &ConfigArgs,
    command: impl FnOnce(Config, cachepick::app::Prepared) -> ExitCode,
) -> ExitCode {
    with_config(args, |config| match cachepick::app::prepare(&config) {
        Ok(prepared) => command(config, prepared),
        Err(error) => {
            eprintln!("{error}");
            ExitCode::from(EXIT_BAD_CONFIG)
        }
    })
}

fn bad_config(error: &config::ConfigError) -> ExitCode {
    eprintln!("{error}");
    ExitCode::from(EXIT_BAD_CONFIG)
}

/// Runs `command` to completion on a multi-threaded runtime; an error is printed after `name` and
/// exits 1.
fn run(name: &str, command: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let result = tokio::runtime::Runtime::new()
        .context("cannot start the async runtime")
        .and_then(|runtime| runtime.block_on(command));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{name}: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGINT or SIGTERM (what Kubernetes sends).
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

//! A routing decision as Envoy experiences it: one ext_proc `Process` stream over real gRPC on loopback
//! (request headers with `protocol_config` BUFFERED, then the whole body → the answer), against a picker
//! started through `app::run` in front of a simulated fleet of 16 vLLM workers, all in this process.
//!
//! Run: `cargo bench --bench extproc` (`CACHEPICK_BENCH_LOG=info` for `serve`'s log subscriber).
//! Every case is *warm*: the same body was decided before, so its
//! segments are cached and its blocks are in the owner index. Each measured decision commits, as a real
//! one does. Per body, three ways of asking:
//!
//! - `envoy_sequence`: Envoy's order in BUFFERED mode — the headers message, *wait* for the headers
//!   response, then the body message, then the answer (Envoy sends the body only after the headers
//!   response; `send_body_without_waiting_for_header_response` is for STREAMED only). The stream's end
//!   (the server's trailers) is read by a spawned task, outside the timing, as Envoy keeps its stream
//!   open until the downstream request ends.
//! - `client_decide`: `extproc::client::Client::decide`, which sends both messages at once and returns
//!   at the answer.
//! - `in_process`: `Service::route` (what the gRPC handler calls: prepare, decide, commit, metrics) on
//!   a second picker over the same fleet, in the same run, so the difference is the gRPC/HTTP/2 layer.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cachepick::config::{Config, Overrides};
use cachepick::load::{PoolLoad, Scraper};
use cachepick::metrics::Metrics;
use cachepick::route::{Answer, CommitGate, Inbound, Moment, Picker, Service};
use cachepick_rig::client::{Client, Verdict, buffered_request};
use cachepick_rig::stage::{Shutdown, Stage, on_free_ports};
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::{Engine, SimConfig};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingResponse, external_processor_client::ExternalProcessorClient, processing_response,
};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

mod support {
    pub mod bodies;
    pub mod sampling;
}

use support::bodies;

const CHAT: &str = "/v1/chat/completions";
const MODEL: &str = SimConfig::DEFAULT_MODEL;
const WORKERS: u32 = 16;
const BLOCK_SIZE: u32 = 64;
/// `Client::decide` drops its stream at the answer, so the server's trailers arrive for a stream the
/// client forgot and h2 answers each with a reset of its own; after 1,024 of those h2 closes the
/// connection (`too_many_internal_resets`). A fresh client every this many decisions stays clear of it.
const DECISIONS_PER_CONNECTION: u64 = 500;

/// One short user message.
fn small_chat() -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a haiku about prefix caching on GPUs."}],
    }))
    .unwrap()
}

/// The fleet, the picker serving it over gRPC, and an in-process service over the same fleet.
struct Bench {
    runtime: Runtime,
    /// The fleet and the picker serving it over gRPC.
    stage: Stage,
    listen: SocketAddr,
    /// envoy-types' generated client on its own HTTP/2 connection, for Envoy's message order.
    raw: ExternalProcessorClient<Channel>,
    /// The baseline: a second picker with its own scraper, called directly.
    service: Arc<Service>,
    stop_scraper: Shutdown,
}

impl Bench {
    fn start() -> Bench {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let mut sim = SimConfig::new(Engine::Vllm, NonZeroU32::new(WORKERS).unwrap());
        sim.tokenizer = TokenizerConfig::default(); // tiktoken o200k_base
        sim.block_size = NonZeroU32::new(BLOCK_SIZE).unwrap();
        let stage = runtime
            .block_on(Stage::start(&sim, |generated| {
                on_free_ports(generated, "extproc bench", Overrides::default())
            }))
            .expect("the fleet and the picker start");
        let config = stage.config().clone();
        let listen = config.listen;
        let raw = runtime.block_on(async {
            let channel = Endpoint::from_shared(format!("http://{listen}"))
                .unwrap()
                .connect()
                .await
                .expect("the ext_proc channel connects");
            ExternalProcessorClient::new(channel).max_decoding_message_size(usize::MAX)
        });
        let (stop_scraper, service) = baseline(&runtime, &config);
        Bench {
            runtime,
            stage,
            listen,
            raw,
            service,
            stop_scraper,
        }
    }

    fn client(&self) -> Client {
        self.runtime
            .block_on(Client::connect(self.listen))
            .expect("the ext_proc client connects")
    }

    fn decide(&self, client: &Client, body: &[u8]) -> Verdict {
        self.runtime
            .block_on(client.decide(CHAT, body))
            .expect("the ext_proc stream works")
    }

    fn envoy_sequence(&self, body: &[u8]) -> ProcessingResponse {
        self.runtime.block_on(envoy_sequence(&self.raw, body))
    }

    fn stop(self) {
        self.stop_scraper.trigger();
        self.runtime
            .block_on(self.stage.stop())
            .expect("app::run ended cleanly");
    }
}

/// One BUFFERED exchange in Envoy's order, with the messages `Client::decide` sends; returns the answer
/// to the body. The rest of the stream is read to its end by a spawned task.
async fn envoy_sequence(
    client: &ExternalProcessorClient<Channel>,
    body: &[u8],
) -> ProcessingResponse {
    let [headers, body] = buffered_request(CHAT, body);
    let (sender, receiver) = mpsc::channel(2);
    sender.send(headers).await.expect("the headers are queued");
    let mut responses = client
        .clone()
        .process(ReceiverStream::new(receiver))
        .await
        .expect("the Process stream opens")
        .into_inner();
    let first = responses.message().await.expect("a response");
    assert!(
        matches!(
            first
                .as_ref()
                .and_then(|response| response.response.as_ref()),
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "expected a headers response, got {first:?}"
    );
    sender.send(body).await.expect("the body is queued");
    let answer = responses
        .message()
        .await
        .expect("a response")
        .expect("an answer before the end of the stream");
    drop(sender);
    tokio::spawn(async move { while let Ok(Some(_)) = responses.message().await {} });
    answer
}

/// The destination header of a BUFFERED answer, if it routes.
fn destination(answer: &ProcessingResponse) -> Option<String> {
    let Some(processing_response::Response::RequestBody(body)) = &answer.response else {
        return None;
    };
    body.response
        .as_ref()?
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|option| option.header.as_ref())
        .find(|header| header.key == cachepick::extproc::DESTINATION)
        .map(|header| String::from_utf8_lossy(&header.raw_value).into_owned())
}

/// `app::run`'s request path without the wire: a `Service` over a picker whose pool a scraper keeps
/// fresh, ready once a scrape round has completed.
fn baseline(runtime: &Runtime, config: &Config) -> (Shutdown, Arc<Service>) {
    let metrics = Arc::new(Metrics::new().unwrap());
    let stop = Shutdown::default();
    let mut loads = Vec::new();
    for pool in &config.pools {
        let load = PoolLoad::new(pool, &config.load);
        let scraper = Scraper::new(pool, &config.load, Arc::clone(&load), metrics.clone());
        let mut rounds = load.rounds();
        runtime.spawn(scraper.run(stop.signal()));
        runtime
            .block_on(rounds.wait_for(|completed| *completed > 0))
            .expect("a scrape round completes");
        loads.push(load);
    }
    let picker = Picker::new(config, &loads).unwrap();
    (stop, Service::new(picker, metrics))
}

// Over 100 lines: one criterion group, its cases set up and measured in turn against one running
// stage.
fn bench_extproc(c: &mut Criterion) {
    // `CACHEPICK_BENCH_LOG=info` installs `serve`'s default subscriber (text lines at `info`, written to
    // a sink): the decision span each request opens is then live, as in production, and the run says
    // what it costs against a run without.
    if let Ok(level) = std::env::var("CACHEPICK_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(level))
            .with_writer(std::io::sink)
            .init();
    }
    let bench = Bench::start();
    let cases = [
        ("small_chat", small_chat()),
        ("chat_8k_10_turns", bodies::chat(MODEL, 10, 380)),
        ("chat_254kb_40_turns", bodies::chat(MODEL, 40, 560)),
    ];
    for (name, body) in &cases {
        // Warm the picker, then check the next decisions are what a warm one should be.
        let warmer = bench.client();
        let first = bench.decide(&warmer, body);
        let warm = bench.decide(&warmer, body);
        drop(warmer);
        let prompt_tokens = bench
            .service
            .picker()
            .prepare(CHAT, body, Instant::now())
            .unwrap()
            .prompt_tokens;
        let Verdict::Route {
            endpoints,
            reason,
            prefix_tokens,
        } = &warm
        else {
            panic!("{name}: expected a route, got {warm:?}");
        };
        let Verdict::Route {
            endpoints: before, ..
        } = &first
        else {
            panic!("{name}: expected a route, got {first:?}");
        };
        let full_blocks = prompt_tokens / u64::from(BLOCK_SIZE) * u64::from(BLOCK_SIZE);
        assert_eq!(
            *prefix_tokens, full_blocks,
            "{name}: a warm decision matches every full block"
        );
        let selected = endpoints.first().map(ToString::to_string);
        if full_blocks > 0 {
            assert_eq!(before.first(), endpoints.first(), "{name}: the owner again");
            let answer = bench.envoy_sequence(body);
            let routed = destination(&answer).expect("a routing answer");
            assert_eq!(
                routed.split(',').next(),
                selected.as_deref(),
                "{name}: Envoy's order reaches the same owner"
            );
        }
        for _ in 0..2 {
            let answer = bench.service.answer(
                &Inbound::new(CHAT, Some(body)),
                &CommitGate::open(),
                Moment::now(),
            );
            assert!(matches!(answer, Answer::Route(_)), "{name}: {answer:?}");
        }
        println!(
            "{name}: {} bytes, {prompt_tokens} tokens, warm decision {reason} with {prefix_tokens} \
             prefix tokens on {}",
            body.len(),
            selected.unwrap_or_default(),
        );

        let mut group = c.benchmark_group(*name);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function("envoy_sequence", |b| {
            b.iter(|| black_box(bench.envoy_sequence(black_box(body))))
        });
        group.bench_function("client_decide", |b| {
            b.iter_custom(|iters| {
                let mut elapsed = Duration::ZERO;
                let mut client = bench.client();
                for done in 0..iters {
                    if done > 0 && done % DECISIONS_PER_CONNECTION == 0 {
                        client = bench.client();
                    }
                    let started = Instant::now();
                    black_box(bench.decide(&client, black_box(body)));
                    elapsed += started.elapsed();
                }
                elapsed
            })
        });
        group.bench_function("in_process", |b| {
            b.iter(|| {
                black_box(bench.service.answer(
                    &Inbound::new(CHAT, Some(black_box(body))),
                    &CommitGate::open(),
                    Moment::now(),
                ))
            })
        });
        group.finish();
    }
    bench.stop();
}

criterion_group! {
    name = benches;
    config = support::sampling::fifty_samples();
    targets = bench_extproc
}
criterion_main!(benches);

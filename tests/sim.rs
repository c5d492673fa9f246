//! The fleet simulator's model, checked through its real HTTP interface: prefix caching and its effect
//! on time to first token, the running limit and the FIFO queue, LRU eviction and pinned blocks, the
//! exposition against the model's own state, SSE framing, discovery, admin controls, crashes, data
//! parallelism, and cachepick reading a simulated fleet (in process and through the binary).
//!
//! Every fleet binds ephemeral loopback ports and runs at a small time scale, except where a time to
//! first token is measured. State is frozen with `/admin/pause` rather than raced: a paused worker
//! admits and queues requests but computes nothing, so what it reports stays put.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod sim_client;
}

use support::sim_client;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::{Value, json};

use cachepick::load::from_loads_json;
use cachepick_rig::nz;
use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::expo;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::server::Worker;
use cachepick_sim::{Engine, SimConfig, SimParams, Timing};
use sim_client::{Client, Opened, Reply, Streamed, TimedEvent, Usage, content_of, metric};

/// cachepick's reader of an engine's exposition, for the engine a simulated worker imitates. The two
/// `Engine` types are separate on purpose: the simulator does not depend on the product.
fn from_metrics(
    engine: Engine,
    text: &str,
    dp_size: u32,
) -> Result<cachepick::load::Report, cachepick::load::ExtractError> {
    let engine = match engine {
        Engine::Vllm => cachepick::worker::Engine::Vllm,
        Engine::Sglang => cachepick::worker::Engine::Sglang,
    };
    cachepick::load::from_metrics(engine, text, dp_size)
}

const MODEL: &str = SimConfig::DEFAULT_MODEL;

/// A fleet with the exact byte tokenizer, no jitter, a fast clock, and `tune` applied to the params.
async fn fleet(engine: Engine, workers: u32, tune: impl FnOnce(&mut SimConfig)) -> Fleet {
    let mut config = SimConfig::new(engine, nz(workers));
    config.tokenizer = TokenizerConfig::Bytes;
    config.params.jitter = 0.0;
    config.params.time_scale = 0.01;
    tune(&mut config);
    Fleet::start(&config).await.expect("the fleet starts")
}

/// [`fleet`] under the slots model (`timing: slots`) with its defaults: the tests of what that model
/// promises (a queue exactly beyond the running slots, admission-time KV, a request's own token clock).
async fn slots_fleet(engine: Engine, workers: u32, tune: impl FnOnce(&mut SimConfig)) -> Fleet {
    fleet(engine, workers, |config| {
        config.timing = Timing::Slots;
        config.params = SimParams {
            jitter: 0.0,
            time_scale: 0.01,
            ..SimParams::slots()
        };
        tune(config);
    })
    .await
}

fn worker(fleet: &Fleet, index: usize) -> &Worker {
    fleet.worker(index).expect("the worker exists")
}

/// `len` token ids counting up from `start`; ranges that do not overlap share no block.
fn ids(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

fn concat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

/// A non-streaming `/v1/completions` body over token ids.
fn completion(prompt: &[u32], max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
}

/// A streaming `/v1/completions` body over token ids that ends with a usage chunk.
fn streaming(prompt: &[u32], max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// Posts a completion and expects a 200.
async fn complete(client: &Client, addr: SocketAddr, prompt: &[u32], max_tokens: u32) -> Reply {
    let reply = client
        .post(addr, "/v1/completions", &completion(prompt, max_tokens))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    reply
}

/// Starts a completion in the background; the handle yields its reply.
fn spawn_completion(
    client: &Client,
    addr: SocketAddr,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> tokio::task::JoinHandle<Reply> {
    let client = client.clone();
    tokio::spawn(async move {
        client
            .post(addr, "/v1/completions", &completion(&prompt, max_tokens))
            .await
    })
}

fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

/// The tokens each event adds (the simulator's byte tokenizer decodes a token as one word).
fn tokens_per_event(events: &[TimedEvent]) -> impl Iterator<Item = usize> + '_ {
    events
        .iter()
        .filter_map(|event| event.json())
        .map(|value| words(&content_of(&value)))
}

/// A one-worker vLLM fleet on the real clock under the slots model: a 1 ms prefill, then a token every
/// `gap`.
async fn real_time_fleet(gap: Duration) -> Fleet {
    slots_fleet(Engine::Vllm, 1, |config| {
        config.params.time_scale = 1.0;
        config.params.prefill_overhead = Duration::from_millis(1);
        config.params.prefill_per_token = Duration::ZERO;
        config.params.inter_token_latency = gap;
    })
    .await
}

/// Opens a streaming completion of a 50-token prompt and `max_tokens` tokens out.
async fn open_long_stream(client: &Client, addr: SocketAddr, max_tokens: u32) -> Opened {
    client
        .open_stream(addr, "/v1/completions", &streaming(&ids(0, 50), max_tokens))
        .await
}

// === 1. prefix cache and time to first token ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_cached_tokens_and_a_shorter_ttft() {
    // On the real clock under the default profile (Llama-3.1-8B on an H100): a cold 4,096-token
    // prefill is one step of about 98 ms after the 15 ms front; warm, 16 tokens are computed (7 ms).
    let fleet = fleet(Engine::Vllm, 1, |config| {
        config.params.time_scale = 1.0;
    })
    .await;
    let profile = worker(&fleet, 0).params().profile;
    let mut cold_step = cachepick_sim::step::StepWork::default();
    cold_step.chunk(4096, 0);
    let modelled = Duration::from_secs_f64(profile.front + profile.step_time(&cold_step));
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let prompt = ids(1, 4096);

    let cold = client
        .stream(addr, "/v1/completions", &streaming(&prompt, 4))
        .await;
    assert!(cold.done(), "{cold:?}");
    assert_eq!(cold.cached_header(), 0);
    let usage = cold.usage();
    assert_eq!((usage.prompt_tokens, usage.cached_tokens), (4096, 0));
    assert_eq!(usage.completion_tokens, 4);

    let warm = client
        .stream(addr, "/v1/completions", &streaming(&prompt, 4))
        .await;
    assert!(warm.done(), "{warm:?}");
    // Whole blocks only, and never the last prompt token: (4096 - 1) / 16 × 16.
    assert_eq!(warm.cached_header(), 4080);
    assert_eq!(warm.usage().cached_tokens, 4080);
    assert_eq!(warm.usage().prompt_tokens, 4096);

    let (cold_ttft, warm_ttft) = (cold.ttft(), warm.ttft());
    assert!(
        cold_ttft >= modelled.mul_f64(0.95),
        "cold prefill is modelled at {modelled:?}, measured {cold_ttft:?}"
    );
    assert!(
        warm_ttft < cold_ttft / 3,
        "warm TTFT {warm_ttft:?} is not much shorter than cold {cold_ttft:?}"
    );

    // A prompt sharing only its first 2048 tokens (128 whole blocks) hits exactly those.
    let half = concat(&prompt[..2048], &ids(100_000, 2048));
    let partial = client
        .stream(addr, "/v1/completions", &streaming(&half, 4))
        .await;
    assert!(partial.done());
    assert_eq!(partial.cached_header(), 2048);
    assert_eq!(partial.usage().cached_tokens, 2048);
}

// === 2. running limit and queue ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_forms_exactly_beyond_max_running() {
    let fleet = slots_fleet(Engine::Vllm, 1, |config| {
        config.params.max_running = nz(3);
    })
    .await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();

    client.pause(addr).await;
    let requests: Vec<_> = (0..7)
        .map(|i| spawn_completion(&client, addr, ids(i * 1000, 50), 4))
        .collect();
    let state = client.wait_accounted(addr, 7).await;
    assert_eq!((state.running(), state.waiting()), (3, 4), "{}", state.json);

    let text = client.get(addr, "/metrics").await.text();
    let rank = [("engine", "0"), ("model_name", MODEL)];
    assert_eq!(metric(&text, "vllm:num_requests_running", &rank), 3.0);
    assert_eq!(metric(&text, "vllm:num_requests_waiting", &rank), 4.0);
    let report = from_metrics(Engine::Vllm, &text, 1).expect("cachepick reads the exposition");
    let load = report.ranks[0].expect("rank 0 reported");
    assert_eq!((load.running, load.waiting), (3, 4));
    assert_eq!(report.malformed, 0);
    let stats = worker(&fleet, 0).stats();
    assert_eq!((stats[0].running, stats[0].waiting), (3, 4));

    client.resume(addr).await;
    for request in requests {
        let reply = request.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
    let state = client.wait_idle(addr).await;
    assert_eq!(state.field("finished"), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_with_503() {
    let fleet = fleet(Engine::Vllm, 1, |config| {
        config.params.max_running = nz(1);
        config.params.max_queue = Some(2);
    })
    .await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();

    client.pause(addr).await;
    let mut requests = Vec::new();
    for i in 0..3 {
        requests.push(spawn_completion(&client, addr, ids(i * 1000, 20), 2));
        client.wait_accounted(addr, u64::from(i) + 1).await;
    }
    let state = client.state(addr).await;
    assert_eq!((state.running(), state.waiting()), (1, 2));

    let refused = client
        .post(addr, "/v1/completions", &completion(&ids(9000, 20), 2))
        .await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    let body = refused.json();
    assert_eq!(body["object"], "error", "{body}");
    assert_eq!(body["code"], 503, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("queue"),
        "{body}"
    );
    assert_eq!(client.state(addr).await.field("rejected"), 1);

    client.resume(addr).await;
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
}

// === 3. the exposition agrees with the model ===

/// Names of the series both engines report, as (running, waiting, KV usage).
fn gauges(engine: Engine) -> (&'static str, &'static str, &'static str) {
    match engine {
        Engine::Vllm => (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ),
        Engine::Sglang => (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
        ),
    }
}

fn counter(engine: Engine, name: &str) -> String {
    match engine {
        Engine::Vllm => format!("vllm:{name}"),
        Engine::Sglang => format!("sglang:{name}"),
    }
}

/// A mixed run against one worker: repeats, shared prefixes, a chat, streams and a concurrent burst.
/// Returns the summed usage the responses reported and how many requests there were.
async fn mixed_run(client: &Client, addr: SocketAddr) -> (Usage, u64) {
    let mut total = Usage::default();
    let mut count = 0;
    let base = ids(0, 300);
    for (prompt, max_tokens) in [
        (base.clone(), 8),
        (base.clone(), 8),
        (concat(&base[..200], &ids(9000, 50)), 5),
        (ids(50_000, 77), 3),
    ] {
        total.add(complete(client, addr, &prompt, max_tokens).await.usage());
        count += 1;
    }
    let streamed = client
        .stream(addr, "/v1/completions", &streaming(&base, 6))
        .await;
    assert!(streamed.done());
    total.add(streamed.usage());
    count += 1;
    let chat = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about caches"}],
        "max_tokens": 3,
    });
    for _ in 0..2 {
        let reply = client.post(addr, "/v1/chat/completions", &chat).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        total.add(reply.usage());
        count += 1;
    }
    let burst: Vec<_> = (0..5)
        .map(|_| spawn_completion(client, addr, ids(20_000, 100), 6))
        .collect();
    for request in burst {
        let reply = request.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK);
        total.add(reply.usage());
        count += 1;
    }
    assert!(total.cached_tokens > 0, "the run had cache hits: {total:?}");
    (total, count)
}

async fn metrics_agree_with_the_model(engine: Engine, timing: Timing) {
    let tune = |config: &mut SimConfig| config.params.max_running = nz(2);
    let fleet = match timing {
        Timing::Step => fleet(engine, 1, tune).await,
        Timing::Slots => slots_fleet(engine, 1, tune).await,
    };
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let client = Client::new();

    let (total, count) = mixed_run(&client, addr).await;
    client.wait_idle(addr).await;
    let text = client.get(addr, "/metrics").await.text();
    let stats = worker.stats();
    let rank = &stats[0];
    let labels: &[(&str, &str)] = match engine {
        Engine::Vllm => &[("engine", "0")],
        Engine::Sglang => &[],
    };
    let value = |name: &str| metric(&text, &counter(engine, name), labels);
    assert_eq!(value("prompt_tokens_total"), total.prompt_tokens as f64);
    assert_eq!(
        value("generation_tokens_total"),
        total.completion_tokens as f64
    );
    let (_, _, usage) = gauges(engine);
    assert_eq!(metric(&text, usage, labels), rank.kv_usage());
    // Engines count evictable cached blocks as free: an idle worker with a warm cache reports 0.
    assert_eq!(
        rank.kv_usage(),
        rank.kv_pinned_blocks as f64 / rank.kv_total_blocks as f64
    );
    assert!(rank.kv_used_blocks > 0, "the cache is warm");
    assert_eq!(rank.counters.prompt_tokens, total.prompt_tokens);
    assert_eq!(rank.counters.prefix_hit_tokens, total.cached_tokens);
    match engine {
        Engine::Vllm => {
            assert_eq!(value("prefix_cache_hits_total"), total.cached_tokens as f64);
            assert_eq!(
                value("prefix_cache_queries_total"),
                total.prompt_tokens as f64
            );
            let length = [("engine", "0"), ("finished_reason", "length")];
            assert_eq!(
                metric(&text, "vllm:request_success_total", &length),
                count as f64
            );
            assert_eq!(
                metric(&text, "vllm:time_to_first_token_seconds_count", labels),
                count as f64
            );
        }
        Engine::Sglang => {
            // The slots model reports the share of every lookup; the step model, as SGLang, the
            // share of the latest prefill batch.
            let rate = value("cache_hit_rate");
            let expected = match timing {
                Timing::Slots => total.cached_tokens as f64 / total.prompt_tokens as f64,
                Timing::Step => rank.last_prefill_hit_rate.unwrap(),
            };
            assert!((rate - expected).abs() < 1e-12, "{rate} vs {expected}");
            assert_eq!(
                value("num_used_tokens"),
                (rank.kv_pinned_blocks * u64::from(rank.block_size)) as f64
            );
            assert_eq!(value("num_requests_total"), count as f64);
        }
    }

    // At a paused instant with requests running and waiting, the exposition is the model's state.
    client.pause(addr).await;
    let requests: Vec<_> = [
        ids(0, 300),
        concat(&ids(0, 160), &ids(70_000, 40)),
        ids(80_000, 64),
        concat(&ids(20_000, 100), &ids(90_000, 33)),
    ]
    .into_iter()
    .map(|prompt| spawn_completion(&client, addr, prompt, 4))
    .collect();
    client.wait_accounted(addr, 4).await;
    let text = client.get(addr, "/metrics").await.text();
    let stats = worker.stats();
    let rank = &stats[0];
    match timing {
        // Admitted at once up to the two slots.
        Timing::Slots => assert_eq!((rank.running, rank.waiting), (2, 2)),
        // The paused step admitted what had arrived when it formed; the rest waits for the next.
        Timing::Step => assert!(rank.waiting >= 2 && rank.requests == 4, "{rank:?}"),
    }
    assert!(rank.waiting_uncached_tokens > 0);
    let (running, waiting, usage) = gauges(engine);
    assert_eq!(metric(&text, running, labels), rank.running as f64);
    assert_eq!(metric(&text, waiting, labels), rank.waiting as f64);
    assert_eq!(metric(&text, usage, labels), rank.kv_usage());
    assert_eq!(
        metric(&text, &counter(engine, "prompt_tokens_total"), labels),
        rank.counters.prompt_tokens as f64
    );
    assert_eq!(text, expo::render_metrics(engine, MODEL, &stats));
    let report = from_metrics(engine, &text, 1).expect("cachepick reads the exposition");
    let load = report.ranks[0].expect("rank 0 reported");
    assert_eq!((load.running, load.waiting), (rank.running, rank.waiting));
    if engine == Engine::Sglang {
        let loads = client.get(addr, "/v1/loads").await;
        assert_eq!(loads.status, StatusCode::OK);
        assert_eq!(loads.body.as_ref(), expo::render_loads(&stats).as_slice());
        let report = from_loads_json(&loads.body, 1).expect("cachepick reads /v1/loads");
        let load = report.ranks[0].expect("rank 0 reported");
        assert_eq!((load.running, load.waiting), (rank.running, rank.waiting));
        assert_eq!(
            load.waiting_uncached_tokens,
            Some(rank.waiting_uncached_tokens)
        );
        assert_eq!(
            load.used_tokens,
            Some(rank.kv_pinned_blocks * u64::from(rank.block_size))
        );
    }
    client.resume(addr).await;
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_metrics_agree_with_the_model() {
    metrics_agree_with_the_model(Engine::Vllm, Timing::Step).await;
    metrics_agree_with_the_model(Engine::Vllm, Timing::Slots).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_metrics_agree_with_the_model() {
    metrics_agree_with_the_model(Engine::Sglang, Timing::Step).await;
    metrics_agree_with_the_model(Engine::Sglang, Timing::Slots).await;
}

// === 4. eviction ===

/// 400-token prompts with 240 output tokens: 25 cached blocks and 15 anonymous ones each, 40 of the
/// rank's 64 blocks while running. A finished request's 25 blocks stay cached until evicted.
const PROMPT: u32 = 400;
const OUTPUT: u32 = 240;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_lru_under_capacity_pressure() {
    let fleet = slots_fleet(Engine::Vllm, 1, |config| {
        config.params.kv_blocks = nz(64);
        config.params.inter_token_latency = Duration::from_millis(1);
    })
    .await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let (a, b, c) = (ids(0, PROMPT), ids(10_000, PROMPT), ids(20_000, PROMPT));

    for prompt in [&a, &b, &c] {
        assert_eq!(
            complete(&client, addr, prompt, OUTPUT)
                .await
                .cached_header(),
            0
        );
    }
    // B evicted A's tail block; C needed 40 blocks with 49 cached: the other 24 of A, then B's tail.
    let state = client.state(addr).await;
    assert_eq!(state.field("evicted_blocks"), 26, "{}", state.json);

    // A was the least recently used: gone.
    let again = complete(&client, addr, &a, OUTPUT).await;
    assert_eq!(again.cached_header(), 0);
    assert_eq!(again.usage().cached_tokens, 0);
    // C was the most recently used: every block but the one holding the last token hits.
    let again = complete(&client, addr, &c, OUTPUT).await;
    assert_eq!(again.cached_header(), 384);
    assert_eq!(again.usage().cached_tokens, 384);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_blocks_are_not_evicted_and_the_request_waits() {
    let fleet = slots_fleet(Engine::Vllm, 1, |config| {
        config.params.kv_blocks = nz(64);
        config.params.max_running = nz(4);
        config.params.inter_token_latency = Duration::from_millis(1);
    })
    .await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let (p, q) = (ids(0, PROMPT), ids(10_000, PROMPT));

    client.pause(addr).await;
    let first = spawn_completion(&client, addr, p.clone(), OUTPUT);
    client.wait_accounted(addr, 1).await;
    let second = spawn_completion(&client, addr, q.clone(), OUTPUT);
    // Q needs 40 blocks; 24 are free and P's 40 are pinned: Q waits although a slot is free.
    let state = client.wait_accounted(addr, 2).await;
    assert_eq!((state.running(), state.waiting()), (1, 1), "{}", state.json);
    assert_eq!(state.field("kv_pinned_blocks"), 40);
    assert_eq!(state.field("kv_used_blocks"), 40);
    assert_eq!(state.field("evicted_blocks"), 0);

    client.resume(addr).await;
    let first = first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(
        (first.status, second.status),
        (StatusCode::OK, StatusCode::OK)
    );
    assert_eq!((first.cached_header(), second.cached_header()), (0, 0));
    // Q ran after P finished and evicted only P's tail block (tail first): P's head still hits.
    let state = client.wait_idle(addr).await;
    assert_eq!(state.field("evicted_blocks"), 1);
    assert_eq!(complete(&client, addr, &p, 1).await.cached_header(), 384);
}

// === 5. SSE framing ===

fn check_framing(stream: &Streamed, what: &str) {
    assert_eq!(stream.status, StatusCode::OK, "{what}");
    assert!(
        stream
            .header("content-type")
            .is_some_and(|value| value.starts_with("text/event-stream")),
        "{what}: {:?}",
        stream.headers
    );
    assert!(stream.error.is_none(), "{what}: {:?}", stream.error);
    assert!(
        stream.done(),
        "{what}: no final [DONE]: {:?}",
        stream.events
    );
    let dones = stream
        .events
        .iter()
        .filter(|event| event.data == "[DONE]")
        .count();
    assert_eq!(dones, 1, "{what}");
    assert!(stream.events.iter().all(|event| event.event == "message"));
    // Every other event is JSON (`payloads` panics otherwise).
    assert!(stream.payloads().len() >= 2, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_parse_with_a_standard_client() {
    const MAX: u32 = 7;
    let vllm = fleet(Engine::Vllm, 1, |_| {}).await;
    let sglang = fleet(Engine::Sglang, 1, |_| {}).await;
    let (vllm, sglang) = (worker(&vllm, 0).addr(), worker(&sglang, 0).addr());
    let client = Client::new();
    let messages = json!([{"role": "user", "content": "stream me a story"}]);

    for addr in [vllm, sglang] {
        let chat = client
            .stream(
                addr,
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": messages, "max_tokens": MAX, "stream": true,
                        "stream_options": {"include_usage": true}}),
            )
            .await;
        check_framing(&chat, "chat");
        let payloads = chat.payloads();
        assert_eq!(payloads[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(
            payloads
                .iter()
                .all(|p| p["object"] == "chat.completion.chunk")
        );
        let text: String = payloads.iter().map(content_of).collect();
        assert_eq!(words(&text), MAX as usize, "{text:?}");
        assert!(
            payloads
                .iter()
                .any(|p| p["choices"][0]["finish_reason"] == "length")
        );
        assert_eq!(chat.usage().completion_tokens, u64::from(MAX));
        let whole = client
            .post(
                addr,
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": messages, "max_tokens": MAX}),
            )
            .await;
        let content = whole.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(words(&content), MAX as usize);
        assert_eq!(whole.usage().prompt_tokens, chat.usage().prompt_tokens);

        let completion = client
            .stream(addr, "/v1/completions", &streaming(&ids(5, 40), MAX))
            .await;
        check_framing(&completion, "completion");
        let payloads = completion.payloads();
        assert!(payloads.iter().all(|p| p["object"] == "text_completion"));
        let text: String = payloads.iter().map(content_of).collect();
        assert_eq!(words(&text), MAX as usize, "{text:?}");
        let usage = completion.usage();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 7));
    }

    let generate = client
        .stream(
            sglang,
            "/generate",
            &json!({"input_ids": ids(5, 40), "sampling_params": {"max_new_tokens": MAX}, "stream": true}),
        )
        .await;
    check_framing(&generate, "generate");
    let payloads = generate.payloads();
    // SGLang sends the text so far in every event.
    for pair in payloads.windows(2) {
        let (before, after) = (content_of(&pair[0]), content_of(&pair[1]));
        assert!(after.starts_with(&before), "{before:?} then {after:?}");
    }
    let last = payloads.last().unwrap();
    assert_eq!(words(last["text"].as_str().unwrap()), MAX as usize);
    assert_eq!(last["meta_info"]["completion_tokens"], MAX);
    assert_eq!(last["meta_info"]["prompt_tokens"], 40);
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
}

// === 6. discovery ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_endpoints_answer_like_the_engines() {
    let vllm = fleet(Engine::Vllm, 1, |_| {}).await;
    let sglang = fleet(Engine::Sglang, 1, |config| {
        config.dp_size = nz(2);
        config.block_size = nz(32);
    })
    .await;
    let (vllm, sglang) = (worker(&vllm, 0).addr(), worker(&sglang, 0).addr());
    let client = Client::new();

    assert_eq!(client.get(vllm, "/health").await.status, StatusCode::OK);
    let models = client.get(vllm, "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    let version = client.get(vllm, "/version").await.json();
    assert!(version["version"].is_string(), "{version}");
    assert_eq!(
        client.get(vllm, "/v1/loads").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        client.get(vllm, "/server_info").await.status,
        StatusCode::NOT_FOUND
    );

    assert_eq!(client.get(sglang, "/health").await.status, StatusCode::OK);
    let info = client.get(sglang, "/server_info").await.json();
    assert_eq!(info["page_size"], 32, "{info}");
    assert_eq!(info["dp_size"], 2, "{info}");
    let model_info = client.get(sglang, "/model_info").await.json();
    assert_eq!(model_info["model_path"], MODEL, "{model_info}");
    let models = client.get(sglang, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    let loads = client.get(sglang, "/v1/loads").await;
    assert_eq!(loads.status, StatusCode::OK);
    let report = from_loads_json(&loads.body, 2).expect("cachepick reads /v1/loads");
    assert!(report.ranks.iter().all(Option::is_some), "{report:?}");
    assert_eq!(
        client.get(sglang, "/version").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_render_endpoints_give_the_token_ids_the_engine_counts() {
    let vllm = fleet(Engine::Vllm, 1, |_| {}).await;
    let sglang = fleet(Engine::Sglang, 1, |_| {}).await;
    let (vllm, sglang) = (worker(&vllm, 0).addr(), worker(&sglang, 0).addr());
    let client = Client::new();
    let text = json!({"model": MODEL, "prompt": "a render of this prompt", "max_tokens": 1});
    let rendered = client
        .post(vllm, "/v1/completions/render", &text)
        .await
        .json();
    // Completions: one rendered prompt per prompt, in a list, as vLLM answers.
    let ids = rendered[0]["token_ids"]
        .as_array()
        .expect("token ids")
        .len();
    let usage = client.post(vllm, "/v1/completions", &text).await.json();
    assert_eq!(usage["usage"]["prompt_tokens"], ids, "{rendered} {usage}");
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1});
    let rendered = client
        .post(vllm, "/v1/chat/completions/render", &chat)
        .await
        .json();
    let ids = rendered["token_ids"].as_array().expect("token ids").len();
    let usage = client
        .post(vllm, "/v1/chat/completions", &chat)
        .await
        .json();
    assert_eq!(usage["usage"]["prompt_tokens"], ids, "{rendered} {usage}");
    let other = json!({"model": "other", "prompt": "x"});
    assert_eq!(
        client
            .post(vllm, "/v1/completions/render", &other)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    // SGLang has no render endpoint.
    assert_eq!(
        client
            .post(sglang, "/v1/completions/render", &text)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

// === 7. admin controls ===

async fn set_metrics(client: &Client, addr: SocketAddr, control: Value) {
    client.admin(addr, "/admin/metrics", &control).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_metrics_modes_change_what_scrapes_see() {
    let fleet = fleet(Engine::Vllm, 1, |_| {}).await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    complete(&client, addr, &ids(0, 64), 2).await;
    let waiting = [("engine", "0")];

    // Frozen: the text captured when frozen, whatever happens after.
    let before = client.get(addr, "/metrics").await.text();
    set_metrics(&client, addr, json!({"mode": "frozen"})).await;
    complete(&client, addr, &ids(1000, 64), 2).await;
    let frozen = client.get(addr, "/metrics").await.text();
    assert_eq!(frozen, before);
    set_metrics(&client, addr, json!({"mode": "live"})).await;
    let live = client.get(addr, "/metrics").await.text();
    assert_ne!(live, frozen);
    assert_eq!(
        metric(&live, "vllm:prompt_tokens_total", &waiting),
        128.0,
        "live again"
    );

    set_metrics(&client, addr, json!({"mode": "fail"})).await;
    assert_eq!(
        client.get(addr, "/metrics").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );

    set_metrics(&client, addr, json!({"mode": "garbage"})).await;
    let garbage = client.get(addr, "/metrics").await;
    assert_eq!(garbage.status, StatusCode::OK);
    assert!(from_metrics(Engine::Vllm, &garbage.text(), 1).is_err());

    set_metrics(&client, addr, json!({"mode": "hang"})).await;
    let hung = tokio::time::timeout(
        Duration::from_millis(300),
        client.try_exchange(http::Method::GET, addr, "/metrics", None),
    )
    .await;
    assert!(hung.is_err(), "a hanging /metrics answered: {hung:?}");

    set_metrics(
        &client,
        addr,
        json!({"mode": "live", "fake": {"waiting": 9}}),
    )
    .await;
    let faked = client.get(addr, "/metrics").await.text();
    assert_eq!(metric(&faked, "vllm:num_requests_waiting", &waiting), 9.0);
    assert_eq!(metric(&faked, "vllm:num_requests_running", &waiting), 0.0);
    set_metrics(&client, addr, json!({"fake": null})).await;
    let cleared = client.get(addr, "/metrics").await.text();
    assert_eq!(metric(&cleared, "vllm:num_requests_waiting", &waiting), 0.0);

    let bad = client
        .post(addr, "/admin/metrics", &json!({"mode": "sideways"}))
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_config_changes_limits_and_lists_every_problem() {
    let fleet = fleet(Engine::Vllm, 1, |config| {
        config.params.max_running = nz(8);
    })
    .await;
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let client = Client::new();

    let state = client
        .admin(addr, "/admin/config", &json!({"max_running": 1}))
        .await
        .json();
    assert_eq!(state["params"]["max_running"], 1, "{state}");
    assert_eq!(worker.params().max_running, nz(1));
    client.pause(addr).await;
    let requests: Vec<_> = (0..2)
        .map(|i| spawn_completion(&client, addr, ids(i * 1000, 30), 2))
        .collect();
    let state = client.wait_accounted(addr, 2).await;
    assert_eq!((state.running(), state.waiting()), (1, 1), "{}", state.json);
    client.resume(addr).await;
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }

    let bad = client
        .post(
            addr,
            "/admin/config",
            &json!({"max_running": 0, "jitter": 7, "bogus": 1}),
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let message = bad.json()["message"].as_str().unwrap().to_owned();
    for problem in ["max_running", "jitter", "bogus"] {
        assert!(message.contains(problem), "{problem} not in {message:?}");
    }
    // Nothing of the refused change applied.
    assert_eq!(worker.params().max_running, nz(1));
    assert_eq!(worker.params().jitter, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_rate_one_fails_every_request() {
    let fleet = fleet(Engine::Sglang, 1, |config| {
        config.params.failure_rate = 1.0;
    })
    .await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let bodies = [
        ("/v1/completions", completion(&ids(0, 10), 2)),
        ("/v1/completions", streaming(&ids(0, 10), 2)),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
        (
            "/generate",
            json!({"input_ids": ids(0, 10), "sampling_params": {"max_new_tokens": 2}}),
        ),
    ];
    for _ in 0..3 {
        for (path, body) in &bodies {
            let reply = client.post(addr, path, body).await;
            assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{path}");
            assert_eq!(reply.json()["code"], 500);
        }
    }
    let state = client.state(addr).await;
    assert_eq!(state.field("rejected"), 12);
    assert_eq!(state.field("prompt_tokens"), 0);
    assert_eq!(client.get(addr, "/health").await.status, StatusCode::OK);
}

// === 8. crash and restart ===

/// Connects until the port refuses, for at most `within`.
async fn refused_within(addr: SocketAddr, within: Duration) -> bool {
    let start = Instant::now();
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => return true,
            _ if start.elapsed() > within => return false,
            _ => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_refuses_connections_and_restarts_empty() {
    let fleet = fleet(Engine::Vllm, 1, |_| {}).await;
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let client = Client::new();
    let prompt = ids(0, 100);
    complete(&client, addr, &prompt, 2).await;
    assert_eq!(
        complete(&client, addr, &prompt, 2).await.cached_header(),
        96
    );

    worker.kill().await;
    assert!(!worker.is_up());
    assert!(worker.stats().is_empty());
    // The port closes (see `kill_closes_the_port_before_it_returns` for how soon).
    assert!(
        refused_within(addr, Duration::from_secs(1)).await,
        "a killed worker's port is still open"
    );
    let attempt = client
        .try_exchange(http::Method::GET, addr, "/health", None)
        .await;
    assert!(attempt.is_err(), "{attempt:?}");

    worker.restart().await.expect("restarts on the same port");
    assert!(worker.is_up());
    assert_eq!(worker.addr(), addr);
    assert_eq!(client.get(addr, "/health").await.status, StatusCode::OK);
    let after = complete(&client, addr, &prompt, 2).await;
    assert_eq!(after.cached_header(), 0, "the cache did not survive");
    assert_eq!(worker.stats()[0].counters.prompt_tokens, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_closes_the_port_before_it_returns() {
    // `Worker::kill` promises to stop serving at once, the port closed; a harness that kills a worker
    // and then expects its next connection to be refused relies on that. Twenty cycles, so a close
    // that merely races the caller is caught.
    let fleet = fleet(Engine::Vllm, 1, |_| {}).await;
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        worker.kill().await;
        outcomes.push(match std::net::TcpStream::connect(addr) {
            Ok(_) => "connected".to_owned(),
            Err(error) => format!("{:?}", error.kind()),
        });
        worker.restart().await.expect("restarts on the same port");
    }
    assert!(
        outcomes
            .iter()
            .all(|outcome| outcome == "ConnectionRefused"),
        "connecting right after kill(): {outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_crash_goes_down_and_comes_back() {
    let fleet = fleet(Engine::Sglang, 1, |_| {}).await;
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let client = Client::new();
    let crashing = client
        .post(addr, "/admin/crash", &json!({"restart_after_ms": 200}))
        .await;
    assert_eq!(crashing.status, StatusCode::ACCEPTED);
    let start = Instant::now();
    assert!(
        refused_within(addr, Duration::from_millis(500)).await,
        "the worker did not go down"
    );
    assert!(!worker.is_up());
    loop {
        if let Ok(reply) = client
            .try_exchange(http::Method::GET, addr, "/health", None)
            .await
            && reply.status == StatusCode::OK
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "not back within 3 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(worker.is_up());
    assert!(
        start.elapsed() >= Duration::from_millis(150),
        "back too soon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_cuts_its_streams() {
    // 2000 tokens at 1 ms: a two-second stream.
    let fleet = real_time_fleet(Duration::from_millis(1)).await;
    let worker = worker(&fleet, 0);
    let client = Client::new();
    let opened = open_long_stream(&client, worker.addr(), 2000).await;
    let mut events = opened.events();
    events.next().await.expect("a first event");
    let start = Instant::now();
    worker.kill().await;
    let stream = events.finish().await;
    assert!(!stream.done(), "a cut stream ended with [DONE]");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the stream ran on after the kill: {:?}",
        start.elapsed()
    );
    assert!(
        stream.error.is_some(),
        "the body ended cleanly after {} events",
        stream.events.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_stream_counts_the_tokens_it_produced() {
    // 2000 tokens at 2 ms; the client reads 20 events (at least 20 tokens) and goes away.
    let fleet = real_time_fleet(Duration::from_millis(2)).await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let opened = open_long_stream(&client, addr, 2000).await;
    let events = opened.take(20).await;
    let received: usize = tokens_per_event(&events).sum();
    assert!(
        received >= 20,
        "{received} tokens in {} events",
        events.len()
    );

    let state = client.wait_idle(addr).await;
    assert_eq!(state.field("aborted"), 1, "{}", state.json);
    let text = client.get(addr, "/metrics").await.text();
    let abort = [("engine", "0"), ("finished_reason", "abort")];
    assert_eq!(metric(&text, "vllm:request_success_total", &abort), 1.0);
    // The engine produced every token the client received, so it counts them, as vLLM counts the
    // tokens of a request aborted mid-decode.
    let generated = metric(&text, "vllm:generation_tokens_total", &[("engine", "0")]);
    assert!(
        generated >= received as f64,
        "generation_tokens_total {generated} < {received} tokens streamed before the client left"
    );
}

/// Pauses the worker at `addr` after `after` for `length`; the handle yields when the pause began.
fn pause_during(
    client: &Client,
    addr: SocketAddr,
    after: Duration,
    length: Duration,
) -> tokio::task::JoinHandle<Instant> {
    let client = client.clone();
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        client.pause(addr).await;
        let paused = Instant::now();
        tokio::time::sleep(length).await;
        client.resume(addr).await;
        paused
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_freezes_a_streams_clock() {
    // 60 tokens at 10 ms: 600 ms of decode. Paused at 100 ms for 300 ms, the stream should resume at
    // the same pace and end near 900 ms, not make up for the pause with a burst.
    let fleet = real_time_fleet(Duration::from_millis(10)).await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let opened = open_long_stream(&client, addr, 60).await;
    let pauser = pause_during(
        &client,
        addr,
        Duration::from_millis(100),
        Duration::from_millis(300),
    );
    let stream = opened.read().await;
    pauser.await.unwrap();
    assert!(stream.done());
    let burst = tokens_per_event(&stream.events).max().unwrap_or(0);
    let took = stream.events.last().unwrap().at.duration_since(stream.sent);
    assert!(
        burst <= 5,
        "{burst} tokens arrived in one event after the pause (the decode clock ran while paused)"
    );
    assert!(
        took >= Duration::from_millis(800),
        "a 600 ms stream paused for 300 ms ended after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_stops_the_step_models_engine() {
    // On the real clock: 60 output tokens of a 50-token prompt decode at about 7.2 ms a step, 430 ms.
    // Paused at 100 ms for 300 ms, the engine runs no step meanwhile: the stream ends after 700 ms,
    // and no token comes while it is paused.
    let fleet = fleet(Engine::Vllm, 1, |config| config.params.time_scale = 1.0).await;
    let addr = worker(&fleet, 0).addr();
    let client = Client::new();
    let opened = open_long_stream(&client, addr, 60).await;
    let pauser = pause_during(
        &client,
        addr,
        Duration::from_millis(100),
        Duration::from_millis(300),
    );
    let stream = opened.read().await;
    let paused = pauser.await.unwrap();
    assert!(stream.done());
    let took = stream.events.last().unwrap().at.duration_since(stream.sent);
    assert!(
        took >= Duration::from_millis(700),
        "a 430 ms stream paused for 300 ms ended after {took:?}"
    );
    // A step already under way when the pause came ends with it; none starts after.
    let during = stream
        .events
        .iter()
        .filter(|event| {
            event.at > paused + Duration::from_millis(20)
                && event.at < paused + Duration::from_millis(290)
        })
        .count();
    assert_eq!(during, 0, "{during} events while paused");
}

// === 9. data-parallel ranks ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_each_take_a_request() {
    let fleet = fleet(Engine::Vllm, 1, |config| {
        config.dp_size = nz(2);
        config.params.max_running = nz(1);
    })
    .await;
    let worker = worker(&fleet, 0);
    let addr = worker.addr();
    let client = Client::new();

    client.pause(addr).await;
    // A streamed response's head arrives at admission, so each request lands before the next is sent.
    let first = client
        .open_stream(addr, "/v1/completions", &streaming(&ids(0, 40), 3))
        .await;
    let second = client
        .open_stream(addr, "/v1/completions", &streaming(&ids(1000, 40), 3))
        .await;
    assert_eq!(first.header("x-served-by-rank"), Some("0"));
    assert_eq!(second.header("x-served-by-rank"), Some("1"));

    let text = client.get(addr, "/metrics").await.text();
    for engine in ["0", "1"] {
        let labels = [("engine", engine), ("model_name", MODEL)];
        assert_eq!(metric(&text, "vllm:num_requests_running", &labels), 1.0);
        assert_eq!(metric(&text, "vllm:num_requests_waiting", &labels), 0.0);
    }
    let report = from_metrics(Engine::Vllm, &text, 2).expect("both ranks read");
    for rank in &report.ranks {
        assert_eq!(rank.map(|load| (load.running, load.waiting)), Some((1, 0)));
    }
    let stats = worker.stats();
    assert_eq!(stats.len(), 2);
    assert!(stats.iter().all(|rank| rank.running == 1));

    client.resume(addr).await;
    for opened in [first, second] {
        let stream = opened.read().await;
        assert!(stream.done());
        assert_eq!(stream.usage().completion_tokens, 3);
    }
}

// === 10. cachepick snapshot over a simulated fleet ===

/// Running and waiting of a worker summed over its ranks, as the simulator holds them.
fn held(worker: &Worker) -> (u64, u64) {
    worker
        .stats()
        .iter()
        .fold((0, 0), |(running, waiting), rank| {
            (running + rank.running, waiting + rank.waiting)
        })
}

/// Pauses worker 1 of a three-worker fleet and puts `requests` on it one after the other.
async fn load_worker_one(
    client: &Client,
    fleet: &Fleet,
    requests: u32,
) -> Vec<tokio::task::JoinHandle<Reply>> {
    let addr = worker(fleet, 1).addr();
    client.pause(addr).await;
    let mut pending = Vec::new();
    for i in 0..requests {
        pending.push(spawn_completion(client, addr, ids(i * 1000, 40), 2));
        client.wait_accounted(addr, u64::from(i) + 1).await;
    }
    pending
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_reads_a_simulated_fleet_of_either_engine() {
    // vLLM with one rank: two requests, one runs and one waits. SGLang with two ranks: three requests,
    // one admitted on each rank and the third waiting; their prefills are paused under way, which
    // SGLang counts as neither running (its decode batch) nor waiting.
    for (engine, dp_size, requests, expected) in
        [(Engine::Vllm, 1, 2, (1, 1)), (Engine::Sglang, 2, 3, (0, 1))]
    {
        let fleet = fleet(engine, 3, |config| {
            config.dp_size = nz(dp_size);
            config.params.max_running = nz(1);
        })
        .await;
        let client = Client::new();
        let pending = load_worker_one(&client, &fleet, requests).await;
        assert_eq!(held(worker(&fleet, 1)), expected);

        let config =
            cachepick::config::parse(&fleet.cachepick_config(), "sim", &Default::default())
                .expect("the emitted config is valid");
        let pools = cachepick::app::snapshot(&config, 1)
            .await
            .expect("snapshot");
        assert_eq!(pools.len(), 1);
        let views = &pools[0].view.workers;
        assert_eq!(views.len(), 3);
        for (index, sim) in fleet.workers().iter().enumerate() {
            let view = &views[index];
            assert_eq!(view.endpoint, sim.addr().to_string());
            assert!(view.fresh, "{engine:?} worker {index}: {view:?}");
            let (running, waiting) = held(sim);
            assert_eq!(
                (view.running, view.waiting),
                (Some(running), Some(waiting)),
                "{engine:?} worker {index}"
            );
            let capacity = sim.params().kv_blocks.get() as u64 * 16 * u64::from(dp_size);
            assert_eq!(view.max_total_tokens, Some(capacity), "{view:?}");
        }

        if engine == Engine::Vllm {
            let mut file = tempfile::NamedTempFile::new().unwrap();
            file.write_all(fleet.cachepick_config().as_bytes()).unwrap();
            let path = file.path().to_owned();
            let output = tokio::task::spawn_blocking(move || {
                Command::new(cachepick_rig::cachepick_binary())
                    .args(["snapshot", "--config", path.to_str().unwrap(), "--json"])
                    .output()
                    .unwrap()
            })
            .await
            .unwrap();
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            let pools: Value = serde_json::from_slice(&output.stdout).expect("JSON output");
            let views = pools[0]["workers"].as_array().unwrap();
            assert_eq!(views.len(), 3);
            for (view, sim) in views.iter().zip(fleet.workers()) {
                let (running, waiting) = held(sim);
                assert_eq!(view["endpoint"], sim.addr().to_string());
                assert_eq!(view["fresh"], true, "{view}");
                assert_eq!(view["running"], running, "{view}");
                assert_eq!(view["waiting"], waiting, "{view}");
            }
        }

        client.resume(worker(&fleet, 1).addr()).await;
        for request in pending {
            assert_eq!(request.await.unwrap().status, StatusCode::OK);
        }
    }
}

// === 11. the `cachepick sim` command ===

/// A child process killed when dropped, so a failing test leaves nothing running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cachepick_sim_serves_a_fleet_and_emits_a_valid_config() {
    let dir = tempfile::tempdir().unwrap();
    let emitted = dir.path().join("cachepick.yaml");
    let mut child = Running(
        Command::new(cachepick_rig::cachepick_binary())
            .args(["sim", "--workers", "2", "--engine", "sglang"])
            .args(["--time-scale", "0.01", "--emit-config"])
            .arg(&emitted)
            .args(["--picker-listen", "127.0.0.1:19702"])
            .args(["--picker-metrics-listen", "0.0.0.0:19790"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cachepick sim starts"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    let mut workers: Vec<SocketAddr> = Vec::new();
    let mut control: Option<SocketAddr> = None;
    let start = Instant::now();
    while control.is_none() {
        let remaining = Duration::from_secs(20).saturating_sub(start.elapsed());
        let line = tokio::task::block_in_place(|| receiver.recv_timeout(remaining))
            .unwrap_or_else(|_| panic!("no worker and control lines; saw {workers:?}"));
        if let Some(rest) = line.strip_prefix("worker ") {
            let (index, url) = rest.split_once(' ').unwrap();
            assert_eq!(index, workers.len().to_string(), "{line}");
            let addr = url.strip_prefix("http://").unwrap().parse().unwrap();
            workers.push(addr);
        } else if let Some(rest) = line.strip_prefix("control http://") {
            control = Some(rest.split_whitespace().next().unwrap().parse().unwrap());
        }
    }
    assert_eq!(workers.len(), 2);
    let control = control.unwrap();

    let client = Client::new();
    for addr in &workers {
        assert!(addr.ip().is_loopback());
        let reply = client
            .post(
                *addr,
                "/generate",
                &json!({"text": "hello", "sampling_params": {"max_new_tokens": 3}}),
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.json()["meta_info"]["completion_tokens"], 3);
        assert_eq!(client.get(*addr, "/server_info").await.json()["dp_size"], 1);
    }

    // The fleet control kills and restarts a worker.
    let up = |listing: &Value| -> Vec<bool> {
        listing["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|worker| worker["up"].as_bool().unwrap())
            .collect()
    };
    assert_eq!(
        up(&client.get(control, "/workers").await.json()),
        [true, true]
    );
    let killed = client.post(control, "/workers/0/kill", &json!({})).await;
    assert_eq!(up(&killed.json()), [false, true]);
    assert!(refused_within(workers[0], Duration::from_secs(1)).await);
    let started = client.post(control, "/workers/0/start", &json!({})).await;
    assert_eq!(up(&started.json()), [true, true]);
    assert_eq!(
        client.get(workers[0], "/health").await.status,
        StatusCode::OK
    );
    assert_eq!(
        client
            .post(control, "/workers/7/kill", &json!({}))
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    let text = std::fs::read_to_string(&emitted).expect("the config was written");
    for addr in &workers {
        assert!(text.contains(&addr.to_string()), "{addr} not in {text}");
    }
    // The picker's listeners as the flags gave them, and the thresholds explained where they are set.
    assert!(
        text.contains("\nlisten: 127.0.0.1:19702\n")
            && text.contains("\nmetrics_listen: 0.0.0.0:19790\n"),
        "{text}"
    );
    assert!(
        text.contains("# The queue gate:") && text.contains("# The saturation floor:"),
        "{text}"
    );
    let check = tokio::task::spawn_blocking(move || {
        Command::new(cachepick_rig::cachepick_binary())
            .args(["check", "--config"])
            .arg(&emitted)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    drop(child);
}

#[test]
fn cachepick_sim_lists_every_problem_of_a_bad_file() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(b"engine: vllm\nworkers: 0\nhost: 10.0.0.1\njitter: 2\nbogus: 1\n")
        .unwrap();
    let output = Command::new(cachepick_rig::cachepick_binary())
        .args(["sim", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    for problem in ["workers", "host", "jitter", "bogus"] {
        assert!(stderr.contains(problem), "{problem} not in {stderr}");
    }
    let listed = stderr.lines().filter(|line| line.starts_with("  ")).count();
    assert_eq!(listed, 4, "{stderr}");
    assert!(output.stdout.is_empty());
}

// === determinism ===

/// Two fleets with the same seed, given the same requests in the same order, answer the same: same
/// text, same cached tokens, same counters. A different seed changes the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_and_a_request_order_determine_the_answers() {
    async fn run(seed: u64) -> Vec<(String, u64, Usage)> {
        let fleet = fleet(Engine::Vllm, 1, |config| {
            config.seed = seed;
            config.params.jitter = 0.3;
            config.params.kv_blocks = nz(40);
        })
        .await;
        let client = Client::new();
        let addr = worker(&fleet, 0).addr();
        let prompts = [
            ids(0, 300),
            ids(0, 300),
            concat(&ids(0, 100), &ids(5000, 200)),
            ids(9000, 400),
            ids(0, 300),
        ];
        let mut answers = Vec::new();
        for prompt in &prompts {
            let reply = complete(&client, addr, prompt, 12).await;
            let text = content_of(&reply.json());
            answers.push((text, reply.cached_header(), reply.usage()));
        }
        answers
    }
    let first = run(7).await;
    assert_eq!(first, run(7).await);
    assert!(first.iter().any(|(_, cached, _)| *cached > 0), "{first:?}");
    let other: Vec<String> = run(8).await.into_iter().map(|(text, ..)| text).collect();
    let texts: Vec<String> = first.into_iter().map(|(text, ..)| text).collect();
    assert_ne!(texts, other, "the seed chooses the output text");
}

// cachepick's readers recover exactly what the simulator's expositions say, rank by rank: the two sides
// are written independently (different crates), so these agree only if both follow the engines.

use cachepick_sim::stats::sample_ranks as ranks;

const EXPO_MODEL: &str = "org/model \"q\"";

#[test]
fn cachepicks_reader_recovers_every_rank_from_the_metrics() {
    for engine in [Engine::Vllm, Engine::Sglang] {
        for n in [1, 3] {
            let stats = ranks(n);
            let text = expo::render_metrics(engine, EXPO_MODEL, &stats);
            let report = from_metrics(engine, &text, n).unwrap();
            assert_eq!(report.malformed, 0, "{engine:?}/{n}");
            assert_eq!(report.ranks.len(), n as usize);
            for (read, want) in report.ranks.iter().zip(&stats) {
                let read = read.unwrap();
                assert_eq!(read.waiting, want.waiting, "{engine:?}/{n}");
                assert_eq!(read.running, want.running);
                assert_eq!(read.kv_usage, Some(want.kv_usage()));
                assert_eq!(read.max_total_tokens, Some(want.kv_total_blocks * 16));
                assert_eq!(read.used_tokens, Some(want.kv_pinned_blocks * 16));
                let max_running = (engine == Engine::Sglang).then_some(want.max_running);
                assert_eq!(read.max_running, max_running);
            }
        }
    }
}

#[test]
fn cache_config_info_alone_gives_the_capacity() {
    let stats = ranks(3);
    for engine in [Engine::Vllm, Engine::Sglang] {
        let text = expo::render_metrics(engine, EXPO_MODEL, &stats);
        let without_gauge: String = text
            .lines()
            .filter(|line| !line.contains("max_total_num_tokens"))
            .map(|line| format!("{line}\n"))
            .collect();
        let report = from_metrics(engine, &without_gauge, 3).unwrap();
        for read in &report.ranks {
            assert_eq!(read.unwrap().max_total_tokens, Some(8192 * 16));
        }
    }
}

#[test]
fn cachepicks_reader_recovers_every_rank_from_loads_json() {
    for n in [1, 3] {
        let stats = ranks(n);
        let body = expo::render_loads(&stats);
        let report = from_loads_json(&body, n).unwrap();
        assert_eq!(report.malformed, 0);
        for (read, want) in report.ranks.iter().zip(&stats) {
            let read = read.unwrap();
            assert_eq!((read.waiting, read.running), (want.waiting, want.running));
            assert_eq!(
                read.waiting_uncached_tokens,
                Some(want.waiting_uncached_tokens)
            );
            assert_eq!(read.used_tokens, Some(want.kv_pinned_blocks * 16));
            assert_eq!(read.max_total_tokens, Some(8192 * 16));
            assert_eq!(read.max_running, Some(64));
            assert_eq!(read.kv_usage, Some(want.kv_usage()));
        }
        let json: Value = serde_json::from_slice(&body).unwrap();
        let last = &json["loads"][n as usize - 1];
        assert_eq!(last["dp_rank"], n - 1);
        let want = &stats[n as usize - 1];
        let rate = want.counters.prefix_hit_tokens as f64 / 4000.0;
        assert_eq!(last["cache_hit_rate"].as_f64(), Some(rate));
        // SGLang's load figure: tokens in use plus every waiting token, cached or not.
        assert_eq!(
            last["num_total_tokens"],
            want.kv_pinned_blocks * 16 + want.waiting_tokens
        );
    }
    assert_eq!(expo::render_loads(&[]), br#"{"loads":[]}"#);
}

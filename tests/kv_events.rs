//! `events` mode end to end over real sockets: the simulator publishes KV cache events as each engine
//! does, a real picker (`app::run`) subscribes, and its decisions follow what the engines say they
//! hold — including what another replica (here: a request sent to a worker directly) put there, a
//! dropped batch healed by replay, an unhealable gap, and a restarted worker.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod sim_client;
    pub mod sim_fleet;
}

use support::{sim_client, sim_fleet};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::Method;
use serde_json::{Value, json};

use cachepick::config::Overrides;
use cachepick_rig::client::{Client as PickerClient, Verdict};
use cachepick_rig::stage::{Stage, on_free_ports};
use cachepick_sim::config::{TiktokenEncoding, TokenizerConfig};
use cachepick_sim::{Engine, KvEventsConfig, KvEventsFormat};
use sim_client::{COMPLETIONS, Client, DEADLINE, MODEL, Reply, bounded, read_whole};

/// Two workers of `format`'s engine with the byte tokenizer, 16-token blocks and a fast clock, and a
/// picker whose pool runs in `events` mode.
async fn stage(format: KvEventsFormat) -> Stage {
    let engine = match format {
        KvEventsFormat::Sglang => Engine::Sglang,
        _ => Engine::Vllm,
    };
    let mut sim = sim_fleet::config(engine, 2);
    sim.kv_events = Some(KvEventsConfig::new(format));
    bounded(
        "the stage to start",
        Duration::from_secs(20),
        Stage::start(&sim, |text| {
            on_free_ports(&events_mode(text), "kv_events test", Overrides::default())
        }),
    )
    .await
    .expect("stage")
}

/// Two vLLM workers publishing map-form events, with `o200k_base` and the fixture's ChatML template, and a picker in `events` mode that counts any matched block.
async fn chat_stage() -> Stage {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let mut sim = sim_fleet::config(Engine::Vllm, 2);
    // ChatML's markers are not tiktoken specials, so segment-wise tokens differ from the whole
    // text's where a content meets a marker (see `tokenize`): the whole-text path is what matches.
    sim.tokenizer = TokenizerConfig::Tiktoken {
        encoding: TiktokenEncoding::O200kBase,
    };
    sim.chat_template = Some(fixtures.join("tokenizer_config.json"));
    sim.kv_events = Some(KvEventsConfig::new(KvEventsFormat::VllmMap));
    bounded(
        "the stage to start",
        Duration::from_secs(20),
        Stage::start(&sim, |text| {
            let text =
                events_mode(text).replacen("\npolicy:\n", "\npolicy:\n  min_match_tokens: 16\n", 1);
            on_free_ports(&text, "kv_events test", Overrides::default())
        }),
    )
    .await
    .expect("stage")
}

/// The fleet's generated configuration with its pool in `events` mode.
fn events_mode(text: &str) -> String {
    assert!(text.contains("\n    workers:\n"), "{text}");
    text.replacen(
        "\n    workers:\n",
        "\n    index:\n      mode: events\n      stream_grace: 30s\n    workers:\n",
        1,
    )
}

/// A prompt of about `blocks` 16-token blocks under the byte tokenizer, unique to `tag`.
fn prompt(tag: &str, blocks: usize) -> String {
    let mut text = format!("{tag}: ");
    while text.len() < blocks * 16 * 4 {
        text.push_str("the quick brown fox jumps over the lazy dog. ");
    }
    text
}

fn body(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1})).unwrap()
}

/// One HTTP exchange, whole.
async fn request(method: Method, addr: SocketAddr, path: &str, body: Option<&Value>) -> Reply {
    let response = bounded("an HTTP exchange", DEADLINE, async {
        read_whole(Client::new().send(method, addr, path, body).await).await
    })
    .await;
    response.unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// Sends `prompt` straight to `worker`, as another picker replica would have routed it.
async fn send_directly(worker: SocketAddr, prompt: &str) {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let reply = request(Method::POST, worker, COMPLETIONS, Some(&body)).await;
    assert!(reply.status.is_success(), "{}", reply.status);
}

/// Admin control `path` of the simulated worker with `body`.
async fn admin(worker: SocketAddr, path: &str, body: Value) {
    let reply = request(Method::POST, worker, path, Some(&body)).await;
    assert!(
        reply.status.is_success(),
        "{path}: {} {}",
        reply.status,
        reply.text()
    );
}

/// The picker's `/debug/snapshot`.
async fn snapshot(stage: &Stage) -> Value {
    request(
        Method::GET,
        stage.picker.metrics_listen(),
        "/debug/snapshot",
        None,
    )
    .await
    .json()
}

/// The picker's KV event stream of worker `worker`, rank 0, from `/debug/snapshot`.
async fn stream(stage: &Stage, worker: u64) -> Value {
    let streams = snapshot(stage).await["pools"][0]["kv_events"]
        .as_array()
        .expect("kv_events streams")
        .clone();
    streams
        .into_iter()
        .find(|stream| stream["worker"] == worker && stream["rank"] == 0)
        .expect("the worker's stream")
}

/// Polls `check` on the worker's stream until it holds, for at most `limit`.
async fn wait_stream(
    stage: &Stage,
    worker: u64,
    limit: Duration,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let stream = stream(stage, worker).await;
        if check(&stream) {
            return stream;
        }
        assert!(
            start.elapsed() < limit,
            "stream never got there: {stream:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reset_count(stream: &Value, reason: &str) -> u64 {
    stream["resets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|pair| pair[0] == reason)
        .map_or(0, |pair| pair[1].as_u64().unwrap())
}

async fn decide(picker: &PickerClient, prompt: &str) -> (SocketAddr, String, u64) {
    match bounded(
        "a decision",
        DEADLINE,
        picker.decide(COMPLETIONS, &body(prompt)),
    )
    .await
    .unwrap()
    {
        Verdict::Route {
            endpoints,
            reason,
            prefix_tokens,
        } => (endpoints[0], reason, prefix_tokens),
        refused => panic!("refused: {refused:?}"),
    }
}

/// What the engine says a worker holds becomes where its prompts go, in each engine's encoding.
async fn follows_the_engine(format: KvEventsFormat) {
    let stage = stage(format).await;
    let worker = stage.fleet.workers()[1].addr();
    wait_stream(&stage, 1, DEADLINE, |s| s["state"] == "live").await;
    let text = prompt(format.as_str(), 80);
    send_directly(worker, &text).await;
    let stream = wait_stream(&stage, 1, DEADLINE, |s| {
        s["blocks_stored"].as_u64() > Some(0)
    })
    .await;
    assert_eq!(stream["engine_block_size"], 16, "{stream:#}");
    let picker = PickerClient::connect(stage.picker.listen()).await.unwrap();
    let (chosen, reason, tokens) = decide(&picker, &text).await;
    assert_eq!((chosen, reason.as_str()), (worker, "cache_hit"));
    assert!(tokens >= 1024, "{tokens} tokens");
    // explain says where the owner's depth comes from, and what each engine holds per tier.
    let explained = request(
        Method::POST,
        stage.picker.metrics_listen(),
        "/debug/explain?path=/v1/completions",
        Some(&serde_json::from_slice::<Value>(&body(&text)).unwrap()),
    )
    .await
    .json();
    let sources = explained["depth_sources"]
        .as_array()
        .expect("depth sources");
    assert!(
        sources
            .iter()
            .any(|source| source["worker"] == 1 && source["events_tokens"].as_u64() >= Some(1024)),
        "{explained:#}"
    );
    let tiers = explained["tiers"].as_array().expect("tiers");
    assert!(
        tiers.iter().any(|worker| worker["worker"] == 1
            && worker["blocks"][0][0] == "gpu"
            && worker["blocks"][0][1].as_u64() > Some(0)),
        "{explained:#}"
    );
    let metrics = request(Method::GET, stage.picker.metrics_listen(), "/metrics", None)
        .await
        .text();
    assert!(
        metrics.lines().any(|line| line.starts_with(
            "cachepick_kv_events_stream_state{pool=\"sim-model\",rank=\"0\",state=\"live\",worker=\"1\"} 1"
        )),
        "{metrics}"
    );
    stage.stop().await.unwrap();
}

#[tokio::test]
async fn the_picker_follows_what_vllm_array_events_say() {
    follows_the_engine(KvEventsFormat::VllmArray).await;
}

#[tokio::test]
async fn the_picker_follows_what_vllm_map_events_say() {
    follows_the_engine(KvEventsFormat::VllmMap).await;
}

#[tokio::test]
async fn the_picker_follows_what_sglang_events_say() {
    follows_the_engine(KvEventsFormat::Sglang).await;
}

#[tokio::test]
async fn a_dropped_batch_is_healed_by_replay_and_an_unreplayable_one_resets_the_worker() {
    let stage = stage(KvEventsFormat::VllmMap).await;
    let worker = stage.fleet.workers()[0].addr();
    wait_stream(&stage, 0, DEADLINE, |s| s["state"] == "live").await;
    // The batch storing this prompt never reaches the live socket, but stays in the ring.
    admin(worker, "/admin/kv-events", json!({"drop_next": 1})).await;
    let healed = prompt("healed", 80);
    send_directly(worker, &healed).await;
    // The next batch reveals the gap; the replay brings the lost one back.
    send_directly(worker, &prompt("revealing", 4)).await;
    let stream = wait_stream(&stage, 0, DEADLINE, |s| {
        s["gaps"] == 1 && s["replays"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(reset_count(&stream, "gap"), 0, "{stream:#}");
    let picker = PickerClient::connect(stage.picker.listen()).await.unwrap();
    let (chosen, reason, _) = decide(&picker, &healed).await;
    assert_eq!((chosen, reason.as_str()), (worker, "cache_hit"));

    // Now a loss the ring cannot return: the worker's blocks are forgotten.
    admin(
        worker,
        "/admin/kv-events",
        json!({"drop_next": 1, "unreplayable": true}),
    )
    .await;
    send_directly(worker, &prompt("lost", 4)).await;
    send_directly(worker, &prompt("revealing again", 4)).await;
    let stream = wait_stream(&stage, 0, DEADLINE, |s| reset_count(s, "gap") == 1).await;
    assert_eq!(stream["gaps"], 2, "{stream:#}");
    stage.stop().await.unwrap();
}

#[tokio::test]
async fn a_restarted_worker_is_credited_nothing_a_second_after_it_is_back() {
    let stage = stage(KvEventsFormat::VllmMap).await;
    let worker = stage.fleet.workers()[1].addr();
    wait_stream(&stage, 1, DEADLINE, |s| s["state"] == "live").await;
    let text = prompt("restart", 80);
    send_directly(worker, &text).await;
    wait_stream(&stage, 1, DEADLINE, |s| {
        s["blocks_stored"].as_u64() > Some(0)
    })
    .await;
    let picker = PickerClient::connect(stage.picker.listen()).await.unwrap();
    // This decision also leaves a guess for the worker, which the restart must clear too.
    assert_eq!(decide(&picker, &text).await.0, worker);

    let restart_after = Duration::from_millis(500);
    let crashed = Instant::now();
    admin(
        worker,
        "/admin/crash",
        json!({"restart_after_ms": restart_after.as_millis() as u64}),
    )
    .await;
    // While it is down, its stream is too, and what it held makes no owner.
    wait_stream(&stage, 1, DEADLINE, |s| s["state"] == "connecting").await;
    let (chosen, reason, _) = decide(&picker, &text).await;
    assert!(
        !(chosen == worker && reason == "cache_hit"),
        "{chosen} {reason}: a worker whose stream is down is still credited"
    );
    // Back (answering HTTP) ...
    let back = loop {
        let up = Client::new()
            .send(Method::GET, worker, "/health", None)
            .await
            .is_ok_and(|response| response.status().is_success());
        if up && crashed.elapsed() >= restart_after {
            break Instant::now();
        }
        assert!(crashed.elapsed() < DEADLINE, "the worker never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // ... and one second later nothing credits it with what the old process held.
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(back.elapsed())).await;
    let (chosen, reason, tokens) = decide(&picker, &text).await;
    assert!(
        !(chosen == worker && reason == "cache_hit"),
        "{chosen} {reason} {tokens}: the restarted worker is still credited"
    );
    let stream = stream(&stage, 1).await;
    assert_eq!(reset_count(&stream, "restart"), 1, "{stream:#}");
    // The roster knows it too: the worker counts a restart.
    let snapshot = snapshot(&stage).await;
    let restarts = snapshot["pools"][0]["workers"][1]["restarts"].as_u64();
    assert!(restarts >= Some(1), "{snapshot:#}");
    stage.stop().await.unwrap();
}

/// Chats whose segment-wise tokens can differ from the whole text's at a boundary (a content ending
/// in punctuation before the template's marker, trailing newlines and spaces, non-ASCII) and plain
/// ones. In `events` mode the picker must produce the engine's own ids for every one of them, or its
/// blocks would never match the engine's.
fn chats() -> Vec<Value> {
    let contents = [
        "How long should bread dough rise?",
        "Summarise this.\n\n",
        "ends with punctuation...",
        "trailing spaces   ",
        "emoji 🍞 and accents: crème brûlée, naïve café",
        "code: `fn main() { println!(\"hi\"); }`\n",
        "<|im_start|> looks like a marker but is text",
        "numbers 1234567890 and 3.14159",
    ];
    contents
        .iter()
        .enumerate()
        .map(|(at, content)| {
            let mut messages = vec![json!({"role": "system", "content": format!("You are assistant number {at}. Be brief.")})];
            for turn in 0..3 {
                messages.push(json!({"role": "user", "content": format!("{content} (turn {turn}) {}", "context ".repeat(20))}));
                messages.push(json!({"role": "assistant", "content": format!("{content} answered.")}));
            }
            messages.push(json!({"role": "user", "content": *content}));
            json!({"model": MODEL, "messages": messages, "max_tokens": 1})
        })
        .collect()
}

#[tokio::test]
async fn chat_tokens_equal_the_engines_so_every_full_block_matches() {
    let stage = chat_stage().await;
    let worker = stage.fleet.workers()[1].addr();
    wait_stream(&stage, 1, DEADLINE, |s| s["state"] == "live").await;
    let picker = PickerClient::connect(stage.picker.listen()).await.unwrap();
    let chats = chats();
    for (at, chat) in chats.iter().enumerate() {
        let stored_before = stream(&stage, 1).await["blocks_stored"].as_u64().unwrap();
        let reply = request(Method::POST, worker, "/v1/chat/completions", Some(chat)).await;
        assert!(reply.status.is_success(), "{}", reply.text());
        let prompt_tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        // The engine reuses whole blocks short of the prompt's last token (which it must compute), and
        // the picker credits exactly those (the engine's 16-token blocks, from its cache_config_info).
        let full_blocks = (prompt_tokens - 1) / 16;
        wait_stream(&stage, 1, DEADLINE, |s| {
            s["blocks_stored"].as_u64().unwrap() > stored_before
        })
        .await;
        let body = serde_json::to_vec(chat).unwrap();
        let verdict = bounded(
            "a decision",
            DEADLINE,
            picker.decide("/v1/chat/completions", &body),
        )
        .await
        .unwrap();
        let Verdict::Route {
            endpoints,
            prefix_tokens,
            ..
        } = verdict
        else {
            panic!("chat {at} refused: {verdict:?}");
        };
        assert_eq!(endpoints[0], worker, "chat {at}");
        assert_eq!(
            prefix_tokens,
            full_blocks * 16,
            "chat {at}: the picker matched {prefix_tokens} of the engine's {prompt_tokens} prompt tokens"
        );
    }
    stage.stop().await.unwrap();
}

/// `cachepick snapshot` listens to the streams too, so an operator sees whether the engines publish.
#[tokio::test]
async fn the_snapshot_command_shows_every_stream() {
    let stage = stage(KvEventsFormat::VllmArray).await;
    send_directly(stage.fleet.workers()[0].addr(), &prompt("snapshot", 4)).await;
    let pools = bounded(
        "the snapshot",
        DEADLINE,
        cachepick::app::snapshot(stage.config(), 1),
    )
    .await
    .unwrap();
    let streams = &pools[0].kv_events;
    assert_eq!(streams.len(), 2, "{pools:?}");
    for stream in streams {
        assert_eq!(stream.state.as_str(), "live", "{stream:?}");
        assert_eq!(
            stream.replays, 1,
            "the first connection replays the ring: {stream:?}"
        );
    }
    // Worker 0's ring held the batch of the request above.
    assert_eq!(streams[0].last_seq, Some(0), "{streams:?}");
    assert!(streams[0].blocks_stored > 0, "{streams:?}");
    assert!(
        streams
            .iter()
            .all(|stream| stream.events_per_second.is_some()),
        "{streams:?}"
    );
    let text = cachepick::render::snapshot(&pools);
    assert!(
        text.contains("kv events:") && text.contains("EVENTS/S"),
        "{text}"
    );
    assert!(text.contains(" live "), "{text}");
    stage.stop().await.unwrap();
}

/// Two workers of `format`'s engine whose configuration names no sockets: the pool's port is one where
/// nobody publishes, and `index.sockets` is `sockets`.
async fn unnamed_sockets_stage(format: KvEventsFormat, sockets: &str) -> (Stage, SocketAddr) {
    let engine = match format {
        KvEventsFormat::Sglang => Engine::Sglang,
        _ => Engine::Vllm,
    };
    let mut sim = sim_fleet::config(engine, 2);
    sim.kv_events = Some(KvEventsConfig::new(format));
    let nobody = cachepick_rig::free_port().unwrap();
    let stage = bounded(
        "the stage to start",
        Duration::from_secs(20),
        Stage::start(&sim, |text| {
            let unnamed: String = text
                .lines()
                .filter(|line| {
                    !(line.starts_with("        kv_events:")
                        || line.starts_with("          endpoint: tcp://")
                        || line.starts_with("          replay_endpoint: tcp://"))
                })
                .map(|line| format!("{line}\n"))
                .collect();
            let text = events_mode(&unnamed).replacen(
                "      stream_grace: 30s\n",
                &format!(
                    "      stream_grace: 30s\n      sockets: {sockets}\n      port: {}\n",
                    nobody.port()
                ),
                1,
            );
            on_free_ports(&text, "kv_events test", Overrides::default())
        }),
    )
    .await
    .expect("stage");
    (stage, nobody)
}

/// `index.sockets: advertised` (the default): each engine is asked where it publishes (vLLM's
/// `/kv_event_sources`, SGLang's `/server_info`) and its streams move there from the pool's port, so
/// what it caches makes it the owner; `/debug/snapshot` and `/metrics` say the engine named them.
async fn subscribes_where_the_engine_says(format: KvEventsFormat) {
    let (stage, nobody) = unnamed_sockets_stage(format, "advertised").await;
    let worker = &stage.fleet.workers()[1];
    let published = worker.kv_events().unwrap().ranks[0].live;
    let stream = wait_stream(&stage, 1, DEADLINE, |s| s["state"] == "live").await;
    assert_eq!(
        (&stream["from"], &stream["live"]),
        (&json!("engine"), &json!(published.to_string())),
        "{stream:#}"
    );
    assert_ne!(published, nobody);
    let text = prompt(&format!("advertised-{}", format.as_str()), 80);
    send_directly(worker.addr(), &text).await;
    wait_stream(&stage, 1, DEADLINE, |s| {
        s["blocks_stored"].as_u64() > Some(0)
    })
    .await;
    let picker = PickerClient::connect(stage.picker.listen()).await.unwrap();
    let (chosen, reason, _) = decide(&picker, &text).await;
    assert_eq!((chosen, reason.as_str()), (worker.addr(), "cache_hit"));
    let metrics = request(Method::GET, stage.picker.metrics_listen(), "/metrics", None)
        .await
        .text();
    let line = format!(
        "cachepick_kv_events_stream_socket{{from=\"engine\",pool=\"sim-model\",rank=\"0\",socket=\"{published}\",worker=\"1\"}} 1"
    );
    assert!(metrics.lines().any(|l| l == line), "{line}\n{metrics}");
    stage.stop().await.unwrap();
}

#[tokio::test]
async fn vllm_workers_are_subscribed_where_kv_event_sources_says() {
    subscribes_where_the_engine_says(KvEventsFormat::VllmMap).await;
}

#[tokio::test]
async fn sglang_workers_are_subscribed_where_server_info_says() {
    subscribes_where_the_engine_says(KvEventsFormat::Sglang).await;
}

/// The control: with `index.sockets: ports` no engine is asked, so the streams stay at the pool's
/// port, where nobody publishes.
#[tokio::test]
async fn with_sockets_ports_the_engine_is_not_asked() {
    let (stage, nobody) = unnamed_sockets_stage(KvEventsFormat::VllmMap, "ports").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stream = stream(&stage, 1).await;
    assert_eq!(
        (&stream["from"], &stream["live"], &stream["state"]),
        (
            &json!("pool"),
            &json!(format!("127.0.0.1:{}", nobody.port())),
            &json!("connecting")
        ),
        "{stream:#}"
    );
    stage.stop().await.unwrap();
}

/// A picker that starts beside engines already holding prompts says it is ready only once its streams
/// have replayed the engines' rings, so its very first decision finds what they hold (the warm start
/// of an `events` pool). The picker runs `app::run`, whose readiness waits as `serve`'s does.
#[tokio::test]
async fn a_starting_picker_is_ready_only_once_the_engines_rings_are_replayed() {
    let mut sim = sim_fleet::config(Engine::Vllm, 2);
    // A replay that takes a while, as a long ring over a slow link does: a picker ready before it ends
    // would send these first requests where nothing is known of them.
    let mut events = KvEventsConfig::new(KvEventsFormat::VllmMap);
    events.replay_delay = Duration::from_millis(1_500);
    sim.kv_events = Some(events);
    let fleet = sim_fleet::start(&sim).await;
    let mut held = Vec::new();
    for (at, worker) in fleet.workers().iter().enumerate() {
        // Past `min_match_tokens` (1,024), as every prompt here.
        let text = prompt(&format!("held before the picker started {at}"), 80);
        send_directly(worker.addr(), &text).await;
        held.push((worker.addr(), text));
    }
    let config = on_free_ports(
        &events_mode(&fleet.cachepick_config()),
        "kv_events test",
        Overrides::default(),
    )
    .unwrap();
    let mut picker = cachepick_rig::stage::Picker::spawn(config);
    picker
        .ready(cachepick_rig::stage::READY_WITHIN)
        .await
        .unwrap();
    let client = PickerClient::connect(picker.listen()).await.unwrap();
    for (worker, text) in &held {
        let (chosen, reason, _) = decide(&client, text).await;
        assert_eq!(
            (chosen, reason.as_str()),
            (*worker, "cache_hit"),
            "the first decisions after readiness"
        );
    }
}

//! The simulator's KV cache events over real sockets: a fleet with events on, a ZeroMQ SUB on a rank's
//! live socket and a DEALER on its replay socket, requests through the HTTP API. Checks the frames and
//! the msgpack layout of every format, eviction, a healable gap, an unhealable one, a ring that forgot,
//! a prefix-cache reset, a crash and restart, and the ports and config of data-parallel ranks.
//!
//! Every wait is bounded: a missing message fails the test instead of hanging it.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, KvEventsConfig, KvEventsFormat, SimConfig, SimParams, Timing};

const WAIT: Duration = Duration::from_secs(5);
const TOPIC: &str = "kv@sim";
const BLOCK: u32 = 4;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// One worker of `format`'s engine, block size 4, `kv_blocks` blocks, fast, under the slots model: a
/// request's blocks are stored (and room evicted) as it is admitted, so each request is one batch. The
/// step model's batches are per step ([`the_step_model_publishes_each_steps_blocks_when_it_ends`]).
fn config(format: KvEventsFormat, kv_blocks: u32) -> SimConfig {
    let mut config = SimConfig::new(format.engine(), nz(1));
    config.timing = Timing::Slots;
    config.params = SimParams::slots();
    config.tokenizer = TokenizerConfig::Bytes;
    config.block_size = nz(BLOCK);
    config.params.kv_blocks = nz(kv_blocks);
    config.params.time_scale = 0.01;
    let mut events = KvEventsConfig::new(format);
    events.topic = TOPIC.to_owned();
    config.kv_events = Some(events);
    config
}

async fn start(config: &SimConfig) -> Fleet {
    within("the fleet", Fleet::start(config)).await.unwrap()
}

/// A minimal HTTP/1.1 exchange: status and body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    within(&format!("{method} {path}"), async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        (status, body)
    })
    .await
}

/// A completion of `prompt` (token ids) with one output token, to its end.
async fn complete(addr: SocketAddr, prompt: &[u32]) {
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": 1 }).to_string();
    let (status, body) = http(addr, "POST", "/v1/completions", &body).await;
    assert_eq!(status, 200, "{body}");
}

async fn admin(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    http(addr, "POST", path, body).await
}

fn tokens(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

async fn subscribe(live: SocketAddr) -> SubSocket {
    let mut socket = SubSocket::new();
    within(
        "the SUB connection",
        socket.connect(&format!("tcp://{live}")),
    )
    .await
    .unwrap();
    socket.subscribe("").await.unwrap();
    // The PUB learns of the subscription asynchronously and drops what it publishes until then (the
    // slow joiner); there is no signal to wait for, so leave it ample time.
    tokio::time::sleep(Duration::from_millis(500)).await;
    socket
}

/// The next live message: topic, seq, payload.
async fn next_live(socket: &mut SubSocket) -> (Bytes, u64, Value) {
    let message = within("a live batch", socket.recv()).await.unwrap();
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "{frames:?}");
    (frames[0].clone(), seq(&frames[1]), decode(&frames[2]))
}

/// Nothing more arrives on the live socket for a while.
async fn quiet(socket: &mut SubSocket) {
    if let Ok(message) = tokio::time::timeout(Duration::from_millis(300), socket.recv()).await {
        panic!("unexpected live message {message:?}");
    }
}

fn seq(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("an 8-byte seq"))
}

fn decode(payload: &[u8]) -> Value {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader).unwrap();
    assert!(reader.is_empty(), "trailing bytes after the batch");
    value
}

/// A replay request from `start` on the rank's ROUTER: the replies as a DEALER sees them, each with its
/// leading empty delimiter already checked and removed, up to and including the end marker.
async fn replay(addr: SocketAddr, start: u64) -> Vec<Vec<Bytes>> {
    let mut dealer = DealerSocket::new();
    within(
        "the DEALER connection",
        dealer.connect(&format!("tcp://{addr}")),
    )
    .await
    .unwrap();
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.unwrap();
    let mut replies = Vec::new();
    loop {
        let frames = within("a replay reply", dealer.recv())
            .await
            .unwrap()
            .into_vec();
        assert_eq!(
            frames[0],
            Bytes::new(),
            "the empty delimiter first: {frames:?}"
        );
        let frames = frames[1..].to_vec();
        let end = frames.iter().any(|frame| frame.as_ref() == [0xFF; 8]);
        replies.push(frames);
        if end {
            return replies;
        }
    }
}

/// A reply's seq and payload, checking its framing for `format`: vLLM's map-era replay carries the
/// topic (empty on the end marker), the others do not.
fn reply_parts(format: KvEventsFormat, frames: &[Bytes]) -> (Option<u64>, Bytes) {
    let frames = if format == KvEventsFormat::VllmMap {
        assert_eq!(frames.len(), 3, "[topic, seq, payload]: {frames:?}");
        let end = frames[1].as_ref() == [0xFF; 8];
        let topic: &[u8] = if end { b"" } else { TOPIC.as_bytes() };
        assert_eq!(frames[0].as_ref(), topic);
        &frames[1..]
    } else {
        assert_eq!(frames.len(), 2, "[seq, payload]: {frames:?}");
        frames
    };
    if frames[0].as_ref() == [0xFF; 8] {
        assert!(frames[1].is_empty(), "the end marker has an empty payload");
        (None, frames[1].clone())
    } else {
        (Some(seq(&frames[0])), frames[1].clone())
    }
}

/// The seqs a replay answered, checking that it ends with the marker.
fn replayed_seqs(format: KvEventsFormat, replies: &[Vec<Bytes>]) -> Vec<u64> {
    let parts: Vec<(Option<u64>, Bytes)> = replies
        .iter()
        .map(|frames| reply_parts(format, frames))
        .collect();
    assert_eq!(
        parts.last().map(|(seq, _)| *seq),
        Some(None),
        "ends with the marker"
    );
    parts.iter().filter_map(|(seq, _)| *seq).collect()
}

/// An event, read in any format: its tag and named fields.
#[derive(Debug, PartialEq)]
enum Event {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    Cleared,
}

fn hash(value: &Value, format: KvEventsFormat) -> u64 {
    match format {
        // SGLang's hashes are signed; the simulator's are its own u64 reinterpreted.
        KvEventsFormat::Sglang => {
            let signed = value
                .as_i64()
                .unwrap_or_else(|| panic!("i64 hash: {value}"));
            u64::from_ne_bytes(signed.to_ne_bytes())
        }
        _ => value
            .as_u64()
            .unwrap_or_else(|| panic!("u64 hash: {value}")),
    }
}

fn hashes(value: &Value, format: KvEventsFormat) -> Vec<u64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|value| hash(value, format))
        .collect()
}

fn parent(value: &Value, format: KvEventsFormat) -> Option<u64> {
    (!value.is_nil()).then(|| hash(value, format))
}

fn token_ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|token| u32::try_from(token.as_u64().unwrap()).unwrap())
        .collect()
}

fn str(text: &str) -> Value {
    Value::from(text)
}

/// Reads one event, asserting every field of the documented layout for `format`.
fn event(value: &Value, format: KvEventsFormat) -> Event {
    match format {
        KvEventsFormat::VllmArray => {
            let fields = value.as_array().unwrap();
            match fields[0].as_str().unwrap() {
                "BlockStored" => {
                    assert_eq!(fields.len(), 12, "{value}");
                    assert_eq!(fields[4], Value::from(BLOCK));
                    assert!(fields[5].is_nil(), "lora_id");
                    assert_eq!(fields[6], str("GPU"));
                    assert!(
                        fields[7].is_nil() && fields[8].is_nil(),
                        "lora_name, extra_keys"
                    );
                    assert_eq!(fields[9], Value::from(0), "group_idx");
                    assert_eq!(fields[10], str("full_attention"));
                    assert!(fields[11].is_nil(), "sliding window");
                    Event::Stored {
                        hashes: hashes(&fields[1], format),
                        parent: parent(&fields[2], format),
                        tokens: token_ids(&fields[3]),
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(fields.len(), 4, "{value}");
                    assert_eq!(fields[2], str("GPU"));
                    assert_eq!(fields[3], Value::from(0), "group_idx");
                    Event::Removed {
                        hashes: hashes(&fields[1], format),
                    }
                }
                "AllBlocksCleared" => {
                    assert_eq!(fields.len(), 1);
                    Event::Cleared
                }
                other => panic!("unknown tag {other}"),
            }
        }
        KvEventsFormat::VllmMap => {
            let entries = value.as_map().unwrap();
            let keys: Vec<&str> = entries
                .iter()
                .map(|(key, _)| key.as_str().unwrap())
                .collect();
            let field = |name: &str| {
                entries
                    .iter()
                    .find(|(key, _)| key.as_str() == Some(name))
                    .map(|(_, value)| value.clone())
                    .unwrap_or_else(|| panic!("no {name} in {value}"))
            };
            assert_eq!(keys[0], "type", "the tag comes first");
            match field("type").as_str().unwrap() {
                "BlockStored" => {
                    assert_eq!(
                        keys,
                        [
                            "type",
                            "block_hashes",
                            "parent_block_hash",
                            "token_ids",
                            "block_size",
                            "lora_id",
                            "medium",
                            "lora_name",
                            "extra_keys",
                            "group_idx",
                            "kv_cache_spec_kind"
                        ]
                    );
                    assert_eq!(field("block_size"), Value::from(BLOCK));
                    assert!(field("lora_id").is_nil() && field("lora_name").is_nil());
                    assert_eq!(field("medium"), str("GPU"));
                    assert_eq!(field("group_idx"), Value::from(0));
                    assert_eq!(field("kv_cache_spec_kind"), str("full_attention"));
                    Event::Stored {
                        hashes: hashes(&field("block_hashes"), format),
                        parent: parent(&field("parent_block_hash"), format),
                        tokens: token_ids(&field("token_ids")),
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(keys, ["type", "block_hashes", "medium", "group_idx"]);
                    assert_eq!(field("medium"), str("GPU"));
                    Event::Removed {
                        hashes: hashes(&field("block_hashes"), format),
                    }
                }
                "AllBlocksCleared" => {
                    assert_eq!(keys, ["type"]);
                    Event::Cleared
                }
                other => panic!("unknown type {other}"),
            }
        }
        KvEventsFormat::Sglang => {
            let fields = value.as_array().unwrap();
            match fields[0].as_str().unwrap() {
                "BlockStored" => {
                    assert_eq!(fields.len(), 7, "{value}");
                    assert_eq!(fields[1].as_array().unwrap().len(), 1, "one page per event");
                    assert_eq!(fields[4], Value::from(BLOCK));
                    assert!(fields[5].is_nil(), "lora_id");
                    assert_eq!(fields[6], str("GPU"));
                    Event::Stored {
                        hashes: hashes(&fields[1], format),
                        parent: parent(&fields[2], format),
                        tokens: token_ids(&fields[3]),
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(fields.len(), 3, "{value}");
                    assert_eq!(fields[2], str("GPU"));
                    Event::Removed {
                        hashes: hashes(&fields[1], format),
                    }
                }
                "AllBlocksCleared" => {
                    assert_eq!(fields.len(), 1);
                    Event::Cleared
                }
                other => panic!("unknown tag {other}"),
            }
        }
    }
}

/// A batch's events, checking its envelope: `[ts f64, [event...], rank]`.
fn batch(value: &Value, format: KvEventsFormat, rank: u32) -> Vec<Event> {
    let fields = value.as_array().unwrap();
    assert_eq!(fields.len(), 3, "{value}");
    assert!(
        fields[0].as_f64().is_some_and(|ts| ts > 1.6e9),
        "ts: {value}"
    );
    assert!(matches!(fields[0], Value::F64(_)), "ts is a float64");
    assert_eq!(fields[2], Value::from(rank), "the rank");
    let events: Vec<Event> = fields[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|value| event(value, format))
        .collect();
    merge_pages(events)
}

/// SGLang's one-event-per-page stores, joined into runs, so every format reads the same.
fn merge_pages(events: Vec<Event>) -> Vec<Event> {
    let mut merged: Vec<Event> = Vec::new();
    for event in events {
        if let (
            Some(Event::Stored {
                hashes,
                tokens: ids,
                ..
            }),
            Event::Stored {
                hashes: next,
                parent: Some(parent),
                tokens: more,
            },
        ) = (merged.last_mut(), &event)
            && hashes.last() == Some(parent)
        {
            hashes.extend(next);
            ids.extend(more);
            continue;
        }
        merged.push(event);
    }
    merged
}

fn stored_hashes(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Stored { hashes, .. } => Some(hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The whole life of one rank's stream in `format`: stores, eviction, a healable gap, an unhealable
/// one, a reset, and a crash after which the stream starts again from seq 0.
async fn stream_life(format: KvEventsFormat) {
    // Four blocks: a three-block prompt plus its one output block fill the rank.
    let fleet = start(&config(format, 4)).await;
    let worker = fleet.worker(0).unwrap();
    let addr = worker.addr();
    let endpoints = worker.kv_events().unwrap().clone();
    assert_eq!(endpoints.format, format);
    let rank = &endpoints.ranks[0];
    let replay_addr = rank.replay.unwrap();
    let mut live = subscribe(rank.live).await;

    // A cold prompt stores its three full blocks.
    let first = tokens(0, 12);
    complete(addr, &first).await;
    let (topic, seq, payload) = next_live(&mut live).await;
    assert_eq!(topic.as_ref(), TOPIC.as_bytes());
    assert_eq!(seq, 0);
    let events = batch(&payload, format, 0);
    let [
        Event::Stored {
            hashes,
            parent,
            tokens: ids,
        },
    ] = events.as_slice()
    else {
        panic!("one store: {events:?}");
    };
    assert_eq!(hashes.len(), 3);
    assert_eq!(*parent, None);
    assert_eq!(ids, &first);
    let first_hashes = hashes.clone();

    // The same prompt again is a hit: nothing to publish.
    complete(addr, &first).await;
    quiet(&mut live).await;

    // Another prompt needs the room: the first prompt's blocks go, tail first, in the same batch.
    let second = tokens(100, 12);
    complete(addr, &second).await;
    let (_, seq, payload) = next_live(&mut live).await;
    assert_eq!(seq, 1);
    let events = batch(&payload, format, 0);
    assert_eq!(events.len(), 2, "{events:?}");
    let Event::Removed { hashes: removed } = &events[0] else {
        panic!("removal first: {events:?}");
    };
    assert_eq!(
        removed,
        &first_hashes.iter().rev().copied().collect::<Vec<_>>()
    );
    assert!(
        matches!(&events[1], Event::Stored { parent: None, tokens, .. } if *tokens == second),
        "{events:?}"
    );

    // A batch lost on the live socket: a gap in seq, healed by a replay from the missing seq.
    let (status, body) = admin(addr, "/admin/kv-events", r#"{"drop_next": 1}"#).await;
    assert_eq!(status, 200, "{body}");
    let third = tokens(200, 12);
    complete(addr, &third).await;
    complete(addr, &tokens(300, 12)).await;
    let (_, seq, _) = next_live(&mut live).await;
    assert_eq!(seq, 3, "seq 2 was dropped on the live socket");
    let replies = replay(replay_addr, 2).await;
    assert_eq!(replayed_seqs(format, &replies), [2, 3]);
    let (_, payload) = reply_parts(format, &replies[0]);
    let healed = batch(&decode(&payload), format, 0);
    assert!(
        matches!(healed.last(), Some(Event::Stored { tokens, .. }) if *tokens == third),
        "{healed:?}"
    );

    // Lost and kept out of the ring: the replay starts after the gap.
    let (status, body) = admin(
        addr,
        "/admin/kv-events",
        r#"{"drop_next": 1, "unreplayable": true}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    complete(addr, &tokens(400, 12)).await;
    complete(addr, &tokens(500, 12)).await;
    let (_, seq, _) = next_live(&mut live).await;
    assert_eq!(seq, 5);
    let replies = replay(replay_addr, 4).await;
    assert_eq!(
        replayed_seqs(format, &replies),
        [5],
        "seq 4 cannot be replayed"
    );
    let everything = replay(replay_addr, 0).await;
    assert_eq!(replayed_seqs(format, &everything), [0, 1, 2, 3, 5]);

    // The engine's own reset endpoint clears the cache and says so.
    let reset = match format.engine() {
        Engine::Vllm => "/reset_prefix_cache",
        Engine::Sglang => "/flush_cache",
    };
    let (status, body) = admin(addr, reset, "").await;
    assert_eq!(status, 200, "{body}");
    let (_, seq, payload) = next_live(&mut live).await;
    assert_eq!(seq, 6);
    assert_eq!(batch(&payload, format, 0), [Event::Cleared]);

    // A crash: the new process numbers from 0, its ring is empty, and it says nothing about the cache
    // it lost.
    let (status, body) = admin(addr, "/admin/crash", r#"{"restart_after_ms": 50}"#).await;
    assert_eq!(status, 202, "{body}");
    within("the restart", async {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if worker.is_up() {
                break;
            }
        }
    })
    .await;
    let fourth = tokens(600, 8);
    complete(addr, &fourth).await;
    let replies = replay(replay_addr, 0).await;
    assert_eq!(
        replayed_seqs(format, &replies),
        [0],
        "a fresh ring from seq 0"
    );
    let (_, payload) = reply_parts(format, &replies[0]);
    let events = batch(&decode(&payload), format, 0);
    assert!(
        matches!(events.as_slice(), [Event::Stored { parent: None, tokens, .. }] if *tokens == fourth),
        "{events:?}"
    );
    // A new subscriber sees the next batch live, numbered on from there.
    let mut live = subscribe(rank.live).await;
    complete(addr, &tokens(700, 8)).await;
    let (_, seq, _) = next_live(&mut live).await;
    assert_eq!(seq, 1);
    assert_eq!(stored_hashes(&events).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_array_stream_stores_evicts_heals_and_restarts() {
    stream_life(KvEventsFormat::VllmArray).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_map_stream_stores_evicts_heals_and_restarts() {
    stream_life(KvEventsFormat::VllmMap).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_stream_stores_evicts_heals_and_restarts() {
    stream_life(KvEventsFormat::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_ring_forgets_its_oldest_batches() {
    let mut config = config(KvEventsFormat::VllmArray, 64);
    if let Some(events) = &mut config.kv_events {
        events.ring_batches = nz(2);
    }
    let fleet = start(&config).await;
    let worker = fleet.worker(0).unwrap();
    for start in 0..3 {
        complete(worker.addr(), &tokens(start * 100, 8)).await;
    }
    let replay_addr = worker.kv_events().unwrap().ranks[0].replay.unwrap();
    let replies = replay(replay_addr, 0).await;
    assert_eq!(
        replayed_seqs(KvEventsFormat::VllmArray, &replies),
        [1, 2],
        "seq 0 fell out of a two-batch ring"
    );
    // Asking past the end gets the marker alone.
    let replies = replay(replay_addr, 9).await;
    assert!(replayed_seqs(KvEventsFormat::VllmArray, &replies).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_publish_on_contiguous_ports() {
    let mut config = config(KvEventsFormat::VllmMap, 64);
    config.workers = nz(2);
    config.dp_size = nz(2);
    let fleet = start(&config).await;
    let yaml = fleet.cachepick_config();
    for worker in fleet.workers() {
        let events = worker.kv_events().unwrap();
        assert_eq!(events.ranks.len(), 2);
        let (zero, one) = (&events.ranks[0], &events.ranks[1]);
        assert_eq!(one.live.port(), zero.live.port() + 1);
        assert_eq!(one.replay.unwrap().port(), zero.replay.unwrap().port() + 1);
        let entry = format!(
            "      - endpoint: {}\n        dp_size: 2\n        kv_events:\n          endpoint: tcp://{}\n          replay_endpoint: tcp://{}\n",
            worker.addr(),
            zero.live,
            zero.replay.unwrap()
        );
        assert!(yaml.contains(&entry), "{entry}\nnot in\n{yaml}");
    }
    assert!(
        !yaml.contains("index:"),
        "the picker's index mode is not the simulator's to set"
    );

    // Rank 1 gets the second request while rank 0 holds the first (paused, so both stay put), and
    // publishes it on its own socket with its own rank and its own seq.
    let worker = fleet.worker(0).unwrap();
    let addr = worker.addr();
    let mut rank_one = subscribe(worker.kv_events().unwrap().ranks[1].live).await;
    admin(addr, "/admin/pause", "").await;
    let held: Vec<_> = [0u32, 100]
        .into_iter()
        .map(|start| tokio::spawn(async move { complete(addr, &tokens(start, 8)).await }))
        .collect();
    let (_, seq, payload) = next_live(&mut rank_one).await;
    assert_eq!(seq, 0);
    let events = batch(&payload, KvEventsFormat::VllmMap, 1);
    assert_eq!(stored_hashes(&events).len(), 2);
    admin(addr, "/admin/resume", "").await;
    for request in held {
        within("the held requests", request).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_port_lays_the_ranks_out_worker_after_worker() {
    // A port range unlikely to be in use, probed so the test skips rather than fails when it is.
    let base = 47_310;
    let probe: Vec<_> = (0..8)
        .map(|offset| std::net::TcpListener::bind(("127.0.0.1", base + offset)))
        .collect();
    if probe.iter().any(Result::is_err) {
        eprintln!("ports {base}..{} busy; skipped", base + 8);
        return;
    }
    drop(probe);
    let mut config = config(KvEventsFormat::Sglang, 64);
    config.workers = nz(2);
    config.dp_size = nz(2);
    if let Some(events) = &mut config.kv_events {
        events.base_port = Some(base);
    }
    let fleet = start(&config).await;
    let ports = |index: usize| {
        let events = fleet.worker(index).unwrap().kv_events().unwrap().clone();
        events
            .ranks
            .iter()
            .flat_map(|rank| [rank.live.port(), rank.replay.unwrap().port()])
            .collect::<Vec<u16>>()
    };
    assert_eq!(ports(0), [base, base + 2, base + 1, base + 3]);
    assert_eq!(ports(1), [base + 4, base + 6, base + 5, base + 7]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_there_is_no_router_and_no_replay_endpoint() {
    let mut config = config(KvEventsFormat::VllmArray, 64);
    if let Some(events) = &mut config.kv_events {
        events.replay = false;
    }
    let fleet = start(&config).await;
    let events = fleet.worker(0).unwrap().kv_events().unwrap();
    assert_eq!(events.ranks[0].replay, None);
    let yaml = fleet.cachepick_config();
    assert!(
        yaml.contains("kv_events:\n          endpoint: tcp://"),
        "{yaml}"
    );
    assert!(!yaml.contains("replay_endpoint"), "{yaml}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_events_control_needs_events_on() {
    let mut config = config(KvEventsFormat::VllmMap, 64);
    config.kv_events = None;
    let fleet = start(&config).await;
    let worker = fleet.worker(0).unwrap();
    assert!(worker.kv_events().is_none());
    assert!(!fleet.cachepick_config().contains("kv_events"));
    let (status, _) = admin(worker.addr(), "/admin/kv-events", r#"{"drop_next": 1}"#).await;
    assert_eq!(status, 409);

    let fleet = start(&self::config(KvEventsFormat::VllmMap, 64)).await;
    let addr = fleet.worker(0).unwrap().addr();
    let (status, body) = admin(addr, "/admin/kv-events", r#"{"drop_next": 1, "rank": 3}"#).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = admin(addr, "/admin/kv-events", r#"{"drop": 1}"#).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = admin(addr, "/admin/kv-events", r#"{"drop_next": 2}"#).await;
    assert_eq!(status, 200, "{body}");
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(state["kv_events"]["format"], "vllm_map");
    assert_eq!(state["ranks"][0]["kv_events"]["drop_next"], 2);
}

/// Under the step model a batch is one step's changes, published when the step ends: a prompt longer
/// than the budget is stored chunk by chunk, each chunk's blocks chained to the previous chunk's, and
/// room is evicted only when a step needs it (a decode's new block included), least recently released
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_model_publishes_each_steps_blocks_when_it_ends() {
    let mut config = SimConfig::new(Engine::Vllm, nz(1));
    config.tokenizer = TokenizerConfig::Bytes;
    config.block_size = nz(BLOCK);
    config.params.kv_blocks = nz(8);
    config.params.batch_tokens = nz(8);
    config.params.time_scale = 0.01;
    config.kv_events = Some(KvEventsConfig::new(KvEventsFormat::VllmMap));
    let fleet = start(&config).await;
    let worker = fleet.worker(0).unwrap();
    let addr = worker.addr();
    let rank = worker.kv_events().unwrap().ranks[0].clone();
    let mut live = subscribe(rank.live).await;

    // 12 tokens at 8 a step: two prefill steps, two batches; one output token, no decode step.
    let first = tokens(0, 12);
    complete(addr, &first).await;
    let (_, seq, payload) = next_live(&mut live).await;
    assert_eq!(seq, 0);
    let chunk = batch(&payload, KvEventsFormat::VllmMap, 0);
    let [
        Event::Stored {
            hashes: head,
            parent: None,
            tokens: ids,
        },
    ] = chunk.as_slice()
    else {
        panic!("the first chunk's two blocks: {chunk:?}");
    };
    assert_eq!((head.len(), ids.as_slice()), (2, &first[..8]));
    let (_, seq, payload) = next_live(&mut live).await;
    assert_eq!(seq, 1);
    let chunk = batch(&payload, KvEventsFormat::VllmMap, 0);
    let [
        Event::Stored {
            hashes: tail,
            parent,
            tokens: ids,
        },
    ] = chunk.as_slice()
    else {
        panic!("the second chunk's block: {chunk:?}");
    };
    assert_eq!(tail.len(), 1);
    assert_eq!(*parent, head.last().copied(), "chained to the first chunk");
    assert_eq!(ids.as_slice(), &first[8..]);
    quiet(&mut live).await;

    // 28 more tokens need 7 blocks of the 8, two chunks after the first: the first prompt's tail two
    // blocks are evicted once the steps that need the room come.
    let second = tokens(100, 28);
    complete(addr, &second).await;
    let (_, _, payload) = next_live(&mut live).await;
    let events = batch(&payload, KvEventsFormat::VllmMap, 0);
    assert!(
        matches!(events.first(), Some(Event::Stored { tokens, .. }) if *tokens == second[..8]),
        "{events:?}"
    );
    let mut removed: Vec<u64> = Vec::new();
    let mut stored = stored_hashes(&events);
    for _ in 0..4 {
        let (_, _, payload) = next_live(&mut live).await;
        let events = batch(&payload, KvEventsFormat::VllmMap, 0);
        for event in &events {
            if let Event::Removed { hashes } = event {
                removed.extend(hashes.iter().copied());
            }
        }
        stored.extend(stored_hashes(&events));
        if stored.len() == 7 {
            break;
        }
    }
    assert_eq!(stored.len(), 7, "the second prompt's full blocks");
    assert_eq!(removed, [tail[0], head[1]], "least recently released first");
}

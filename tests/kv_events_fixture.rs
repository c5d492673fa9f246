//! The KV event decoder against bytes it did not write: `scripts/kv-events-fixture.py` publishes
//! scripted batches with the engines' own msgspec struct shapes and encoder over libzmq (pyzmq), in
//! each engine's encoding, and serves vLLM's replay protocol. Here a `zeromq::SubSocket` takes the
//! live frames and a `zeromq::DealerSocket` the replayed ones, and every payload is decoded with
//! `decode_batch` and compared field by field with what the script said.
//!
//! The fixture's Python (pinned `msgspec` and `pyzmq`) is installed by `scripts/provision-python`
//! into `target/`; a machine where that fails fails these tests, loudly.
//!
//! The helpers — [`Fixture`], [`subscribe`], [`recv_frames`], [`replay`] — know nothing of the
//! decoder, so the same fixture can be pointed at another subscriber.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use cachepick::events::decode::decode_batch;
use cachepick::events::{BlockStored, EventBatch, KvEvent, Medium};
use serde_json::{Value, json};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(20);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The provisioned interpreter, installed once per test binary.
fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = Command::new("bash")
            .arg(root().join("scripts/provision-python"))
            .output()
            .expect("run scripts/provision-python");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "scripts/provision-python failed ({}); these tests need Python 3 with venv and PyPI:\n{stderr}",
            out.status
        );
        let path = String::from_utf8(out.stdout).unwrap();
        let path = PathBuf::from(path.trim());
        assert!(path.is_file(), "provision-python printed {path:?}, which is not a file:\n{stderr}");
        path
    })
}

/// How replies to a replay request are framed after the DEALER's empty delimiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// vLLM ≥ 0.26: `[topic, seq, payload]`.
    Topic,
    /// vLLM < 0.26 and SGLang: `[seq, payload]`.
    Legacy,
}

/// A running `kv-events-fixture.py`; killed when dropped.
pub struct Fixture {
    child: Child,
    pub pub_endpoint: String,
    pub replay_endpoint: String,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Fixture {
    /// Starts the fixture on two free loopback ports with `script` (the JSON the script documents) on
    /// its stdin, and waits until it has bound. It publishes once one subscriber has subscribed.
    pub fn start(
        format: &str,
        hash_form: &str,
        framing: Framing,
        topic: &str,
        script: &Value,
    ) -> Fixture {
        let pub_endpoint = format!("tcp://{}", cachepick_rig::free_port().unwrap());
        let replay_endpoint = format!("tcp://{}", cachepick_rig::free_port().unwrap());
        let framing = match framing {
            Framing::Topic => "topic",
            Framing::Legacy => "legacy",
        };
        let mut child = Command::new(python())
            .arg(root().join("scripts/kv-events-fixture.py"))
            .args(["--format", format, "--hash-form", hash_form])
            .args(["--pub", &pub_endpoint, "--replay", &replay_endpoint])
            .args(["--replay-framing", framing, "--topic", topic])
            .args([
                "--subscribers",
                "1",
                "--timeout",
                &WAIT.as_secs().to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the fixture");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(script.to_string().as_bytes()).unwrap();
        drop(stdin);
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let fixture = Fixture {
            child,
            pub_endpoint,
            replay_endpoint,
            stdout,
            stderr,
        };
        fixture.wait_line("ready");
        fixture
    }

    /// Waits for a stdout line starting with `prefix` (`ready`, `published N`).
    pub fn wait_line(&self, prefix: &str) -> String {
        loop {
            match self.stdout.recv_timeout(WAIT) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(e) => panic!(
                    "the fixture printed no `{prefix}` ({e}); its stderr:\n{}",
                    self.stderr()
                ),
            }
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A live frame: `[topic, seq, payload]`.
#[derive(Debug)]
pub struct Frame {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
}

fn seq_of(frame: &Bytes) -> i64 {
    i64::from_be_bytes(
        frame
            .as_ref()
            .try_into()
            .expect("an 8-byte sequence number"),
    )
}

/// A SUB socket connected to `endpoint` and subscribed to `topic`. The fixture publishes only once
/// the subscription has reached it, so nothing is lost to the slow-joiner race.
pub async fn subscribe(endpoint: &str, topic: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    tokio::time::timeout(WAIT, sub.connect(endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    sub.subscribe(topic).await.expect("subscribe");
    sub
}

/// The next `n` frames, each within the wait.
pub async fn recv_frames(sub: &mut SubSocket, n: usize) -> Vec<Frame> {
    let mut frames = Vec::with_capacity(n);
    while frames.len() < n {
        let message = tokio::time::timeout(WAIT, sub.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {n} frames came in time", frames.len()))
            .expect("recv");
        let parts = message.into_vec();
        assert_eq!(
            parts.len(),
            3,
            "a live message is [topic, seq, payload]: {parts:?}"
        );
        frames.push(Frame {
            topic: parts[0].clone(),
            seq: u64::try_from(seq_of(&parts[1])).unwrap(),
            payload: parts[2].clone(),
        });
    }
    frames
}

/// Asks the replay socket for every batch from `start_seq` on; returns `(seq, payload)` pairs, and
/// checks the reply framing, the topic, and the end marker (seq -1, empty payload).
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    framing: Framing,
    topic: &str,
) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(WAIT, dealer.connect(endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.expect("send the replay request");
    let mut replies = Vec::new();
    loop {
        let message = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .expect("a replay reply in time")
            .expect("recv");
        let parts = message.into_vec();
        let rest = match (framing, parts.as_slice()) {
            (Framing::Topic, [delimiter, t, rest @ ..]) if rest.len() == 2 => {
                assert!(delimiter.is_empty());
                assert_eq!(t.as_ref(), topic.as_bytes());
                rest
            }
            (Framing::Legacy, [delimiter, rest @ ..]) if rest.len() == 2 => {
                assert!(delimiter.is_empty());
                rest
            }
            _ => panic!("a {framing:?} replay reply, not {parts:?}"),
        };
        let seq = seq_of(&rest[0]);
        if seq == -1 {
            assert!(rest[1].is_empty(), "the end marker has an empty payload");
            return replies;
        }
        replies.push((u64::try_from(seq).unwrap(), rest[1].clone()));
    }
}

/// Runs `script` through the fixture: the live frames (checked for topic and sequence), and the
/// replay from `replay_from`, as decoded batches.
async fn run(
    format: &str,
    hash_form: &str,
    framing: Framing,
    script: &Value,
    replay_from: u64,
) -> (Vec<EventBatch>, Vec<(u64, EventBatch)>) {
    let topic = "kv@127.0.0.1";
    let fixture = Fixture::start(format, hash_form, framing, topic, script);
    let mut sub = subscribe(&fixture.pub_endpoint, topic).await;
    let n = script.as_array().unwrap().len();
    let frames = recv_frames(&mut sub, n).await;
    assert_eq!(fixture.wait_line("published"), format!("published {n}"));
    let mut live = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        assert_eq!(frame.topic.as_ref(), topic.as_bytes());
        assert_eq!(frame.seq, i as u64);
        let batch = decode_batch(&frame.payload).unwrap_or_else(|e| {
            panic!(
                "{format} frame {i}: {e}; payload {:02x?}",
                frame.payload.as_ref()
            )
        });
        live.push(batch);
    }
    let replayed = replay(&fixture.replay_endpoint, replay_from, framing, topic).await;
    for (seq, payload) in &replayed {
        let frame = &frames[usize::try_from(*seq).unwrap()];
        assert_eq!(
            payload, &frame.payload,
            "a replay sends the bytes it published"
        );
    }
    let replayed = replayed
        .into_iter()
        .map(|(seq, payload)| (seq, decode_batch(&payload).unwrap()))
        .collect();
    (live, replayed)
}

fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: std::ops::RangeInclusive<u32>,
    block_size: u32,
    medium: Medium,
) -> BlockStored {
    BlockStored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.collect(),
        block_size,
        medium,
        lora_name: None,
        cache_salt: None,
        opaque_extra_keys: false,
    }
}

/// A vLLM script: every event kind, both salt shapes, a multimodal key, a sliding-window store and an
/// event no engine sends; hashes at both ends of u64.
fn vllm_script() -> Value {
    json!([
        {"ts": 1700000000.25, "rank": 0, "events": [
            {"type": "BlockStored", "block_hashes": [u64::MAX, 1u64 << 63], "parent_block_hash": null,
             "token_ids": (1..=8).collect::<Vec<u32>>(), "block_size": 4, "lora_id": 7,
             "medium": "GPU", "lora_name": "sql-lora",
             "extra_keys": [["sql-lora", "tenant-a"], ["sql-lora"]],
             "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": u64::MAX - 1,
             "token_ids": [9, 10, 11, 12], "block_size": 4, "medium": "CPU",
             "extra_keys": [[["img-9f2c", 0]]]},
            {"type": "BlockStored", "block_hashes": [], "token_ids": (1..=8).collect::<Vec<u32>>(),
             "block_size": 4, "medium": "GPU", "group_idx": 1,
             "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128},
            {"type": "BlockPinned", "fields": [[1, 2], {"x": 1}]}
        ]},
        {"ts": 1700000001.5, "rank": 0, "events": [
            {"type": "BlockRemoved", "block_hashes": [3, u64::MAX], "medium": "CPU", "group_idx": 0},
            {"type": "AllBlocksCleared"}
        ]},
        {"ts": 1700000002.0, "rank": null, "events": [
            {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": null,
             "token_ids": [1, 2, 3, 4], "block_size": 4}
        ]}
    ])
}

fn vllm_expected() -> Vec<EventBatch> {
    vec![
        EventBatch {
            ts: 1700000000.25,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    lora_name: Some("sql-lora".to_owned()),
                    cache_salt: Some("tenant-a".to_owned()),
                    ..stored(&[u64::MAX, 1 << 63], None, 1..=8, 4, Medium::Gpu)
                }),
                KvEvent::BlockStored(BlockStored {
                    opaque_extra_keys: true,
                    ..stored(&[3], Some(u64::MAX - 1), 9..=12, 4, Medium::Cpu)
                }),
            ],
            rank: Some(0),
            // The sliding-window store and the unknown tag.
            unknown_events: 2,
        },
        EventBatch {
            ts: 1700000001.5,
            events: vec![
                KvEvent::BlockRemoved {
                    hashes: vec![3, u64::MAX],
                    medium: Medium::Cpu,
                },
                KvEvent::AllBlocksCleared,
            ],
            rank: Some(0),
            unknown_events: 0,
        },
        EventBatch {
            ts: 1700000002.0,
            events: vec![KvEvent::BlockStored(stored(
                &[5],
                None,
                1..=4,
                4,
                Medium::Gpu,
            ))],
            rank: None,
            unknown_events: 0,
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_array_encoding_live_and_replayed_with_topic_framing() {
    let (live, replayed) = run("vllm_array", "int", Framing::Topic, &vllm_script(), 1).await;
    let expected = vllm_expected();
    assert_eq!(live, expected);
    assert_eq!(
        replayed,
        vec![(1, expected[1].clone()), (2, expected[2].clone())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_map_encoding_with_omitted_defaults_and_legacy_replay() {
    let (live, replayed) = run("vllm_map", "int", Framing::Legacy, &vllm_script(), 0).await;
    let expected = vllm_expected();
    assert_eq!(live, expected);
    assert_eq!(
        replayed,
        expected
            .into_iter()
            .enumerate()
            .map(|(i, b)| (i as u64, b))
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_digest_bytes_hashes_read_as_their_last_eight_bytes() {
    for format in ["vllm_array", "vllm_map"] {
        let (live, replayed) = run(format, "bytes", Framing::Topic, &vllm_script(), 2).await;
        let expected = vllm_expected();
        assert_eq!(live, expected, "{format}");
        assert_eq!(replayed, vec![(2, expected[2].clone())], "{format}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_encoding_with_salt_partial_page_and_bigrams() {
    let script = json!([
        {"ts": 12.5, "rank": 1, "events": [
            // A salted page, then the prompt's short last page chained to it.
            {"type": "BlockStored", "block_hashes": [-42], "parent_block_hash": null,
             "token_ids": (1..=16).collect::<Vec<u32>>(), "block_size": 16, "medium": "GPU",
             "cache_salt": "tenant-z"},
            {"type": "BlockStored", "block_hashes": [i64::MIN], "parent_block_hash": -42,
             "token_ids": [17, 18, 19], "block_size": 3, "medium": "GPU", "cache_salt": "tenant-z"},
            // EAGLE bigram pages: (token, next token) per position; an older release's nil medium.
            {"type": "BlockStored", "block_hashes": [i64::MAX], "parent_block_hash": null,
             "token_ids": [[100, 101], [101, 102], [102, 103], [103, 104]], "block_size": 4},
            {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 8,
             "token_ids": [1, 2], "block_size": 2, "medium": "CPU_PINNED"},
            {"type": "BlockRemoved", "block_hashes": [-42, 9], "medium": "DISK"},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "EXTERNAL"}
        ]},
        {"ts": 13.0, "rank": null, "events": [{"type": "AllBlocksCleared"}]}
    ]);
    let expected = vec![
        EventBatch {
            ts: 12.5,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    cache_salt: Some("tenant-z".to_owned()),
                    ..stored(&[(-42i64) as u64], None, 1..=16, 16, Medium::Gpu)
                }),
                KvEvent::BlockStored(BlockStored {
                    cache_salt: Some("tenant-z".to_owned()),
                    ..stored(&[1 << 63], Some((-42i64) as u64), 17..=19, 3, Medium::Gpu)
                }),
                KvEvent::BlockStored(stored(&[i64::MAX as u64], None, 100..=103, 4, Medium::Gpu)),
                KvEvent::BlockStored(stored(&[9], Some(8), 1..=2, 2, Medium::Cpu)),
                KvEvent::BlockRemoved {
                    hashes: vec![(-42i64) as u64, 9],
                    medium: Medium::Disk,
                },
                KvEvent::BlockRemoved {
                    hashes: vec![7],
                    medium: Medium::Other,
                },
            ],
            rank: Some(1),
            unknown_events: 0,
        },
        EventBatch {
            ts: 13.0,
            events: vec![KvEvent::AllBlocksCleared],
            rank: None,
            unknown_events: 0,
        },
    ];
    let (live, replayed) = run("sglang", "int", Framing::Legacy, &script, 1).await;
    assert_eq!(live, expected);
    assert_eq!(replayed, vec![(1, expected[1].clone())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_past_the_end_is_the_end_marker_alone() {
    let script = json!([{"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]}]);
    let topic = "t";
    for framing in [Framing::Topic, Framing::Legacy] {
        let fixture = Fixture::start("vllm_map", "int", framing, topic, &script);
        let mut sub = subscribe(&fixture.pub_endpoint, topic).await;
        assert_eq!(recv_frames(&mut sub, 1).await[0].seq, 0);
        assert!(
            replay(&fixture.replay_endpoint, 5, framing, topic)
                .await
                .is_empty()
        );
        assert_eq!(
            replay(&fixture.replay_endpoint, 0, framing, topic)
                .await
                .len(),
            1
        );
    }
}

//! A hostile engine's KV event sockets, spoken in raw ZMTP 3.0 over blocking TCP: a PUB whose first
//! subscriber gets one frame of a declared size (its body generated chunk by chunk, never held whole),
//! and a ROUTER whose first replay answers with many large batches. Later connections behave: the PUB
//! publishes a valid empty batch every 100 ms, numbered from 0, the ROUTER answers with the end marker.
//!
//! Written against the wire, not a ZeroMQ library, so the test controls every byte and the library
//! cannot buffer or refuse on the sender's side.

#![allow(dead_code)] // not every test binary that includes the folder uses every counter

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// What the hostile sockets did.
#[derive(Default, Debug)]
pub struct Counters {
    pub live_connections: AtomicU64,
    /// Body bytes of the oversized frame the subscriber took before it closed the connection.
    pub frame_body_sent: AtomicU64,
    pub replay_connections: AtomicU64,
    /// Payload bytes of the first replay the subscriber took before it stopped reading.
    pub replay_bytes_sent: AtomicU64,
    /// Valid batches published after the first connection.
    pub valid_batches_sent: AtomicU64,
}

pub struct HostileEngine {
    pub live: SocketAddr,
    pub replay: SocketAddr,
    pub counters: Arc<Counters>,
}

impl HostileEngine {
    /// The first live connection gets a frame declaring `frame_bytes`; the first replay gets
    /// `replay_batches` batches of `batch_bytes` each.
    pub fn start(frame_bytes: u64, replay_batches: u64, batch_bytes: usize) -> HostileEngine {
        let counters = Arc::new(Counters::default());
        let live = TcpListener::bind("127.0.0.1:0").unwrap();
        let replay = TcpListener::bind("127.0.0.1:0").unwrap();
        let engine = HostileEngine {
            live: live.local_addr().unwrap(),
            replay: replay.local_addr().unwrap(),
            counters: Arc::clone(&counters),
        };
        let live_counters = Arc::clone(&counters);
        std::thread::spawn(move || {
            for stream in live.incoming() {
                let Ok(stream) = stream else { continue };
                let n = live_counters
                    .live_connections
                    .fetch_add(1, Ordering::SeqCst);
                let counters = Arc::clone(&live_counters);
                std::thread::spawn(move || {
                    let _ = if n == 0 {
                        oversized_frame(stream, frame_bytes, &counters)
                    } else {
                        valid_batches(stream, &counters)
                    };
                });
            }
        });
        let replay_counters = counters;
        std::thread::spawn(move || {
            for stream in replay.incoming() {
                let Ok(stream) = stream else { continue };
                let n = replay_counters
                    .replay_connections
                    .fetch_add(1, Ordering::SeqCst);
                let counters = Arc::clone(&replay_counters);
                std::thread::spawn(move || {
                    let _ = if n == 0 {
                        flood(stream, replay_batches, batch_bytes, &counters)
                    } else {
                        empty_replay(stream)
                    };
                });
            }
        });
        engine
    }

    pub fn counter(&self, read: impl Fn(&Counters) -> &AtomicU64) -> u64 {
        read(&self.counters).load(Ordering::SeqCst)
    }
}

fn header(out: &mut Vec<u8>, flags: u8, len: u64) {
    if len > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        out.push(flags);
        out.push(len as u8);
    }
}

fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    header(out, flags, body.len() as u64);
    out.extend_from_slice(body);
}

fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, body) in frames.iter().enumerate() {
        frame(&mut out, if i + 1 < frames.len() { MORE } else { 0 }, body);
    }
    out
}

/// Reads one frame whole (the client's frames are small): flags and body.
fn read_frame(stream: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut flags = [0_u8; 1];
    stream.read_exact(&mut flags)?;
    let len = if flags[0] & LONG != 0 {
        let mut len = [0_u8; 8];
        stream.read_exact(&mut len)?;
        u64::from_be_bytes(len)
    } else {
        let mut len = [0_u8; 1];
        stream.read_exact(&mut len)?;
        u64::from(len[0])
    };
    assert!(len < 1 << 20, "the client sent a frame of {len} bytes");
    let mut body = vec![0_u8; len as usize];
    stream.read_exact(&mut body)?;
    Ok((flags[0], body))
}

/// The server's half of the NULL handshake, as `socket_type`.
fn handshake(stream: &mut TcpStream, socket_type: &[u8]) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut greeting = [0_u8; 64];
    stream.read_exact(&mut greeting)?;
    let mut ours = [0_u8; 64];
    ours[0] = 0xff;
    ours[9] = 0x7f;
    ours[10] = 3;
    ours[12..16].copy_from_slice(b"NULL");
    stream.write_all(&ours)?;
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    ready.extend_from_slice(socket_type);
    let mut out = Vec::new();
    frame(&mut out, COMMAND, &ready);
    stream.write_all(&out)?;
    let (flags, _) = read_frame(stream)?;
    assert!(flags & COMMAND != 0, "the client's READY");
    Ok(())
}

/// A vLLM batch with no events: `[ts, [], nil]`.
fn empty_batch() -> Vec<u8> {
    let mut payload = vec![0x93, 0xcb];
    payload.extend_from_slice(&1.0_f64.to_be_bytes());
    payload.extend_from_slice(&[0x90, 0xc0]);
    payload
}

/// Topic, sequence 0, then a payload frame declaring `len` bytes, its body written 1 MiB at a time
/// from one buffer until the peer stops reading.
fn oversized_frame(mut stream: TcpStream, len: u64, counters: &Counters) -> std::io::Result<()> {
    handshake(&mut stream, b"PUB")?;
    let mut out = Vec::new();
    frame(&mut out, MORE, b"kv@hostile");
    frame(&mut out, MORE, &0_u64.to_be_bytes());
    header(&mut out, 0, len);
    stream.write_all(&out)?;
    let chunk = vec![0xc1_u8; 1 << 20];
    let mut sent = 0_u64;
    while sent < len {
        let take = chunk.len().min((len - sent) as usize);
        stream.write_all(&chunk[..take])?;
        sent += take as u64;
        counters.frame_body_sent.store(sent, Ordering::SeqCst);
    }
    Ok(())
}

fn valid_batches(mut stream: TcpStream, counters: &Counters) -> std::io::Result<()> {
    handshake(&mut stream, b"PUB")?;
    let payload = empty_batch();
    for seq in 0_u64.. {
        stream.write_all(&message(&[b"kv@hostile", &seq.to_be_bytes(), &payload]))?;
        counters.valid_batches_sent.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Answers the first replay request with `batches` messages of `batch_bytes` undecodable bytes
/// (one buffer, written again and again), then the end marker.
fn flood(
    mut stream: TcpStream,
    batches: u64,
    batch_bytes: usize,
    counters: &Counters,
) -> std::io::Result<()> {
    handshake(&mut stream, b"ROUTER")?;
    read_frame(&mut stream)?; // the empty delimiter
    read_frame(&mut stream)?; // the sequence asked for
    let payload = vec![0xc1_u8; batch_bytes];
    for seq in 0..batches {
        let mut out = Vec::new();
        frame(&mut out, MORE, b"");
        frame(&mut out, MORE, &seq.to_be_bytes());
        header(&mut out, 0, payload.len() as u64);
        stream.write_all(&out)?;
        stream.write_all(&payload)?;
        counters
            .replay_bytes_sent
            .fetch_add(payload.len() as u64, Ordering::SeqCst);
    }
    stream.write_all(&message(&[b"", &(-1_i64).to_be_bytes(), b""]))?;
    Ok(())
}

fn empty_replay(mut stream: TcpStream) -> std::io::Result<()> {
    handshake(&mut stream, b"ROUTER")?;
    read_frame(&mut stream)?;
    read_frame(&mut stream)?;
    stream.write_all(&message(&[b"", &(-1_i64).to_be_bytes(), b""]))?;
    // Hold the connection until the client closes it.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    Ok(())
}

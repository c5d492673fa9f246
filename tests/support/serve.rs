//! The `serve` process of the tests that run the real binary: the command, its log lines on a channel,
//! the addresses it logs, and the plain HTTP GET and snapshot reading they ask it with.
//!
//! The files in this folder panic, unwrap and index freely: every test file includes the ones it uses as
//! `mod support { pub mod …; }`, under the `#![allow(clippy::unwrap_used, …)]` that covers them.

#![allow(dead_code)] // each test binary that runs `serve` uses a different part

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long `serve` may take to log the addresses it bound.
const STARTS_WITHIN: Duration = Duration::from_secs(30);

/// The flags that put both listeners on ports the kernel picks; `serve` logs the ones it bound.
pub const ANY_PORTS: [&str; 4] = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];

/// A `serve` process, killed if the test fails before it ends.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `cachepick serve --config <config>` and `args`, at `RUST_LOG=log` without colour, with stdout and
/// stderr piped; a test that wants a stream elsewhere sets it before spawning.
pub fn command(config: &Path, args: &[&str], log: &str) -> Command {
    let mut command = Command::new(cachepick_rig::cachepick_binary());
    command
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(args)
        .env("RUST_LOG", log)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Spawns `command` and forwards every line of its stdout and stderr to the channel it returns, so a
/// test can wait for a line without a full pipe ever blocking the process.
pub fn spawn_logged(command: &mut Command) -> (Server, mpsc::Receiver<String>) {
    let mut server = Server(command.spawn().expect("serve starts"));
    let (sender, receiver) = mpsc::channel();
    for pipe in [
        Box::new(server.0.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(server.0.stderr.take().unwrap()),
    ] {
        let sender = sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
    }
    (server, receiver)
}

/// The value of the ` name=` field in the first log line that has one (`listen`, `metrics_listen`).
pub fn logged_field(lines: &mpsc::Receiver<String>, name: &str) -> String {
    let deadline = Instant::now() + STARTS_WITHIN;
    let field = format!(" {name}=");
    loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("serve logs its addresses");
        if let Some(rest) = line.split(&field).nth(1) {
            return rest.split_whitespace().next().unwrap().to_owned();
        }
    }
}

/// The workers of the first pool of a `/debug/snapshot` body: (endpoint, state).
pub fn snapshot_workers(snapshot: &serde_json::Value) -> Vec<(String, String)> {
    snapshot["pools"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|worker| {
            (
                worker["endpoint"].as_str().unwrap().to_owned(),
                worker["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A plain HTTP/1.1 GET over a fresh connection, blocking; returns the whole response.
pub fn http_get(addr: &str, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    response
}

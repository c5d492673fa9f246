//! Shared helpers for the integration tests.
//!
//! The files in this folder panic, unwrap and index freely: every test file that includes one carries
//! the `#![allow(clippy::unwrap_used, …)]` that covers them.
pub mod engine;
pub mod hostile_zmtp;

use std::io::{Read, Write};
use std::process::Child;
use std::time::Duration;

/// A `serve` process, killed if the test fails before it ends.
#[allow(dead_code)] // only the test binaries that run the real binary hold one
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP/1.1 GET over a fresh connection, blocking; returns the whole response.
#[allow(dead_code)] // not every test binary that includes the folder asks over HTTP
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

//! The `serve` process of the tests that run the real binary, and the plain HTTP GET they ask it with.
//!
//! The files in this folder panic, unwrap and index freely: every test file includes the ones it uses as
//! `mod support { pub mod …; }`, under the `#![allow(clippy::unwrap_used, …)]` that covers them.

use std::io::{Read, Write};
use std::process::Child;
use std::time::Duration;

/// A `serve` process, killed if the test fails before it ends.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP/1.1 GET over a fresh connection, blocking; returns the whole response.
#[allow(dead_code)] // not every test binary that runs `serve` asks it over HTTP
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

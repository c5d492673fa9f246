//! cachepick's bench rig: the product and the simulator together, for people and for tests.
//!
//! # Layout
//! - [`chaos`]: `cachepick chaos` — faults (workers, their metrics, the picker process, slow and
//!   malformed clients) through a real Envoy, every lost request explained; and `--soak`, the picker's
//!   memory over a steady run.
//! - [`client`]: an ext_proc client that asks a picker for a decision the way Envoy does.
//! - [`envoy`]: finding the Envoy binary and running it with the configuration cachepick generates.
//! - [`overhead`]: `cachepick overhead` — the same requests to one worker directly, through Envoy,
//!   Envoy + a no-op ext_proc server and Envoy + cachepick, side by side; what cachepick's own work costs.
//! - [`replay`]: `cachepick replay` — a Mooncake trace or the burst scenario, once per routing policy on
//!   a fresh simulated fleet; prefix-hit rate, TTFT, balance and reasons as a table, JSON and SVG.
//! - [`demo`]: `cachepick demo` — one replay of the burst workload with the fleet's policy, through
//!   Envoy when installed, and a short report.
//! - [`stage`]: the fleet, cachepick through `app::run` with a named shutdown, and optionally Envoy:
//!   what replay, the demo, the integration tests and the benches stand on.
//!
//! This crate depends on both `cachepick` and `cachepick-sim`; neither depends on it, so nothing in
//! the product can reach the rig (Cargo refuses the cycle).

pub mod chaos;
pub mod client;
pub mod demo;
pub mod envoy;
pub mod overhead;
pub mod replay;
pub mod stage;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub use envoy::find_envoy;

/// A loopback port that was free a moment ago, for a service the rig starts next.
///
/// Taken below Linux's ephemeral range (32768 and up): a port from that range, bound to 0 and released,
/// can be grabbed by any outgoing connection (to a worker, to Envoy) before the service binds it, and a
/// run that starts many services saw exactly that. Ports are tried from a per-process starting point,
/// each at most once per process; only when the whole low range is taken does it fall back to port 0.
pub fn free_port() -> std::io::Result<SocketAddr> {
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        let Ok(port) = u16::try_from(LOW + offset) else {
            continue;
        };
        if let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            return listener.local_addr();
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()
}

/// One plain HTTP exchange with a service the rig started (an admin or metrics endpoint): `method` to
/// `http://addr{path}` with `body`, status and body text within `within`; `None` on any failure.
pub async fn http_exchange(
    method: http::Method,
    addr: SocketAddr,
    path: &str,
    body: &str,
    within: Duration,
) -> Option<(u16, String)> {
    let http: HttpClient<HttpConnector, Full<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let request = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .ok()?;
    let exchange = async {
        let response = http.request(request).await.ok()?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(within, exchange).await.ok()?
}

/// A service's `/metrics` exposition (the picker's, a router's), `None` unless it answers 200 within
/// `within`.
pub async fn scrape_metrics(addr: SocketAddr, within: Duration) -> Option<String> {
    match http_exchange(http::Method::GET, addr, "/metrics", "", within).await? {
        (200, text) => Some(text),
        _ => None,
    }
}

/// A response header's value as text; `None` when it is absent or not visible ASCII.
pub fn header_text(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// `n`, or 1 for 0: the rig's fixed sizes are never zero.
pub fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

/// The `cachepick` binary built beside the running test or bench (`CACHEPICK_BIN` overrides it).
///
/// The binary belongs to the `cachepick-cli` package, so Cargo gives other packages' tests no
/// `CARGO_BIN_EXE_cachepick`; it is found the way Cargo lays out a target directory instead: a test
/// runs from `target/<profile>/deps/`, the binary is `target/<profile>/cachepick`. `cargo test` at the
/// workspace root builds it first, because `cachepick-cli` has integration tests of its own.
///
/// # Panics
/// When there is no such binary, with what to run: a test that needs the binary fails loudly.
#[allow(clippy::panic)]
pub fn cachepick_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("CACHEPICK_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let profile_dir = exe
        .parent()
        .filter(|dir| dir.ends_with("deps"))
        .and_then(|deps| deps.parent())
        .or_else(|| exe.parent());
    let candidate =
        profile_dir.map(|dir| dir.join(format!("cachepick{}", std::env::consts::EXE_SUFFIX)));
    match candidate {
        Some(path) if path.is_file() => path,
        other => panic!(
            "the cachepick binary is not built ({}): run the tests from the workspace root with              `make test` (or `cargo build -p cachepick-cli` first), or set CACHEPICK_BIN",
            other.map_or_else(
                || "no target directory".to_owned(),
                |path| path.display().to_string()
            )
        ),
    }
}

//! The security and listener-bound settings: TLS on `listen`, TLS for `https` scrape URLs, who may use
//! the debug endpoints, and the bounds of the HTTP listener on `metrics_listen`.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

pub use crate::tls::{ClientFiles, ServerFiles};

use super::Config;

/// `load.tls`: how `https://` metrics and loads URLs are verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScrapeTls {
    /// The CA bundle, and the client certificate and key when the engines' proxy requires mTLS.
    pub files: ClientFiles,
    /// The name every worker's certificate is checked against, instead of the URL's host: engines are
    /// usually addressed by IP, and their certificates name a service.
    pub server_name: Option<String>,
}

/// `metrics_http`: the bounds of the HTTP listener on `metrics_listen`, so that slow or numerous clients
/// of `/metrics` and `/debug/*` cannot exhaust the process's file descriptors (which `listen`'s accept
/// needs too) or its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections open at once; at the cap one more takes the place of the connection that has waited
    /// longest for a request's headers, or is accepted and closed at once when every one is mid-request.
    pub max_connections: NonZeroUsize,
    /// A client has this long to send a request's headers, from the connection's start or the end of
    /// the previous response.
    pub header_read_timeout: Duration,
    /// A request's body must have arrived, and its answer been computed, within this.
    pub request_timeout: Duration,
    /// A connection is closed when it has lasted this long, whatever it does: keep-alive cannot pin it.
    pub connection_lifetime: Duration,
}

impl HttpLimits {
    /// Prometheus scrapes with one connection per target; a handful of operators' tools use a few more.
    /// 64 stays far below a typical `ulimit -n` of 1024, which the gRPC listener needs too.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
    pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
    /// Long enough for a keep-alive scraper to reuse its connection for many scrapes.
    pub const DEFAULT_CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: NonZeroUsize::new(Self::DEFAULT_MAX_CONNECTIONS)
                .unwrap_or(NonZeroUsize::MIN),
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            connection_lifetime: Self::DEFAULT_CONNECTION_LIFETIME,
        }
    }
}

impl Config {
    /// Whether the admin gRPC API and reflection are served on `listen`: as `debug_endpoints` says, or,
    /// without it, only when `listen` is bound to loopback.
    pub fn debug_on_listen(&self) -> bool {
        debug_on(self.debug_endpoints, self.listen)
    }

    /// Whether `/debug/*` is served on `metrics_listen`: as `debug_endpoints` says, or, without it, only
    /// when `metrics_listen` is bound to loopback.
    pub fn debug_on_metrics(&self) -> bool {
        debug_on(self.debug_endpoints, self.metrics_listen)
    }

    /// The listeners whose debug endpoints are forced on beyond loopback with no token to guard them.
    pub fn exposed_debug(&self) -> Vec<(&'static str, SocketAddr)> {
        if self.debug_token_file.is_some() || self.debug_endpoints != Some(true) {
            return Vec::new();
        }
        [
            ("listen", self.listen),
            ("metrics_listen", self.metrics_listen),
        ]
        .into_iter()
        .filter(|(_, addr)| !addr.ip().is_loopback())
        .collect()
    }
}

fn debug_on(forced: Option<bool>, listener: SocketAddr) -> bool {
    forced.unwrap_or_else(|| listener.ip().is_loopback())
}

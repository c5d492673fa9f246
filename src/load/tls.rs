//! The scraper's HTTP client: plain `http://`, or, with `load.tls`, `https://` too, verified against the
//! configured CA bundle only (no system or webpki roots).

use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::ServerName;

use crate::config::{LoadConfig, ScrapeTls};
use crate::tls::{self, TlsError};

/// `load.tls`, loaded: what every pool's scraper connects to `https://` URLs with.
#[derive(Clone, Debug)]
pub struct ScrapeTlsClient {
    config: rustls::ClientConfig,
    server_name: Option<ServerName<'static>>,
}

impl ScrapeTlsClient {
    /// Reads the CA bundle (and the client certificate and key, if any): a bad file is an error at
    /// start-up, not a scrape error on every worker later.
    pub fn load(tls: &ScrapeTls) -> Result<ScrapeTlsClient, TlsError> {
        Ok(ScrapeTlsClient {
            config: tls::client_config(&tls.files)?,
            // Validation checked the name; one that does not parse verifies against the URL's host.
            server_name: tls
                .server_name
                .as_ref()
                .and_then(|name| ServerName::try_from(name.clone()).ok()),
        })
    }
}

/// The scraper's client, one per pool; the KV event feeds ask the engines where they publish with it
/// too, so an `https://` worker is asked over the same verified TLS.
#[derive(Clone)]
pub enum HttpClient {
    Plain(Client<HttpConnector, Empty<Bytes>>),
    Tls(Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>),
}

impl HttpClient {
    pub fn new(config: &LoadConfig, tls: Option<&ScrapeTlsClient>) -> HttpClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.scrape_timeout));
        connector.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(config.scrape_interval.saturating_mul(4))
            .pool_max_idle_per_host(1);
        match tls {
            None => HttpClient::Plain(builder.build(connector)),
            Some(tls) => {
                // The TLS layer decides the scheme: http:// stays plain, https:// gets rustls.
                connector.enforce_http(false);
                let https = HttpsConnectorBuilder::new()
                    .with_tls_config(tls.config.clone())
                    .https_or_http();
                let https = match &tls.server_name {
                    Some(name) => {
                        https.with_server_name_resolver(FixedServerNameResolver::new(name.clone()))
                    }
                    None => https,
                };
                HttpClient::Tls(builder.build(https.enable_http1().wrap_connector(connector)))
            }
        }
    }

    pub fn request(&self, request: Request<Empty<Bytes>>) -> ResponseFuture {
        match self {
            HttpClient::Plain(client) => client.request(request),
            HttpClient::Tls(client) => client.request(request),
        }
    }
}

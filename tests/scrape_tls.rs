//! https scraping against a real TLS metrics server on loopback (tokio-rustls + hyper, certificates
//! generated in the test): with `load.tls` naming the CA that signed the server, the scrape reads the
//! engine's load; with another CA, or without the client certificate a server requires, the scrape is
//! an error that says why, and the worker's reading never counts.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod engine;
    pub mod pki;
}

use support::{engine, pki};

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Response;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use cachepick::config::{self, Config, Overrides};
use cachepick::load::{PoolLoad, ScrapeOutcome, ScrapeTlsClient, Scraper};
use cachepick::metrics::Metrics;
use cachepick::worker::WorkerId;
use pki::{Ca, Leaf, SERVER_NAME};

/// An HTTPS server answering every request with a vLLM exposition of 3 waiting and 7 running; with
/// `client_ca`, it requires a client certificate that CA signed.
async fn https_engine(server: &Leaf, client_ca: Option<&Ca>) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            roots
                .add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap())
                .unwrap();
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(server.cert_pem.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(server.key_pem.as_bytes()).unwrap(),
        )
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let body = engine::vllm_metrics(&[(0, 3, 7, 0.25)]);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let body = body.clone();
            tokio::spawn(async move {
                // A refused client fails here; the scraper reports it on its side.
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = service_fn(move |_request| {
                    let body = body.clone();
                    async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body)))) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn config(addr: SocketAddr, tls: &str) -> Config {
    let yaml = format!(
        "load:\n  tls: {{{tls}}}\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {{endpoint: \"{addr}\", metrics_url: \"https://{addr}/metrics\"}}\n"
    );
    config::parse(&yaml, "test.yaml", &Overrides::default())
        .unwrap_or_else(|error| panic!("{error}\n{yaml}"))
}

/// One scrape round of the configuration's only worker: (scrape outcome counts ok/error, the load's
/// waiting and running if fresh, the last error).
async fn scrape(config: &Config) -> (u64, Option<(u64, u64)>, String) {
    let metrics = Arc::new(Metrics::new().unwrap());
    let pool = &config.pools[0];
    let load = PoolLoad::new(pool, &config.load);
    let tls = ScrapeTlsClient::load(config.load.tls.as_ref().unwrap()).unwrap();
    let mut scraper =
        Scraper::new(pool, &config.load, Arc::clone(&load), metrics.clone()).with_tls(&tls);
    scraper.round().await;
    let snapshot = load.snapshot();
    let worker = pool.workers[0].endpoint.to_string();
    let ok = metrics
        .scrapes
        .with_label_values(&["m", &worker, ScrapeOutcome::Ok.as_str()])
        .get();
    let fresh = snapshot
        .fresh_load(WorkerId(0), Instant::now())
        .map(|load| (load.waiting, load.running));
    let error = snapshot.workers()[0]
        .scrape
        .last_error
        .as_deref()
        .unwrap_or_default()
        .to_owned();
    (ok, fresh, error)
}

fn path(file: &Path) -> String {
    file.display().to_string()
}

#[tokio::test]
async fn https_metrics_are_scraped_with_the_configured_ca_and_refused_with_another() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "engines");
    let server = ca.server(dir.path(), "engine");
    let addr = https_engine(&server, None).await;

    // The CA that signed the engine, the certificate checked against the configured name.
    let trusted = config(
        addr,
        &format!(
            "ca_file: \"{}\", server_name: {SERVER_NAME}",
            path(&ca.file)
        ),
    );
    let (ok, fresh, error) = scrape(&trusted).await;
    assert_eq!((ok, fresh), (1, Some((3, 7))), "{error}");

    // Without server_name the URL's IP is checked, which the certificate also names.
    let by_ip = config(addr, &format!("ca_file: \"{}\"", path(&ca.file)));
    let (ok, fresh, error) = scrape(&by_ip).await;
    assert_eq!((ok, fresh), (1, Some((3, 7))), "{error}");

    // Another CA: the handshake fails, the scrape is an error naming the certificate.
    let other = Ca::new(dir.path(), "other");
    let untrusted = config(
        addr,
        &format!(
            "ca_file: \"{}\", server_name: {SERVER_NAME}",
            path(&other.file)
        ),
    );
    let (ok, fresh, error) = scrape(&untrusted).await;
    assert_eq!((ok, fresh), (0, None));
    assert!(
        error.contains("certificate") && error.contains("UnknownIssuer"),
        "{error}"
    );

    // The right CA but a name the certificate does not carry.
    let misnamed = config(
        addr,
        &format!("ca_file: \"{}\", server_name: other.test", path(&ca.file)),
    );
    let (ok, _, error) = scrape(&misnamed).await;
    assert_eq!(ok, 0);
    assert!(error.contains("certificate"), "{error}");
}

#[tokio::test]
async fn an_engine_requiring_client_certificates_is_scraped_with_one() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "engines");
    let server = ca.server(dir.path(), "engine");
    let clients = Ca::new(dir.path(), "scrapers");
    let scraper = clients.client(dir.path(), "scraper", "cachepick");
    let addr = https_engine(&server, Some(&clients)).await;

    let with_identity = config(
        addr,
        &format!(
            "ca_file: \"{}\", cert_file: \"{}\", key_file: \"{}\"",
            path(&ca.file),
            path(&scraper.cert_file),
            path(&scraper.key_file)
        ),
    );
    let (ok, fresh, error) = scrape(&with_identity).await;
    assert_eq!((ok, fresh), (1, Some((3, 7))), "{error}");

    let anonymous = config(addr, &format!("ca_file: \"{}\"", path(&ca.file)));
    let (ok, fresh, error) = scrape(&anonymous).await;
    assert_eq!((ok, fresh), (0, None), "{error}");
    assert!(!error.is_empty());
}

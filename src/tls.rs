//! TLS material from PEM files: the ext_proc listener's server configuration (with an optional client
//! CA, which makes client certificates mandatory) and the scraper's client configuration.
//!
//! rustls with the `ring` provider only; no trust anchor comes from the system: every root is a file the
//! configuration names. The server side re-reads its files on [`ServerTls::refresh`], so a certificate
//! that cert-manager rotates on disk is served to new connections without a restart; connections
//! already open keep the certificate they were accepted with.
//!
//! This module takes paths, not configuration types, so every layer may use it.

use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} holds no PEM certificate{}", path.display(), detail(.reason))]
    NoCertificate { path: PathBuf, reason: String },
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1){}", path.display(), detail(.reason))]
    NoKey { path: PathBuf, reason: String },
    #[error("{}: a CA certificate is not usable as a trust anchor: {reason}", path.display())]
    BadCa { path: PathBuf, reason: String },
    #[error("the client CA in {} cannot verify client certificates: {reason}", path.display())]
    ClientVerifier { path: PathBuf, reason: String },
    #[error("{}: the certificate and the key {} do not make a usable pair: {source}", cert.display(), key.display())]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("rustls refused the protocol versions: {0}")]
    Protocol(#[source] rustls::Error),
}

fn detail(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(" ({reason})")
    }
}

/// The one provider cachepick uses, whatever else the process has installed.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The largest PEM file read: a CA bundle of every public root is about 250 KiB.
const PEM_FILE_LIMIT: u64 = 4 << 20;

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    cachepick_decode::file::read_regular(path, PEM_FILE_LIMIT).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in a PEM file, at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::NoCertificate {
            path: path.to_owned(),
            reason: error.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
            reason: String::new(),
        });
    }
    Ok(certs)
}

fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|error| TlsError::NoKey {
        path: path.to_owned(),
        reason: error.to_string(),
    })
}

/// The certificates of a CA bundle as trust anchors.
fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path, pem)? {
        store.add(cert).map_err(|error| TlsError::BadCa {
            path: path.to_owned(),
            reason: error.to_string(),
        })?;
    }
    Ok(store)
}

// === server ===

/// The files of the ext_proc listener's TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert_file: PathBuf,
    /// The leaf's private key (PEM).
    pub key_file: PathBuf,
    /// When set, clients must present a certificate signed by one of these CAs (mTLS).
    pub client_ca_file: Option<PathBuf>,
    /// When not empty, a client's certificate must also name one of these among its subject alternative
    /// names (a DNS name, a URI such as a SPIFFE ID, an IP address); others fail the handshake.
    pub allowed_client_identities: Vec<String>,
    /// How often the files are read again, so a rotated certificate reaches new connections.
    pub reload_interval: Duration,
}

impl ServerFiles {
    /// cert-manager renews well before expiry (a third of the lifetime by default), so a minute's delay
    /// is harmless, and reading three small files a minute costs nothing.
    pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(60);
}

/// The files' bytes as last read, and the configuration built from them.
struct Loaded {
    contents: Vec<Vec<u8>>,
    config: Arc<rustls::ServerConfig>,
}

/// The listener's TLS configuration, rebuilt from its files when they change.
pub struct ServerTls {
    files: ServerFiles,
    current: ArcSwap<Loaded>,
}

impl ServerTls {
    /// Reads and checks the files: a missing file, a file without a certificate or key, or a key that
    /// does not match the certificate is an error here, at start-up.
    pub fn load(files: ServerFiles) -> Result<ServerTls, TlsError> {
        let loaded = build_server(&files)?;
        Ok(ServerTls {
            files,
            current: ArcSwap::from_pointee(loaded),
        })
    }

    /// The configuration a new connection is accepted with.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.current.load().config)
    }

    pub fn files(&self) -> &ServerFiles {
        &self.files
    }

    /// Reads the files again; when their bytes changed and make a valid configuration, new connections
    /// get it (`Ok(true)`). Unchanged files are `Ok(false)`; files that changed into something unusable
    /// (a rotation caught half-written, say) are the error, and the previous configuration stays.
    pub fn refresh(&self) -> Result<bool, TlsError> {
        let contents = read_all(&self.files)?;
        if contents == self.current.load().contents {
            return Ok(false);
        }
        let loaded = build_server(&self.files)?;
        self.current.store(Arc::new(loaded));
        Ok(true)
    }
}

fn read_all(files: &ServerFiles) -> Result<Vec<Vec<u8>>, TlsError> {
    let mut contents = vec![read(&files.cert_file)?, read(&files.key_file)?];
    if let Some(ca) = &files.client_ca_file {
        contents.push(read(ca)?);
    }
    Ok(contents)
}

fn build_server(files: &ServerFiles) -> Result<Loaded, TlsError> {
    let contents = read_all(files)?;
    let (cert_pem, key_pem) = match contents.as_slice() {
        [cert, key, ..] => (cert, key),
        _ => {
            return Err(TlsError::Protocol(rustls::Error::General(
                "no files".into(),
            )));
        }
    };
    let chain = certificates(&files.cert_file, cert_pem)?;
    let key = private_key(&files.key_file, key_pem)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocol)?;
    let builder = match (&files.client_ca_file, contents.get(2)) {
        (Some(path), Some(ca_pem)) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(path, ca_pem)?),
                provider(),
            )
            .build()
            .map_err(|error| TlsError::ClientVerifier {
                path: path.clone(),
                reason: error.to_string(),
            })?;
            if files.allowed_client_identities.is_empty() {
                builder.with_client_cert_verifier(verifier)
            } else {
                builder.with_client_cert_verifier(Arc::new(AllowedClients {
                    ca: verifier,
                    identities: files.allowed_client_identities.clone(),
                }))
            }
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Pair {
            cert: files.cert_file.clone(),
            key: files.key_file.clone(),
            source,
        })?;
    // gRPC is HTTP/2: a client that offers ALPN gets h2 (one that offers none is served h2 all the same).
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Loaded {
        contents,
        config: Arc::new(config),
    })
}

/// `tls.allowed_client_identities`: the CA's check, then the leaf must name one of the identities. A
/// certificate from the same CA is not enough: a CA that signs for the whole mesh signs for clients
/// that must not report what Envoy reports (the served endpoint, the response's status).
#[derive(Debug)]
struct AllowedClients {
    ca: Arc<dyn ClientCertVerifier>,
    identities: Vec<String>,
}

impl ClientCertVerifier for AllowedClients {
    fn offer_client_auth(&self) -> bool {
        self.ca.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.ca.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.ca.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.ca.verify_client_cert(end_entity, intermediates, now)?;
        if names_any(end_entity, &self.identities) {
            Ok(verified)
        } else {
            tracing::debug!(
                "a client certificate from the CA names none of tls.allowed_client_identities"
            );
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.ca.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.ca.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.ca.supported_verify_schemes()
    }
}

/// Whether `cert` names one of `identities` among its subject alternative names: an identity that
/// parses as an IP address matches an IP address name; any other matches a DNS name (ASCII case
/// ignored, a wildcard only as written) or a URI, exactly. A certificate that does not parse names
/// nothing.
pub fn names_any(cert: &CertificateDer<'_>, identities: &[String]) -> bool {
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    identities
        .iter()
        .any(|identity| match identity.parse::<IpAddr>() {
            Ok(ip) => cert
                .verify_is_valid_for_subject_name(&ServerName::IpAddress(ip.into()))
                .is_ok(),
            Err(_) => {
                cert.valid_dns_names()
                    .any(|name| name.eq_ignore_ascii_case(identity))
                    || cert.valid_uri_names().any(|uri| uri == identity)
            }
        })
}

// === client ===

/// The files of the scraper's TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientFiles {
    /// The CAs a worker's certificate must chain to (PEM bundle).
    pub ca_file: PathBuf,
    /// A client certificate and key, for engines behind a proxy that requires mTLS.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A client configuration trusting only `files.ca_file`, presenting `files.identity` when set. It sets
/// no ALPN: the HTTP connector that uses it chooses the protocols (and refuses a preset list).
pub fn client_config(files: &ClientFiles) -> Result<rustls::ClientConfig, TlsError> {
    let roots = roots(&files.ca_file, &read(&files.ca_file)?)?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocol)?
        .with_root_certificates(roots);
    let config = match &files.identity {
        Some((cert, key)) => {
            let chain = certificates(cert, &read(cert)?)?;
            let private = private_key(key, &read(key)?)?;
            builder
                .with_client_auth_cert(chain, private)
                .map_err(|source| TlsError::Pair {
                    cert: cert.clone(),
                    key: key.clone(),
                    source,
                })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Ca = rcgen::CertifiedIssuer<'static, rcgen::KeyPair>;

    fn ca(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap()
    }

    /// A leaf for `name` signed by `ca`: (certificate PEM, key PEM).
    fn leaf(ca: &Ca, name: &str) -> (String, String) {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_certificate_names_an_identity_by_dns_name_uri_or_ip_address() {
        let pki = ca("test ca");
        let mut params =
            rcgen::CertificateParams::new(vec!["Envoy.Gateway.svc".to_owned()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://cluster.local/ns/gateway/sa/envoy"
                .try_into()
                .unwrap(),
        ));
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress([10, 0, 0, 7].into()));
        let cert = params
            .signed_by(&rcgen::KeyPair::generate().unwrap(), &pki)
            .unwrap();
        let der = cert.der();
        let names = |list: &[&str]| {
            let list: Vec<String> = list.iter().map(|name| (*name).to_owned()).collect();
            names_any(der, &list)
        };
        assert!(names(&["envoy.gateway.svc"]), "DNS names ignore ASCII case");
        assert!(names(&["spiffe://cluster.local/ns/gateway/sa/envoy"]));
        assert!(names(&["10.0.0.7"]));
        assert!(names(&["someone.else", "10.0.0.7"]), "any one of them");
        assert!(
            !names(&["spiffe://cluster.local/ns/gateway/sa/Envoy"]),
            "URIs exactly"
        );
        assert!(
            !names(&["spiffe://cluster.local/ns/gateway"]),
            "not a prefix"
        );
        assert!(!names(&["gateway.svc", "10.0.0.8", "10.0.0.7:80"]));
        assert!(!names(&[]));
        assert!(!names_any(
            &CertificateDer::from(vec![0x30, 0x03, 1, 2, 3]),
            &["x".to_owned()]
        ));
    }

    #[test]
    fn bad_files_are_typed_errors_and_a_rotation_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let pki = ca("test ca");
        let (cert, key) = leaf(&pki, "picker.test");
        let files = ServerFiles {
            cert_file: write(dir.path(), "tls.crt", &cert),
            key_file: write(dir.path(), "tls.key", &key),
            client_ca_file: Some(write(dir.path(), "ca.crt", &pki.pem())),
            allowed_client_identities: Vec::new(),
            reload_interval: ServerFiles::DEFAULT_RELOAD_INTERVAL,
        };
        let tls = ServerTls::load(files.clone()).unwrap();
        let first = tls.config();
        assert!(!tls.refresh().unwrap(), "unchanged files are no reload");
        assert!(Arc::ptr_eq(&first, &tls.config()));

        // A half-written rotation: refused, the previous configuration stays.
        std::fs::write(&files.key_file, "-----BEGIN PRIVATE KEY-----\n").unwrap();
        assert!(matches!(tls.refresh(), Err(TlsError::NoKey { .. })));
        assert!(Arc::ptr_eq(&first, &tls.config()));

        // The new pair in place: new connections get it.
        let (cert, key) = leaf(&pki, "picker.test");
        std::fs::write(&files.cert_file, cert).unwrap();
        std::fs::write(&files.key_file, key).unwrap();
        assert!(tls.refresh().unwrap());
        assert!(!Arc::ptr_eq(&first, &tls.config()));

        // A key that is not the certificate's.
        let (_, other_key) = leaf(&pki, "other.test");
        std::fs::write(&files.key_file, other_key).unwrap();
        assert!(matches!(
            ServerTls::load(files.clone()),
            Err(TlsError::Pair { .. })
        ));
        let missing = ServerFiles {
            cert_file: dir.path().join("absent.crt"),
            ..files.clone()
        };
        let error = ServerTls::load(missing).err().unwrap();
        assert!(error.to_string().contains("absent.crt"), "{error}");
        let not_pem = ServerFiles {
            cert_file: write(dir.path(), "junk.crt", "not a certificate"),
            ..files
        };
        assert!(matches!(
            ServerTls::load(not_pem),
            Err(TlsError::NoCertificate { .. })
        ));
    }

    #[test]
    fn client_configs_trust_only_the_named_bundle() {
        let dir = tempfile::tempdir().unwrap();
        let pki = ca("scrape ca");
        let (cert, key) = leaf(&pki, "client.test");
        let ca_file = write(dir.path(), "ca.crt", &pki.pem());
        let config = client_config(&ClientFiles {
            ca_file: ca_file.clone(),
            identity: Some((
                write(dir.path(), "c.crt", &cert),
                write(dir.path(), "c.key", &key),
            )),
        })
        .unwrap();
        assert!(config.client_auth_cert_resolver.has_certs());
        let error = client_config(&ClientFiles {
            ca_file: write(dir.path(), "empty.crt", ""),
            identity: None,
        })
        .err()
        .unwrap();
        assert!(matches!(error, TlsError::NoCertificate { .. }), "{error}");
    }
}

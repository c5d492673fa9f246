//! Certificates generated for a test (rcgen, ring): a CA, leaves it signs, and the PEM files in a
//! temporary directory, for the TLS tests of the ext_proc listener and of https scraping.
//!
//! A test names it in its `mod support { pub mod pki; }`.

#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};

/// The DNS name the pickers' and the metrics servers' certificates carry.
pub const SERVER_NAME: &str = "cachepick.test";

/// A certificate authority that writes what it issues under `dir`.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
    /// Where the CA certificate is written.
    pub file: PathBuf,
}

/// A leaf certificate and key, PEM, and their files.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

impl Ca {
    /// A new CA named `name`, its certificate written to `dir/<name>-ca.crt`.
    pub fn new(dir: &Path, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("a key"))
            .expect("a self-signed CA");
        let pem = issuer.pem();
        let file = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&file, &pem).expect("write the CA certificate");
        Ca { issuer, pem, file }
    }

    /// A server certificate for [`SERVER_NAME`] and 127.0.0.1, written as `dir/<file>.crt|.key`.
    pub fn server(&self, dir: &Path, file: &str) -> Leaf {
        let mut params =
            CertificateParams::new(vec![SERVER_NAME.to_owned()]).expect("server parameters");
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        self.issue(dir, file, params)
    }

    /// A client certificate (CN `name`), written as `dir/<file>.crt|.key`.
    pub fn client(&self, dir: &Path, file: &str, name: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        self.issue(dir, file, params)
    }

    /// A client certificate (CN `name`) that also names `dns` and `uris` among its subject alternative
    /// names (a SPIFFE ID is a URI), written as `dir/<file>.crt|.key`.
    pub fn client_named(
        &self,
        dir: &Path,
        file: &str,
        name: &str,
        dns: &[&str],
        uris: &[&str],
    ) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        for name in dns {
            params
                .subject_alt_names
                .push(SanType::DnsName((*name).try_into().expect("a DNS name")));
        }
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().expect("a URI")));
        }
        self.issue(dir, file, params)
    }

    fn issue(&self, dir: &Path, file: &str, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("a signed leaf");
        let leaf = Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_file: dir.join(format!("{file}.crt")),
            key_file: dir.join(format!("{file}.key")),
        };
        std::fs::write(&leaf.cert_file, &leaf.cert_pem).expect("write the certificate");
        std::fs::write(&leaf.key_file, &leaf.key_pem).expect("write the key");
        leaf
    }
}

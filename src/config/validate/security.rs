//! The security keys: `tls` (the ext_proc listener), `load.tls` (https scrape URLs), `debug_endpoints`
//! and `debug_token_file`, and `metrics_http` (the HTTP listener's bounds).
//!
//! Only the shape is checked here (keys, types, pairs that go together); the files themselves are read
//! when the process starts, where a missing or malformed one stops it with the file's name.

use std::path::PathBuf;

use rustls_pki_types::ServerName;

use super::Validator;
use crate::config::{ClientFiles, HttpLimits, ScrapeTls, ServerFiles};
use cachepick_decode::{Decode, Field, Map, Node, Phase, Place, Res, Val};

const LISTENER_TLS_KEYS: &[&str] = &[
    "cert_file",
    "key_file",
    "client_ca_file",
    "allowed_client_identities",
    "reload_interval",
];
/// The most identities `tls.allowed_client_identities` lists: each is compared with every name of a
/// connecting client's certificate.
pub(super) const MAX_CLIENT_IDENTITIES: usize = 32;
const SCRAPE_TLS_KEYS: &[&str] = &["ca_file", "cert_file", "key_file", "server_name"];
const HTTP_KEYS: &[&str] = &[
    "max_connections",
    "header_read_timeout",
    "request_timeout",
    "connection_lifetime",
];

/// The most connections `metrics_http.max_connections` may allow: each is a file descriptor, and a
/// typical `ulimit -n` of 1024 must leave room for the gRPC listener, the scrapes and the KV streams.
pub(super) const MAX_HTTP_CONNECTIONS: usize = 512;

impl Validator<'_> {
    pub(super) fn path(&mut self, node: &Node, at: &Place) -> Res<PathBuf> {
        self.string(node, at).map(PathBuf::from)
    }

    /// The root's `tls:` section; absent or null is plain text.
    pub(super) fn listener_tls(&mut self, root: &Map) -> Res<Option<ServerFiles>> {
        let Some((node, at)) = root.get("tls") else {
            return Ok(None);
        };
        let map = self.mapping(node, &at, LISTENER_TLS_KEYS)?;
        let cert = self.required(&map, "cert_file", Self::path);
        let key = self.required(&map, "key_file", Self::path);
        let client_ca = self.opt(&map, "client_ca_file", Self::path);
        let identities = self.opt(&map, "allowed_client_identities", Self::identities);
        let identities = match (identities, &client_ca) {
            (Ok(Some(Val { at, .. })), Ok(None)) => Err(self.report(
                Phase::Cross,
                at,
                "allowed_client_identities needs client_ca_file: without client certificates there is \
                 no identity to check",
            )),
            (identities, _) => identities.map(|given| given.map(|list| list.value)),
        };
        let reload = self.positive_duration(
            &map,
            "reload_interval",
            ServerFiles::DEFAULT_RELOAD_INTERVAL,
        );
        Ok(Some(ServerFiles {
            cert_file: cert?.value,
            key_file: key?.value,
            client_ca_file: client_ca?.map(|ca| ca.value),
            allowed_client_identities: identities?.unwrap_or_default(),
            reload_interval: reload?.value,
        }))
    }

    /// `tls.allowed_client_identities`: 1 to [`MAX_CLIENT_IDENTITIES`] names as a certificate writes
    /// them (a DNS name, a URI such as `spiffe://cluster.local/ns/gateway/sa/envoy`, an IP address).
    fn identities(&mut self, node: &Node, at: &Place) -> Res<Vec<String>> {
        let items = self.list(node, at, "a list of certificate identities")?;
        let identities: Vec<Res<String>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let at = at.index(i, item.line);
                let identity = self.string(item, &at);
                let given = identity.map(|value| Val {
                    value,
                    at: at.origin(),
                });
                self.check(given, |identity| {
                    if identity.is_empty() || identity.chars().any(|c| c.is_whitespace() || c.is_control()) {
                        Err(format!("`{identity}` is not an identity: a certificate's DNS name, URI or IP address, without spaces"))
                    } else {
                        Ok(identity)
                    }
                })
                .map(|val| val.value)
            })
            .collect();
        let identities: Vec<String> = identities.into_iter().collect::<Res<_>>()?;
        if identities.is_empty() || identities.len() > MAX_CLIENT_IDENTITIES {
            return Err(self.report(
                Phase::Value,
                at.origin(),
                format!(
                    "list 1 to {MAX_CLIENT_IDENTITIES} identities (leave the key out to accept any \
                     certificate from client_ca_file); got {}",
                    identities.len()
                ),
            ));
        }
        Ok(identities)
    }

    /// `load.tls`; absent or null allows `http://` scrape URLs only.
    pub(super) fn scrape_tls(&mut self, load: &Map) -> Res<Option<ScrapeTls>> {
        let Some((node, at)) = load.get("tls") else {
            return Ok(None);
        };
        let map = self.mapping(node, &at, SCRAPE_TLS_KEYS)?;
        let ca = self.required(&map, "ca_file", Self::path);
        let cert = self.opt(&map, "cert_file", Self::path);
        let key = self.opt(&map, "key_file", Self::path);
        let name = self.opt(&map, "server_name", Self::string);
        let name = self.check_opt(name, |name| match ServerName::try_from(name.as_str()) {
            Ok(_) => Ok(name),
            Err(_) => Err(format!(
                "`{name}` is not a DNS name or IP address a certificate can name"
            )),
        });
        let identity = self.pair(cert, key)?;
        Ok(Some(ScrapeTls {
            files: ClientFiles {
                ca_file: ca?.value,
                identity,
            },
            server_name: name?.map(|name| name.value),
        }))
    }

    /// A client certificate and its key: both or neither.
    fn pair(
        &mut self,
        cert: Field<PathBuf>,
        key: Field<PathBuf>,
    ) -> Res<Option<(PathBuf, PathBuf)>> {
        match (cert?, key?) {
            (Some(cert), Some(key)) => Ok(Some((cert.value, key.value))),
            (None, None) => Ok(None),
            (Some(Val { at, .. }), None) => Err(self.report(
                Phase::Cross,
                at,
                "cert_file needs key_file (the client certificate's private key)",
            )),
            (None, Some(Val { at, .. })) => Err(self.report(
                Phase::Cross,
                at,
                "key_file needs cert_file (the client certificate it belongs to)",
            )),
        }
    }

    /// A template's `scrape_scheme`: `http` (the default) or `https`, which needs `load.tls`.
    pub(super) fn scrape_scheme(&mut self, template: &Map) -> Res<bool> {
        let scheme = self.opt(template, "scrape_scheme", |v, node, at| {
            v.keyword(node, at, &[false, true], |https| {
                if https { "https" } else { "http" }
            })
        })?;
        match scheme {
            Some(Val { value: true, at }) if !self.https_scrape => Err(self.report(
                Phase::Cross,
                at,
                "scrape_scheme: https needs load.tls (a ca_file to verify the engines with)",
            )),
            Some(scheme) => Ok(scheme.value),
            None => Ok(false),
        }
    }

    /// `debug_token_file`.
    pub(super) fn debug_token_file(&mut self, root: &Map) -> Res<Option<PathBuf>> {
        self.opt(root, "debug_token_file", Self::path)
            .map(|path| path.map(|path| path.value))
    }

    /// The `metrics_http:` section; absent keys take their defaults.
    pub(super) fn metrics_http(&mut self, root: &Map) -> Res<HttpLimits> {
        let map = self.section(root, "metrics_http", HTTP_KEYS)?;
        let defaults = HttpLimits::default();
        let connections =
            self.positive_count(&map, "max_connections", HttpLimits::DEFAULT_MAX_CONNECTIONS);
        let connections = match connections {
            Ok(count) if count.get() > MAX_HTTP_CONNECTIONS => {
                let message = format!(
                    "must be at most {MAX_HTTP_CONNECTIONS}: each connection holds a file descriptor that \
                     listen's accept needs too (a typical ulimit -n is 1024)"
                );
                Err(self.report(
                    Phase::Value,
                    map.place_of("max_connections").origin(),
                    message,
                ))
            }
            other => other,
        };
        let headers =
            self.positive_duration(&map, "header_read_timeout", defaults.header_read_timeout);
        let request = self.positive_duration(&map, "request_timeout", defaults.request_timeout);
        let lifetime =
            self.positive_duration(&map, "connection_lifetime", defaults.connection_lifetime);
        let lifetime = match (lifetime, &request) {
            (Ok(lifetime), Ok(request)) if lifetime.value < request.value => {
                let message = format!(
                    "connection_lifetime must be at least request_timeout ({}): a connection would be cut \
                     before its request may end",
                    cachepick_decode::duration::format(request.value)
                );
                Err(self.report(Phase::Cross, lifetime.at, message))
            }
            (lifetime, _) => lifetime,
        };
        Ok(HttpLimits {
            max_connections: connections?,
            header_read_timeout: headers?.value,
            request_timeout: request?.value,
            connection_lifetime: lifetime?.value,
        })
    }
}

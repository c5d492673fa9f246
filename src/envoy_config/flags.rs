//! How `cachepick envoy-config`'s flags and the configuration combine into [`EnvoyOptions`]: a flag
//! given wins, a flag left out takes the configuration's default, and the `--picker-*` TLS flags must
//! fit the configuration's `tls`. A `--picker` is an IP literal or a DNS name ([`PickerAddr`]); the
//! command line itself is kept, quoted for a POSIX shell ([`command_line`]), so the file's header
//! reproduces the file exactly.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use super::{BodyMode, EnvoyOptions, PickerTls, PickerTlsError};
use crate::config::Config;

/// The flags of `cachepick envoy-config` as given (their own defaults applied by the CLI).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyFlags {
    /// `--mode`.
    pub mode: BodyMode,
    /// `--envoy-listen`.
    pub listen: SocketAddr,
    /// `--envoy-admin`.
    pub admin: SocketAddr,
    /// `--envoy-ready`.
    pub ready: Option<SocketAddr>,
    /// `--picker`, repeated; none means the picker at the configuration's `listen`.
    pub pickers: Vec<PickerAddr>,
    /// `--picker-ca`.
    pub picker_ca: Option<PathBuf>,
    /// `--picker-client-cert`.
    pub picker_client_cert: Option<PathBuf>,
    /// `--picker-client-key`.
    pub picker_client_key: Option<PathBuf>,
    /// `--picker-sni`.
    pub picker_sni: Option<String>,
    /// `--access-log`.
    pub access_log: Option<PathBuf>,
    /// The command line as given ([`command_line`]), echoed in the bootstrap's header as the way to
    /// regenerate it.
    pub command: String,
}

/// Where Envoy reaches one picker replica: an IP literal, or a DNS name (a Kubernetes Service, say)
/// that Envoy resolves itself, re-resolving as the name's answers change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickerAddr {
    Ip(SocketAddr),
    Name { host: String, port: u16 },
}

impl PickerAddr {
    /// Whether Envoy must resolve this address (the clusters of pickers are then `STRICT_DNS`).
    pub fn is_name(&self) -> bool {
        matches!(self, PickerAddr::Name { .. })
    }

    /// The host as Envoy's `socket_address` takes it (an IPv6 literal without brackets) and the port.
    pub(super) fn host_and_port(&self) -> (String, u16) {
        match self {
            PickerAddr::Ip(addr) => (addr.ip().to_string(), addr.port()),
            PickerAddr::Name { host, port } => (host.clone(), *port),
        }
    }
}

impl From<SocketAddr> for PickerAddr {
    fn from(addr: SocketAddr) -> Self {
        PickerAddr::Ip(addr)
    }
}

impl fmt::Display for PickerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PickerAddr::Ip(addr) => write!(f, "{addr}"),
            PickerAddr::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl FromStr for PickerAddr {
    type Err = String;

    /// `IP:PORT` (`[v6]:PORT`) or `NAME:PORT`, where NAME is a DNS name: dot-separated labels of
    /// letters, digits and inner hyphens, at most 253 characters.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(PickerAddr::Ip(addr));
        }
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(format!("expected IP:PORT or NAME:PORT, got `{text}`"));
        };
        let port: u16 = port
            .parse()
            .map_err(|_| format!("`{port}` in `{text}` is not a port (0-65535)"))?;
        if port == 0 {
            return Err(format!("port 0 in `{text}` cannot be dialled"));
        }
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        let name = host.strip_suffix('.').unwrap_or(host);
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(format!(
                "`{host}` in `{text}` is neither an IP address nor a DNS name"
            ));
        }
        Ok(PickerAddr::Name {
            host: host.to_owned(),
            port,
        })
    }
}

/// `args` as one line a POSIX shell runs with the same arguments: an argument of characters that need
/// no quoting as it is, any other in single quotes (a quote inside as `'\''`). A control character
/// cannot sit on a comment line, so it is written `?` (the line no longer reproduces that argument).
pub fn command_line(args: impl IntoIterator<Item = String>) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c);
    args.into_iter()
        .map(|arg| {
            let arg = super::yaml::one_line(&arg);
            if !arg.is_empty() && arg.chars().all(plain) {
                arg
            } else {
                format!("'{}'", arg.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl EnvoyOptions {
    /// The options `flags` ask for over `config`'s defaults ([`EnvoyOptions::for_config`]); an error
    /// when the TLS flags do not fit the configuration.
    pub fn from_flags(config: &Config, flags: EnvoyFlags) -> Result<EnvoyOptions, PickerTlsError> {
        let picker_tls = PickerTls::from_flags(
            config,
            flags.picker_ca,
            flags.picker_client_cert,
            flags.picker_client_key,
            flags.picker_sni,
        )?;
        let defaults = EnvoyOptions::for_config(config);
        Ok(EnvoyOptions {
            mode: flags.mode,
            listen: flags.listen,
            admin: flags.admin,
            ready: flags.ready,
            pickers: if flags.pickers.is_empty() {
                defaults.pickers.clone()
            } else {
                flags.pickers
            },
            command: Some(flags.command),
            picker_tls,
            access_log: flags.access_log,
            ..defaults
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{self, Overrides};

    fn config(yaml: &str) -> Config {
        config::parse(yaml, "test.yaml", &Overrides::default()).expect("valid config")
    }

    const ONE: &str = "listen: 0.0.0.0:9002\noverload: {message_timeout: 3500ms}\npools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"127.0.0.1:8001\"}\n";

    fn flags() -> EnvoyFlags {
        EnvoyFlags {
            mode: BodyMode::Duplex,
            listen: "0.0.0.0:10000".parse().expect("addr"),
            admin: "127.0.0.1:9911".parse().expect("addr"),
            ready: None,
            pickers: Vec::new(),
            picker_ca: None,
            picker_client_cert: None,
            picker_client_key: None,
            picker_sni: None,
            access_log: None,
            command: "cachepick envoy-config --config deploy/cachepick.yaml".to_owned(),
        }
    }

    #[test]
    fn flags_left_out_take_the_configuration_s_defaults() {
        let config = config(ONE);
        let options = EnvoyOptions::from_flags(&config, flags()).expect("fits");
        assert_eq!(options.pickers, ["127.0.0.1:9002".parse().expect("addr")]);
        assert_eq!(options.message_timeout, Duration::from_millis(3500));
        assert_eq!(options.picker_tls, None);
        assert_eq!(options.mode, BodyMode::Duplex);
        assert_eq!(options.listen, flags().listen);
        assert_eq!(options.admin, flags().admin);
        assert_eq!(
            options.command.as_deref(),
            Some("cachepick envoy-config --config deploy/cachepick.yaml")
        );
    }

    #[test]
    fn pickers_given_replace_the_default_in_their_order() {
        let pickers: Vec<PickerAddr> = ["10.0.0.2:9002", "picker.llm.svc:9002"]
            .iter()
            .map(|addr| addr.parse().expect("addr"))
            .collect();
        let options = EnvoyOptions::from_flags(
            &config(ONE),
            EnvoyFlags {
                pickers: pickers.clone(),
                ..flags()
            },
        )
        .expect("fits");
        assert_eq!(options.pickers, pickers);
    }

    #[test]
    fn tls_flags_must_fit_the_configuration() {
        let plain = config(ONE);
        let with_ca = EnvoyFlags {
            picker_ca: Some(PathBuf::from("/e/ca.crt")),
            ..flags()
        };
        assert_eq!(
            EnvoyOptions::from_flags(&plain, with_ca),
            Err(PickerTlsError::NotTls)
        );
        let half_pair = EnvoyFlags {
            picker_client_cert: Some(PathBuf::from("/e/envoy.crt")),
            ..flags()
        };
        assert_eq!(
            EnvoyOptions::from_flags(&plain, half_pair),
            Err(PickerTlsError::HalfPair)
        );
    }

    #[test]
    fn a_picker_is_an_ip_literal_or_a_dns_name_and_nothing_else() {
        assert_eq!(
            "[::1]:9002".parse::<PickerAddr>(),
            Ok(PickerAddr::Ip("[::1]:9002".parse().expect("addr")))
        );
        let name = "cachepick.llm.svc.cluster.local:9002"
            .parse::<PickerAddr>()
            .expect("a name");
        assert!(name.is_name());
        assert_eq!(name.to_string(), "cachepick.llm.svc.cluster.local:9002");
        assert_eq!(
            name.host_and_port(),
            ("cachepick.llm.svc.cluster.local".to_owned(), 9002)
        );
        for bad in [
            "cachepick",
            "cachepick:",
            "cachepick:0",
            "cachepick:70000",
            "-picker:9002",
            "pick_er:9002",
            "a..b:9002",
            "http://cachepick:9002",
            ":9002",
        ] {
            assert!(bad.parse::<PickerAddr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_command_line_is_quoted_for_a_shell() {
        let line = command_line(
            [
                "cachepick",
                "envoy-config",
                "--config",
                "my dir/it's.yaml",
                "--picker",
                "[::1]:9002",
                "--listen=0.0.0.0:9102",
                "",
            ]
            .map(str::to_owned),
        );
        assert_eq!(
            line,
            "cachepick envoy-config --config 'my dir/it'\\''s.yaml' --picker '[::1]:9002' --listen=0.0.0.0:9102 ''"
        );
    }
}

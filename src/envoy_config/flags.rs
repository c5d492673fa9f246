//! How `cachepick envoy-config`'s flags and the configuration combine into [`EnvoyOptions`]: a flag
//! given wins, a flag left out takes the configuration's default, and the `--picker-*` TLS flags must
//! fit the configuration's `tls`.

use std::net::SocketAddr;
use std::path::PathBuf;

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
    /// `--picker`, repeated; none means the picker at the configuration's `listen`.
    pub pickers: Vec<SocketAddr>,
    /// `--picker-ca`.
    pub picker_ca: Option<PathBuf>,
    /// `--picker-client-cert`.
    pub picker_client_cert: Option<PathBuf>,
    /// `--picker-client-key`.
    pub picker_client_key: Option<PathBuf>,
    /// `--picker-sni`.
    pub picker_sni: Option<String>,
    /// The configuration file as the command line named it, echoed in the bootstrap's header.
    pub source: String,
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
            pickers: if flags.pickers.is_empty() {
                defaults.pickers.clone()
            } else {
                flags.pickers
            },
            source: Some(flags.source),
            picker_tls,
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
            pickers: Vec::new(),
            picker_ca: None,
            picker_client_cert: None,
            picker_client_key: None,
            picker_sni: None,
            source: "deploy/cachepick.yaml".to_owned(),
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
        assert_eq!(options.source.as_deref(), Some("deploy/cachepick.yaml"));
    }

    #[test]
    fn pickers_given_replace_the_default_in_their_order() {
        let pickers: Vec<SocketAddr> = ["10.0.0.2:9002", "10.0.0.1:9002"]
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
}

//! A simulated vLLM fleet, cachepick in process through `app::run`, and optionally a real Envoy 1.40
//! running the bootstrap `envoy_config::render` generates: the stack the observability and real-client
//! tests talk to, with a fast scrape so readings follow the workers within a fraction of a second.
//!
//! It stands on `envoy`, `provision`, `sim_client` and `sim_fleet`: a test that names `gateway` in its
//! `mod support { … }` names those beside it.

#![allow(dead_code)] // not every test uses every helper

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use serde_json::json;

use cachepick::config::{self, Config, Overrides};
use cachepick::envoy_config::{self, BodyMode};
use cachepick_rig::stage::{Picker, READY_WITHIN};
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};

use super::envoy;
use super::sim_client::{CHAT, Client, MODEL, Reply};
use super::sim_fleet;

pub const SCRAPE_INTERVAL: Duration = Duration::from_millis(100);
pub const SCRAPE_TIMEOUT: Duration = Duration::from_millis(80);
pub const FRESHNESS: Duration = Duration::from_millis(500);

pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Fleet + cachepick (+ Envoy). Dropping it stops cachepick, kills Envoy and stops the workers.
pub struct Gateway {
    pub fleet: Fleet,
    pub config: Config,
    pub envoy: Option<envoy::Envoy>,
    /// Envoy's HTTP listener, when Envoy runs.
    pub gateway: Option<SocketAddr>,
    pub sim: Client,
    /// Stopped when dropped.
    picker: Picker,
}

impl Gateway {
    /// `workers` simulated vLLM workers (byte tokenizer, 16-token blocks, no jitter), tuned by `tune`,
    /// cachepick over them (its pool in `events` mode when `tune` turns the workers' KV events on), and
    /// Envoy in `mode` when given.
    pub async fn start(
        workers: u32,
        tune: impl FnOnce(&mut SimConfig),
        mode: Option<BodyMode>,
    ) -> Self {
        let mut sim = sim_fleet::config(Engine::Vllm, workers);
        tune(&mut sim);
        let fleet = sim_fleet::start(&sim).await;

        let mut generated = fleet.cachepick_config();
        if sim.kv_events.is_some() {
            assert!(generated.contains("\n    workers:\n"), "{generated}");
            generated = generated.replacen(
                "\n    workers:\n",
                "\n    index:\n      mode: events\n    workers:\n",
                1,
            );
        }
        let overrides = envoy::free_listeners();
        let mut config = config::parse(&generated, "the gateway configuration", &overrides)
            .unwrap_or_else(|error| panic!("{error}\n{generated}"));
        config.load.scrape_interval = SCRAPE_INTERVAL;
        config.load.scrape_timeout = SCRAPE_TIMEOUT;
        config.load.freshness = FRESHNESS;
        // The edits bypassed validation: round-trip the effective configuration through it.
        let effective = config.to_yaml();
        let config = config::parse(
            &effective,
            "the edited gateway configuration",
            &Overrides::default(),
        )
        .unwrap_or_else(|error| panic!("{error}\n{effective}"));
        let mut picker = Picker::spawn(config.clone());
        if let Err(error) = picker.ready(READY_WITHIN).await {
            panic!("cachepick on {} is not ready: {error}", config.listen);
        }

        let (envoy, gateway) = match mode {
            Some(mode) => {
                let options = envoy::free_options(&config, mode);
                let gateway = options.listen;
                let yaml = envoy_config::render(&config, &options);
                (Some(envoy::Envoy::start(&yaml).await), Some(gateway))
            }
            None => (None, None),
        };
        Gateway {
            fleet,
            config,
            envoy,
            gateway,
            sim: Client::new(),
            picker,
        }
    }

    /// Envoy's listener; panics when the stack runs without Envoy.
    pub fn gateway(&self) -> SocketAddr {
        self.gateway.expect("this stack runs Envoy")
    }

    pub fn envoy(&self) -> &envoy::Envoy {
        self.envoy.as_ref().expect("this stack runs Envoy")
    }

    /// cachepick's `/metrics` text.
    pub async fn picker_metrics(&self) -> String {
        let reply = self.sim.get(self.config.metrics_listen, "/metrics").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.text()
    }

    /// A non-streaming chat of one user message through Envoy.
    pub async fn chat(&self, prompt: &str) -> Reply {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
        });
        self.sim.post(self.gateway(), CHAT, &body).await
    }

    /// Sets the values worker `addr`'s `/metrics` reports instead of its model's (`None` keeps the
    /// model's), in `mode` (`live`, `fail`, ...).
    pub async fn fake_metrics(&self, addr: SocketAddr, mode: &str, fake: serde_json::Value) {
        self.sim
            .admin(addr, "/admin/metrics", &json!({"mode": mode, "fake": fake}))
            .await;
    }
}

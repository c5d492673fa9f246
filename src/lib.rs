//! cachepick: an Envoy external processor that picks the GPU worker for each LLM inference request.
//!
//! # Layout
//! - [`config`]: the YAML file and CLI overrides, validated in one place into typed configuration.
//! - [`worker`]: worker identity (`WorkerId`, role, engine) shared by every other module.
//! - [`tls`]: rustls server and client configurations from PEM files (the ext_proc listener, https
//!   scraping); [`auth`]: the debug bearer token.
//! - [`request`]: request bodies → the API, model and prompt routing needs, borrowed from the body.
//! - [`discovery`]: where each pool's workers come from at runtime (the file, DNS, Kubernetes).
//! - [`load`]: scraping worker load into immutable per-pool snapshots; router-local dispatch counts.
//! - [`metrics`]: cachepick's own Prometheus metrics, defined in one place.
//! - [`tokenize`]: prompt → tokens per pool (tiktoken, Hugging Face or bytes), chat templates, and the
//!   segment cache that lets a growing conversation re-tokenize only its new turn.
//! - [`policy`]: the pure routing decision (queue gate, saturation pin, off-owner sampling).
//! - [`prefix`]: chained block hashes of a prompt and the owner index of which worker holds them.
//! - [`route`]: the request path — body → pool → tokens → block hashes → owners → decision → commit on
//!   one load snapshot — and the service that answers each request (route or refuse) in domain terms.
//! - [`pd`]: a prefill/decode pool's handshake — the prefill leg cachepick sends itself (vLLM NIXL's
//!   two-stage relay) and the decode leg's body with the parameters spliced in.
//! - [`protocol`]: the names cachepick speaks on the wire — headers, metadata keys, health services.
//! - [`connections`]: a listener's open connections, their streams and idleness, and the room made at
//!   the cap by closing the one idle longest; [`health`]: readiness shared by both listeners.
//! - [`extproc`]: the gRPC server on `listen`; the only module that sees protobuf types.
//! - [`metrics_server`]: the HTTP server on `metrics_listen`: `/metrics` and the `/debug/*` endpoints.
//! - [`envoy_config`]: `cachepick envoy-config` — the Envoy bootstrap generated from the configuration.
//! - [`render`]: the text forms `cachepick snapshot` and `cachepick explain` print.
//! - [`app`]: process wiring — binds listeners and runs the services until shutdown.
//!
//! The fleet simulator, the bench rig (replay, demo, the harness tests share) and the `cachepick`
//! binary are crates of their own in `crates/`; nothing here depends on them.
//!
//! `ARCHITECTURE.md` at the repository root holds the code map and the invariants.

pub mod app;
pub mod auth;
pub mod config;
pub mod connections;
pub mod discovery;
pub mod envoy_config;
pub mod events;
pub mod extproc;
pub mod health;
pub mod load;
pub mod metrics;
pub mod metrics_server;
pub mod pd;
pub mod policy;
pub mod prefix;
pub mod protocol;
pub mod render;
pub mod request;
pub mod route;
pub mod tls;
pub mod tokenize;
pub mod worker;

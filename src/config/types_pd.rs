//! `pools[].pd`: a pool whose prompts prefill on one worker and decode on another.

use std::num::NonZeroUsize;
use std::time::Duration;

/// How a PD pool's two legs find each other: the engines' handshake cachepick performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Handshake {
    /// vLLM's NixlConnector, two-stage: cachepick sends the prefill worker the request capped at one
    /// output token with `kv_transfer_params: {do_remote_decode: true}`, waits for the parameters it
    /// returns, and hands the request to the decode worker with them; the decode worker pulls the KV.
    Nixl,
    /// SGLang's bootstrap rendezvous: cachepick mints a room, sends the prefill worker the client's body
    /// with `bootstrap_host`, `bootstrap_port` and `bootstrap_room` from its own client (drained, not
    /// waited for), and hands the decode worker the same body, which joins the room and receives the KV.
    Bootstrap,
    /// llm-d's decode sidecar performs the handshake (any connector it supports, SGLang's included):
    /// cachepick names the prefill worker in `x-prefiller-host-port` beside the decode destination, whose
    /// endpoint is the sidecar's port, and sends no leg itself.
    Sidecar,
}

impl Handshake {
    pub const ALL: [Handshake; 3] = [Handshake::Nixl, Handshake::Bootstrap, Handshake::Sidecar];

    pub fn as_str(self) -> &'static str {
        match self {
            Handshake::Nixl => "nixl",
            Handshake::Bootstrap => "bootstrap",
            Handshake::Sidecar => "sidecar",
        }
    }
}

/// `pools[].pd`: each request gets two picks, the prefill worker by the pool's policy over its
/// `prefill` workers and the decode worker by decode pressure over its `decode` workers, and
/// cachepick performs the handshake between them. Without it a pool's `decode` workers take no
/// requests.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    pub handshake: Handshake,
    /// The longest the prefill leg may take, from its dispatch to its parameters; past it the leg is
    /// cancelled and the decode worker prefills the request itself. The stream deadline
    /// (`overload.stream_deadline`) bounds it too.
    pub prefill_timeout: Duration,
    /// Prefill legs in flight at once, over every stream of this pool. A request over the bound is
    /// sent to its decode worker to prefill locally, so no burst of clients holds unbounded
    /// connections and memory.
    pub max_inflight_prefills: NonZeroUsize,
    /// Decode workers sampled per request (power of k); the least pressured wins.
    pub decode_choices: NonZeroUsize,
    /// The largest prefill-leg response read (it carries one token and the transfer parameters).
    pub max_prefill_response_bytes: NonZeroUsize,
    /// `bootstrap`: the port of a prefill worker's bootstrap server when the worker names none
    /// (SGLang's `--disaggregation-bootstrap-port`, 8998).
    pub bootstrap_port: u16,
    /// Conditional disaggregation: the decode worker prefills a request itself when what it lacks of
    /// the prompt is at most this many tokens and at most `local_prefill_share` of the prompt, and it
    /// is not busy (room by its reading, nothing waiting, nothing sent since); 0 turns it off. `nixl`
    /// and `sidecar` only: SGLang's decode worker cannot prefill.
    pub local_prefill_tokens: u64,
    pub local_prefill_share: super::DepthRatio,
    /// ... and when the prompt's prefill owner was passed over as queued while the decode worker holds
    /// the prefix.
    pub local_prefill_when_queued: bool,
}

impl PdConfig {
    pub const DEFAULT_PREFILL_TIMEOUT: Duration = Duration::from_secs(20);
    pub const DEFAULT_MAX_INFLIGHT_PREFILLS: usize = 512;
    pub const DEFAULT_DECODE_CHOICES: usize = 2;
    pub const DEFAULT_MAX_PREFILL_RESPONSE_BYTES: usize = 1 << 20;
    pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
    /// Off: measured on the step model, the rule costs more than it saves (BENCHMARKS.md).
    pub const DEFAULT_LOCAL_PREFILL_TOKENS: u64 = 0;
    pub const DEFAULT_LOCAL_PREFILL_SHARE: f64 = 0.7;
}

impl Default for PdConfig {
    /// The NIXL handshake with every default bound.
    fn default() -> Self {
        let count = |n: usize| NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN);
        PdConfig {
            handshake: Handshake::Nixl,
            prefill_timeout: PdConfig::DEFAULT_PREFILL_TIMEOUT,
            max_inflight_prefills: count(PdConfig::DEFAULT_MAX_INFLIGHT_PREFILLS),
            decode_choices: count(PdConfig::DEFAULT_DECODE_CHOICES),
            max_prefill_response_bytes: count(PdConfig::DEFAULT_MAX_PREFILL_RESPONSE_BYTES),
            bootstrap_port: PdConfig::DEFAULT_BOOTSTRAP_PORT,
            local_prefill_tokens: PdConfig::DEFAULT_LOCAL_PREFILL_TOKENS,
            local_prefill_share: super::DepthRatio::new(PdConfig::DEFAULT_LOCAL_PREFILL_SHARE)
                .unwrap_or(super::DepthRatio::ZERO),
            local_prefill_when_queued: false,
        }
    }
}

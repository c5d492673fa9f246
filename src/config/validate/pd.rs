//! `pools[].pd`: the handshake and the bounds of a prefill/decode pool's prefill legs.

use super::Validator;
use crate::config::{Handshake, PdConfig};
use crate::worker::Engine;
use cachepick_decode::{Decode, Map, Phase, Res};

const PD_KEYS: &[&str] = &[
    "handshake",
    "prefill_timeout",
    "max_inflight_prefills",
    "decode_choices",
    "max_prefill_response_bytes",
];

impl Validator<'_> {
    /// `pools[].pd`; `None` when the key is absent. `engine` is the pool's, `None` when it was
    /// rejected (the check against it is then skipped).
    pub(super) fn pd(&mut self, pool: &Map, engine: Option<Engine>) -> Res<Option<PdConfig>> {
        if pool.get("pd").is_none() {
            return Ok(None);
        }
        let map = self.section(pool, "pd", PD_KEYS)?;
        let handshake = self.opt(&map, "handshake", |v, node, at| {
            v.keyword(node, at, &Handshake::ALL, Handshake::as_str)
        });
        // Only vLLM's handshake exists; an SGLang pool is refused whatever it names.
        let handshake = match engine {
            Some(Engine::Sglang) => {
                let at = map.place_of("handshake").origin();
                handshake.and_then(|_| Err(self.report(Phase::Value, at, SGLANG)))
            }
            _ => handshake.map(|given| given.map_or(Handshake::Nixl, |given| given.value)),
        };
        let prefill_timeout =
            self.positive_duration(&map, "prefill_timeout", PdConfig::DEFAULT_PREFILL_TIMEOUT);
        let inflight = self.positive_count(
            &map,
            "max_inflight_prefills",
            PdConfig::DEFAULT_MAX_INFLIGHT_PREFILLS,
        );
        let choices = self.positive_count(&map, "decode_choices", PdConfig::DEFAULT_DECODE_CHOICES);
        let response = self.positive_size(
            &map,
            "max_prefill_response_bytes",
            PdConfig::DEFAULT_MAX_PREFILL_RESPONSE_BYTES,
        );
        Ok(Some(PdConfig {
            handshake: handshake?,
            prefill_timeout: prefill_timeout?.value,
            max_inflight_prefills: inflight?,
            decode_choices: choices?,
            max_prefill_response_bytes: response?.value,
        }))
    }
}

/// Why an SGLang pool cannot be disaggregated yet.
const SGLANG: &str = "engine sglang has no PD handshake in cachepick yet: SGLang's bootstrap \
                      rendezvous is not implemented; run the pool aggregated (no pd key) or behind \
                      SGLang's own router";

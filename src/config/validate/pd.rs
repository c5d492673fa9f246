//! `pools[].pd`: the handshake and the bounds of a prefill/decode pool's prefill legs.

use super::{Validator, WorkerDraft};
use crate::config::{DepthRatio, Handshake, PdConfig};
use crate::worker::{Engine, Role};
use cachepick_decode::{Decode, Map, Phase, Res};

const PD_KEYS: &[&str] = &[
    "handshake",
    "prefill_timeout",
    "max_inflight_prefills",
    "decode_choices",
    "max_prefill_response_bytes",
    "bootstrap_port",
    "local_prefill_tokens",
    "local_prefill_share",
    "local_prefill_when_queued",
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
        // Each engine has its own handshake; the sidecar speaks either.
        let handshake = match (handshake, engine) {
            (Ok(None), Some(Engine::Sglang)) => Ok(Handshake::Bootstrap),
            (Ok(None), _) => Ok(Handshake::Nixl),
            (Ok(Some(given)), Some(engine)) => match (given.value, engine) {
                (Handshake::Nixl, Engine::Sglang) | (Handshake::Bootstrap, Engine::Vllm) => {
                    let message = format!(
                        "handshake {} is {}'s; engine {} takes handshake {} (or sidecar, for \
                         llm-d's decode sidecar)",
                        given.value.as_str(),
                        if given.value == Handshake::Nixl {
                            "vLLM"
                        } else {
                            "SGLang"
                        },
                        engine.as_str(),
                        if engine == Engine::Sglang {
                            "bootstrap"
                        } else {
                            "nixl"
                        },
                    );
                    Err(self.report(Phase::Cross, given.at, message))
                }
                (value, _) => Ok(value),
            },
            (Ok(Some(given)), None) => Ok(given.value),
            (Err(reported), _) => Err(reported),
        };
        let bootstrap_port = self.opt(&map, "bootstrap_port", Self::port);
        let bootstrap_port = match (bootstrap_port, &handshake) {
            (Ok(Some(port)), Ok(handshake)) if *handshake != Handshake::Bootstrap => {
                let message = "bootstrap_port is read only with handshake: bootstrap";
                Err(self.report(Phase::Cross, port.at, message))
            }
            (Ok(port), _) => Ok(port.map_or(PdConfig::DEFAULT_BOOTSTRAP_PORT, |port| port.value)),
            (Err(reported), _) => Err(reported),
        };
        let local_tokens = self.opt(&map, "local_prefill_tokens", Self::integer);
        let local_share = self.opt(&map, "local_prefill_share", Self::number);
        let local_share = self.check_opt(local_share, |value| {
            DepthRatio::new(value).ok_or_else(|| format!("must be between 0 and 1, got {value}"))
        });
        let when_queued = self.opt(&map, "local_prefill_when_queued", Self::boolean);
        // SGLang's decode worker cannot prefill alone: the rule has nothing to choose there.
        if let Ok(Handshake::Bootstrap) = handshake {
            for key in [
                "local_prefill_tokens",
                "local_prefill_share",
                "local_prefill_when_queued",
            ] {
                if map.get(key).is_some() {
                    let message = format!(
                        "{key} is read only with handshake nixl or sidecar: SGLang's decode worker \
                         cannot prefill a request itself"
                    );
                    self.report(Phase::Cross, map.place_of(key).origin(), message);
                }
            }
        }
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
            bootstrap_port: bootstrap_port?,
            local_prefill_tokens: local_tokens?
                .map_or(PdConfig::DEFAULT_LOCAL_PREFILL_TOKENS, |given| given.value),
            local_prefill_share: local_share?.map_or_else(
                || {
                    DepthRatio::new(PdConfig::DEFAULT_LOCAL_PREFILL_SHARE)
                        .unwrap_or(DepthRatio::ZERO)
                },
                |given| given.value,
            ),
            local_prefill_when_queued: when_queued?.is_some_and(|given| given.value),
        }))
    }

    /// A PD pool's workers: at least one decodes, and a worker's `bootstrap_port` is read only as a
    /// prefill worker of a `bootstrap` pool. Judged on the workers that were read.
    pub(super) fn pd_workers(
        &mut self,
        pool: &Map,
        pd: Res<Option<PdConfig>>,
        workers: &Res<Vec<Res<WorkerDraft>>>,
    ) -> Res<Option<PdConfig>> {
        let Ok(workers) = workers else {
            return pd;
        };
        let bootstrap = matches!(&pd, Ok(Some(pd)) if pd.handshake == Handshake::Bootstrap);
        for worker in workers.iter().flatten() {
            if let Ok(Some(port)) = &worker.bootstrap_port
                && !(bootstrap && matches!(worker.role, Ok(Role::Prefill | Role::Both)))
            {
                let message = "bootstrap_port is read only on a prefill worker of a pool with \
                               pd: {handshake: bootstrap}";
                self.report(Phase::Cross, port.at.clone(), message);
            }
        }
        match pd {
            Ok(Some(pd)) if !workers.is_empty() => {
                let decodes = workers
                    .iter()
                    .flatten()
                    .filter(|worker| matches!(worker.role, Ok(Role::Decode)))
                    .count();
                if decodes == 0 {
                    let at = pool.place_of("pd").origin();
                    let message = "a PD pool needs at least one worker with role: decode (its \
                                   prefill workers take role: prefill)";
                    Err(self.report(Phase::Value, at, message))
                } else {
                    Ok(Some(pd))
                }
            }
            pd => pd,
        }
    }
}

//! The discovery documents a simulated engine serves: `/v1/models`, vLLM's `/version`, SGLang's
//! `/server_info` and `/model_info`, each a pure function of the worker's [`Identity`].

use serde_json::json;

use super::{SGLANG_VERSION, VLLM_VERSION};
use crate::config::Engine;
use crate::kv_events::KvEventEndpoints;

/// What discovery reports about a worker. Capacities are per data-parallel rank, as each engine
/// scheduler reports its own.
#[derive(Clone, Copy, Debug)]
pub struct Identity<'a> {
    pub engine: Engine,
    /// The served model name, also reported as the model and tokenizer path.
    pub model: &'a str,
    pub dp_size: u32,
    pub block_size: u32,
    pub max_running: u64,
    pub kv_blocks: u64,
    pub max_model_len: u32,
    /// The tokenizer the worker uses, as SGLang reports `tokenizer_path`.
    pub tokenizer: &'a str,
    /// SGLang's `disaggregation_mode`: `null`, `prefill` or `decode`.
    pub disaggregation: &'static str,
    /// The port SGLang's bootstrap server answers on (the simulator's: the worker's own).
    pub bootstrap_port: u16,
    /// Where the ranks publish KV cache events; `None` when events are off.
    pub kv_events: Option<&'a KvEventEndpoints>,
}

impl Identity<'_> {
    fn version(&self) -> &'static str {
        match self.engine {
            Engine::Vllm => VLLM_VERSION,
            Engine::Sglang => SGLANG_VERSION,
        }
    }

    fn max_total_num_tokens(&self) -> u64 {
        self.kv_blocks.saturating_mul(u64::from(self.block_size))
    }
}

/// Discovery documents are built from `json!` values, whose serialization cannot fail.
fn to_bytes(value: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// `GET /v1/models`: the OpenAI model list with the one served model. `created` is 0 to keep the
/// document a function of the identity.
pub fn models_json(id: &Identity) -> Vec<u8> {
    let mut card = json!({
        "id": id.model,
        "object": "model",
        "created": 0,
        "owned_by": id.engine.as_str(),
        "root": id.model,
        "parent": null,
        "max_model_len": id.max_model_len,
    });
    if id.engine == Engine::Vllm
        && let Some(card) = card.as_object_mut()
    {
        card.insert(
            "permission".to_owned(),
            json!([{
                "id": "modelperm-cachepick-sim",
                "object": "model_permission",
                "created": 0,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }]),
        );
    }
    to_bytes(&json!({ "object": "list", "data": [card] }))
}

/// vLLM's `GET /version`.
pub fn version_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({ "version": id.version() }))
}

/// SGLang's `GET /server_info` (also `/get_server_info`): the server arguments and scheduler limits a
/// router reads to learn the worker's parallelism and capacity.
pub fn server_info_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({
        "model_path": id.model,
        "tokenizer_path": id.tokenizer,
        "served_model_name": id.model,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": id.dp_size,
        "enable_dp_attention": false,
        "load_balance_method": "shortest_queue",
        "page_size": id.block_size,
        "max_running_requests": id.max_running,
        "max_total_num_tokens": id.max_total_num_tokens(),
        "context_length": id.max_model_len,
        "disaggregation_mode": id.disaggregation,
        "disaggregation_bootstrap_port": id.bootstrap_port,
        "disable_radix_cache": false,
        "skip_tokenizer_init": false,
        "is_embedding": false,
        "version": id.version(),
        "kv_events": sglang_kv_events(id),
    }))
}

/// SGLang's `kv_events` block of `/server_info` (its PR #25844, with the replay fields of #32729): the
/// publisher's host and base port, rank `r` at base + `r`; `null` when it publishes nothing.
fn sglang_kv_events(id: &Identity) -> serde_json::Value {
    let Some(events) = id.kv_events else {
        return serde_json::Value::Null;
    };
    let Some(first) = events.ranks.first() else {
        return serde_json::Value::Null;
    };
    let mut block = json!({
        "publisher": "zmq",
        "endpoint_host": first.live.ip().to_string(),
        "endpoint_port_base": first.live.port(),
        "topic": events.topic,
        "block_size": id.block_size,
        "dp_size": id.dp_size,
    });
    if let (Some(replay), Some(block)) = (first.replay, block.as_object_mut()) {
        block.insert(
            "replay_endpoint_host".into(),
            json!(replay.ip().to_string()),
        );
        block.insert("replay_endpoint_port_base".into(), json!(replay.port()));
    }
    block
}

/// vLLM's `GET /kv_event_sources` (0.32): each publishing rank's `KVEventsConfig`, keyed by the rank
/// as a string; `{}` when events are off.
pub fn kv_event_sources_json(id: &Identity) -> Vec<u8> {
    let mut sources = serde_json::Map::new();
    if let Some(events) = id.kv_events {
        for rank in &events.ranks {
            sources.insert(
                rank.rank.to_string(),
                json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": format!("tcp://{}", rank.live),
                    "replay_endpoint": rank.replay.map(|replay| format!("tcp://{replay}")),
                    "buffer_steps": 10_000,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": events.topic,
                }),
            );
        }
    }
    to_bytes(&serde_json::Value::Object(sources))
}

/// SGLang's `GET /model_info` (also `/get_model_info`).
pub fn model_info_json(id: &Identity) -> Vec<u8> {
    to_bytes(&json!({
        "model_path": id.model,
        "tokenizer_path": id.tokenizer,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
    }))
}

//! The endpoints that tokenize without generating: vLLM's `/tokenize` and its render endpoints, each
//! the prompt's token ids exactly as a generation request would compute them.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::generate::{read, tokens};
use super::{Body, Shared, error, json};
use crate::wire::Api;

/// vLLM's render endpoints (`POST /v1/completions/render`, `/v1/chat/completions/render`, which vLLM
/// serves with `--enable-scale-out`): the prompt's token ids exactly as [`generate`] would compute them,
/// without generating. Routers that route on token ids ask a worker for them (vllm-router's
/// `cache_aware` does before every request). Completions answer a list with one rendered prompt per
/// prompt, chat a single object, as vLLM does.
pub(super) fn render(shared: &Shared, api: Api, body: &Bytes) -> Response<Body> {
    let request = match read(shared, api, body) {
        Ok(request) => request,
        Err((status, message)) => return error(status, &message),
    };
    let token_ids = match tokens(&shared.spec.tokenizer, &request.prompt) {
        Ok(prompt) => prompt,
        Err(message) => return error(StatusCode::BAD_REQUEST, &message),
    };
    let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
    let rendered = serde_json::json!({
        "request_id": format!("{prefix}-render-{id}"),
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": request.max_tokens},
        "model": shared.spec.model,
    });
    let answer = if api == Api::Chat {
        rendered
    } else {
        serde_json::Value::Array(vec![rendered])
    };
    json(StatusCode::OK, answer.to_string().into_bytes())
}

/// vLLM's `/tokenize`: a completion's `prompt` or a chat's `messages` (rendered by the template, as
/// the chat endpoint would) to the engine's token ids, with vLLM's answer's fields.
pub(super) fn tokenize(shared: &Shared, body: &Bytes) -> Response<Body> {
    let chat = serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|value| value.get("messages").is_some());
    let api = if chat { Api::Chat } else { Api::Completion };
    let request = match read(shared, api, body) {
        Ok(request) => request,
        Err((status, message)) => return error(status, &message),
    };
    match tokens(&shared.spec.tokenizer, &request.prompt) {
        Ok(ids) => {
            let answer = serde_json::json!({
                "count": ids.len(),
                "max_model_len": shared.params.load().max_model_len,
                "tokens": ids,
                "token_strs": null,
            });
            json(StatusCode::OK, answer.to_string().into_bytes())
        }
        Err(message) => error(StatusCode::BAD_REQUEST, &message),
    }
}

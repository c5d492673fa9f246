//! The worker's HTTP routes: the engine's API and its other endpoints (metrics, discovery, vLLM's
//! `/tokenize` and render, the prefix-cache reset), the disaggregation handshakes and `/admin/*`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::admin::{Scrape, admin, metrics};
use super::generate::generate;
use super::{
    Arrival, Body, DISPATCH_TAG, Incarnation, MAX_REQUEST_BYTES, Shared, bootstrap, error,
    identity, json, lock, nixl, text, tokenize,
};
use crate::config::Engine;
use crate::expo;
use crate::wire::Api;

pub(super) async fn route(
    shared: Arc<Shared>,
    incarnation: Arc<Incarnation>,
    request: Request<Incoming>,
) -> Response<Body> {
    let path = request.uri().path().to_owned();
    let engine = shared.spec.engine;
    match (request.method(), path.as_str()) {
        (&Method::POST, "/v1/chat/completions" | "/v1/completions" | "/generate") => {
            let api = Api::from_path(&path).unwrap_or(Api::Chat);
            let tag = request
                .headers()
                .get(DISPATCH_TAG)
                .and_then(|value| value.to_str().ok()?.parse().ok());
            match read_body(request).await {
                Ok(body) => {
                    let arrival = Arrival {
                        shared: Arc::clone(&shared),
                        tag,
                    };
                    generate(Arc::clone(&shared), incarnation, api, body, arrival).await
                }
                Err(response) => response,
            }
        }
        (&Method::POST, "/v1/chat/completions/render" | "/v1/completions/render")
            if engine == Engine::Vllm =>
        {
            let api = Api::from_path(path.trim_end_matches("/render")).unwrap_or(Api::Chat);
            match read_body(request).await {
                Ok(body) => tokenize::render(&shared, api, &body),
                Err(response) => response,
            }
        }
        (&Method::POST, "/tokenize") if engine == Engine::Vllm => match read_body(request).await {
            Ok(body) => tokenize::tokenize(&shared, &body),
            Err(response) => response,
        },
        (&Method::GET, "/metrics") => metrics(&shared, &incarnation, Scrape::Metrics).await,
        (&Method::GET, "/v1/loads") if engine == Engine::Sglang => {
            metrics(&shared, &incarnation, Scrape::Loads).await
        }
        (&Method::GET, "/health" | "/health_generate" | "/ping") => {
            text(StatusCode::OK, String::new())
        }
        (&Method::GET, "/v1/models") => json(StatusCode::OK, expo::models_json(&identity(&shared))),
        (&Method::GET, "/kv_event_sources") if engine == Engine::Vllm => json(
            StatusCode::OK,
            expo::kv_event_sources_json(&identity(&shared)),
        ),
        (&Method::GET, "/version") if engine == Engine::Vllm => {
            json(StatusCode::OK, expo::version_json(&identity(&shared)))
        }
        (&Method::GET, "/server_info" | "/get_server_info") if engine == Engine::Sglang => {
            json(StatusCode::OK, expo::server_info_json(&identity(&shared)))
        }
        (&Method::GET, "/model_info" | "/get_model_info") if engine == Engine::Sglang => {
            json(StatusCode::OK, expo::model_info_json(&identity(&shared)))
        }
        (&Method::GET, claim) if engine == Engine::Vllm && claim.starts_with("/sim/nixl/") => {
            nixl::claim(&shared, &incarnation, claim)
        }
        (&Method::GET, room) if engine == Engine::Sglang && room.starts_with("/sim/bootstrap/") => {
            bootstrap::join(&shared, &incarnation, room).await
        }
        (&Method::POST, "/reset_prefix_cache") if engine == Engine::Vllm => {
            reset_prefix_cache(&incarnation)
        }
        (&Method::GET | &Method::POST, "/flush_cache") if engine == Engine::Sglang => {
            reset_prefix_cache(&incarnation)
        }
        (_, route) if route.starts_with("/admin/") => {
            let method = request.method().clone();
            match read_body(request).await {
                Ok(body) => admin(&shared, &incarnation, &method, route, &body).await,
                Err(response) => response,
            }
        }
        _ => error(StatusCode::NOT_FOUND, &format!("no route for {path}")),
    }
}

/// vLLM's `/reset_prefix_cache` and SGLang's `/flush_cache`: every rank drops its cached blocks (and
/// publishes `AllBlocksCleared`), unless a request runs on it, which the engines refuse too.
fn reset_prefix_cache(incarnation: &Incarnation) -> Response<Body> {
    let mut busy = Vec::new();
    for (index, rank) in incarnation.ranks.iter().enumerate() {
        let mut rank = lock(rank);
        if !rank.engine.reset_prefix_cache() {
            busy.push(index);
        }
        rank.flush_events();
    }
    if busy.is_empty() {
        text(StatusCode::OK, String::new())
    } else {
        error(
            StatusCode::BAD_REQUEST,
            &format!("Cache not flushed: requests are running on rank(s) {busy:?}."),
        )
    }
}

async fn read_body(request: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(request.into_body(), MAX_REQUEST_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(cause) if cause.is::<http_body_util::LengthLimitError>() => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body exceeds {MAX_REQUEST_BYTES} bytes"),
        )),
        Err(cause) => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("cannot read the request body: {cause}"),
        )),
    }
}

//! Writing an answer: the JSON body of a finished request, the SSE events of a streamed one, the
//! error body, and the words the simulated model generates.

use bytes::Bytes;
use serde::Serialize;

use super::{Api, Outcome};

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: PromptDetails,
    /// vLLM 0.32 writes it, null without reasoning tokens (`tests/vllm/conformance.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<Null>,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: u32,
    /// vLLM 0.32's other details, null for a text prompt on an engine without KV offload.
    #[serde(skip_serializing_if = "Option::is_none")]
    created_cache_tokens: Option<Null>,
    #[serde(skip_serializing_if = "Option::is_none")]
    multimodal_tokens: Option<Null>,
}

/// A JSON `null` that is written (an `Option` that is `None` is left out instead).
#[derive(Serialize)]
struct Null(());

impl Usage {
    fn of(outcome: &Outcome<'_>) -> Usage {
        let null = || outcome.vllm.then_some(Null(()));
        Usage {
            prompt_tokens: outcome.prompt_tokens,
            total_tokens: u64::from(outcome.prompt_tokens) + u64::from(outcome.completion_tokens),
            completion_tokens: outcome.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: outcome.cached_tokens,
                created_cache_tokens: null(),
                multimodal_tokens: null(),
            },
            completion_tokens_details: null(),
        }
    }
}

/// An OpenAI response or chunk: the envelope vLLM wraps around its choices.
#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl<'a, C> Envelope<'a, C> {
    fn new(outcome: &Outcome<'a>, object: &'static str, choices: Vec<C>) -> Self {
        Envelope {
            id: outcome.id,
            object,
            created: outcome.created,
            model: outcome.model,
            choices,
            usage: None,
        }
    }

    /// The envelope with the request's token counts, as a whole response and the usage chunk carry.
    fn with_usage(mut self, outcome: &Outcome<'_>) -> Self {
        self.usage = Some(Usage::of(outcome));
        self
    }
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: AssistantMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'a str,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<()>>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<()>,
}

/// An empty choice list's element type, for the usage-only chunk.
#[derive(Serialize)]
enum NoChoice {}

#[derive(Serialize)]
struct Generated<'a> {
    text: &'a str,
    meta_info: MetaInfo<'a>,
}

#[derive(Serialize)]
struct MetaInfo<'a> {
    id: &'a str,
    finish_reason: Option<SglangFinish<'a>>,
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
}

/// SGLang's finish reason object: `{"type": "length", "length": n}` for a budget reached.
#[derive(Serialize)]
struct SglangFinish<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    length: Option<u32>,
}

impl<'a> Generated<'a> {
    fn of(outcome: &Outcome<'a>, finished: bool) -> Self {
        let finish_reason = finished.then(|| SglangFinish {
            kind: outcome.finish_reason,
            length: (outcome.finish_reason == "length").then_some(outcome.completion_tokens),
        });
        Generated {
            text: outcome.text,
            meta_info: MetaInfo {
                id: outcome.id,
                finish_reason,
                prompt_tokens: outcome.prompt_tokens,
                completion_tokens: outcome.completion_tokens,
                cached_tokens: outcome.cached_tokens,
            },
        }
    }
}

/// The JSON of a serializable value. Serializing these plain structs cannot fail (string keys only,
/// no maps), so the empty fallback is never taken.
fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// One SSE event carrying `value`.
fn event<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&json(value));
    out.extend_from_slice(b"\n\n");
}

/// One SSE event carrying an OpenAI chunk with one choice.
fn chunk<C: Serialize>(out: &mut Vec<u8>, outcome: &Outcome<'_>, object: &'static str, choice: C) {
    event(out, &Envelope::new(outcome, object, vec![choice]));
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// The non-streaming response to a finished request.
pub fn response_body(api: Api, outcome: &Outcome) -> Vec<u8> {
    match api {
        Api::Chat => {
            let choice = ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: outcome.text,
                },
                logprobs: None,
                finish_reason: outcome.finish_reason,
                stop_reason: None,
            };
            json(&Envelope::new(outcome, "chat.completion", vec![choice]).with_usage(outcome))
        }
        Api::Completion => {
            let choice = TextChoice {
                index: 0,
                text: outcome.text,
                logprobs: None,
                finish_reason: Some(outcome.finish_reason),
                stop_reason: None,
            };
            json(&Envelope::new(outcome, "text_completion", vec![choice]).with_usage(outcome))
        }
        Api::Generate => json(&Generated::of(outcome, true)),
    }
}

/// One SSE event carrying the newly produced `delta`. OpenAI chunks carry the delta alone, the first
/// chat chunk also the assistant role; SGLang's events carry the whole text so far (`outcome.text`) and
/// ignore `delta` and `first`.
pub fn stream_chunk(api: Api, outcome: &Outcome, delta: &str, first: bool) -> Bytes {
    let mut out = Vec::with_capacity(256 + delta.len());
    match api {
        Api::Chat => {
            let choice = ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: first.then_some("assistant"),
                    content: Some(delta),
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            };
            chunk(&mut out, outcome, "chat.completion.chunk", choice);
        }
        Api::Completion => {
            let choice = TextChoice {
                index: 0,
                text: delta,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            };
            chunk(&mut out, outcome, "text_completion", choice);
        }
        Api::Generate => event(&mut out, &Generated::of(outcome, false)),
    }
    Bytes::from(out)
}

/// The events that close a stream: a chunk with the finish reason and no new text, the usage chunk
/// (`choices: []`) when `include_usage` and the API is OpenAI's, then `data: [DONE]`.
pub fn stream_end(api: Api, outcome: &Outcome, include_usage: bool) -> Bytes {
    let mut out = Vec::with_capacity(512);
    match api {
        Api::Chat => {
            let choice = ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: None,
                    content: None,
                },
                logprobs: None,
                finish_reason: Some(outcome.finish_reason),
                stop_reason: Some(None),
            };
            chunk(&mut out, outcome, "chat.completion.chunk", choice);
            if include_usage {
                usage_chunk(&mut out, outcome, "chat.completion.chunk");
            }
        }
        Api::Completion => {
            let choice = TextChoice {
                index: 0,
                text: "",
                logprobs: None,
                finish_reason: Some(outcome.finish_reason),
                stop_reason: None,
            };
            chunk(&mut out, outcome, "text_completion", choice);
            if include_usage {
                usage_chunk(&mut out, outcome, "text_completion");
            }
        }
        Api::Generate => event(&mut out, &Generated::of(outcome, true)),
    }
    out.extend_from_slice(DONE);
    Bytes::from(out)
}

fn usage_chunk(out: &mut Vec<u8>, outcome: &Outcome<'_>, object: &'static str) {
    event(
        out,
        &Envelope::<NoChoice>::new(outcome, object, Vec::new()).with_usage(outcome),
    );
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<()>,
    code: u16,
}

/// An error response as vLLM's OpenAI server writes it (SGLang's OpenAI adapter uses the same shape).
pub fn error_body(status: u16, message: &str) -> Vec<u8> {
    let kind = match status {
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        408 => "RequestTimeoutError",
        413 => "RequestEntityTooLargeError",
        422 => "UnprocessableEntityError",
        429 => "RateLimitError",
        501 => "NotImplementedError",
        503 => "ServiceUnavailableError",
        500..=599 => "InternalServerError",
        _ => "BadRequestError",
    };
    json(&ErrorBody {
        object: "error",
        message,
        kind,
        param: None,
        code: status,
    })
}

/// Words the simulated model "generates": common, distinct, each one token in most vocabularies, so
/// outputs read as text and token counts stay close to word counts.
const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " with", " was",
    " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have",
    " an", " they", " which", " one", " you", " were", " all", " we", " her", " she", " there",
    " would", " their", " will", " when", " who", " him", " been", " has", " more", " if", " no",
    " out", " so", " said", " what", " up", " its", " about", " into", " than", " them", " can",
    " only", " other", " new", " some", " could", " time", " these",
];

/// The `index`-th output word of a request seeded with `seed`, with its leading space. A function of
/// the two alone, so a rerun with the same seed produces the same text.
pub fn output_token(seed: u64, index: u32) -> &'static str {
    // splitmix64's finalizer: every input bit moves every output bit, so neighbouring indices differ.
    let mut x = seed ^ u64::from(index).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    let slot = usize::try_from(x % WORDS.len() as u64).unwrap_or(0);
    WORDS.get(slot).copied().unwrap_or(" the")
}

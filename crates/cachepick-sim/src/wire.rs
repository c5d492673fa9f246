//! The request bodies simulated engines accept and the JSON and SSE they answer, shaped as vLLM's
//! OpenAI-compatible server and SGLang's native `/generate` shape them, so a client or a router cannot
//! tell a simulated worker from a real one by its wire format.
//!
//! Parsing is the simulator's own and shares nothing with the picker's request path: the simulator must
//! not agree with the picker by construction. It reads the members an engine acts on and ignores the
//! rest, as the engines do. A member given twice keeps its last value, as Python's JSON parser does;
//! `null` counts as absent. Every problem is a [`WireError`] naming the member at fault, answered with a
//! 400; no body, however malformed, panics.
//!
//! What each API reads:
//! - **Chat** (`/v1/chat/completions`): `messages` (required, non-empty; each with a `role` and a
//!   `content` that is a string, a list of content parts or `null`), `tools` (kept as raw JSON text for
//!   the chat template), `model`, `max_completion_tokens` else `max_tokens` (vLLM's precedence),
//!   `stream`, `stream_options.include_usage`. Text parts are joined with `\n`, as vLLM joins them for a
//!   string-content chat template; other parts (`image_url`, `input_audio`, …) carry no text and are
//!   skipped.
//! - **Completions** (`/v1/completions`): `prompt` as a string, a list of one string, token ids or a list
//!   of one token-id list; `model`, `max_tokens`, `stream`, `stream_options.include_usage`. Several
//!   prompts in one request are refused: the simulator answers one choice per request.
//! - **Generate** (SGLang's `/generate`): `text` or `input_ids` (one, not both, and not a batch),
//!   `sampling_params.max_new_tokens`, `stream`, `model`.
//!
//! Every output-length member must be at least 1, as vLLM requires of `max_tokens`.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::fmt;

use bytes::Bytes;
use serde::Serialize;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use thiserror::Error;

/// Arrays and objects in `tools` nest at most this deep. The simulator hands `tools` to a chat template
/// renderer, which recurses over it; JSON schemas nest about a dozen levels, nothing legitimate nears this.
pub const MAX_TOOLS_DEPTH: usize = 64;

/// Which inference API a request speaks, fixed by the path it was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI `/v1/chat/completions`.
    Chat,
    /// OpenAI `/v1/completions`.
    Completion,
    /// SGLang's native `/generate`.
    Generate,
}

impl Api {
    pub const ALL: [Api; 3] = [Api::Chat, Api::Completion, Api::Generate];

    /// The path the engines serve the API at.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completion => "/v1/completions",
            Api::Generate => "/generate",
        }
    }

    /// The API served at `path`, query string ignored. Engines route exact paths, so a prefixed path
    /// (`/proxy/v1/completions`) is `None` here and a 404 at the server, as it is at a real engine.
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        Api::ALL.into_iter().find(|api| api.path() == path)
    }
}

/// One chat message as the chat template sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    /// The string content, or the text parts joined with `\n`; empty for `null` or absent content.
    pub content: String,
}

/// The prompt as the API gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Never empty.
    Chat {
        messages: Vec<Message>,
        /// The raw JSON text of `tools` (an array) when present and not `null`.
        tools: Option<String>,
    },
    /// May be empty: engines render an empty prompt to the tokenizer's special tokens.
    Text(String),
    /// Never empty.
    Tokens(Vec<u32>),
}

/// A request as a simulated engine acts on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    pub api: Api,
    pub model: Option<String>,
    pub prompt: Prompt,
    /// At least 1 when present; `None` leaves the choice to the engine's default.
    pub max_tokens: Option<u32>,
    pub stream: bool,
    /// Whether a streamed OpenAI response ends with a usage chunk; always `false` without `stream` and
    /// for `/generate`, whose every event carries the token counts anyway.
    pub include_usage: bool,
}

/// Why a body was refused. Every variant names the member at fault, so a client can fix its request from
/// the message alone.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    #[error("request body must be a JSON object")]
    NotObject,
    #[error("`{0}` is required")]
    Missing(String),
    #[error("one of `text` or `input_ids` is required")]
    NoPrompt,
    #[error("`text` and `input_ids` cannot both be given")]
    BothPrompts,
    #[error("`{field}` must be {expected}")]
    Invalid {
        field: String,
        expected: &'static str,
    },
    #[error("`{0}` must not be empty")]
    Empty(String),
    #[error("`{field}` must be at least 1, got {value}")]
    TooFewTokens { field: &'static str, value: String },
    #[error("batched prompts are not supported by the simulator: `{0}` holds more than one prompt")]
    Batched(&'static str),
    #[error("`stream_options` is only allowed when `stream` is true")]
    StreamOptionsWithoutStream,
    #[error("`{field}` nests deeper than {MAX_TOOLS_DEPTH} levels")]
    TooDeep { field: &'static str },
}

impl WireError {
    /// The HTTP status to answer with: every refused body is the client's fault.
    pub fn status(&self) -> u16 {
        400
    }
}

/// Reads a request body sent to `api`'s path.
pub fn parse(api: Api, body: &[u8]) -> Result<SimRequest, WireError> {
    let members = top_level(body)?;
    let model = members
        .get("model")
        .map(|raw| string(raw, "model"))
        .transpose()?;
    let stream = members
        .get("stream")
        .map(|raw| boolean(raw, "stream"))
        .transpose()?
        .unwrap_or(false);
    let (prompt, max_tokens, include_usage) = match api {
        Api::Chat => {
            let messages = members
                .get("messages")
                .ok_or_else(|| WireError::Missing("messages".to_owned()))?;
            let prompt = Prompt::Chat {
                messages: chat_messages(messages)?,
                tools: members.get("tools").map(tools).transpose()?,
            };
            let max_tokens = max_tokens_of(&members, "max_tokens")?;
            let max_completion_tokens = max_tokens_of(&members, "max_completion_tokens")?;
            let usage = include_usage(&members, stream)?;
            (prompt, max_completion_tokens.or(max_tokens), usage)
        }
        Api::Completion => {
            let prompt = members
                .get("prompt")
                .ok_or_else(|| WireError::Missing("prompt".to_owned()))?;
            let prompt = completion_prompt(prompt)?;
            let usage = include_usage(&members, stream)?;
            (prompt, max_tokens_of(&members, "max_tokens")?, usage)
        }
        Api::Generate => {
            let prompt = match (members.get("text"), members.get("input_ids")) {
                (Some(_), Some(_)) => return Err(WireError::BothPrompts),
                (None, None) => return Err(WireError::NoPrompt),
                (Some(text), None) => generate_text(text)?,
                (None, Some(ids)) => generate_ids(ids)?,
            };
            let max_tokens = match members.get("sampling_params") {
                None => None,
                Some(raw) => {
                    let params = object(raw, "sampling_params")?;
                    max_tokens_of(&params, "sampling_params.max_new_tokens")?
                }
            };
            (prompt, max_tokens, false)
        }
    };
    Ok(SimRequest {
        api,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
    })
}

/// An object's members in the order written, each kept as its raw JSON text. Reading values raw keeps
/// the parse flat: serde_json skips a raw value iteratively, so no nesting in an ignored member can
/// exhaust the stack.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'a> Members<'a> {
    /// The last value given for `name`; `None` when absent or `null`.
    fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(key, _)| key == name)
            .map(|(_, raw)| *raw)
            .filter(|raw| raw.get() != "null")
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;

        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<&'de RawValue>()?;
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }

        deserializer.deserialize_map(MembersVisitor)
    }
}

/// The body's top-level members. A syntax error is reported as such; well-formed JSON of another type is
/// [`WireError::NotObject`].
fn top_level(body: &[u8]) -> Result<Members<'_>, WireError> {
    serde_json::from_slice::<Members<'_>>(body).map_err(|error| match error.classify() {
        serde_json::error::Category::Data => WireError::NotObject,
        _ => WireError::Json(error.to_string()),
    })
}

/// The members of `raw`, which must be an object.
fn object<'a>(raw: &'a RawValue, field: &str) -> Result<Members<'a>, WireError> {
    serde_json::from_str::<Members<'a>>(raw.get()).map_err(|_| invalid(field, "an object"))
}

fn invalid(field: &str, expected: &'static str) -> WireError {
    WireError::Invalid {
        field: field.to_owned(),
        expected,
    }
}

fn string(raw: &RawValue, field: &str) -> Result<String, WireError> {
    serde_json::from_str::<String>(raw.get()).map_err(|_| invalid(field, "a string"))
}

fn boolean(raw: &RawValue, field: &str) -> Result<bool, WireError> {
    serde_json::from_str::<bool>(raw.get()).map_err(|_| invalid(field, "a boolean"))
}

/// The first byte of a raw value, which tells its JSON type.
fn kind(raw: &RawValue) -> Option<u8> {
    raw.get().trim_start().bytes().next()
}

/// An output-token budget: an integer of at least 1. `field` is the dotted path for messages; its last
/// segment is the member read from `members`. A number beyond `u32` saturates, since any such budget
/// exceeds every model's context and the server refuses it there with the limit in the message.
fn max_tokens_of(members: &Members<'_>, field: &'static str) -> Result<Option<u32>, WireError> {
    let name = field.rsplit('.').next().unwrap_or(field);
    let Some(raw) = members.get(name) else {
        return Ok(None);
    };
    let number = serde_json::from_str::<serde_json::Number>(raw.get())
        .map_err(|_| invalid(field, "an integer"))?;
    let too_few = || WireError::TooFewTokens {
        field,
        value: raw.get().to_owned(),
    };
    if let Some(value) = number.as_u64() {
        return match value {
            0 => Err(too_few()),
            value => Ok(Some(u32::try_from(value).unwrap_or(u32::MAX))),
        };
    }
    if number.as_i64().is_some() {
        return Err(too_few());
    }
    // A float: Python's lax integer coercion takes `16.0` and a huge integer literal, not `16.5`.
    match number.as_f64() {
        Some(value) if value.is_finite() && value.fract() == 0.0 => {
            if value < 1.0 {
                Err(too_few())
            } else {
                Ok(Some(if value >= f64::from(u32::MAX) {
                    u32::MAX
                } else {
                    value as u32
                }))
            }
        }
        _ => Err(invalid(field, "an integer")),
    }
}

/// `stream_options.include_usage`, refused without `stream` as vLLM refuses it.
fn include_usage(members: &Members<'_>, stream: bool) -> Result<bool, WireError> {
    let Some(raw) = members.get("stream_options") else {
        return Ok(false);
    };
    if !stream {
        return Err(WireError::StreamOptionsWithoutStream);
    }
    let options = object(raw, "stream_options")?;
    Ok(options
        .get("include_usage")
        .map(|raw| boolean(raw, "stream_options.include_usage"))
        .transpose()?
        .unwrap_or(false))
}

fn chat_messages(raw: &RawValue) -> Result<Vec<Message>, WireError> {
    const EXPECTED: &str = "a non-empty array of message objects";
    let items = serde_json::from_str::<Vec<&RawValue>>(raw.get())
        .map_err(|_| invalid("messages", EXPECTED))?;
    if items.is_empty() {
        return Err(WireError::Empty("messages".to_owned()));
    }
    items
        .iter()
        .enumerate()
        .map(|(index, item)| chat_message(index, item))
        .collect()
}

fn chat_message(index: usize, raw: &RawValue) -> Result<Message, WireError> {
    let at = format!("messages[{index}]");
    let members = object(raw, &at).map_err(|_| invalid(&at, "a message object"))?;
    let role = match members.get("role") {
        Some(role) => string(role, &format!("{at}.role"))?,
        None => return Err(WireError::Missing(format!("{at}.role"))),
    };
    let content = match members.get("content") {
        None => String::new(),
        Some(content) => message_content(&at, content)?,
    };
    Ok(Message { role, content })
}

/// A message's content as text: a string as is, a list of parts as its text parts joined with `\n`.
fn message_content(at: &str, raw: &RawValue) -> Result<String, WireError> {
    const EXPECTED: &str = "a string, an array of content parts, or null";
    let field = format!("{at}.content");
    match kind(raw) {
        Some(b'"') => string(raw, &field),
        Some(b'[') => {
            let parts = serde_json::from_str::<Vec<&RawValue>>(raw.get())
                .map_err(|_| invalid(&field, EXPECTED))?;
            let mut texts = Vec::new();
            for (index, part) in parts.iter().enumerate() {
                if let Some(text) = content_part(&format!("{field}[{index}]"), part)? {
                    texts.push(text);
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(&field, EXPECTED)),
    }
}

/// A content part's text; `None` for a part of another type, which contributes no text. A part without
/// `type` is a text part if it has `text`.
fn content_part(at: &str, raw: &RawValue) -> Result<Option<String>, WireError> {
    let members = object(raw, at).map_err(|_| invalid(at, "a content part object"))?;
    let kind = members
        .get("type")
        .map(|raw| string(raw, &format!("{at}.type")))
        .transpose()?;
    let text = members.get("text");
    match (kind.as_deref(), text) {
        (Some("text") | None, Some(text)) => string(text, &format!("{at}.text")).map(Some),
        (Some("text"), None) => Err(WireError::Missing(format!("{at}.text"))),
        (None, None) => Err(WireError::Missing(format!("{at}.type"))),
        (Some(_), _) => Ok(None),
    }
}

/// `tools` as raw JSON text: an array nested no deeper than [`MAX_TOOLS_DEPTH`].
fn tools(raw: &RawValue) -> Result<String, WireError> {
    if kind(raw) != Some(b'[') {
        return Err(invalid("tools", "an array of tool objects"));
    }
    if depth(raw.get()) > MAX_TOOLS_DEPTH {
        return Err(WireError::TooDeep { field: "tools" });
    }
    Ok(raw.get().to_owned())
}

/// The deepest nesting of arrays and objects in well-formed JSON text, brackets inside strings ignored.
fn depth(json: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for byte in json.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Token ids: a non-empty array of integers in `u32`.
fn token_ids(raw: &RawValue, field: &str) -> Result<Vec<u32>, WireError> {
    if let Ok(ids) = serde_json::from_str::<Vec<u32>>(raw.get()) {
        return if ids.is_empty() {
            Err(WireError::Empty(field.to_owned()))
        } else {
            Ok(ids)
        };
    }
    let items = serde_json::from_str::<Vec<&RawValue>>(raw.get())
        .map_err(|_| invalid(field, "an array of token ids"))?;
    let bad = items
        .iter()
        .position(|item| serde_json::from_str::<u32>(item.get()).is_err())
        .unwrap_or(0);
    Err(invalid(
        &format!("{field}[{bad}]"),
        "a token id (an integer from 0 to 4294967295)",
    ))
}

fn completion_prompt(raw: &RawValue) -> Result<Prompt, WireError> {
    const EXPECTED: &str = "a string, an array of one string, or an array of token ids";
    match kind(raw) {
        Some(b'"') => string(raw, "prompt").map(Prompt::Text),
        Some(b'[') => {
            let items = serde_json::from_str::<Vec<&RawValue>>(raw.get())
                .map_err(|_| invalid("prompt", EXPECTED))?;
            let first = items.first().map(|item| kind(item));
            match (first, items.len()) {
                (None, _) => Err(WireError::Empty("prompt".to_owned())),
                (Some(Some(b'"' | b'[')), 2..) => Err(WireError::Batched("prompt")),
                (Some(Some(b'"')), _) => items
                    .first()
                    .map_or(Err(invalid("prompt", EXPECTED)), |item| {
                        string(item, "prompt[0]").map(Prompt::Text)
                    }),
                (Some(Some(b'[')), _) => items
                    .first()
                    .map_or(Err(invalid("prompt", EXPECTED)), |item| {
                        token_ids(item, "prompt[0]").map(Prompt::Tokens)
                    }),
                _ => token_ids(raw, "prompt").map(Prompt::Tokens),
            }
        }
        _ => Err(invalid("prompt", EXPECTED)),
    }
}

/// SGLang's `text`: one string. A list is a batch, answered by SGLang with a list of results, a shape
/// the simulator does not produce.
fn generate_text(raw: &RawValue) -> Result<Prompt, WireError> {
    match kind(raw) {
        Some(b'[') => Err(WireError::Batched("text")),
        _ => string(raw, "text").map(Prompt::Text),
    }
}

/// SGLang's `input_ids`: one list of token ids; a list of lists is a batch.
fn generate_ids(raw: &RawValue) -> Result<Prompt, WireError> {
    let nested = serde_json::from_str::<Vec<&RawValue>>(raw.get())
        .ok()
        .and_then(|items| items.first().map(|item| kind(item) == Some(b'[')));
    if nested == Some(true) {
        return Err(WireError::Batched("input_ids"));
    }
    token_ids(raw, "input_ids").map(Prompt::Tokens)
}

/// What a finished (or, while streaming, partly produced) request reports. While streaming it describes
/// the response so far: `text` holds everything produced up to and including the chunk being written,
/// and `completion_tokens` counts it. The caller passes `id` and `created` so output is deterministic.
#[derive(Clone, Copy, Debug)]
pub struct Outcome<'a> {
    pub id: &'a str,
    pub model: &'a str,
    /// Unix seconds.
    pub created: u64,
    pub text: &'a str,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: u32,
    /// `"length"`, `"stop"` or `"abort"`.
    pub finish_reason: &'a str,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: PromptDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: u32,
}

impl Usage {
    fn of(outcome: &Outcome<'_>) -> Usage {
        Usage {
            prompt_tokens: outcome.prompt_tokens,
            total_tokens: u64::from(outcome.prompt_tokens) + u64::from(outcome.completion_tokens),
            completion_tokens: outcome.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: outcome.cached_tokens,
            },
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
            let mut envelope = Envelope::new(outcome, "chat.completion", vec![choice]);
            envelope.usage = Some(Usage::of(outcome));
            json(&envelope)
        }
        Api::Completion => {
            let choice = TextChoice {
                index: 0,
                text: outcome.text,
                logprobs: None,
                finish_reason: Some(outcome.finish_reason),
                stop_reason: None,
            };
            let mut envelope = Envelope::new(outcome, "text_completion", vec![choice]);
            envelope.usage = Some(Usage::of(outcome));
            json(&envelope)
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
            event(
                &mut out,
                &Envelope::new(outcome, "chat.completion.chunk", vec![choice]),
            );
        }
        Api::Completion => {
            let choice = TextChoice {
                index: 0,
                text: delta,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            };
            event(
                &mut out,
                &Envelope::new(outcome, "text_completion", vec![choice]),
            );
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
            event(
                &mut out,
                &Envelope::new(outcome, "chat.completion.chunk", vec![choice]),
            );
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
            event(
                &mut out,
                &Envelope::new(outcome, "text_completion", vec![choice]),
            );
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
    let mut envelope = Envelope::<NoChoice>::new(outcome, object, Vec::new());
    envelope.usage = Some(Usage::of(outcome));
    event(out, &envelope);
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

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use proptest::prelude::*;
    use serde_json::Value;

    use super::*;

    fn ok(api: Api, body: &str) -> SimRequest {
        parse(api, body.as_bytes()).unwrap_or_else(|error| panic!("{body}: {error}"))
    }

    fn err(api: Api, body: &str) -> WireError {
        match parse(api, body.as_bytes()) {
            Ok(request) => panic!("{body} parsed: {request:?}"),
            Err(error) => error,
        }
    }

    #[test]
    fn paths_map_to_apis_exactly() {
        assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
        assert_eq!(Api::from_path("/v1/completions?x=1"), Some(Api::Completion));
        assert_eq!(Api::from_path("/generate"), Some(Api::Generate));
        assert_eq!(Api::from_path("/proxy/v1/completions"), None);
        assert_eq!(Api::from_path("/v1/models"), None);
        for api in Api::ALL {
            assert_eq!(Api::from_path(api.path()), Some(api));
        }
    }

    #[test]
    fn chat_reads_messages_tools_and_options() {
        let request = ok(
            Api::Chat,
            r#"{"model": "m", "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}}, {"text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": []}],
               "tools": [{"type": "function", "function": {"name": "f"}}],
               "max_tokens": 5, "max_completion_tokens": 7, "stream": true,
               "stream_options": {"include_usage": true}, "temperature": 0.2}"#,
        );
        assert_eq!(request.api, Api::Chat);
        assert_eq!(request.model.as_deref(), Some("m"));
        assert_eq!(
            (request.max_tokens, request.stream, request.include_usage),
            (Some(7), true, true)
        );
        let Prompt::Chat { messages, tools } = request.prompt else {
            panic!("not chat");
        };
        let contents: Vec<_> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            contents,
            [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
        );
        assert_eq!(
            tools.as_deref(),
            Some(r#"[{"type": "function", "function": {"name": "f"}}]"#)
        );
    }

    #[test]
    fn chat_defaults_and_null_members() {
        let request = ok(
            Api::Chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "tools": null, "model": null,
                "stream": null, "max_tokens": 3}"#,
        );
        assert_eq!(request.model, None);
        assert_eq!(
            (request.max_tokens, request.stream, request.include_usage),
            (Some(3), false, false)
        );
        assert!(matches!(request.prompt, Prompt::Chat { tools: None, .. }));
    }

    #[test]
    fn a_member_given_twice_keeps_its_last_value() {
        let request = ok(
            Api::Completion,
            r#"{"prompt": "a", "max_tokens": 1, "prompt": "b", "max_tokens": 2}"#,
        );
        assert_eq!(request.prompt, Prompt::Text("b".to_owned()));
        assert_eq!(request.max_tokens, Some(2));
    }

    #[test]
    fn completions_read_every_single_prompt_shape() {
        let cases = [
            (r#""hello""#, Prompt::Text("hello".to_owned())),
            (r#""""#, Prompt::Text(String::new())),
            (r#"["hello"]"#, Prompt::Text("hello".to_owned())),
            ("[1, 2, 3]", Prompt::Tokens(vec![1, 2, 3])),
            ("[[4, 5]]", Prompt::Tokens(vec![4, 5])),
        ];
        for (prompt, expected) in cases {
            let request = ok(
                Api::Completion,
                &format!(r#"{{"prompt": {prompt}, "model": "m", "max_tokens": 4}}"#),
            );
            assert_eq!(request.prompt, expected, "{prompt}");
            assert_eq!(request.max_tokens, Some(4));
        }
        let request = ok(
            Api::Completion,
            r#"{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}"#,
        );
        assert!(request.stream && request.include_usage);
    }

    #[test]
    fn generate_reads_text_or_input_ids() {
        let request = ok(
            Api::Generate,
            r#"{"text": "hi", "sampling_params": {"max_new_tokens": 9, "temperature": 0}, "stream": true}"#,
        );
        assert_eq!(request.prompt, Prompt::Text("hi".to_owned()));
        assert_eq!(
            (request.max_tokens, request.stream, request.include_usage),
            (Some(9), true, false)
        );
        let request = ok(Api::Generate, r#"{"input_ids": [7, 8], "text": null}"#);
        assert_eq!(request.prompt, Prompt::Tokens(vec![7, 8]));
        assert_eq!(request.max_tokens, None);
    }

    #[test]
    fn budgets_accept_integral_floats_and_saturate() {
        let request = ok(Api::Completion, r#"{"prompt": "x", "max_tokens": 16.0}"#);
        assert_eq!(request.max_tokens, Some(16));
        let request = ok(
            Api::Completion,
            r#"{"prompt": "x", "max_tokens": 99999999999999}"#,
        );
        assert_eq!(request.max_tokens, Some(u32::MAX));
        let request = ok(Api::Completion, r#"{"prompt": "x", "max_tokens": 1e30}"#);
        assert_eq!(request.max_tokens, Some(u32::MAX));
    }

    #[test]
    fn every_refusal_is_a_400_naming_the_member() {
        let cases: &[(Api, &str, &str)] = &[
            (Api::Chat, "{", "not valid JSON"),
            (Api::Chat, "[]", "JSON object"),
            (Api::Chat, "{} x", "not valid JSON"),
            (Api::Chat, "{}", "`messages` is required"),
            (
                Api::Chat,
                r#"{"messages": []}"#,
                "`messages` must not be empty",
            ),
            (Api::Chat, r#"{"messages": "hi"}"#, "`messages` must be"),
            (Api::Chat, r#"{"messages": [1]}"#, "`messages[0]` must be"),
            (
                Api::Chat,
                r#"{"messages": [{"content": "x"}]}"#,
                "`messages[0].role` is required",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": 1}]}"#,
                "`messages[0].role` must be a string",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u", "content": 5}]}"#,
                "`messages[0].content` must be",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u", "content": [{"type": "text"}]}]}"#,
                "`messages[0].content[0].text` is required",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u", "content": [{"image_url": {}}]}]}"#,
                "`messages[0].content[0].type` is required",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u", "content": ["x"]}]}"#,
                "`messages[0].content[0]` must be a content part object",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "tools": {}}"#,
                "`tools` must be an array",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "model": 3}"#,
                "`model` must be a string",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "stream": "yes"}"#,
                "`stream` must be a boolean",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "max_tokens": 0}"#,
                "`max_tokens` must be at least 1, got 0",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "max_completion_tokens": -2}"#,
                "`max_completion_tokens` must be at least 1, got -2",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "max_tokens": 1.5}"#,
                "`max_tokens` must be an integer",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "max_tokens": "3"}"#,
                "`max_tokens` must be an integer",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "stream_options": {"include_usage": true}}"#,
                "`stream_options` is only allowed when `stream` is true",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "stream": true, "stream_options": 1}"#,
                "`stream_options` must be an object",
            ),
            (
                Api::Chat,
                r#"{"messages": [{"role": "u"}], "stream": true, "stream_options": {"include_usage": 1}}"#,
                "`stream_options.include_usage` must be a boolean",
            ),
            (Api::Completion, "{}", "`prompt` is required"),
            (
                Api::Completion,
                r#"{"prompt": ["a", "b"]}"#,
                "batched prompts are not supported by the simulator: `prompt`",
            ),
            (
                Api::Completion,
                r#"{"prompt": [[1], [2]]}"#,
                "batched prompts are not supported by the simulator: `prompt`",
            ),
            (
                Api::Completion,
                r#"{"prompt": []}"#,
                "`prompt` must not be empty",
            ),
            (
                Api::Completion,
                r#"{"prompt": [[]]}"#,
                "`prompt[0]` must not be empty",
            ),
            (
                Api::Completion,
                r#"{"prompt": [1, -1]}"#,
                "`prompt[1]` must be a token id",
            ),
            (
                Api::Completion,
                r#"{"prompt": [1, 4294967296]}"#,
                "`prompt[1]` must be a token id",
            ),
            (
                Api::Completion,
                r#"{"prompt": [1, "a"]}"#,
                "`prompt[1]` must be a token id",
            ),
            (
                Api::Completion,
                r#"{"prompt": 5}"#,
                "`prompt` must be a string",
            ),
            (
                Api::Completion,
                r#"{"prompt": "x", "max_tokens": 0}"#,
                "`max_tokens` must be at least 1",
            ),
            (
                Api::Generate,
                "{}",
                "one of `text` or `input_ids` is required",
            ),
            (
                Api::Generate,
                r#"{"text": "a", "input_ids": [1]}"#,
                "`text` and `input_ids`",
            ),
            (
                Api::Generate,
                r#"{"text": ["a"]}"#,
                "batched prompts are not supported by the simulator: `text`",
            ),
            (
                Api::Generate,
                r#"{"input_ids": [[1], [2]]}"#,
                "batched prompts are not supported by the simulator: `input_ids`",
            ),
            (
                Api::Generate,
                r#"{"input_ids": []}"#,
                "`input_ids` must not be empty",
            ),
            (
                Api::Generate,
                r#"{"input_ids": "a"}"#,
                "`input_ids` must be an array of token ids",
            ),
            (Api::Generate, r#"{"text": 1}"#, "`text` must be a string"),
            (
                Api::Generate,
                r#"{"text": "a", "sampling_params": []}"#,
                "`sampling_params` must be an object",
            ),
            (
                Api::Generate,
                r#"{"text": "a", "sampling_params": {"max_new_tokens": 0}}"#,
                "`sampling_params.max_new_tokens` must be at least 1, got 0",
            ),
        ];
        for (api, body, message) in cases {
            let error = err(*api, body);
            assert_eq!(error.status(), 400);
            let text = error.to_string();
            assert!(text.contains(message), "{body}: {text:?} lacks {message:?}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_in_tools_and_harmless_elsewhere() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let body = format!(r#"{{"messages": [{{"role": "u"}}], "tools": {deep}}}"#);
        assert_eq!(err(Api::Chat, &body), WireError::TooDeep { field: "tools" });
        let body = format!(r#"{{"messages": [{{"role": "u"}}], "extra": {deep}}}"#);
        assert!(parse(Api::Chat, body.as_bytes()).is_ok());
        let body = format!(
            r#"{{"messages": [{{"role": "u", "content": [{{"type": "image_url", "image_url": {deep}}}]}}]}}"#
        );
        assert!(parse(Api::Chat, body.as_bytes()).is_ok());
        let nested_tools = format!(
            r#"[{{"a": "[[[[", "b": {}{}}}]"#,
            "[".repeat(10),
            "]".repeat(10)
        );
        let body = format!(r#"{{"messages": [{{"role": "u"}}], "tools": {nested_tools}}}"#);
        assert!(parse(Api::Chat, body.as_bytes()).is_ok());
    }

    fn outcome<'a>(text: &'a str, completion_tokens: u32) -> Outcome<'a> {
        Outcome {
            id: "req-1",
            model: "sim \"model\"",
            created: 1_700_000_000,
            text,
            prompt_tokens: 12,
            completion_tokens,
            cached_tokens: 8,
            finish_reason: "length",
        }
    }

    fn parse_json(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn non_streaming_bodies_carry_the_openai_and_sglang_fields() {
        let done = outcome(" the end\n\"quoted\"", 3);
        let chat = parse_json(&response_body(Api::Chat, &done));
        assert_eq!(chat["id"], "req-1");
        assert_eq!(chat["object"], "chat.completion");
        assert_eq!(chat["created"], 1_700_000_000);
        assert_eq!(chat["model"], "sim \"model\"");
        assert_eq!(chat["choices"][0]["index"], 0);
        assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
        assert_eq!(chat["choices"][0]["message"]["content"], done.text);
        assert_eq!(chat["choices"][0]["finish_reason"], "length");
        assert!(chat["choices"][0]["logprobs"].is_null());
        assert_eq!(chat["usage"]["prompt_tokens"], 12);
        assert_eq!(chat["usage"]["completion_tokens"], 3);
        assert_eq!(chat["usage"]["total_tokens"], 15);
        assert_eq!(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

        let text = parse_json(&response_body(Api::Completion, &done));
        assert_eq!(text["object"], "text_completion");
        assert_eq!(text["choices"][0]["text"], done.text);
        assert_eq!(text["choices"][0]["finish_reason"], "length");
        assert_eq!(text["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

        let generated = parse_json(&response_body(Api::Generate, &done));
        assert_eq!(generated["text"], done.text);
        let meta = &generated["meta_info"];
        assert_eq!(meta["id"], "req-1");
        assert_eq!(meta["finish_reason"]["type"], "length");
        assert_eq!(meta["finish_reason"]["length"], 3);
        assert_eq!(
            (
                &meta["prompt_tokens"],
                &meta["completion_tokens"],
                &meta["cached_tokens"]
            ),
            (&Value::from(12), &Value::from(3), &Value::from(8))
        );
    }

    /// The JSON payloads of an SSE stream, asserting its framing: `data: <json>\n\n` events, ending
    /// with `data: [DONE]\n\n`.
    fn events(stream: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(stream).unwrap();
        let body = text
            .strip_suffix("data: [DONE]\n\n")
            .expect("ends with [DONE]");
        assert!(body.ends_with("\n\n"));
        body.split_terminator("\n\n")
            .map(|event| {
                let json = event.strip_prefix("data: ").expect("data: prefix");
                assert!(!json.contains('\n'), "one line per event");
                serde_json::from_str(json).unwrap()
            })
            .collect()
    }

    /// A whole stream for `words`, as a server would write it.
    fn stream(api: Api, words: &[&str], include_usage: bool) -> (String, Vec<u8>) {
        let mut text = String::new();
        let mut out = Vec::new();
        for (index, word) in words.iter().enumerate() {
            text.push_str(word);
            let so_far = outcome(&text, index as u32 + 1);
            out.extend_from_slice(&stream_chunk(api, &so_far, word, index == 0));
        }
        let done = outcome(&text, words.len() as u32);
        out.extend_from_slice(&stream_end(api, &done, include_usage));
        (text, out)
    }

    #[test]
    fn chat_streams_deltas_then_finish_then_usage() {
        let words = [" a", " \"b\"", "\n c"];
        let (text, out) = stream(Api::Chat, &words, true);
        let events = events(&out);
        assert_eq!(events.len(), words.len() + 2);
        assert!(
            events
                .iter()
                .all(|e| e["object"] == "chat.completion.chunk")
        );
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(events[1]["choices"][0]["delta"].get("role").is_none());
        let deltas: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(deltas, text);
        let finish = &events[words.len()];
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        assert!(
            events[..words.len()]
                .iter()
                .all(|e| e["choices"][0]["finish_reason"].is_null())
        );
        let usage = &events[words.len() + 1];
        assert_eq!(usage["choices"], Value::Array(vec![]));
        assert_eq!(usage["usage"]["completion_tokens"], 3);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert!(
            events[..=words.len()]
                .iter()
                .all(|e| e.get("usage").is_none())
        );

        let (_, out) = stream(Api::Chat, &words, false);
        assert_eq!(events_len(&out), words.len() + 1);
    }

    fn events_len(out: &[u8]) -> usize {
        events(out).len()
    }

    #[test]
    fn completions_stream_text_deltas() {
        let words = [" x", " y"];
        let (text, out) = stream(Api::Completion, &words, true);
        let events = events(&out);
        assert_eq!(events.len(), 4);
        assert!(events.iter().all(|e| e["object"] == "text_completion"));
        let deltas: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(deltas, text);
        assert_eq!(events[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(events[3]["usage"]["total_tokens"], 14);
    }

    #[test]
    fn generate_streams_cumulative_text_and_finishes_in_meta_info() {
        let words = [" p", " q", " r"];
        let (text, out) = stream(Api::Generate, &words, true);
        let events = events(&out);
        assert_eq!(events.len(), 4, "no usage chunk for /generate");
        let mut previous = String::new();
        for event in &events {
            let so_far = event["text"].as_str().unwrap();
            assert!(so_far.starts_with(&previous));
            previous = so_far.to_owned();
        }
        assert_eq!(previous, text);
        assert!(
            events[..3]
                .iter()
                .all(|e| e["meta_info"]["finish_reason"].is_null())
        );
        assert_eq!(events[1]["meta_info"]["completion_tokens"], 2);
        assert_eq!(events[3]["meta_info"]["finish_reason"]["type"], "length");
    }

    #[test]
    fn errors_are_vllm_shaped() {
        for (status, kind) in [
            (400, "BadRequestError"),
            (404, "NotFoundError"),
            (500, "InternalServerError"),
            (503, "ServiceUnavailableError"),
        ] {
            let body = parse_json(&error_body(status, "bad \"thing\""));
            assert_eq!(body["object"], "error");
            assert_eq!(body["message"], "bad \"thing\"");
            assert_eq!(body["type"], kind);
            assert!(body["param"].is_null());
            assert_eq!(body["code"], status);
        }
    }

    #[test]
    fn output_tokens_are_deterministic_words() {
        let text: String = (0..32).map(|i| output_token(42, i)).collect();
        let again: String = (0..32).map(|i| output_token(42, i)).collect();
        let other: String = (0..32).map(|i| output_token(43, i)).collect();
        assert_eq!(text, again);
        assert_ne!(text, other);
        assert!((0..32).all(|i| output_token(42, i).starts_with(' ')));
        let distinct: std::collections::HashSet<_> = (0..256).map(|i| output_token(7, i)).collect();
        assert!(distinct.len() > 32, "indices spread over the word list");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            for api in Api::ALL {
                if let Err(error) = parse(api, &body) {
                    prop_assert_eq!(error.status(), 400);
                }
            }
        }

        #[test]
        fn json_shaped_bodies_never_panic(
            key in prop::sample::select(vec!["messages", "prompt", "text", "input_ids", "tools",
                "max_tokens", "stream", "stream_options", "sampling_params", "model"]),
            value in r#"(\[|\{|"|-?[0-9]{1,12}(\.[0-9])?|null|true|,|\]|\}|:|"role"|"content"|"type"|"text"|"max_new_tokens"){0,12}"#,
        ) {
            let body = format!(r#"{{"{key}": {value}}}"#);
            for api in Api::ALL {
                let _ = parse(api, body.as_bytes());
            }
        }
    }
}

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
use thiserror::Error;

mod request;
mod response;
#[cfg(test)]
mod tests;

pub use request::parse;

pub use response::{error_body, output_token, response_body, stream_chunk, stream_end};

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
    /// vLLM's `kv_transfer_params` (OpenAI APIs only): which leg of a disaggregated request this is.
    pub kv_transfer: Option<KvTransfer>,
    /// SGLang's rendezvous (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`), on either leg of a
    /// disaggregated request; `None` when the body names no room.
    pub bootstrap: Option<Bootstrap>,
}

/// Where a disaggregated SGLang request's two legs meet: the prefill worker's bootstrap server and the
/// room both legs name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
}

/// A disaggregated request's leg, as vLLM's NixlConnector reads `kv_transfer_params`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvTransfer {
    /// `do_remote_decode: true`: the prefill leg; its KV is kept for a decode worker to pull.
    RemoteDecode,
    /// `do_remote_prefill: true`: the decode leg; the KV is pulled from the prefill worker that
    /// answered these parameters.
    RemotePrefill {
        engine_id: String,
        request_id: String,
        host: String,
        port: u16,
    },
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
    #[error("`bootstrap_room` needs `{0}`")]
    BootstrapField(&'static str),
    #[error("`kv_transfer_params` with `do_remote_prefill` needs `{0}`")]
    KvTransferField(&'static str),
    #[error("`{field}` nests deeper than {MAX_TOOLS_DEPTH} levels")]
    TooDeep { field: &'static str },
}

impl WireError {
    /// The HTTP status to answer with: every refused body is the client's fault.
    pub fn status(&self) -> u16 {
        400
    }
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
    /// The engine is vLLM, whose `usage` also names the details it leaves empty here.
    pub vllm: bool,
}

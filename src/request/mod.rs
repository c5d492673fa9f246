//! Request bodies → typed requests: the API, the model, the prompt and the few parameters routing reads,
//! borrowed from the body buffer; and the pool that serves the model.
//!
//! [`parse`] checks in this order, each before any work on the next:
//! 1. **Size**: a body over `max_body_bytes` is [`BodyError::TooLarge`], unread.
//! 2. **UTF-8**: the whole body, up front ([`BodyError::NotUtf8`] with the offset). serde_json checks
//!    only the strings it decodes, reports a bad one as a syntax error, and never checks the strings it
//!    skips; validating once and parsing the `&str` costs the same, since serde_json then skips its own
//!    per-string check.
//! 3. **One pass of serde_json** (`body`): only the members below are read, their strings borrowed from
//!    the buffer (`Cow::Borrowed`; a string with escapes is decoded into `Cow::Owned`); everything else is
//!    skipped. A member given twice keeps its last value, as the engines' JSON parsers do; `null` counts
//!    as absent. Arrays and objects nest at most 64 deep anywhere in the body, skipped members included
//!    ([`BodyError::TooDeep`], never a stack overflow; see `body`).
//! 4. **The prompt** of the API, which must not be empty ([`BodyError::EmptyPrompt`]).
//!
//! The API comes from the path's suffix, query string ignored, so gateway prefixes still match; any other
//! path is read by the body's shape, first match wins: `messages` → chat, `prompt` → completions, `text`
//! or `input_ids` → SGLang's `/generate`. A known path reads only its own prompt members.
//!
//! What each API contributes:
//! - **Chat** (`messages`, `tools`): each message's `role` (required) and `content` as text parts in
//!   order. A string is one part, `null` none; in a list, a text part is its `text` and any other part
//!   (`image_url`, `input_audio`, …) the placeholder `<{type}:{16 hex digits}>`, a hash of its JSON, so
//!   the same image keeps the prefix going and another image ends it there. An assistant's `tool_calls`
//!   follow as one more part, their JSON text verbatim. Other message members (`name`, `tool_call_id`)
//!   are not part of the prompt. `tools` is kept as raw JSON (a list) for the chat template.
//! - **Completions** (`prompt`): a string, a list of strings, token ids, or a list of token-id lists.
//! - **Generate** (`text` or `input_ids`, each alone or as a batch); with both, `input_ids` wins, being
//!   the exact tokens (SGLang refuses such a request anyway).
//!
//! A batch is routed by its first prompt: the whole request goes to one worker, the first prompt's
//! prefix is the one that can be matched there, and batched prompts usually share their prefix (one
//! few-shot template, many questions). The other prompts are skipped unread; the engine validates them.
//!
//! `cache_salt` is vLLM's, as given. The requested output (`max_tokens`, `max_completion_tokens`,
//! `sampling_params.max_new_tokens`) is read leniently, never refused: a count the picker cannot read is
//! none, since a body the engine accepts (`"max_tokens": 100.0`, `"stream": "true"`) must not be refused
//! by the picker in front of it; it only tells the picker that the engine will refuse a request whose
//! prompt and output exceed the model's context, so that it is not learned. Nothing else is read.
// What a request is must not depend on when it is read: no clock reads here (clippy.toml).
#![deny(clippy::disallowed_methods)]

mod body;
pub mod charset;
pub mod encoding;
mod error;

#[cfg(test)]
mod tests;

use std::borrow::Cow;

use serde_json::value::RawValue;

use crate::config::{ModelMatch, PoolConfig};

pub use error::BodyError;

/// Which inference API a request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI `/v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `/v1/completions`.
    Completions,
    /// SGLang's native `/generate`.
    Generate,
}

impl Api {
    const ALL: [Api; 3] = [Api::ChatCompletions, Api::Completions, Api::Generate];

    /// The path the API is served at; a request path ending with it speaks this API.
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
        }
    }

    /// The API a request path names, by suffix and without its query string; `None` for any other path.
    pub fn of_path(path: &str) -> Option<Api> {
        ApiPath::new(path).api
    }
}

/// A request path without its query string, and the API it names: what routing reads of the path,
/// computed once per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiPath<'a> {
    /// The path up to its `?`.
    pub path: &'a str,
    pub api: Option<Api>,
}

impl<'a> ApiPath<'a> {
    /// The API comes from the path's suffix; the query string does not change it.
    pub fn new(path: &'a str) -> Self {
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        ApiPath {
            path,
            api: Api::ALL.into_iter().find(|api| path.ends_with(api.path())),
        }
    }
}

/// What routing needs from a request body, borrowing from the body buffer.
#[derive(Clone, Debug)]
pub struct ParsedRequest<'a> {
    pub api: Api,
    pub model: Option<Cow<'a, str>>,
    /// Never empty.
    pub prompt: Prompt<'a>,
    /// vLLM's `cache_salt`: requests with different salts share no cached prefix.
    pub cache_salt: Option<Cow<'a, str>>,
    /// The output the request asks for (`max_tokens`, `max_completion_tokens`, SGLang's
    /// `sampling_params.max_new_tokens`; the largest), read leniently: `None` when absent or not a
    /// non-negative number. Routing reads it only to know the engine will refuse the request.
    pub max_output_tokens: Option<u64>,
}

/// The prompt, as the API gave it.
#[derive(Clone, Debug)]
pub enum Prompt<'a> {
    /// At least one message has a non-empty part.
    Chat {
        messages: Vec<Message<'a>>,
        /// The `tools` list as written, for the chat template.
        tools: Option<&'a RawValue>,
    },
    /// Non-empty.
    Text(Cow<'a, str>),
    /// Non-empty.
    Tokens(Vec<u32>),
}

/// One chat message: its role and its content as text parts in order (see the module documentation for
/// non-text parts and tool calls).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    pub role: Cow<'a, str>,
    pub content: Vec<Cow<'a, str>>,
}

/// The `model` of a JSON body that is not a generation request, looked for leniently: for a body that
/// [`read`] refuses (a `/v1/embeddings` body that is not UTF-8 or nests too deep, say), so a request
/// routed by load alone still reaches its model's pool. A body that reads gives its model through
/// [`ReadBody::model`] instead. Anything unreadable here is `None`.
pub fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    serde_json::from_slice::<ModelOnly>(body)
        .ok()
        .and_then(|only| only.model)
}

/// Reads the request at `path` from `body`, refusing a body over `max_body_bytes` unread: [`read`], then
/// [`ReadBody::into_request`].
pub fn parse<'a>(
    path: &str,
    body: &'a [u8],
    max_body_bytes: usize,
) -> Result<ParsedRequest<'a>, BodyError> {
    read(Api::of_path(path), body, max_body_bytes)?.into_request()
}

/// A body read in its one pass, before the API decides which members make the prompt.
pub struct ReadBody<'a> {
    /// The API the path names; `None` picks it by the body's shape.
    api: Option<Api>,
    draft: body::Draft<'a>,
}

/// The first half of [`parse`]: size, UTF-8 and the one pass of serde_json, for the API of the request's
/// path (`None` for a path that names none: every prompt member is read).
pub fn read(
    api: Option<Api>,
    body: &[u8],
    max_body_bytes: usize,
) -> Result<ReadBody<'_>, BodyError> {
    if body.len() > max_body_bytes {
        return Err(BodyError::TooLarge {
            size: body.len(),
            limit: max_body_bytes,
        });
    }
    let text = std::str::from_utf8(body).map_err(|error| BodyError::NotUtf8 {
        offset: error.valid_up_to(),
    })?;
    let draft = body::read(text, api)?;
    Ok(ReadBody { api, draft })
}

impl<'a> ReadBody<'a> {
    /// The body's `model`, whether or not it holds a usable prompt: enough to pick the pool of a request
    /// routed by load alone.
    pub fn model(&self) -> Option<Cow<'a, str>> {
        self.draft.model.clone()
    }

    /// The second half of [`parse`]: the API (by shape, for a path that names none) and its prompt,
    /// which must not be empty.
    pub fn into_request(self) -> Result<ParsedRequest<'a>, BodyError> {
        let ReadBody { api, draft } = self;
        let api = match api {
            Some(api) => api,
            None => shape(&draft).ok_or_else(|| {
                BodyError::MissingField(
                    "the body holds no prompt: expected `messages`, `prompt`, `text` or `input_ids`"
                        .to_owned(),
                )
            })?,
        };
        let required =
            |what: &str| BodyError::MissingField(format!("{what} is required for {}", api.path()));
        let prompt = match api {
            Api::ChatCompletions => {
                let messages = draft.messages.ok_or_else(|| required("`messages`"))?;
                let has_text = messages
                    .iter()
                    .any(|message| message.content.iter().any(|part| !part.is_empty()));
                if !has_text {
                    return Err(BodyError::EmptyPrompt { field: "messages" });
                }
                Prompt::Chat {
                    messages,
                    tools: draft.tools,
                }
            }
            Api::Completions => {
                non_empty(draft.prompt.ok_or_else(|| required("`prompt`"))?, "prompt")?
            }
            Api::Generate => match (draft.input_ids, draft.text) {
                (Some(ids), _) => non_empty(ids, "input_ids")?,
                (None, Some(text)) => non_empty(text, "text")?,
                (None, None) => return Err(required("`text` or `input_ids`")),
            },
        };
        Ok(ParsedRequest {
            api,
            model: draft.model,
            prompt,
            cache_salt: draft.cache_salt,
            max_output_tokens: draft.max_output_tokens,
        })
    }
}

/// The API a body's members suggest, for a path that names none.
fn shape(draft: &body::Draft<'_>) -> Option<Api> {
    if draft.messages.is_some() {
        Some(Api::ChatCompletions)
    } else if draft.prompt.is_some() {
        Some(Api::Completions)
    } else if draft.text.is_some() || draft.input_ids.is_some() {
        Some(Api::Generate)
    } else {
        None
    }
}

fn non_empty<'a>(prompt: Prompt<'a>, field: &'static str) -> Result<Prompt<'a>, BodyError> {
    let empty = match &prompt {
        Prompt::Text(text) => text.is_empty(),
        Prompt::Tokens(tokens) => tokens.is_empty(),
        Prompt::Chat { .. } => false,
    };
    if empty {
        Err(BodyError::EmptyPrompt { field })
    } else {
        Ok(prompt)
    }
}

/// The pool serving `model` and its index: the pool naming it exactly, else the default pool (`*`).
pub fn select_pool<'c, P>(
    pools: P,
    model: Option<&str>,
) -> Result<(usize, &'c PoolConfig), BodyError>
where
    P: IntoIterator<Item = &'c PoolConfig>,
    P::IntoIter: Clone,
{
    let named = |pool: &&PoolConfig| match (&pool.model, model) {
        (ModelMatch::Exact(name), Some(model)) => name == model,
        _ => false,
    };
    let mut pools = pools.into_iter().enumerate();
    let found = pools
        .clone()
        .find(|(_, pool)| named(pool))
        .or_else(|| pools.find(|(_, pool)| pool.model == ModelMatch::Any));
    found.ok_or_else(|| match model {
        None => BodyError::MissingModel,
        Some(model) => BodyError::unknown_model(model),
    })
}

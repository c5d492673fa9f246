//! Reading a request body: the members each API acts on, every problem a [`WireError`] naming the
//! member at fault.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use super::{Api, Bootstrap, KvTransfer, MAX_TOOLS_DEPTH, Message, Prompt, SimRequest, WireError};

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
    let kv_transfer = match (api, members.get("kv_transfer_params")) {
        (Api::Chat | Api::Completion, Some(raw)) => kv_transfer(raw)?,
        _ => None,
    };
    let bootstrap = bootstrap(&members)?;
    Ok(SimRequest {
        api,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        kv_transfer,
        bootstrap,
    })
}

/// SGLang's three rendezvous fields: a room needs the prefill worker's host and bootstrap port, as
/// SGLang's decode worker does to find it. Batched (list) forms are not simulated.
fn bootstrap(members: &Members<'_>) -> Result<Option<Bootstrap>, WireError> {
    let value = |key: &str| -> Option<Value> {
        members
            .get(key)
            .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
    };
    let Some(room) = value("bootstrap_room") else {
        return Ok(None);
    };
    let room = room.as_u64().ok_or(WireError::Invalid {
        field: "bootstrap_room".to_owned(),
        expected: "a non-negative integer",
    })?;
    let host = value("bootstrap_host")
        .and_then(|host| host.as_str().map(str::to_owned))
        .ok_or(WireError::BootstrapField("bootstrap_host"))?;
    let port = value("bootstrap_port")
        .and_then(|port| port.as_u64())
        .and_then(|port| u16::try_from(port).ok())
        .ok_or(WireError::BootstrapField("bootstrap_port"))?;
    Ok(Some(Bootstrap { host, port, room }))
}

/// `kv_transfer_params`: an object; `do_remote_prefill` needs the prefill worker's engine, request,
/// host and port, as vLLM's connector does. Anything else is an aggregated request.
fn kv_transfer(raw: &RawValue) -> Result<Option<KvTransfer>, WireError> {
    let invalid = || WireError::Invalid {
        field: "kv_transfer_params".to_owned(),
        expected: "an object",
    };
    let value: Value = serde_json::from_str(raw.get()).map_err(|_| invalid())?;
    let Some(params) = value.as_object() else {
        return if value.is_null() {
            Ok(None)
        } else {
            Err(invalid())
        };
    };
    let flag = |key: &str| params.get(key).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_prefill") {
        let text = |key: &'static str| {
            params
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or(WireError::KvTransferField(key))
        };
        let port = params
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|port| u16::try_from(port).ok())
            .ok_or(WireError::KvTransferField("remote_port"))?;
        return Ok(Some(KvTransfer::RemotePrefill {
            engine_id: text("remote_engine_id")?,
            request_id: text("remote_request_id")?,
            host: text("remote_host")?,
            port,
        }));
    }
    Ok(flag("do_remote_decode").then_some(KvTransfer::RemoteDecode))
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

/// `tools` as raw JSON text: an array nested no deeper than [`MAX_TOOLS_DEPTH`], measured on the
/// parsed value, as an engine measures what its `json.loads` returned.
fn tools(raw: &RawValue) -> Result<String, WireError> {
    if kind(raw) != Some(b'[') {
        return Err(invalid("tools", "an array of tool objects"));
    }
    let too_deep = WireError::TooDeep { field: "tools" };
    // The text is valid JSON already, so the one way parsing it again fails is serde_json's own
    // nesting limit, which is deeper than ours.
    let value: Value = serde_json::from_str(raw.get()).map_err(|_| too_deep.clone())?;
    if depth(&value) > MAX_TOOLS_DEPTH {
        return Err(too_deep);
    }
    Ok(raw.get().to_owned())
}

/// How many arrays and objects `value` nests, 0 for a scalar. serde_json's nesting limit bounds the
/// recursion.
fn depth(value: &Value) -> usize {
    let deepest_child = match value {
        Value::Array(items) => items.iter().map(depth).max(),
        Value::Object(members) => members.values().map(depth).max(),
        _ => return 0,
    };
    deepest_child.unwrap_or(0).saturating_add(1)
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

//! Chat templates: loading one from a Jinja file or a Hugging Face `tokenizer_config.json`, rendering
//! it the way transformers does, and finding the message contents in what it rendered.

use std::io;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};

use cachepick_decode::file::read_regular_to_string;

use crate::{ChatTurn, TokenizeError};

/// The largest chat template or `tokenizer_config.json` read: those with every added token listed
/// hold a few MB.
pub const TEMPLATE_FILE_LIMIT: u64 = 32 << 20;

/// The template rendered when the request has no tools, or the config names no tool-use template.
const DEFAULT: &str = "default";
/// Hugging Face's name for the template to render when the request carries tools.
const TOOL_USE: &str = "tool_use";
/// The special tokens transformers hands every chat template, read from `tokenizer_config.json`.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];
/// Where a Jinja template file finds its special tokens: the tokenizer config beside it, as in a
/// Hugging Face model directory (`chat_template.jinja` next to `tokenizer_config.json`).
const SIBLING_CONFIG: &str = "tokenizer_config.json";

/// Private-use code points around a message's index stand in for its content while rendering, so
/// the contents can be found in the output without rendering them. No tokenizer or client gives them
/// meaning; if one turns up in a role or in the tools anyway, the split fails and the chat is rendered
/// whole instead.
const SENTINEL_OPEN: char = '\u{F8F0}';
const SENTINEL_CLOSE: char = '\u{F8F1}';

pub(super) struct ChatTemplate {
    path: PathBuf,
    /// Holds `default` and, when the config names one, `tool_use`.
    env: Environment<'static>,
    has_tool_use: bool,
    /// `(name, token)` for each special token the config defines.
    special_tokens: Vec<(&'static str, String)>,
}

impl ChatTemplate {
    /// Loads a Hugging Face `tokenizer_config.json` (any file holding a JSON object) or, failing that,
    /// a Jinja template file.
    pub(super) fn load(path: &Path) -> Result<ChatTemplate, TokenizeError> {
        let text = read(path)?;
        match serde_json::from_str::<Map<String, Json>>(&text) {
            Ok(config) => {
                let templates = named_templates(path, &config)?;
                ChatTemplate::compile(path, templates, special_tokens(&config))
            }
            Err(err) if path.extension().is_some_and(|ext| ext == "json") => {
                Err(TokenizeError::TemplateConfig {
                    path: path.to_path_buf(),
                    reason: format!("not valid JSON: {err}"),
                })
            }
            Err(_) => {
                let sibling = path.with_file_name(SIBLING_CONFIG);
                let special = match read_regular_to_string(&sibling, TEMPLATE_FILE_LIMIT) {
                    Ok(config) => special_tokens(&config_object(&sibling, &config)?),
                    Err(err) if err.kind() == io::ErrorKind::NotFound => Vec::new(),
                    Err(source) => {
                        return Err(TokenizeError::Read {
                            path: sibling,
                            source,
                        });
                    }
                };
                ChatTemplate::compile(path, vec![(DEFAULT.to_owned(), text)], special)
            }
        }
    }

    fn compile(
        path: &Path,
        templates: Vec<(String, String)>,
        special_tokens: Vec<(&'static str, String)>,
    ) -> Result<ChatTemplate, TokenizeError> {
        let invalid = |source| TokenizeError::Template {
            path: path.to_path_buf(),
            source,
        };
        let mut env = Environment::new();
        // transformers compiles chat templates with these two on, and templates are written for them.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(invalid)?;
        env.set_syntax(syntax);
        // Python string, list and dict methods (`.strip()`, `.items()`, ...), which templates call freely.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        let has_tool_use = templates.iter().any(|(name, _)| name == TOOL_USE);
        for (name, source) in templates {
            env.add_template_owned(name, source).map_err(invalid)?;
        }
        Ok(ChatTemplate {
            path: path.to_path_buf(),
            env,
            has_tool_use,
            special_tokens,
        })
    }

    /// Renders the chat with each message's content replaced by a sentinel: the template's own text,
    /// with a marker where each content goes; [`split_skeleton`] takes it apart.
    pub(super) fn render_skeleton(
        &self,
        turns: &[ChatTurn<'_>],
        tools: &Value,
    ) -> Result<String, TokenizeError> {
        self.render(turns, tools, |index, _| {
            format!("{SENTINEL_OPEN}{index}{SENTINEL_CLOSE}")
        })
    }

    /// Renders the chat with its real contents: what the engine renders.
    pub(super) fn render_whole(
        &self,
        turns: &[ChatTurn<'_>],
        tools: &Value,
    ) -> Result<String, TokenizeError> {
        self.render(turns, tools, |_, turn| turn.parts.join("\n"))
    }

    /// Renders the chat with `content(index, turn)` as each message's content.
    fn render(
        &self,
        turns: &[ChatTurn<'_>],
        tools: &Value,
        content: impl Fn(usize, &ChatTurn<'_>) -> String,
    ) -> Result<String, TokenizeError> {
        let messages: Vec<Value> = turns
            .iter()
            .enumerate()
            .map(|(index, turn)| message(turn.role, content(index, turn)))
            .collect();
        let failed = |source| TokenizeError::Render {
            path: self.path.clone(),
            source,
        };
        let name = if self.has_tool_use && !tools.is_none() {
            TOOL_USE
        } else {
            DEFAULT
        };
        let context = Value::from_pairs(
            [
                ("messages", Value::from(messages)),
                ("tools", tools.clone()),
                ("add_generation_prompt", Value::from(true)),
            ]
            .into_iter()
            .chain(
                self.special_tokens
                    .iter()
                    .map(|(name, token)| (*name, Value::from(token.as_str()))),
            ),
        );
        self.env
            .get_template(name)
            .and_then(|template| template.render(context))
            .map_err(failed)
    }
}

/// The request's `tools` as the template sees them: parsed JSON, or none.
pub(super) fn tools_value(tools: Option<&str>) -> Result<Value, TokenizeError> {
    match tools {
        Some(raw) => serde_json::from_str::<Json>(raw)
            .map(|json| Value::from(Serde(json)))
            .map_err(TokenizeError::Tools),
        None => Ok(Value::from(())),
    }
}

/// Splits a skeleton rendered by [`ChatTemplate::render_skeleton`] into segments, each a list of
/// pieces to be joined: template text between sentinels is one piece; a message's content is its
/// parts with `"\n"` between them (vLLM joins text parts so). Empty template text is left out.
/// `None` when the sentinels do not come back exactly once each and in order (a template that drops,
/// repeats or reorders messages); the caller then renders the chat whole.
pub(super) fn split_skeleton<'s>(
    skeleton: &'s str,
    turns: &'s [ChatTurn<'s>],
) -> Option<Vec<Vec<&'s str>>> {
    let mut segments = Vec::with_capacity(turns.len() * 2 + 1);
    let mut rest = skeleton;
    for (index, turn) in turns.iter().enumerate() {
        let (literal, after) = rest.split_once(SENTINEL_OPEN)?;
        let (found, tail) = after.split_once(SENTINEL_CLOSE)?;
        if literal.contains(SENTINEL_CLOSE) || found.parse::<usize>().ok()? != index {
            return None;
        }
        if !literal.is_empty() {
            segments.push(vec![literal]);
        }
        segments.push(joined_parts(turn));
        rest = tail;
    }
    if rest.contains([SENTINEL_OPEN, SENTINEL_CLOSE]) {
        return None;
    }
    if !rest.is_empty() {
        segments.push(vec![rest]);
    }
    Some(segments)
}

/// A turn's text parts with `"\n"` between them, as pieces of one segment.
pub(super) fn joined_parts<'s>(turn: &ChatTurn<'s>) -> Vec<&'s str> {
    let mut pieces = Vec::with_capacity(turn.parts.len() * 2);
    for (index, part) in turn.parts.iter().enumerate() {
        if index > 0 {
            pieces.push("\n");
        }
        pieces.push(part.as_ref());
    }
    pieces
}

fn message(role: &str, content: String) -> Value {
    Value::from_pairs([
        ("role", Value::from(role)),
        ("content", Value::from(content)),
    ])
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn read(path: &Path) -> Result<String, TokenizeError> {
    read_regular_to_string(path, TEMPLATE_FILE_LIMIT).map_err(|source| TokenizeError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn config_object(path: &Path, text: &str) -> Result<Map<String, Json>, TokenizeError> {
    serde_json::from_str(text).map_err(|err| TokenizeError::TemplateConfig {
        path: path.to_path_buf(),
        reason: format!("not a valid tokenizer config: {err}"),
    })
}

/// The config's `chat_template`: one template, or Hugging Face's list of `{name, template}`.
fn named_templates(
    path: &Path,
    config: &Map<String, Json>,
) -> Result<Vec<(String, String)>, TokenizeError> {
    let malformed = |reason: &str| TokenizeError::TemplateConfig {
        path: path.to_path_buf(),
        reason: reason.to_owned(),
    };
    match config.get("chat_template") {
        Some(Json::String(source)) => Ok(vec![(DEFAULT.to_owned(), source.clone())]),
        Some(Json::Array(entries)) => {
            let templates = entries
                .iter()
                .map(|entry| match (entry.get("name"), entry.get("template")) {
                    (Some(Json::String(name)), Some(Json::String(source))) => {
                        Ok((name.clone(), source.clone()))
                    }
                    _ => Err(malformed(
                        "each chat_template entry needs a string `name` and `template`",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if templates.iter().any(|(name, _)| name == DEFAULT) {
                Ok(templates)
            } else {
                Err(malformed("chat_template names no `default` template"))
            }
        }
        Some(_) => Err(malformed(
            "chat_template must be a string or a list of {name, template}",
        )),
        None => Err(malformed(
            "has no chat_template (point chat_template at the model's chat_template.jinja instead)",
        )),
    }
}

/// Special tokens are strings or `{"content": ...}` objects (an `AddedToken`); others are ignored.
fn special_tokens(config: &Map<String, Json>) -> Vec<(&'static str, String)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|name| {
            let token = match config.get(*name)? {
                Json::String(token) => token.as_str(),
                Json::Object(added) => added.get("content")?.as_str()?,
                _ => return None,
            };
            Some((*name, token.to_owned()))
        })
        .collect()
}

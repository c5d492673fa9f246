//! The one pass of serde_json over a body: hand-written visitors that read the members routing needs,
//! borrow their strings from the body, skip everything else within the depth bound, and name the member
//! at fault when something is wrong.
//!
//! Every visitor reads through `deserialize_any` and answers every JSON type itself — the ones it does
//! not accept through `visitor_common!` — so a wrong type is reported with the member's path and the
//! expected type rather than serde's generic "invalid type" text. serde_json's errors carry only text, so
//! a visitor that fails records the typed [`BodyError`] in [`Faults`] first, and [`read`] returns that.
//!
//! Depth: serde_json bounds the values it deserializes (128 levels), but skips `IgnoredAny` and reads
//! `RawValue` iteratively with no bound at all. That never overflows the stack, but it would accept a
//! 100,000-deep `tools` and hand it on to the template renderer. So skipped members go through [`Skip`],
//! which counts levels, and raw members are scanned once; both enforce [`MAX_DEPTH`], counted from the
//! body's root. The bound sits below serde_json's own, so it is always this one that fires.
//!
//! This module holds the pass, the machinery every visitor shares and the body's own and scalar members;
//! the chat API's `messages` are [`chat`]'s, the prompt members of the other APIs [`prompt`]'s.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{Api, BodyError, Message, Prompt};
use chat::Messages;
use prompt::{Accepts, PromptVisitor};

/// Arrays and objects nest at most this deep, counted from the body's root, in every member alike:
/// read, skipped or kept raw. JSON schemas in `tools` nest about a dozen levels; nothing legitimate comes
/// near this. A skipped level costs about 2 KiB of stack in a debug build (serde_json's `deserialize_any`
/// and [`Skip`]), so the deepest body stays under 128 KiB of stack, far within any thread's.
pub(super) const MAX_DEPTH: usize = 64;

/// The members read from a body, before the API decides which of them make the prompt. A member given
/// twice keeps its last value, as the engines' JSON parsers do; `null` counts as absent.
#[derive(Default)]
pub(super) struct Draft<'a> {
    pub(super) model: Option<Cow<'a, str>>,
    pub(super) cache_salt: Option<Cow<'a, str>>,
    pub(super) messages: Option<Vec<Message<'a>>>,
    pub(super) tools: Option<&'a RawValue>,
    /// `/v1/completions`' `prompt`: text or tokens.
    pub(super) prompt: Option<Prompt<'a>>,
    /// SGLang's `text`, as [`Prompt::Text`].
    pub(super) text: Option<Prompt<'a>>,
    /// SGLang's `input_ids`, as [`Prompt::Tokens`].
    pub(super) input_ids: Option<Prompt<'a>>,
    /// The output the request asks for: `max_tokens`, `max_completion_tokens` (chat, which wins), or
    /// SGLang's `sampling_params.max_new_tokens` (see [`output`]).
    pub(super) max_output_tokens: Option<u64>,
}

/// Reads `body` in one pass. With an `api`, the prompt members of the other APIs are skipped unread;
/// without one, every prompt member is read and the caller picks by shape.
pub(super) fn read(body: &str, api: Option<Api>) -> Result<Draft<'_>, BodyError> {
    let faults = Faults::default();
    let faults = &faults;
    let mut json = serde_json::Deserializer::from_str(body);
    let draft = Any(BodyVisitor { api, faults })
        .deserialize(&mut json)
        .and_then(|draft| json.end().map(|()| draft));
    // Without a recorded fault the error is serde_json's own: syntax or an early end.
    draft.map_err(|error| faults.take().unwrap_or(BodyError::InvalidJson(error)))
}

/// The typed error behind a failed pass.
#[derive(Default)]
struct Faults(Cell<Option<BodyError>>);

impl Faults {
    /// Records `error` and returns the serde error that aborts the pass.
    fn fail<E: de::Error>(&self, error: BodyError) -> E {
        let abort = E::custom(&error);
        self.0.set(Some(error));
        abort
    }

    fn take(&self) -> Option<BodyError> {
        self.0.take()
    }
}

/// Where a value sits in the body; formatted only for an error.
#[derive(Clone, Copy)]
enum At {
    Body,
    /// `name`
    Member(&'static str),
    /// `name[i]`
    Item(&'static str, usize),
    /// `name[i][j]`
    ItemOf(&'static str, usize, usize),
    /// `messages[i].name`
    MessageMember(usize, &'static str),
    /// `messages[i].content[j]`
    Part(usize, usize),
    /// `messages[i].content[j].name`
    PartMember(usize, usize, &'static str),
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            At::Body => f.write_str("the request body"),
            At::Member(name) => write!(f, "`{name}`"),
            At::Item(name, i) => write!(f, "`{name}[{i}]`"),
            At::ItemOf(name, i, j) => write!(f, "`{name}[{i}][{j}]`"),
            At::MessageMember(i, name) => write!(f, "`messages[{i}].{name}`"),
            At::Part(i, j) => write!(f, "`messages[{i}].content[{j}]`"),
            At::PartMember(i, j, name) => write!(f, "`messages[{i}].content[{j}].{name}`"),
        }
    }
}

fn missing(at: At) -> BodyError {
    BodyError::MissingField(format!("{at} is required"))
}

/// What a visitor reads and where, for its messages.
trait Expect {
    fn at(&self) -> At;
    fn expected(&self) -> &'static str;
    fn faults(&self) -> &Faults;

    fn wrong<E: de::Error>(&self, got: &'static str) -> E {
        self.faults().fail(BodyError::WrongType {
            field: self.at().to_string(),
            expected: self.expected(),
            got,
        })
    }
}

/// `expect!(Visitor; |v| at, expected)`: the [`Expect`] of a visitor that holds its `faults`, with `at`
/// read from the visitor `v`; `expected` is a string, or `|v| expected` where the visitor decides it.
macro_rules! expect {
    ($visitor:ident; |$v:tt| $at:expr, |$w:tt| $expected:expr) => {
        impl Expect for $visitor<'_> {
            fn at(&self) -> At {
                let $v: &Self = self;
                $at
            }
            fn expected(&self) -> &'static str {
                let $w: &Self = self;
                $expected
            }
            fn faults(&self) -> &Faults {
                self.faults
            }
        }
    };
    ($visitor:ident; |$v:tt| $at:expr, $expected:expr) => {
        expect!($visitor; |$v| $at, |_| $expected);
    };
}

/// `expecting` from [`Expect`], and a `WrongType` for each JSON type listed: the ones the visitor does
/// not accept. `$de` is the visitor's lifetime.
macro_rules! visitor_common {
    ($de:lifetime; $($kind:ident),*) => {
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.expected())
        }
        $(visitor_common!(@reject $de; $kind);)*
    };
    (@reject $de:lifetime; bool) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err(self.wrong("a boolean"))
        }
    };
    (@reject $de:lifetime; number) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err(self.wrong("a number"))
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err(self.wrong("a number"))
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err(self.wrong("a number"))
        }
    };
    (@reject $de:lifetime; string) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(self.wrong("a string"))
        }
    };
    (@reject $de:lifetime; null) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Err(self.wrong("null"))
        }
    };
    (@reject $de:lifetime; list) => {
        fn visit_seq<A: SeqAccess<$de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(self.wrong("a list"))
        }
    };
    (@reject $de:lifetime; object) => {
        fn visit_map<A: MapAccess<$de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(self.wrong("an object"))
        }
    };
}

// Declared after the macros, which are in scope only below their definition.
mod chat;
mod output;
mod prompt;

/// Reads a value with a visitor through `deserialize_any`, so the visitor sees whatever type is there.
struct Any<V>(V);

impl<'a, V: Visitor<'a>> DeserializeSeed<'a> for Any<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'a>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        deserializer.deserialize_any(self.0)
    }
}

/// An object key, borrowed unless it has escapes.
struct Key;

impl<'a> DeserializeSeed<'a> for Key {
    type Value = Cow<'a, str>;

    fn deserialize<D: Deserializer<'a>>(self, deserializer: D) -> Result<Cow<'a, str>, D::Error> {
        // JSON keys are always strings.
        deserializer.deserialize_str(self)
    }
}

impl<'a> Visitor<'a> for Key {
    type Value = Cow<'a, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'a str) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Borrowed(key))
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Owned(key.to_owned()))
    }
}

/// Any value, read only to find its end; arrays and objects count towards [`MAX_DEPTH`].
#[derive(Clone, Copy)]
struct Skip<'f> {
    /// Arrays and objects around the value.
    enclosing: usize,
    faults: &'f Faults,
}

impl<'f> Skip<'f> {
    /// The skip of a value inside this one, which is a container: fails if it nests too deep.
    fn inner<E: de::Error>(&self) -> Result<Skip<'f>, E> {
        let level = self.enclosing + 1;
        if level > MAX_DEPTH {
            return Err(self.faults.fail(BodyError::TooDeep { limit: MAX_DEPTH }));
        }
        Ok(Skip {
            enclosing: level,
            faults: self.faults,
        })
    }
}

impl<'a> Visitor<'a> for Skip<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut seq: A) -> Result<(), A::Error> {
        let inner = self.inner()?;
        while seq.next_element_seed(Any(inner))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'a>>(self, mut map: A) -> Result<(), A::Error> {
        let inner = self.inner()?;
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(Any(inner))?;
        }
        Ok(())
    }
}

/// A member kept as its raw JSON text, whose own nesting is bounded like everything else's.
fn raw<'a, A: MapAccess<'a>>(
    map: &mut A,
    enclosing: usize,
    faults: &Faults,
) -> Result<&'a RawValue, A::Error> {
    let raw: &'a RawValue = map.next_value()?;
    if nests_deeper(raw.get(), MAX_DEPTH.saturating_sub(enclosing)) {
        return Err(faults.fail(BodyError::TooDeep { limit: MAX_DEPTH }));
    }
    Ok(raw)
}

/// A raw member that must be a list (or null, which is absent).
fn raw_list<'a, A: MapAccess<'a>>(
    map: &mut A,
    enclosing: usize,
    at: At,
    expected: &'static str,
    faults: &Faults,
) -> Result<Option<&'a RawValue>, A::Error> {
    let value = raw(map, enclosing, faults)?;
    // serde_json's raw text starts at the value itself, after any whitespace.
    let got = match value.get().as_bytes().first() {
        Some(b'[') => return Ok(Some(value)),
        Some(b'n') => return Ok(None),
        Some(b'{') => "an object",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        _ => "a number",
    };
    Err(faults.fail(BodyError::WrongType {
        field: at.to_string(),
        expected,
        got,
    }))
}

/// Whether valid JSON `text` nests arrays and objects more than `limit` deep.
fn nests_deeper(text: &str, limit: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for byte in text.bytes() {
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
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// The body: an object whose known members are read and the rest skipped.
struct BodyVisitor<'f> {
    /// `None` reads the prompt members of every API.
    api: Option<Api>,
    faults: &'f Faults,
}

expect!(BodyVisitor; |_| At::Body, "a JSON object");

impl<'a> Visitor<'a> for BodyVisitor<'_> {
    type Value = Draft<'a>;

    visitor_common!('a; bool, number, string, null, list);

    fn visit_map<A: MapAccess<'a>>(self, mut map: A) -> Result<Draft<'a>, A::Error> {
        let faults = self.faults;
        let reads = |api: Api| self.api.is_none_or(|wanted| wanted == api);
        let text = |name| Any(Text::new(At::Member(name), faults));
        let mut draft = Draft::default();
        while let Some(key) = map.next_key_seed(Key)? {
            match &*key {
                "model" => draft.model = map.next_value_seed(text("model"))?,
                "cache_salt" => draft.cache_salt = map.next_value_seed(text("cache_salt"))?,
                "messages" if reads(Api::ChatCompletions) => {
                    draft.messages = map.next_value_seed(Any(Messages { faults }))?;
                }
                "tools" if reads(Api::ChatCompletions) => {
                    let at = At::Member("tools");
                    draft.tools = raw_list(&mut map, 1, at, "a list of tools", faults)?;
                }
                "prompt" if reads(Api::Completions) => {
                    let prompt = PromptVisitor::new("prompt", Accepts::TextOrTokens, faults);
                    draft.prompt = map.next_value_seed(Any(prompt))?;
                }
                "text" if reads(Api::Generate) => {
                    let text = PromptVisitor::new("text", Accepts::Text, faults);
                    draft.text = map.next_value_seed(Any(text))?;
                }
                "input_ids" if reads(Api::Generate) => {
                    let ids = PromptVisitor::new("input_ids", Accepts::Tokens, faults);
                    draft.input_ids = map.next_value_seed(Any(ids))?;
                }
                "max_tokens" => {
                    let asked = map.next_value_seed(Any(output::Count {
                        faults,
                        member: None,
                    }))?;
                    draft.max_output_tokens = draft.max_output_tokens.max(asked);
                }
                "max_completion_tokens" => {
                    let asked = map.next_value_seed(Any(output::Count {
                        faults,
                        member: None,
                    }))?;
                    draft.max_output_tokens = draft.max_output_tokens.max(asked);
                }
                "sampling_params" if reads(Api::Generate) => {
                    let asked = map.next_value_seed(Any(output::Count {
                        faults,
                        member: Some("max_new_tokens"),
                    }))?;
                    draft.max_output_tokens = draft.max_output_tokens.max(asked);
                }
                _ => map.next_value_seed(Any(Skip {
                    enclosing: 1,
                    faults,
                }))?,
            }
        }
        Ok(draft)
    }
}

/// A string member, borrowed unless it has escapes; `null` is absent.
struct Text<'f> {
    at: At,
    faults: &'f Faults,
}

impl<'f> Text<'f> {
    fn new(at: At, faults: &'f Faults) -> Self {
        Text { at, faults }
    }
}

expect!(Text; |v| v.at, "a string");

impl<'a> Visitor<'a> for Text<'_> {
    type Value = Option<Cow<'a, str>>;

    visitor_common!('a; bool, number, list, object);

    fn visit_borrowed_str<E: de::Error>(self, text: &'a str) -> Result<Self::Value, E> {
        Ok(Some(Cow::Borrowed(text)))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(Some(Cow::Owned(text.to_owned())))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

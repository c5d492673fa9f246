//! The chat API's `messages`: each message's `role` and `content`, a content part's text or the
//! placeholder of its non-text payload, and an assistant's `tool_calls` kept raw.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Any, At, Expect, Faults, Key, Skip, Text, missing, raw, raw_list};
use crate::request::Message;

/// `messages`: a list of message objects; `null` is absent.
pub(super) struct Messages<'f> {
    pub(super) faults: &'f Faults,
}

expect!(Messages; |_| At::Member("messages"), "a list of messages");

impl<'a> Visitor<'a> for Messages<'_> {
    type Value = Option<Vec<Message<'a>>>;

    visitor_common!('a; bool, number, string, object);

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut messages = Vec::new();
        let faults = self.faults;
        while let Some(message) = seq.next_element_seed(Any(MessageVisitor {
            index: messages.len(),
            faults,
        }))? {
            messages.push(message);
        }
        Ok(Some(messages))
    }
}

/// One message: `role`, `content` and, for an assistant's tool calls, `tool_calls`.
struct MessageVisitor<'f> {
    index: usize,
    faults: &'f Faults,
}

expect!(MessageVisitor; |v| At::Item("messages", v.index), "an object");

impl<'a> Visitor<'a> for MessageVisitor<'_> {
    type Value = Message<'a>;

    visitor_common!('a; bool, number, string, null, list);

    fn visit_map<A: MapAccess<'a>>(self, mut map: A) -> Result<Message<'a>, A::Error> {
        let (index, faults) = (self.index, self.faults);
        let mut role = None;
        let mut content = Vec::new();
        let mut tool_calls = None;
        while let Some(key) = map.next_key_seed(Key)? {
            match &*key {
                "role" => {
                    let at = At::MessageMember(index, "role");
                    role = map.next_value_seed(Any(Text::new(at, faults)))?;
                }
                "content" => content = map.next_value_seed(Any(Content { index, faults }))?,
                "tool_calls" => {
                    let at = At::MessageMember(index, "tool_calls");
                    tool_calls = raw_list(&mut map, 3, at, "a list of tool calls", faults)?;
                }
                _ => map.next_value_seed(Any(Skip {
                    enclosing: 3,
                    faults,
                }))?,
            }
        }
        let role = role.ok_or_else(|| faults.fail(missing(At::MessageMember(index, "role"))))?;
        content.extend(tool_calls.map(|calls| Cow::Borrowed(calls.get())));
        Ok(Message { role, content })
    }
}

/// A message's `content`: a string (one part), a list of content parts, or `null` (no parts).
struct Content<'f> {
    index: usize,
    faults: &'f Faults,
}

expect!(Content; |v| At::MessageMember(v.index, "content"), "a string or a list of content parts");

impl<'a> Visitor<'a> for Content<'_> {
    type Value = Vec<Cow<'a, str>>;

    visitor_common!('a; bool, number, object);

    fn visit_borrowed_str<E: de::Error>(self, text: &'a str) -> Result<Self::Value, E> {
        Ok(vec![Cow::Borrowed(text)])
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(vec![Cow::Owned(text.to_owned())])
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::new();
        let (index, faults) = (self.index, self.faults);
        while let Some(part) = seq.next_element_seed(Any(Part {
            index,
            part: parts.len(),
            faults,
        }))? {
            parts.push(part);
        }
        Ok(parts)
    }
}

/// One content part: a text part's `text`, or for any other type (`image_url`, `input_audio`, …) the
/// placeholder `<{type}:{digest}>`. The digest is a chained xxh3-64 over each member other than `type`
/// and `text`, key then raw JSON text, in the order written; so the same image gives the same placeholder
/// and a different one diverges there, as engines key cached images by a hash of their content. A part
/// without `type` is a text part if it has `text`.
struct Part<'f> {
    index: usize,
    part: usize,
    faults: &'f Faults,
}

expect!(Part; |v| At::Part(v.index, v.part), "a content part object");

impl<'a> Visitor<'a> for Part<'_> {
    type Value = Cow<'a, str>;

    visitor_common!('a; bool, number, string, null, list);

    fn visit_map<A: MapAccess<'a>>(self, mut map: A) -> Result<Cow<'a, str>, A::Error> {
        let (index, part, faults) = (self.index, self.part, self.faults);
        let mut kind = None;
        let mut text = None;
        let mut digest = 0;
        while let Some(key) = map.next_key_seed(Key)? {
            match &*key {
                "type" => {
                    let at = At::PartMember(index, part, "type");
                    kind = map.next_value_seed(Any(Text::new(at, faults)))?;
                }
                "text" => {
                    let at = At::PartMember(index, part, "text");
                    text = map.next_value_seed(Any(Text::new(at, faults)))?;
                }
                _ => {
                    let value = raw(&mut map, 5, faults)?;
                    digest = xxh3_64_with_seed(key.as_bytes(), digest);
                    digest = xxh3_64_with_seed(value.get().as_bytes(), digest);
                }
            }
        }
        match (kind.as_deref(), text) {
            (Some("text") | None, Some(text)) => Ok(text),
            (Some("text"), None) => Err(faults.fail(missing(At::PartMember(index, part, "text")))),
            (Some(kind), _) => Ok(Cow::Owned(format!("<{kind}:{digest:016x}>"))),
            (None, None) => Err(faults.fail(missing(At::PartMember(index, part, "type")))),
        }
    }
}

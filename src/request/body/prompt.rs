//! The prompt members of `/v1/completions` (`prompt`) and SGLang's `/generate` (`text`, `input_ids`):
//! text or token ids, a batch routed by its first prompt and the rest skipped unread.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};

use super::{Any, At, Expect, Faults, Skip};
use crate::request::Prompt;

/// Which prompt shapes a member accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Accepts {
    /// `/v1/completions`' `prompt`.
    TextOrTokens,
    /// SGLang's `text`.
    Text,
    /// SGLang's `input_ids`.
    Tokens,
}

impl Accepts {
    fn text(self) -> bool {
        self != Accepts::Tokens
    }

    fn tokens(self) -> bool {
        self != Accepts::Text
    }

    /// What the member must be.
    fn member(self) -> &'static str {
        match self {
            Accepts::TextOrTokens => {
                "a string, a list of strings, a list of token ids or a list of token-id lists"
            }
            Accepts::Text => "a string or a list of strings",
            Accepts::Tokens => "a list of token ids or a list of token-id lists",
        }
    }

    /// What the first item of the member's list must be.
    fn first_item(self) -> &'static str {
        match self {
            Accepts::TextOrTokens => "a string, a token id or a list of token ids",
            Accepts::Text => "a string",
            Accepts::Tokens => "a token id or a list of token ids",
        }
    }
}

/// A prompt member: a string, or a list whose first item decides — a string (a batch of texts), a token
/// id (a token list), or a token list (a batch of token lists). A batch is routed by its first prompt;
/// the rest is skipped unread. `null` is absent; an empty list is an empty prompt.
pub(super) struct PromptVisitor<'f> {
    name: &'static str,
    accepts: Accepts,
    faults: &'f Faults,
}

impl<'f> PromptVisitor<'f> {
    pub(super) fn new(name: &'static str, accepts: Accepts, faults: &'f Faults) -> Self {
        PromptVisitor {
            name,
            accepts,
            faults,
        }
    }
}

expect!(PromptVisitor; |v| At::Member(v.name), |v| v.accepts.member());

impl<'a> Visitor<'a> for PromptVisitor<'_> {
    type Value = Option<Prompt<'a>>;

    visitor_common!('a; bool, number, object);

    fn visit_borrowed_str<E: de::Error>(self, text: &'a str) -> Result<Self::Value, E> {
        if !self.accepts.text() {
            return Err(self.wrong("a string"));
        }
        Ok(Some(Prompt::Text(Cow::Borrowed(text))))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        if !self.accepts.text() {
            return Err(self.wrong("a string"));
        }
        Ok(Some(Prompt::Text(Cow::Owned(text.to_owned()))))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (name, faults) = (self.name, self.faults);
        let first = FirstItem {
            name,
            accepts: self.accepts,
            faults,
        };
        let prompt = match seq.next_element_seed(Any(first))? {
            None if self.accepts.tokens() => Prompt::Tokens(Vec::new()),
            None => Prompt::Text(Cow::Borrowed("")),
            Some(First::Text(text)) => {
                skip_rest(&mut seq, 2, faults)?;
                Prompt::Text(text)
            }
            Some(First::Tokens(tokens)) => {
                skip_rest(&mut seq, 2, faults)?;
                Prompt::Tokens(tokens)
            }
            Some(First::Token(token)) => {
                let mut tokens = vec![token];
                while let Some(token) = seq.next_element_seed(Any(Token {
                    at: At::Item(name, tokens.len()),
                    faults,
                }))? {
                    tokens.push(token);
                }
                Prompt::Tokens(tokens)
            }
        };
        Ok(Some(prompt))
    }
}

/// The first item of a prompt list, which decides what the list is.
enum First<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

struct FirstItem<'f> {
    name: &'static str,
    accepts: Accepts,
    faults: &'f Faults,
}

impl FirstItem<'_> {
    fn token(&self) -> Token<'_> {
        Token {
            at: self.at(),
            faults: self.faults,
        }
    }
}

expect!(FirstItem; |v| At::Item(v.name, 0), |v| v.accepts.first_item());

impl<'a> Visitor<'a> for FirstItem<'_> {
    type Value = First<'a>;

    visitor_common!('a; bool, null, object);

    fn visit_borrowed_str<E: de::Error>(self, text: &'a str) -> Result<First<'a>, E> {
        if !self.accepts.text() {
            return Err(self.wrong("a string"));
        }
        Ok(First::Text(Cow::Borrowed(text)))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<First<'a>, E> {
        if !self.accepts.text() {
            return Err(self.wrong("a string"));
        }
        Ok(First::Text(Cow::Owned(text.to_owned())))
    }

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<First<'a>, E> {
        if !self.accepts.tokens() {
            return Err(self.wrong("a number"));
        }
        self.token().visit_u64(id).map(First::Token)
    }

    fn visit_i64<E: de::Error>(self, id: i64) -> Result<First<'a>, E> {
        if !self.accepts.tokens() {
            return Err(self.wrong("a number"));
        }
        self.token().visit_i64(id).map(First::Token)
    }

    fn visit_f64<E: de::Error>(self, id: f64) -> Result<First<'a>, E> {
        if !self.accepts.tokens() {
            return Err(self.wrong("a number"));
        }
        self.token().visit_f64(id).map(First::Token)
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut seq: A) -> Result<First<'a>, A::Error> {
        if !self.accepts.tokens() {
            return Err(self.wrong("a list"));
        }
        let (name, faults) = (self.name, self.faults);
        let mut tokens = Vec::new();
        while let Some(token) = seq.next_element_seed(Any(Token {
            at: At::ItemOf(name, 0, tokens.len()),
            faults,
        }))? {
            tokens.push(token);
        }
        Ok(First::Tokens(tokens))
    }
}

/// A token id: an integer that fits `u32`, as every engine's vocabulary does.
struct Token<'f> {
    at: At,
    faults: &'f Faults,
}

expect!(Token; |v| v.at, "a token id (an integer from 0 to 4294967295)");

impl<'a> Visitor<'a> for Token<'_> {
    type Value = u32;

    visitor_common!('a; bool, string, null, list, object);

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<u32, E> {
        u32::try_from(id).map_err(|_| self.wrong("a number above 4294967295"))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<u32, E> {
        Err(self.wrong("a negative number"))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<u32, E> {
        Err(self.wrong("a number that is not an integer below 2^64"))
    }
}

/// Skips the rest of a list whose first item decided the value.
fn skip_rest<'a, A: SeqAccess<'a>>(
    seq: &mut A,
    enclosing: usize,
    faults: &Faults,
) -> Result<(), A::Error> {
    while seq
        .next_element_seed(Any(Skip { enclosing, faults }))?
        .is_some()
    {}
    Ok(())
}

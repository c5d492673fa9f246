//! vLLM's `extra_keys`, read without allocating, and the rule that tells a `cache_salt` from an
//! adapter name and from keys a text prompt cannot match (the parent module's documentation, "Salt
//! and extra keys").

use super::reader::{Head, Reader};
use super::{DecodeError, EVENT_FIELD, Kept, Result, kept};

/// How many distinct strings a root block may carry before the event is opaque regardless.
const ROOT_STRINGS: usize = 4;

/// vLLM's `extra_keys`, summarised without allocating: the strings of the first block, the one string
/// allowed in later blocks (the adapter), and whether anything else appeared.
#[derive(Default)]
pub(super) struct ExtraKeys<'a> {
    root: [Option<&'a [u8]>; ROOT_STRINGS],
    later: Option<&'a [u8]>,
    opaque: bool,
}

pub(super) fn read_extra_keys<'a>(r: &mut Reader<'a>) -> Result<ExtraKeys<'a>> {
    let mut keys = ExtraKeys::default();
    let blocks = match r.head()? {
        Head::Nil => return Ok(keys),
        Head::Array(n) => n,
        _ => {
            return Err(DecodeError::WrongType {
                field: "extra_keys",
                expected: "an array or nil",
            });
        }
    };
    for block in 0..blocks {
        let n = match r.head()? {
            Head::Nil => continue,
            Head::Array(n) => n,
            _ => {
                return Err(DecodeError::WrongType {
                    field: "extra_keys",
                    expected: "per-block tuples or nil",
                });
            }
        };
        for _ in 0..n {
            match r.peek()? {
                Head::Str(s) => {
                    r.head()?;
                    keys.note(block == 0, s);
                }
                _ => {
                    keys.opaque = true;
                    r.skip(EVENT_FIELD + 2)?;
                }
            }
        }
    }
    Ok(keys)
}

impl<'a> ExtraKeys<'a> {
    fn note(&mut self, root: bool, s: &'a [u8]) {
        if root {
            if self.root.iter().flatten().any(|seen| *seen == s) {
                return;
            }
            match self.root.iter_mut().find(|slot| slot.is_none()) {
                Some(slot) => *slot = Some(s),
                None => self.opaque = true,
            }
        } else {
            match self.later {
                None => self.later = Some(s),
                Some(seen) if seen == s => {}
                Some(_) => self.opaque = true,
            }
        }
    }

    /// The salt the keys carry, and whether they carry anything a text prompt cannot match.
    pub(super) fn classify(
        &self,
        lora_name: Option<&str>,
        explicit_salt: Option<&str>,
        root_block: bool,
    ) -> (Option<&'a str>, bool) {
        let known = |s: &[u8]| {
            lora_name.is_some_and(|name| name.as_bytes() == s)
                || explicit_salt.is_some_and(|salt| salt.as_bytes() == s)
        };
        let mut opaque = self.opaque
            || self
                .later
                .is_some_and(|s| lora_name.is_none_or(|n| n.as_bytes() != s));
        let mut rest = self.root.iter().flatten().filter(|s| !known(s));
        let first = rest.next();
        let more = rest.next().is_some();
        let mut salt = None;
        match first {
            None => {}
            Some(s) if root_block && !more => match kept(s) {
                Kept::Value(s) => salt = Some(s),
                _ => opaque = true,
            },
            Some(_) => opaque = true,
        }
        (salt, opaque)
    }
}

//! The output a request asks for, read leniently: a count routing uses only to know that the engine
//! will refuse the request (prompt + output beyond `max_model_len`), never to refuse it itself.
//!
//! A count is any JSON number: an integer as it is, a non-negative float truncated (vLLM accepts
//! `100.0`), anything negative or of another type ignored (`None`) — the engine validates it, and a
//! body it accepts must not be refused here. Where a body gives several (`max_tokens` and
//! `max_completion_tokens`), the largest counts, since the engine may honour either.

use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{Any, Faults, Key, Skip};

/// Where a lenient count is: the value itself (`max_tokens`, `max_completion_tokens`), or `member` of an
/// object (SGLang's `sampling_params` and its `max_new_tokens`, everything else in it skipped within the
/// depth bound). A value of any other shape holds no count.
pub(super) struct Count<'f> {
    pub(super) faults: &'f Faults,
    pub(super) member: Option<&'static str>,
}

impl Count<'_> {
    /// `count` when the value itself is the count; none when the count was to be a member.
    fn direct(&self, count: Option<u64>) -> Option<u64> {
        count.filter(|_| self.member.is_none())
    }
}

impl<'a> Visitor<'a> for Count<'_> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.member {
            None => "a token count",
            Some(_) => "sampling parameters",
        })
    }

    fn visit_u64<E: de::Error>(self, count: u64) -> Result<Option<u64>, E> {
        Ok(self.direct(Some(count)))
    }

    fn visit_i64<E: de::Error>(self, count: i64) -> Result<Option<u64>, E> {
        Ok(self.direct(u64::try_from(count).ok()))
    }

    fn visit_f64<E: de::Error>(self, count: f64) -> Result<Option<u64>, E> {
        // `as` saturates at u64::MAX and maps NaN to 0; a negative count is none.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(self.direct((count >= 0.0).then_some(count as u64)))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'a>>(self, seq: A) -> Result<Option<u64>, A::Error> {
        skip_seq(seq, self.faults)
    }

    fn visit_map<A: MapAccess<'a>>(self, mut map: A) -> Result<Option<u64>, A::Error> {
        let faults = self.faults;
        let Some(member) = self.member else {
            return skip_map(map, faults);
        };
        let mut asked = None;
        while let Some(key) = map.next_key_seed(Key)? {
            if key == member {
                asked = map.next_value_seed(Any(Count {
                    faults,
                    member: None,
                }))?;
            } else {
                // The body is level 1, this object level 2.
                map.next_value_seed(Any(Skip {
                    enclosing: 2,
                    faults,
                }))?;
            }
        }
        Ok(asked)
    }
}

/// A list where a count was expected: skipped within the depth bound, no count.
fn skip_seq<'a, A: SeqAccess<'a>>(mut seq: A, faults: &Faults) -> Result<Option<u64>, A::Error> {
    let inner = Skip {
        enclosing: 2,
        faults,
    };
    while seq.next_element_seed(Any(inner))?.is_some() {}
    Ok(None)
}

/// An object where a count was expected: skipped within the depth bound, no count.
fn skip_map<'a, A: MapAccess<'a>>(mut map: A, faults: &Faults) -> Result<Option<u64>, A::Error> {
    let inner = Skip {
        enclosing: 2,
        faults,
    };
    while map.next_key::<IgnoredAny>()?.is_some() {
        map.next_value_seed(Any(inner))?;
    }
    Ok(None)
}

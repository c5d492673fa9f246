//! The schema-directed walker: a decoder reads each node as whatever its key expects and records every
//! problem instead of stopping at the first.
//!
//! [`Decode`] is a trait with provided methods so that each schema (cachepick's file, the simulator's)
//! keeps its own decoder type and its own schema methods beside these, while the walking and the scalar
//! readers exist once.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use crate::problem::{Origin, Phase, Problems, Reported, Res};
use crate::tree::{Entry, Kind, Node, Place};
use crate::{duration, size};

pub const ADDRESS: &str = "ip:port such as 10.0.0.11:8000 (an IP address, not a host name)";
pub const DURATION: &str = "a duration such as 1s, 500ms or 1.5m (units: ms, s, m, h)";
pub const INTEGER: &str = "a non-negative integer";
pub const SIZE: &str = "a size such as 4MiB, 512KiB or 200000 (a whole number of bytes or of KiB, MiB, GiB, KB, MB, GB)";

/// A value and where it came from.
#[derive(Clone, Debug)]
pub struct Val<T> {
    pub value: T,
    pub at: Origin,
}

impl<T> Val<T> {
    /// How a message names this value: by its flag if it came from one, else by its key.
    pub fn name<'a>(&'a self, key: &'a str) -> &'a str {
        match &self.at {
            Origin::Flag(flag) => flag,
            _ => key,
        }
    }
}

/// An optional value: absent, given, or given but rejected.
pub type Field<T> = Res<Option<Val<T>>>;

/// A flag, when given, replaces the file's value.
pub fn overridden<T>(file: Field<T>, flag: Option<T>, name: &'static str) -> Field<T> {
    match flag {
        Some(value) => Ok(Some(Val {
            value,
            at: Origin::Flag(name),
        })),
        None => file,
    }
}

pub fn with_default<T>(field: Field<T>, default: T) -> Res<Val<T>> {
    field.map(|given| {
        given.unwrap_or(Val {
            value: default,
            at: Origin::Default,
        })
    })
}

/// The value of a field, or `default` when it is absent.
pub fn value_or<T>(field: Field<T>, default: T) -> Res<T> {
    field.map(|given| given.map_or(default, |given| given.value))
}

/// The origin to blame when two values disagree: the first one unless it is a default.
pub fn blame<A, B>(first: &Val<A>, second: &Val<B>) -> Origin {
    match first.at {
        Origin::Default => second.at.clone(),
        _ => first.at.clone(),
    }
}

pub fn at_least_one(n: u64) -> Result<NonZeroU64, String> {
    NonZeroU64::new(n).ok_or_else(|| "must be at least 1".to_owned())
}

pub fn at_least_one_usize(n: u64) -> Result<NonZeroUsize, String> {
    NonZeroUsize::try_from(at_least_one(n)?).map_err(|_| format!("must be at most {}", usize::MAX))
}

pub fn at_least_one_u32(n: u64) -> Result<NonZeroU32, String> {
    NonZeroU32::try_from(at_least_one(n)?).map_err(|_| format!("must be at most {}", u32::MAX))
}

/// A mapping being decoded.
pub struct Map<'n> {
    pub at: Place,
    pub entries: &'n [Entry],
}

impl<'n> Map<'n> {
    /// The value of `key` and its place; a null value counts as absent.
    pub fn get(&self, key: &str) -> Option<(&'n Node, Place)> {
        let entry = self
            .entries
            .iter()
            .find(|entry| entry.key == key && !entry.value.is_null())?;
        Some((&entry.value, self.at.key(key, entry.line)))
    }

    /// Where `key` is, when it is written with a null value: for the few keys where `null` means "off"
    /// rather than "absent".
    pub fn null_at(&self, key: &str) -> Option<Place> {
        let entry = self
            .entries
            .iter()
            .find(|entry| entry.key == key && entry.value.is_null())?;
        Some(self.at.key(key, entry.line))
    }

    /// Where `key` is, or would be: its own line if written, else the mapping's.
    pub fn place_of(&self, key: &str) -> Place {
        let line = self
            .entries
            .iter()
            .find(|entry| entry.key == key)
            .map_or(self.at.line, |entry| entry.line);
        self.at.key(key, line)
    }
}

/// The walker over a positioned tree. A schema's decoder implements [`problems`](Decode::problems) and
/// gets the rest; its own methods can then be passed where a method of this trait is expected
/// (`self.opt(&map, "key", Self::integer)`), because every reader takes `&mut Self`.
pub trait Decode: Sized {
    /// Where problems are recorded.
    fn problems(&mut self) -> &mut Problems;

    fn report(&mut self, phase: Phase, at: Origin, message: impl Into<String>) -> Reported {
        self.problems().report(phase, at, message)
    }

    /// A mapping with exactly the keys known at this point of the schema.
    fn mapping<'n>(&mut self, node: &'n Node, at: &Place, keys: &[&str]) -> Res<Map<'n>> {
        let map = self.any_mapping(node, at)?;
        self.known_keys(&map, keys);
        Ok(map)
    }

    /// A mapping whose keys are checked later; null reads as an empty mapping (an empty file).
    fn any_mapping<'n>(&mut self, node: &'n Node, at: &Place) -> Res<Map<'n>> {
        match &node.kind {
            Kind::Map(entries) => Ok(Map {
                at: at.clone(),
                entries,
            }),
            _ if node.is_null() => Ok(Map {
                at: at.clone(),
                entries: &[],
            }),
            _ => Err(self.type_error(node, at, "a mapping")),
        }
    }

    fn known_keys(&mut self, map: &Map, keys: &[&str]) {
        for entry in map
            .entries
            .iter()
            .filter(|entry| !keys.contains(&entry.key.as_str()))
        {
            let message = format!("unknown key; expected one of: {}", keys.join(", "));
            self.report(
                Phase::Value,
                map.at.key(&entry.key, entry.line).origin(),
                message,
            );
        }
    }

    /// A section of the root; absent is empty, so its keys take their defaults (and flags still apply).
    fn section<'n>(&mut self, root: &Map<'n>, key: &str, keys: &[&str]) -> Res<Map<'n>> {
        match root.get(key) {
            Some((node, at)) => self.mapping(node, &at, keys),
            None => Ok(Map {
                at: root.place_of(key),
                entries: &[],
            }),
        }
    }

    fn list<'n>(&mut self, node: &'n Node, at: &Place, expected: &str) -> Res<&'n [Node]> {
        match &node.kind {
            Kind::Seq(items) => Ok(items),
            _ => Err(self.type_error(node, at, expected)),
        }
    }

    fn opt<T>(
        &mut self,
        map: &Map,
        key: &str,
        decode: impl FnOnce(&mut Self, &Node, &Place) -> Res<T>,
    ) -> Field<T> {
        let Some((node, at)) = map.get(key) else {
            return Ok(None);
        };
        let value = decode(self, node, &at)?;
        Ok(Some(Val {
            value,
            at: at.origin(),
        }))
    }

    fn required<T>(
        &mut self,
        map: &Map,
        key: &str,
        decode: impl FnOnce(&mut Self, &Node, &Place) -> Res<T>,
    ) -> Res<Val<T>> {
        self.opt(map, key, decode)?.ok_or_else(|| {
            self.report(
                Phase::Value,
                map.place_of(key).origin(),
                "missing required key",
            )
        })
    }

    /// Checks a value on its own, turning it into its validated type.
    fn check<T, U>(
        &mut self,
        given: Res<Val<T>>,
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Res<Val<U>> {
        let Val { value, at } = given?;
        match check(value) {
            Ok(value) => Ok(Val { value, at }),
            Err(message) => Err(self.report(Phase::Value, at, message)),
        }
    }

    fn check_opt<T, U>(
        &mut self,
        given: Field<T>,
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Field<U> {
        given?.map(|given| self.check(Ok(given), check)).transpose()
    }

    fn type_error(&mut self, node: &Node, at: &Place, expected: &str) -> Reported {
        let got = match &node.kind {
            Kind::Map(_) => "a mapping".to_owned(),
            Kind::Seq(_) => "a list".to_owned(),
            Kind::Scalar { text, plain: true } => format!("`{text}`"),
            Kind::Scalar { text, plain: false } => format!("the quoted string {text:?}"),
        };
        self.report(
            Phase::Value,
            at.origin(),
            format!("expected {expected}, got {got}"),
        )
    }

    // Scalars, read as the schema expects.

    /// Any scalar, as text: where a string is expected, `3` is "3".
    fn text<'n>(&mut self, node: &'n Node, at: &Place, expected: &str) -> Res<&'n str> {
        match &node.kind {
            Kind::Scalar { text, .. } => Ok(text),
            _ => Err(self.type_error(node, at, expected)),
        }
    }

    fn string(&mut self, node: &Node, at: &Place) -> Res<String> {
        match self.text(node, at, "a string")? {
            "" => Err(self.report(Phase::Value, at.origin(), "must not be empty")),
            text => Ok(text.to_owned()),
        }
    }

    /// Numbers are plain scalars; a quoted one is a string.
    fn integer(&mut self, node: &Node, at: &Place) -> Res<u64> {
        match &node.kind {
            Kind::Scalar { text, plain: true } => text.parse().map_err(|_| {
                if text.bytes().all(|b| b.is_ascii_digit()) {
                    self.report(
                        Phase::Value,
                        at.origin(),
                        format!("must be at most {}", u64::MAX),
                    )
                } else {
                    self.type_error(node, at, INTEGER)
                }
            }),
            _ => Err(self.type_error(node, at, INTEGER)),
        }
    }

    /// `true` or `false`, plain; a quoted one is a string.
    fn boolean(&mut self, node: &Node, at: &Place) -> Res<bool> {
        match &node.kind {
            Kind::Scalar { text, plain: true } if text == "true" => Ok(true),
            Kind::Scalar { text, plain: true } if text == "false" => Ok(false),
            _ => Err(self.type_error(node, at, "true or false")),
        }
    }

    fn number(&mut self, node: &Node, at: &Place) -> Res<f64> {
        match &node.kind {
            Kind::Scalar { text, plain: true } => text
                .parse()
                .map_err(|_| self.type_error(node, at, "a number")),
            _ => Err(self.type_error(node, at, "a number")),
        }
    }

    fn duration(&mut self, node: &Node, at: &Place) -> Res<Duration> {
        let text = self.text(node, at, DURATION)?;
        duration::parse(text).ok_or_else(|| self.type_error(node, at, DURATION))
    }

    /// An IP literal, not a host name: Envoy's `override_host` needs an address.
    fn address(&mut self, node: &Node, at: &Place) -> Res<SocketAddr> {
        let text = self.text(node, at, ADDRESS)?;
        text.parse().map_err(|_| self.type_error(node, at, ADDRESS))
    }

    /// A byte size, bare or with a unit (see `size`).
    fn size(&mut self, node: &Node, at: &Place) -> Res<usize> {
        let text = self.text(node, at, SIZE)?;
        size::parse(text).map_err(|invalid| match invalid {
            size::Invalid::Malformed => self.type_error(node, at, SIZE),
            size::Invalid::TooLarge => {
                let message = format!("must be at most {} bytes", usize::MAX);
                self.report(Phase::Value, at.origin(), message)
            }
        })
    }

    fn keyword<T: Copy>(
        &mut self,
        node: &Node,
        at: &Place,
        options: &[T],
        name: fn(T) -> &'static str,
    ) -> Res<T> {
        let text = self.text(node, at, "a string")?;
        options
            .iter()
            .copied()
            .find(|option| name(*option) == text)
            .ok_or_else(|| {
                let names: Vec<_> = options.iter().map(|option| name(*option)).collect();
                let message = format!("expected one of: {}; got `{text}`", names.join(", "));
                self.report(Phase::Value, at.origin(), message)
            })
    }
}

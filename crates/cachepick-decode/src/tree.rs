//! A positioned YAML tree: just enough structure for the schema-directed decoder, with the line of
//! every node and mapping key so that each problem can point into the file.
//!
//! Scalars stay text: the decoder reads each one as whatever its key expects. Aliases are rejected
//! rather than expanded, since a configuration this small gains nothing from them and an expanded alias
//! would have no line of its own to report.

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use crate::problem::{Origin, Phase, Problems, Reported, Res};

#[derive(Debug, PartialEq)]
pub struct Node {
    /// 1-based; for a block mapping or sequence, the line of its first entry.
    pub line: usize,
    pub kind: Kind,
}

#[derive(Debug, PartialEq)]
pub enum Kind {
    /// `plain` is false for quoted and block scalars, which are always strings.
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    /// In document order, keys unique.
    Map(Vec<Entry>),
}

#[derive(Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    /// The line of the key, which is where a message about the entry points.
    pub line: usize,
    pub value: Node,
}

impl Node {
    /// YAML's null (`~`, `null`, or nothing at all), which the decoder reads as "not given".
    pub fn is_null(&self) -> bool {
        match &self.kind {
            Kind::Scalar { text, plain: true } => {
                matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL")
            }
            _ => false,
        }
    }
}

/// Where a node sits in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// Dotted keys and `[index]`es from the root, e.g. `pools[0].workers[1]`; empty for the root.
    pub path: String,
    pub line: usize,
}

impl Place {
    pub fn root(line: usize) -> Place {
        Place {
            path: String::new(),
            line,
        }
    }

    pub fn key(&self, key: &str, line: usize) -> Place {
        let path = if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        };
        Place { path, line }
    }

    pub fn index(&self, index: usize, line: usize) -> Place {
        Place {
            path: format!("{}[{index}]", self.path),
            line,
        }
    }

    pub fn origin(&self) -> Origin {
        Origin::Yaml {
            path: self.path.clone(),
            line: self.line,
        }
    }
}

/// Builds the tree of the single document in `source`. Duplicate keys are recorded as problems (the
/// first occurrence stays in the tree). The first thing that leaves no trustworthy tree — a syntax
/// error, an alias, a non-scalar key, a second document, too deep a nesting — is recorded, ends the
/// parse and makes this an `Err`. An empty document is a null root.
pub fn parse(source: &str, problems: &mut Problems) -> Res<Node> {
    let mut builder = Builder {
        problems,
        stack: Vec::new(),
        root: None,
        documents: 0,
        failed: None,
    };
    // Events are pulled one at a time rather than through `Parser::load`, which recurses once per
    // nesting level and so lets a deeply nested file overflow the stack.
    let mut parser = Parser::new_from_str(source);
    while builder.failed.is_none() {
        match parser.next_token() {
            Ok((Event::StreamEnd, _)) => break,
            Ok((event, mark)) => builder.on_event(event, mark),
            Err(error) => {
                let at = error.marker();
                let message = format!("invalid YAML (column {}): {}", at.col() + 1, error.info());
                builder.fail(at.line(), &message);
            }
        }
    }
    match builder.failed {
        Some(reported) => Err(reported),
        None => Ok(builder.root.unwrap_or(Node {
            line: 1,
            kind: Kind::Scalar {
                text: String::new(),
                plain: true,
            },
        })),
    }
}

/// Far deeper than the schema (five levels), yet shallow enough that dropping the tree, which recurses,
/// cannot overflow the stack.
const MAX_DEPTH: usize = 32;

struct Builder<'p> {
    problems: &'p mut Problems,
    /// The collections being built, innermost last.
    stack: Vec<Frame>,
    root: Option<Node>,
    documents: usize,
    failed: Option<Reported>,
}

enum Frame {
    Seq {
        at: Place,
        items: Vec<Node>,
    },
    /// `key` holds a key (and its line) until its value is complete.
    Map {
        at: Place,
        entries: Vec<Entry>,
        key: Option<(String, usize)>,
    },
}

impl MarkedEventReceiver for Builder<'_> {
    fn on_event(&mut self, event: Event, mark: Marker) {
        let line = mark.line();
        match event {
            Event::DocumentStart => {
                self.documents += 1;
                if self.documents > 1 {
                    self.fail(
                        line,
                        "a second YAML document; the configuration is a single document",
                    );
                }
            }
            Event::Alias(_) => self.fail(
                line,
                "aliases (*name) are not supported; write the value out",
            ),
            Event::Scalar(text, style, ..) => {
                self.finish(Node {
                    line,
                    kind: Kind::Scalar {
                        text,
                        plain: style == TScalarStyle::Plain,
                    },
                });
            }
            Event::SequenceStart(..) | Event::MappingStart(..) if self.stack.len() >= MAX_DEPTH => {
                self.fail(line, &format!("nested deeper than {MAX_DEPTH} levels"));
            }
            Event::SequenceStart(..) => {
                let at = self.child(line);
                self.stack.push(Frame::Seq {
                    at,
                    items: Vec::new(),
                });
            }
            Event::MappingStart(..) => {
                let at = self.child(line);
                self.stack.push(Frame::Map {
                    at,
                    entries: Vec::new(),
                    key: None,
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(frame) = self.stack.pop() {
                    let node = match frame {
                        Frame::Seq { at, items } => Node {
                            line: at.line,
                            kind: Kind::Seq(items),
                        },
                        Frame::Map { at, entries, .. } => Node {
                            line: at.line,
                            kind: Kind::Map(entries),
                        },
                    };
                    self.finish(node);
                }
            }
            Event::Nothing | Event::StreamStart | Event::StreamEnd | Event::DocumentEnd => {}
        }
    }
}

impl Builder<'_> {
    fn fail(&mut self, line: usize, message: &str) {
        self.failed = Some(
            self.problems
                .report(Phase::Value, Place::root(line).origin(), message),
        );
    }

    /// The place of a collection starting at `line` inside the innermost open one.
    fn child(&self, line: usize) -> Place {
        match self.stack.last() {
            None => Place::root(line),
            Some(Frame::Seq { at, items }) => at.index(items.len(), line),
            Some(Frame::Map {
                at,
                key: Some((key, _)),
                ..
            }) => at.key(key, line),
            // A collection used as a key, rejected once it is complete.
            Some(Frame::Map { at, key: None, .. }) => Place {
                path: at.path.clone(),
                line,
            },
        }
    }

    /// Attaches a complete node to the innermost open collection, as an item, a key, or a value.
    fn finish(&mut self, node: Node) {
        let Some(frame) = self.stack.last_mut() else {
            self.root = Some(node);
            return;
        };
        match frame {
            Frame::Seq { items, .. } => items.push(node),
            Frame::Map { at, entries, key } => match (key.take(), node.kind) {
                (None, Kind::Scalar { text, .. }) => *key = Some((text, node.line)),
                (None, _) => self.fail(
                    node.line,
                    "a mapping key must be a name, not a list or a mapping",
                ),
                (Some((key, line)), kind) => match entries.iter().find(|entry| entry.key == key) {
                    Some(first) => {
                        let message = format!("duplicate key; first given on line {}", first.line);
                        self.problems
                            .report(Phase::Value, at.key(&key, line).origin(), message);
                    }
                    None => entries.push(Entry {
                        key,
                        line,
                        value: Node {
                            line: node.line,
                            kind,
                        },
                    }),
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(source: &str) -> (Res<Node>, Vec<String>) {
        let mut problems = Problems::default();
        let node = parse(source, &mut problems);
        (
            node,
            problems
                .into_sorted()
                .iter()
                .map(ToString::to_string)
                .collect(),
        )
    }

    fn scalar(line: usize, text: &str) -> Node {
        Node {
            line,
            kind: Kind::Scalar {
                text: text.to_owned(),
                plain: true,
            },
        }
    }

    #[test]
    fn nodes_and_keys_keep_their_lines_and_order() {
        let (node, problems) = tree("# comment\nb: 1\na:\n  - x\n  - 'y'\n");
        assert!(problems.is_empty(), "{problems:?}");
        let expected = Node {
            line: 2,
            kind: Kind::Map(vec![
                Entry {
                    key: "b".into(),
                    line: 2,
                    value: scalar(2, "1"),
                },
                Entry {
                    key: "a".into(),
                    line: 3,
                    value: Node {
                        line: 4,
                        kind: Kind::Seq(vec![
                            scalar(4, "x"),
                            Node {
                                line: 5,
                                kind: Kind::Scalar {
                                    text: "y".into(),
                                    plain: false,
                                },
                            },
                        ]),
                    },
                },
            ]),
        };
        assert_eq!(node.unwrap(), expected);
    }

    #[test]
    fn an_empty_document_is_a_null_root() {
        for source in ["", "# only a comment\n", "~\n"] {
            assert!(tree(source).0.unwrap().is_null(), "{source:?}");
        }
    }

    #[test]
    fn a_duplicate_key_is_a_problem_naming_both_lines_and_the_first_stays() {
        let (node, problems) = tree("a:\n  - b: 1\n    c: 2\n    b: 3\n");
        assert_eq!(
            problems,
            ["a[0].b (line 4): duplicate key; first given on line 2"]
        );
        let Kind::Map(root) = node.unwrap().kind else {
            panic!("not a mapping")
        };
        let Kind::Seq(items) = &root[0].value.kind else {
            panic!("not a sequence")
        };
        let Kind::Map(entries) = &items[0].kind else {
            panic!("not a mapping")
        };
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].value, scalar(2, "1"));
    }

    #[test]
    fn what_leaves_no_trustworthy_tree_fails_with_its_line() {
        let cases = [
            ("a: 1\nb: [1, 2\n", "line 3: invalid YAML"),
            (
                "a: &x 1\nb: *x\n",
                "line 2: aliases (*name) are not supported",
            ),
            ("a: 1\n? [b]\n: 2\n", "line 2: a mapping key must be a name"),
            ("a: 1\n---\nb: 2\n", "line 2: a second YAML document"),
            (
                &"- ".repeat(100_000),
                "line 1: nested deeper than 32 levels",
            ),
        ];
        for (source, expected) in cases {
            let (node, problems) = tree(source);
            assert!(node.is_err(), "{source:?}");
            assert!(
                problems.iter().any(|p| p.starts_with(expected)),
                "{source:?}: {problems:?}"
            );
        }
    }
}

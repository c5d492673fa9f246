//! The YAML writer: indented lines and wrapped comment blocks, and the value forms Envoy reads.

use std::fmt::Display;
use std::net::SocketAddr;
use std::time::Duration;

/// Comment lines are wrapped to this many columns, indentation included.
const COMMENT_WIDTH: usize = 108;

/// The bootstrap being written, line by line.
#[derive(Default)]
pub(super) struct Yaml {
    pub(super) text: String,
}

impl Yaml {
    pub(super) fn line(&mut self, indent: usize, text: &str) {
        for _ in 0..indent {
            self.text.push(' ');
        }
        self.text.push_str(text);
        self.text.push('\n');
    }

    /// Static lines written as the YAML they are: `text`'s non-blank lines, less the indentation they
    /// share, at `indent`. The text may open and close on lines of its own, so that the source shows
    /// the block as it comes out.
    pub(super) fn block(&mut self, indent: usize, text: &str) {
        let lines: Vec<&str> = text
            .lines()
            .filter(|line| !line.trim().is_empty())
            .collect();
        let shared = lines
            .iter()
            .map(|line| line.len() - line.trim_start().len())
            .min()
            .unwrap_or(0);
        for line in lines {
            self.line(indent, line.get(shared..).unwrap_or(line));
        }
    }

    /// A comment block. Consecutive entries form one paragraph, re-wrapped to [`COMMENT_WIDTH`]; an empty
    /// entry separates paragraphs; an entry starting with a space is kept verbatim on its own line.
    pub(super) fn comment(&mut self, indent: usize, entries: &[&str]) {
        let width = COMMENT_WIDTH.saturating_sub(indent + 2).max(40);
        let mut paragraph: Vec<&str> = Vec::new();
        for entry in entries {
            if entry.is_empty() || entry.starts_with(' ') {
                self.paragraph(indent, width, &paragraph);
                paragraph.clear();
                if entry.is_empty() {
                    self.line(indent, "#");
                } else {
                    self.line(indent, &format!("#{entry}"));
                }
            } else {
                paragraph.extend(entry.split_whitespace());
            }
        }
        self.paragraph(indent, width, &paragraph);
    }

    fn paragraph(&mut self, indent: usize, width: usize, words: &[&str]) {
        let mut current = String::new();
        for word in words {
            if !current.is_empty() && current.len() + 1 + word.len() > width {
                self.line(indent, &format!("# {current}"));
                current.clear();
            }
            if !current.is_empty() {
                current.push(' ');
            }
            current.push_str(word);
        }
        if !current.is_empty() {
            self.line(indent, &format!("# {current}"));
        }
    }

    /// `"@type": type.googleapis.com/<type_name>`: the type of a `typed_config`.
    pub(super) fn type_url(&mut self, indent: usize, type_name: &str) {
        self.line(
            indent,
            &format!("\"@type\": type.googleapis.com/{type_name}"),
        );
    }

    /// A `policies:` list of one load-balancing policy at `indent`; its fields, if any, follow at
    /// `indent + 6`.
    pub(super) fn load_balancing_policy(&mut self, indent: usize, name: &str, type_name: &str) {
        self.line(indent, "policies:");
        self.line(indent, "- typed_extension_config:");
        self.line(indent + 4, &format!("name: {name}"));
        self.line(indent + 4, "typed_config:");
        self.type_url(indent + 6, type_name);
    }

    /// A list entry `- name: <name>` whose `typed_config` is a `type_name`; its fields, if any, follow at
    /// `indent + 4`.
    pub(super) fn typed_entry(&mut self, indent: usize, name: &str, type_name: &str) {
        self.line(indent, &format!("- name: {name}"));
        self.line(indent + 2, "typed_config:");
        self.type_url(indent + 4, type_name);
    }

    pub(super) fn socket_address(&mut self, indent: usize, addr: SocketAddr) {
        self.line(indent, &socket_address(addr.ip(), addr.port()));
    }

    /// `<key>:` holding one typed extension: its `name` and a `typed_config` of `type_name`, whose fields,
    /// if any, follow at `indent + 4`.
    pub(super) fn typed_extension(
        &mut self,
        indent: usize,
        key: &str,
        name: &str,
        type_name: &str,
    ) {
        self.line(indent, &format!("{key}:"));
        self.line(indent + 2, &format!("name: {name}"));
        self.line(indent + 2, "typed_config:");
        self.type_url(indent + 4, type_name);
    }

    /// A cluster's static `load_assignment`: one locality of endpoints at `addresses`, each a
    /// [`socket_address`] (an IP literal, or a name a `STRICT_DNS` cluster resolves).
    pub(super) fn load_assignment(
        &mut self,
        cluster_name: &str,
        addresses: impl IntoIterator<Item = String>,
    ) {
        self.line(4, "load_assignment:");
        self.line(6, &format!("cluster_name: {cluster_name}"));
        self.line(6, "endpoints:");
        self.line(6, "- lb_endpoints:");
        for address in addresses {
            self.line(8, "- endpoint:");
            self.line(12, "address:");
            self.line(14, &address);
        }
    }
}

/// An Envoy `socket_address` in flow form: `host` is an IP literal or a name to resolve.
pub(super) fn socket_address(host: impl Display, port: u16) -> String {
    format!("socket_address: {{address: \"{host}\", port_value: {port}}}")
}

/// Printable on one comment line: no control characters.
pub(super) fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// An Envoy `Duration` in its JSON form: whole seconds, or seconds with milliseconds.
pub(super) fn duration(value: Duration) -> String {
    match value.subsec_millis() {
        0 => format!("{}s", value.as_secs()),
        millis => format!("{}.{millis:03}s", value.as_secs()),
    }
}

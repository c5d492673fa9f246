//! A Prometheus text-format reader built for the scraper's hot path.
//!
//! The scraper reads a handful of gauges out of every worker's `/metrics` once a second, for up to
//! hundreds of workers. Each exposition is 50–200 KB, most of it histogram buckets nobody here reads, so
//! [`samples`] looks at each line's metric name first and, when the caller does not want it, jumps to
//! the next newline without reading its labels or value. Only wanted lines are parsed. A wanted line's
//! labels are validated before it is yielded, so iterating them later cannot fail. Nothing is allocated
//! per line: names, label names and label values borrow the input, and a label value is copied only when
//! it holds an escape.
//!
//! It is written by hand because the common crates drop metric names containing `:`, and every vLLM and
//! SGLang metric has one.
//!
//! Accepted, per line (text exposition format 0.0.4, as vLLM, SGLang and `prometheus_client` write it):
//! blank lines; comments (`# HELP`, `# TYPE`, anything after `#`); and samples
//! `name [{label="value", ...}] value [timestamp_ms]`, where the name is `[a-zA-Z_:][a-zA-Z0-9_:]*`, a
//! label name `[a-zA-Z_][a-zA-Z0-9_]*`, a label value escapes only `\\`, `\"` and `\n`, the label list may
//! end with a comma, the value is a float (`1.5e+03`, `NaN`, `+Inf`, `-Inf`, `Inf`) and the timestamp an
//! integer. Spaces and tabs may surround every token; lines end in LF or CRLF. Histogram and summary
//! series are ordinary samples (`_bucket`, `_sum`, `_count`, with `le` or `quantile` labels). Duplicate
//! label names are not rejected; [`Sample::label`] returns the first.
//!
//! Anything else on a wanted line makes it malformed: it is counted in [`Samples::malformed`] and
//! skipped, and reading resumes at the next line. A line whose name is not wanted is never parsed, so
//! its errors go uncounted; a line that does not start with a name at all is counted, since no filter
//! could have meant it.
use std::borrow::Cow;

/// The blanks that may separate tokens within a line.
const BLANKS: [char; 2] = [' ', '\t'];

/// Reads `text`, yielding only the samples whose metric name `want` accepts. Lines of other names are
/// skipped unparsed. `want` is asked once per run of consecutive lines with the same name.
pub fn samples<'a, F: Fn(&str) -> bool>(text: &'a str, want: F) -> Samples<'a, F> {
    Samples {
        rest: text,
        want,
        previous: None,
        malformed: 0,
    }
}

/// The wanted samples of one exposition, in order; see [`samples`].
pub struct Samples<'a, F> {
    /// The input not yet read, starting at a line.
    rest: &'a str,
    want: F,
    /// The last name read and whether it is wanted. A family's lines are consecutive, so most lines
    /// repeat the previous name, and comparing it costs less than scanning it and asking `want` again.
    previous: Option<(&'a str, bool)>,
    malformed: usize,
}

impl<F> Samples<'_, F> {
    /// Malformed lines seen so far: wanted lines that failed to parse, and lines that do not start with
    /// a metric name. Read it once the iterator is exhausted for the whole exposition's count.
    pub fn malformed(&self) -> usize {
        self.malformed
    }
}

impl<'a, F: Fn(&str) -> bool> Samples<'a, F> {
    /// Splits the metric name off the line in `text`: the name, whether it is wanted, and the rest of
    /// the input. `None` if the line does not start with a name.
    fn name(&mut self, text: &'a str) -> Option<(&'a str, bool, &'a str)> {
        if let Some((name, wanted)) = self.previous
            && let Some(after) = text.strip_prefix(name)
            && !after
                .bytes()
                .next()
                .is_some_and(|b| is_name_byte(b, METRIC))
        {
            return Some((name, wanted, after));
        }
        let (name, after) = split_name(text, METRIC);
        if name.is_empty() {
            return None;
        }
        let wanted = (self.want)(name);
        self.previous = Some((name, wanted));
        Some((name, wanted, after))
    }
}

impl<'a, F: Fn(&str) -> bool> Iterator for Samples<'a, F> {
    type Item = Sample<'a>;

    fn next(&mut self) -> Option<Sample<'a>> {
        while !self.rest.is_empty() {
            let text = skip_blanks(self.rest);
            let Some((name, wanted, after)) = self.name(text) else {
                let (line, rest) = split_line(text);
                self.rest = rest;
                if !(line.is_empty() || line.starts_with('#')) {
                    self.malformed += 1;
                }
                continue;
            };
            let (line, rest) = split_line(after);
            self.rest = rest;
            if !wanted {
                continue;
            }
            match sample(name, line) {
                Some(sample) => return Some(sample),
                None => self.malformed += 1,
            }
        }
        None
    }
}

/// One sample line. Its labels were validated when it was read, so [`Sample::labels`] yields all of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the line carries a timestamp.
    pub timestamp_ms: Option<i64>,
    /// The label list between the braces, values still escaped; empty without braces.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// The labels in the order they were written, values unescaped.
    pub fn labels(&self) -> Labels<'a> {
        Labels { rest: self.labels }
    }

    /// The value of the first label called `name`, unescaped.
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        let mut labels = self.labels();
        while let Some((label, value)) = labels.next_raw() {
            if label == name {
                return Some(unescape(value));
            }
        }
        None
    }
}

/// A sample's labels as `(name, value)`; a value is borrowed unless it held an escape.
#[derive(Clone, Debug)]
pub struct Labels<'a> {
    /// The validated label list not yet yielded.
    rest: &'a str,
}

impl<'a> Labels<'a> {
    /// The next pair with its value still escaped, so a lookup by name unescapes only the match.
    fn next_raw(&mut self) -> Option<(&'a str, &'a str)> {
        // The list was validated, so the only failure left is its end.
        let (name, value, rest) = label_pair(skip_blanks(self.rest))?;
        self.rest = rest;
        Some((name, value))
    }
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        self.next_raw().map(|(name, value)| (name, unescape(value)))
    }
}

/// Parses what follows a wanted metric name on its line: labels, value and timestamp.
fn sample<'a>(name: &'a str, line: &'a str) -> Option<Sample<'a>> {
    let (labels, rest) = match skip_blanks(line).strip_prefix('{') {
        Some(list) => label_list(list)?,
        // Without labels the name must end at a blank: `name1.0` or `name=1` is not a sample.
        None if line.starts_with(BLANKS) => ("", line),
        None => return None,
    };
    let mut fields = rest.split(BLANKS).filter(|field| !field.is_empty());
    let value = fields.next()?.parse().ok()?;
    let timestamp_ms = match fields.next() {
        Some(field) => Some(field.parse().ok()?),
        None => None,
    };
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name,
        value,
        timestamp_ms,
        labels,
    })
}

/// Validates the label list that follows `{`. Returns the list up to its closing brace and what follows
/// the brace.
fn label_list(list: &str) -> Option<(&str, &str)> {
    let mut rest = skip_blanks(list);
    while !rest.starts_with('}') {
        let (_, _, after) = label_pair(rest)?;
        rest = skip_blanks(after);
    }
    let (labels, brace) = list.split_at_checked(list.len() - rest.len())?;
    Some((labels, brace.get(1..)?))
}

/// Splits `name="value"` off the front of `text`: the name, the still-escaped value, and the rest after
/// a separating comma. Without a comma the pair must be the last, so the rest is empty or starts at `}`.
fn label_pair(text: &str) -> Option<(&str, &str, &str)> {
    let (name, rest) = split_name(text, LABEL);
    if name.is_empty() {
        return None;
    }
    let rest = skip_blanks(skip_blanks(rest).strip_prefix('=')?);
    let (value, rest) = quoted(rest.strip_prefix('"')?)?;
    let rest = skip_blanks(rest);
    match rest.strip_prefix(',') {
        Some(after_comma) => Some((name, value, after_comma)),
        None if rest.is_empty() || rest.starts_with('}') => Some((name, value, rest)),
        None => None,
    }
}

/// Splits a label value that follows its opening quote into the still-escaped value and what follows the
/// closing quote. Fails on an unterminated value or an escape other than `\\`, `\"` and `\n`.
fn quoted(text: &str) -> Option<(&str, &str)> {
    let mut bytes = text.bytes().enumerate();
    while let Some((at, byte)) = bytes.next() {
        match byte {
            b'"' => {
                let (value, rest) = text.split_at_checked(at)?;
                return Some((value, rest.get(1..)?));
            }
            b'\\' if !matches!(bytes.next(), Some((_, b'\\' | b'"' | b'n'))) => return None,
            _ => {}
        }
    }
    None
}

/// Resolves the escapes of a validated label value, borrowing it when it has none.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some((plain, escaped)) = rest.split_once('\\') {
        out.push_str(plain);
        let mut chars = escaped.chars();
        match chars.next() {
            Some('n') => out.push('\n'),
            // `\\` and `\"`: validation admitted no other escape.
            Some(other) => out.push(other),
            None => {}
        }
        rest = chars.as_str();
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// Splits the name at the front of `text`, of bytes in `class` and not starting with a digit, from what
/// follows; the name is empty if `text` does not start with one.
#[inline]
fn split_name(text: &str, class: u8) -> (&str, &str) {
    let bytes = text.as_bytes();
    let len = match bytes.first() {
        Some(first) if !first.is_ascii_digit() => bytes
            .iter()
            .position(|&b| !is_name_byte(b, class))
            .unwrap_or(bytes.len()),
        _ => 0,
    };
    text.split_at_checked(len).unwrap_or(("", text))
}

/// Splits off the first line, without its LF or CRLF, from the text after it. It runs on every line,
/// where a call would cost about as much as its work, so it is inlined, as are [`split_name`] and
/// [`skip_blanks`].
#[inline]
fn split_line(text: &str) -> (&str, &str) {
    let (line, rest) = match text.split_at_checked(line_end(text.as_bytes())) {
        Some((line, newline)) => (line, newline.get(1..).unwrap_or("")),
        None => (text, ""),
    };
    (line.strip_suffix('\r').unwrap_or(line), rest)
}

/// The offset of the first `\n` in `bytes`, or its length. Skipping unwanted lines is most of the
/// scraper's work, so the search tests sixteen bytes per step, as two words the compiler compares in one
/// vector register.
fn line_end(bytes: &[u8]) -> usize {
    let (words, _) = bytes.as_chunks::<8>();
    let (pairs, _) = words.as_chunks::<2>();
    for (index, [low, high]) in pairs.iter().enumerate() {
        let (low, high) = (newlines(*low), newlines(*high));
        if low | high != 0 {
            let bit = if low != 0 {
                low.trailing_zeros()
            } else {
                64 + high.trailing_zeros()
            };
            return index * 16 + bit as usize / 8;
        }
    }
    let done = pairs.len() * 16;
    let tail = bytes.get(done..).unwrap_or_default();
    done + tail.iter().position(|&b| b == b'\n').unwrap_or(tail.len())
}

/// Marks the newlines of `word`: the top bit of its lowest newline byte is set. A byte of
/// `word ^ NEWLINES` is zero where `word` holds a newline, and `(x - 0x01…) & !x & 0x80…` sets the top
/// bit of the lowest zero byte of `x`; the borrow may set bits above it, so only the lowest counts.
fn newlines(word: [u8; 8]) -> u64 {
    const ONES: u64 = u64::from_le_bytes([0x01; 8]);
    const TOPS: u64 = u64::from_le_bytes([0x80; 8]);
    const NEWLINES: u64 = u64::from_le_bytes([b'\n'; 8]);
    let x = u64::from_le_bytes(word) ^ NEWLINES;
    x.wrapping_sub(ONES) & !x & TOPS
}

#[inline]
fn skip_blanks(text: &str) -> &str {
    let blanks = text
        .bytes()
        .take_while(|&b| b == b' ' || b == b'\t')
        .count();
    text.get(blanks..).unwrap_or(text)
}

/// Bytes of metric names, `[a-zA-Z0-9_:]`.
const METRIC: u8 = 1;
/// Bytes of label names, `[a-zA-Z0-9_]`.
const LABEL: u8 = 2;

/// The name classes of every byte. Scanning names is most of the per-line work, and a table lookup is
/// one load where the range tests are several compares.
#[allow(
    clippy::indexing_slicing,
    reason = "evaluated at compile time, where an index out of bounds fails the build"
)]
const NAME_BYTES: [u8; 256] = {
    let mut table = [0; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        if b.is_ascii_alphanumeric() || b == b'_' {
            table[byte] = METRIC | LABEL;
        } else if b == b':' {
            table[byte] = METRIC;
        }
        byte += 1;
    }
    table
};

fn is_name_byte(b: u8, class: u8) -> bool {
    NAME_BYTES
        .get(usize::from(b))
        .is_some_and(|classes| classes & class != 0)
}

#[cfg(test)]
mod tests;

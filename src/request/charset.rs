//! The character encodings a JSON body may arrive in, read as the engines read them.
//!
//! vLLM's and SGLang's HTTP servers are FastAPI: a JSON body is parsed by Starlette's `Request.json()`,
//! which is `json.loads` on the body's bytes. Python's `json.loads` detects the encoding of bytes itself
//! (`json.detect_encoding`): a UTF-32 or UTF-16 byte-order mark names that encoding (the mark is
//! dropped), a UTF-8 mark is skipped, and without a mark the zero bytes of the first characters tell
//! UTF-16 and UTF-32 apart from UTF-8, since JSON text starts with ASCII. So a client may send any of
//! them and be served; cachepick reads the same text, by the same rule, and routes it as the UTF-8 it
//! is. The body Envoy forwards is never changed: only cachepick's reading of it.

use std::borrow::Cow;

/// How a body's bytes encode its text, by `json.detect_encoding`'s rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charset {
    Utf8,
    /// UTF-8 after a byte-order mark (EF BB BF), which is skipped.
    Utf8Bom,
    Utf16Le,
    Utf16Be,
    Utf32Le,
    Utf32Be,
}

const BOM_UTF8: &[u8] = &[0xEF, 0xBB, 0xBF];
const BOM_UTF16_LE: &[u8] = &[0xFF, 0xFE];
const BOM_UTF16_BE: &[u8] = &[0xFE, 0xFF];
const BOM_UTF32_LE: &[u8] = &[0xFF, 0xFE, 0, 0];
const BOM_UTF32_BE: &[u8] = &[0, 0, 0xFE, 0xFF];

impl Charset {
    /// The encoding of `body` and the length of its byte-order mark. UTF-32's marks are looked for
    /// first: UTF-32LE's starts with UTF-16LE's.
    pub fn detect(body: &[u8]) -> (Charset, usize) {
        for (bom, charset) in [
            (BOM_UTF32_LE, Charset::Utf32Le),
            (BOM_UTF32_BE, Charset::Utf32Be),
            (BOM_UTF16_LE, Charset::Utf16Le),
            (BOM_UTF16_BE, Charset::Utf16Be),
            (BOM_UTF8, Charset::Utf8Bom),
        ] {
            if body.starts_with(bom) {
                return (charset, bom.len());
            }
        }
        // As Python's rule: a body of 3 bytes is UTF-8 whatever its zeros.
        if body.len() == 3 {
            return (Charset::Utf8, 0);
        }
        let charset = match *body {
            [0, 0, ..] if body.len() >= 4 => Charset::Utf32Be,
            [0, _, ..] => Charset::Utf16Be,
            [_, 0, 0, 0, ..] => Charset::Utf32Le,
            [_, 0, ..] => Charset::Utf16Le,
            _ => Charset::Utf8,
        };
        (charset, 0)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Charset::Utf8 => "utf-8",
            Charset::Utf8Bom => "utf-8-bom",
            Charset::Utf16Le => "utf-16le",
            Charset::Utf16Be => "utf-16be",
            Charset::Utf32Le => "utf-32le",
            Charset::Utf32Be => "utf-32be",
        }
    }
}

/// `body` as UTF-8 bytes: itself when it is UTF-8 (any validation is the reader's), without its mark
/// when it has one, else transcoded. A unit that is no character (an unpaired surrogate, a code point
/// beyond U+10FFFF, a truncated last unit) becomes U+FFFD: the engine cannot tokenize such a character
/// either, and the rest of the prompt still routes. `None` when the UTF-8 would exceed `limit` bytes
/// (a UTF-16 body grows by up to half in UTF-8): the caller routes it by load, unread.
pub fn to_utf8(body: &[u8], limit: usize) -> Option<Cow<'_, [u8]>> {
    let (charset, bom) = Charset::detect(body);
    let units = body.get(bom..).unwrap_or_default();
    let text: String = match charset {
        Charset::Utf8 => return Some(Cow::Borrowed(body)),
        Charset::Utf8Bom => return Some(Cow::Borrowed(units)),
        Charset::Utf16Le | Charset::Utf16Be => {
            let little = charset == Charset::Utf16Le;
            let (pairs, rest) = units.as_chunks::<2>();
            let truncated = !rest.is_empty();
            let code_units = pairs.iter().map(|&pair| {
                if little {
                    u16::from_le_bytes(pair)
                } else {
                    u16::from_be_bytes(pair)
                }
            });
            let mut text = String::with_capacity(units.len().min(limit));
            for decoded in char::decode_utf16(code_units) {
                text.push(decoded.unwrap_or(char::REPLACEMENT_CHARACTER));
                if text.len() > limit {
                    return None;
                }
            }
            if truncated {
                text.push(char::REPLACEMENT_CHARACTER);
            }
            text
        }
        Charset::Utf32Le | Charset::Utf32Be => {
            let little = charset == Charset::Utf32Le;
            let (quads, rest) = units.as_chunks::<4>();
            let truncated = !rest.is_empty();
            let mut text = String::with_capacity(quads.len().min(limit));
            for &quad in quads {
                let scalar = if little {
                    u32::from_le_bytes(quad)
                } else {
                    u32::from_be_bytes(quad)
                };
                text.push(char::from_u32(scalar).unwrap_or(char::REPLACEMENT_CHARACTER));
                if text.len() > limit {
                    return None;
                }
            }
            if truncated {
                text.push(char::REPLACEMENT_CHARACTER);
            }
            text
        }
    };
    (text.len() <= limit).then(|| Cow::Owned(text.into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{"model":"m","messages":[{"role":"user","content":"héllo 🌍"}]}"#;

    fn utf16(text: &str, little: bool, bom: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let units = bom.then_some(0xFEFF).into_iter().chain(text.encode_utf16());
        for unit in units {
            out.extend(if little {
                unit.to_le_bytes()
            } else {
                unit.to_be_bytes()
            });
        }
        out
    }

    fn utf32(text: &str, little: bool, bom: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let scalars = bom
            .then_some(0xFEFF)
            .into_iter()
            .chain(text.chars().map(u32::from));
        for scalar in scalars {
            out.extend(if little {
                scalar.to_le_bytes()
            } else {
                scalar.to_be_bytes()
            });
        }
        out
    }

    #[test]
    fn every_encoding_json_loads_accepts_reads_as_the_same_utf8() {
        let mut bom = BOM_UTF8.to_vec();
        bom.extend(JSON.as_bytes());
        let cases = [
            (JSON.as_bytes().to_vec(), Charset::Utf8),
            (bom, Charset::Utf8Bom),
            (utf16(JSON, true, true), Charset::Utf16Le),
            (utf16(JSON, true, false), Charset::Utf16Le),
            (utf16(JSON, false, true), Charset::Utf16Be),
            (utf16(JSON, false, false), Charset::Utf16Be),
            (utf32(JSON, true, true), Charset::Utf32Le),
            (utf32(JSON, true, false), Charset::Utf32Le),
            (utf32(JSON, false, true), Charset::Utf32Be),
            (utf32(JSON, false, false), Charset::Utf32Be),
        ];
        for (body, charset) in cases {
            assert_eq!(Charset::detect(&body).0, charset, "{body:?}");
            let read = to_utf8(&body, 1 << 20).expect("within the limit");
            assert_eq!(std::str::from_utf8(&read), Ok(JSON), "{}", charset.as_str());
        }
        // Plain UTF-8 (and its BOM form) is never copied.
        assert!(matches!(
            to_utf8(JSON.as_bytes(), 1 << 20),
            Some(Cow::Borrowed(_))
        ));
    }

    #[test]
    fn units_that_are_no_character_become_replacement_characters() {
        // An unpaired surrogate, then a truncated last unit.
        let mut body = utf16("{\"a\":\"", true, false);
        body.extend(0xD800_u16.to_le_bytes());
        body.extend(utf16("\"}", true, false));
        body.push(b'x');
        let read = to_utf8(&body, 1 << 20).expect("read");
        assert_eq!(
            std::str::from_utf8(&read),
            Ok("{\"a\":\"\u{FFFD}\"}\u{FFFD}")
        );
        let mut body = utf32("{", false, false);
        body.extend(0x0011_0000_u32.to_be_bytes());
        let read = to_utf8(&body, 1 << 20).expect("read");
        assert_eq!(std::str::from_utf8(&read), Ok("{\u{FFFD}"));
        // Short and empty bodies are UTF-8 (the JSON reader refuses them as it would anyway).
        for body in [&b""[..], b"{", b"{}", b"{\0\0"] {
            assert_eq!(Charset::detect(body).0, Charset::Utf8);
        }
    }

    #[test]
    fn a_transcoded_body_over_the_limit_is_not_read() {
        // 1,000 CJK characters: 2,000 bytes of UTF-16, 3,000 of UTF-8.
        let text = format!("{{\"p\":\"{}\"}}", "漢".repeat(1000));
        let body = utf16(&text, true, true);
        assert!(to_utf8(&body, text.len()).is_some());
        assert!(to_utf8(&body, text.len() - 1).is_none());
        assert!(body.len() < text.len());
    }
}

//! Compressed request bodies: `content-encoding` undone before the body is read.
//!
//! Envoy hands ext_proc the body as the client sent it; a client (or an SDK) that compresses its request
//! bodies would otherwise get a 400 "not UTF-8" from a picker whose engine behind it accepts them.
//! `gzip` (`x-gzip`), `deflate` (zlib-wrapped as HTTP says, or raw as some clients send it), `br` and
//! `zstd` are decoded, in the reverse order of the header's list; `identity` is nothing to undo.
//!
//! The output is bounded, not the input: every decoder reads through a limit of `max_body_bytes` plus
//! one byte, so a small body that expands without end (a decompression bomb) stops at the limit with
//! [`EncodingError::TooLarge`] after doing at most that much work. What cannot be decoded is routed by
//! load by the caller, never refused: the engine may still understand it, and affinity is only an
//! optimisation.

use std::borrow::Cow;
use std::io::{self, Read};

use thiserror::Error;

/// Content codings applied one after the other; more layers than this is not a real client.
const MAX_LAYERS: usize = 2;

/// The read buffer of the brotli decoder: its own default.
const BROTLI_BUFFER: usize = 4096;

/// Why a compressed body could not be read; each is a label of `cachepick_body_decoding_total`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum EncodingError {
    #[error("content-encoding {0:?} is not one cachepick decodes (gzip, deflate, br, zstd)")]
    Unsupported(String),
    #[error("the body is not valid {encoding}: {detail}")]
    Corrupt {
        encoding: &'static str,
        detail: String,
    },
    #[error("the body decodes to more than {limit} bytes")]
    TooLarge { limit: usize },
}

impl EncodingError {
    /// The metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            EncodingError::Unsupported(_) => "unsupported",
            EncodingError::Corrupt { .. } => "corrupt",
            EncodingError::TooLarge { .. } => "too_large",
        }
    }
}

/// One content coding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
    Brotli,
    Zstd,
}

impl Coding {
    pub const ALL: [Coding; 4] = [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd];

    /// The header's token, and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
            Coding::Brotli => "br",
            Coding::Zstd => "zstd",
        }
    }

    fn parse(token: &str) -> Option<Coding> {
        match token.to_ascii_lowercase().as_str() {
            "gzip" | "x-gzip" => Some(Coding::Gzip),
            "deflate" => Some(Coding::Deflate),
            "br" => Some(Coding::Brotli),
            "zstd" => Some(Coding::Zstd),
            _ => None,
        }
    }
}

/// The codings a `content-encoding` value lists, in the order they were applied; identity entries are
/// dropped, so an empty list means the body is as sent.
pub fn codings(content_encoding: &str) -> Result<Vec<Coding>, EncodingError> {
    let mut codings = Vec::new();
    for token in content_encoding
        .split(',')
        .map(str::trim)
        .filter(|token| !token.is_empty() && !token.eq_ignore_ascii_case("identity"))
    {
        let coding =
            Coding::parse(token).ok_or_else(|| EncodingError::Unsupported(token.to_owned()))?;
        codings.push(coding);
    }
    if codings.len() > MAX_LAYERS {
        return Err(EncodingError::Unsupported(content_encoding.to_owned()));
    }
    Ok(codings)
}

/// `body` with `content_encoding` undone, at most `limit` bytes of it; borrowed when there is nothing
/// to undo.
pub fn decode<'b>(
    content_encoding: Option<&str>,
    body: &'b [u8],
    limit: usize,
) -> Result<Cow<'b, [u8]>, EncodingError> {
    let codings = match content_encoding {
        Some(header) => codings(header)?,
        None => Vec::new(),
    };
    let mut decoded = Cow::Borrowed(body);
    for coding in codings.into_iter().rev() {
        decoded = Cow::Owned(decode_one(coding, &decoded, limit)?);
    }
    Ok(decoded)
}

fn decode_one(coding: Coding, input: &[u8], limit: usize) -> Result<Vec<u8>, EncodingError> {
    match coding {
        Coding::Gzip => bounded(coding, flate2::read::MultiGzDecoder::new(input), limit),
        // HTTP's deflate is zlib-wrapped; some clients send the raw stream, which is tried when the
        // zlib stream does not read.
        Coding::Deflate => match bounded(coding, flate2::read::ZlibDecoder::new(input), limit) {
            Err(EncodingError::Corrupt { .. }) => {
                bounded(coding, flate2::read::DeflateDecoder::new(input), limit)
            }
            decoded => decoded,
        },
        Coding::Brotli => bounded(
            coding,
            brotli_decompressor::Decompressor::new(input, BROTLI_BUFFER),
            limit,
        ),
        Coding::Zstd => {
            let decoder = ruzstd::decoding::StreamingDecoder::new(input)
                .map_err(|error| corrupt(coding, error))?;
            bounded(coding, decoder, limit)
        }
    }
}

fn corrupt(coding: Coding, error: impl std::fmt::Display) -> EncodingError {
    EncodingError::Corrupt {
        encoding: coding.as_str(),
        detail: error.to_string(),
    }
}

/// Reads `reader` to its end, failing once it yields more than `limit` bytes.
fn bounded(coding: Coding, reader: impl Read, limit: usize) -> Result<Vec<u8>, EncodingError> {
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    reader
        .take(cap)
        .read_to_end(&mut out)
        .map_err(|error: io::Error| corrupt(coding, error))?;
    if out.len() > limit {
        return Err(EncodingError::TooLarge { limit });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn raw_deflate(data: &[u8]) -> Vec<u8> {
        let mut encoder =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn each_coding_decodes_and_identity_borrows() {
        let body = br#"{"prompt":"hello"}"#;
        assert!(matches!(decode(None, body, 100), Ok(Cow::Borrowed(_))));
        assert!(matches!(
            decode(Some("identity"), body, 100),
            Ok(Cow::Borrowed(_))
        ));
        for (header, encoded) in [
            ("gzip", gzip(body)),
            ("x-gzip", gzip(body)),
            ("GZIP", gzip(body)),
            ("deflate", zlib(body)),
            ("deflate", raw_deflate(body)),
        ] {
            assert_eq!(
                decode(Some(header), &encoded, 100).unwrap().as_ref(),
                body,
                "{header}"
            );
        }
        // Two layers, applied gzip first: undone in reverse.
        let twice = gzip(&zlib(body));
        assert_eq!(
            decode(Some("deflate, gzip"), &twice, 100).unwrap().as_ref(),
            body
        );
    }

    #[test]
    fn brotli_and_zstd_decode_their_reference_frames() {
        // Frames written by the reference encoders (`brotli -c`, `zstd -c`) of `{"prompt":"hi"}`.
        let brotli = [
            0x0b, 0x07, 0x80, 0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22,
            0x68, 0x69, 0x22, 0x7d, 0x03,
        ];
        assert_eq!(
            decode(Some("br"), &brotli, 100).unwrap().as_ref(),
            br#"{"prompt":"hi"}"#
        );
        let zstd = [
            0x28, 0xb5, 0x2f, 0xfd, 0x04, 0x58, 0x79, 0x00, 0x00, 0x7b, 0x22, 0x70, 0x72, 0x6f,
            0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0x68, 0x69, 0x22, 0x7d, 0x33, 0x91, 0x55, 0x2f,
        ];
        assert_eq!(
            decode(Some("zstd"), &zstd, 100).unwrap().as_ref(),
            br#"{"prompt":"hi"}"#
        );
    }

    #[test]
    fn the_output_is_bounded_whatever_the_input() {
        // 64 MiB of zeros compress to about 64 KiB; decoding stops at the limit.
        let bomb = gzip(&vec![0_u8; 64 << 20]);
        assert!(bomb.len() < 1 << 20);
        assert_eq!(
            decode(Some("gzip"), &bomb, 1 << 20),
            Err(EncodingError::TooLarge { limit: 1 << 20 })
        );
        let exact = gzip(&[b'x'; 100]);
        assert_eq!(decode(Some("gzip"), &exact, 100).unwrap().len(), 100);
        assert_eq!(
            decode(Some("gzip"), &exact, 99),
            Err(EncodingError::TooLarge { limit: 99 })
        );
    }

    #[test]
    fn unknown_codings_and_corrupt_bodies_are_typed_errors() {
        assert_eq!(
            decode(Some("compress"), b"x", 10),
            Err(EncodingError::Unsupported("compress".to_owned()))
        );
        assert!(matches!(
            decode(Some("gzip, gzip, gzip"), b"x", 10),
            Err(EncodingError::Unsupported(_))
        ));
        for header in ["gzip", "deflate", "br", "zstd"] {
            let error = decode(Some(header), b"definitely not compressed", 1000).unwrap_err();
            assert_eq!(error.as_str(), "corrupt", "{header}: {error}");
        }
    }
}

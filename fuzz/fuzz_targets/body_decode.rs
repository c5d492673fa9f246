//! Fuzzes the content-encoding decoders, `request::encoding::decode`, with any bytes under each coding
//! and a small output limit, and checks what must hold for any input: no panic, and never more output
//! than the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

use cachepick::request::encoding::decode;

const HEADERS: [&str; 7] = ["gzip", "deflate", "br", "zstd", "gzip, br", "identity", "x"];

fuzz_target!(|input: (u8, u16, &[u8])| {
    let (selector, limit, body) = input;
    let header = HEADERS[usize::from(selector) % HEADERS.len()];
    let limit = usize::from(limit);
    if let Ok(decoded) = decode(Some(header), body, limit) {
        assert!(decoded.len() <= limit.max(body.len()));
    }
});

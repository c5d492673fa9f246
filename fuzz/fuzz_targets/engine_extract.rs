//! Fuzzes the engine readers that turn a scrape body into per-rank load: any bytes, either engine, any
//! `dp_size` up to 8, and the `/v1/loads` JSON reader. They must never panic, and a report must have
//! exactly `dp_size` ranks.
#![no_main]

use cachepick::load::{from_loads_json, from_metrics};
use cachepick::worker::Engine;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, &[u8])| {
    let (selector, body) = input;
    let dp_size = u32::from(selector % 8) + 1;
    let engine = if selector & 0x80 == 0 { Engine::Vllm } else { Engine::Sglang };
    let text = String::from_utf8_lossy(body);
    if let Ok(report) = from_metrics(engine, &text, dp_size) {
        assert_eq!(report.ranks.len(), dp_size as usize);
        assert!(report.ranks.iter().any(Option::is_some));
    }
    if let Ok(report) = from_loads_json(body, dp_size) {
        assert_eq!(report.ranks.len(), dp_size as usize);
    }
});

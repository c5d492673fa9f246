//! Running `cachepick replay` from a test, and the tiny trace the end-to-end replay tests share.

#![allow(dead_code)] // each test binary uses a different part

use std::fmt::Write as _;
use std::process::Command;

/// 30 requests over 3 s in Mooncake's JSONL form: five conversations whose turns extend each other's
/// 512-token blocks, so a router that keeps a conversation on one worker finds its earlier turns cached.
pub fn tiny_trace() -> String {
    let mut text = String::new();
    for index in 0..30_u64 {
        let conversation = index % 5;
        let turn = index / 5;
        let blocks = 2 + turn;
        let ids: Vec<String> = (0..blocks)
            .map(|block| (conversation * 100 + block).to_string())
            .collect();
        let input = blocks * 512 - 100;
        let _ = writeln!(
            text,
            "{{\"timestamp\": {}, \"input_length\": {input}, \"output_length\": 8, \"hash_ids\": [{}]}}",
            index * 100,
            ids.join(", ")
        );
    }
    text
}

/// Runs `cachepick replay` with `args` and returns its success, stdout and stderr, whatever the
/// outcome: for the tests that expect a refusal.
pub fn replay_status(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(cachepick_rig::cachepick_binary())
        .arg("replay")
        .args(args)
        .output()
        .expect("cachepick runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `cachepick replay` with `args`, which must succeed, and returns its stdout and stderr.
pub fn replay(args: &[&str]) -> (String, String) {
    let (ok, stdout, stderr) = replay_status(args);
    assert!(ok, "cachepick replay {args:?} failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

//! The binary's contract at its own crate: every subcommand is there, and a bad configuration exits 2
//! with every problem listed. (The behaviour of each command is tested at the workspace root, in
//! `tests/cli.rs` and beside the features; this package's tests also make `cargo test` build the binary
//! those tests run.)

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::Write;
use std::process::Command;

fn cachepick(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cachepick"))
        .args(args)
        .output()
        .expect("the cachepick binary runs")
}

#[test]
fn help_lists_every_subcommand() {
    let output = cachepick(&["--help"]);
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for command in [
        "serve",
        "check",
        "explain",
        "snapshot",
        "sim",
        "envoy-config",
        "demo",
        "replay",
    ] {
        assert!(
            help.lines()
                .any(|line| line.trim_start().starts_with(command)),
            "`{command}` missing from:\n{help}"
        );
    }
}

#[test]
fn a_bad_configuration_and_a_bad_simulator_file_both_exit_2_listing_every_problem() {
    let mut config = tempfile_in_target("bad.yaml");
    config
        .1
        .write_all(b"policy:\n  worker_queue_limit: 0\n  bogus: 1\n")
        .expect("write");
    let output = cachepick(&["check", "--config", config.0.to_str().expect("utf-8 path")]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("policy.worker_queue_limit (line 2): must be at least 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("policy.bogus (line 3): unknown key"),
        "{stderr}"
    );

    let mut sim = tempfile_in_target("bad-sim.yaml");
    sim.1
        .write_all(b"engine: vllm\nworkers: 0\njitter: 9\n")
        .expect("write");
    let output = cachepick(&["sim", "--config", sim.0.to_str().expect("utf-8 path")]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("workers (line 2): must be at least 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("jitter (line 3): must be between 0 and 0.5"),
        "{stderr}"
    );
}

/// A file under this test's temporary target directory.
fn tempfile_in_target(name: &str) -> (std::path::PathBuf, std::fs::File) {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let file = std::fs::File::create(&path).expect("create");
    (path, file)
}

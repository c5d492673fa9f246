//! The binary's contract at its own crate: every subcommand is there, and a bad configuration exits 2
//! with every problem listed. (The behaviour of each command is tested at the workspace root, in
//! `tests/cli.rs` and beside the features; this package's tests also make `cargo test` build the binary
//! those tests run.)

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

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
    let problems = [
        "policy.worker_queue_limit (line 2): must be at least 1",
        "policy.bogus (line 3): unknown key",
    ];
    refused_with(
        "check",
        "policy:\n  worker_queue_limit: 0\n  bogus: 1\n",
        &problems,
    );
    let problems = [
        "workers (line 2): must be at least 1",
        "jitter (line 3): must be between 0 and 0.5",
    ];
    refused_with("sim", "engine: vllm\nworkers: 0\njitter: 9\n", &problems);
}

/// Runs `cachepick <command> --config FILE` on a file holding `yaml`: it must exit 2 and list each of
/// `problems` on stderr.
fn refused_with(command: &str, yaml: &str, problems: &[&str]) {
    let path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bad-{command}.yaml"));
    std::fs::write(&path, yaml).expect("write the file");
    let output = cachepick(&[command, "--config", path.to_str().expect("a UTF-8 path")]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    for problem in problems {
        assert!(stderr.contains(problem), "{problem:?} not in:\n{stderr}");
    }
}

//! A command line as a person runs it: through `sh -c`, in a directory, with the `cachepick` under test
//! first on the PATH, so a line a file prints (a "regenerate with" header) runs exactly as written.

#![allow(dead_code)] // not every test binary uses every helper

use std::path::Path;
use std::process::{Command, Output};

/// Runs `command` in a POSIX shell in `dir`; panics, with its stderr, unless it succeeds.
pub fn run(command: &str, dir: &Path) -> Output {
    let binary = cachepick_rig::cachepick_binary();
    let bin_dir = binary.parent().expect("the binary's directory");
    let path = std::env::join_paths(std::iter::once(bin_dir.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("a PATH");
    let output = Command::new("sh")
        .arg("-c")
        .arg(command)
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .expect("sh runs");
    assert!(
        output.status.success(),
        "`{command}` failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The command under "regenerate with" in a generated Envoy bootstrap's header, without its `> FILE`.
pub fn regenerate_command(text: &str) -> &str {
    let line = text.lines().nth(1).expect("a header of more than one line");
    line.trim_start_matches('#')
        .trim()
        .strip_suffix(" > FILE")
        .unwrap_or_else(|| panic!("no `> FILE` on the regeneration line: {line}"))
}

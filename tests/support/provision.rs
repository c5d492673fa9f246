//! Runs one of the project's `scripts/provision-*` scripts, which install a real tool under `target/` at a
//! pinned version (Envoy, promtool, the peer routers) and print one absolute path on stdout.
//!
//! A test that needs the tool and cannot get it fails with the script's own reason; it never skips.

#![allow(dead_code)]
// each test binary uses a different part

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Runs `scripts/<name>` and returns the path it printed, which must exist. Panics, with the script's
/// stderr and what the tool is `needed_for`, when the script fails or prints anything else.
pub fn script(name: &str, needed_for: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name);
    let output = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", script.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed ({}); {needed_for}:\n{stderr}",
        script.display(),
        output.status
    );
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(
        path.is_absolute() && path.exists(),
        "{} printed `{}`, not a path that exists; stderr:\n{stderr}",
        script.display(),
        path.display()
    );
    path
}

//! The routers `cachepick replay --front` compares cachepick with — `smg` and `vllm-router` from PyPI at
//! the versions `scripts/provision-peers` pins — installed under target/ by that script.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The directory holding `smg` and `vllm-router` (once per process). Panics with the script's stderr if
/// they cannot be installed: a comparison with a router that is not there is not skipped.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(provision).clone()
}

fn provision() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/provision-peers");
    let output = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", script.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed ({}); the replay cannot compare cachepick with smg and vllm-router without them:\n{stderr}",
        script.display(),
        output.status
    );
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    for program in ["smg", "vllm-router"] {
        assert!(
            dir.join(program).is_file(),
            "{} printed `{}`, which holds no {program}; stderr:\n{stderr}",
            script.display(),
            dir.display()
        );
    }
    dir
}

//! The routers `cachepick replay` compares cachepick with — `smg` and `vllm-router` for `--front`, and
//! the Python with NVIDIA Dynamo's runtime for `--dynamo-selector`, from PyPI at the versions
//! `scripts/provision-peers` pins — installed under target/ by that script.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The directory holding `smg`, `vllm-router` and that `python` (once per process). Panics with the script's stderr if
/// they cannot be installed: a comparison with a router that is not there is not skipped.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(provision).clone()
}

fn provision() -> PathBuf {
    let dir = super::provision::script(
        "provision-peers",
        "the replay cannot compare cachepick with smg, vllm-router and Dynamo's router without them",
    );
    for program in ["smg", "vllm-router", "python"] {
        assert!(
            dir.join(program).is_file(),
            "scripts/provision-peers printed `{}`, which holds no {program}",
            dir.display()
        );
    }
    dir
}

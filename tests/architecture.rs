//! Architecture invariants that a grep can hold, checked on every test run.

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("source directory is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

fn sources() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(
        files.len() > 5,
        "found the sources under {}",
        root.display()
    );
    files
        .into_iter()
        .map(|path| {
            let text = fs::read_to_string(&path).expect("source is UTF-8");
            (
                path.strip_prefix(&root).expect("under src").to_path_buf(),
                text,
            )
        })
        .collect()
}

#[test]
fn only_the_extproc_module_sees_protobuf_and_grpc_types() {
    let wire_crates = ["envoy_types", "prost", "tonic", "tonic_health"];
    let offenders: Vec<String> = sources()
        .into_iter()
        .filter(|(path, _)| !path.starts_with("extproc"))
        .flat_map(|(path, text)| {
            wire_crates
                .iter()
                .filter(|krate| text.contains(&format!("{krate}::")))
                .map(|krate| format!("{} uses {krate}", path.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "protobuf types outside extproc/: {offenders:?}"
    );
}

#[test]
fn the_policy_never_awaits_nor_touches_io_or_metrics() {
    let forbidden = [
        "async ",
        ".await",
        "tokio",
        "std::io",
        "std::net::TcpStream",
        "prometheus",
        "tracing::",
    ];
    let offenders: Vec<String> = sources()
        .into_iter()
        .filter(|(path, _)| path.starts_with("policy"))
        .flat_map(|(path, text)| {
            forbidden
                .iter()
                .filter(|needle| text.contains(*needle))
                .map(|needle| format!("{} contains `{needle}`", path.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "the policy must stay pure: {offenders:?}"
    );
}

#[test]
fn anyhow_is_used_only_by_the_binary() {
    let offenders: Vec<PathBuf> = sources()
        .into_iter()
        .filter(|(path, text)| path != Path::new("main.rs") && text.contains("anyhow"))
        .map(|(path, _)| path)
        .collect();
    assert!(
        offenders.is_empty(),
        "library modules use typed errors: {offenders:?}"
    );
}

/// The simulator must not agree with the picker by construction: it parses bodies, hashes blocks and
/// keeps its cache with code of its own. Only the tokenizer is shared, as an engine shares the model's
/// tokenizer with the router in front of it. Test code inside a file (after `#[cfg(test)]`) may use the
/// picker's readers to prove the simulator's output is readable.
#[test]
fn the_simulator_shares_no_code_with_the_routing_path() {
    let routing = [
        "crate::request",
        "crate::prefix",
        "crate::policy",
        "crate::route",
        "crate::load",
        "super::super::",
    ];
    let offenders: Vec<String> = sources()
        .into_iter()
        .filter(|(path, _)| path.starts_with("sim"))
        .flat_map(|(path, text)| {
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_owned();
            routing
                .iter()
                .filter(|needle| code.contains(*needle))
                .map(|needle| format!("{} uses {needle}", path.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "the simulator reaches into the routing path: {offenders:?}"
    );
}

/// Dependencies point down: the modules below never import the ones above them (test code excepted).
#[test]
fn lower_modules_do_not_import_upper_ones() {
    let rules: [(&str, &[&str]); 4] = [
        ("protocol.rs", &["crate::"]),
        (
            "prefix",
            &["crate::policy", "crate::route", "crate::metrics"],
        ),
        ("load", &["crate::metrics", "crate::route", "crate::app"]),
        (
            "route",
            &["crate::metrics_server", "crate::extproc", "crate::app"],
        ),
    ];
    let offenders: Vec<String> = sources()
        .into_iter()
        .flat_map(|(path, text)| {
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_owned();
            rules
                .iter()
                .filter(|(module, _)| path.starts_with(module))
                .flat_map(|(_, forbidden)| forbidden.iter())
                .filter(|needle| code.contains(**needle))
                .map(|needle| format!("{} uses {needle}", path.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "an import points up the layers: {offenders:?}"
    );
}

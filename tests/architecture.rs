//! Architecture invariants that Cargo cannot express, checked on every test run.
//!
//! What Cargo does express is left to it: the simulator does not depend on the product (its manifest
//! names no product crate, and the first test below keeps it so), the product cannot import the rig or
//! the binary (that would be a package cycle), and `anyhow` is a dependency of the binary alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

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

/// Every `needle` found in a source file under `src/` that `in_scope` takes (by its path there), as
/// `describe` names it.
fn offenders(
    in_scope: impl Fn(&Path) -> bool,
    needles: &[impl AsRef<str>],
    describe: impl Fn(&Path, &str) -> String,
) -> Vec<String> {
    sources()
        .into_iter()
        .filter(|(path, _)| in_scope(path))
        .flat_map(|(path, text)| {
            needles
                .iter()
                .map(AsRef::as_ref)
                .filter(|needle| text.contains(needle))
                .map(|needle| describe(&path, needle))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn only_the_extproc_module_sees_protobuf_and_grpc_types() {
    let wire_crates = ["envoy_types", "prost", "tonic", "tonic_health"];
    let paths: Vec<String> = wire_crates
        .iter()
        .map(|krate| format!("{krate}::"))
        .collect();
    let offenders = offenders(
        |path| !path.starts_with("extproc"),
        &paths,
        |path, found| format!("{} uses {}", path.display(), found.trim_end_matches("::")),
    );
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
    let offenders = offenders(
        |path| path.starts_with("policy"),
        &forbidden,
        |path, needle| format!("{} contains `{needle}`", path.display()),
    );
    assert!(
        offenders.is_empty(),
        "the policy must stay pure: {offenders:?}"
    );
}

/// The clock ban of `clippy.toml` holds where decisions and their inputs are made: each of these
/// modules denies the lint the workspace allows.
#[test]
fn the_decision_modules_deny_clock_reads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for module in ["policy", "prefix", "request", "tokenize"] {
        let text = fs::read_to_string(root.join(module).join("mod.rs")).expect("the module's root");
        assert!(
            text.contains("#![deny(clippy::disallowed_methods)]"),
            "src/{module}/mod.rs must deny clippy::disallowed_methods (clippy.toml's clock ban)"
        );
    }
}

/// A source file's code outside its `#[cfg(test)]` part, without its comment lines.
fn code_of(text: &str) -> String {
    text.split("#[cfg(test)]")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names a source file's code refers to right after `prefix` (`crate::` gives the crate-level
/// modules), also inside grouped imports such as `use crate::{x, y::z}`.
fn names_after(text: &str, prefix: &str) -> Vec<String> {
    let code = code_of(text);
    let code = code.as_str();
    let mut modules = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find(';').unwrap_or(group.len())];
            // Only the group's own items name modules: `f::{G, H}` is module `f`, not `H`.
            let mut depth = 0_i32;
            let mut parts = vec![String::new()];
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => parts.push(String::new()),
                    _ if depth == 0 => parts.last_mut().expect("one part").push(c),
                    _ => {}
                }
            }
            for part in &parts {
                let name: String = part
                    .trim_start_matches(|c: char| c.is_whitespace() || c == '{')
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                modules.push(name);
            }
        } else {
            modules.push(
                rest.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    modules.retain(|name| !name.is_empty() && name != "self");
    modules.sort();
    modules.dedup();
    modules
}

/// The crate-level modules a source file refers to (`crate::x`), outside its `#[cfg(test)]` part.
fn crate_modules(text: &str) -> Vec<String> {
    names_after(text, "crate::")
}

/// Within each module directory, which sibling files each file imports (`super::x`, or
/// `crate::<module>::x`), by path under `src/`. A module's `mod.rs` is its root and declares the
/// others, so it is no node here.
fn sibling_imports(files: &[(PathBuf, String)]) -> Vec<(PathBuf, Vec<PathBuf>)> {
    files
        .iter()
        .filter(|(path, _)| path.parent().is_some_and(|dir| !dir.as_os_str().is_empty()))
        .filter(|(path, _)| path.file_name().is_some_and(|name| name != "mod.rs"))
        .map(|(path, text)| {
            let dir = path.parent().expect("in a module directory");
            let own = path
                .file_stem()
                .and_then(|stem| stem.to_str())
                .unwrap_or("");
            let module = dir.to_str().unwrap_or("").replace('/', "::");
            let mut names = names_after(text, "super::");
            names.extend(names_after(text, &format!("crate::{module}::")));
            let mut siblings: Vec<PathBuf> = names
                .iter()
                .filter(|name| name.as_str() != own)
                .map(|name| dir.join(format!("{name}.rs")))
                .filter(|sibling| files.iter().any(|(path, _)| path == sibling))
                .collect();
            siblings.sort();
            siblings.dedup();
            (path.clone(), siblings)
        })
        .collect()
}

/// One circle of imports between files, as `a.rs → b.rs → a.rs`, if there is any.
fn a_circle(graph: &[(PathBuf, Vec<PathBuf>)]) -> Option<String> {
    fn visit(
        node: &PathBuf,
        graph: &[(PathBuf, Vec<PathBuf>)],
        path: &mut Vec<PathBuf>,
        done: &mut Vec<PathBuf>,
    ) -> Option<String> {
        if let Some(at) = path.iter().position(|seen| seen == node) {
            let mut circle: Vec<String> = path[at..]
                .iter()
                .map(|file| file.display().to_string())
                .collect();
            circle.push(node.display().to_string());
            return Some(circle.join(" → "));
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.clone());
        let next = graph
            .iter()
            .find(|(file, _)| file == node)
            .map_or(&[][..], |(_, imports)| imports.as_slice());
        for import in next {
            if let Some(circle) = visit(import, graph, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.push(node.clone());
        None
    }
    let mut done = Vec::new();
    graph
        .iter()
        .find_map(|(file, _)| visit(file, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_files_import_each_other_in_a_circle() {
    let graph = sibling_imports(&sources());
    assert!(
        graph.iter().any(|(_, imports)| !imports.is_empty()),
        "the reader sees the imports between files"
    );
    if let Some(circle) = a_circle(&graph) {
        panic!(
            "files import each other in a circle: {circle}; move what both need to a file of its own"
        );
    }
}

#[test]
fn a_deliberate_circle_between_files_is_found() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_owned());
    let files = [
        file("route/mod.rs", "mod explain;\nmod picker;\nmod prepared;"),
        file("route/explain.rs", "use super::picker::Prepared;"),
        file(
            "route/picker.rs",
            "use super::{explain::Explanation, prepared};",
        ),
        file("route/prepared.rs", "use crate::prefix::OwnerMatch;"),
    ];
    assert_eq!(
        a_circle(&sibling_imports(&files)).as_deref(),
        Some("route/explain.rs → route/picker.rs → route/explain.rs")
    );
    // Breaking it the way the tree does: both import the leaf.
    let mut fixed = files.clone();
    fixed[1] = file("route/explain.rs", "use super::prepared::Prepared;");
    assert_eq!(a_circle(&sibling_imports(&fixed)), None);
    // A path through the crate root counts, and tests do not.
    fixed[3] = file(
        "route/prepared.rs",
        "use crate::route::picker::Picker;\n#[cfg(test)]\nuse super::explain::X;",
    );
    assert_eq!(
        a_circle(&sibling_imports(&fixed)).as_deref(),
        Some("route/explain.rs → route/prepared.rs → route/picker.rs → route/explain.rs")
    );
}

#[test]
fn the_module_reader_sees_grouped_imports() {
    let text = "use crate::a::B;\nuse crate::{c, d::E,\n  f::{G, H}};\nfn x() { crate::i::j(); }\n//! see `crate::k`";
    assert_eq!(crate_modules(text), ["a", "c", "d", "f", "i"]);
}

/// The simulator must not agree with the picker by construction. Its crate has no dependency on the
/// product, so Cargo refuses any import; this keeps that dependency from being added.
#[test]
fn the_simulator_crate_depends_on_no_product_crate() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/cachepick-sim/Cargo.toml");
    let text = fs::read_to_string(&manifest).expect("the simulator's manifest");
    for line in text.lines().map(str::trim) {
        for product in [
            "cachepick ",
            "cachepick=",
            "cachepick.",
            "cachepick-rig",
            "cachepick-cli",
        ] {
            assert!(
                !line.starts_with(product),
                "{} depends on the product: `{line}`",
                manifest.display()
            );
        }
    }
}

/// The product's modules in layers, lowest first. A module imports only modules of lower layers: no
/// upward arrow (the owner index reaching up to the policy for its own answer type, the scraper
/// reaching up to the metrics), and so no cycle.
const LAYERS: [&[&str]; 8] = [
    &["worker", "protocol", "tls", "auth", "connections", "health"],
    &["config"],
    &["request", "tokenize", "prefix", "load", "discovery", "pd"],
    &["policy", "events"],
    &["metrics"],
    &["route"],
    &["extproc", "metrics_server", "envoy_config"],
    &["app", "render"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

#[test]
fn product_modules_import_only_lower_layers() {
    let mut offenders = Vec::new();
    for (path, text) in sources() {
        let Some(top) = path
            .components()
            .next()
            .and_then(|first| first.as_os_str().to_str())
            .map(|name| name.trim_end_matches(".rs").to_owned())
        else {
            continue;
        };
        if top == "lib" {
            continue;
        }
        let Some(own) = layer_of(&top) else {
            offenders.push(format!(
                "{} is in no layer: add it to LAYERS",
                path.display()
            ));
            continue;
        };
        for module in crate_modules(&text) {
            if module == top {
                continue;
            }
            match layer_of(&module) {
                Some(layer) if layer < own => {}
                _ => offenders.push(format!("{} imports crate::{module}", path.display())),
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "upward or unknown imports: {offenders:#?}"
    );
}

/// Whether ARCHITECTURE.md's code map names `file` (a path under the crate's `src/`, `/`-separated):
/// by its whole path, or in the row of a directory it sits in, by its path below that directory. A
/// directory's `mod.rs` is named by the directory's row. `prefix` is how the crate's rows spell its
/// `src/` (`src/` for the product, nothing for the crates that have a section of their own).
fn code_map_names(rows: &[&str], prefix: &str, file: &str) -> bool {
    let parts: Vec<&str> = file.split('/').collect();
    let whole = format!("`{prefix}{file}`");
    rows.iter().any(|row| {
        if !prefix.is_empty() && row.contains(&whole) {
            return true;
        }
        let first = row.split('|').nth(1).unwrap_or("");
        (0..parts.len()).any(|at| {
            let dir = parts[..at].join("/");
            let rest = parts[at..].join("/");
            if dir.is_empty() {
                return first.contains(&format!("`{prefix}{rest}`"));
            }
            first.contains(&format!("`{prefix}{dir}/`"))
                && (rest == "mod.rs" || row.contains(rest.as_str()))
        })
    })
}

/// Unit tests beside their module (`tests.rs`, `tests/`) are the module's, not rows of their own.
fn is_unit_test_file(file: &str) -> bool {
    file.ends_with("/tests.rs") || file == "tests.rs" || file.contains("tests/")
}

#[test]
fn the_code_map_names_every_source_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let map = fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let rows: Vec<&str> = map.lines().filter(|line| line.starts_with("| `")).collect();
    let mut unnamed = Vec::new();
    for (crate_src, prefix) in [
        ("src".to_owned(), "src/"),
        ("crates/cachepick-sim/src".to_owned(), ""),
        ("crates/cachepick-rig/src".to_owned(), ""),
    ] {
        let dir = root.join(&crate_src);
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        for path in files {
            let file = path
                .strip_prefix(&dir)
                .expect("under the crate's src")
                .to_string_lossy()
                .replace('\\', "/");
            if !is_unit_test_file(&file) && !code_map_names(&rows, prefix, &file) {
                unnamed.push(format!("{crate_src}/{file}"));
            }
        }
    }
    assert!(
        unnamed.is_empty(),
        "ARCHITECTURE.md's code map does not name: {unnamed:?}"
    );
}

#[test]
fn the_code_map_check_sees_a_file_it_does_not_name() {
    let rows = [
        "| `src/route/` | the request path: `picker.rs`, `index/events.rs` | |",
        "| `src/lib.rs` | the crate root | |",
        "| `src/a.rs`, `src/b.rs` | a and b; `src/metrics/c.rs` c | |",
    ];
    assert!(code_map_names(&rows, "src/", "route/picker.rs"));
    assert!(code_map_names(&rows, "src/", "route/index/events.rs"));
    assert!(code_map_names(&rows, "src/", "route/mod.rs"));
    assert!(code_map_names(&rows, "src/", "lib.rs"));
    assert!(code_map_names(&rows, "src/", "metrics/c.rs"));
    assert!(!code_map_names(&rows, "src/", "route/service.rs"));
    assert!(!code_map_names(&rows, "src/", "load/scrape.rs"));
}

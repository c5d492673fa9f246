//! The documentation as a reader meets it: every relative link of the README and the guides leads to a
//! file that exists (and, for a `#fragment` into a Markdown file, to one of its headings), and the
//! configuration reference (`docs/configuration.md`) is held to the schema in both directions.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use cachepick::config::{self, Overrides};
use serde_yaml::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The documents a reader follows from the README.
fn documents() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "BENCHMARKS.md",
        "RELIABILITY.md",
        "deploy/README.md",
        "envoy/README.md",
        "traces/README.md",
    ]
    .iter()
    .map(|path| root().join(path))
    .collect();
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "md") {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`; a
/// repeated anchor gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// Every `](target)` of `text`'s prose.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(start) = rest.find("](") {
            let after = &rest[start + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    found
}

#[test]
fn every_relative_link_leads_to_a_file_and_a_heading_that_exist() {
    let mut broken = Vec::new();
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        let dir = document.parent().unwrap();
        for link in links(&text) {
            if link.starts_with("http://")
                || link.starts_with("https://")
                || link.starts_with("mailto:")
            {
                continue;
            }
            let (path, fragment) = match link.split_once('#') {
                Some((path, fragment)) => (path, Some(fragment)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                document.clone()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", document.display()));
                continue;
            }
            if let Some(fragment) = fragment
                && target.extension().is_some_and(|ext| ext == "md")
                && !anchors(&std::fs::read_to_string(&target).unwrap()).contains(fragment)
            {
                broken.push(format!("{}: {link} (no such heading)", document.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_fits_in_a_head_and_every_guide_opens_with_its_contents() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 300,
        "README.md is {} lines",
        readme.lines().count()
    );
    // The test command CI runs is the README's.
    assert!(
        readme.contains("\nmake test "),
        "the README gives `make test`"
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.lines().any(|line| line.trim() == "make test"), "{ci}");
    for document in documents() {
        if !document.starts_with(root().join("docs")) {
            continue;
        }
        let text = std::fs::read_to_string(&document).unwrap();
        let headings: Vec<&str> = prose(&text)
            .into_iter()
            .filter(|line| line.starts_with("## "))
            .collect();
        assert!(
            text.contains("\nContents:\n"),
            "{} has no contents list",
            document.display()
        );
        for heading in headings {
            let anchor = anchors(heading).into_iter().next().unwrap();
            assert!(
                text.contains(&format!("](#{anchor})")),
                "{}: `{heading}` is not in its contents",
                document.display()
            );
        }
    }
}

// === the configuration reference ===

/// The keys `docs/configuration.md`'s table names in its first column (`a.b`, `pools[].c`; a cell may
/// name several).
fn documented_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let mut keys = BTreeSet::new();
    for line in prose(&text) {
        let Some(cell) = line.strip_prefix("| `") else {
            continue;
        };
        let first = cell.split(" | ").next().unwrap_or_default();
        for key in format!("`{first}").split(", ") {
            let key = key.trim().trim_matches('`');
            if !key.is_empty() && key != "key" {
                keys.insert(key.to_owned());
            }
        }
    }
    keys
}

/// Every key path of an effective configuration as `check` writes it, list positions as `[]`.
fn emitted_keys(value: &Value, path: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Mapping(map) => {
            for (key, child) in map {
                let key = key.as_str().unwrap();
                let path = if path.is_empty() {
                    key.to_owned()
                } else {
                    format!("{path}.{key}")
                };
                // A section is covered by its keys' rows; only a leaf (or an empty section) needs its own.
                let section = child.as_mapping().is_some_and(|map| !map.is_empty())
                    || child
                        .as_sequence()
                        .is_some_and(|items| items.iter().any(Value::is_mapping));
                if !section {
                    out.insert(path.clone());
                }
                emitted_keys(child, &path, out);
            }
        }
        Value::Sequence(items) => {
            for item in items {
                emitted_keys(item, &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

/// Files that between them set every optional section: the example, and what it leaves commented.
const FILES: [&str; 8] = [
    "policy: {prefill_tokens_per_second: 5000}\npools:\n  - model: m\n    engine: vllm\n    workers: [{endpoint: \"10.0.0.1:8000\"}]\n",
    "policy: {gate_unit: requests, worker_queue_limit: 4, saturation_queue_floor: 2}\n\
     pools:\n  - model: m\n    engine: vllm\n    workers: [{endpoint: \"10.0.0.1:8000\"}]\n",
    "replica_sync: {listen: 0.0.0.0:9104, peers: [10.0.0.7:9104], key_file: /etc/sync.key}\n\
     tracing: {otlp_endpoint: \"http://otel:4317\"}\n\
     cache_salt_header: x-tenant\n\
     debug_token_file: /etc/token\n\
     tls: {cert_file: /t/tls.crt, key_file: /t/tls.key, client_ca_file: /t/ca.crt, allowed_client_identities: [envoy.gateway.svc]}\n\
     load: {tls: {ca_file: /t/ca.crt, cert_file: /t/c.crt, key_file: /t/c.key, server_name: vllm}}\n\
     pools:\n  - model: m\n    engine: vllm\n    chat_template: /t/tpl.jinja\n\
     \x20   workers: [{endpoint: \"10.0.0.1:8000\", max_running_requests: 8, max_total_tokens: 4096}]\n",
    "pools:\n  - model: m\n    engine: vllm\n    block_size: 16\n    engine_block_size: 128\n\
     \x20   dns: {name: vllm.llm.svc, port: 8000, server: \"10.0.0.10:53\"}\n",
    "pools:\n  - model: m\n    engine: vllm\n    kubernetes: {namespace: llm, selector: app=vllm, ports: [8000]}\n\
     \x20   template: {role: both, max_running_requests: 8, max_total_tokens: 4096}\n",
    "pools:\n  - model: m\n    engine: vllm\n    pd: {local_prefill_tokens: 2048}\n\
     \x20   index: {mode: events, replay_port: 5558, topic: kv}\n\
     \x20   workers:\n      - {endpoint: \"10.0.0.1:8000\", role: prefill, kv_events: {endpoint: \"tcp://10.0.0.1:5557\", replay_endpoint: \"tcp://10.0.0.1:5558\"}}\n\
     \x20     - {endpoint: \"10.0.0.2:8000\", role: decode}\n",
    "pools:\n  - model: m\n    engine: sglang\n    pd: {handshake: bootstrap}\n    workers:\n\
     \x20     - {endpoint: \"10.0.0.1:30000\", role: prefill, bootstrap_port: 9000, load_source: loads}\n\
     \x20     - {endpoint: \"10.0.0.2:30000\", role: decode}\n",
    "policy: {mode: balance_threshold}\npools:\n  - model: m\n    engine: vllm\n    workers: [{endpoint: \"10.0.0.1:8000\"}]\n\
     \x20 - model: n\n    engine: vllm\n    policy: {mode: cache_aware, prefill_tokens_per_second: 5000}\n\
     \x20   workers: [{endpoint: \"10.0.0.2:8000\"}]\n\
     \x20 - model: o\n    engine: vllm\n    policy: {mode: cache_aware, gate_unit: requests, worker_queue_limit: 4}\n\
     \x20   workers: [{endpoint: \"10.0.0.3:8000\"}]\n",
];

fn emitted() -> BTreeSet<String> {
    let mut texts = vec![std::fs::read_to_string(root().join("examples/cachepick.yaml")).unwrap()];
    texts.extend(FILES.iter().map(|text| (*text).to_owned()));
    let mut keys = BTreeSet::new();
    for text in texts {
        let config = config::parse(&text, "docs.yaml", &Overrides::default())
            .unwrap_or_else(|error| panic!("{error}\n{text}"));
        let written: Value = serde_yaml::from_str(&config.to_yaml()).unwrap();
        emitted_keys(&written, "", &mut keys);
    }
    keys
}

/// `key` is `documented`, or lies under a documented key (`pools[].dns.name` under `pools[].dns`).
fn covered(key: &str, documented: &BTreeSet<String>) -> bool {
    documented.iter().any(|doc| {
        key == doc
            || key
                .strip_prefix(doc.as_str())
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    })
}

#[test]
fn every_key_the_schema_writes_has_a_row_in_the_reference() {
    let documented = documented_keys();
    assert!(documented.len() > 80, "{documented:?}");
    let missing: Vec<String> = emitted()
        .into_iter()
        .filter(|key| !covered(key, &documented))
        .collect();
    assert!(
        missing.is_empty(),
        "keys with no row in docs/configuration.md:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_key_the_reference_names_is_one_the_parser_accepts() {
    let emitted = emitted();
    let unknown: Vec<String> = documented_keys()
        .into_iter()
        .filter(|doc| {
            !emitted.iter().any(|key| {
                key == doc
                    || key
                        .strip_prefix(doc.as_str())
                        .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            })
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "docs/configuration.md names keys no configuration here is written with (a typo, a removed \
         key, or one to add to FILES in tests/docs.rs):\n{}",
        unknown.join("\n")
    );
}

/// Every trace and every fleet file a documented command replays is in the repository, so the
/// commands run from a clone as written (from its root).
#[test]
fn every_file_a_documented_replay_reads_is_in_the_repository() {
    let mut checked = 0;
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        let words: Vec<&str> = text.split_whitespace().collect();
        for pair in words.windows(2) {
            let [flag, value] = pair else { continue };
            let replay_file =
                *flag == "--trace" || (*flag == "--config" && value.starts_with("docs/bench/"));
            if !replay_file || value.contains(['<', '{', '$']) {
                continue;
            }
            let path = value.trim_end_matches(['`', ')', ',', ';']);
            assert!(
                root().join(path).is_file(),
                "{} names {path}, which is not in the repository",
                document.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 10,
        "only {checked} replay files named in the docs"
    );
}

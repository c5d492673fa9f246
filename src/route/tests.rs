//! Explain is routing without the commit: for a table of requests — plain and compressed bodies, a
//! byte-order mark, tenant headers, passthrough paths and methods, refusals, a round-robin pool —
//! explain's label equals the label the live decision that follows it gets, and explaining changes
//! nothing (no metric, no index entry, no turn).

use std::io::Write;
use std::sync::Arc;

use super::{Answer, Commit, CommitGate, Inbound, Moment, Picker, Routing, Service};
use crate::config::Overrides;
use crate::load::PoolLoad;
use crate::metrics::Metrics;

fn service() -> Arc<Service> {
    let yaml = "\
cache_salt_header: x-tenant
policy: {min_match_tokens: 4}
pools:
  - model: chat
    engine: vllm
    tokenizer: {kind: bytes}
    workers:
      - endpoint: 127.0.0.1:1
      - endpoint: 127.0.0.1:2
      - endpoint: 127.0.0.1:3
  - model: rr
    engine: vllm
    tokenizer: {kind: bytes}
    policy: {mode: round_robin}
    workers:
      - endpoint: 127.0.0.1:4
      - endpoint: 127.0.0.1:5
";
    let config = crate::config::parse(yaml, "t", &Overrides::default()).unwrap();
    let loads = PoolLoad::for_pools(&config);
    let picker = Picker::new(&config, &loads).unwrap();
    Service::new(picker, Arc::new(Metrics::new().unwrap()))
}

fn chat(model: &str, text: &str) -> Vec<u8> {
    let content = format!("{text} ").repeat(30);
    serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
    }))
    .unwrap()
}

fn gzip(body: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(body).unwrap();
    encoder.finish().unwrap()
}

fn utf16_with_bom(body: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(body).unwrap();
    let mut out = vec![0xFF, 0xFE];
    out.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
    out
}

/// One row: a request and the label both explain and routing must give it.
struct Row {
    name: &'static str,
    path: &'static str,
    method: Option<&'static str>,
    body: Option<Vec<u8>>,
    encoding: Option<&'static str>,
    tenant: Option<&'static str>,
    label: &'static str,
}

fn row(name: &'static str, path: &'static str, body: Option<Vec<u8>>, label: &'static str) -> Row {
    Row {
        name,
        path,
        method: Some("POST"),
        body,
        encoding: None,
        tenant: None,
        label,
    }
}

fn inbound(row: &Row) -> Inbound<'_> {
    Inbound {
        path: row.path,
        method: row.method,
        body: row.body.as_deref(),
        subset: None,
        content_encoding: row.encoding,
        tenant: row.tenant,
    }
}

#[test]
fn explain_gives_every_request_the_label_routing_gives_it() {
    let service = service();
    let plain = chat("chat", "the conversation so far");
    let rows = [
        row(
            "a first prompt",
            "/v1/chat/completions",
            Some(plain.clone()),
            "cache_miss",
        ),
        row(
            "the same prompt again",
            "/v1/chat/completions",
            Some(plain.clone()),
            "cache_hit",
        ),
        Row {
            encoding: Some("gzip"),
            ..row(
                "the same prompt gzipped",
                "/v1/chat/completions",
                Some(gzip(&plain)),
                "cache_hit",
            )
        },
        row(
            "the same prompt in UTF-16 after a byte-order mark",
            "/v1/chat/completions",
            Some(utf16_with_bom(&plain)),
            "cache_hit",
        ),
        Row {
            encoding: Some("gzip"),
            ..row(
                "a body that is not gzip",
                "/v1/chat/completions",
                Some(plain.clone()),
                "passthrough",
            )
        },
        Row {
            encoding: Some("compress"),
            ..row(
                "an encoding cachepick does not read",
                "/v1/chat/completions",
                Some(plain.clone()),
                "passthrough",
            )
        },
        Row {
            tenant: Some("acme"),
            ..row(
                "the same prompt for a tenant",
                "/v1/chat/completions",
                Some(plain.clone()),
                "cache_miss",
            )
        },
        Row {
            tenant: Some("acme"),
            ..row(
                "the tenant's prompt again",
                "/v1/chat/completions",
                Some(plain.clone()),
                "cache_hit",
            )
        },
        Row {
            tenant: Some("globex"),
            ..row(
                "another tenant's same prompt",
                "/v1/chat/completions",
                Some(plain.clone()),
                "cache_miss",
            )
        },
        row(
            "a non-generation API with a chat body",
            "/v1/embeddings",
            Some(plain.clone()),
            "passthrough",
        ),
        Row {
            method: Some("GET"),
            ..row(
                "a GET on a chat path with a chat body",
                "/v1/chat/completions",
                Some(plain.clone()),
                "passthrough",
            )
        },
        Row {
            method: Some("GET"),
            ..row("a GET without a body", "/v1/models", None, "passthrough")
        },
        row(
            "a chat path without a body",
            "/v1/chat/completions",
            None,
            "missing_body",
        ),
        row(
            "a body that is not JSON",
            "/v1/chat/completions",
            Some(b"{not json".to_vec()),
            "invalid_json",
        ),
        row(
            "a model no pool serves",
            "/v1/chat/completions",
            Some(chat("nobody", "hello")),
            "unknown_model",
        ),
        row(
            "a round-robin pool",
            "/v1/chat/completions",
            Some(chat("rr", "hello")),
            "round_robin",
        ),
        row(
            "a round-robin pool again",
            "/v1/chat/completions",
            Some(chat("rr", "hello")),
            "round_robin",
        ),
    ];
    for row in &rows {
        let before = counted(&service);
        let stats = service.picker().index_stats();
        let explained = service.route(&inbound(row), Commit::DryRun, Moment::now());
        assert_eq!(
            counted(&service),
            before,
            "{}: explaining counts nothing",
            row.name
        );
        assert_eq!(
            format!("{:?}", service.picker().index_stats()),
            format!("{stats:?}"),
            "{}: explaining commits nothing",
            row.name
        );
        // The public call is the same dry run.
        match service.explain(&inbound(row)) {
            Ok(explanation) => assert_eq!(explanation.decision, row.label, "{}", row.name),
            Err(refusal) => assert_eq!(refusal.reason.as_str(), row.label, "{}", row.name),
        }
        let routed = service.route(
            &inbound(row),
            Commit::Live(&CommitGate::open()),
            Moment::now(),
        );
        assert_eq!(explained.label(), row.label, "{}: explain", row.name);
        assert_eq!(routed.label(), row.label, "{}: routing", row.name);
        assert_same_answer(row.name, &explained, &routed);
    }
}

/// Every series the metrics expose but the tokenizer's segment cache, which explaining fills as
/// routing does (it is a cache of tokenizing work, not a count of requests).
fn counted(service: &Service) -> Vec<String> {
    service
        .metrics()
        .render()
        .lines()
        // The process's own CPU and memory move by themselves.
        .filter(|line| {
            !line.starts_with('#')
                && !line.starts_with("cachepick_segment_cache_bytes")
                && !line.starts_with("process_")
        })
        .map(str::to_owned)
        .collect()
}

/// The dry run's answer is the live one's but for what only a commit makes (the credit), and a
/// round-robin dry run names the worker whose turn is next.
fn assert_same_answer(name: &str, explained: &Routing, routed: &Routing) {
    match (&explained.answer, &routed.answer) {
        (Answer::Route(dry), Answer::Route(live)) => {
            assert_eq!(dry.pool, live.pool, "{name}");
            assert_eq!(dry.passthrough, live.passthrough, "{name}");
            assert_eq!(dry.matched_tokens, live.matched_tokens, "{name}");
            assert_eq!(dry.prompt_tokens, live.prompt_tokens, "{name}");
            assert!(dry.credit.is_none(), "{name}: a dry run credits nothing");
            let explanation = explained
                .explanation
                .as_ref()
                .expect("a routed dry run explains");
            assert_eq!(explanation.passthrough, dry.passthrough, "{name}");
            if dry.reason.as_str() == "round_robin" {
                assert_eq!(
                    dry.endpoints.first(),
                    live.endpoints.first(),
                    "{name}: the next turn"
                );
            }
        }
        (Answer::Refuse(dry), Answer::Refuse(live)) => assert_eq!(dry, live, "{name}"),
        (dry, live) => panic!("{name}: explain answered {dry:?}, routing {live:?}"),
    }
}

/// The route cuts a chain to `prefix::MAX_CHECKPOINTS` hashes for `replica_sync`, whose datagram
/// carries at most `load::MAX_CHECKPOINTS`; the two modules share a layer and may not import each
/// other, so the route, above both, holds them equal.
#[test]
fn an_announced_chain_fits_the_datagram() {
    assert_eq!(crate::prefix::MAX_CHECKPOINTS, crate::load::MAX_CHECKPOINTS);
    let chain: Vec<u64> = (0..1 << 20).collect();
    assert_eq!(
        crate::prefix::checkpoints(&chain).len(),
        crate::load::MAX_CHECKPOINTS
    );
}

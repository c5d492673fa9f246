//! The text forms of what the operator commands print: `cachepick snapshot`'s table of every pool's
//! workers and `cachepick explain`'s account of one decision. Both views (`load::PoolView`,
//! `route::Explanation`) are also served as JSON; their text is written here, in one place, beside
//! nothing that decides.

use std::fmt::Write as _;

use crate::events::stream::StreamView;
use crate::policy::{Outcome, Trace};
use crate::prefix::DepthSource;
use crate::route::{AdmissionView, Explanation, OwnerDepth, PoolReport};
use crate::worker::WorkerId;

/// A running picker's admission (the `admission` object of `/debug/snapshot`) as text: slots, queue,
/// deadline, buffered bytes, and what was shed and refused.
pub fn admission(view: &AdmissionView) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "admission: {}/{} decision slots busy, {}/{} queued, deadline {} ms, {}/{} body bytes held, {} explain slot(s)",
        view.in_flight,
        view.decision_slots,
        view.queued,
        view.max_queued,
        view.decision_deadline_ms,
        view.buffered_bytes,
        view.max_buffered_bytes,
        view.explain_slots,
    );
    let counts = |counts: &[(&str, u64)]| {
        counts
            .iter()
            .map(|(reason, count)| format!("{reason} {count}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(out, "  shed: {}", counts(&view.shed));
    let _ = writeln!(out, "  commits refused: {}", counts(&view.commits_refused));
    out
}

/// `cachepick snapshot`: a plain-text table of every pool.
pub fn snapshot(pools: &[PoolReport]) -> String {
    let mut out = String::new();
    for report in pools {
        let pool = &report.view;
        let _ = writeln!(
            out,
            "pool {} (snapshot v{}, freshness {:.1}s)",
            pool.pool, pool.version, pool.freshness_seconds
        );
        if let Some(source) = &report.source {
            let _ = writeln!(
                out,
                "  workers from {}: {} listed, {} answers, {} errors{}",
                source.kind,
                source.state.members,
                source.state.updates,
                source.state.errors,
                source
                    .state
                    .last_error
                    .as_deref()
                    .map(|error| format!("; last error: {error}"))
                    .unwrap_or_default()
            );
        }
        out.push_str(&row([
            "WORKER",
            "ROLE",
            "STATE",
            "WAITING",
            "RUNNING",
            "UNCACHED",
            "USED/MAX TOKENS",
            "KV",
            "MAXRUN",
            "AGE",
            "FRESH",
        ]));
        for worker in &pool.workers {
            let tokens = match (worker.used_tokens, worker.max_total_tokens) {
                (None, None) => "-".to_owned(),
                (used, max) => format!("{}/{}", cell(used), cell(max)),
            };
            let kv = worker
                .kv_usage
                .map_or_else(|| "-".to_owned(), |usage| format!("{:.0}%", usage * 100.0));
            let age = worker
                .age_seconds
                .map_or_else(|| "-".to_owned(), |age| format!("{age:.1}s"));
            let state = match worker.restarts {
                0 => worker.state.to_owned(),
                restarts => format!("{} ({restarts} restarts)", worker.state),
            };
            let fresh = match &worker.why_not_fresh {
                None => "yes".to_owned(),
                Some(why) => format!("no: {why}"),
            };
            out.push_str(&row([
                &worker.endpoint,
                worker.role,
                &state,
                &cell(worker.waiting),
                &cell(worker.running),
                &cell(worker.waiting_uncached_tokens),
                &tokens,
                &kv,
                &cell(worker.max_running),
                &age,
                &fresh,
            ]));
        }
        if !report.kv_events.is_empty() {
            kv_event_streams(&mut out, &report.kv_events);
        }
    }
    out
}

/// The `events` pool's streams: one line per worker rank.
fn kv_event_streams(out: &mut String, streams: &[StreamView]) {
    let _ = writeln!(
        out,
        "  kv events: {:<20} {:<6} {:>4} {:<10} {:>9} {:>8} {:>9} {:>9} {:>5} {:>7} {:>6} {:>9}",
        "STREAM",
        "FROM",
        "RANK",
        "STATE",
        "LAST SEQ",
        "BATCHES",
        "EVENTS/S",
        "GPU BLKS",
        "GAPS",
        "REPLAYS",
        "RESETS",
        "ENGINE BS"
    );
    for stream in streams {
        let resets: u64 = stream.resets.iter().map(|(_, count)| count).sum();
        let gpu = stream.tiers.first().map_or(0, |(_, blocks)| *blocks);
        let _ = writeln!(
            out,
            "             {:<20} {:<6} {:>4} {:<10} {:>9} {:>8} {:>9} {:>9} {:>5} {:>7} {:>6} {:>9}",
            stream.live.to_string(),
            stream.from.as_str(),
            stream.rank,
            stream.state.as_str(),
            cell(stream.last_seq),
            stream.batches,
            stream
                .events_per_second
                .map_or_else(|| "-".to_owned(), |rate| format!("{rate:.1}")),
            gpu,
            stream.gaps,
            stream.replays,
            resets,
            stream
                .engine_block_size
                .map_or_else(|| "-".to_owned(), |size| size.to_string()),
        );
    }
}

fn row(cells: [&str; 11]) -> String {
    let [
        worker,
        role,
        state,
        waiting,
        running,
        uncached,
        tokens,
        kv,
        max_running,
        age,
        fresh,
    ] = cells;
    format!(
        "  {worker:<22} {role:<7} {state:<11} {waiting:>7} {running:>7} {uncached:>9} {tokens:>21} {kv:>6} \
         {max_running:>6} {age:>6}  {fresh}\n"
    )
}

/// One worker as `explain` shows it: its state, whether its reading counts (and what the gate does
/// when it does not), and the rates its engine taught, with where each came from.
fn worker_line(worker: &crate::load::WorkerView) -> String {
    let reading = match (&worker.why_not_fresh, worker.fresh) {
        (_, true) => format!(
            "reading fresh ({} waiting, {} running)",
            cell(worker.waiting),
            cell(worker.running)
        ),
        (Some(why), false) => format!("{why}: its queue is unknown, so its gate fails open"),
        (None, false) => {
            "no fresh reading: its queue is unknown, so its gate fails open".to_owned()
        }
    };
    let prefill = &worker.prefill;
    let rate = |value: Option<u64>| {
        value.map_or_else(
            || "not learned".to_owned(),
            |rate| format!("{rate} tokens/s"),
        )
    };
    let mut line = format!(
        "{} {}, {reading}; prefill {} (its engine's prefill histograms), queue drain {} (its counters \
         while requests waited)",
        worker.endpoint,
        worker.state,
        rate(prefill.prefill_tokens_per_second),
        rate(prefill.drain_tokens_per_second),
    );
    if let Some(us) = prefill.queue_wait_us {
        let _ = write!(line, ", engine's mean queue wait {}", millis(us));
    }
    if let Some(block) = worker.engine_block {
        let _ = write!(line, ", engine block {block} tokens");
    }
    line
}

fn cell(value: Option<u64>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| value.to_string())
}

/// Microseconds as milliseconds with one decimal.
fn millis(us: u64) -> String {
    format!("{}.{} ms", us / 1000, us % 1000 / 100)
}

/// `cachepick explain`: the pool, the prompt's blocks, the owners and the decision with its trace.
pub fn explanation(explanation: &Explanation) -> String {
    let mut out = String::new();
    prompt_lines(&mut out, explanation);
    owner_lines(&mut out, explanation);
    for worker in &explanation.workers {
        let _ = writeln!(out, "worker:  {}", worker_line(worker));
    }
    let trace = explanation.outcome.trace();
    prediction_lines(&mut out, explanation, trace);
    decision_lines(&mut out, explanation);
    // The policy's trace in the same text form as the rest (YAML), never a JSON block in the text
    // output: `--json` is for JSON.
    let _ = writeln!(out, "trace:");
    for line in serde_yaml::to_string(trace).unwrap_or_default().lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}

/// A worker as explain names it: its endpoint, or its id when the roster no longer has it.
fn endpoint(explanation: &Explanation, id: WorkerId) -> String {
    explanation
        .endpoints
        .get(id.index())
        .cloned()
        .unwrap_or_else(|| id.to_string())
}

/// The pool, whether the request is routed by load alone, and the prompt's blocks.
fn prompt_lines(out: &mut String, explanation: &Explanation) {
    let prepared = &explanation.prepared;
    let _ = writeln!(out, "pool:    {}", prepared.pool_label);
    if explanation.passthrough {
        let _ = writeln!(
            out,
            "routing: passthrough (routed by load alone: not a generation request, or a body cachepick cannot read)"
        );
    }
    let _ = writeln!(
        out,
        "prompt:  {} tokens, {} full blocks of {}",
        prepared.prompt_tokens,
        prepared.block_hashes.len(),
        explanation.block_size
    );
    let shown: Vec<String> = prepared
        .block_hashes
        .iter()
        .take(4)
        .map(|hash| format!("{hash:016x}"))
        .collect();
    let _ = writeln!(
        out,
        "blocks:  {}{}",
        shown.join(" "),
        if prepared.block_hashes.len() > 4 {
            " …"
        } else {
            ""
        }
    );
}

/// Each owner with its depth and where that depth came from, then the tiers beyond the GPU.
fn owner_lines(out: &mut String, explanation: &Explanation) {
    let prepared = &explanation.prepared;
    if prepared.owners.is_empty() {
        let _ = writeln!(
            out,
            "owners:  none (this one-shot picker has routed nothing yet)"
        );
    }
    for owner in &prepared.owners {
        let source = explanation
            .depth_sources
            .as_ref()
            .and_then(|sources| sources.iter().find(|source| source.worker == owner.worker))
            .map(|source| match source.source() {
                DepthSource::Events => " (engine events)".to_owned(),
                DepthSource::Speculative => format!(
                    " (speculative: a decision of this replica; events say {})",
                    source.events_tokens
                ),
            })
            .unwrap_or_default();
        // A match the ladder does not count says which rule dropped it, with both numbers.
        let ignored = explanation
            .owner_depth
            .filter(|depth| owner.matched_tokens < depth.tokens)
            .map(|depth| not_an_owner(owner.matched_tokens, &depth))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "owner:   {} holds {} tokens{source}{ignored}",
            endpoint(explanation, owner.worker),
            owner.matched_tokens
        );
    }
    for worker in &explanation.tiers {
        let blocks: Vec<String> = worker
            .blocks
            .iter()
            .filter(|(_, blocks)| *blocks > 0)
            .map(|(medium, blocks)| format!("{} {blocks}", medium.as_str()))
            .collect();
        if !blocks.is_empty() {
            let _ = writeln!(
                out,
                "tiers:   {} holds {} blocks (only gpu blocks make an owner)",
                endpoint(explanation, worker.worker),
                blocks.join(", ")
            );
        }
    }
}

/// The policy's predictions, each with the rate that priced it and where that rate came from.
/// Why a match makes no owner, with the rule that set the depth and its numbers.
fn not_an_owner(held: u64, depth: &OwnerDepth) -> String {
    let share = (depth.min_match_share * depth.prompt_tokens as f64).ceil() as u64;
    if share > depth.min_match_tokens {
        format!(
            " — not an owner: {held} tokens < {} (min_match_share {} of the prompt's {} tokens)",
            depth.tokens, depth.min_match_share, depth.prompt_tokens
        )
    } else {
        format!(
            " — not an owner: {held} tokens < min_match_tokens {}",
            depth.tokens
        )
    }
}

fn prediction_lines(out: &mut String, explanation: &Explanation, trace: &Trace) {
    for predicted in &trace.predictions {
        let p = &predicted.prediction;
        let _ = writeln!(
            out,
            "predict: {} cached {} tokens, {} uncached ahead ({} sent since its reading): queue {} at \
             {} tokens/s ({}), prefill {} at {} tokens/s ({}), first token {}",
            endpoint(explanation, predicted.worker),
            predicted.cached_tokens,
            p.ahead_tokens,
            p.dispatched_tokens,
            millis(p.queue_us),
            p.queue_rate,
            p.queue_rate_source.as_str(),
            millis(p.prefill_us),
            p.rate,
            p.rate_source.as_str(),
            millis(predicted.ttft_us),
        );
    }
}

/// The decision, the decode leg's and a local prefill's.
fn decision_lines(out: &mut String, explanation: &Explanation) {
    match &explanation.outcome {
        Outcome::Route(decision) => {
            let fallbacks: Vec<String> = decision
                .fallbacks
                .iter()
                .map(|id| endpoint(explanation, *id))
                .collect();
            let _ = writeln!(
                out,
                "decision: {} -> {} (fallbacks: {})",
                decision.reason.as_str(),
                endpoint(explanation, decision.selected),
                if fallbacks.is_empty() {
                    "none".to_owned()
                } else {
                    fallbacks.join(", ")
                }
            );
        }
        Outcome::Refuse(refused) => {
            let _ = writeln!(out, "decision: refuse {}", refused.reason.as_str());
        }
    }
    if let Some(decode) = &explanation.decode {
        let fallbacks: Vec<String> = decode
            .fallbacks
            .iter()
            .map(|id| endpoint(explanation, *id))
            .collect();
        let _ = writeln!(
            out,
            "decode:   {} -> {} (pressure {}, holds {} tokens, {} decode workers; fallbacks: {})",
            decode.reason.as_str(),
            endpoint(explanation, decode.selected),
            decode.pressure,
            decode.matched_tokens,
            decode.fleet,
            if fallbacks.is_empty() {
                "none".to_owned()
            } else {
                fallbacks.join(", ")
            }
        );
    }
    if let Some(local) = explanation.local_prefill {
        let _ = writeln!(
            out,
            "prefill:  on the decode worker, no remote leg ({})",
            crate::route::local_handoff(local).as_str()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same short chat twice, under the default `min_match_tokens` (1024): the second is a miss,
    /// and explain says why, with the rule and both numbers.
    #[test]
    fn a_match_below_min_match_tokens_is_named_with_the_rule_and_its_numbers() {
        use crate::route::{Commit, CommitGate, Inbound, Moment, Picker, Service};
        let yaml = "pools:\n  - model: m\n    engine: vllm\n    tokenizer: {kind: bytes}\n    workers:\n\
                    \x20     - endpoint: 127.0.0.1:1\n      - endpoint: 127.0.0.1:2\n";
        let config = crate::config::parse(yaml, "t", &crate::config::Overrides::default()).unwrap();
        let loads = crate::load::PoolLoad::for_pools(&config);
        let picker = Picker::new(&config, &loads).unwrap();
        let service = Service::new(
            picker,
            std::sync::Arc::new(crate::metrics::Metrics::new().unwrap()),
        );
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "a short question, asked twice ".repeat(20)}],
        }))
        .unwrap();
        let inbound = Inbound {
            path: "/v1/chat/completions",
            method: Some("POST"),
            body: Some(&body),
            subset: None,
            content_encoding: None,
            tenant: None,
        };
        let _ = service.route(&inbound, Commit::Live(&CommitGate::open()), Moment::now());
        let explained = service.explain(&inbound).unwrap();
        assert_eq!(explained.owner_depth.map(|depth| depth.tokens), Some(1024));
        let held = explained
            .prepared
            .owners
            .first()
            .expect("the first request's worker")
            .matched_tokens;
        assert!(held > 0 && held < 1024, "{held}");
        let text = explanation(&explained);
        assert!(
            text.contains(&format!(
                "not an owner: {held} tokens < min_match_tokens 1024"
            )),
            "{text}"
        );
        // Text only: the trace reads as indented YAML, with no JSON object in it.
        assert!(text.contains("\ntrace:\n  "), "{text}");
        assert!(!text.contains('{') && !text.contains("\":"), "{text}");
    }

    /// The depth names the rule that set it: the share on a long prompt, the token floor on a short.
    #[test]
    fn a_match_below_the_owner_depth_names_the_rule_that_set_it() {
        let long = OwnerDepth {
            tokens: 3_000,
            min_match_tokens: 1024,
            min_match_share: 0.5,
            prompt_tokens: 6_000,
        };
        assert_eq!(
            not_an_owner(1_024, &long),
            " — not an owner: 1024 tokens < 3000 (min_match_share 0.5 of the prompt's 6000 tokens)"
        );
        let short = OwnerDepth {
            prompt_tokens: 1_500,
            tokens: 1024,
            ..long
        };
        assert_eq!(
            not_an_owner(512, &short),
            " — not an owner: 512 tokens < min_match_tokens 1024"
        );
    }

    #[test]
    fn admission_reads_as_one_line_and_its_counts() {
        let view = AdmissionView {
            decision_slots: 4,
            heavy_slots: 2,
            heavy_in_flight: 1,
            in_flight: 3,
            queued: 2,
            max_queued: 128,
            decision_deadline_ms: 1750,
            per_decision_us: 1200,
            buffered_bytes: 10,
            max_buffered_bytes: 100,
            explain_slots: 1,
            shed: vec![("queue_full", 1), ("deadline", 5)],
            commits_refused: vec![("deadline", 2), ("cancelled", 0)],
        };
        let text = admission(&view);
        assert!(
            text.starts_with("admission: 3/4 decision slots busy, 2/128 queued, deadline 1750 ms"),
            "{text}"
        );
        assert!(
            text.contains("  shed: queue_full 1, deadline 5\n"),
            "{text}"
        );
        assert!(
            text.contains("  commits refused: deadline 2, cancelled 0\n"),
            "{text}"
        );
    }
}

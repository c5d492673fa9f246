//! `pools[].pd` decoded: off without the key, its defaults and keys, the emitted form, and every
//! problem of a bad section reported at once.

use std::time::Duration;

use super::super::*;

const WORKERS: &str = "    workers:\n      - {endpoint: 10.0.0.1:8000, role: prefill}\n      - \
                       {endpoint: 10.0.0.2:8000, role: decode}\n";

fn pool(engine: &str, pd: &str) -> String {
    format!("pools:\n  - model: m\n    engine: {engine}\n{pd}{WORKERS}")
}

fn accepted(yaml: &str) -> Config {
    super::accepted(yaml, &Overrides::default())
}

fn messages(yaml: &str) -> Vec<String> {
    super::messages(yaml, &Overrides::default())
}

#[test]
fn without_the_key_a_pool_is_aggregated() {
    assert_eq!(accepted(&pool("vllm", "")).pools[0].pd, None);
}

#[test]
fn an_empty_section_is_a_nixl_pool_with_the_defaults() {
    let pd = accepted(&pool("vllm", "    pd: {}\n")).pools[0]
        .pd
        .clone()
        .expect("a PD pool");
    assert_eq!(pd.handshake, Handshake::Nixl);
    assert_eq!(pd.prefill_timeout, PdConfig::DEFAULT_PREFILL_TIMEOUT);
    assert_eq!(
        pd.max_inflight_prefills.get(),
        PdConfig::DEFAULT_MAX_INFLIGHT_PREFILLS
    );
    assert_eq!(pd.decode_choices.get(), PdConfig::DEFAULT_DECODE_CHOICES);
    let given = accepted(&pool(
        "vllm",
        "    pd: {handshake: nixl, prefill_timeout: 45s, max_inflight_prefills: 8, decode_choices: 3, \
         max_prefill_response_bytes: 64KiB}\n",
    ));
    let pd = given.pools[0].pd.as_ref().unwrap();
    assert_eq!(pd.prefill_timeout, Duration::from_secs(45));
    assert_eq!(pd.max_inflight_prefills.get(), 8);
    assert_eq!(pd.decode_choices.get(), 3);
    assert_eq!(pd.max_prefill_response_bytes.get(), 64 << 10);
    let again = parse(&given.to_yaml(), "emitted", &Overrides::default()).unwrap();
    assert_eq!(again.pools[0].pd, given.pools[0].pd);
}

#[test]
fn every_problem_of_a_bad_section_is_listed() {
    let problems = messages(&pool(
        "vllm",
        "    pd: {handshake: bootstrap, prefill_timeout: 0s, decode_choices: 0, extra: 1}\n",
    ));
    let text = problems.join("\n");
    for expected in ["handshake", "prefill_timeout", "decode_choices", "extra"] {
        assert!(text.contains(expected), "{expected} missing from:\n{text}");
    }
}

#[test]
fn sglang_pools_and_pools_without_a_decode_worker_are_refused() {
    let sglang = messages(&pool("sglang", "    pd: {}\n")).join("\n");
    assert!(
        sglang.contains("bootstrap rendezvous is not implemented"),
        "{sglang}"
    );
    let no_decode = messages(
        "pools:\n  - model: m\n    engine: vllm\n    pd: {}\n    workers:\n      - {endpoint: \
         10.0.0.1:8000, role: prefill}\n",
    )
    .join("\n");
    assert!(
        no_decode.contains("at least one worker with role: decode"),
        "{no_decode}"
    );
}

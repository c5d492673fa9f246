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
fn each_engine_takes_its_own_handshake_and_the_sidecar() {
    let sglang = accepted(&pool("sglang", "    pd: {}\n"));
    let pd = sglang.pools[0].pd.as_ref().unwrap();
    assert_eq!(pd.handshake, Handshake::Bootstrap);
    assert_eq!(pd.bootstrap_port, PdConfig::DEFAULT_BOOTSTRAP_PORT);
    for (engine, handshake) in [("sglang", "sidecar"), ("vllm", "sidecar")] {
        let pd = format!("    pd: {{handshake: {handshake}}}\n");
        assert_eq!(
            accepted(&pool(engine, &pd)).pools[0]
                .pd
                .as_ref()
                .unwrap()
                .handshake,
            Handshake::Sidecar
        );
    }
    let nixl = messages(&pool("sglang", "    pd: {handshake: nixl}\n")).join("\n");
    assert!(
        nixl.contains("engine sglang takes handshake bootstrap"),
        "{nixl}"
    );
    let bootstrap = messages(&pool("vllm", "    pd: {handshake: bootstrap}\n")).join("\n");
    assert!(
        bootstrap.contains("engine vllm takes handshake nixl"),
        "{bootstrap}"
    );
}

#[test]
fn a_prefill_worker_names_its_bootstrap_server_and_no_other_worker_may() {
    let yaml = "pools:\n  - model: m\n    engine: sglang\n    pd: {bootstrap_port: 9000}\n    workers:\n      \
                - {endpoint: 10.0.0.1:8000, role: prefill, bootstrap_port: 9100}\n      - {endpoint: \
                10.0.0.3:8000, role: prefill}\n      - {endpoint: 10.0.0.2:8000, role: decode}\n";
    let config = accepted(yaml);
    let given = &config.pools[0];
    assert_eq!(given.pd.as_ref().unwrap().bootstrap_port, 9000);
    assert_eq!(given.workers[0].bootstrap_port, Some(9100));
    assert_eq!(given.workers[1].bootstrap_port, None);
    let again = parse(&config.to_yaml(), "emitted", &Overrides::default()).unwrap();
    assert_eq!(again.pools[0], config.pools[0]);
    // On a decode worker, or in a pool without the rendezvous, the port is read by nothing.
    let misplaced = messages(&yaml.replace("role: decode}", "role: decode, bootstrap_port: 1}"));
    assert_eq!(misplaced.len(), 1, "{misplaced:?}");
    assert!(misplaced[0].contains("bootstrap_port is read only on a prefill worker"));
    let nixl = messages(
        &yaml
            .replace("engine: sglang", "engine: vllm")
            .replace("{bootstrap_port: 9000}", "{}"),
    );
    assert_eq!(nixl.len(), 1, "{nixl:?}");
    let pool_port = messages(&pool("vllm", "    pd: {bootstrap_port: 9000}\n")).join("\n");
    assert!(
        pool_port.contains("read only with handshake: bootstrap"),
        "{pool_port}"
    );
}

#[test]
fn pools_without_a_decode_worker_are_refused() {
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

#[test]
fn conditional_disaggregation_is_off_by_default_and_refused_where_it_cannot_act() {
    let pd = accepted(&pool("vllm", "    pd: {}\n")).pools[0]
        .pd
        .clone()
        .unwrap();
    assert_eq!(
        pd.local_prefill_tokens,
        PdConfig::DEFAULT_LOCAL_PREFILL_TOKENS
    );
    assert_eq!(
        pd.local_prefill_share.get(),
        PdConfig::DEFAULT_LOCAL_PREFILL_SHARE
    );
    assert_eq!(pd.local_prefill_tokens, 0);
    assert!(!pd.local_prefill_when_queued);
    let given = accepted(&pool(
        "vllm",
        "    pd: {local_prefill_tokens: 2048, local_prefill_share: 0.25, local_prefill_when_queued: true}\n",
    ));
    let pd = given.pools[0].pd.as_ref().unwrap();
    assert_eq!(pd.local_prefill_tokens, 2048);
    assert_eq!(pd.local_prefill_share.get(), 0.25);
    assert!(pd.local_prefill_when_queued);
    let again = parse(&given.to_yaml(), "emitted", &Overrides::default()).unwrap();
    assert_eq!(again.pools[0].pd, given.pools[0].pd);
    let problems = messages(&pool(
        "vllm",
        "    pd: {local_prefill_share: 1.5, local_prefill_tokens: -1}\n",
    ))
    .join("\n");
    for key in ["local_prefill_share", "local_prefill_tokens"] {
        assert!(problems.contains(key), "{key} missing from:\n{problems}");
    }
    let sglang = messages(&pool("sglang", "    pd: {local_prefill_tokens: 512}\n")).join("\n");
    assert!(
        sglang.contains("cannot prefill a request itself"),
        "{sglang}"
    );
    // And the SGLang pool's emitted form carries none of them.
    let emitted = accepted(&pool("sglang", "    pd: {}\n")).to_yaml();
    assert!(!emitted.contains("local_prefill"), "{emitted}");
}

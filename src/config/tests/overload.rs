//! `overload:` decoded: its defaults, the derived decision deadline, the flag, the emitted form, and
//! every cross-field problem reported at once.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use super::super::*;

const POOL: &str =
    "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.1:8000\n";

fn config(head: &str, overrides: &Overrides) -> Config {
    super::accepted(&format!("{head}{POOL}"), overrides)
}

/// Every problem of `head` before the pool, as `path (line n): message`.
fn messages(head: &str) -> Vec<String> {
    super::messages(&format!("{head}{POOL}"), &Overrides::default())
}

#[test]
fn without_a_section_the_defaults_hold() {
    let overload = config("", &Overrides::default()).overload;
    assert_eq!(overload, OverloadConfig::default());
    assert_eq!(overload.message_timeout, Duration::from_secs(2));
    // A quarter of the timeout, at most 250 ms, is kept for the answer's way back.
    assert_eq!(overload.decision_deadline, Duration::from_millis(1750));
    assert_eq!(overload.shutdown_grace, Duration::from_secs(5));
}

#[test]
fn the_deadline_follows_the_message_timeout_unless_given() {
    let derived = config(
        "overload:\n  message_timeout: 400ms\n",
        &Overrides::default(),
    )
    .overload;
    assert_eq!(derived.decision_deadline, Duration::from_millis(300));
    let given = config(
        "overload:\n  message_timeout: 1s\n  decision_deadline: 600ms\n  max_queued_decisions: 7\n  \
         max_buffered_bytes: 64MiB\n  max_concurrent_streams: 50\n  max_connections: 9\n  \
         idle_timeout: 90s\n  first_stream_timeout: 3s\n  stream_deadline: 10s\n  explain_rate: 1\n  shutdown_grace: 0s\n",
        &Overrides::default(),
    )
    .overload;
    assert_eq!(
        given,
        OverloadConfig {
            message_timeout: Duration::from_secs(1),
            decision_deadline: Duration::from_millis(600),
            max_queued_decisions: NonZeroUsize::new(7).unwrap(),
            max_buffered_bytes: NonZeroUsize::new(64 << 20).unwrap(),
            max_concurrent_streams: NonZeroU32::new(50).unwrap(),
            max_connections: NonZeroUsize::new(9).unwrap(),
            idle_timeout: Duration::from_secs(90),
            first_stream_timeout: Duration::from_secs(3),
            stream_deadline: Duration::from_secs(10),
            explain_rate: NonZeroU32::new(1).unwrap(),
            shutdown_grace: Duration::ZERO,
        }
    );
}

#[test]
fn unset_bounds_follow_the_limits_they_must_hold() {
    let overload = config(
        "max_body_bytes: 512MiB\noverload: {message_timeout: 60s}\n",
        &Overrides::default(),
    )
    .overload;
    assert_eq!(overload.max_buffered_bytes.get(), 512 << 20);
    assert_eq!(overload.stream_deadline, Duration::from_secs(60));
}

#[test]
fn connection_timeouts_default_and_follow_a_shorter_idle_timeout() {
    let overload = config("", &Overrides::default()).overload;
    assert_eq!(overload.idle_timeout, Duration::from_secs(60));
    assert_eq!(overload.first_stream_timeout, Duration::from_secs(10));
    let short = config("overload: {idle_timeout: 4s}\n", &Overrides::default()).overload;
    assert_eq!(short.first_stream_timeout, Duration::from_secs(4));
    let problems = messages("overload: {idle_timeout: 0s, first_stream_timeout: 0s}\n").join("\n");
    assert!(
        problems.contains("overload.idle_timeout")
            && problems.contains("overload.first_stream_timeout"),
        "{problems}"
    );
}

#[test]
fn the_flag_replaces_the_grace() {
    let flagged = Overrides {
        shutdown_grace: Some(Duration::from_millis(50)),
        ..Overrides::default()
    };
    let overload = config("overload:\n  shutdown_grace: 9s\n", &flagged).overload;
    assert_eq!(overload.shutdown_grace, Duration::from_millis(50));
}

#[test]
fn every_cross_field_problem_is_reported_at_once() {
    let problems = messages(
        "max_body_bytes: 8MiB\noverload:\n  message_timeout: 2s\n  decision_deadline: 2s\n  \
         stream_deadline: 1s\n  max_buffered_bytes: 1MiB\n  max_queued_decisions: 0\n  \
         explain_rate: 0\n  idle_timeout: 5s\n  first_stream_timeout: 6s\n  bogus: 1\n",
    );
    let all = problems.join("\n");
    for expected in [
        "decision_deadline (2s) must be shorter than message_timeout (2s)",
        "stream_deadline (1s) must be at least message_timeout (2s)",
        "max_buffered_bytes (1048576) must be at least max_body_bytes (8388608)",
        "first_stream_timeout (6s) must be at most idle_timeout (5s)",
        "overload.max_queued_decisions",
        "overload.explain_rate",
        "overload.bogus",
    ] {
        assert!(all.contains(expected), "missing {expected:?} in\n{all}");
    }
}

#[test]
fn the_section_is_written_back_and_read_again_the_same() {
    let config = config(
        "overload:\n  message_timeout: 1s\n  max_buffered_bytes: 64MiB\n  shutdown_grace: 250ms\n",
        &Overrides::default(),
    );
    let yaml = config.to_yaml();
    assert!(yaml.contains("overload:"), "{yaml}");
    let again = parse(&yaml, "emitted", &Overrides::default()).unwrap();
    assert_eq!(again.overload, config.overload);
}

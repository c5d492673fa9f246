//! Request bodies the benches share, included by each with `mod support { pub mod bodies; }`.

/// A chat for `model`: `turns` user/assistant pairs after a long system prompt, `words` words per message.
pub fn chat(model: &str, turns: usize, words: usize) -> Vec<u8> {
    let vocabulary = [
        "the", "cache", "router", "sends", "each", "request", "to", "a", "worker", "that",
        "already", "holds", "its", "prefix", "so", "prefill", "is", "short", "and", "latency",
        "drops", "when", "queues", "grow",
    ];
    let text = |seed: usize| {
        (0..words)
            .map(|i| vocabulary[(i * 7 + seed * 13) % vocabulary.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(0)})];
    for turn in 1..=turns {
        messages.push(serde_json::json!({"role": "user", "content": text(2 * turn)}));
        messages.push(serde_json::json!({"role": "assistant", "content": text(2 * turn + 1)}));
    }
    serde_json::to_vec(&serde_json::json!({"model": model, "messages": messages})).unwrap()
}

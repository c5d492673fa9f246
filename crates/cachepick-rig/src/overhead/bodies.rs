//! The request bodies the overhead bench sends: OpenAI chat completions of a given size, shaped like a
//! conversation's next turn — a system prompt and earlier turns every request of a size shares, then a
//! last user message of its own — so the picker's segment cache and owner index see what they see in
//! production (a known prefix, a new tail), not one body repeated.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The API the bodies are for.
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// Words the prose is drawn from: ordinary English, so a BPE tokenizer meets ordinary words.
const WORDS: [&str; 48] = [
    "the",
    "model",
    "answers",
    "each",
    "question",
    "with",
    "a",
    "short",
    "paragraph",
    "about",
    "prefix",
    "caching",
    "and",
    "how",
    "requests",
    "share",
    "their",
    "first",
    "tokens",
    "when",
    "users",
    "continue",
    "conversation",
    "so",
    "worker",
    "that",
    "already",
    "holds",
    "those",
    "blocks",
    "can",
    "skip",
    "most",
    "of",
    "prefill",
    "which",
    "saves",
    "time",
    "on",
    "every",
    "turn",
    "while",
    "queues",
    "stay",
    "balanced",
    "across",
    "fleet",
    "today",
];

/// About how long each request's own last message is: a new chat turn, as in a conversation whose
/// earlier turns the picker has seen.
pub const TAIL: usize = 256;

/// Output tokens each request asks for: the worker answers briefly whatever it is asked.
const MAX_TOKENS: u32 = 16;

/// The bodies of one size: a shared conversation prefix and, per request, a new last message.
#[derive(Clone, Debug)]
pub struct Bodies {
    model: String,
    /// The JSON of every message before the last, each followed by a comma.
    prefix: String,
    size: usize,
}

impl Bodies {
    /// Bodies for `model` of about `size` bytes each (within a few dozen bytes), the prose drawn from
    /// `seed`.
    pub fn new(model: &str, size: usize, seed: u64) -> Bodies {
        let mut rng = SmallRng::seed_from_u64(seed ^ (size as u64));
        let mut bodies = Bodies {
            model: model.to_owned(),
            prefix: String::new(),
            size,
        };
        // Turns of about a tenth of the body (at least one short system prompt), then one shorter
        // turn, so that the last user message — the one new text of each request — is about TAIL.
        let turn = (size / 10).max(64);
        let mut role = "system";
        loop {
            let room = size.saturating_sub(bodies.fixed(0) + TAIL);
            if room < 16 {
                break;
            }
            let text = prose(&mut rng, room.min(turn));
            bodies.prefix.push_str(&message(role, &text));
            bodies.prefix.push(',');
            role = if role == "user" { "assistant" } else { "user" };
        }
        bodies
    }

    /// The size asked for.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Request `index`'s body: the shared prefix, then a last user message that only it has, padded
    /// so the body is about [`size`](Self::size) bytes.
    pub fn body(&self, index: u64) -> Vec<u8> {
        let head = self.head();
        let question = question(index);
        let mut last = question.clone();
        let fixed = self.fixed(index);
        let mut filler = SmallRng::seed_from_u64(index);
        if fixed + 1 < self.size {
            let pad = prose(&mut filler, self.size - fixed - 1);
            last = format!("{question} {pad}");
        }
        let mut body = head;
        body.push_str(&message("user", &last));
        body.push_str("]}");
        body.into_bytes()
    }
}

impl Bodies {
    fn head(&self) -> String {
        format!(
            "{{\"model\":{},\"max_tokens\":{MAX_TOKENS},\"messages\":[{}",
            json_string(&self.model),
            self.prefix
        )
    }

    /// Request `index`'s body length before its last message is padded.
    fn fixed(&self, index: u64) -> usize {
        self.head().len() + message("user", &question(index)).len() + 2
    }
}

fn question(index: u64) -> String {
    format!("Question {index}: what does the worker that holds this prefix save")
}

/// About `bytes` bytes of words (never more), space-separated.
fn prose(rng: &mut SmallRng, bytes: usize) -> String {
    let mut text = String::with_capacity(bytes);
    loop {
        let word = WORDS
            .get(rng.random_range(0..WORDS.len()))
            .copied()
            .unwrap_or("the");
        if text.len() + word.len() + 1 > bytes {
            return text;
        }
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(word);
    }
}

fn message(role: &str, content: &str) -> String {
    format!(
        "{{\"role\":{},\"content\":{}}}",
        json_string(role),
        json_string(content)
    )
}

fn json_string(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_chat_requests_of_about_the_size_asked_with_a_shared_prefix_and_their_own_tail() {
        for size in [1_024, 4_096, 45 * 1_024, 200 * 1_024] {
            let bodies = Bodies::new("m", size, 7);
            let (one, two) = (bodies.body(1), bodies.body(2));
            for body in [&one, &two] {
                assert!(
                    body.len() <= size && body.len() + 64 >= size,
                    "{size}: {}",
                    body.len()
                );
                let json: serde_json::Value = serde_json::from_slice(body).expect("JSON");
                assert_eq!(json["model"], "m");
                let messages = json["messages"].as_array().expect("messages");
                assert_eq!(messages.first().expect("first")["role"], "system");
                assert_eq!(messages.last().expect("last")["role"], "user");
            }
            assert_ne!(one, two);
            let shared = one.iter().zip(&two).take_while(|(a, b)| a == b).count();
            assert!(shared + TAIL + 128 > size, "{size}: {shared} bytes shared");
        }
    }
}

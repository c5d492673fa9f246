//! Backends against known ids, templates against transformers' rendering (via the fixtures that
//! `tests/fixtures/tokenizer/make_fixtures.py` generated), and the segment cache.

use std::borrow::Cow;
use std::fs;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::*;
use crate::config::{ModelMatch, PolicyConfig, TiktokenEncoding};
use crate::worker::Engine;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

/// What the Python `tokenizers` and `jinja2` packages produced for the fixtures.
fn expected() -> Json {
    serde_json::from_str(&fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn ids(value: &Json) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

fn hugging_face() -> TokenizerConfig {
    TokenizerConfig::HuggingFace {
        path: fixture("tokenizer.json"),
    }
}

fn tiktoken(encoding: TiktokenEncoding) -> TokenizerConfig {
    TokenizerConfig::Tiktoken { encoding }
}

fn pool(tokenizer: TokenizerConfig, template: Option<&Path>) -> PoolTokenizer {
    PoolTokenizer::build(&tokenizer, template, NonZeroUsize::new(4096).unwrap()).unwrap()
}

fn fixture_chat_pool(tokenizer: TokenizerConfig) -> PoolTokenizer {
    pool(tokenizer, Some(&fixture("tokenizer_config.json")))
}

/// Messages owned by the test, lent out as [`ChatTurn`]s.
struct Messages(Vec<(String, Vec<Cow<'static, str>>)>);

impl Messages {
    fn new(messages: &[(&str, &str)]) -> Messages {
        Messages(
            messages
                .iter()
                .map(|(role, content)| (role.to_string(), vec![Cow::Owned(content.to_string())]))
                .collect(),
        )
    }

    fn turns(&self) -> Vec<ChatTurn<'_>> {
        self.0
            .iter()
            .map(|(role, parts)| ChatTurn { role, parts })
            .collect()
    }

    fn push(&mut self, role: &str, content: String) {
        self.0.push((role.to_string(), vec![Cow::Owned(content)]));
    }
}

fn fixture_chat() -> Messages {
    Messages::new(&[
        ("system", "You are a helpful assistant."),
        ("user", "How long should bread dough rise?"),
    ])
}

fn fixture_tools() -> String {
    expected()["chat"]["tools"].to_string()
}

/// The text of every segment of a chat, in order, as `tokens_for_chat` would tokenize them.
fn segments(pool: &PoolTokenizer, chat: &Messages) -> Vec<String> {
    let mut out = Vec::new();
    pool.tokenizer()
        .for_each_segment(Chat::new(&chat.turns()), |segment| {
            out.push(segment.concat());
            Ok(())
        })
        .unwrap();
    out
}

/// Tokens of the whole rendered chat, tokenized in one piece.
fn whole_text_tokens(pool: &PoolTokenizer, chat: &Messages) -> Vec<u32> {
    let text = pool.render_chat(Chat::new(&chat.turns())).unwrap();
    pool.tokenizer().encode(&text, Mode::Segment).unwrap()
}

/// A conversation of ordinary English turns, built from the fixture corpus.
fn conversation(turns: usize) -> Messages {
    let corpus = fs::read_to_string(fixture("corpus.txt")).unwrap();
    let paragraphs: Vec<&str> = corpus.split("\n\n").collect();
    let mut chat = Messages::new(&[("system", "You are a helpful assistant.")]);
    for turn in 0..turns {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        chat.push(role, paragraphs[turn % paragraphs.len()].to_string());
    }
    chat
}

fn tiktoken_decode(pool: &PoolTokenizer, tokens: &[u32]) -> String {
    pool.tokenizer().decode(tokens).unwrap()
}

#[test]
fn tiktoken_encodes_hello_world_to_its_published_ids() {
    let o200k = pool(tiktoken(TiktokenEncoding::O200kBase), None);
    assert_eq!(o200k.tokens_for_text("hello world").unwrap(), [24912, 2375]);
    let cl100k = pool(tiktoken(TiktokenEncoding::Cl100kBase), None);
    assert_eq!(
        cl100k.tokens_for_text("hello world").unwrap(),
        [15339, 1917]
    );
}

#[test]
fn tiktoken_tokens_decode_back_to_the_text() {
    let corpus = fs::read_to_string(fixture("corpus.txt")).unwrap();
    for encoding in TiktokenEncoding::ALL {
        let pool = pool(tiktoken(encoding), None);
        let tokens = pool.tokens_for_text(&corpus).unwrap();
        assert!(tokens.len() < corpus.len() / 3, "{encoding:?} compresses");
        assert_eq!(tiktoken_decode(&pool, &tokens), corpus, "{encoding:?}");
    }
}

#[test]
fn tiktoken_reads_a_special_token_in_the_text_as_one_token() {
    let pool = pool(tiktoken(TiktokenEncoding::O200kBase), None);
    let tokens = pool.tokens_for_text("end<|endoftext|>").unwrap();
    assert_eq!(tokens.len(), 2);
    assert_eq!(tokens[1], 199_999);
}

#[test]
fn the_hugging_face_fixture_tokenizes_as_the_python_package_does() {
    let pool = pool(hugging_face(), None);
    let expected = expected();
    for sample in expected["samples"].as_array().unwrap() {
        let text = sample["text"].as_str().unwrap();
        // A text prompt gets the post-processor's BOS; a chat segment does not.
        assert_eq!(
            pool.tokens_for_text(text).unwrap(),
            ids(&sample["ids_with_special_tokens"]),
            "{text}"
        );
        assert_eq!(
            pool.tokenizer().encode(text, Mode::Segment).unwrap(),
            ids(&sample["ids"]),
            "{text}"
        );
    }
}

#[test]
fn hugging_face_tokens_decode_back_to_the_text() {
    let pool = pool(hugging_face(), None);
    let text = "A loaf needs flour, water, salt and time: 12 hours.";
    let tokens = pool.tokenizer().encode(text, Mode::Segment).unwrap();
    assert_eq!(pool.tokenizer().decode(&tokens).unwrap(), text);
}

#[test]
fn bytes_packs_four_bytes_per_token_little_endian_and_zero_pads_the_last() {
    let pool = pool(TokenizerConfig::Bytes, None);
    let text = "hello wörld";
    let tokens = pool.tokens_for_text(text).unwrap();
    assert_eq!(
        tokens,
        [
            u32::from_le_bytes(*b"hell"),
            u32::from_le_bytes(*b"o w\xc3"),
            u32::from_le_bytes(*b"\xb6rld"),
        ]
    );
    let tail = pool.tokens_for_text("abcde").unwrap();
    assert_eq!(tail, [u32::from_le_bytes(*b"abcd"), u32::from(b'e')]);
    let unpacked: Vec<u8> = tokens
        .iter()
        .flat_map(|token| token.to_le_bytes())
        .collect();
    assert_eq!(unpacked, text.as_bytes());
}

#[test]
fn the_fixture_template_renders_a_two_turn_chat_as_transformers_does() {
    let pool = fixture_chat_pool(hugging_face());
    let expected = expected();
    let chat = fixture_chat();
    assert_eq!(
        pool.render_chat(Chat::new(&chat.turns())).unwrap(),
        expected["chat"]["rendered"].as_str().unwrap()
    );
    assert_eq!(
        pool.render_chat(Chat::new(&chat.turns()).with_tools(Some(&fixture_tools())))
            .unwrap(),
        expected["chat"]["rendered_with_tools"].as_str().unwrap()
    );
}

#[test]
fn chat_tokens_through_the_fixture_template_equal_whole_text_tokens_from_python() {
    let pool = fixture_chat_pool(hugging_face());
    let expected = expected();
    let chat = fixture_chat();
    let tokens = pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap();
    assert_eq!(tokens, ids(&expected["chat"]["ids"]));
    // The template's BOS, once: the post-processor adds none to chat segments.
    assert_eq!(tokens[..2], [0, 2]);
    assert_eq!(
        pool.tokens_for_chat(Chat::new(&chat.turns()).with_tools(Some(&fixture_tools())))
            .unwrap(),
        ids(&expected["chat"]["ids_with_tools"])
    );
}

#[test]
fn without_a_template_a_chat_renders_in_the_fixed_format() {
    let pool = pool(tiktoken(TiktokenEncoding::O200kBase), None);
    let parts = [Cow::Borrowed("Look at this:"), Cow::Borrowed("a picture")];
    let turns = [
        ChatTurn {
            role: "system",
            parts: &[Cow::Borrowed("Be brief.")],
        },
        ChatTurn {
            role: "user",
            parts: &parts,
        },
    ];
    let tools = r#"[{"type":"function","function":{"name":"f"}}]"#;
    assert_eq!(
        pool.render_chat(Chat::new(&turns).with_tools(Some(tools)))
            .unwrap(),
        "<|tools|>\n[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]\n\
         <|system|>\nBe brief.\n\
         <|user|>\nLook at this:\na picture\n\
         <|assistant|>\n"
    );
    assert_eq!(
        pool.render_chat(Chat::new(&[])).unwrap(),
        "<|assistant|>\n",
        "an empty chat is the generation prompt"
    );
}

#[test]
fn the_fixed_format_tokenizes_exactly_as_the_whole_text_under_o200k_and_cl100k() {
    let mut chat = conversation(12);
    // Endings that could reach across a boundary if any pattern let them.
    for ending in [
        "trailing spaces  ",
        "blank lines\n\n",
        "a/path/",
        "done!",
        "",
        " ",
    ] {
        chat.push("user", format!("Consider {ending}"));
        chat.push("assistant", ending.to_string());
    }
    for encoding in [TiktokenEncoding::O200kBase, TiktokenEncoding::Cl100kBase] {
        let pool = pool(tiktoken(encoding), None);
        assert_eq!(
            pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap(),
            whole_text_tokens(&pool, &chat),
            "{encoding:?}"
        );
    }
}

#[test]
fn ordinary_chat_text_through_a_template_with_special_tokens_equals_whole_text_tokens() {
    let pool = fixture_chat_pool(hugging_face());
    let chat = conversation(20);
    assert_eq!(
        pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap(),
        whole_text_tokens(&pool, &chat)
    );
}

/// Asserts that segment-wise and whole-text tokens differ, and only within the two segments that meet
/// at the boundary after segment `left`: every token before `left` agrees, and every token after the
/// segment following it agrees.
fn assert_difference_confined_to_boundary(pool: &PoolTokenizer, chat: &Messages, left: usize) {
    let segmented = pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap();
    let whole = whole_text_tokens(pool, chat);
    assert_ne!(segmented, whole, "the boundary changes the tokens");
    let lengths: Vec<usize> = segments(pool, chat)
        .iter()
        .map(|text| pool.tokenizer().encode(text, Mode::Segment).unwrap().len())
        .collect();
    let before: usize = lengths[..left].iter().sum();
    let after: usize = lengths[left + 2..].iter().sum();
    let common_prefix = segmented
        .iter()
        .zip(&whole)
        .take_while(|(a, b)| a == b)
        .count();
    let common_suffix = segmented
        .iter()
        .rev()
        .zip(whole.iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        common_prefix >= before,
        "agree before the boundary's segments: {common_prefix} < {before}"
    );
    assert!(
        common_suffix >= after,
        "agree after the boundary's segments: {common_suffix} < {after}"
    );
}

#[test]
fn punctuation_before_template_text_that_is_not_a_special_token_merges_in_the_whole_text() {
    // Under o200k_base `<|im_end|>` is plain text, so the whole text has `.<|` as one pre-token.
    let pool = fixture_chat_pool(tiktoken(TiktokenEncoding::O200kBase));
    let chat = Messages::new(&[
        ("system", "You are a helpful assistant"),
        ("user", "How long should bread dough rise?"),
        ("assistant", "Overnight in a cool room"),
    ]);
    let texts = segments(&pool, &chat);
    assert_eq!(texts[3], "How long should bread dough rise?");
    assert_difference_confined_to_boundary(&pool, &chat, 3);
}

#[test]
fn a_message_ending_in_a_newline_splits_differently_in_the_whole_text_under_gpt2_patterns() {
    // The GPT-2 pattern takes "\n\n" at the end of a segment as one pre-token (one token), but in the
    // whole text, before the next segment's `<|`, it leaves the last "\n" to a pre-token of its own.
    let chat = Messages::new(&[
        ("system", "You are a helpful assistant."),
        ("user", "def rise():\n    return 'overnight'\n"),
        ("assistant", "It returns overnight."),
    ]);
    for encoding in [TiktokenEncoding::P50kBase, TiktokenEncoding::R50kBase] {
        let pool = pool(tiktoken(encoding), None);
        assert!(segments(&pool, &chat)[1].ends_with("'overnight'\n\n"));
        assert_difference_confined_to_boundary(&pool, &chat, 1);
    }
}

#[test]
fn a_sentencepiece_style_tokenizer_marks_every_segment_start_as_a_word_start() {
    // Metaspace prepends "▁" to each encoded text, so the content after "[INST] " gains a "▁" token
    // that the whole text, where the literal's space already precedes it, does not have.
    let dir = directory(&[(
        "chat_template.jinja",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]\
         {% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
    )]);
    let pool = pool(
        TokenizerConfig::HuggingFace {
            path: fixture("metaspace_tokenizer.json"),
        },
        Some(&dir.path().join("chat_template.jinja")),
    );
    let chat = Messages::new(&[("user", "Hello there")]);
    assert_eq!(
        segments(&pool, &chat),
        ["[INST] ", "Hello there", " [/INST]"]
    );
    let segmented = pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap();
    assert_eq!(segmented.len(), whole_text_tokens(&pool, &chat).len() + 1);
    assert_difference_confined_to_boundary(&pool, &chat, 0);
}

#[test]
fn a_growing_conversation_tokenizes_only_its_new_turn() {
    let template = fixture("tokenizer_config.json");
    for (tokenizer, template) in [
        (hugging_face(), Some(template.as_path())),
        (tiktoken(TiktokenEncoding::O200kBase), None),
        (TokenizerConfig::Bytes, None),
    ] {
        let warm = pool(tokenizer.clone(), template);
        let mut chat = conversation(20);
        warm.tokens_for_chat(Chat::new(&chat.turns())).unwrap();
        let before = warm.cache_stats();

        chat.push(
            "user",
            "And one more question about the lighthouse?".to_string(),
        );
        let tokens = warm.tokens_for_chat(Chat::new(&chat.turns())).unwrap();
        let after = warm.cache_stats();

        assert_eq!(
            after.misses - before.misses,
            1,
            "{tokenizer:?}: only the new turn"
        );
        assert!(
            after.hits - before.hits >= 21,
            "{tokenizer:?}: every earlier segment"
        );
        let cold = pool(tokenizer, template);
        assert_eq!(
            tokens,
            cold.tokens_for_chat(Chat::new(&chat.turns())).unwrap()
        );
    }
}

#[test]
fn the_segment_cache_forgets_the_least_recently_used_segment() {
    let pool =
        PoolTokenizer::build(&TokenizerConfig::Bytes, None, NonZeroUsize::new(1).unwrap()).unwrap();
    for text in ["first", "first", "second", "first"] {
        pool.tokens_for_text(text).unwrap();
    }
    // One entry left, "first": two 4-byte pseudo-tokens and its five bytes of text, 4 units of 4 bytes.
    assert_eq!(
        pool.cache_stats(),
        CacheStats {
            hits: 1,
            misses: 3,
            bytes: 16
        }
    );
}

#[test]
fn a_text_prompt_and_a_chat_segment_with_equal_text_are_cached_apart() {
    let pool = pool(hugging_face(), None);
    let text = pool.tokens_for_text("<|assistant|>\n").unwrap();
    let chat = pool.tokens_for_chat(Chat::new(&[])).unwrap();
    assert_eq!(text[0], 0, "a text prompt gets the BOS");
    assert_eq!(text[1..], chat[..]);
    assert_eq!(pool.cache_stats().misses, 2);
}

/// Writes `files` into a fresh directory and returns it.
fn directory(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

/// A pool over `tokenizer` whose chat template is `template`, one of `files` written to a fresh directory.
fn directory_pool(
    tokenizer: TokenizerConfig,
    files: &[(&str, &str)],
    template: &str,
) -> PoolTokenizer {
    let dir = directory(files);
    pool(tokenizer, Some(&dir.path().join(template)))
}

/// Renders a chat of one user message, "hi".
fn render_hi(pool: &PoolTokenizer, tools: Option<&str>) -> String {
    let chat = Messages::new(&[("user", "hi")]);
    pool.render_chat(Chat::new(&chat.turns()).with_tools(tools))
        .unwrap()
}

#[test]
fn a_template_that_drops_a_message_is_rendered_and_tokenized_whole() {
    let pool = directory_pool(
        hugging_face(),
        &[(
            "chat_template.jinja",
            "{% for m in messages %}{% if m.role != 'system' %}[{{ m.role }}] {{ m.content }}\n\
             {% endif %}{% endfor %}[assistant] ",
        )],
        "chat_template.jinja",
    );
    let chat = fixture_chat();
    let rendered = pool.render_chat(Chat::new(&chat.turns())).unwrap();
    assert_eq!(
        rendered,
        "[user] How long should bread dough rise?\n[assistant] "
    );
    assert_eq!(segments(&pool, &chat), [rendered]);
    assert_eq!(
        pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap(),
        whole_text_tokens(&pool, &chat)
    );
}

#[test]
fn templates_may_call_python_string_methods() {
    let pool = directory_pool(
        TokenizerConfig::Bytes,
        &[(
            "chat_template.jinja",
            "{% for m in messages %}{{ m.role.upper() }}: {{ m.content.strip() }}|{% endfor %}",
        )],
        "chat_template.jinja",
    );
    assert_eq!(render_hi(&pool, None), "USER: hi|");
}

#[test]
fn a_jinja_template_takes_its_special_tokens_from_the_tokenizer_config_beside_it() {
    let pool = directory_pool(
        TokenizerConfig::Bytes,
        &[
            (
                "chat_template.jinja",
                "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            ),
            (
                "tokenizer_config.json",
                r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#,
            ),
        ],
        "chat_template.jinja",
    );
    assert_eq!(render_hi(&pool, None), "<s>hi</s>");
}

#[test]
fn a_named_template_list_renders_tool_use_when_the_request_has_tools() {
    let config = serde_json::json!({
        "chat_template": [
            {"name": "default", "template": "plain: {{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools {{ tools[0].name }}: {{ messages[0].content }}"},
        ]
    });
    let pool = directory_pool(
        TokenizerConfig::Bytes,
        &[("tokenizer_config.json", &config.to_string())],
        "tokenizer_config.json",
    );
    assert_eq!(render_hi(&pool, None), "plain: hi");
    assert_eq!(render_hi(&pool, Some(r#"[{"name": "f"}]"#)), "tools f: hi");
}

#[test]
fn a_pool_config_builds_its_tokenizer() {
    let config = PoolConfig {
        model: ModelMatch::Any,
        engine: Engine::Vllm,
        block_size: NonZeroU32::new(64).unwrap(),
        engine_block_size: None,
        tokenizer: hugging_face(),
        chat_template: Some(fixture("tokenizer_config.json")),
        segment_cache_entries: NonZeroUsize::new(16).unwrap(),
        default_cache_blocks: NonZeroUsize::new(16).unwrap(),
        max_model_len: std::num::NonZeroU64::MAX,
        workers: Vec::new(),
        policy: PolicyConfig::default(),
        index: Default::default(),
        discovery: crate::config::Discovery::Static,
        template: Default::default(),
        max_workers: NonZeroUsize::new(8).unwrap(),
        pd: None,
    };
    let pool = PoolTokenizer::new(&config).unwrap();
    assert_eq!(
        pool.tokens_for_chat(Chat::new(&fixture_chat().turns()))
            .unwrap(),
        ids(&expected()["chat"]["ids"])
    );
}

fn build_error(tokenizer: TokenizerConfig, template: Option<&Path>) -> String {
    match PoolTokenizer::build(&tokenizer, template, NonZeroUsize::new(8).unwrap()) {
        Ok(_) => panic!("expected an error"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn a_missing_tokenizer_file_is_an_error_naming_it() {
    let message = build_error(
        TokenizerConfig::HuggingFace {
            path: PathBuf::from("/nonexistent/tokenizer.json"),
        },
        None,
    );
    assert!(
        message.starts_with("cannot read /nonexistent/tokenizer.json: "),
        "{message}"
    );
}

#[test]
fn a_malformed_tokenizer_file_is_an_error_naming_it() {
    let dir = directory(&[("tokenizer.json", r#"{"model": "nonsense"}"#)]);
    let path = dir.path().join("tokenizer.json");
    let message = build_error(TokenizerConfig::HuggingFace { path: path.clone() }, None);
    assert!(
        message.starts_with(&format!(
            "{} is not a usable tokenizer.json: ",
            path.display()
        )),
        "{message}"
    );
}

#[test]
fn a_template_with_a_syntax_error_is_an_error_naming_the_file() {
    let dir = directory(&[(
        "chat_template.jinja",
        "{% for m in messages %}{{ m.content }}",
    )]);
    let path = dir.path().join("chat_template.jinja");
    let message = build_error(TokenizerConfig::Bytes, Some(&path));
    assert!(
        message.starts_with(&format!("chat template {}: syntax error", path.display())),
        "{message}"
    );
}

#[test]
fn a_missing_template_file_is_an_error_naming_it() {
    let message = build_error(
        TokenizerConfig::Bytes,
        Some(Path::new("/nonexistent/chat_template.jinja")),
    );
    assert!(
        message.starts_with("cannot read /nonexistent/chat_template.jinja: "),
        "{message}"
    );
}

#[test]
fn a_tokenizer_config_without_a_chat_template_is_an_error() {
    let dir = directory(&[("tokenizer_config.json", r#"{"bos_token": "<s>"}"#)]);
    let path = dir.path().join("tokenizer_config.json");
    let message = build_error(TokenizerConfig::Bytes, Some(&path));
    assert!(message.contains("has no chat_template"), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");

    let dir = directory(&[("tokenizer_config.json", "{not json")]);
    let message = build_error(
        TokenizerConfig::Bytes,
        Some(&dir.path().join("tokenizer_config.json")),
    );
    assert!(message.contains("not valid JSON"), "{message}");
}

#[test]
fn a_template_that_raises_fails_the_chat_with_its_message() {
    let pool = fixture_chat_pool(TokenizerConfig::Bytes);
    let chat = Messages::new(&[("narrator", "Once upon a time")]);
    let err = pool.tokens_for_chat(Chat::new(&chat.turns())).unwrap_err();
    assert!(matches!(err, TokenizeError::Render { .. }), "{err:?}");
    assert!(err.to_string().contains("unknown role: narrator"), "{err}");
}

#[test]
fn tools_that_are_not_json_fail_the_chat() {
    let pool = fixture_chat_pool(TokenizerConfig::Bytes);
    let err = pool
        .tokens_for_chat(Chat::new(&fixture_chat().turns()).with_tools(Some("[{")))
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Tools(_)), "{err:?}");
}

#[test]
fn a_pool_tokenizer_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<PoolTokenizer>();
    shared::<TokenizeError>();
}

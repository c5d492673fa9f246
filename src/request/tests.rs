//! The body parser as tables of bodies: each API and prompt shape, each error with its status, kind and
//! message, borrowing, the depth bound on a small stack, pool selection; and properties over arbitrary
//! and mutated bodies.

use proptest::prelude::*;

use super::body::MAX_DEPTH;
use super::*;
use crate::config::{self, Overrides};

const LIMIT: usize = 1 << 20;
const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const GENERATE: &str = "/generate";

/// A prompt in a form tests can compare.
#[derive(Debug, PartialEq)]
enum Shape {
    /// (role, parts) per message, and `tools` as written.
    Chat(Vec<(String, Vec<String>)>, Option<String>),
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&Prompt<'_>> for Shape {
    fn from(prompt: &Prompt<'_>) -> Self {
        match prompt {
            Prompt::Chat { messages, tools } => Shape::Chat(
                messages
                    .iter()
                    .map(|message| {
                        let parts = message.content.iter().map(|p| p.to_string()).collect();
                        (message.role.to_string(), parts)
                    })
                    .collect(),
                tools.map(|tools| tools.get().to_owned()),
            ),
            Prompt::Text(text) => Shape::Text(text.to_string()),
            Prompt::Tokens(tokens) => Shape::Tokens(tokens.clone()),
        }
    }
}

fn chat(messages: &[(&str, &[&str])]) -> Shape {
    chat_with_tools(messages, None)
}

fn chat_with_tools(messages: &[(&str, &[&str])], tools: Option<&str>) -> Shape {
    let messages = messages
        .iter()
        .map(|(role, parts)| {
            let parts = parts.iter().map(|part| part.to_string()).collect();
            (role.to_string(), parts)
        })
        .collect();
    Shape::Chat(messages, tools.map(str::to_owned))
}

fn text(text: &str) -> Shape {
    Shape::Text(text.to_owned())
}

fn parsed<'a>(path: &str, body: &'a str) -> ParsedRequest<'a> {
    parse(path, body.as_bytes(), LIMIT)
        .unwrap_or_else(|error| panic!("{path} {body}: {error} ({})", error.reason().as_str()))
}

fn refused(path: &str, body: &[u8], limit: usize) -> BodyError {
    match parse(path, body, limit) {
        Ok(request) => panic!("accepted {}: {request:?}", String::from_utf8_lossy(body)),
        Err(error) => error,
    }
}

#[test]
fn each_api_reads_each_of_its_prompt_shapes() {
    let user = r#"{"role":"user","content":"hi"}"#;
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, String, Api, Shape)> = vec![
        ("chat with string content", CHAT,
         format!(r#"{{"model":"m","messages":[{{"role":"system","content":"be brief"}},{user}]}}"#),
         Api::ChatCompletions, chat(&[("system", &["be brief"]), ("user", &["hi"])])),
        ("chat with text parts in order", CHAT,
         r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"text":"b","type":"text"}]}]}"#
             .to_owned(),
         Api::ChatCompletions, chat(&[("user", &["a", "b"])])),
        ("chat with a part that has text but no type", CHAT,
         r#"{"messages":[{"role":"user","content":[{"text":"a"}]}]}"#.to_owned(),
         Api::ChatCompletions, chat(&[("user", &["a"])])),
        ("chat with null content and tool calls, kept verbatim", CHAT,
         format!(r#"{{"messages":[{user},{{"role":"assistant","content":null,"tool_calls":[ {{"id":"c1"}} ]}}]}}"#),
         Api::ChatCompletions, chat(&[("user", &["hi"]), ("assistant", &[r#"[ {"id":"c1"} ]"#])])),
        ("chat with content and tool calls, the calls last", CHAT,
         r#"{"messages":[{"tool_calls":[],"role":"assistant","content":"ok"}]}"#.to_owned(),
         Api::ChatCompletions, chat(&[("assistant", &["ok", "[]"])])),
        ("chat with a tool message whose id is not part of the prompt", CHAT,
         format!(r#"{{"messages":[{user},{{"role":"tool","tool_call_id":"c1","name":"f","content":"42"}}]}}"#),
         Api::ChatCompletions, chat(&[("user", &["hi"]), ("tool", &["42"])])),
        ("chat with tools kept as written", CHAT,
         format!(r#"{{"tools": [{{"type":"function"}}] ,"messages":[{user}]}}"#),
         Api::ChatCompletions, chat_with_tools(&[("user", &["hi"])], Some(r#"[{"type":"function"}]"#))),
        ("chat with null tools", CHAT, format!(r#"{{"tools":null,"messages":[{user}]}}"#),
         Api::ChatCompletions, chat(&[("user", &["hi"])])),
        ("chat with escapes, decoded", CHAT,
         r#"{"messages":[{"role":"us\u0065r","content":"a\"b\n\u00e9"}]}"#.to_owned(),
         Api::ChatCompletions, chat(&[("user", &["a\"b\n\u{e9}"])])),
        ("chat with an escaped member name", CHAT,
         r#"{"m\u0065ssages":[{"role":"user","content":"hi"}]}"#.to_owned(),
         Api::ChatCompletions, chat(&[("user", &["hi"])])),
        ("chat with an empty message among others", CHAT,
         format!(r#"{{"messages":[{{"role":"system","content":""}},{user}]}}"#),
         Api::ChatCompletions, chat(&[("system", &[""]), ("user", &["hi"])])),
        ("chat whose only content is an image", CHAT,
         r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#.to_owned(),
         Api::ChatCompletions, chat(&[("user", &["<image_url:92e78da7bbeffde6>"])])),
        ("completions with a string", COMPLETIONS, r#"{"prompt":"once upon"}"#.to_owned(),
         Api::Completions, text("once upon")),
        ("completions with a batch of strings, by the first", COMPLETIONS,
         r#"{"prompt":["first","second"]}"#.to_owned(), Api::Completions, text("first")),
        ("completions with a batch whose later items are not read", COMPLETIONS,
         r#"{"prompt":["first",3,{"x":[1]},null]}"#.to_owned(), Api::Completions, text("first")),
        ("completions with token ids", COMPLETIONS, r#"{"prompt":[1, 2 ,4294967295]}"#.to_owned(),
         Api::Completions, Shape::Tokens(vec![1, 2, u32::MAX])),
        ("completions with a batch of token lists, by the first", COMPLETIONS,
         r#"{"prompt":[[5,6],[7]]}"#.to_owned(), Api::Completions, Shape::Tokens(vec![5, 6])),
        ("generate with text", GENERATE, r#"{"text":"hello"}"#.to_owned(), Api::Generate, text("hello")),
        ("generate with a batch of texts", GENERATE, r#"{"text":["a","b"]}"#.to_owned(),
         Api::Generate, text("a")),
        ("generate with input ids", GENERATE, r#"{"input_ids":[9,8]}"#.to_owned(),
         Api::Generate, Shape::Tokens(vec![9, 8])),
        ("generate with a batch of input ids", GENERATE, r#"{"input_ids":[[9],[8]]}"#.to_owned(),
         Api::Generate, Shape::Tokens(vec![9])),
        ("generate with both, by the input ids", GENERATE,
         r#"{"input_ids":[1],"text":"a"}"#.to_owned(), Api::Generate, Shape::Tokens(vec![1])),
        ("the query string ignored", "/v1/completions?api-version=2", r#"{"prompt":"p"}"#.to_owned(),
         Api::Completions, text("p")),
        ("a gateway prefix before the API path", "/openai/v1/chat/completions",
         format!(r#"{{"messages":[{user}]}}"#), Api::ChatCompletions, chat(&[("user", &["hi"])])),
        ("unknown members skipped, whatever their type", COMPLETIONS,
         r#"{"temperature":0.7,"logit_bias":{"50256":-100},"stop":["\n"],"n":1,"echo":false,"user":null,"prompt":"p"}"#
             .to_owned(),
         Api::Completions, text("p")),
        ("another API's prompt member skipped unread on a known path", CHAT,
         format!(r#"{{"prompt":{{"not":"read"}},"input_ids":"x","messages":[{user}]}}"#),
         Api::ChatCompletions, chat(&[("user", &["hi"])])),
        ("a member given twice keeps its last value", COMPLETIONS,
         r#"{"prompt":"first","prompt":"last"}"#.to_owned(), Api::Completions, text("last")),
        ("whitespace around everything", COMPLETIONS, " \n{ \"prompt\" : \"p\" } \t".to_owned(),
         Api::Completions, text("p")),
    ];
    for (name, path, body, api, shape) in cases {
        let request = parsed(path, &body);
        assert_eq!(request.api, api, "{name}");
        assert_eq!(Shape::from(&request.prompt), shape, "{name}");
    }
}

#[test]
fn a_path_naming_no_api_is_read_by_the_body_shape() {
    #[rustfmt::skip]
    let cases = [
        ("/", r#"{"messages":[{"role":"user","content":"hi"}]}"#, Api::ChatCompletions),
        ("/v1/responses", r#"{"prompt":"p"}"#, Api::Completions),
        ("", r#"{"text":"t"}"#, Api::Generate),
        ("/generate/", r#"{"input_ids":[1]}"#, Api::Generate),
        ("/v1/completions/", r#"{"messages":[{"role":"user","content":"hi"}]}"#, Api::ChatCompletions),
        ("/x?path=/v1/completions", r#"{"text":"t"}"#, Api::Generate),
        ("/x", r#"{"text":"t","prompt":"p"}"#, Api::Completions),
        ("/x", r#"{"prompt":"p","messages":[{"role":"user","content":"hi"}]}"#, Api::ChatCompletions),
    ];
    for (path, body, api) in cases {
        assert_eq!(parsed(path, body).api, api, "{path} {body}");
    }
}

#[test]
fn the_requested_output_is_read_leniently() {
    #[rustfmt::skip]
    let cases = [
        (COMPLETIONS, r#"{"max_tokens":100,"prompt":"p"}"#, Some(100)),
        (COMPLETIONS, r#"{"max_tokens":100.7,"prompt":"p"}"#, Some(100)),
        (COMPLETIONS, r#"{"max_tokens":1e30,"prompt":"p"}"#, Some(u64::MAX)),
        (COMPLETIONS, r#"{"max_tokens":-1,"prompt":"p"}"#, None),
        (COMPLETIONS, r#"{"max_tokens":"9","prompt":"p"}"#, None),
        (COMPLETIONS, r#"{"max_tokens":[1,{"a":2}],"prompt":"p"}"#, None),
        (COMPLETIONS, r#"{"max_tokens":null,"prompt":"p"}"#, None),
        (COMPLETIONS, r#"{"prompt":"p"}"#, None),
        // The engine may honour either: the larger counts.
        (CHAT, r#"{"max_tokens":5,"max_completion_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#, Some(9)),
        (CHAT, r#"{"max_completion_tokens":9,"max_tokens":50,"messages":[{"role":"user","content":"hi"}]}"#, Some(50)),
        (GENERATE, r#"{"sampling_params":{"temperature":0,"max_new_tokens":7,"stop":["x"]},"text":"t"}"#, Some(7)),
        (GENERATE, r#"{"sampling_params":{"max_new_tokens":"7"},"text":"t"}"#, None),
        (GENERATE, r#"{"sampling_params":[],"text":"t"}"#, None),
    ];
    for (path, body, expected) in cases {
        assert_eq!(
            parsed(path, body).max_output_tokens,
            expected,
            "{path} {body}"
        );
    }
    // Skipped within the depth bound like every other member.
    let deep = format!(
        r#"{{"prompt":"p","max_tokens":{}1{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    assert!(matches!(
        parse(COMPLETIONS, deep.as_bytes(), 1 << 20),
        Err(BodyError::TooDeep { .. })
    ));
}

#[test]
fn members_routing_does_not_read_are_not_type_checked() {
    // What vLLM and SGLang accept, or validate themselves: the picker has no opinion on them.
    #[rustfmt::skip]
    let cases = [
        (COMPLETIONS, r#"{"max_tokens":100.0,"prompt":"p"}"#),
        (COMPLETIONS, r#"{"stream":"true","prompt":"p"}"#),
        (COMPLETIONS, r#"{"max_tokens":-1,"stream":1,"prompt":"p"}"#),
        (CHAT, r#"{"max_completion_tokens":1.5,"messages":[{"role":"user","content":"hi"}]}"#),
        (GENERATE, r#"{"sampling_params":[],"text":"t"}"#),
        (GENERATE, r#"{"sampling_params":{"max_new_tokens":"9"},"text":"t"}"#),
    ];
    for (path, body) in cases {
        assert!(
            parse(path, body.as_bytes(), 1 << 20).is_ok(),
            "{path} {body}"
        );
    }
    let request = parsed(
        COMPLETIONS,
        r#"{"model":"m","cache_salt":"s","stream":true,"prompt":"p"}"#,
    );
    assert_eq!(
        (request.model.as_deref(), request.cache_salt.as_deref()),
        (Some("m"), Some("s"))
    );
    let request = parsed(
        COMPLETIONS,
        r#"{"model":null,"cache_salt":null,"prompt":"p"}"#,
    );
    assert_eq!((request.model, request.cache_salt), (None, None));
}

#[test]
fn strings_without_escapes_are_borrowed_from_the_body() {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"plain"},{"role":"user","content":[{"type":"text","text":"esc\u0061ped"}]}]}"#;
    let request = parsed(CHAT, body);
    assert!(matches!(request.model, Some(Cow::Borrowed("m"))));
    let Prompt::Chat { messages, .. } = &request.prompt else {
        panic!("{request:?}")
    };
    assert!(matches!(messages[0].role, Cow::Borrowed("user")));
    assert!(matches!(messages[0].content[0], Cow::Borrowed("plain")));
    assert!(matches!(&messages[1].content[0], Cow::Owned(text) if text == "escaped"));
    let prompt = parsed(COMPLETIONS, r#"{"prompt":["first"]}"#).prompt;
    assert!(matches!(prompt, Prompt::Text(Cow::Borrowed("first"))));
    let prompt = parsed(GENERATE, r#"{"text":"t\/"}"#).prompt;
    assert!(matches!(prompt, Prompt::Text(Cow::Owned(text)) if text == "t/"));
}

#[test]
fn a_non_text_part_becomes_a_placeholder_hashing_its_json() {
    let part = |part: &str| {
        let body = format!(r#"{{"messages":[{{"role":"user","content":[{part}]}}]}}"#);
        let request = parse(CHAT, body.as_bytes(), LIMIT).unwrap();
        match Shape::from(&request.prompt) {
            Shape::Chat(messages, _) => messages[0].1[0].clone(),
            shape => panic!("{shape:?}"),
        }
    };
    let cat = part(r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,Y2F0"}}"#);
    let dog = part(r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,ZG9n"}}"#);
    assert!(
        cat.starts_with("<image_url:") && cat.ends_with('>'),
        "{cat}"
    );
    assert_eq!(cat.len(), "<image_url:>".len() + 16, "{cat}");
    assert_ne!(cat, dog);
    // The same members give the same placeholder wherever `type` is written.
    let late_type =
        part(r#"{"image_url":{"url":"data:image/png;base64,Y2F0"},"type":"image_url"}"#);
    assert_eq!(cat, late_type);
    let audio = part(r#"{"type":"input_audio","input_audio":{"data":"Y2F0","format":"wav"}}"#);
    assert!(audio.starts_with("<input_audio:"), "{audio}");
    // Pinned, so the prefix of a conversation with an image survives a cachepick upgrade.
    assert_eq!(
        part(r#"{"type":"image_url","image_url":{"url":"x"}}"#),
        "<image_url:92e78da7bbeffde6>"
    );
}

/// A case of a refused body: name, path, body, and the error's kind, status and (part of its) message.
type Refusal = (
    &'static str,
    &'static str,
    Vec<u8>,
    &'static str,
    u16,
    &'static str,
);

#[test]
fn each_refused_body_has_its_status_kind_and_message() {
    let message =
        |content: &str| format!(r#"{{"messages":[{{"role":"user","content":{content}}}]}}"#);
    #[rustfmt::skip]
    let cases: Vec<Refusal> = vec![
        ("invalid UTF-8 in the prompt", COMPLETIONS, b"{\"prompt\":\"a\xffb\"}".to_vec(), "not_utf8", 400,
         "the request body is not UTF-8: invalid byte at offset 12"),
        ("invalid UTF-8 in a skipped member", COMPLETIONS, b"{\"user\":\"\xc3\",\"prompt\":\"p\"}".to_vec(),
         "not_utf8", 400, "offset 9"),
        ("invalid UTF-8 in a key", COMPLETIONS, b"{\"\xed\xa0\x80\":1,\"prompt\":\"p\"}".to_vec(),
         "not_utf8", 400, "offset 2"),
        ("invalid UTF-8 outside any string", COMPLETIONS, b"\xfe{\"prompt\":\"p\"}".to_vec(), "not_utf8", 400,
         "offset 0"),
        ("an empty body", COMPLETIONS, b"".to_vec(), "invalid_json", 400,
         "the request body is not valid JSON: EOF while parsing a value at line 1 column 0"),
        ("an unterminated object", COMPLETIONS, br#"{"prompt":"p""#.to_vec(), "invalid_json", 400,
         "EOF while parsing an object"),
        ("trailing characters", COMPLETIONS, br#"{"prompt":"p"} x"#.to_vec(), "invalid_json", 400,
         "trailing characters at line 1 column 16"),
        ("single quotes", COMPLETIONS, br#"{'prompt':'p'}"#.to_vec(), "invalid_json", 400, "key must be a string"),
        ("a syntax error in a skipped member", COMPLETIONS, br#"{"n":[1,,2],"prompt":"p"}"#.to_vec(),
         "invalid_json", 400, "expected value"),
        ("a list as the body", COMPLETIONS, b"[]".to_vec(), "wrong_type", 400,
         "the request body must be a JSON object, got a list"),
        ("null as the body", COMPLETIONS, b"null".to_vec(), "wrong_type", 400,
         "the request body must be a JSON object, got null"),
        ("a string as the body", COMPLETIONS, br#""p""#.to_vec(), "wrong_type", 400,
         "the request body must be a JSON object, got a string"),
        ("a numeric model", COMPLETIONS, br#"{"model":3,"prompt":"p"}"#.to_vec(), "wrong_type", 400,
         "`model` must be a string, got a number"),
        ("a cache salt as a list", COMPLETIONS, br#"{"cache_salt":["s"],"prompt":"p"}"#.to_vec(),
         "wrong_type", 400, "`cache_salt` must be a string, got a list"),
        ("messages as an object", CHAT, br#"{"messages":{"role":"user"}}"#.to_vec(), "wrong_type", 400,
         "`messages` must be a list of messages, got an object"),
        ("a message as a string", CHAT, br#"{"messages":[{"role":"user","content":"a"},"hi"]}"#.to_vec(),
         "wrong_type", 400, "`messages[1]` must be an object, got a string"),
        ("a numeric role", CHAT, br#"{"messages":[{"role":1,"content":"a"}]}"#.to_vec(), "wrong_type", 400,
         "`messages[0].role` must be a string, got a number"),
        ("numeric content", CHAT, message("7").into_bytes(), "wrong_type", 400,
         "`messages[0].content` must be a string or a list of content parts, got a number"),
        ("content as an object", CHAT, message(r#"{"type":"text"}"#).into_bytes(), "wrong_type", 400,
         "`messages[0].content` must be a string or a list of content parts, got an object"),
        ("a content part as a string", CHAT, message(r#"[{"type":"text","text":"a"},"b"]"#).into_bytes(),
         "wrong_type", 400, "`messages[0].content[1]` must be a content part object, got a string"),
        ("a part's text as a list", CHAT, message(r#"[{"type":"text","text":["a"]}]"#).into_bytes(),
         "wrong_type", 400, "`messages[0].content[0].text` must be a string, got a list"),
        ("a part's type as a boolean", CHAT, message(r#"[{"type":true,"text":"a"}]"#).into_bytes(),
         "wrong_type", 400, "`messages[0].content[0].type` must be a string, got a boolean"),
        ("tools as an object", CHAT, br#"{"tools":{"type":"function"}}"#.to_vec(), "wrong_type", 400,
         "`tools` must be a list of tools, got an object"),
        ("tool calls as a string", CHAT, br#"{"messages":[{"role":"assistant","tool_calls":"f()"}]}"#.to_vec(),
         "wrong_type", 400, "`messages[0].tool_calls` must be a list of tool calls, got a string"),
        ("a prompt as an object", COMPLETIONS, br#"{"prompt":{"text":"p"}}"#.to_vec(), "wrong_type", 400,
         "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists, \
          got an object"),
        ("a prompt as a number", COMPLETIONS, br#"{"prompt":12}"#.to_vec(), "wrong_type", 400,
         "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists, \
          got a number"),
        ("a prompt list starting with a boolean", COMPLETIONS, br#"{"prompt":[true]}"#.to_vec(),
         "wrong_type", 400, "`prompt[0]` must be a string, a token id or a list of token ids, got a boolean"),
        ("a token list with a string", COMPLETIONS, br#"{"prompt":[1,"a"]}"#.to_vec(), "wrong_type", 400,
         "`prompt[1]` must be a token id (an integer from 0 to 4294967295), got a string"),
        ("a token id beyond u32", COMPLETIONS, br#"{"prompt":[1,4294967296]}"#.to_vec(), "wrong_type", 400,
         "`prompt[1]` must be a token id (an integer from 0 to 4294967295), got a number above 4294967295"),
        ("a negative token id", COMPLETIONS, br#"{"prompt":[[1,-2]]}"#.to_vec(), "wrong_type", 400,
         "`prompt[0][1]` must be a token id (an integer from 0 to 4294967295), got a negative number"),
        ("a fractional first token id", COMPLETIONS, br#"{"prompt":[1.0]}"#.to_vec(), "wrong_type", 400,
         "`prompt[0]` must be a token id (an integer from 0 to 4294967295), got a number that is not"),
        ("a token list nested in a token list", COMPLETIONS, br#"{"prompt":[[[1]]]}"#.to_vec(),
         "wrong_type", 400, "`prompt[0][0]` must be a token id (an integer from 0 to 4294967295), got a list"),
        ("input ids as a string", GENERATE, br#"{"input_ids":"1 2"}"#.to_vec(), "wrong_type", 400,
         "`input_ids` must be a list of token ids or a list of token-id lists, got a string"),
        ("input ids as a list of strings", GENERATE, br#"{"input_ids":["1"]}"#.to_vec(), "wrong_type", 400,
         "`input_ids[0]` must be a token id or a list of token ids, got a string"),
        ("text as a list of numbers", GENERATE, br#"{"text":[1]}"#.to_vec(), "wrong_type", 400,
         "`text[0]` must be a string, got a number"),
        ("text as a list of lists", GENERATE, br#"{"text":[["a"]]}"#.to_vec(), "wrong_type", 400,
         "`text[0]` must be a string, got a list"),
        ("no messages on the chat path", CHAT, br#"{"prompt":"p"}"#.to_vec(), "missing_field", 400,
         "`messages` is required for /v1/chat/completions"),
        ("null messages on the chat path", CHAT, br#"{"messages":null}"#.to_vec(), "missing_field", 400,
         "`messages` is required for /v1/chat/completions"),
        ("no prompt on the completions path", COMPLETIONS, br#"{"text":"t"}"#.to_vec(), "missing_field",
         400, "`prompt` is required for /v1/completions"),
        ("no text or input ids on the generate path", GENERATE, br#"{"prompt":"p"}"#.to_vec(),
         "missing_field", 400, "`text` or `input_ids` is required for /generate"),
        ("no prompt member on an unknown path", "/v1/embeddings", br#"{"input":"p"}"#.to_vec(),
         "missing_field", 400,
         "the body holds no prompt: expected `messages`, `prompt`, `text` or `input_ids`"),
        ("a message without a role", CHAT, br#"{"messages":[{"content":"a"}]}"#.to_vec(), "missing_field",
         400, "`messages[0].role` is required"),
        ("a text part without text", CHAT, message(r#"[{"type":"text"}]"#).into_bytes(), "missing_field",
         400, "`messages[0].content[0].text` is required"),
        ("a part with neither type nor text", CHAT, message(r#"[{"image_url":{"url":"x"}}]"#).into_bytes(),
         "missing_field", 400, "`messages[0].content[0].type` is required"),
        ("no messages", CHAT, br#"{"messages":[]}"#.to_vec(), "empty_prompt", 400,
         "the prompt is empty: `messages` holds no text or token ids"),
        ("messages whose content is all empty", CHAT,
         br#"{"messages":[{"role":"system","content":""},{"role":"user","content":[]},{"role":"user"},
             {"role":"user","content":[{"type":"text","text":""}]}]}"#.to_vec(), "empty_prompt", 400,
         "`messages` holds no text"),
        ("an empty prompt string", COMPLETIONS, br#"{"prompt":""}"#.to_vec(), "empty_prompt", 400,
         "`prompt` holds no text"),
        ("an empty prompt list", COMPLETIONS, br#"{"prompt":[]}"#.to_vec(), "empty_prompt", 400,
         "`prompt` holds no text"),
        ("a batch whose first prompt is empty", COMPLETIONS, br#"{"prompt":["","b"]}"#.to_vec(),
         "empty_prompt", 400, "`prompt` holds no text"),
        ("an empty token list", COMPLETIONS, br#"{"prompt":[[],[1]]}"#.to_vec(), "empty_prompt", 400,
         "`prompt` holds no text"),
        ("empty input ids", GENERATE, br#"{"input_ids":[]}"#.to_vec(), "empty_prompt", 400,
         "`input_ids` holds no text"),
        ("an empty text", GENERATE, br#"{"text":""}"#.to_vec(), "empty_prompt", 400, "`text` holds no text"),
        ("an empty text batch", GENERATE, br#"{"text":[]}"#.to_vec(), "empty_prompt", 400,
         "`text` holds no text"),
    ];
    for (name, path, body, kind, status, message) in cases {
        let error = refused(path, &body, LIMIT);
        assert_eq!(
            (error.reason().as_str(), error.reason().status()),
            (kind, status),
            "{name}: {error}"
        );
        assert!(
            error.to_string().contains(message),
            "{name}: {error}\nexpected: {message}"
        );
    }
    // The first problem in the body is the one reported.
    let error = refused(COMPLETIONS, br#"{"model":1,"prompt":{}}"#, LIMIT);
    assert_eq!(error.to_string(), "`model` must be a string, got a number");
}

#[test]
fn a_body_over_the_limit_is_refused_unread() {
    let body = br#"{"prompt":"p"}"#;
    assert!(parse(COMPLETIONS, body, body.len()).is_ok());
    let error = refused(COMPLETIONS, body, body.len() - 1);
    assert_eq!(
        (error.reason().as_str(), error.reason().status()),
        ("too_large", 413)
    );
    assert_eq!(
        error.to_string(),
        "the request body has 14 bytes, more than max_body_bytes (13)"
    );
    // Not even UTF-8, but the size is all that is looked at.
    let error = refused(CHAT, &[0xff; 100], 99);
    assert_eq!(error.reason().as_str(), "too_large");
}

/// `depth` nested arrays (`[[…]]`) or objects (`{"a":{"a":…}}`) around `1`.
fn nested(depth: usize, objects: bool) -> String {
    let (open, close) = if objects {
        (r#"{"a":"#, "}")
    } else {
        ("[", "]")
    };
    format!("{}1{}", open.repeat(depth), close.repeat(depth))
}

/// A body with a value placed in one kind of member: where, the path that reads that member, how many
/// arrays and objects enclose the value (the body's own object included), and the body.
struct Placement {
    place: &'static str,
    path: &'static str,
    enclosing: usize,
    body: String,
}

/// `value` in every kind of member that may hold a list or an object.
fn placements(value: &str) -> Vec<Placement> {
    let user = r#"{"role":"user","content":"hi"}"#;
    #[rustfmt::skip]
    let placements = [
        ("a skipped member", CHAT, 1, format!(r#"{{"x":{value},"messages":[{user}]}}"#)),
        ("a skipped member after the prompt", CHAT, 1, format!(r#"{{"messages":[{user}],"x":{value}}}"#)),
        ("a skipped sampling parameter", CHAT, 2,
         format!(r#"{{"sampling_params":{{"x":{value}}},"messages":[{user}]}}"#)),
        ("a skipped batch prompt", COMPLETIONS, 2, format!(r#"{{"prompt":["a",{value}]}}"#)),
        ("a skipped message member", CHAT, 3,
         format!(r#"{{"messages":[{{"role":"user","content":"a","x":{value}}}]}}"#)),
        ("a skipped member of a text part", CHAT, 5,
         format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"a","x":{value}}}]}}]}}"#)),
        ("an image part", CHAT, 5,
         format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{value}}}]}}]}}"#)),
        ("tools", CHAT, 2, format!(r#"{{"tools":[{value}],"messages":[{user}]}}"#)),
        ("tool calls", CHAT, 4, format!(r#"{{"messages":[{{"role":"assistant","tool_calls":[{value}]}}]}}"#)),
    ];
    placements
        .into_iter()
        .map(|(place, path, enclosing, body)| Placement {
            place,
            path,
            enclosing,
            body,
        })
        .collect()
}

/// Runs `test` on a thread with a 256 KiB stack: a recursion the depth bound failed to stop would overflow it.
fn on_a_small_stack(test: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(test)
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn nesting_100000_deep_is_too_deep_wherever_it_is_and_overflows_no_small_stack() {
    on_a_small_stack(|| {
        for objects in [false, true] {
            for Placement {
                place, path, body, ..
            } in placements(&nested(100_000, objects))
            {
                let error = refused(path, body.as_bytes(), 16 << 20);
                assert_eq!(
                    error.reason().as_str(),
                    "too_deep",
                    "{place}, objects: {objects}: {error}"
                );
                assert_eq!(
                    error.to_string(),
                    "the request body nests arrays and objects more than 64 deep"
                );
            }
        }
        // Where the expected type holds no list or object, the first bracket is already the wrong type.
        let deep = nested(100_000, false);
        for (body, field) in [
            (deep.clone(), "the request body"),
            (format!(r#"{{"messages":{deep}}}"#), "`messages[0]`"),
            (format!(r#"{{"prompt":{deep}}}"#), "`prompt[0][0]`"),
        ] {
            let error = refused("/", body.as_bytes(), 16 << 20);
            assert_eq!(error.reason().as_str(), "wrong_type", "{error}");
            assert!(error.to_string().starts_with(field), "{error}");
        }
    });
}

#[test]
fn the_depth_bound_counts_every_level_from_the_body_root() {
    on_a_small_stack(|| {
        for objects in [false, true] {
            for (
                i,
                Placement {
                    place, enclosing, ..
                },
            ) in placements("1").into_iter().enumerate()
            {
                let most = MAX_DEPTH - enclosing;
                for (depth, accepted) in [(most, true), (most + 1, false)] {
                    let Placement { path, body, .. } =
                        placements(&nested(depth, objects)).remove(i);
                    let result = parse(path, body.as_bytes(), LIMIT);
                    assert_eq!(result.is_ok(), accepted, "{place} at {depth}: {result:?}");
                }
            }
        }
    });
}

fn pools(yaml_models: &[&str]) -> Vec<PoolConfig> {
    let mut yaml = String::from("pools:\n");
    for (i, model) in yaml_models.iter().enumerate() {
        yaml += &format!(
            "  - model: '{model}'\n    engine: vllm\n    workers:\n      - endpoint: 10.0.0.{}:8000\n",
            i + 1
        );
    }
    config::parse(&yaml, "t", &Overrides::default())
        .unwrap()
        .pools
}

/// A pool's index, or the error's kind and status.
type Found = Result<usize, (&'static str, u16)>;

#[test]
fn a_pool_is_chosen_by_exact_model_then_the_default() {
    let with_default = pools(&["a", "*", "b"]);
    let without = pools(&["a", "b"]);
    #[rustfmt::skip]
    let cases: Vec<(&[PoolConfig], Option<&str>, Found)> = vec![
        (&with_default, Some("a"), Ok(0)),
        (&with_default, Some("b"), Ok(2)),
        (&with_default, Some("c"), Ok(1)),
        (&with_default, None, Ok(1)),
        (&with_default, Some(""), Ok(1)),
        (&with_default, Some("*"), Ok(1)),
        (&without, Some("b"), Ok(1)),
        (&without, Some("A"), Err(("unknown_model", 404))),
        (&without, Some("*"), Err(("unknown_model", 404))),
        (&without, None, Err(("missing_model", 400))),
    ];
    for (pools, model, expected) in cases {
        let found = select_pool(pools, model)
            .map(|(index, pool)| {
                assert!(std::ptr::eq(pool, &pools[index]));
                index
            })
            .map_err(|error| (error.reason().as_str(), error.reason().status()));
        assert_eq!(found, expected, "{model:?}");
    }
    let error = select_pool(&without, Some("c")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no pool serves model `c`, and no pool is the default (`*`)"
    );
    let long = "é".repeat(300);
    let error = select_pool(&without, Some(&long)).unwrap_err();
    let BodyError::UnknownModel { model } = &error else {
        panic!("{error:?}")
    };
    assert_eq!(model.chars().count(), BodyError::MODEL_ECHO_CHARS);
}

/// Valid bodies of every API, to mutate.
const SEEDS: [(&str, &str); 5] = [
    (
        CHAT,
        r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a\"b"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],"tools":[{"type":"function"}],"max_completion_tokens":9}"#,
    ),
    (
        COMPLETIONS,
        r#"{"model":"m","prompt":["a",[1]],"max_tokens":4,"cache_salt":"s","logit_bias":{"1":-1}}"#,
    ),
    (COMPLETIONS, r#"{"prompt":[[1,2],[3]],"n":2}"#),
    (
        GENERATE,
        r#"{"text":["t","u"],"sampling_params":{"max_new_tokens":3,"stop":["\n"]}}"#,
    ),
    ("/", r#"{"input_ids":[7,8,9],"rid":"r"}"#),
];

/// What must hold for any input: no panic, a non-empty prompt when accepted, a status that fits the
/// kind, the size checked first, and nothing accepted that serde_json would reject.
fn check(path: &str, body: &[u8], limit: usize) -> Result<(), TestCaseError> {
    match parse(path, body, limit) {
        Ok(request) => {
            prop_assert!(body.len() <= limit);
            let empty = match &request.prompt {
                Prompt::Chat { messages, .. } => messages
                    .iter()
                    .all(|m| m.content.iter().all(|p| p.is_empty())),
                Prompt::Text(text) => text.is_empty(),
                Prompt::Tokens(tokens) => tokens.is_empty(),
            };
            prop_assert!(!empty, "{:?}", request);
            prop_assert!(serde_json::from_slice::<serde_json::Value>(body).is_ok());
        }
        Err(error) => {
            prop_assert_eq!(error.reason().as_str() == "too_large", body.len() > limit);
            let status = match error.reason().as_str() {
                "too_large" => 413,
                "unknown_model" => 404,
                _ => 400,
            };
            prop_assert_eq!(error.reason().status(), status);
        }
    }
    Ok(())
}

const PATHS: [&str; 5] = [CHAT, COMPLETIONS, GENERATE, "/", "/v1/completions?x"];

/// Bytes that make JSON structure, and a few that break UTF-8.
const JSON_BYTES: &[u8] = b"{}[]\",:\\ 0123456789-.eEtrufalsn\xff\xc3\x80";

proptest! {
    #[test]
    fn parse_never_panics_on_arbitrary_bytes(
        path in prop::sample::select(&PATHS[..]),
        body in prop::collection::vec(any::<u8>(), 0..512),
        limit in 0usize..600,
    ) {
        check(path, &body, limit)?;
    }

    #[test]
    fn parse_never_panics_on_mutated_valid_bodies(
        seed in prop::sample::select(&SEEDS[..]),
        path in prop::option::of(prop::sample::select(&PATHS[..])),
        edits in prop::collection::vec(
            (any::<prop::sample::Index>(), 0..3u8, prop::sample::select(JSON_BYTES)),
            1..8,
        ),
    ) {
        let (seed_path, seed) = seed;
        let mut body = seed.as_bytes().to_vec();
        for (at, edit, byte) in edits {
            let i = at.index(body.len() + 1);
            match edit {
                0 => body.insert(i, byte),
                1 if i < body.len() => { body.remove(i); }
                _ if i < body.len() => body[i] = byte,
                _ => body.push(byte),
            }
        }
        check(path.unwrap_or(seed_path), &body, LIMIT)?;
    }
}

#[test]
fn every_seed_body_is_accepted() {
    for (path, body) in SEEDS {
        parsed(path, body);
    }
}

use proptest::prelude::*;
use serde_json::Value;

use super::*;

fn ok(api: Api, body: &str) -> SimRequest {
    parse(api, body.as_bytes()).unwrap_or_else(|error| panic!("{body}: {error}"))
}

fn err(api: Api, body: &str) -> WireError {
    match parse(api, body.as_bytes()) {
        Ok(request) => panic!("{body} parsed: {request:?}"),
        Err(error) => error,
    }
}

#[test]
fn paths_map_to_apis_exactly() {
    assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
    assert_eq!(Api::from_path("/v1/completions?x=1"), Some(Api::Completion));
    assert_eq!(Api::from_path("/generate"), Some(Api::Generate));
    assert_eq!(Api::from_path("/proxy/v1/completions"), None);
    assert_eq!(Api::from_path("/v1/models"), None);
    for api in Api::ALL {
        assert_eq!(Api::from_path(api.path()), Some(api));
    }
}

#[test]
fn chat_reads_messages_tools_and_options() {
    let request = ok(
        Api::Chat,
        r#"{"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}}, {"text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": []}],
           "tools": [{"type": "function", "function": {"name": "f"}}],
           "max_tokens": 5, "max_completion_tokens": 7, "stream": true,
           "stream_options": {"include_usage": true}, "temperature": 0.2}"#,
    );
    assert_eq!(request.api, Api::Chat);
    assert_eq!(request.model.as_deref(), Some("m"));
    assert_eq!(
        (request.max_tokens, request.stream, request.include_usage),
        (Some(7), true, true)
    );
    let Prompt::Chat { messages, tools } = request.prompt else {
        panic!("not chat");
    };
    let contents: Vec<_> = messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        contents,
        [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
    );
    assert_eq!(
        tools.as_deref(),
        Some(r#"[{"type": "function", "function": {"name": "f"}}]"#)
    );
}

#[test]
fn chat_defaults_and_null_members() {
    let request = ok(
        Api::Chat,
        r#"{"messages": [{"role": "user", "content": "hi"}], "tools": null, "model": null,
            "stream": null, "max_tokens": 3}"#,
    );
    assert_eq!(request.model, None);
    assert_eq!(
        (request.max_tokens, request.stream, request.include_usage),
        (Some(3), false, false)
    );
    assert!(matches!(request.prompt, Prompt::Chat { tools: None, .. }));
}

#[test]
fn a_member_given_twice_keeps_its_last_value() {
    let request = ok(
        Api::Completion,
        r#"{"prompt": "a", "max_tokens": 1, "prompt": "b", "max_tokens": 2}"#,
    );
    assert_eq!(request.prompt, Prompt::Text("b".to_owned()));
    assert_eq!(request.max_tokens, Some(2));
}

#[test]
fn completions_read_every_single_prompt_shape() {
    let cases = [
        (r#""hello""#, Prompt::Text("hello".to_owned())),
        (r#""""#, Prompt::Text(String::new())),
        (r#"["hello"]"#, Prompt::Text("hello".to_owned())),
        ("[1, 2, 3]", Prompt::Tokens(vec![1, 2, 3])),
        ("[[4, 5]]", Prompt::Tokens(vec![4, 5])),
    ];
    for (prompt, expected) in cases {
        let request = ok(
            Api::Completion,
            &format!(r#"{{"prompt": {prompt}, "model": "m", "max_tokens": 4}}"#),
        );
        assert_eq!(request.prompt, expected, "{prompt}");
        assert_eq!(request.max_tokens, Some(4));
    }
    let request = ok(
        Api::Completion,
        r#"{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}"#,
    );
    assert!(request.stream && request.include_usage);
}

#[test]
fn generate_reads_text_or_input_ids() {
    let request = ok(
        Api::Generate,
        r#"{"text": "hi", "sampling_params": {"max_new_tokens": 9, "temperature": 0}, "stream": true}"#,
    );
    assert_eq!(request.prompt, Prompt::Text("hi".to_owned()));
    assert_eq!(
        (request.max_tokens, request.stream, request.include_usage),
        (Some(9), true, false)
    );
    let request = ok(Api::Generate, r#"{"input_ids": [7, 8], "text": null}"#);
    assert_eq!(request.prompt, Prompt::Tokens(vec![7, 8]));
    assert_eq!(request.max_tokens, None);
}

#[test]
fn budgets_accept_integral_floats_and_saturate() {
    let request = ok(Api::Completion, r#"{"prompt": "x", "max_tokens": 16.0}"#);
    assert_eq!(request.max_tokens, Some(16));
    let request = ok(
        Api::Completion,
        r#"{"prompt": "x", "max_tokens": 99999999999999}"#,
    );
    assert_eq!(request.max_tokens, Some(u32::MAX));
    let request = ok(Api::Completion, r#"{"prompt": "x", "max_tokens": 1e30}"#);
    assert_eq!(request.max_tokens, Some(u32::MAX));
}

#[test]
fn every_refusal_is_a_400_naming_the_member() {
    let cases: &[(Api, &str, &str)] = &[
        (Api::Chat, "{", "not valid JSON"),
        (Api::Chat, "[]", "JSON object"),
        (Api::Chat, "{} x", "not valid JSON"),
        (Api::Chat, "{}", "`messages` is required"),
        (
            Api::Chat,
            r#"{"messages": []}"#,
            "`messages` must not be empty",
        ),
        (Api::Chat, r#"{"messages": "hi"}"#, "`messages` must be"),
        (Api::Chat, r#"{"messages": [1]}"#, "`messages[0]` must be"),
        (
            Api::Chat,
            r#"{"messages": [{"content": "x"}]}"#,
            "`messages[0].role` is required",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": 1}]}"#,
            "`messages[0].role` must be a string",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u", "content": 5}]}"#,
            "`messages[0].content` must be",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u", "content": [{"type": "text"}]}]}"#,
            "`messages[0].content[0].text` is required",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u", "content": [{"image_url": {}}]}]}"#,
            "`messages[0].content[0].type` is required",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u", "content": ["x"]}]}"#,
            "`messages[0].content[0]` must be a content part object",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "tools": {}}"#,
            "`tools` must be an array",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "model": 3}"#,
            "`model` must be a string",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "stream": "yes"}"#,
            "`stream` must be a boolean",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "max_tokens": 0}"#,
            "`max_tokens` must be at least 1, got 0",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "max_completion_tokens": -2}"#,
            "`max_completion_tokens` must be at least 1, got -2",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "max_tokens": 1.5}"#,
            "`max_tokens` must be an integer",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "max_tokens": "3"}"#,
            "`max_tokens` must be an integer",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "stream_options": {"include_usage": true}}"#,
            "`stream_options` is only allowed when `stream` is true",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "stream": true, "stream_options": 1}"#,
            "`stream_options` must be an object",
        ),
        (
            Api::Chat,
            r#"{"messages": [{"role": "u"}], "stream": true, "stream_options": {"include_usage": 1}}"#,
            "`stream_options.include_usage` must be a boolean",
        ),
        (Api::Completion, "{}", "`prompt` is required"),
        (
            Api::Completion,
            r#"{"prompt": ["a", "b"]}"#,
            "batched prompts are not supported by the simulator: `prompt`",
        ),
        (
            Api::Completion,
            r#"{"prompt": [[1], [2]]}"#,
            "batched prompts are not supported by the simulator: `prompt`",
        ),
        (
            Api::Completion,
            r#"{"prompt": []}"#,
            "`prompt` must not be empty",
        ),
        (
            Api::Completion,
            r#"{"prompt": [[]]}"#,
            "`prompt[0]` must not be empty",
        ),
        (
            Api::Completion,
            r#"{"prompt": [1, -1]}"#,
            "`prompt[1]` must be a token id",
        ),
        (
            Api::Completion,
            r#"{"prompt": [1, 4294967296]}"#,
            "`prompt[1]` must be a token id",
        ),
        (
            Api::Completion,
            r#"{"prompt": [1, "a"]}"#,
            "`prompt[1]` must be a token id",
        ),
        (
            Api::Completion,
            r#"{"prompt": 5}"#,
            "`prompt` must be a string",
        ),
        (
            Api::Completion,
            r#"{"prompt": "x", "max_tokens": 0}"#,
            "`max_tokens` must be at least 1",
        ),
        (
            Api::Generate,
            "{}",
            "one of `text` or `input_ids` is required",
        ),
        (
            Api::Generate,
            r#"{"text": "a", "input_ids": [1]}"#,
            "`text` and `input_ids`",
        ),
        (
            Api::Generate,
            r#"{"text": ["a"]}"#,
            "batched prompts are not supported by the simulator: `text`",
        ),
        (
            Api::Generate,
            r#"{"input_ids": [[1], [2]]}"#,
            "batched prompts are not supported by the simulator: `input_ids`",
        ),
        (
            Api::Generate,
            r#"{"input_ids": []}"#,
            "`input_ids` must not be empty",
        ),
        (
            Api::Generate,
            r#"{"input_ids": "a"}"#,
            "`input_ids` must be an array of token ids",
        ),
        (Api::Generate, r#"{"text": 1}"#, "`text` must be a string"),
        (
            Api::Generate,
            r#"{"text": "a", "sampling_params": []}"#,
            "`sampling_params` must be an object",
        ),
        (
            Api::Generate,
            r#"{"text": "a", "sampling_params": {"max_new_tokens": 0}}"#,
            "`sampling_params.max_new_tokens` must be at least 1, got 0",
        ),
    ];
    for (api, body, message) in cases {
        let error = err(*api, body);
        assert_eq!(error.status(), 400);
        let text = error.to_string();
        assert!(text.contains(message), "{body}: {text:?} lacks {message:?}");
    }
}

#[test]
fn deep_nesting_is_refused_in_tools_and_harmless_elsewhere() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let body = format!(r#"{{"messages": [{{"role": "u"}}], "tools": {deep}}}"#);
    assert_eq!(err(Api::Chat, &body), WireError::TooDeep { field: "tools" });
    let body = format!(r#"{{"messages": [{{"role": "u"}}], "extra": {deep}}}"#);
    assert!(parse(Api::Chat, body.as_bytes()).is_ok());
    let body = format!(
        r#"{{"messages": [{{"role": "u", "content": [{{"type": "image_url", "image_url": {deep}}}]}}]}}"#
    );
    assert!(parse(Api::Chat, body.as_bytes()).is_ok());
    let nested_tools = format!(
        r#"[{{"a": "[[[[", "b": {}{}}}]"#,
        "[".repeat(10),
        "]".repeat(10)
    );
    let body = format!(r#"{{"messages": [{{"role": "u"}}], "tools": {nested_tools}}}"#);
    assert!(parse(Api::Chat, body.as_bytes()).is_ok());
}

fn outcome<'a>(text: &'a str, completion_tokens: u32) -> Outcome<'a> {
    Outcome {
        id: "req-1",
        model: "sim \"model\"",
        created: 1_700_000_000,
        text,
        prompt_tokens: 12,
        completion_tokens,
        cached_tokens: 8,
        finish_reason: "length",
        vllm: true,
    }
}

fn parse_json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn non_streaming_bodies_carry_the_openai_and_sglang_fields() {
    let done = outcome(" the end\n\"quoted\"", 3);
    let chat = parse_json(&response_body(Api::Chat, &done));
    assert_eq!(chat["id"], "req-1");
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["created"], 1_700_000_000);
    assert_eq!(chat["model"], "sim \"model\"");
    assert_eq!(chat["choices"][0]["index"], 0);
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["message"]["content"], done.text);
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    assert!(chat["choices"][0]["logprobs"].is_null());
    assert_eq!(chat["usage"]["prompt_tokens"], 12);
    assert_eq!(chat["usage"]["completion_tokens"], 3);
    assert_eq!(chat["usage"]["total_tokens"], 15);
    assert_eq!(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

    let text = parse_json(&response_body(Api::Completion, &done));
    assert_eq!(text["object"], "text_completion");
    assert_eq!(text["choices"][0]["text"], done.text);
    assert_eq!(text["choices"][0]["finish_reason"], "length");
    assert_eq!(text["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

    let generated = parse_json(&response_body(Api::Generate, &done));
    assert_eq!(generated["text"], done.text);
    let meta = &generated["meta_info"];
    assert_eq!(meta["id"], "req-1");
    assert_eq!(meta["finish_reason"]["type"], "length");
    assert_eq!(meta["finish_reason"]["length"], 3);
    assert_eq!(
        (
            &meta["prompt_tokens"],
            &meta["completion_tokens"],
            &meta["cached_tokens"]
        ),
        (&Value::from(12), &Value::from(3), &Value::from(8))
    );
}

/// The JSON payloads of an SSE stream, asserting its framing: `data: <json>\n\n` events, ending
/// with `data: [DONE]\n\n`.
fn events(stream: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(stream).unwrap();
    let body = text
        .strip_suffix("data: [DONE]\n\n")
        .expect("ends with [DONE]");
    assert!(body.ends_with("\n\n"));
    body.split_terminator("\n\n")
        .map(|event| {
            let json = event.strip_prefix("data: ").expect("data: prefix");
            assert!(!json.contains('\n'), "one line per event");
            serde_json::from_str(json).unwrap()
        })
        .collect()
}

/// A whole stream for `words`, as a server would write it.
fn stream(api: Api, words: &[&str], include_usage: bool) -> (String, Vec<u8>) {
    let mut text = String::new();
    let mut out = Vec::new();
    for (index, word) in words.iter().enumerate() {
        text.push_str(word);
        let so_far = outcome(&text, index as u32 + 1);
        out.extend_from_slice(&stream_chunk(api, &so_far, word, index == 0));
    }
    let done = outcome(&text, words.len() as u32);
    out.extend_from_slice(&stream_end(api, &done, include_usage));
    (text, out)
}

#[test]
fn chat_streams_deltas_then_finish_then_usage() {
    let words = [" a", " \"b\"", "\n c"];
    let (text, out) = stream(Api::Chat, &words, true);
    let events = events(&out);
    assert_eq!(events.len(), words.len() + 2);
    assert!(
        events
            .iter()
            .all(|e| e["object"] == "chat.completion.chunk")
    );
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(events[1]["choices"][0]["delta"].get("role").is_none());
    let deltas: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(deltas, text);
    let finish = &events[words.len()];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(
        events[..words.len()]
            .iter()
            .all(|e| e["choices"][0]["finish_reason"].is_null())
    );
    let usage = &events[words.len() + 1];
    assert_eq!(usage["choices"], Value::Array(vec![]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    assert!(
        events[..=words.len()]
            .iter()
            .all(|e| e.get("usage").is_none())
    );

    let (_, out) = stream(Api::Chat, &words, false);
    assert_eq!(events_len(&out), words.len() + 1);
}

fn events_len(out: &[u8]) -> usize {
    events(out).len()
}

#[test]
fn completions_stream_text_deltas() {
    let words = [" x", " y"];
    let (text, out) = stream(Api::Completion, &words, true);
    let events = events(&out);
    assert_eq!(events.len(), 4);
    assert!(events.iter().all(|e| e["object"] == "text_completion"));
    let deltas: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(deltas, text);
    assert_eq!(events[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[3]["usage"]["total_tokens"], 14);
}

#[test]
fn generate_streams_cumulative_text_and_finishes_in_meta_info() {
    let words = [" p", " q", " r"];
    let (text, out) = stream(Api::Generate, &words, true);
    let events = events(&out);
    assert_eq!(events.len(), 4, "no usage chunk for /generate");
    let mut previous = String::new();
    for event in &events {
        let so_far = event["text"].as_str().unwrap();
        assert!(so_far.starts_with(&previous));
        previous = so_far.to_owned();
    }
    assert_eq!(previous, text);
    assert!(
        events[..3]
            .iter()
            .all(|e| e["meta_info"]["finish_reason"].is_null())
    );
    assert_eq!(events[1]["meta_info"]["completion_tokens"], 2);
    assert_eq!(events[3]["meta_info"]["finish_reason"]["type"], "length");
}

#[test]
fn errors_are_vllm_shaped() {
    for (status, kind) in [
        (400, "BadRequestError"),
        (404, "NotFoundError"),
        (500, "InternalServerError"),
        (503, "ServiceUnavailableError"),
    ] {
        let body = parse_json(&error_body(status, "bad \"thing\""));
        assert_eq!(body["object"], "error");
        assert_eq!(body["message"], "bad \"thing\"");
        assert_eq!(body["type"], kind);
        assert!(body["param"].is_null());
        assert_eq!(body["code"], status);
    }
}

#[test]
fn output_tokens_are_deterministic_words() {
    let text: String = (0..32).map(|i| output_token(42, i)).collect();
    let again: String = (0..32).map(|i| output_token(42, i)).collect();
    let other: String = (0..32).map(|i| output_token(43, i)).collect();
    assert_eq!(text, again);
    assert_ne!(text, other);
    assert!((0..32).all(|i| output_token(42, i).starts_with(' ')));
    let distinct: std::collections::HashSet<_> = (0..256).map(|i| output_token(7, i)).collect();
    assert!(distinct.len() > 32, "indices spread over the word list");
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
        for api in Api::ALL {
            if let Err(error) = parse(api, &body) {
                prop_assert_eq!(error.status(), 400);
            }
        }
    }

    #[test]
    fn json_shaped_bodies_never_panic(
        key in prop::sample::select(vec!["messages", "prompt", "text", "input_ids", "tools",
            "max_tokens", "stream", "stream_options", "sampling_params", "model"]),
        value in r#"(\[|\{|"|-?[0-9]{1,12}(\.[0-9])?|null|true|,|\]|\}|:|"role"|"content"|"type"|"text"|"max_new_tokens"){0,12}"#,
    ) {
        let body = format!(r#"{{"{key}": {value}}}"#);
        for api in Api::ALL {
            let _ = parse(api, body.as_bytes());
        }
    }
}

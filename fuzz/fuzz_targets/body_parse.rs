//! Fuzzes the request body parser, `request::parse`, with any bytes under each kind of path, mostly with
//! no size limit and sometimes with a small one, and checks what must hold for any input: no panic; the
//! size is judged first; the status fits the error's kind; an accepted request speaks the API its path
//! names and has a non-empty prompt.
#![no_main]

use libfuzzer_sys::fuzz_target;

use cachepick::request::{Api, Prompt, parse};

/// Each API's path, with a query string and with a gateway prefix, and paths naming none.
const PATHS: [(&str, Option<Api>); 6] = [
    ("/v1/chat/completions", Some(Api::ChatCompletions)),
    ("/v1/completions?stream=true", Some(Api::Completions)),
    ("/generate", Some(Api::Generate)),
    ("/openai/v1/chat/completions", Some(Api::ChatCompletions)),
    ("/", None),
    ("/v1/embeddings", None),
];

fuzz_target!(|input: (u8, u16, &[u8])| {
    let (selector, limit, body) = input;
    let (path, named) = PATHS[usize::from(selector & 0x7f) % PATHS.len()];
    let limit = if selector & 0x80 == 0 {
        usize::MAX
    } else {
        usize::from(limit)
    };
    match parse(path, body, limit) {
        Ok(request) => {
            assert!(body.len() <= limit);
            if let Some(api) = named {
                assert_eq!(request.api, api);
            }
            let empty = match &request.prompt {
                Prompt::Chat { messages, tools } => {
                    assert!(tools.is_none_or(|tools| tools.get().starts_with('[')));
                    messages
                        .iter()
                        .all(|message| message.content.iter().all(|part| part.is_empty()))
                }
                Prompt::Text(text) => text.is_empty(),
                Prompt::Tokens(tokens) => tokens.is_empty(),
            };
            assert!(!empty, "{request:?}");
        }
        Err(error) => {
            let reason = error.reason();
            assert_eq!(reason.as_str() == "too_large", body.len() > limit, "{error}");
            let status = match reason.as_str() {
                "too_large" => 413,
                "unknown_model" => 404,
                _ => 400,
            };
            assert_eq!(reason.status(), status, "{error}");
            assert!(!error.to_string().is_empty());
        }
    }
});

//! The two legs' bodies: the prefill leg re-written as vLLM's proxies write it, and the decode leg
//! spliced, so a multi-megabyte prompt is copied once and never re-serialised for the decode worker.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// The APIs whose requests split into two legs.
const SPLIT: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// The prefill leg's body: the client's, with `kv_transfer_params: {do_remote_decode: true}`, one
/// output token (`max_tokens`, and `max_completion_tokens` when given), one choice, no stream and no
/// minimum output. `None` when `path` is not a chat or completion, or the body is not a JSON object.
pub fn prefill_body(path: &str, body: &[u8]) -> Option<Vec<u8>> {
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    if !SPLIT.contains(&path) {
        return None;
    }
    let mut object: Map<String, Value> = serde_json::from_slice(body).ok()?;
    object.insert(
        "kv_transfer_params".to_owned(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    object.insert("max_tokens".to_owned(), json!(1));
    if object.contains_key("max_completion_tokens") {
        object.insert("max_completion_tokens".to_owned(), json!(1));
    }
    if object.contains_key("n") {
        object.insert("n".to_owned(), json!(1));
    }
    object.insert("stream".to_owned(), json!(false));
    for key in ["stream_options", "min_tokens", "min_completion_tokens"] {
        object.remove(key);
    }
    serde_json::to_vec(&object).ok()
}

/// The decode leg's body: the client's bytes with `"kv_transfer_params": <params>` added as its last
/// member. Engines keep the last of a repeated member (Python's JSON parser), so parameters a client
/// sent are overridden: a client never names the worker the KV comes from. `None` when the body does
/// not end as a JSON object.
pub fn decode_body(body: &[u8], params: &RawValue) -> Option<Vec<u8>> {
    append_members(body, &format!("\"kv_transfer_params\":{}", params.get()))
}

/// `body` with `members` (`"key":value,...`) added after its last member. `None` when the body does
/// not end as a JSON object.
pub(super) fn append_members(body: &[u8], members: &str) -> Option<Vec<u8>> {
    let close = body.iter().rposition(|byte| !byte.is_ascii_whitespace())?;
    if body.get(close) != Some(&b'}') {
        return None;
    }
    let before = body
        .get(..close)?
        .iter()
        .rposition(|byte| !byte.is_ascii_whitespace())?;
    let empty = body.get(before) == Some(&b'{');
    let mut out = Vec::with_capacity(body.len() + members.len() + 2);
    out.extend_from_slice(body.get(..close)?);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(members.as_bytes());
    out.push(b'}');
    Some(out)
}

/// The `kv_transfer_params` object of a prefill worker's answer, raw; `None` when it has none (or
/// `null`).
pub(super) fn params_of(answer: &[u8]) -> Result<Option<Box<RawValue>>, serde_json::Error> {
    #[derive(Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        kv_transfer_params: Option<&'a RawValue>,
    }
    let answer: Answer<'_> = serde_json::from_slice(answer)?;
    Ok(answer
        .kv_transfer_params
        .filter(|raw| raw.get().trim_start().starts_with('{'))
        .map(|raw| raw.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_for_one_unstreamed_token_and_the_remote_decode() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
            "stream_options":{"include_usage":true},"max_completion_tokens":50,"min_tokens":4,"n":3,
            "kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9"}}"#;
        let tagged: Value =
            serde_json::from_slice(&prefill_body("/v1/chat/completions", body).unwrap()).unwrap();
        assert_eq!(tagged["max_tokens"], 1);
        assert_eq!(tagged["max_completion_tokens"], 1);
        assert_eq!(tagged["n"], 1);
        assert_eq!(tagged["stream"], false);
        assert!(tagged.get("stream_options").is_none());
        assert!(tagged.get("min_tokens").is_none());
        // The client's parameters are replaced whole.
        assert_eq!(tagged["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(tagged["kv_transfer_params"]["remote_host"], Value::Null);
        assert_eq!(tagged["messages"][0]["content"], "hi");
    }

    #[test]
    fn only_chats_and_completions_that_are_objects_split() {
        assert!(prefill_body("/v1/completions?x=1", br#"{"prompt":"a"}"#).is_some());
        assert!(prefill_body("/v1/embeddings", br#"{"input":"a"}"#).is_none());
        assert!(prefill_body("/v1/completions", b"[1,2]").is_none());
        assert!(prefill_body("/v1/completions", b"{\"prompt\":").is_none());
    }

    #[test]
    fn the_decode_leg_is_the_clients_bytes_with_the_params_last() {
        let params = raw(r#"{"do_remote_prefill":true,"remote_port":8001}"#);
        let body = b"{\"prompt\": \"a  b\", \"kv_transfer_params\": {\"remote_port\": 1}}\n  ";
        let spliced = decode_body(body, &params).unwrap();
        assert!(
            spliced.starts_with(
                b"{\"prompt\": \"a  b\", \"kv_transfer_params\": {\"remote_port\": 1}"
            )
        );
        // The last member wins, as the engines read a repeated one.
        let text = String::from_utf8(spliced).unwrap();
        assert!(
            text.ends_with(
                r#","kv_transfer_params":{"do_remote_prefill":true,"remote_port":8001}}"#
            ),
            "{text}"
        );
        // An empty object gets the member alone, no comma.
        assert_eq!(
            decode_body(b" { } ", &params).unwrap(),
            format!(" {{ \"kv_transfer_params\":{}}}", params.get()).into_bytes()
        );
        assert!(decode_body(b"[1]", &params).is_none());
        assert!(decode_body(b"", &params).is_none());
        assert!(decode_body(b"}", &params).is_none());
    }

    #[test]
    fn the_params_are_read_raw_from_the_prefill_answer() {
        let answer = br#"{"id":"c","choices":[],"kv_transfer_params":{"remote_block_ids":[1,2],"remote_port":5600}}"#;
        let params = params_of(answer).unwrap().unwrap();
        assert_eq!(
            params.get(),
            r#"{"remote_block_ids":[1,2],"remote_port":5600}"#
        );
        assert!(params_of(br#"{"id":"c"}"#).unwrap().is_none());
        assert!(
            params_of(br#"{"kv_transfer_params":null}"#)
                .unwrap()
                .is_none()
        );
        assert!(params_of(b"not json").is_err());
    }
}

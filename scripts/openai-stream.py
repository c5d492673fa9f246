"""Streams one chat completion with the official `openai` client and prints each chunk as it arrives.

Usage: openai-stream.py BASE_URL MODEL MAX_TOKENS PROMPT

Every chunk is one JSON line on stdout, written the moment the client hands it over:
  {"t": <time.monotonic()>, "content": "...", "finish_reason": null|"...", "usage": null|{...}}
and a last line {"end": true, "t": ...} once the stream is over (the client consumes `data: [DONE]`
itself and ends the iteration there). tests/streaming_clients.rs runs it through Envoy and cachepick
and asserts the chunks are spread like the worker's inter-token latency, not delivered in one burst.

It runs on the interpreter `scripts/provision-python` installs (the pinned `openai`).
"""

import json
import sys
import time

import openai


def main() -> int:
    base_url, model, max_tokens, prompt = sys.argv[1:5]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20.0)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(max_tokens),
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        now = time.monotonic()
        choice = chunk.choices[0] if chunk.choices else None
        line = {
            "t": now,
            "content": (choice.delta.content or "") if choice else "",
            "finish_reason": choice.finish_reason if choice else None,
            "usage": chunk.usage.model_dump() if chunk.usage else None,
        }
        print(json.dumps(line), flush=True)
    print(json.dumps({"end": True, "t": time.monotonic()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

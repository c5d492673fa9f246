#!/usr/bin/env python3
"""A KV-event publisher that speaks exactly as vLLM and SGLang do: their msgspec struct shapes,
encoded by `msgspec.msgpack.Encoder`, sent over libzmq (pyzmq) as `[topic, seq, payload]`, with a
ROUTER replay socket that answers `[b"", start_seq]` like their `ZmqEventPublisher._service_replay`.

The structs below are re-declared from the engines' sources (vLLM `vllm/distributed/kv_events.py`,
SGLang `python/sglang/srt/disaggregation/kv_events.py`); only their shapes matter, so each format is
one set of definitions:

  vllm_array  vLLM <= 0.23: `array_like=True, omit_defaults=True, gc=False, tag=True` events in an
              array_like EventBatch `[ts, events, data_parallel_rank]`.
  vllm_map    vLLM >= 0.24: the same fields as `type`-tagged maps with defaults omitted, in a map
              EventBatch `{"ts", "events", "data_parallel_rank"}`.
  sglang      SGLang: array_like events without omit_defaults (a nil medium is sent), the batch
              `[ts, events, attn_dp_rank]`, and `BlockStoredWithMetadata` (a trailing
              `{"cache_salt": s}`) for salted stores.

Usage:
  kv-events-fixture.py --format vllm_array|vllm_map|sglang --pub tcp://127.0.0.1:P
      [--replay tcp://127.0.0.1:R] [--replay-framing topic|legacy] [--hash-form int|bytes]
      [--topic T] [--subscribers N] [--timeout S] [--script FILE]  < script.json

The script (FILE, or stdin when no --script) is a JSON list of batches:
  [{"ts": 1.5, "rank": 0, "events": [EVENT, ...]}, ...]
with each EVENT one of
  {"type": "BlockStored", "block_hashes": [int], "parent_block_hash": int|null,
   "token_ids": [int | [int, int]], "block_size": int, "lora_id": int|null, "medium": str|null,
   "lora_name": str|null, "extra_keys": [[KEY, ...] | null] | null, "group_idx": int|null,
   "kv_cache_spec_kind": str|null, "kv_cache_spec_sliding_window": int|null,
   "cache_salt": str|null}
  {"type": "BlockRemoved", "block_hashes": [int], "medium": str|null, "group_idx": int|null}
  {"type": "AllBlocksCleared"}
  {"type": "<any other tag>", "fields": [...]}   an event no engine sends (array: [tag, *fields];
                                                 map: {"type": tag, "field0": ...})
Omitted keys take the engine's default (null). A KEY is a JSON string or int, a list (sent as a
tuple: vLLM's (mm_identifier, offset)), or {"hex": "..."} for bytes (a prompt-embeds digest). Fields
a format does not have are dropped: SGLang has no lora_name/extra_keys/group fields; vLLM sends no
cache_salt field (its salt rides in extra_keys).

Hashes: with --hash-form int (default) each hash is sent as the JSON int (vLLM: 0 <= h < 2^64, sent
as msgpack uint64 when >= 2^63; SGLang: a signed i64). With --hash-form bytes (vLLM's
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) each hash h is sent as a 32-byte digest whose last 8 bytes are
h big-endian, so a decoder taking the last 8 bytes reads h back.

Publishing: binds the PUB endpoint (an XPUB when --subscribers > 0, which is a PUB on the wire that
also reports subscriptions) and prints `ready` on stdout. With --subscribers N (default 1) it waits
for N subscriptions before publishing, so no batch is lost to the PUB/SUB slow-joiner race; with 0 it
publishes at once, as an engine does. Batch i is published with seq i, then it prints `published N`
and serves replay requests until killed or --timeout seconds (default 60) pass.

Replay: a request `[b"", start_seq (8 bytes big-endian)]` is answered, for every buffered batch with
seq >= start_seq, by `[b"", topic, seq, payload]` (--replay-framing topic, vLLM >= 0.26) or
`[b"", seq, payload]` (legacy: vLLM < 0.26 and SGLang), then the end marker: seq -1 (8 bytes,
signed) with an empty payload, framed the same way.

Exit status: 0 on timeout or SIGTERM, 2 on a bad script or arguments, 3 when the subscribers did not
come within --timeout.
"""

import argparse
import hashlib
import json
import signal
import sys
import time
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- vLLM: one field list, two encodings --------------------------------------------------------


def vllm_types(array_like: bool):
    """vLLM's structs; `array_like` is the <= 0.23 encoding, maps are >= 0.24."""

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Union[int, bytes]]
        parent_block_hash: Union[int, bytes, None]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list[Optional[tuple]]] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Union[int, bytes]]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    def batch(ts, events, rank):
        return EventBatch(ts=ts, events=events, data_parallel_rank=rank)

    def stored(e, hashes, parent):
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=e.get("token_ids", []),
            block_size=e.get("block_size", 0),
            lora_id=e.get("lora_id"),
            medium=e.get("medium"),
            lora_name=e.get("lora_name"),
            extra_keys=extra_keys(e.get("extra_keys")),
            group_idx=e.get("group_idx"),
            kv_cache_spec_kind=e.get("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=e.get("kv_cache_spec_sliding_window"),
        )

    def removed(e, hashes):
        return BlockRemoved(
            block_hashes=hashes, medium=e.get("medium"), group_idx=e.get("group_idx")
        )

    return batch, stored, removed, AllBlocksCleared


# --- SGLang ---------------------------------------------------------------------------------------


class SgEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SgKVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SgBlockStored(SgKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    # SGLang declares list[int]; EAGLE bigram pages carry (token, next_token) tuples in it.
    token_ids: list[Any]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SgBlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SgBlockStoredWithMetadata(SgBlockStored, tag="BlockStored", kw_only=True):
    metadata: SgBlockStoredMetadata


class SgBlockRemoved(SgKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SgAllBlocksCleared(SgKVCacheEvent, tag="AllBlocksCleared"):
    pass


def sglang_types():
    def batch(ts, events, rank):
        return SgEventBatch(ts=ts, events=events, attn_dp_rank=rank)

    def stored(e, hashes, parent):
        fields = dict(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[tuple(t) if isinstance(t, list) else t for t in e.get("token_ids", [])],
            block_size=e.get("block_size", 0),
            lora_id=e.get("lora_id"),
            medium=e.get("medium"),
        )
        salt = e.get("cache_salt")
        if salt is None:
            return SgBlockStored(**fields)
        return SgBlockStoredWithMetadata(
            **fields, metadata=SgBlockStoredMetadata(cache_salt=salt)
        )

    def removed(e, hashes):
        return SgBlockRemoved(block_hashes=hashes, medium=e.get("medium"))

    return batch, stored, removed, SgAllBlocksCleared


# --- the script ------------------------------------------------------------------------------------


def extra_key(key):
    if isinstance(key, dict) and set(key) == {"hex"}:
        return bytes.fromhex(key["hex"])
    if isinstance(key, list):
        return tuple(extra_key(k) for k in key)
    return key


def extra_keys(keys):
    if keys is None:
        return None
    return [None if block is None else tuple(extra_key(k) for k in block) for block in keys]


def wire_hash(h, form):
    if h is None:
        return None
    if form == "bytes":
        return hashlib.sha256(str(h).encode()).digest()[:24] + int(h).to_bytes(8, "big")
    return int(h)


def build_batches(script, fmt, hash_form):
    if fmt == "sglang":
        if hash_form != "int":
            raise ValueError("SGLang sends int hashes only")
        batch, stored, removed, cleared = sglang_types()
    else:
        batch, stored, removed, cleared = vllm_types(array_like=fmt == "vllm_array")
    out = []
    for b in script:
        events = []
        for e in b["events"]:
            kind = e["type"]
            hashes = [wire_hash(h, hash_form) for h in e.get("block_hashes", [])]
            if kind == "BlockStored":
                events.append(stored(e, hashes, wire_hash(e.get("parent_block_hash"), hash_form)))
            elif kind == "BlockRemoved":
                events.append(removed(e, hashes))
            elif kind == "AllBlocksCleared":
                events.append(cleared())
            elif fmt == "vllm_map":
                fields = {f"field{i}": v for i, v in enumerate(e.get("fields", []))}
                events.append({"type": kind, **fields})
            else:
                events.append([kind, *e.get("fields", [])])
        out.append(batch(float(b["ts"]), events, b.get("rank")))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=["vllm_array", "vllm_map", "sglang"])
    p.add_argument("--hash-form", default="int", choices=["int", "bytes"])
    p.add_argument("--pub", required=True, help="PUB endpoint to bind, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", help="ROUTER endpoint to bind for replay requests")
    p.add_argument("--replay-framing", default="topic", choices=["topic", "legacy"])
    p.add_argument("--topic", default="")
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--script", help="JSON script file (default: stdin)")
    args = p.parse_args()

    try:
        text = open(args.script).read() if args.script else sys.stdin.read()
        batches = build_batches(json.loads(text), args.format, args.hash_form)
    except (ValueError, KeyError, TypeError, OSError) as e:
        print(f"kv-events-fixture: bad script: {e}", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    encoder = msgspec.msgpack.Encoder()
    topic = args.topic.encode()
    deadline = time.monotonic() + args.timeout

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB if args.subscribers > 0 else zmq.PUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.set_hwm(100_000)
    if args.subscribers > 0:
        # Every subscription reaches us, even a second subscriber's to the same topic.
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.bind(args.pub)
    replay = None
    if args.replay:
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 1000)
        replay.bind(args.replay)
    print("ready", flush=True)

    joined = 0
    while joined < args.subscribers:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not pub.poll(left_ms):
            print(f"kv-events-fixture: {joined} of {args.subscribers} subscribers came", file=sys.stderr)
            return 3
        if pub.recv()[:1] == b"\x01":
            joined += 1

    buffer = []
    for seq, batch in enumerate(batches):
        payload = encoder.encode(batch)
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        buffer.append((seq, payload))
    print(f"published {len(buffer)}", flush=True)

    while replay is not None:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            break
        if not replay.poll(min(left_ms, 200)):
            continue
        frames = replay.recv_multipart()
        if len(frames) != 3:
            print(f"kv-events-fixture: invalid replay request: {frames!r}", file=sys.stderr)
            continue
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        head = [client, b""] + ([topic] if args.replay_framing == "topic" else [])
        sent = 0
        for seq, payload in buffer:
            if seq >= start_seq:
                replay.send_multipart(head + [seq.to_bytes(8, "big"), payload])
                sent += 1
        replay.send_multipart(head + [END_SEQ, b""])
        print(f"kv-events-fixture: replayed {sent} from seq {start_seq}", file=sys.stderr)
    if replay is None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)
    return 0


if __name__ == "__main__":
    sys.exit(main())

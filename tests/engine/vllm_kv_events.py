"""Decode KV event batches with vLLM 0.33's own structs: ``python vllm_kv_events.py SPEC.json`` under
``PYTHONPATH=.anchors`` (vLLM 0.33.0 installed there with ``--no-deps``, ``make setup``).

SPEC.json: ``{"payloads": [hex, ...], "publish": {"endpoint", "replay_endpoint", "topic"} | null}``. Prints one JSON
line: for each payload, the batch as ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` decodes it
(``ts``, ``data_parallel_rank``, each event's fields with its class under ``type``) and whether vLLM's encoder gives
back the same bytes, or ``{"error": ...}``. With ``publish``, it then hands every decoded batch, in order, to vLLM's
own ``ZmqEventPublisher`` bound there, prints ``{"published": n}`` and keeps it open until stdin closes.

The module is vLLM's, imported whole, but for one of its imports: ``vllm.v1.core.kv_cache_utils`` pulls in vLLM's
v1 engine (xgrammar, which the anchors lack) for a single name, ``ExternalBlockHash``. A stand-in module carries that
name, evaluated from its own line of vLLM's source, so it cannot drift from vLLM's. A process of its own: importing
vLLM makes ``vllm`` importable, which changes what TRL's client imports in the test process.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import sys
import types
from pathlib import Path
from typing import Any

import msgspec


def _stand_in_kv_cache_utils() -> None:
    import vllm  # noqa: PLC0415 - under PYTHONPATH=.anchors only

    source = (Path(vllm.__file__).parent / "v1" / "core" / "kv_cache_utils.py").read_text()
    line = next(node for node in ast.parse(source).body
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash")
    module = types.ModuleType("vllm.v1.core.kv_cache_utils")
    module.ExternalBlockHash = eval(compile(ast.Expression(line.value), "kv_cache_utils.py", "eval"))  # noqa: S307
    sys.modules[module.__name__] = module


def _as_json(batch: Any) -> dict[str, Any]:
    events = [{"type": type(event).__name__, **msgspec.to_builtins(event)} for event in batch.events]
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    _stand_in_kv_cache_utils()
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: PLC0415

    decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
    batches, answers = [], []
    for payload in map(bytes.fromhex, spec["payloads"]):
        try:
            batch = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            answers.append({"error": str(exc)})
            continue
        batches.append(batch)
        answers.append(_as_json(batch) | {"same_bytes": encoder.encode(batch) == payload})
    print(json.dumps({"batches": answers, "vllm": importlib.metadata.version("vllm")}), flush=True)
    if spec.get("publish"):
        where = spec["publish"]
        publisher = ZmqEventPublisher(0, endpoint=where["endpoint"], replay_endpoint=where["replay_endpoint"],
                                      topic=where["topic"])
        for batch in batches:
            publisher.publish(batch)
        print(json.dumps({"published": len(batches)}), flush=True)
        sys.stdin.read()
        publisher.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

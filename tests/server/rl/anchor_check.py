"""Validate bodies against vLLM's own pydantic models: ``python anchor_check.py BODIES.json`` under
``PYTHONPATH=.anchors`` (vLLM 0.33.0 installed there with ``--no-deps`` and the six small packages its protocol
modules import, ``make setup``).

BODIES.json: ``[{"model": "module:Class", "body": {...}, "what": "..."}]``; prints one JSON line: the failures
(``what`` and pydantic's errors), how many were checked, and vLLM's version. A process of its own: importing vLLM makes ``vllm``
importable, which changes what TRL's client imports in the test process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys

from pydantic import TypeAdapter


def main(path: str) -> None:
    cases = json.loads(open(path).read())
    failures, models = [], {}
    for case in cases:
        name = case["model"]
        if name not in models:  # a model class, or a type alias (vLLM 0.33's GenerateResponse is a union)
            module, cls = name.split(":")
            models[name] = TypeAdapter(getattr(importlib.import_module(module), cls))
        try:
            models[name].validate_python(case["body"])
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported whole
            failures.append({"what": case["what"], "model": name, "error": str(exc)[:2000]})
    print(json.dumps({"failures": failures, "checked": len(cases), "vllm": importlib.metadata.version("vllm")}))


if __name__ == "__main__":
    main(sys.argv[1])

"""vLLM's options whose value is a JSON object (``--kv-transfer-config``, ``--kv-events-config``), read one way: text
is decoded, and anything but an object is refused naming the option.

Here, beneath every wing, because the fleet's command lines and the KV event stream's settings both read such
options, each in its own layer. Standard library only.
"""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, option: str) -> dict[str, Any]:
    """``value`` (JSON text, or what it decoded to: a dict that crossed processes) as a dict; ``ValueError`` naming
    ``option`` when it is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{option} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {value!r}")
    return value

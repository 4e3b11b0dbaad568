"""Server-sent events of a streamed answer, written without building a pydantic model per chunk.

A stream sends a chunk per choice for every group of tokens; building and validating the chunk's
pydantic models (chunk, choice, delta, log-prob entries) for each one was the largest per-token
cost of the HTTP server. The chunks' shapes are fixed (they are those of the chunk models in
:mod:`.models`, which document them in the OpenAPI schema), so the part every chunk of an answer
shares (``id``, ``object``, ``created``, ``model``) is encoded once, and each chunk encodes only its
choices, plain data, with msgspec.

Event data escapes U+2028, U+2029 and U+0085. JSON allows them unescaped, but readers that split
lines on every Unicode line break (Python's ``str.splitlines``) cut an event there: a benchmark
client crashed on ``Unterminated string`` where a random model emitted U+2028.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
from pydantic import BaseModel

_JSON = msgspec.json.Encoder()
#: UTF-8 of the line breaks JSON leaves raw, and their escapes (each sequence encodes only that character).
_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def _escape_breaks(data: bytes) -> bytes:
    """JSON ``data`` with the line breaks it leaves raw escaped (ASCII, most pieces, has none: one scan)."""
    if data.isascii():
        return data
    for raw, escaped in _BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def event(data: bytes) -> bytes:
    """One event whose data is the JSON ``data`` (a single line: no raw line breaks of any kind)."""
    return b"data: " + _escape_breaks(data) + b"\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """An event of a whole model or map (error bodies, usage-only chunks): not per token."""
    return event(payload.model_dump_json().encode() if isinstance(payload, BaseModel) else _JSON.encode(payload))


#: A string no text is: where a :class:`TextSlot`'s text goes in the chunk made to cut it.
SLOT = "\x00megatron-serve text slot\x00"


class TextSlot:
    """The event of a chunk that differs from its stream's others in one string alone (a plain text piece of a
    choice): the bytes around the string are made once, by :meth:`ChunkWriter.chunk` itself, and each event is
    those bytes around the string's JSON. The events are those ``chunk`` makes, byte for byte (the bytes around
    the string are cut from its output; a string's JSON escapes alike wherever it stands, and the line breaks
    escaped in event data are whole characters, never cut by the ASCII quotes at the cut).

    Per streamed piece of a plain answer this saves the choice's dict and list, their encoding, the scan of the
    whole chunk for line breaks and the choice's bookkeeping (which serves listings, token ids and running usage):
    what it saves per token is in docs/benchmarks.md (the serving section's eighth round).
    """

    __slots__ = ("_before", "_after")

    def __init__(self, before: bytes, after: bytes) -> None:
        self._before = before
        self._after = after

    def event(self, text: str) -> bytes:
        return self._before + _escape_breaks(_JSON.encode(text)) + self._after


class ChunkWriter:
    """The chunks of one streamed answer: ``{"id", "object", "created", "model", "choices", "usage",
    "system_fingerprint"}``, the first four encoded once. ``running_usage``: the usage every chunk carries
    (``stream_options.continuous_usage_stats``), or None when chunks carry none."""

    def __init__(self, answer_id: str, kind: str, created: int, model: str,
                 running_usage: Callable[[], BaseModel | None] | None = None) -> None:
        head = _JSON.encode({"id": answer_id, "object": kind, "created": created, "model": model})
        self._head = head[:-1] + b',"choices":'
        self._running_usage = running_usage

    def chunk(self, choices: list[dict[str, Any]], usage: BaseModel | dict[str, Any] | None = None,
              prompt_token_ids: list[int] | None = None) -> bytes:
        """One chunk; ``usage``: the model, or its fields as plain data in the model's order; ``prompt_token_ids``
        (``return_token_ids``, a chat's opening chunk) is added when given."""
        if usage is None and self._running_usage is not None:
            usage = self._running_usage()
        if usage is None:
            usage_json = b"null"
        else:
            usage_json = _JSON.encode(usage) if isinstance(usage, dict) else usage.model_dump_json().encode()
        tail = b"}" if prompt_token_ids is None else b',"prompt_token_ids":' + _JSON.encode(prompt_token_ids) + b"}"
        return event(self._head + _JSON.encode(choices) + b',"usage":' + usage_json + b',"system_fingerprint":null'
                     + tail)

    def text_slot(self, choice: dict[str, Any]) -> TextSlot | None:
        """The :class:`TextSlot` of chunks of ``choice`` alone (plain data) whose one varying string stands where
        ``choice`` holds :data:`SLOT`; None when every chunk carries a usage (it varies too)."""
        if self._running_usage is not None:
            return None
        before, after = self.chunk([choice]).split(_JSON.encode(SLOT))
        return TextSlot(before, after)

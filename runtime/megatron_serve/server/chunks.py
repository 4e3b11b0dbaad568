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

from .chunked import FRAME

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


#: A string no text is: where a plain text piece's text goes in the chunk made to cut the bytes around it.
SLOT = "\x00megatron-serve text slot\x00"
_SLOT_JSON = _JSON.encode(SLOT)


def text_event(before: bytes, text: str, after: bytes) -> bytes:
    """The event of a chunk that adds ``text`` alone, from the bytes around its text (:class:`TextChunks`)."""
    data = _JSON.encode(text)
    return before + (data if data.isascii() else _escape_breaks(data)) + after


def write_text_event(transport: Any, before: bytes, text: str, after: bytes) -> bytes | None:
    """:func:`text_event`'s event of ``text`` written as one chunk straight into ``transport``, as
    :func:`~.chunked.write_chunk` writes one (while nothing waits in its buffer and the client is there); else the
    event, unwritten, for the caller to queue. One call per plain stream's token instead of two (``generation
    ._TextTagged.put_text``)."""
    data = _JSON.encode(text)
    event = before + (data if data.isascii() else _escape_breaks(data)) + after
    if transport.get_write_buffer_size() or transport.is_closing():
        return event
    transport.write(FRAME % (len(event), event))
    return None


class TextChunks:
    """The events of the chunks that add a text alone to one choice: the bytes around the text, cut once from a chunk
    :class:`ChunkWriter` made, and the text's JSON between them (the cut is exact: see :class:`ChunkWriter`)."""

    __slots__ = ("before", "after")

    def __init__(self, before: bytes, after: bytes) -> None:
        self.before, self.after = before, after

    def event(self, text: str) -> bytes:
        """The event of the chunk that adds ``text`` alone."""
        return text_event(self.before, text, self.after)


class ChunkWriter:
    """The one producer of a streamed answer's chunks: ``{"id", "object", "created", "model", "choices", "usage",
    "system_fingerprint"}``, the first four encoded once. ``text_choice(index, text)``: the choice (plain data) of a
    chunk that adds ``text`` alone to choice ``index``, the endpoint's one statement of that shape.
    ``running_usage``: the usage every chunk carries (``stream_options.continuous_usage_stats``), or None when
    chunks carry none.

    :meth:`chunk` makes any chunk; :meth:`text` renders a plain text piece's chunk, most of a stream's, from the
    bytes around its text, which :meth:`chunk` itself made once per choice: the same bytes, without the choice's
    dict, its encoding and the scan of the whole chunk for line breaks per piece (what it saves per token is in
    docs/benchmarks.md, the serving section's fifth round). The cut is exact: a string's JSON escapes alike
    wherever it stands, and the line breaks escaped in event data are whole characters, never cut by the ASCII
    quotes at the cut.
    """

    __slots__ = ("_head", "_running_usage", "_text_choice", "_around")

    def __init__(self, answer_id: str, kind: str, created: int, model: str,
                 text_choice: Callable[[int, str], dict[str, Any]],
                 running_usage: Callable[[], BaseModel | None] | None = None) -> None:
        head = _JSON.encode({"id": answer_id, "object": kind, "created": created, "model": model})
        self._head = head[:-1] + b',"choices":'
        self._running_usage = running_usage
        self._text_choice = text_choice
        self._around: dict[int, TextChunks] = {}  # by choice index: the event's bytes around the text

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

    def text(self, index: int, text: str) -> bytes:
        """The chunk of ``text_choice(index, text)`` alone: from the bytes around the text, cut once per choice
        (every chunk's running usage varies too: then :meth:`chunk` each time)."""
        try:
            return self._around[index].event(text)
        except KeyError:
            chunks = self.text_chunks(index)
            return self.chunk([self._text_choice(index, text)]) if chunks is None else chunks.event(text)

    def text_chunks(self, index: int) -> TextChunks | None:
        """What :meth:`text` makes choice ``index``'s chunks with, made once; None when every chunk carries the
        running usage (it varies)."""
        chunks = self._around.get(index)
        if chunks is None and self._running_usage is None:
            before, after = self.chunk([self._text_choice(index, SLOT)]).split(_SLOT_JSON)
            chunks = self._around[index] = TextChunks(before, after)
        return chunks

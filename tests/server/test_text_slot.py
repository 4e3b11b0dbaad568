"""A plain text piece's chunk (``ChunkWriter.text``, rendered from the bytes around its text) is the chunk
``ChunkWriter.chunk`` makes of the same choice, byte for byte, whatever the text and the answer's names hold (quotes,
escapes, control characters, Unicode line breaks, characters outside the BMP), with or without a running usage."""

from __future__ import annotations

import pytest

from megatron_serve.server.chunked import write_chunk
from megatron_serve.server.chunks import SLOT, ChunkWriter, text_event, write_text_event
from megatron_serve.server.models import Usage

TEXTS = ["", "plain", ' "quoted" \\ back', "tab\tnew\nline\r\x00\x1f", "one\u2028two\u2029three\u0085four",
         "é ß 中文 🙂", "\ufffd", SLOT[1:-1]]


def _choice(kind: str, index: int, text: str) -> dict:
    """A streamed choice of a completion or a chat answer holding ``text``, as the endpoints make them."""
    if kind == "text_completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}


@pytest.mark.parametrize("model", ["tiny-llama", "odd\u2028model \"name\" \u0085"])
@pytest.mark.parametrize("kind", ["text_completion", "chat.completion.chunk"])
@pytest.mark.parametrize("index", [0, 3])
def test_text_chunks_are_the_chunks_of_their_choices(model, kind, index):
    writer = ChunkWriter("cmpl-1\u2029", kind, 1700000000, model, lambda i, text: _choice(kind, i, text))
    for text in TEXTS:
        assert writer.text(index, text) == writer.chunk([_choice(kind, index, text)])


def test_text_chunks_carry_the_running_usage_of_their_time():
    counts = iter(range(1, 100))
    writer = ChunkWriter("cmpl-1", "text_completion", 1, "m", lambda i, text: _choice("text_completion", i, text),
                         running_usage=lambda: Usage(prompt_tokens=1, completion_tokens=next(counts),
                                                     total_tokens=0))
    first, second = writer.text(0, "a"), writer.text(0, "a")
    assert b'"completion_tokens":1,' in first and b'"completion_tokens":2,' in second


@pytest.mark.parametrize("cached", [0, 7])
def test_a_stream_s_usage_chunk_is_the_usage_model_s_byte_for_byte(cached):
    """The last chunk encodes the usage's fields as plain data: the same bytes as the model (what whole answers and
    the running usage still carry), nested prompt details and field order included."""
    from types import SimpleNamespace

    from megatron_serve.server.answers import make_usage, usage_fields

    job = SimpleNamespace(prompt_index=0, index=0, prompt=SimpleNamespace(tokens=list(range(12))))
    finished = [(job, SimpleNamespace(generated_tokens=[1, 2, 3], cached_tokens=cached))]
    writer = ChunkWriter("cmpl-1", "text_completion", 1, "m", lambda i, text: _choice("text_completion", i, text))
    assert writer.chunk([], usage=usage_fields(12, finished)) == writer.chunk([], usage=make_usage(12, finished))
    assert b'"prompt_tokens_details":{"cached_tokens":%d}' % cached in writer.chunk([], usage=usage_fields(12, finished))


class _Transport:
    """A connection's transport: what is written, and a buffer that may be full or a client that left."""

    def __init__(self, buffered: int = 0, closing: bool = False) -> None:
        self.data: list[bytes] = []
        self.buffered, self.closing = buffered, closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.data.append(data)


def test_a_lane_writes_the_text_event_as_the_body_s_chunk_or_hands_it_back_unwritten():
    """``write_text_event`` (a plain stream's token, one call) writes what ``text_event`` makes, framed as
    ``write_chunk`` frames it, into a transport that takes it at once; into a full one, or one whose client left, it
    writes nothing and hands the event back."""
    for text in TEXTS[1:]:
        expected = text_event(b"data: {", text, b"}\n\n")
        framed, control = _Transport(), _Transport()
        assert write_text_event(framed, b"data: {", text, b"}\n\n") is None
        assert write_chunk(control, expected) and framed.data == control.data and len(framed.data) == 1
        for busy in (_Transport(buffered=1), _Transport(closing=True)):
            assert write_text_event(busy, b"data: {", text, b"}\n\n") == expected and busy.data == []

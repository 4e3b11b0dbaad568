"""``benchmarks/serving.py`` reads server-sent events as the specification says, wherever the bytes are cut.

Its earlier reader split lines wherever Python does (``str.splitlines``: U+2028, U+0085 ...) and crashed on
``JSONDecodeError: Unterminated string`` at concurrency 64 when a random model emitted U+2028.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def serving():
    spec = importlib.util.spec_from_file_location("serving_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_events_are_read_whole_wherever_the_stream_is_cut(serving, newline):
    texts = ["one\u2028two", "three\u0085four\u2029", "plain"]
    stream = b"".join(b": a comment" + newline + b"data: " + json.dumps({"text": t}, ensure_ascii=False).encode()
                      + newline + newline for t in texts)
    stream += b"data: first" + newline + b"data:second" + newline + newline + b"data: [DONE]" + newline + newline
    for cut in range(1, len(stream)):
        events = serving.EventStream()
        data = events.feed(stream[:cut]) + events.feed(stream[cut:])
        assert [json.loads(d)["text"] for d in data[:3]] == texts, cut
        assert data[3:] == ["first\nsecond", "[DONE]"], cut


def test_staggered_lengths_spread_around_the_uniform_length(serving):
    uniform = serving.workload(64, 8, 128, 512, "uniform", 0)
    staggered = serving.workload(64, 8, 128, 512, "staggered", 0)
    assert uniform.prompts == staggered.prompts and all(0 <= t < 512 for p in uniform.prompts for t in p)
    assert uniform.lengths == [128] * 64
    assert min(staggered.lengths) == 64 and max(staggered.lengths) == 192 and len(set(staggered.lengths)) > 32
    assert abs(staggered.tokens - uniform.tokens) <= 64

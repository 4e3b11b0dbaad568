"""docs/kv-routing.md's subscriber snippets, run as printed against a real engine's publisher: with a wildcard
endpoint the engine binds and the snippet connects, with a host address the engine connects and the snippet binds
(vLLM's rule, ``engine/kv/events.py``'s ``binds``). Only the port and host placeholders are replaced, and the
snippet's blocking ``recv_multipart`` is left to a poll with a deadline."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import zmq

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from tests.helpers import free_port

PAGE = Path(__file__).resolve().parents[2] / "docs" / "kv-routing.md"
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)


def snippets() -> list[str]:
    """The Python blocks of the page's "Who binds and who connects" section, in order."""
    text = PAGE.read_text()
    section = text.split("### Who binds and who connects", 1)[1].split("\n#", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_page_states_the_rule():
    text = PAGE.read_text()
    assert "makes the engine **bind** its PUB socket" in text and "makes the engine **connect** its" in text
    assert len(snippets()) == 2


@pytest.mark.parametrize("case, engine_endpoint", [(0, "tcp://*:{port}"), (1, "tcp://127.0.0.1:{port}")])
def test_each_snippet_receives_an_engines_events(tiny_llama, case, engine_endpoint):
    port = free_port()
    code = snippets()[case].replace("5557", str(port)).replace("ENGINE_HOST", "127.0.0.1")
    namespace: dict = {}
    exec("\n".join(line for line in code.splitlines() if "recv_multipart" not in line), namespace)  # noqa: S102
    sub: zmq.Socket = namespace["sub"]
    config = {"enable_kv_cache_events": True, "endpoint": engine_endpoint.format(port=port)}
    llm = MegatronLLM(tiny_llama, InferenceConfig(num_kv_blocks=32, kv_events_config=config))
    try:
        deadline = time.monotonic() + 60
        while not sub.poll(200):  # a new subscriber misses the first batches (ZeroMQ's slow joiner): ask again
            assert time.monotonic() < deadline, f"no event reached the snippet's socket ({engine_endpoint})"
            llm.generate([[5, 6, 7, 8] * 5], PARAMS)
        _topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8 and payload
    finally:
        llm.engine.shutdown()
        sub.close(linger=0)

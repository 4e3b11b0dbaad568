"""The engine process reads a typed engine (``ServedEngine``): its HELLO says what the engine is, read directly.

It used to probe the engine with ``getattr(engine, name, default)``; a member it misread turned into a
default in the HELLO (no block size: a fleet that routes without prefix affinity) instead of an error.
"""

from __future__ import annotations

from megatron_serve import InferenceConfig
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.engine.process.loop import EngineProcess
from megatron_serve.engine.served import AdapterVerbs, MemoryVerbs, ServedEngine

from ..coordinator.fakes import FakeEngine

ADDRESS = "tcp://127.0.0.1:9"  # never connected: run() is not called


def test_the_hello_of_a_real_engine_carries_its_facts(tiny_llama):
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        block_size_tokens=8, num_kv_blocks=24, max_requests=3, enable_prefix_caching=False))
    hello = EngineProcess(engine, ADDRESS, info={"model": tiny_llama}).link.hello
    info = hello["info"]
    assert hello["capacity"] == 3
    assert (info["block_size"], info["prefix_caching"], info["kv_blocks_total"]) == (8, False, 24)
    assert info["kv_cache_bytes"] == engine.kv_cache.num_bytes > 0
    assert info["max_sequence_length"] == engine.max_sequence_length
    assert (info["tensor_parallel_size"], info["epoch"], info["weights"]) == (1, 0, tiny_llama)
    for served in (engine, FakeEngine()):  # the protocol's members, the verbs' objects' included, all there
        assert not _missing(served), _missing(served)


def _members(protocol: type) -> set[str]:
    return {name for name in [*vars(protocol), *protocol.__annotations__] if not name.startswith("_")}


def _missing(engine: object) -> list[str]:
    """The members of ``ServedEngine`` (and of its ``memory`` and ``adapters``) that ``engine`` lacks."""
    missing = [name for name in _members(ServedEngine) if not hasattr(engine, name)]
    for holder, protocol in (("memory", MemoryVerbs), ("adapters", AdapterVerbs)):
        missing += [f"{holder}.{name}" for name in _members(protocol) if not hasattr(getattr(engine, holder), name)]
    return missing


def test_a_member_missing_is_seen():
    """The control of the check above: an engine without one verb's method is caught."""

    class NoUnload(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.adapters = type("Adapters", (), {"names": None, "verify": None, "load": None})()

    assert _missing(NoUnload()) == ["adapters.unload"]


def test_an_engine_without_a_block_size_says_nothing_of_prefix_caching():
    """The control: the same process over an engine that reports no block size leaves both facts out."""
    with_blocks = EngineProcess(FakeEngine(max_requests=5, block_size=16), ADDRESS).link.hello
    without = EngineProcess(FakeEngine(max_requests=5), ADDRESS).link.hello
    assert (with_blocks["info"]["block_size"], with_blocks["info"]["prefix_caching"]) == (16, True)
    assert "block_size" not in without["info"] and "prefix_caching" not in without["info"]
    assert with_blocks["capacity"] == without["capacity"] == 5

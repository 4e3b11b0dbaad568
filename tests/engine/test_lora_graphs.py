"""Decode steps with adapter rows replayed from graphs (engine.lora_graphs): one graph per batch size over padded
slot ids serves any mix of adapters, ranks and base rows. On CPU the stand-in capture (``tests.graph_replay``)
reruns the captured forward over the static buffers; on a GPU the last test runs real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.precompile.graphs import DecodeGraphs
from megatron_serve.engine.lora.graphs import LoraDecodeGraphs, add_lora_graphs
from megatron_serve.model.tiny import make_tiny_model

from ..graph_replay import install_graphs
from ..lora_adapters import make_peft_adapter
from ..prompts import PROMPTS, run_requests

# Staggered lengths: decode batches shrink through the padded sizes, mixing 3 adapters of ranks 4/8/16 and the base.
JOBS = [(PROMPTS[i], name, 4 + 2 * i) for i, name in enumerate(["r4", None, "r8", "r16", "r8", None])]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("lora-graphs"), seed=5))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-graphs-adapters")
    return {f"r{rank}": str(make_peft_adapter(base, root / f"r{rank}", rank=rank, seed=rank)) for rank in (4, 8, 16)}


def _engine(base: str, adapters: dict[str, str], **overrides) -> DynamicInferenceEngine:
    config = dict(dtype="float32", block_size_tokens=8, max_requests=8, enable_lora=True, max_loras=3,
                  max_lora_rank=16, lora_modules=adapters)
    return DynamicInferenceEngine.from_model_dir(base, InferenceConfig(**{**config, **overrides}))


def _run(engine: DynamicInferenceEngine, jobs=JOBS) -> list[tuple[list[int], list[float]]]:
    outs = run_requests(engine, [(p, SamplingParams(temperature=0.0, num_tokens_to_generate=n, ignore_eos=True,
                                                    return_log_probs=True, lora_name=name)) for p, name, n in jobs])
    return [(o.generated_tokens, o.generated_log_probs) for o in outs]


def _graphed(base: str, adapters: dict[str, str]):
    """An engine whose decode steps replay stand-in graphs of batch 1, 2, 4 and 8, with adapter graphs too."""
    engine = _engine(base, adapters)
    capture = install_graphs(engine, [1, 2, 4, 8])
    engine.worker.runner.lora_rows = engine.loras.slots.rows
    assert add_lora_graphs(engine.worker.runner, engine.loras.slots, engine.kv_cache.layer_caches)
    return engine, capture


def _assert_close(got, want) -> None:
    for (tokens, log_probs), (tokens_want, log_probs_want) in zip(got, want, strict=True):
        assert tokens == tokens_want
        assert log_probs == pytest.approx(log_probs_want, abs=1e-4)


def test_adapter_decode_steps_replay_graphs_and_equal_the_eager_engine(base, adapters):
    eager = _run(_engine(base, adapters))
    engine, capture = _graphed(base, adapters)
    assert engine.worker.runner.graphs.lora_decode.captured
    assert capture.captured_sizes == [8, 4, 2, 1, 8, 4, 2, 1]  # the base graphs, then the adapter graphs
    replays = len(capture.replayed_sizes)
    adapter_only = [job for job in JOBS if job[1] is not None]  # every decode step has adapter rows
    got = _run(engine, adapter_only)
    assert len(capture.replayed_sizes) > replays  # those steps replayed the adapter graphs
    _assert_close(got, [out for out, job in zip(eager, JOBS) if job[1] is not None])
    _assert_close(_run(engine), eager)
    assert eager[0][0] != _run(engine, [(PROMPTS[0], None, 4)])[0][0]  # control: the adapter changes the tokens
    engine.memory.suspend()
    assert not engine.worker.runner.graphs.lora_decode.captured
    engine.memory.resume()
    assert engine.worker.runner.graphs.lora_decode.captured
    _assert_close(_run(engine), eager)


def test_graphs_without_the_padded_slot_ids_give_other_tokens(base, adapters, monkeypatch):
    """Negative control: adapter graphs whose forward does not apply the slots (the base graph's forward) replay
    the base model for the adapter rows, which the comparison above catches."""
    monkeypatch.setattr(LoraDecodeGraphs, "_forward_for", DecodeGraphs._forward_for)
    eager = _run(_engine(base, adapters))
    engine, _ = _graphed(base, adapters)
    got = _run(engine)
    assert [tokens for tokens, _ in got] != [tokens for tokens, _ in eager]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_graphs_with_adapters_equal_the_eager_engine(base, adapters):
    eager = _run(_engine(base, adapters, device="cuda", enable_cuda_graphs=False))
    engine = _engine(base, adapters, device="cuda")
    assert engine.worker.runner.graphs.lora_decode.captured
    _assert_close(_run(engine), eager)
    engine.memory.suspend()
    engine.memory.resume()
    assert engine.worker.runner.graphs.lora_decode.captured
    _assert_close(_run(engine), eager)

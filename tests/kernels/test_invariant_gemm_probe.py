"""The GEMM probe of the CPU's batch-invariant mode: the properties hold on the machine running the tests (or
this test names the one that fails: the mode cannot keep its promise there), a shape set known to round
differently is caught, and an engine whose probe fails refuses the mode with the property named."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import invariant_probe
from megatron_serve.config import InferenceConfig
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.model.errors import UnsupportedModelError


def test_the_cpu_op_sets_gemm_properties_hold_here() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).to(dtype)
               for shape in ((256, 256), (1376, 256), (256, 688), (72, 40))
               for dtype in (torch.float32, torch.bfloat16)]
    assert invariant_probe.cpu_problems(weights, 16) == []
    assert invariant_probe.cpu_problems(weights, 64) == []


def test_a_lone_column_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one query column takes the matrix-vector path, which rounds otherwise than the GEMM
    of 16 columns (on every CPU probed), so a probe that lets the column count reach 1 reports it."""
    monkeypatch.setattr(invariant_probe, "_COLUMN_COUNTS", (1, 16))
    invariant_probe.attention_problems.cache_clear()
    try:
        problems = invariant_probe.attention_problems(32)
    finally:
        invariant_probe.attention_problems.cache_clear()
    assert problems and all("a column changes" in p for p in problems)


def test_an_engine_refuses_the_mode_where_the_probe_fails(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant_probe, "_COLUMN_COUNTS", (1, 16))
    invariant_probe.attention_problems.cache_clear()
    try:
        with pytest.raises(UnsupportedModelError, match=r"--batch-invariant: this CPU's GEMMs .*scores GEMM"):
            DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(batch_invariant=True, num_kv_blocks=16))
    finally:
        invariant_probe.attention_problems.cache_clear()
    monkeypatch.undo()
    engine = DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(batch_invariant=True, num_kv_blocks=16))
    assert engine.config.batch_invariant  # the real probe passes here

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
    linears = [(torch.randn(shape, generator=generator).to(dtype), parts)
               for shape, parts in (((256, 256), (256,)), ((1376, 256), (688, 688)), ((256, 688), (256,)),
                                    ((72, 40), (48, 12, 12)))
               for dtype in (torch.float32, torch.bfloat16)]
    assert invariant_probe.cpu_problems(linears, 16) == []
    assert invariant_probe.cpu_problems(linears, 64) == []


def test_fused_columns_of_whole_tiles_are_the_parts_own() -> None:
    """q|k|v and gate|up of widths that are whole column tiles run as one GEMM (the fast form) on every CPU
    probed; narrower parts may not (the engine then runs them part by part: the parity search's 8-wide
    heads do)."""
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        assert invariant_probe.fusion_holds(torch.randn((512, 256), generator=generator).to(dtype), (256, 128, 128))
        assert invariant_probe.fusion_holds(torch.randn((1376, 256), generator=generator).to(dtype), (688, 688))


def test_a_lone_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one query row takes the matrix-vector path, which rounds otherwise than a GEMM of
    several rows (on every CPU probed), so a probe that lets the row count reach 1 reports it."""
    monkeypatch.setattr(invariant_probe, "_ATTENTION_ROWS", (1, invariant_probe.MIN_ROWS))
    invariant_probe.attention_problems.cache_clear()
    try:
        problems = invariant_probe.attention_problems(32)
    finally:
        invariant_probe.attention_problems.cache_clear()
    assert problems and all("a row changes" in p for p in problems)


def test_an_engine_refuses_the_mode_where_the_probe_fails(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant_probe, "_ATTENTION_ROWS", (1, invariant_probe.MIN_ROWS))
    invariant_probe.attention_problems.cache_clear()
    try:
        with pytest.raises(UnsupportedModelError, match=r"--batch-invariant: this CPU's GEMMs .*scores GEMM"):
            DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(batch_invariant=True, num_kv_blocks=16))
    finally:
        invariant_probe.attention_problems.cache_clear()
    monkeypatch.undo()
    engine = DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(batch_invariant=True, num_kv_blocks=16))
    assert engine.config.batch_invariant  # the real probe passes here

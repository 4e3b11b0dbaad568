"""The GEMM probe of the CPU's batch-invariant mode: the properties hold on the machine running the tests (or
this test names the one that fails: the mode cannot keep its promise there), a shape set known to round
differently is caught, and an engine whose probe fails refuses the mode with the property named."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import invariant, invariant_probe
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


def test_a_lone_row_is_caught() -> None:
    """Negative control: one query row takes the matrix-vector path, which rounds otherwise than a GEMM of
    several rows (on every CPU probed), so a probe that lets the row count reach 1 reports it."""
    problems = invariant_probe._attention_problems(32, (1, invariant.row_tile()))
    assert problems and all("a row changes" in p for p in problems)


def test_an_engine_refuses_the_mode_where_the_probe_fails(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = InferenceConfig(batch_invariant=True, num_kv_blocks=16, device="cpu")  # a GPU engine has its own kernels
    monkeypatch.setattr(invariant_probe, "_row_counts", lambda: (1, invariant.row_tile()))
    with pytest.raises(UnsupportedModelError, match=r"--batch-invariant: this CPU.s GEMMs change a row.s bits.*a linear"):
        DynamicInferenceEngine.from_model_dir(tiny_model, config)
    monkeypatch.undo()
    engine = DynamicInferenceEngine.from_model_dir(tiny_model, config)
    assert engine.config.batch_invariant  # the real probe passes here


def test_the_row_tile_is_probed_or_set_and_a_bad_setting_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile the probe settles on holds here (a row's bits at every multiple of it), a smaller one that
    is not a tile does not (control), and the variable overrides the probe or is refused by name."""
    tile = invariant._settle_row_tile()
    assert tile in (4, 8, invariant.SAFE_ROW_TILE) and invariant._rows_hold(tile)
    assert not invariant._rows_hold(1)  # one row takes the matrix-vector path
    monkeypatch.setenv(invariant.ROW_TILE_VARIABLE, "16")
    assert invariant._settle_row_tile() == 16
    monkeypatch.setenv(invariant.ROW_TILE_VARIABLE, "6")
    with pytest.raises(ValueError, match="MEGATRON_INVARIANT_ROW_TILE='6': must be a positive multiple of 4"):
        invariant._settle_row_tile()

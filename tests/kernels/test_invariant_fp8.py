"""FP8 weights in the batch-invariant mode (``megatron_kernels.invariant_fp8``, FP8 experts through
``invariant.fused_moe``): a row's output is ``==`` alone and in batches of 7 and 64 rows, per-row and block scales,
linear and MoE experts; the default FP8 path is not (the control), and the mode's values are the dequantized
weights' (close to the reference path)."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import fp8, invariant, invariant_fp8, reference
from megatron_kernels.moe_weights import ExpertWeights

ROWS = (1, 7, 64)


def _weights(out_features: int, in_features: int, block, experts: int | None = None):
    shape = (out_features, in_features) if experts is None else (experts, out_features, in_features)
    return fp8.quantize(torch.randn(*shape) / in_features ** 0.5, block)


@pytest.mark.parametrize("block", [None, (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_an_fp8_linear_is_the_same_in_every_batch(block, dtype):
    torch.manual_seed(0)
    weight, scale = _weights(96, 64, block)
    x = torch.randn(64, 64).to(dtype)
    alone = invariant_fp8.fp8_linear(x[:1], weight, scale, block)
    for rows in ROWS:
        assert torch.equal(invariant_fp8.fp8_linear(x[:rows], weight, scale, block)[:1], alone), rows
    expected = reference.fp8_linear(x[:1], weight, scale, block)
    torch.testing.assert_close(alone, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_the_default_fp8_linear_changes_with_the_batch():
    """The control: the reference path (dequantize, then one library GEMM) rounds a row by the row count."""
    torch.manual_seed(0)
    weight, scale = _weights(96, 64, None)
    x = torch.randn(64, 64)
    alone = reference.fp8_linear(x[:1], weight, scale, None)
    assert not all(torch.equal(reference.fp8_linear(x[:rows], weight, scale, None)[:1], alone) for rows in ROWS)


@pytest.mark.parametrize("block", [None, (16, 16)])
def test_a_token_of_fp8_experts_is_the_same_in_every_batch(block):
    torch.manual_seed(1)
    experts, hidden, inner, top_k = 6, 32, 48, 2
    w13, s13 = _weights(2 * inner, hidden, block, experts)
    w2, s2 = _weights(hidden, inner, block, experts)
    moe = ExpertWeights(w13, w2, s13, s2, block)
    x = torch.randn(64, hidden)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(64)])
    weights = torch.softmax(torch.randn(64, top_k), -1)

    def run(rows: int) -> torch.Tensor:
        return invariant.fused_moe(x[:rows], moe, weights[:rows], ids[:rows])[:1]

    alone = run(1)
    for rows in ROWS:
        assert torch.equal(run(rows), alone), rows
    expected = reference.fused_moe(x[:1], moe, weights[:1], ids[:1])
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)


def test_fp8_experts_take_a_negative_id_as_no_expert():
    """The expert-parallel dispatchers' unused rows (id -1) add nothing, and the rows beside them keep their bits."""
    torch.manual_seed(2)
    w13, s13 = _weights(96, 32, None, 4)
    w2, s2 = _weights(32, 48, None, 4)
    moe = ExpertWeights(w13, w2, s13, s2)
    x = torch.randn(5, 32)
    ids = torch.tensor([[0], [3], [-1], [3], [-1]])
    ones = torch.ones(5, 1)
    out = invariant.fused_moe(x, moe, ones, ids)
    assert torch.equal(out[[2, 4]], torch.zeros(2, 32))
    used = invariant.fused_moe(x[[0, 1, 3]], moe, ones[:3], ids[[0, 1, 3]])
    assert torch.equal(out[[0, 1, 3]], used)
    assert invariant.fused_moe(x[:1], moe, ones[:1], ids[2:3]).abs().sum() == 0

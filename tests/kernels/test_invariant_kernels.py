"""The batch-invariant Triton kernels: a row's output is the same (``==``) in a batch of 1, 7 or 64 rows,
and close to the PyTorch twins in ``megatron_kernels.invariant``. Tiny shapes: under the interpreter each
program costs about 1.5 ms."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import invariant, invariant_attention
from megatron_kernels.triton_invariant_linear import invariant_linear, tiles_for
from megatron_kernels.triton_invariant_norm import invariant_fused_add_rms_norm, invariant_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BATCHES = (1, 7, 64)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def _each_batch(function, rows: torch.Tensor) -> list[torch.Tensor]:
    """``function`` of the first 1, 7 and 64 rows: a row's output must not depend on how many came with it."""
    return [function(rows[:count]) for count in BATCHES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_equal_in_any_batch_and_close_to_the_twin(dtype: torch.dtype, bias: bool) -> None:
    x = _randn(64, 72, dtype=dtype, seed=0)  # 72 inputs: two BLOCK_K steps, the second partial
    weight = _randn(40, 72, dtype=dtype, seed=1) / 8
    b = _randn(40, dtype=dtype, seed=2) if bias else None
    outs = _each_batch(lambda rows: invariant_linear(rows, weight, b), x)
    for out in outs:
        assert torch.equal(out, outs[-1][: out.shape[0]])
    assert torch.equal(invariant_linear(x[5:6], weight, b)[0], outs[-1][5])  # a row alone, from mid-batch
    torch.testing.assert_close(outs[-1].float(), invariant.linear(x.cpu(), weight.cpu(), None if b is None else b.cpu())
                               .to(outs[-1].device).float(), **TOL[dtype])


def test_linear_tiles_follow_the_weight_not_the_rows() -> None:
    device = torch.device(DEVICE)
    assert tiles_for(4096, 1024, device) == tiles_for(4096, 1024, device)
    assert "M" not in tiles_for.__code__.co_varnames


def test_library_gemm_control_changes_with_the_batch() -> None:
    """Negative control: the library GEMM the default mode runs gives a row other bits alone than among 64
    (float32, the CPU's MKL: a one-row product takes the matrix-vector path)."""
    x = _randn(64, 256, dtype=torch.float32, seed=3).cpu()
    weight = _randn(512, 256, dtype=torch.float32, seed=4).cpu()
    assert not torch.equal(torch.nn.functional.linear(x[:1], weight)[0], torch.nn.functional.linear(x, weight)[0])


def test_linear_backward_is_the_plain_gradient() -> None:
    """Given the same gradient from above, the gradients are the library's, bit for bit. (A loss of the output
    would compare the forwards too: they round apart, by 4e-5 of a float32 value on an H200.)"""
    x = _randn(5, 72, dtype=torch.float32, seed=5).requires_grad_()
    weight = _randn(40, 72, dtype=torch.float32, seed=6).requires_grad_()
    upstream = _randn(5, 40, dtype=torch.float32, seed=7)
    invariant_linear(x, weight).backward(upstream)
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2).backward(upstream)
    assert torch.equal(x.grad, x2.grad) and torch.equal(weight.grad, w2.grad)


def test_linear_rejects_mismatched_shapes_and_dtypes() -> None:
    x = _randn(3, 72, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="input features 72"):
        invariant_linear(x, _randn(40, 64, dtype=torch.float32, seed=1))
    with pytest.raises(TypeError, match="invariant_linear"):
        invariant_linear(x, _randn(40, 72, dtype=torch.bfloat16, seed=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_rows_equal_in_any_batch_and_close_to_the_twins(dtype: torch.dtype) -> None:
    x = _randn(64, 48, dtype=dtype, seed=7)
    residual = _randn(64, 48, dtype=dtype, seed=8)
    weight = (1 + _randn(48, dtype=dtype, seed=9) / 4)
    normed = _each_batch(lambda rows: invariant_rms_norm(rows, weight, 1e-6), x)
    fused = _each_batch(lambda rows: invariant_fused_add_rms_norm(rows, residual[: rows.shape[0]], weight, 1e-6), x)
    for (out, (fused_out, summed)) in zip(normed, fused):
        assert torch.equal(out, normed[-1][: out.shape[0]])
        assert torch.equal(fused_out, fused[-1][0][: out.shape[0]])
        assert torch.equal(summed, fused[-1][1][: out.shape[0]])
    cpu = x.cpu(), residual.cpu(), weight.cpu()
    torch.testing.assert_close(normed[-1].cpu().float(), invariant.rms_norm(cpu[0], cpu[2], 1e-6).float(), **TOL[dtype])
    twin_out, twin_sum = invariant.fused_add_rms_norm(cpu[0], cpu[1], cpu[2], 1e-6)
    torch.testing.assert_close(fused[-1][0].cpu().float(), twin_out.float(), **TOL[dtype])
    if dtype == torch.float32 or DEVICE == "cuda":  # one rounding of one addition: the same bits (the
        assert torch.equal(fused[-1][1].cpu(), twin_sum)  # interpreter's cast to bfloat16 does not round to even)
    torch.testing.assert_close(fused[-1][1].cpu().float(), twin_sum.float(), **TOL[dtype])


def test_rms_norm_rejects_a_wrong_weight() -> None:
    with pytest.raises(ValueError, match="hidden size 48"):
        invariant_rms_norm(_randn(2, 48, dtype=torch.float32, seed=0), _randn(32, dtype=torch.float32, seed=1), 1e-6)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_row_is_the_same_as_decode_and_as_the_last_row_of_a_chunk(group: int) -> None:
    """A sequence's last query computed alone (a decode row) and as the last row of a chunk of 2 to 20 rows (a
    speculative verify step, a prefill chunk) gets the same bits: the GEMMs' row count changes with the chunk,
    and below ``MIN_ROWS`` the CPU's GEMM kernels round counts their own way (an AVX-512 EPYC: an earlier
    form with 2-column GEMMs failed this)."""
    kv_heads, dim, length = 2, 16, 70
    keys = _randn(kv_heads, 1, length, dim, dtype=torch.float32, seed=10).cpu()
    values = _randn(kv_heads, 1, length, dim, dtype=torch.float32, seed=11).cpu()
    q = _randn(20, kv_heads * group, dim, dtype=torch.float32, seed=12).cpu()
    last = length - 1

    def last_row(rows: int) -> torch.Tensor:
        positions = torch.arange(last - rows + 1, last + 1)
        return invariant_attention.attention(q[20 - rows:], keys, values, torch.zeros(rows, dtype=torch.long),
                                             positions, 0.25)[-1]

    alone = last_row(1)
    for rows in (2, 3, 5, 12, 20):
        assert torch.equal(last_row(rows), alone), rows

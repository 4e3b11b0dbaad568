"""Batch-invariant ``x @ weight.T + bias`` in Triton: tiles chosen by the weight's shape alone, no split-K.

A GEMM library picks its tiles, and whether to split the ``K`` reduction across blocks, by the shape it
is given, ``M`` included; a row's rounding then changes with the number of rows in the step. This
kernel's tiles (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, warps, stages) are a function of
``(out_features, in_features)`` and of the device only, and each output tile reduces ``K`` in one
program, in ``BLOCK_K`` steps from 0: a row meets the same compiled kernel and the same order of
additions whether the step has 1 row or 256. ``n_rows`` is not specialised (no per-row-count variant).

The PyTorch reference twin is :func:`megatron_kernels.invariant.linear` (the CPU path: tiled library
GEMMs). The two order the ``K`` sum differently, so they agree to float32 rounding, not bit for bit;
the engine uses this kernel on CUDA and the twin elsewhere, and a trainer on a GPU reaches the same
kernel through ``megatron_serve.invariant.batch_invariant()`` (its ``F.linear`` is routed here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import interpreted, next_pow2


@triton.jit(do_not_specialize=["n_rows"])
def _invariant_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    n_rows, n_out, n_in,
    stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_out
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_in, BLOCK_K):  # the whole K in one program: no split-K
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < n_in
        a = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols64[None, :] * stride_w + ks[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if IEEE:  # float32 on a GPU: full-precision products, not TF32; the interpreter's dot of bfloat16
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")  # is not exact
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_o + cols64[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def tiles_for(out_features: int, in_features: int, device: torch.device) -> dict[str, int]:
    """The launch's tiles, warps and stages: a function of the weight's shape and the device, never of
    the row count. Small tiles under the interpreter (each program costs about 1.5 ms there)."""
    if device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=min(next_pow2(out_features), 64), BLOCK_K=min(next_pow2(in_features), 64),
                    num_warps=1, num_stages=1)
    block_k = 64 if in_features >= 64 else max(16, next_pow2(in_features))
    block_n = 128 if out_features >= 128 else max(16, next_pow2(out_features))
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n_out, n_in = weight.shape
    if x.shape[-1] != n_in:
        raise ValueError(f"input features {x.shape[-1]} do not match the weight's {n_in}")
    rows = x.reshape(-1, n_in)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((rows.shape[0], n_out), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        tiles = tiles_for(n_out, n_in, x.device)
        grid = (triton.cdiv(rows.shape[0], tiles["BLOCK_M"]), triton.cdiv(n_out, tiles["BLOCK_N"]))
        _invariant_linear_kernel[grid](
            rows, weight, bias if bias is not None else weight, out,
            rows.shape[0], n_out, n_in,
            rows.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or interpreted(x), **tiles)
    return out.view(*x.shape[:-1], n_out)


class _InvariantLinear(torch.autograd.Function):
    """The kernel forward; a plain backward (gradients need no batch invariance)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = grad2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.invariant.linear` (differentiable)."""
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"invariant_linear: input {x.dtype}, weight {weight.dtype} and bias must share a dtype")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _InvariantLinear.apply(x, weight, bias)
    return _forward(x, weight, bias)

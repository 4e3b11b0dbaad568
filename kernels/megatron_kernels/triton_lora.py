"""Batched LoRA shrink/expand in Triton: each row reads its own adapter slot (gathered per row, as
Punica's BGMV), so one launch serves a step that mixes adapters, ranks (zero-padded) and base rows.

Twin of :mod:`megatron_kernels.reference_lora` (same layouts and signatures, the weight tables in any
strides; the kernels read only the batch's per-row ``indices``, and ``h`` has one row per token). A base row
(slot -1) costs one index load: shrink writes zeros, expand returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import interpreted, next_pow2
from .reference_lora import LoraBatch


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, idx_ptr, h_ptr, rank, k_size,
    stride_x, stride_as, stride_ar, stride_ak, stride_h,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + row)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, k_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ks, mask=ks < k_size, other=0.0).to(tl.float32)
            a_ptrs = a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :] * stride_ak
            a = tl.load(a_ptrs, mask=(ranks < rank)[:, None] & (ks < k_size)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row.to(tl.int64) * stride_h + ranks, acc.to(h_ptr.dtype.element_ty), mask=ranks < rank)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, idx_ptr, rank, n_size,
    stride_y, stride_h, stride_bs, stride_bn, stride_br,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + row.to(tl.int64) * stride_h + ranks, mask=ranks < rank, other=0.0).to(tl.float32)
        b_ptrs = b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :] * stride_br
        b = tl.load(b_ptrs, mask=(cols < n_size)[:, None] & (ranks < rank)[None, :], other=0.0).to(tl.float32)
        y_ptrs = y_ptr + row.to(tl.int64) * stride_y + cols
        y = tl.load(y_ptrs, mask=cols < n_size, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + tl.sum(b * h[None, :], axis=1)).to(y_ptr.dtype.element_ty), mask=cols < n_size)


def _check(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _tile(t: torch.Tensor, size: int, gpu_tile: int) -> int:
    """The tile over ``size`` columns: all of them (up to 4096) under the interpreter, whose cost is per
    program, at most ``gpu_tile`` on a GPU."""
    return min(next_pow2(size), 4096 if interpreted(t) else gpu_tile)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference_lora.lora_shrink` (``[tokens, rank]``, zeros for base rows)."""
    indices = batch.indices
    _check("x", x)
    n_rows, k_size = x.shape
    _, rank, _ = a.shape
    h = torch.empty((n_rows, rank), dtype=x.dtype, device=x.device)
    if n_rows:
        block_r = next_pow2(rank)
        _shrink_kernel[(n_rows, triton.cdiv(rank, block_r))](
            x, a, indices, h, rank, k_size, x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
            BLOCK_R=block_r, BLOCK_K=_tile(x, k_size, 128),
        )
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """Triton twin of :func:`megatron_kernels.reference_lora.lora_expand` (adds into ``y`` in place)."""
    indices = batch.indices
    for name, t in (("y", y), ("h", h)):
        _check(name, t)
    n_rows, n_size = y.shape
    rank = b.shape[2]
    if n_rows:
        block_n = _tile(y, n_size, 64)
        _expand_kernel[(n_rows, triton.cdiv(n_size, block_n))](
            y, h, b, indices, rank, n_size, y.stride(0), h.stride(0), b.stride(0), b.stride(1), b.stride(2),
            BLOCK_R=next_pow2(rank), BLOCK_N=block_n,
        )

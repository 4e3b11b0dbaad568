"""Batched LoRA shrink/expand in Triton: each row reads its own adapter slot (gathered per row, as
Punica's BGMV), so one launch serves a step that mixes adapters, ranks (zero-padded) and base rows.

Twin of :mod:`megatron_kernels.reference_lora` (same layouts and signatures, the weight tables in any
strides; the kernel reads only the batch's per-row ``indices``, and ``h`` has one row per token). Shrink and
expand are one kernel, a row's product with its slot's weight. A base row (slot -1) costs one index load:
shrink writes zeros, expand returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import interpreted, next_pow2
from .reference_lora import LoraBatch


@triton.jit
def _slot_gemv_kernel(
    x_ptr, w_ptr, idx_ptr, out_ptr, n_out, n_in,
    stride_x, stride_ws, stride_wo, stride_wi, stride_out,
    ACCUMULATE: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    """``out[row, cols] (+)= w[slot of row][cols, :] @ x[row, :]`` for one row and one tile of output columns, in
    float32. Shrink and expand are this one product (Punica's BGMV): shrink (``w`` = ``a``) writes every row, zeros
    for a base row; expand (``w`` = ``b``, ``ACCUMULATE``) adds into ``out`` and leaves a base row as it is."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slot = tl.load(idx_ptr + row)
    out_ptrs = out_ptr + row.to(tl.int64) * stride_out + cols
    acc = tl.zeros((BLOCK_OUT,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, n_in, BLOCK_IN):
            ks = k0 + tl.arange(0, BLOCK_IN)
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ks, mask=ks < n_in, other=0.0).to(tl.float32)
            w_ptrs = w_ptr + slot * stride_ws + cols[:, None] * stride_wo + ks[None, :] * stride_wi
            w = tl.load(w_ptrs, mask=(cols < n_out)[:, None] & (ks < n_in)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=cols < n_out, other=0.0).to(tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=cols < n_out)
    if not ACCUMULATE:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=cols < n_out)


def _check(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _tile(t: torch.Tensor, size: int, gpu_tile: int) -> int:
    """The tile over ``size`` columns: all of them (up to 4096) under the interpreter, whose cost is per
    program, at most ``gpu_tile`` on a GPU."""
    return min(next_pow2(size), 4096 if interpreted(t) else gpu_tile)


def _slot_gemv(x: torch.Tensor, w: torch.Tensor, batch: LoraBatch, out: torch.Tensor, accumulate: bool,
               block_out: int, block_in: int) -> None:
    """Launch :func:`_slot_gemv_kernel` over every row of ``x`` ``[rows, in]`` into ``out`` ``[rows, out]``, with
    ``w`` ``[slots, out, in]``, in tiles of ``block_out`` output columns."""
    n_rows = x.shape[0]
    _, n_out, n_in = w.shape
    if n_rows:
        _slot_gemv_kernel[(n_rows, triton.cdiv(n_out, block_out))](
            x, w, batch.indices, out, n_out, n_in, x.stride(0), *w.stride(), out.stride(0),
            ACCUMULATE=accumulate, BLOCK_OUT=block_out, BLOCK_IN=block_in,
        )


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference_lora.lora_shrink` (``[tokens, rank]``, zeros for base rows)."""
    _check("x", x)
    rank = a.shape[1]
    h = torch.empty((x.shape[0], rank), dtype=x.dtype, device=x.device)
    _slot_gemv(x, a, batch, h, False, next_pow2(rank), _tile(x, x.shape[1], 128))
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """Triton twin of :func:`megatron_kernels.reference_lora.lora_expand` (adds into ``y`` in place)."""
    for name, t in (("y", y), ("h", h)):
        _check(name, t)
    _slot_gemv(h, b, batch, y, True, _tile(y, y.shape[1], 64), next_pow2(b.shape[2]))

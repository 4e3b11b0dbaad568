"""Batch-invariant RMSNorm and fused residual-add + RMSNorm in Triton: one row per program, always.

:mod:`megatron_kernels.triton_norm` packs as many rows into a program as its tile budget allows, and
its warps follow the tile: the reduction tree of a row's sum of squares then changes with the token
count. Here every launch puts one row in a program with a block of ``next_pow2(hidden)`` columns and
warps chosen from ``hidden`` alone, so a row meets the same compiled kernel and the same reduction
whatever the step holds. The arithmetic is ``transformers``' RMSNorm (float32 statistics, the
normalised row cast to the input dtype, then the weight), in the shared kernel of ``triton_norm``.

The PyTorch reference twins are :func:`megatron_kernels.invariant.rms_norm` and
:func:`~megatron_kernels.invariant.fused_add_rms_norm` (op for op ``transformers``' code, used on CPU);
the two order the row's sum differently and agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton

from ._triton_utils import last_dim_contiguous, next_pow2, num_warps_for, tl_dtype
from .triton_norm import _rms_norm_kernel


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = last_dim_contiguous(x).reshape(-1, hidden)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
        r2 = last_dim_contiguous(residual).reshape(-1, hidden)
        summed = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        norm_dtype = summed.dtype
    else:
        r2 = summed = x2  # unused by the kernel
        norm_dtype = x.dtype
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    if x2.shape[0]:
        block_n = next_pow2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, summed,
            x2.shape[0], hidden, float(eps),
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            HAS_RESIDUAL=residual is not None, NORM_DTYPE=tl_dtype(norm_dtype),
            BLOCK_M=1, BLOCK_N=block_n, num_warps=num_warps_for(block_n))
    if residual is None:
        return out.view(x.shape), None
    return out.view(x.shape), summed.view(x.shape)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.invariant.rms_norm`."""
    return _launch(x, None, weight, eps)[0]


def invariant_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`megatron_kernels.invariant.fused_add_rms_norm`: ``(rms_norm(x + r), x + r)``."""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed

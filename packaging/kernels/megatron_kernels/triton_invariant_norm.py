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

from .triton_norm import launch_rms_norm


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.invariant.rms_norm`."""
    return launch_rms_norm(x, None, weight, eps, one_row_per_program=True)[0]


def invariant_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`megatron_kernels.invariant.fused_add_rms_norm`: ``(rms_norm(x + r), x + r)``."""
    out, summed = launch_rms_norm(x, residual, weight, eps, one_row_per_program=True)
    assert summed is not None
    return out, summed

"""The CPU engine's per-token passes as one C++ loop each (``csrc/rotary_norm.cpp`` and ``csrc/silu_and_mul.cpp``,
built on first use by :mod:`megatron_kernels.cpu_build`): the rotary embedding fused with the KV-cache write,
RMSNorm with its residual add, and SwiGLU, where the reference runs a dozen PyTorch ops over the rows.

The rotation is the reference's arithmetic operation for operation, bit for bit; RMSNorm sums its squares in an
order of its own, fixed by the row's width, and SwiGLU's ``exp`` is glibc's vector one, so both equal the reference
within rounding; no row depends on the rows beside it. Each op serves float32 tensors on the CPU (and a cache
without FP8 scales); any other call, or a machine where the source cannot be built, goes to the reference.
"""

from __future__ import annotations

import torch

from . import cpu_build, reference
from .paged_kv import PagedKV


def built() -> bool:
    """Whether the rotary and norm kernels are built and loaded here (``torch.ops.megatron_cpu_rows``)."""
    return cpu_build.built("rotary_norm")


def swiglu_built() -> bool:
    """Whether the SwiGLU kernel is built and loaded here (``torch.ops.megatron_cpu_swiglu``)."""
    return cpu_build.built("silu_and_mul")


def _float32_rows(*tensors: torch.Tensor) -> bool:
    """Float32 CPU tensors whose last dimension is contiguous."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`megatron_kernels.reference.silu_and_mul` in one pass per row."""
    if not (_float32_rows(x) and x.is_contiguous() and x.shape[-1] % 2 == 0 and swiglu_built()):
        return reference.silu_and_mul(x)
    return torch.ops.megatron_cpu_swiglu.silu_and_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`megatron_kernels.reference.rms_norm` in one pass per row."""
    if not (_float32_rows(x, weight) and x.is_contiguous() and weight.is_contiguous() and built()):
        return reference.rms_norm(x, weight, eps)
    return torch.ops.megatron_cpu_rows.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`megatron_kernels.reference.fused_add_rms_norm` in one pass per row."""
    if not (_float32_rows(x, residual, weight) and x.shape == residual.shape and x.is_contiguous()
            and residual.is_contiguous() and weight.is_contiguous() and built()):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    return torch.ops.megatron_cpu_rows.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`megatron_kernels.reference.apply_rotary_write_kv_cache` in one pass per token, the same bits."""
    if cache.fp8 or not (_float32_rows(q, k, v, cos, sin, cache.k, cache.v) and cos.is_contiguous()
                         and sin.is_contiguous() and built()):
        return reference.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, cache, slot_mapping)
    return torch.ops.megatron_cpu_rows.rotary_write_kv_cache(q, k, v, positions.long().contiguous(), cos, sin, cache.k,
                                                             cache.v, slot_mapping.long().contiguous())

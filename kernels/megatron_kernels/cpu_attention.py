"""Decode and prefill attention on a CPU that read the paged KV cache in place: C++ kernels, built on first use.

:func:`megatron_kernels.reference.paged_attention_decode` gathers each sequence's keys and values into a copy
and multiplies the copy, so a decode step moves the cache through memory three times; the kernel
(``csrc/paged_attention.cpp``) walks each sequence's block table and reads every key and value once
(the offline benchmark's figures are in docs/benchmarks.md). The reference's prefill gathers each sequence,
builds its causal mask and calls torch's flash kernel, a call per sequence and layer; the prefill kernel walks
the table the same way for a chunk of query rows. Each sequence is summed in an order fixed by its own context
alone (a prefill row's by its own position), so its row does not change with the batch around it, nor with
how its prompt was cut into chunks.

It is built on first use (:mod:`megatron_kernels.cpu_build`); where it cannot be, decode attention stays on the
reference. It serves float32 queries over a float32 cache; any other call (a 16-bit model's, an FP8 cache's
scales) goes to the reference.
"""

from __future__ import annotations

import torch

from . import cpu_build, reference
from .paged_kv import PagedKV

SOURCE = cpu_build.CSRC / "paged_attention.cpp"


def built() -> bool:
    """Whether the kernels are built and loaded here (``torch.ops.megatron_cpu.paged_attention_decode`` and
    ``paged_attention_prefill``)."""
    return cpu_build.built("paged_attention")


def _kernel_serves(q: torch.Tensor, cache: PagedKV, out: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: float32 queries and cache on the CPU, rows of contiguous values."""
    return (not cache.fp8 and q.device.type == "cpu"
            and q.dtype == cache.k.dtype == cache.v.dtype == torch.float32
            and q.stride(-1) == cache.k.stride(-1) == cache.v.stride(-1) == 1
            and (out is None or out.stride(-1) == 1))


def paged_attention_decode(q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`megatron_kernels.reference.paged_attention_decode` through the C++ kernel where it serves the call."""
    if not (_kernel_serves(q, cache, out) and built()):
        return reference.paged_attention_decode(q, cache, block_tables, context_lens, scale, out=out)
    result = torch.empty_like(q) if out is None else out
    torch.ops.megatron_cpu.paged_attention_decode(q, cache.k, cache.v, block_tables.to(torch.int32).contiguous(),
                                                  context_lens.to(torch.int32).contiguous(), scale, result)
    return result


def paged_attention_prefill(q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """:func:`megatron_kernels.reference.paged_attention_prefill` through the C++ kernel where it serves the call."""
    if not (_kernel_serves(q, cache, out) and built()):
        return reference.paged_attention_prefill(q, cache, block_tables, query_start_loc, context_lens, scale, out=out)
    result = torch.empty_like(q) if out is None else out
    torch.ops.megatron_cpu.paged_attention_prefill(q, cache.k, cache.v, block_tables.to(torch.int32).contiguous(),
                                                   query_start_loc.to(torch.int32).contiguous(),
                                                   context_lens.to(torch.int32).contiguous(), scale, result)
    return result

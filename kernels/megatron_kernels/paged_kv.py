"""One layer's paged KV cache as every cache op takes it: the keys, the values and an FP8 cache's scales.

The four tensors always travel together (the layout is in :mod:`megatron_kernels.reference`), so every cache
op of every backend takes them as one value, and what each op needs of them (the checks, the query rows fitted
to them, the strides and pointers a kernel takes) is written here once. It is a tuple, so a layer's cache as
the engine's pool holds it, ``(k, v)`` or ``(k, v, k_scales, v_scales)``, becomes one by ``PagedKV(*layer)``.
Only torch here: the reference and the CPU kernels take it without Triton installed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedKV(NamedTuple):
    """``k`` / ``v`` ``[num_blocks, block_size, num_kv_heads, head_dim]``; with an FP8 cache (``float8_e4m3fn``)
    ``k_scales`` / ``v_scales`` ``[num_blocks, block_size, num_kv_heads]`` float32, the cached value being
    ``fp8 * scale``. Without scales the cache holds plain values."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        """Whether the cache holds FP8 values with their scales."""
        return self.k_scales is not None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    def check(self) -> None:
        """Refuse a cache the kernels cannot read: the two caches of one 4-D shape with contiguous heads, and
        both scales or none, shaped ``[blocks, block_size, heads]`` in one layout."""
        k, v, k_scales, v_scales = self
        if k.shape != v.shape or k.dim() != 4:
            raise ValueError(f"k_cache {tuple(k.shape)} / v_cache {tuple(v.shape)}: want equal 4-D shapes")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("KV cache head_dim must be contiguous")
        if (k_scales is None) != (v_scales is None):
            raise ValueError("an FP8 KV cache needs both k_scales and v_scales")
        if k_scales is not None:
            if k_scales.shape != k.shape[:3] or v_scales.shape != k_scales.shape:
                raise ValueError(f"KV scales {tuple(k_scales.shape)} / {tuple(v_scales.shape)} do not fit cache "
                                 f"{tuple(k.shape)}: want [blocks, block_size, heads]")
            if k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1:
                raise ValueError("KV scales must share one layout with contiguous heads")

    def fit(self, q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention kernel's query rows ``[rows, heads, head_dim]`` checked against the cache: ``q`` with a
        contiguous last dimension, and where the output goes (``out``, checked, or a new tensor of ``q``'s shape)."""
        _, heads, head_dim = q.shape
        if self.k.shape[3] != head_dim or heads % self.kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(self.k.shape)}")
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.stride(-1) != 1:
            raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)} and a contiguous last "
                             "dimension")
        return q, out

    def block_strides(self) -> tuple[int, ...]:
        """The (block, slot, head) strides of the keys, then of the values: a kernel's cache parameters."""
        return (*self.k.stride()[:3], *self.v.stride()[:3])

    def scale_strides(self) -> tuple[int, int]:
        """(block, slot) strides of the FP8 scales (zeros for a plain cache, whose kernels never read them)."""
        return (0, 0) if self.k_scales is None else (self.k_scales.stride(0), self.k_scales.stride(1))

    def scales_or(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales as a kernel's pointer arguments: ``placeholder`` twice for a plain cache (never read)."""
        if self.k_scales is None:
            return placeholder, placeholder
        return self.k_scales, self.v_scales

"""KV-cache write: scatter this step's keys and values into their paged-cache slots, in Triton.

``store_to_cache`` is the shared device function; the rotary kernel calls it too when it fuses the
key rotation with the cache write. Into an FP8 cache, ``head_scales`` gives each (token, head) its
scale from the row's largest magnitude, ``store_to_cache`` divides by it on the way in and
``store_scales`` writes it beside the block (:mod:`megatron_kernels.fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import (fp8_native, interpreted, last_dim_contiguous, next_pow2, num_warps_for, rows_per_program,
                            to_e4m3)
from .fp8 import FP8_MAX, MIN_SCALE

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def store_to_cache(
    cache_ptr, vals, slots, heads, dims, mask,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr,
    scales=None,
    SOFTWARE_ROUNDING: tl.constexpr = False,
):
    """Store ``vals`` ``[T, H, D]`` at ``slots`` ``[T]`` (negative = skip), heads ``heads``, dims ``dims``;
    divided by ``scales`` ``[T, H]`` first when given (an FP8 cache, see ``to_e4m3``)."""
    valid = slots >= 0
    safe = tl.where(valid, slots, 0).to(tl.int64)
    block = safe // BLOCK_SIZE
    offset = safe % BLOCK_SIZE
    ptrs = (
        cache_ptr
        + (block * stride_cb + offset * stride_co)[:, None, None]
        + heads[None, :, None] * stride_ch
        + dims[None, None, :]
    )
    if scales is not None:
        vals = to_e4m3(tl.clamp(vals.to(tl.float32) / scales[:, :, None], -_FP8_MAX, _FP8_MAX), SOFTWARE_ROUNDING)
    tl.store(ptrs, vals.to(cache_ptr.dtype.element_ty), mask=mask & valid[:, None, None])


@triton.jit
def head_scales(amax):
    """FP8 cache scales ``[T, H]`` from each (token, head)'s largest magnitude (``fp8.quantize``'s rule)."""
    return tl.maximum(amax / _FP8_MAX, _MIN_SCALE)


@triton.jit
def abs_max(vals):
    """``[T, H]`` largest magnitude over the last dimension of ``vals`` ``[T, H, D]`` (masked lanes are 0)."""
    return tl.max(tl.abs(vals.to(tl.float32)), axis=2)


@triton.jit
def store_scales(
    scale_ptr, scales, slots, heads, mask,
    stride_sb, stride_so,
    BLOCK_SIZE: tl.constexpr,
):
    """Store the FP8 scales ``[T, H]`` of ``slots`` ``[T]`` (negative = skip); ``mask`` ``[T, H]``.
    Scale storage is ``[num_blocks, block_size, H]`` with contiguous heads."""
    valid = slots >= 0
    safe = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = scale_ptr + ((safe // BLOCK_SIZE) * stride_sb + (safe % BLOCK_SIZE) * stride_so)[:, None] + heads[None, :]
    tl.store(ptrs, scales, mask=mask & valid[:, None])


@triton.jit(do_not_specialize=["n_tokens"])
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    n_tokens, n_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    stride_sb, stride_so,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    tmask = tok < n_tokens
    mask = tmask[:, None, None] & (heads < n_heads)[None, :, None] & (dims < head_dim)[None, None, :]
    slots = tl.load(slot_ptr + tok, mask=tmask, other=-1)
    tok64 = tok.to(tl.int64)[:, None, None]
    k = tl.load(key_ptr + tok64 * stride_kt + heads[None, :, None] * stride_kh + dims[None, None, :], mask=mask,
                other=0.0)
    v = tl.load(value_ptr + tok64 * stride_vt + heads[None, :, None] * stride_vh + dims[None, None, :], mask=mask,
                other=0.0)
    if KV_FP8:
        head_mask = tmask[:, None] & (heads < n_heads)[None, :]
        k_scales = head_scales(abs_max(k))
        v_scales = head_scales(abs_max(v))
        store_scales(k_scale_ptr, k_scales, slots, heads, head_mask, stride_sb, stride_so, BLOCK_SIZE)
        store_scales(v_scale_ptr, v_scales, slots, heads, head_mask, stride_sb, stride_so, BLOCK_SIZE)
        store_to_cache(k_cache_ptr, k, slots, heads, dims, mask, stride_kcb, stride_kco, stride_kch, BLOCK_SIZE,
                       k_scales, SOFTWARE_ROUNDING)
        store_to_cache(v_cache_ptr, v, slots, heads, dims, mask, stride_vcb, stride_vco, stride_vch, BLOCK_SIZE,
                       v_scales, SOFTWARE_ROUNDING)
    else:
        store_to_cache(k_cache_ptr, k, slots, heads, dims, mask, stride_kcb, stride_kco, stride_kch, BLOCK_SIZE)
        store_to_cache(v_cache_ptr, v, slots, heads, dims, mask, stride_vcb, stride_vco, stride_vch, BLOCK_SIZE)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}: want equal 4-D shapes")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("an FP8 KV cache needs both k_scales and v_scales")
    if k_scales is not None:
        if k_scales.shape != k_cache.shape[:3] or v_scales.shape != k_scales.shape:
            raise ValueError(f"KV scales {tuple(k_scales.shape)} / {tuple(v_scales.shape)} do not fit cache "
                             f"{tuple(k_cache.shape)}: want [blocks, block_size, heads]")
        if k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1:
            raise ValueError("KV scales must share one layout with contiguous heads")


def fit_to_cache(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """An attention kernel's query rows ``[rows, heads, head_dim]`` checked against the cache
    ``[blocks, block_size, kv_heads, head_dim]``: ``q`` with a contiguous last dimension, where the output goes
    (``out``, checked, or a new tensor of ``q``'s shape), the cache's block size and KV heads."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)} and a contiguous last dimension")
    return q, out, block_size, kv_heads


def scale_strides(k_scales: torch.Tensor | None) -> tuple[int, int]:
    """(block, slot) strides of the FP8 scales (zeros for a plain cache, whose kernels never read them)."""
    return (0, 0) if k_scales is None else (k_scales.stride(0), k_scales.stride(1))


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Triton twin of :func:`megatron_kernels.reference.write_kv_cache` (in place, no host sync)."""
    check_cache(k_cache, v_cache, k_scales, v_scales)
    if k_scales is not None and not fp8_native(key.device):
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)
        return
    n_tokens, n_heads, head_dim = key.shape
    if n_tokens == 0:
        return
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    block_h, block_d = next_pow2(n_heads), next_pow2(head_dim)
    block_t = rows_per_program(key, block_h * block_d, n_tokens)
    fp8 = k_scales is not None
    _write_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, k_scales if fp8 else k_cache, v_scales if fp8 else v_cache,
        n_tokens, n_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides(k_scales),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        KV_FP8=fp8,
        SOFTWARE_ROUNDING=interpreted(key),
        num_warps=num_warps_for(block_t * block_h * block_d),
    )

"""KV-cache write: scatter this step's keys and values into their paged-cache slots, in Triton.

``store_to_cache`` is the shared device function, and ``write_heads`` (load a tensor's rows, store them)
writes both of this kernel's tensors and the rotary kernel's values when it fuses the key rotation with
the cache write. Into an FP8 cache, ``head_scales`` gives each (token, head) its scale from the row's
largest magnitude, ``store_to_cache`` divides by it on the way in and ``store_scales`` writes it beside
the block (:mod:`megatron_kernels.fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import (fp8_native, interpreted, last_dim_contiguous, next_pow2, num_warps_for, rows_per_program,
                            to_e4m3)
from .fp8 import FP8_MAX, MIN_SCALE
from .paged_kv import PagedKV

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


@triton.jit
def write_heads(
    x_ptr, tok, tmask, n_heads, head_dim, stride_xt, stride_xh,
    cache_ptr, slots, stride_cb, stride_co, stride_ch,
    scale_ptr, stride_sb, stride_so,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):
    """Load the rows ``[T, n_heads, head_dim]`` of the tokens ``tok`` (``tmask``) and store them at ``slots``
    (negative = skip); into an FP8 cache quantized, with one scale per token and head stored beside it."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = tmask[:, None] & (heads < n_heads)[None, :]
    mask = head_mask[:, :, None] & (dims < head_dim)[None, None, :]
    rows = tok.to(tl.int64)[:, None, None] * stride_xt + heads[None, :, None] * stride_xh + dims[None, None, :]
    x = tl.load(x_ptr + rows, mask=mask, other=0.0)
    if KV_FP8:
        scales = head_scales(abs_max(x))
        store_scales(scale_ptr, scales, slots, heads, head_mask, stride_sb, stride_so, BLOCK_SIZE)
        store_to_cache(cache_ptr, x, slots, heads, dims, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE, scales,
                       SOFTWARE_ROUNDING)
    else:
        store_to_cache(cache_ptr, x, slots, heads, dims, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)


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
    tmask = tok < n_tokens
    slots = tl.load(slot_ptr + tok, mask=tmask, other=-1)
    write_heads(key_ptr, tok, tmask, n_heads, head_dim, stride_kt, stride_kh,
                k_cache_ptr, slots, stride_kcb, stride_kco, stride_kch, k_scale_ptr, stride_sb, stride_so,
                BLOCK_H, BLOCK_D, BLOCK_SIZE, KV_FP8, SOFTWARE_ROUNDING)
    write_heads(value_ptr, tok, tmask, n_heads, head_dim, stride_vt, stride_vh,
                v_cache_ptr, slots, stride_vcb, stride_vco, stride_vch, v_scale_ptr, stride_sb, stride_so,
                BLOCK_H, BLOCK_D, BLOCK_SIZE, KV_FP8, SOFTWARE_ROUNDING)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Triton twin of :func:`megatron_kernels.reference.write_kv_cache` (in place, no host sync)."""
    cache.check()
    if cache.fp8 and not fp8_native(key.device):
        reference.write_kv_cache(key, value, cache, slot_mapping)
        return
    n_tokens, n_heads, head_dim = key.shape
    if n_tokens == 0:
        return
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    block_h, block_d = next_pow2(n_heads), next_pow2(head_dim)
    block_t = rows_per_program(key, block_h * block_d, n_tokens)
    _write_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        key, value, cache.k, cache.v, slot_mapping, *cache.scales_or(cache.k),
        n_tokens, n_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache.block_strides(),
        *cache.scale_strides(),
        BLOCK_SIZE=cache.block_size,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        KV_FP8=cache.fp8,
        SOFTWARE_ROUNDING=interpreted(key),
        num_warps=num_warps_for(block_t * block_h * block_d),
    )

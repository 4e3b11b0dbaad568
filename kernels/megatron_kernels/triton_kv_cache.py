"""KV-cache write: scatter this step's keys and values into their paged-cache slots, in Triton.

``store_to_cache`` is the shared device function; the rotary kernel calls it too when it fuses the
key rotation with the cache write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import last_dim_contiguous, next_pow2, num_warps_for, rows_per_program


@triton.jit
def store_to_cache(
    cache_ptr, vals, slots, heads, dims, mask,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """Store ``vals`` ``[T, H, D]`` at ``slots`` ``[T]`` (negative = skip), heads ``heads``, dims ``dims``."""
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
    tl.store(ptrs, vals.to(cache_ptr.dtype.element_ty), mask=mask & valid[:, None, None])


@triton.jit(do_not_specialize=["n_tokens"])
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    n_tokens, n_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    tmask = tok < n_tokens
    mask = tmask[:, None, None] & (heads < n_heads)[None, :, None] & (dims < head_dim)[None, None, :]
    slots = tl.load(slot_ptr + tok, mask=tmask, other=-1)
    tok64 = tok.to(tl.int64)[:, None, None]
    k = tl.load(key_ptr + tok64 * stride_kt + heads[None, :, None] * stride_kh + dims[None, None, :], mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + heads[None, :, None] * stride_vh + dims[None, None, :], mask=mask)
    store_to_cache(k_cache_ptr, k, slots, heads, dims, mask, stride_kcb, stride_kco, stride_kch, BLOCK_SIZE)
    store_to_cache(v_cache_ptr, v, slots, heads, dims, mask, stride_vcb, stride_vco, stride_vch, BLOCK_SIZE)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}: want equal 4-D shapes")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton twin of :func:`megatron_kernels.reference.write_kv_cache` (in place, no host sync)."""
    check_cache(k_cache, v_cache)
    n_tokens, n_heads, head_dim = key.shape
    if n_tokens == 0:
        return
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    block_h, block_d = next_pow2(n_heads), next_pow2(head_dim)
    block_t = rows_per_program(key, block_h * block_d, n_tokens)
    _write_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping,
        n_tokens, n_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=num_warps_for(block_t * block_h * block_d),
    )

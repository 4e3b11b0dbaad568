"""Rotary position embedding (Hugging Face rotate-half form) in Triton, optionally fused with the KV write.

``apply_rotary`` keeps the reference API. ``apply_rotary_write_kv_cache`` rotates ``q`` and ``k`` and, in
the same pass, scatters the rotated keys and the values into the paged cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import fp8_native, interpreted, last_dim_contiguous, next_pow2, num_warps_for, rows_per_program
from .paged_kv import PagedKV
from .triton_kv_cache import abs_max, head_scales, store_scales, store_to_cache, write_heads


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, tok, tmask, cos, sin, n_heads,
    stride_xt, stride_xh, stride_ot, stride_oh,
    cache_ptr, slots, stride_cb, stride_co, stride_ch,
    scale_ptr, stride_sb, stride_so,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):
    """Rotate heads ``[BLOCK_T, n_heads, HEAD_DIM]`` of the tokens ``tok``; store them (and into the cache,
    quantized with one scale per token and head when ``KV_FP8``)."""
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    tok64 = tok.to(tl.int64)[:, None, None]
    hmask = tmask[:, None, None] & (heads < n_heads)[None, :, None]
    mask = hmask & (j < HALF)[None, None, :]
    src = x_ptr + tok64 * stride_xt + heads[None, :, None] * stride_xh + j[None, None, :]
    dst = out_ptr + tok64 * stride_ot + heads[None, :, None] * stride_oh + j[None, None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :].to(tl.float32)
    s = sin[:, None, :].to(tl.float32)
    # each product rounded to the tables' dtype, as the reference computes in it (a no-op for float32 tables)
    o1 = ((x1 * c).to(cos.dtype).to(tl.float32) - (x2 * s).to(cos.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
    o2 = ((x2 * c).to(cos.dtype).to(tl.float32) + (x1 * s).to(cos.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    if BLOCK_REST > 0:
        # Partial rotary: dims past 2 * HALF pass through unchanged.
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        rmask = hmask & (r < HEAD_DIM)[None, None, :]
        rest = tl.load(x_ptr + tok64 * stride_xt + heads[None, :, None] * stride_xh + r[None, None, :], mask=rmask,
                       other=0.0)
        rest = rest.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok64 * stride_ot + heads[None, :, None] * stride_oh + r[None, None, :], rest, mask=rmask)
    if WRITE_CACHE:
        if KV_FP8:
            amax = tl.maximum(abs_max(o1), abs_max(o2))
            if BLOCK_REST > 0:
                amax = tl.maximum(amax, abs_max(rest))
            scales = head_scales(amax)
            store_scales(scale_ptr, scales, slots, heads, tmask[:, None] & (heads < n_heads)[None, :],
                         stride_sb, stride_so, BLOCK_SIZE)
            store_to_cache(cache_ptr, o1, slots, heads, j, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE, scales,
                           SOFTWARE_ROUNDING)
            store_to_cache(cache_ptr, o2, slots, heads, j + HALF, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE,
                           scales, SOFTWARE_ROUNDING)
            if BLOCK_REST > 0:
                store_to_cache(cache_ptr, rest, slots, heads, r, rmask, stride_cb, stride_co, stride_ch, BLOCK_SIZE,
                               scales, SOFTWARE_ROUNDING)
        else:
            store_to_cache(cache_ptr, o1, slots, heads, j, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
            store_to_cache(cache_ptr, o2, slots, heads, j + HALF, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
            if BLOCK_REST > 0:
                store_to_cache(cache_ptr, rest, slots, heads, r, rmask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)


# Positions and slots of a micro-batch are slices of the step's at any row: no variant per address alignment.
@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    n_tokens, n_q_heads, n_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cos, stride_sin,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    stride_sb, stride_so,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    j = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    cs_mask = tmask[:, None] & (j < HALF)[None, :]
    cos = tl.load(cos_ptr + pos[:, None] * stride_cos + j[None, :], mask=cs_mask, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * stride_sin + j[None, :], mask=cs_mask, other=0.0)
    if WRITE_CACHE:
        slots = tl.load(slot_ptr + tok, mask=tmask, other=-1)
    else:
        slots = tok
    _rotate_heads(
        q_ptr, q_out_ptr, tok, tmask, cos, sin, n_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
        k_cache_ptr, slots, stride_kcb, stride_kco, stride_kch, k_scale_ptr, stride_sb, stride_so,
        HALF, HEAD_DIM, BLOCK_HQ, BLOCK_HALF, BLOCK_REST, False, BLOCK_SIZE, False, SOFTWARE_ROUNDING,
    )
    _rotate_heads(
        k_ptr, k_out_ptr, tok, tmask, cos, sin, n_kv_heads, stride_kt, stride_kh, stride_kot, stride_koh,
        k_cache_ptr, slots, stride_kcb, stride_kco, stride_kch, k_scale_ptr, stride_sb, stride_so,
        HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF, BLOCK_REST, WRITE_CACHE, BLOCK_SIZE, KV_FP8, SOFTWARE_ROUNDING,
    )
    if WRITE_CACHE:
        write_heads(v_ptr, tok, tmask, n_kv_heads, HEAD_DIM, stride_vt, stride_vh,
                    v_cache_ptr, slots, stride_vcb, stride_vco, stride_vch, v_scale_ptr, stride_sb, stride_so,
                    BLOCK_HK, BLOCK_D, BLOCK_SIZE, KV_FP8, SOFTWARE_ROUNDING)


def _rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            v: torch.Tensor | None = None, cache: PagedKV | None = None, slot_mapping: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k``; with ``cache`` also write the rotated keys and ``v`` at ``slot_mapping``."""
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    if k.shape[0] != n_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    half = cos.shape[-1]
    if sin.shape[-1] != half or 2 * half > head_dim:
        raise ValueError(f"cos/sin width {half} does not fit head_dim {head_dim}")
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)
    positions = positions.contiguous()
    q_out = torch.empty((n_tokens, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n_tokens, n_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    write_cache = cache is not None
    if write_cache:
        cache.check()
        v = last_dim_contiguous(v)
        slot_mapping = slot_mapping.contiguous()
    else:
        v, cache, slot_mapping = k, PagedKV(k_out, k_out), positions  # placeholders, never touched
    if n_tokens == 0:
        return q_out, k_out
    block_hq, block_hk = next_pow2(n_q_heads), next_pow2(n_kv_heads)
    block_half, block_d = next_pow2(half), next_pow2(head_dim)
    rest = head_dim - 2 * half
    block_t = rows_per_program(q, (block_hq + block_hk) * block_d, n_tokens)
    _rotary_kernel[(triton.cdiv(n_tokens, block_t),)](
        q, k, v, positions, cos, sin, q_out, k_out,
        cache.k, cache.v, slot_mapping, *cache.scales_or(cache.k),
        n_tokens, n_q_heads, n_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        *(cache.block_strides() if write_cache else (0,) * 6),
        *cache.scale_strides(),
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        BLOCK_REST=next_pow2(rest) if rest else 0,
        BLOCK_D=block_d,
        WRITE_CACHE=write_cache,
        BLOCK_SIZE=cache.block_size if write_cache else 1,
        KV_FP8=cache.fp8,
        SOFTWARE_ROUNDING=interpreted(q),
        num_warps=num_warps_for(block_t * (block_hq + block_hk) * block_d),
        # each product rounded before the sum, as the reference: fused into one FMA, a GPU skipped the rounding
        # (1 ulp off the reference in bfloat16 and float16 on an H200)
        enable_fp_fusion=False,
    )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`megatron_kernels.reference.apply_rotary`."""
    return _rotary(q, k, positions, cos, sin)


def apply_rotary_write_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    cache: PagedKV, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` and write the rotated keys and ``v`` into the cache in one kernel (into an FP8
    cache quantized: see :mod:`megatron_kernels.reference`)."""
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if cache.fp8 and not fp8_native(q.device):
        return reference.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, cache, slot_mapping)
    return _rotary(q, k, positions, cos, sin, v, cache, slot_mapping)

"""What the decode and prefill attention kernels share: the online-softmax pass over a range of one
sequence's paged keys, and the stride and constant arguments their launches pass to it.

``attend`` is a ``@triton.jit`` function that both kernels call (Triton inlines it), so a change to how a
tile of keys is read, scaled or accumulated is made once for both. An FP8 cache (``KV_FP8``) is read as
e4m3 and widened in registers; each key's scale multiplies its column of ``q @ K^T`` and each value's
scale its column of ``P`` before ``P @ V``: attention over the dequantized cache at half the bytes read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import dot_width, interpreted
from .paged_kv import PagedKV

LOG2E = 1.4426950408889634


@triton.jit
def attend(
    acc, l_i, m_i, q, q_pos, lo, hi, qk_scale, d, d_mask, kv_head,
    block_tables_ptr, seq, stride_bt, cache,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_END: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online-softmax accumulation of sequence ``seq``'s keys ``[lo, hi)`` of KV head ``kv_head`` into
    ``(acc, l_i, m_i)``, in tiles of ``BLOCK_N`` from ``lo``.

    The masks are compile-time choices, so a tile that needs none costs none: ``MASK_END`` hides the keys
    at or past ``hi`` (a range that does not end on a tile), ``CAUSAL`` those too and every key after
    its row's query position ``q_pos``. Each row must see a key in the first tile it reads (its
    running maximum stays finite).

    ``cache``: the kernel's cache arguments as one tuple, ``(k_cache_ptr, stride_kb, stride_ko, stride_kh,
    v_cache_ptr, stride_vb, stride_vo, stride_vh, k_scale_ptr, v_scale_ptr, stride_sb, stride_so)`` (the
    caches' block, slot and head strides, the FP8 scales' block and slot strides)."""
    (k_cache_ptr, stride_kb, stride_ko, stride_kh, v_cache_ptr, stride_vb, stride_vo, stride_vh,
     k_scale_ptr, v_scale_ptr, stride_sb, stride_so) = cache
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + (block * stride_kb + offset * stride_ko)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * qk_scale
        if KV_FP8:
            slot_scales = block * stride_sb + offset * stride_so + kv_head
            s = s * tl.load(k_scale_ptr + slot_scales, mask=n_mask, other=0.0)[None, :]
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif MASK_END:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + (block * stride_vb + offset * stride_vo)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pv = p
        if KV_FP8:
            pv = p * tl.load(v_scale_ptr + slot_scales, mask=n_mask, other=0.0)[None, :]
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, l_i, m_i


def attention_strides(q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, out: torch.Tensor
                      ) -> tuple[int, ...]:
    """The strides an attention kernel takes, in its parameters' order: the query rows and heads, each
    cache's (block, slot, head), the block table's row, the output rows and heads, the FP8 scales' (block, slot)."""
    return (q.stride(0), q.stride(1), *cache.block_strides(), block_tables.stride(0), out.stride(0), out.stride(1),
            *cache.scale_strides())


def attend_constants(q: torch.Tensor, cache: PagedKV, block_n: int) -> dict[str, int | bool]:
    """The constexprs both kernels pass on to :func:`attend`, by name: the head's width and its ``tl.dot`` tile,
    the cache's block size and FP8-ness, the key tile, and whether the dots run in float32 (under the
    interpreter, or a float32 model)."""
    head_dim = q.shape[-1]
    return dict(HEAD_DIM=head_dim, BLOCK_D=dot_width(head_dim), BLOCK_SIZE=cache.block_size, BLOCK_N=block_n,
                FP32_DOT=interpreted(q) or q.dtype == torch.float32, KV_FP8=cache.fp8)

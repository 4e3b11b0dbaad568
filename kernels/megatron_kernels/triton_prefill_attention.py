"""Paged attention for prefill and chunked prefill over cached blocks, in Triton.

Queries of all sequences are packed (varlen, ``query_start_loc``); each sequence's queries are the last
``q_len`` positions of its ``context_len`` cached tokens, and attention is causal. One program serves
one tile of ``BLOCK_Q`` queries of one sequence times the ``GROUP`` query heads of one KV head: the
tile's rows are (query, head) pairs, so each K/V tile is read once for the whole GQA group. Programs
find their sequence by binary search over ``query_start_loc``; the grid is a shape-only upper bound
(``num_tokens // BLOCK_Q + num_seqs`` tiles), so no host sync is needed. Key tiles below the tile's
first query position skip the causal mask; only the diagonal tiles apply it. The pass over the keys is
:func:`megatron_kernels.triton_paged_attention.attend`, the decode kernel's too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import fp8_native, interpreted, last_dim_contiguous, next_pow2
from .paged_kv import PagedKV
from .triton_paged_attention import LOG2E, attend, attend_constants, attention_strides


# The step's metadata arrives as slices that start past its decode rows (``seq_lens[num_decode:]``): their address
# is a multiple of 16 bytes or not with the decode count, and Triton would compile a variant for each (a mixed
# step's first odd decode count compiled one mid-serving on an H200). Scalar loads gain nothing from it.
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "context_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale, num_seqs, search_steps,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    stride_sb, stride_so,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence of this tile: the last i with query_start_loc[i] // BLOCK_Q + i <= tile. Those starts
    # strictly increase and leave each sequence at least cdiv(q_len, BLOCK_Q) tiles.
    lo = num_seqs * 0
    hi = num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = tile - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len  # cached tokens before this chunk's first query

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q_block * BLOCK_Q + rows // BLOCK_G
    g = rows % BLOCK_G
    heads = kv_head * GROUP + g
    row_mask = (q_idx < q_len) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = prefix + q_idx

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
    first_pos = prefix + q_block * BLOCK_Q
    # Keys at or before the tile's first query are visible to every row: no causal mask there.
    full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    kv_hi = tl.minimum(context_len, first_pos + BLOCK_Q)
    cache = (k_cache_ptr, stride_kb, stride_ko, stride_kh, v_cache_ptr, stride_vb, stride_vo, stride_vh,
             k_scale_ptr, v_scale_ptr, stride_sb, stride_so)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, q_pos, 0, full_hi, qk_scale, d, d_mask, kv_head, block_tables_ptr, seq,
                           stride_bt, cache, BLOCK_SIZE, BLOCK_N, False, False, FP32_DOT, KV_FP8)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, q_pos, full_hi, kv_hi, qk_scale, d, d_mask, kv_head, block_tables_ptr,
                           seq, stride_bt, cache, BLOCK_SIZE, BLOCK_N, False, True, FP32_DOT, KV_FP8)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(
    q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None, block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference.paged_attention_prefill`.

    ``block_m`` (rows = queries x padded group heads) and ``block_n`` (keys) override the tile heuristics;
    ``out``: where to write the result (rows of a persistent buffer), a new tensor when None.
    """
    cache.check()
    if cache.fp8 and not fp8_native(q.device):
        return reference.paged_attention_prefill(q, cache, block_tables, query_start_loc, context_lens, scale,
                                                 out=out)
    q, out = cache.fit(q, out)
    num_kv_heads = cache.kv_heads
    num_tokens, num_q_heads, head_dim = q.shape
    block_tables = last_dim_contiguous(block_tables)
    query_start_loc, context_lens = query_start_loc.contiguous(), context_lens.contiguous()
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = next_pow2(group)
    cpu = interpreted(q)
    # Long prompts have tiles enough to fill the GPU with the larger, more efficient 128-row tile.
    large = not cpu and num_tokens * num_kv_heads >= 4096 and head_dim <= 128
    if block_m is None:
        block_m = 128 if cpu or large else 64
    if block_n is None:
        block_n = 128 if cpu else (64 if head_dim <= 128 else 32)
    block_m = max(block_m, block_g, 16)
    block_q = block_m // block_g
    num_tiles = num_tokens // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, cache.k, cache.v, block_tables, query_start_loc, context_lens, out, *cache.scales_or(out),
        float(scale) * LOG2E, num_seqs, max(num_seqs - 1, 1).bit_length(),
        *attention_strides(q, cache, block_tables, out),
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        **attend_constants(q, cache, block_n),
        num_warps=8 if block_m >= 128 and not cpu else 4,
        num_stages=1 if q.dtype == torch.float32 else 2,  # fp32 tiles would need twice the shared memory
    )
    return out

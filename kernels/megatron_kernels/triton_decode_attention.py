"""Paged attention for decode (one query token per sequence) in Triton, with split-K (flash-decoding).

One program serves one (sequence, KV head, split): the ``GROUP`` query heads that share the KV head are
the rows of one ``tl.dot`` (padded to 16), so each K/V tile is read once for the whole group. A split
covers an equal share of its own sequence's context, so the grid depends on shapes only (no host sync,
CUDA-graph friendly). With more than one split, partial outputs and their log-sum-exp are combined by a
second small kernel. The pass over the keys is :func:`megatron_kernels.triton_paged_attention.attend`,
the prefill kernel's too (an FP8 cache is read there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import dot_width, fp8_native, interpreted, last_dim_contiguous, next_pow2, sm_count
from .paged_kv import PagedKV
from .triton_paged_attention import LOG2E, attend, attend_constants, attention_strides

_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32


# A micro-batch's decode rows are slices of the step's metadata at any row (engine.micro_batches): no variant per
# address alignment (see the prefill kernel).
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,
    stride_qs, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    stride_sb, stride_so,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    context_len = tl.load(context_lens_ptr + seq)
    if NUM_SPLITS == 1:
        start = 0
        end = context_len
    else:
        per_split = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, context_len)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    cache = (k_cache_ptr, stride_kb, stride_ko, stride_kh, v_cache_ptr, stride_vb, stride_vo, stride_vh,
             k_scale_ptr, v_scale_ptr, stride_sb, stride_so)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, 0, start, end, qk_scale, d, d_mask, kv_head, block_tables_ptr, seq,
                           stride_bt, cache, BLOCK_SIZE, BLOCK_N, True, False, FP32_DOT, KV_FP8)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are [S, Hq, NUM_SPLITS, HEAD_DIM] and [S, Hq, NUM_SPLITS], contiguous, fp32.
        row = (seq * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + d[None, :], out, mask=out_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row0 + sp, mask=sp_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    parts = tl.load(part_out_ptr + (row0 + sp)[:, None].to(tl.int64) * HEAD_DIM + d[None, :],
                    mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def split_count(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    """Split count from shapes alone: fill the GPU (``sms`` multiprocessors) when sequences x KV heads are too
    few to. A power of two: few kernel variants to compile (the engine compiles each at start-up)."""
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * sms, max(programs, 1))
    worth = triton.cdiv(max_context, max(_MIN_TOKENS_PER_SPLIT, block_n))
    splits = max(1, min(want, worth, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_block_n(q: torch.Tensor) -> int:
    return 128 if interpreted(q) else 64


def paged_attention_decode(
    q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference.paged_attention_decode`.

    ``num_splits`` / ``block_n`` override the launch heuristics (tests use them to cover split-K);
    ``out``: where to write the result (rows of a persistent buffer), a new tensor when None.
    """
    cache.check()
    if cache.fp8 and not fp8_native(q.device):
        return reference.paged_attention_decode(q, cache, block_tables, context_lens, scale, out=out)
    q, out = cache.fit(q, out)
    block_size, num_kv_heads = cache.block_size, cache.kv_heads
    num_seqs, num_q_heads, head_dim = q.shape
    block_tables, context_lens = last_dim_contiguous(block_tables), context_lens.contiguous()
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    cpu = interpreted(q)
    if block_n is None:
        block_n = decode_block_n(q)
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = 1 if cpu else split_count(num_seqs, num_kv_heads, max_context, block_n, sm_count(q.device))
    block_d = dot_width(head_dim)
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, cache.k, cache.v, block_tables, context_lens,
        out, part_out, part_lse, *cache.scales_or(out),
        float(scale) * LOG2E,
        *attention_strides(q, cache, block_tables, out),
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        NUM_SPLITS=num_splits,
        **attend_constants(q, cache, block_n),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _combine_kernel[(num_seqs, num_q_heads)](
            part_out, part_lse, out,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=next_pow2(num_splits),
            num_warps=4 if block_d * num_splits >= 2048 else 1,
        )
    return out


"""Batch-invariant paged attention in Triton: the GPU side of ``--batch-invariant``'s attention.

One program per (query row, query head), a row's heads side by side in the grid (the query heads
that share a KV head read its keys one after another, from L2). A program finds its row's position
and block-table row in the step's metadata as the engine left it on the device (a decode row: its
sequence's length; a prefill row: its chunk by binary search over the chunks' starts, then the
chunk's length and offset), so the engine runs no PyTorch op per layer for it. It reduces keys
``0..position`` in blocks of :data:`KEY_BLOCK` keys from key 0, one block after another, with an
online softmax in float32 (``exp2``, the scale folded with ``log2 e``). Nothing in a program depends
on the other rows of the launch: tile shapes and warps come from the head size and :data:`KEY_BLOCK`
alone (more rows only add programs), and a row's loop runs over its own position. A decode row, a
prefill row, a chunked-prefill row and a row after a prefix-cache hit at the same position over the
same keys therefore compute the same bits, in a launch of one row or of thousands. No value is read
back to the host, so the launch can be captured in a CUDA graph.

The CPU mode keeps :func:`megatron_kernels.invariant_attention.attention` (MKL GEMMs per key block). The two
order the head-dimension dot product differently and agree to float32 rounding, not bit for bit: a
trainer gets the engine's bits on the same kind of device only (:func:`dense_attention` is this
kernel over a trainer's unpaged K/V). :func:`reference_attention` is the PyTorch twin (same block
order, same online-softmax steps) the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import fp8_native, last_dim_contiguous, next_pow2
from .paged_kv import PagedKV

KEY_BLOCK = 32
"""Keys per block of the online softmax, for every row and every launch (the CPU mode's block too)."""

DENSE_PAGE = 64
"""Page size of the paged view :func:`dense_attention` builds over a trainer's K/V: the engine's CUDA
default (``block_size_tokens``), so the trainer runs the very kernel binary the engine runs (the page
size only moves addresses, never the arithmetic)."""

NUM_WARPS = 4
"""Warps per program, fixed: a reduction's tree follows the layout, so it must not follow the batch."""

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_decode", "num_chunks", "search_steps", "stride_dt", "stride_pt"])
def _invariant_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, decode_tables_ptr, decode_lens_ptr, prefill_tables_ptr, starts_ptr,
    prefill_lens_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_decode, num_chunks, search_steps,
    stride_qr, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_dt, stride_pt,
    stride_or, stride_oh,
    stride_sb, stride_so,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    program = tl.program_id(0)  # the heads of a row are neighbours: a KV head's GROUP readers run together
    row = program // NUM_HEADS
    head = program % NUM_HEADS
    kv_head = head // GROUP
    if row < num_decode:  # a decode row: its sequence's length includes it
        table = decode_tables_ptr + row.to(tl.int64) * stride_dt
        position = tl.load(decode_lens_ptr + row).to(tl.int32) - 1  # keys 0..position; negative: padding
    else:  # a prefill row: its chunk is the last one starting at or before it
        index = row - num_decode
        lo = num_chunks * 0
        hi = num_chunks - 1
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            ok = tl.load(starts_ptr + mid) <= index
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        start = tl.load(starts_ptr + lo)
        count = tl.load(starts_ptr + lo + 1) - start
        position = (tl.load(prefill_lens_ptr + lo) - count + index - start).to(tl.int32)
        table = prefill_tables_ptr + lo.to(tl.int64) * stride_pt

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qr + head * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([KEY_BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([KEY_BLOCK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for key_start in range(0, position + 1, KEY_BLOCK):
        n = key_start + tl.arange(0, KEY_BLOCK)
        n_mask = n <= position
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + (block * stride_kb + offset * stride_ko)[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_base + (block * stride_vb + offset * stride_vo)[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        if KV_FP8:  # attention over the dequantized cache, as the CPU mode gathers it
            slot_scales = block * stride_sb + offset * stride_so + kv_head
            k = k * tl.load(k_scale_ptr + slot_scales, mask=n_mask, other=0.0)[:, None]
            v = v * tl.load(v_scale_ptr + slot_scales, mask=n_mask, other=0.0)[:, None]
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: a block's first key is always visible
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)  # a padding row (no key) writes zeros
    tl.store(out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def _launch(q: torch.Tensor, cache: PagedKV, out: torch.Tensor | None, scale: float,
            decode: tuple[torch.Tensor, torch.Tensor] | None, prefill: tuple[torch.Tensor, ...] | None,
            key_block: int) -> torch.Tensor:
    """One launch over ``q``'s rows: ``decode`` (tables, lengths) rows first, then ``prefill`` (tables, chunk
    starts ``[P + 1]``, lengths) chunks; either may be ``None``."""
    cache.check()
    if cache.fp8 and not fp8_native(q.device):
        raise NotImplementedError("an FP8 cache needs compute capability 8.9 for the invariant attention kernel")
    q, out = cache.fit(q, out)
    rows, heads, head_dim = q.shape
    if rows == 0:
        return out
    decode_tables, decode_lens = decode if decode is not None else (None, None)
    prefill_tables, starts, prefill_lens = prefill if prefill is not None else (None, None, None)
    decode_tables = last_dim_contiguous(decode_tables if decode_tables is not None else prefill_tables)
    prefill_tables = last_dim_contiguous(prefill_tables if prefill_tables is not None else decode_tables)
    num_decode = 0 if decode is None else decode_lens.shape[0]
    num_chunks = 0 if prefill is None else prefill_lens.shape[0]
    _invariant_attention_kernel[(rows * heads,)](
        q, cache.k, cache.v, decode_tables, decode_lens if decode is not None else prefill_lens,
        prefill_tables, starts if prefill is not None else decode_lens,
        prefill_lens if prefill is not None else decode_lens, out, *cache.scales_or(out),
        float(scale) * _LOG2E, num_decode, num_chunks, max(num_chunks - 1, 0).bit_length(),
        q.stride(0), q.stride(1),
        *cache.block_strides(),
        decode_tables.stride(0), prefill_tables.stride(0),
        out.stride(0), out.stride(1),
        *cache.scale_strides(),
        NUM_HEADS=heads, GROUP=heads // cache.kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_SIZE=cache.block_size, KEY_BLOCK=key_block, KV_FP8=cache.fp8, num_warps=NUM_WARPS,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    sequence: torch.Tensor, positions: torch.Tensor, scale: float, *,
                    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, key_block: int = KEY_BLOCK) -> torch.Tensor:
    """Causal attention of ``q`` ``[R, Hq, D]`` over a paged cache ``[blocks, block_size, Hkv, D]``.

    Row ``r`` reads the sequence ``sequence[r]`` (a row of ``block_tables``) up to key ``positions[r]``
    (negative: no key, zeros out): each row is launched as a decode row of its own (its table row
    gathered, its length ``position + 1``), the arithmetic every row of :func:`attend_step` meets.
    ``out`` gets the result in ``q``'s dtype. ``key_block`` exists for the tests' negative control only:
    a block that changes with the launch (split-K, a block per chunk) changes the bits, which is what the
    fixed :data:`KEY_BLOCK` prevents.
    """
    tables = block_tables[sequence]
    lens = (positions + 1).to(torch.int32)
    return _launch(q, PagedKV(k_cache, v_cache, k_scales, v_scales), out, scale, (tables, lens), None, key_block)


def attend_step(q: torch.Tensor, meta, cache: PagedKV, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The engine's step (``meta``: its ``AttentionMetadata``), every row of ``q`` into ``out`` in one launch:
    the kernel reads the decode lengths, the chunks' starts and lengths and the block tables as the step
    left them on the device (no PyTorch op per layer, nothing read back: capturable)."""
    count = meta.num_decode_tokens
    decode = (meta.decode_block_tables, meta.decode_context_lens[:count]) if count else None
    prefill = None
    if meta.prefill_block_tables is not None and q.shape[0] > meta.num_decode_tokens:
        prefill = (meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_context_lens)
    return _launch(q, cache, out, scale, decode, prefill, KEY_BLOCK)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel over unpaged K/V (a trainer's): ``keys``/``values`` ``[S, Hkv, L, D]`` (``transformers``'
    layout) are copied into pages of :data:`DENSE_PAGE` keys behind an identity block table, so a row meets
    the engine's launch (same constants, same compiled kernel for the same head size and dtype).
    Differentiable: the backward is plain softmax attention's (gradients need no batch invariance)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values)):
        return _DenseAttention.apply(q, keys, values, sequence, positions, scale)
    return _dense_forward(q, keys, values, sequence, positions, scale)


def _dense_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
                   positions: torch.Tensor, scale: float) -> torch.Tensor:
    count, kv_heads, length, dim = keys.shape
    pages = -(-length // DENSE_PAGE)

    def paged(cache: torch.Tensor) -> torch.Tensor:
        out = cache.new_zeros((count, pages * DENSE_PAGE, kv_heads, dim))
        out[:, :length] = cache.transpose(1, 2)
        return out.view(count * pages, DENSE_PAGE, kv_heads, dim)

    table = torch.arange(count * pages, dtype=torch.int32, device=q.device).view(count, pages)
    return paged_attention(q, paged(keys), paged(values), table, sequence, positions, scale)


class _DenseAttention(torch.autograd.Function):
    """The kernel forward; the backward of plain causal softmax attention, recomputed in float32."""

    @staticmethod
    def forward(ctx, q, keys, values, sequence, positions, scale):
        ctx.save_for_backward(q, keys, values, sequence, positions)
        ctx.scale = scale
        return _dense_forward(q, keys, values, sequence, positions, scale)

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, sequence, positions = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, keys, values)]
            out = plain_attention(*inputs, sequence, positions, ctx.scale)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None)


def plain_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention by the textbook (float32, one softmax over all keys): ``q`` ``[R, Hq, D]``,
    ``keys``/``values`` ``[S, Hkv, L, D]``. The tests' yardstick and the trainer's backward."""
    rows, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.float()[sequence].repeat_interleave(group, 1)  # [R, Hq, L, D]
    v = values.float()[sequence].repeat_interleave(group, 1)
    scores = torch.einsum("rhd,rhld->rhl", q.float(), k) * scale
    visible = torch.arange(keys.shape[2], device=q.device) <= positions[:, None, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("rhl,rhld->rhd", weights, v).to(q.dtype)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        sequence: torch.Tensor, positions: torch.Tensor, scale: float,
                        key_block: int = KEY_BLOCK) -> torch.Tensor:
    """PyTorch twin of :func:`paged_attention`: the same blocks in the same order, the same online-softmax
    steps (``exp2``, running maximum, rescaled sum and accumulator), all rows at once. A block past a row's
    position changes nothing (its weights are exact zeros, its rescale exactly 1). Close to the kernel to
    float32 rounding (the head-dimension sums are ordered differently), not bit for bit."""
    rows, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q32 = q.float().view(rows, kv_heads, group, dim)
    qk_scale = float(scale) * _LOG2E
    m = torch.full((rows, kv_heads, group), float("-inf"), device=q.device)
    total = torch.zeros_like(m)
    acc = torch.zeros((rows, kv_heads, group, dim), device=q.device)
    tables = block_tables.long()[sequence]
    last = int(positions.max()) if rows else -1
    for start in range(0, last + 1, key_block):
        n = torch.arange(start, start + key_block, device=q.device)
        visible = n[None, :] <= positions[:, None]  # [R, KB]
        slots = tables.gather(1, (n // block_size).clamp_max(tables.shape[1] - 1).expand(rows, -1))
        k = k_cache[slots, n % block_size].float().permute(0, 2, 1, 3)  # [R, Hkv, KB, D]
        v = v_cache[slots, n % block_size].float().permute(0, 2, 1, 3)
        k = torch.where(visible[:, None, :, None], k, 0.0)
        v = torch.where(visible[:, None, :, None], v, 0.0)
        s = (q32[:, :, :, None, :] * k[:, :, None]).sum(-1) * qk_scale  # [R, Hkv, G, KB]
        s = torch.where(visible[:, None, None, :], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alive = m_new > float("-inf")  # rows with no visible key yet keep their zeros
        alpha = torch.where(alive, torch.exp2(m - m_new), 1.0)
        p = torch.where(alive[..., None], torch.exp2(s - m_new[..., None]), 0.0)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[..., None] * v[:, :, None]).sum(-2)
        m = m_new
    out = acc / torch.where(total > 0, total, 1.0)[..., None]
    return out.view(rows, heads, dim).to(q.dtype)

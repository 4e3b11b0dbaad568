"""Plain-PyTorch reference implementations of every hot-path op.

These are the CPU path of the engine and the ground truth the Triton kernels are tested against.
Layout conventions shared with the kernels:

* KV cache of one layer: a :class:`~megatron_kernels.paged_kv.PagedKV`, keys and values of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``.
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's last block are ignored.
* ``slot_mapping``: int64 ``[num_tokens]``, ``block_id * block_size + offset``; negative slots are skipped.
* ``context_lens``: int32 ``[num_seqs]``, tokens in the cache for each sequence *including* the ones
  written this step. Prefill queries are the last ``q_len`` positions of their sequence.
* Rotary embedding is the Hugging Face "rotate half" form, ``cos``/``sin`` of shape ``[positions, rotary_dim // 2]``.
* An FP8 KV cache (``float8_e4m3fn``) comes with its scales in the ``PagedKV``, ``[num_blocks, block_size,
  num_kv_heads]`` float32, one per cache slot and head: the cached value is ``fp8 * scale``
  (:mod:`megatron_kernels.fp8`). Without them the cache holds plain values.
* FP8 weights: ``weight`` ``[N, K]`` ``float8_e4m3fn`` and float32 ``weight_scale`` per row (``block=None``)
  or per ``block`` tile (:mod:`megatron_kernels.fp8`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .dense import linear
from .fp8 import Block, dequantize, quantize_heads
from .moe_weights import ExpertWeights
from .paged_kv import PagedKV
from .reference_lora import lora_expand, lora_shrink  # noqa: F401 - dispatcher ops, in their own module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Llama does, then cast back to the input dtype.

    In float32 it is torch's own ``F.rms_norm`` (one fused pass on a CPU, where the ops below take one pass each),
    which computes these ops' values bit for bit (``tests/kernels/test_kernels.py`` holds it to ``==``).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the pre-norm of the next sub-layer and its residual."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused gate/up projection: ``silu(x[..., :n]) * x[..., n:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` by their token positions."""
    cos_t = cos[positions].unsqueeze(1)
    sin_t = sin[positions].unsqueeze(1)
    return _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(x1 cos - x2 sin, x2 cos + x1 sin, rest)``, each half written in place into one new tensor (no ``cat``).

    Computed in the tables' dtype, each product rounded to it: tables in the model dtype give ``transformers``' and
    vLLM's rotation in that dtype bit for bit (both cast ``cos``/``sin`` to it and rotate in it); with float32 tables
    a 16-bit ``x`` is rounded once, at the end.
    """
    half = cos.shape[-1]
    xc = x.to(cos.dtype)
    x1, x2 = xc[..., :half], xc[..., half : 2 * half]
    rotated = torch.empty_like(xc) if 2 * half == x.shape[-1] else xc.clone()  # partial rotary: the rest as is
    torch.mul(x1, cos, out=rotated[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=rotated[..., half : 2 * half]).add_(x1 * sin)
    return rotated.to(x.dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values ``[T, Hkv, D]`` into their cache slots (in place); into an FP8
    cache quantized, one scale per token and head."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_blocks, block_size = cache.k.shape[:2]
    for x, pages, scales in ((key, cache.k, cache.k_scales), (value, cache.v, cache.v_scales)):
        if scales is not None:
            x, slot_scales = quantize_heads(x)
            scales.view(num_blocks * block_size, scales.shape[2])[slot_mapping] = slot_scales
        pages.view(num_blocks * block_size, *pages.shape[2:])[slot_mapping] = x.to(pages.dtype)


def apply_rotary_write_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    cache: PagedKV, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` then ``write_kv_cache`` of the rotated keys and ``v``; returns the rotated ``(q, k)``."""
    q, k = apply_rotary(q, k, positions, cos, sin)
    write_kv_cache(k, v, cache, slot_mapping)
    return q, k


def paged_attention_decode(
    q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q`` ``[S, Hq, D]``) attending to its whole cached context.

    ``out``: where to write the result (a view of a persistent buffer); a new tensor when None.
    A sequence of context 0 (a padding row of a replayed step) attends to nothing: its row is NaN, and
    never read (rows stay apart through every later layer).

    The sequences go in groups of similar length (:func:`decode_groups`), each padded to its longest only:
    a batch of mixed lengths padded to its longest gathered and multiplied about twice the keys and values
    it needed. Each group's keys and values are gathered into ``[Hkv, S, L, D]`` (:func:`_gather_kv`), and
    the query heads that share a KV head multiply them together (no copy per query head).

    Queries over a cache of their own 16-bit dtype go one sequence at a time through
    :func:`paged_attention_prefill` instead: attention in the model dtype as ``transformers``' decode step computes it
    (torch's fused kernel over the sequence's own keys), which padding a group to its longest would change (the
    kernel's sums depend on the key count).
    """
    if _attention_dtype(q, cache) != torch.float32:
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention_prefill(q, cache, block_tables, starts, context_lens, scale, out=out)
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = cache.block_size, cache.kv_heads
    group = num_heads // kv_heads
    groups = decode_groups(tuple(context_lens.tolist()), block_size, group_cost(block_size, kv_heads, head_dim))
    queries_all = q.view(num_seqs, kv_heads, group, head_dim).transpose(0, 1).float()  # [Hkv, S, G, D]
    result = queries_all.new_empty(queries_all.shape)
    order = None
    if len(groups) > 1:  # the rows longest first, as decode_groups sorted them (stable: ties keep their order)
        order = torch.argsort(-torch.div(context_lens.long() + block_size - 1, block_size, rounding_mode="floor")
                              .clamp_min(1), stable=True)
    for start, end, num_blocks in groups:
        index = None if order is None else order[start:end]
        tables = block_tables if index is None else block_tables.index_select(0, index)
        length = num_blocks * block_size
        keys, values = _gather_kv(cache, tables[:, :num_blocks])  # [Hkv, n, L, D]
        queries = queries_all if index is None else queries_all.index_select(1, index)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)  # [Hkv, n, G, L]
        lengths = context_lens if index is None else context_lens.index_select(0, index)
        past = torch.arange(length, device=q.device)[None, :] >= lengths[:, None]
        scores.masked_fill_(past[None, :, None, :], float("-inf"))
        attended = torch.matmul(scores.softmax(-1), values)  # [Hkv, n, G, D]
        if index is None:
            result = attended
        else:
            result.index_copy_(1, index, attended)
    result = result.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _attention_dtype(q: torch.Tensor, cache: PagedKV) -> torch.dtype:
    """The dtype attention computes in: the model's where the cache holds keys in it (a 16-bit model, as
    ``transformers`` computes it), float32 otherwise (a float32 model, an FP8 cache dequantized)."""
    return q.dtype if cache.k.dtype == q.dtype else torch.float32


def _gather_kv(cache: PagedKV, tables: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[Hkv, S, L, D]`` in ``dtype``: the blocks ``tables`` ``[S, blocks]`` of each sequence, head by
    head (dequantized in float32, from an FP8 cache; a table's unused entries read block 0, masked by the caller).

    On a pool stored heads first (``KVCachePool(heads_first=True)``, a CPU's) every (head, block) is one contiguous
    run of ``block_size * D`` values, and the gather copies whole runs straight into place; a pool stored blocks
    first is gathered by blocks and then reordered (one more copy). Keys and values share the row indices.
    """
    num_blocks, block_size, kv_heads, head_dim = cache.k.shape
    seqs, width = tables.shape
    blocks = tables.long().clamp_min(0).flatten()  # [S * blocks]
    heads_first = cache.k.permute(2, 0, 1, 3).is_contiguous()
    if heads_first:  # row h * num_blocks + b of the pool seen as [Hkv * blocks, block_size * D]
        rows = (torch.arange(kv_heads, device=blocks.device)[:, None] * num_blocks + blocks).flatten()
    gathered = []
    for pages, scales in ((cache.k, cache.k_scales), (cache.v, cache.v_scales)):
        if heads_first:
            runs = pages.permute(2, 0, 1, 3).reshape(kv_heads * num_blocks, block_size * head_dim)
            out = runs.index_select(0, rows).view(kv_heads, seqs, width * block_size, head_dim)
        else:
            out = (pages.reshape(num_blocks, -1).index_select(0, blocks)
                   .view(seqs, width * block_size, kv_heads, head_dim).permute(2, 0, 1, 3).contiguous())
        if scales is None:
            gathered.append(out.to(dtype))
        else:
            scale = scales.index_select(0, blocks).view(seqs, width * block_size, kv_heads).permute(2, 0, 1)
            gathered.append((out.float() * scale[..., None]).to(dtype))
    return gathered[0], gathered[1]


#: A decode group's fixed cost in the cost model of :func:`decode_groups`, in elements of keys (one value of one head
#: of one token; the values cost as much again): the dozen ops a group adds, against what gathering and multiplying
#: the keys and values costs (a CPU, with the whole-block gather of a heads-first pool). A fixed count of blocks
#: would not do: a group's ops cost the same at every model size while a block's work grows with the heads and their
#: width (the sweeps that chose it, on the benchmark model and on the served tiny one: docs/design-measurements.md).
GROUP_COST_ELEMENTS = 1 << 15


def group_cost(block_size: int, kv_heads: int, head_dim: int) -> int:
    """:data:`GROUP_COST_ELEMENTS` in sequence-blocks of a cache of this shape (at least one)."""
    return max(1, GROUP_COST_ELEMENTS // (block_size * kv_heads * head_dim))


@functools.lru_cache(maxsize=16)
def decode_groups(lens: tuple[int, ...], block_size: int, cost: int) -> tuple[tuple[int, int, int], ...]:
    """The decode batch's sequences in groups of similar length: ``(start, end, blocks)`` per group, a slice of the
    sequences sorted longest first (stably), padded to ``blocks`` blocks.

    The sorted sequences are cut between lengths where the padding saved pays for a group's fixed ``cost`` (in
    sequence-blocks, :func:`group_cost`): a dynamic programme over the cut points, cheap at batch sizes (its cache
    keeps the plan across a forward's layers, which share the step's lengths). A length of 0 counts as one block (its row is
    NaN: it attends to nothing).
    """
    widths = sorted((max(1, -(-length // block_size)) for length in lens), reverse=True)
    bounds = [0] + [row for row in range(1, len(widths)) if widths[row] != widths[row - 1]] + [len(widths)]
    best = [0] * len(bounds)  # best[i]: the cost of the sequences before bounds[i] (runs of one width each)
    cut = [0] * len(bounds)
    for end in range(1, len(bounds)):
        best[end], cut[end] = min((best[start] + cost + (bounds[end] - bounds[start]) * widths[bounds[start]],
                                   start) for start in range(end))
    groups = []
    end = len(bounds) - 1
    while end:
        groups.append((bounds[cut[end]], bounds[end], widths[bounds[cut[end]]]))
        end = cut[end]
    return tuple(reversed(groups))


def paged_attention_prefill(
    q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed query chunks (``q`` ``[T, Hq, D]``) over their cached prefixes.

    Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]``, which are the last
    positions of its ``context_lens[i]`` cached tokens (chunked prefill over cached blocks).

    Computed in :func:`_attention_dtype` by torch's fused kernel on 4-D tensors, as ``transformers``' sdpa attention
    calls it: a 16-bit model's rows then have its bits. A sequence of context 0 (a padding row of a decode step)
    attends to nothing: its rows are NaN.
    """
    block_size = cache.block_size
    dtype = _attention_dtype(q, cache)
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i, context_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if context_len == 0:
            out[q_start:q_end] = float("nan")
            continue
        num_blocks = -(-context_len // block_size)
        table = block_tables[i : i + 1, :num_blocks]
        keys, values = _gather_kv(cache, table, dtype)
        keys, values = keys[:, :, :context_len], values[:, :, :context_len]  # [Hkv, 1, L, D]
        query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            q[q_start:q_end].to(dtype).transpose(0, 1)[None], keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[0],
        )
        out[q_start:q_end] = attended[0].transpose(0, 1).to(q.dtype)
    return out


def fused_moe(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
    """Mixture-of-experts SwiGLU MLP: every token through its ``k`` experts, outputs summed by router weight.

    ``hidden`` ``[T, H]``; ``experts``: the stacked weights (:class:`~megatron_kernels.moe_weights.ExpertWeights`);
    ``topk_weights`` ``[T, k]`` (float32 router weights); ``topk_ids`` ``[T, k]`` expert ids.
    The ``T * k`` (token, expert) pairs are sorted by expert, so each expert's rows go through one
    matmul per projection; experts that received no token cost nothing. Each expert's output is
    rounded to the input dtype, then weighted and summed over ``k`` in float32.
    FP8 experts are dequantized to the input dtype one expert at a time. A negative id is no expert: the pair adds
    nothing (the expert-parallel dispatchers' unused rows, :mod:`megatron_kernels.triton_moe`).
    """
    experts.check(hidden, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts = experts.w13.shape[0]
    flat = torch.where(topk_ids.reshape(-1) < 0, num_experts, topk_ids.reshape(-1))  # no expert: sorted last
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()[:num_experts]
    rows = hidden[order // top_k]
    out = hidden.new_zeros((num_tokens * top_k, hidden.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate_up, down = experts.dequantized(expert, hidden.dtype)
            activated = silu_and_mul(linear(rows[start:end], gate_up))
            out[order[start:end]] = linear(activated, down)
            start = end
    weighted = out.float().view(num_tokens, top_k, hidden.shape[1]) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(1).to(hidden.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: Block,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for an FP8 weight, on devices without FP8 matrix units: the weight is dequantized
    to ``x``'s dtype and the activations stay unquantized (``input_scale``, a checkpoint's static
    activation scale, only matters where activations are quantized). This gives exactly the engine's
    output on the dequantized weights.
    """
    return linear(x, dequantize(weight, weight_scale, block, x.dtype), bias)

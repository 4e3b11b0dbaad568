"""Batch-invariant arithmetic: ops whose result for one row does not depend on the other rows.

A CPU (or GPU) library picks its algorithm by the shape it is given: ``torch.mm`` of one row is a
matrix-vector product, of seven rows a blocked GEMM, and the two round differently (on this 2-core
AVX-512 machine 1 row and 2 rows already differ in float32). Elementwise functions differ too: a
vectorized loop leaves a tail of a tensor to a scalar loop, and PyTorch's scalar ``silu`` rounds
differently from its vector one (767 of 20,000 float32 values differ). A token's log prob then
depends on how many other tokens share its step. The ops here remove every such dependence:

* :func:`linear`: rows go through the library in fixed tiles of :data:`ROW_TILE` rows (the last
  tile padded), so every row meets the same GEMM shape whatever the batch;
* :func:`silu`, :func:`sigmoid`, :func:`exp`, :func:`cos`, :func:`sin`: the tensor is flattened, padded to whole
  vectors and cut into pieces no larger than one thread's share, so every element takes the
  vector path, and vector lanes do not interact;
* :func:`attention`: keys reduced in blocks of :data:`KEY_BLOCK` from position 0 with an online
  softmax, scores and weighted values as elementwise products summed over a fixed length, so a
  query's output depends only on its own position and its sequence's keys: prefill, decode, a
  prefix-cache hit and any chunking give the same bits.

Row-wise kernels PyTorch already runs one row at a time (``softmax``, ``log_softmax``, ``mean`` over
the last dimension) and correctly rounded elementwise ops (``+``, ``*``, ``rsqrt``, casts) need
nothing.

The engine calls these functions directly when started with ``--batch-invariant``;
:class:`InvariantMode` routes a trainer's ``F.linear``, ``F.silu`` and ``torch.cos``/``sin``/``exp``
here (``megatron_serve.invariant.batch_invariant``). Only ``torch`` is imported.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 16
"""Rows per GEMM call. benchmarks/batch_invariance.py on the 2-core CPU (hidden 256, 4 layers, quiet):
16 and 64 rows cost the same CPU per token (greedy Llama 2.84 ms both, sampled 1.82 vs 1.80 ms,
Qwen3-MoE greedy 3.23 vs 3.43 ms); 16 pads a small decode step least."""

KEY_BLOCK = 32
"""Keys per attention block: every query reduces its keys in blocks of this many from position 0."""

_VECTOR = 64
"""Elements of two AVX-512 registers of bfloat16: a multiple of every vector loop's stride."""

_PIECE = 32768
"""PyTorch's grain: an elementwise op of at most this many elements runs on one thread, so no thread
boundary can cut a vector loop short."""

def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every row computed by a GEMM of :data:`ROW_TILE` rows (differentiable:
    a trainer's backward runs through it)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    whole = count - count % ROW_TILE
    weight_t = weight.t()
    tracked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if tracked:  # out= has no autograd: tiles as separate tensors, concatenated
        tiles = [_tile(rows[start:start + ROW_TILE], weight_t, bias) for start in range(0, whole, ROW_TILE)]
        if whole < count:
            padded = F.pad(rows[whole:], (0, 0, 0, ROW_TILE - count + whole))
            tiles.append(_tile(padded, weight_t, bias)[: count - whole])
        out = torch.cat(tiles) if tiles else rows.new_empty((0, weight.shape[0]))
        return out.view(*x.shape[:-1], weight.shape[0])
    out = rows.new_empty((count, weight.shape[0]))
    for start in range(0, whole, ROW_TILE):
        _tile(rows[start:start + ROW_TILE], weight_t, bias, out[start:start + ROW_TILE])
    if whole < count:
        padded = rows.new_zeros((ROW_TILE, rows.shape[1]))
        padded[: count - whole] = rows[whole:]
        out[whole:] = _tile(padded, weight_t, bias)[: count - whole]
    return out.view(*x.shape[:-1], weight.shape[0])


def _tile(rows: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    if bias is None:
        return torch.mm(rows, weight_t) if out is None else torch.mm(rows, weight_t, out=out)
    return torch.addmm(bias, rows, weight_t) if out is None else torch.addmm(bias, rows, weight_t, out=out)


def lanewise(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``function(x)`` for an elementwise ``function``, every element through the vector loop."""
    flat = x.reshape(-1)
    count = flat.numel()
    size = -(-count // _VECTOR) * _VECTOR
    if size != count or not flat.is_contiguous():
        padded = flat.new_zeros(size)
        padded[:count] = flat
        flat = padded
    if size <= _PIECE:
        out = function(flat)
    else:
        out = torch.empty_like(flat)
        for start in range(0, size, _PIECE):
            out[start:start + _PIECE] = function(flat[start:start + _PIECE])
    return out[:count].view(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return lanewise(F.silu, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.exp, x)


def cos(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.sin, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.sigmoid, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up tensor, as ``act(gate) * up`` of separate projections computes it."""
    gate, up = x.chunk(2, dim=-1)
    return silu(gate.contiguous()) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, op for op as ``transformers`` writes it (float32 statistics, cast, then the weight)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as ``transformers`` applies it: ``x * cos + rotate_half(x) * sin`` in ``x``'s dtype,
    ``cos_full``/``sin_full`` over the whole head dimension (both halves), already in that dtype."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_full + rotated_half * sin_full


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query rows over their sequences' keys, blockwise from key 0.

    ``q`` ``[R, Hq, D]``; ``keys``/``values`` ``[S, L, Hkv, D]`` (``L`` at least every query's position
    plus one; entries past it may hold anything); ``sequence[r]`` which of the ``S`` sequences row
    ``r`` reads; ``positions[r]`` its position (it sees keys ``0..positions[r]``). Returns ``[R, Hq, D]``
    in ``q``'s dtype. Computed in float32 with an online softmax over blocks of :data:`KEY_BLOCK`
    keys; a block wholly past a row's position changes nothing (its weights are exactly 0 and its
    rescale factor exactly 1), so neither the longest sequence of the call nor the other rows matter.

    Scores and weighted values are elementwise products summed over ``D`` and over the block: a
    batched GEMM per row and head (``torch.matmul``) is not invariant, the library picks its path by
    the batch count (one thread, 4 heads of 32: the parity search's case 0 changed a log prob).

    For speed, none of which changes a bit (every element meets the same products in the same
    layouts, so the same sums): each block is read through a view of the keys (no copy of a block
    for all sequences); rows run sorted by position, latest first, so the rows a block reaches are a
    prefix and the rows it is wholly past are set aside once, not copied back (no ``index_copy``); the
    causal masks are applied only in blocks some row sees in part; rows that all read one sequence
    (a prefill chunk, a trainer's single sequence) broadcast its block instead of a copy per row.
    Checked equal with ``==`` to the plain loop on decode, prefill, prefix-hit and mixed calls,
    float32 and bfloat16, grouped heads, NaN past the positions. CPU time of one call, one thread,
    best of 15, the plain loop then this (2-core CPU, shared): 20 decode rows 2.28 -> 1.97 ms,
    a 300-row prefill 59.1 -> 34.3 ms, a 77-row prefix-hit chunk in bfloat16 4.13 -> 2.14 ms,
    a mixed step 3.13 -> 2.66 ms.
    """
    rows, heads, dim = q.shape
    span_in, kv_heads = keys.shape[1:3]
    group = heads // kv_heads
    if rows == 0:
        return q.new_empty((0, heads, dim))
    order = torch.argsort(positions, descending=True, stable=True)
    ordered = positions[order].tolist()
    length = min(span_in, ordered[0] + 1)
    blocks = -(-length // KEY_BLOCK)
    span = blocks * KEY_BLOCK
    if span > span_in:
        keys = F.pad(keys, (0, 0, 0, 0, 0, span - span_in))
        values = F.pad(values, (0, 0, 0, 0, 0, span - span_in))
    row_seq = sequence[order]
    first = int(sequence[0])
    one_sequence = bool((sequence == first).all())
    tiled = (keys.shape[0], blocks, KEY_BLOCK, kv_heads, dim)
    keys_blocked = keys[:, :span].reshape(tiled).transpose(0, 1)  # [n, S, B, Hkv, D], a view
    values_blocked = values[:, :span].reshape(tiled).transpose(0, 1)
    row_pos = positions[order]
    row_q = q[order].to(torch.float32).view(rows, kv_heads, group, 1, dim)
    best = row_q.new_full((rows, kv_heads, group), float("-inf"))
    total = row_q.new_zeros((rows, kv_heads, group))
    acc = row_q.new_zeros((rows, kv_heads, group, dim))
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    finished: list[torch.Tensor] = []
    live = rows
    for block in range(blocks):
        start = block * KEY_BLOCK
        reached = bisect.bisect_right(ordered, -start, key=lambda p: -p)  # rows with position >= start
        if reached < live:  # the block is wholly past the rest: their sums are final
            finished.append(acc[reached:live] / total[reached:live, ..., None])
            live = reached
            best, total, acc, row_seq, row_pos, row_q = (
                best[:live], total[:live], acc[:live], row_seq[:live], row_pos[:live], row_q[:live])
        if one_sequence:  # every row reads the same block: broadcast it
            k, v = keys_blocked[block, first:first + 1], values_blocked[block, first:first + 1]  # [1, B, Hkv, D]
        else:
            k, v = keys_blocked[block].index_select(0, row_seq), values_blocked[block].index_select(0, row_seq)
        k, v = k.float(), v.float()
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 3, 1)  # [r, Hkv, B, D], [r, Hkv, D, B]
        scores = (row_q * k[:, :, None]).sum(-1) * scale  # [r, Hkv, G, B]
        if ordered[live - 1] < start + KEY_BLOCK - 1:  # some row sees only part of the block
            visible = (start + offsets)[None, :] <= row_pos[:, None]  # [r, B]
            v = torch.where(visible[:, None, None, :], v, 0.0)
            scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1))
        rescale = exp(best - new_best)
        weights = exp(scores - new_best[..., None])
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + (weights[:, :, :, None, :] * v[:, :, None]).sum(-1)
        best = new_best
    finished.append(acc / total[..., None])
    ordered_out = torch.cat(finished[::-1]) if len(finished) > 1 else finished[0]
    return ordered_out[torch.argsort(order)].view(rows, heads, dim).to(q.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Mixture-of-experts SwiGLU as ``transformers``' expert loop computes it, with invariant GEMMs.

    Experts in ascending id order; each takes its tokens' rows through :func:`linear` (tiles padded
    with zero rows that no token reads), scales them by the router weight (in ``topk_weights``' dtype:
    Qwen-MoE routers round it to the model dtype, Mixtral's keeps float32), rounds to the model dtype
    and adds them into a zero-initialised output, so a token's sum runs over its experts in ascending
    id order whatever the other tokens are.
    """
    weights = topk_weights
    out = torch.zeros_like(hidden)
    for expert in torch.unique(topk_ids).tolist():
        slot, token = torch.where((topk_ids == expert).t())
        activated = silu_and_mul(linear(hidden[token], w13[expert]))
        out.index_add_(0, token, (linear(activated, w2[expert]) * weights[token, slot, None]).to(out.dtype))
    return out


_OVERRIDES: dict[Callable, Callable] = {
    F.linear: linear,
    F.silu: lambda x, inplace=False: silu(x),
    torch.cos: cos,
    torch.Tensor.cos: cos,
    torch.sin: sin,
    torch.Tensor.sin: sin,
    torch.exp: exp,
    torch.Tensor.exp: exp,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
}


class InvariantMode(TorchFunctionMode):
    """Routes the ops of :data:`_OVERRIDES` (called the plain way, no ``out=``) to their invariant twins;
    inside the handler the mode is off, so the twins call the plain ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = _OVERRIDES.get(func)
        if replacement is not None and "out" not in kwargs:
            return replacement(*args, **kwargs)
        return func(*args, **kwargs)

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

import math
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

GEMM_ROWS = 16
"""The attention's GEMMs take rows in multiples of this: from 16 rows up, MKL's float32 GEMM computes an
element the same way whatever the shape (8 rows already take another path)."""

_VECTOR = 64
"""Elements of two AVX-512 registers of bfloat16: a multiple of every vector loop's stride."""

_PIECE = 32768
"""PyTorch's grain: an elementwise op of at most this many elements runs on one thread, so no thread
boundary can cut a vector loop short."""

def _gpu_kernels(x: torch.Tensor):
    """The Triton twins for a CUDA tensor (fixed tiles per weight shape, one row per norm program), else
    ``None``: on CPU the PyTorch ops here are the invariant ones. Imported on first GPU use, so a trainer
    on CPU needs no ``triton``."""
    if not x.is_cuda:
        return None
    from . import triton_invariant_linear, triton_invariant_norm  # noqa: PLC0415 - GPU only, needs triton
    return triton_invariant_linear, triton_invariant_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every row computed by a GEMM of :data:`ROW_TILE` rows (differentiable:
    a trainer's backward runs through it); on CUDA the Triton kernel of ``triton_invariant_linear``."""
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[0].invariant_linear(x, weight, bias)
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
    """Llama's RMSNorm, op for op as ``transformers`` writes it (float32 statistics, cast, then the weight);
    on CUDA the one-row-per-program Triton kernel of ``triton_invariant_norm``."""
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[1].invariant_rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[1].invariant_fused_add_rms_norm(x, residual, weight, eps)
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
    """Causal attention of query rows over their sequences' keys, keys reduced in blocks from key 0.

    ``q`` ``[R, Hq, D]``; ``keys``/``values`` ``[S, L, Hkv, D]`` (``L`` at least every query's position
    plus one; entries past a sequence's last queried position may hold anything, NaN included);
    ``sequence[r]`` which of the ``S`` sequences row ``r`` reads; ``positions[r]`` its position (it
    sees keys ``0..positions[r]``). Returns ``[R, Hq, D]`` in ``q``'s dtype, computed in float32.

    Per query row and head: scores by GEMM, the softmax's maximum over the visible keys (exact in
    any order), weights ``exp(score - max)`` (0 for unseen keys), then the weights' sum and the
    weighted values reduced per block of :data:`KEY_BLOCK` keys (a 32-wide sum; a GEMM with
    ``K = KEY_BLOCK``) and the blocks added one by one from block 0. A block past a row's
    position adds exact zeros, so neither the longest sequence of the call, the padding, nor the
    other rows change a bit: prefill, decode, a prefix-cache hit and any chunking agree.

    The GEMMs are batched per group of sequences (one group per padded row count: all decode rows
    together, each prefill chunk on its own) as ``[M, D] x [D, L]`` and ``[M, KEY_BLOCK] x
    [KEY_BLOCK, D]`` with ``M`` a multiple of :data:`GEMM_ROWS` (zero rows padded): a float32 GEMM
    whose ``M`` is a multiple of 16 computes each element the same way whatever ``M``, ``N`` and
    the batch count (checked on MKL 2024.2, AVX-512, 1 and 2 threads, ``D`` 8 to 128, transposed
    or not); below 16 rows the library takes other paths (8 rows already differ), which is why a
    per-row batched GEMM was not invariant. ``tests/invariance`` holds it to ``==``.

    CPU per call, one thread, the earlier elementwise-product version then this: (measured in
    benchmarks/batch_invariance.py's engine runs, see docs/batch-invariance.md).
    """
    rows, heads, dim = q.shape
    count, span_in, kv_heads = keys.shape[:3]
    group = heads // kv_heads
    if rows == 0:
        return q.new_empty((0, heads, dim))
    order = torch.argsort(sequence, stable=True)  # rows of a sequence together, in their order
    per_sequence = torch.bincount(sequence, minlength=count)
    limits = torch.full((count,), -1, dtype=positions.dtype, device=q.device).scatter_reduce(
        0, sequence, positions, "amax")
    unit = GEMM_ROWS // math.gcd(GEMM_ROWS, group)  # rows whose heads fill whole GEMM tiles
    padded_rows = (-(-per_sequence // unit) * unit).tolist()
    starts = [0] + torch.cumsum(per_sequence, 0).tolist()
    by_size: dict[int, list[int]] = {}
    for index, size in enumerate(padded_rows):
        if size:
            by_size.setdefault(size, []).append(index)
    out = torch.empty((rows, kv_heads, group, dim), dtype=torch.float32, device=q.device)
    q32 = q.to(torch.float32).view(rows, kv_heads, group, dim)
    for size, members in by_size.items():
        row_index = torch.cat([order[starts[s]:starts[s + 1]] for s in members])
        slot_seq = torch.cat([torch.full((starts[s + 1] - starts[s],), i, device=q.device)
                              for i, s in enumerate(members)])
        slot_row = torch.cat([torch.arange(starts[s + 1] - starts[s], device=q.device) for s in members])
        out[row_index] = _attend_group(q32[row_index], slot_seq, slot_row, size,
                                       torch.tensor(members, device=q.device), keys, values,
                                       positions[row_index], limits, scale)
    return out.view(rows, heads, dim).to(q.dtype)


def _attend_group(q: torch.Tensor, slot_seq: torch.Tensor, slot_row: torch.Tensor, size: int,
                  members: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  limits: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attention` for the rows of the sequences ``members``, each padded to ``size`` rows:
    ``q`` ``[r, Hkv, G, D]`` float32, row ``i`` at slot ``slot_row[i]`` of sequence ``slot_seq[i]``."""
    n, (_, kv_heads, group, dim) = members.numel(), q.shape
    limit = limits[members]
    blocks = -(-(int(limit.max()) + 1) // KEY_BLOCK)
    span = blocks * KEY_BLOCK
    k, v = keys[members, :span], values[members, :span]
    if span > k.shape[1]:
        k = F.pad(k, (0, 0, 0, 0, 0, span - k.shape[1]))
        v = F.pad(v, (0, 0, 0, 0, 0, span - v.shape[1]))
    seen = torch.arange(span, device=q.device)[None, :] <= limit[:, None]  # [n, L]: keys some row reads
    v = torch.where(seen[:, :, None, None], v.to(torch.float32), 0.0)  # never 0 * NaN
    k_t = k.to(torch.float32).permute(0, 2, 3, 1).reshape(n * kv_heads, dim, span)
    padded = q.new_zeros((n, size, kv_heads, group, dim))
    padded[slot_seq, slot_row] = q
    tile_rows = size * group
    q_t = padded.permute(0, 2, 1, 3, 4).reshape(n * kv_heads, tile_rows, dim)
    scores = torch.bmm(q_t, k_t).mul_(scale).view(n, kv_heads, size, group, span)
    row_pos = positions.new_zeros((n, size))
    row_pos[slot_seq, slot_row] = positions
    visible = torch.arange(span, device=q.device) <= row_pos[:, None, :, None, None]  # [n, 1, size, 1, L]
    scores = torch.where(visible, scores, float("-inf"))
    weights = exp(scores - scores.amax(-1, keepdim=True)).view(n * kv_heads, tile_rows, blocks, KEY_BLOCK)
    block_totals = weights.sum(-1)  # [b, M, blocks]
    partial = torch.bmm(weights.transpose(1, 2).reshape(-1, tile_rows, KEY_BLOCK),
                        v.permute(0, 2, 1, 3).reshape(-1, KEY_BLOCK, dim)).view(n * kv_heads, blocks, tile_rows, dim)
    total, acc = block_totals[..., 0], partial[:, 0]
    for block in range(1, blocks):
        total = total + block_totals[..., block]
        acc = acc + partial[:, block]
    out = (acc / total[..., None]).view(n, kv_heads, size, group, dim).permute(0, 2, 1, 3, 4)
    return out[slot_seq, slot_row]


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

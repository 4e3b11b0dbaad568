"""Batch-invariant attention (CPU): a query row's output depends on its position and its sequence's keys only.

Per KV head and sequence, the query rows (a sequence's rows times the query heads sharing the KV head) are
the rows of small GEMMs, one per block of :data:`~megatron_kernels.invariant.KEY_BLOCK` keys from key 0:

* scores ``[r, D] x [D, KEY_BLOCK]`` (the row's query against one block of keys), scaled, unseen keys
  set to ``-inf``;
* the softmax's maximum over all blocks (exact in any order), weights ``exp(score - max)``;
* weighted values ``[r, KEY_BLOCK] x [KEY_BLOCK, D]`` and the weights' sums (``sum`` over the block's 32
  contiguous weights) per block, added block after block from block 0, then divided.

Every GEMM has fixed ``K`` and ``N`` (the head size and the key block); only the row count ``r`` and the
number of GEMMs in the batch follow the call. From :data:`MIN_ROWS` rows up, MKL's float32 GEMM computes
a row the same way whatever the row count, the row's place and the batch count (``benchmarks/
invariance_probe.py``: 1,530 shapes, head sizes 8-256, 4-600 rows, batches 3 and 21, 1 and 2 threads, no
difference; 2 or 3 rows differ), and ``sum`` over a contiguous last dimension of 32 adds a row the same
way whatever the other rows. A block past a row's position adds exact zeros, so neither the call's
longest sequence, nor the padding, nor the other rows change a bit: prefill, decode, a prefix-cache hit
and any chunking agree (``tests/invariance`` holds the engine to ``==``).

Rows as the GEMMs' rows (rather than keys as rows, the earlier form) keep the library's fast path: a
decode row of the cost benchmark's model (2 query heads per KV head) is one GEMM of 4 rows (its rows
repeated), where the keys-as-rows form had GEMMs of 2 columns, which MKL runs 4-5x slower per product.
CPU per call, one thread, 32 decode rows over 60-200 keys (8/4 heads of 32): 6.3-7.2 ms before (with
the cache gathered in two copies), see ``PagedStep`` for after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .invariant import KEY_BLOCK, exp, exp_

MIN_ROWS = 4
"""Rows of an attention GEMM at least (a sequence's last row repeated): below 4 rows MKL takes other paths."""


@dataclass
class RowGroup:
    """The sequences of one call that have the same number of query rows: one set of batched GEMMs.

    A sequence's rows enter the GEMMs in their order, then its last row repeated up to ``padded`` rows (a row
    is computed on its own, so a repeat changes no other row; its output is dropped)."""

    size: int  # query rows of each member
    padded: int  # rows of each member in the GEMMs (per query head of a KV head)
    members: list[int]  # the call's sequences, in the group's order
    gather: torch.Tensor  # [n * blocks * padded] long: the call's rows that fill the GEMMs, once per key block
    rows: torch.Tensor | None  # [n * size] long: where each output row goes; None: rows 0.. of the call in order
    limits: list[int]  # each member's last position read
    span: int  # keys read per member: a multiple of KEY_BLOCK and of the caller's granule
    hidden: torch.Tensor  # [n, span // KEY_BLOCK, padded, 1, KEY_BLOCK] bool: keys a row does not see


def plan_rows(rows_of: list[range | list[int]], positions_of: list[range | list[int]], group_heads: int,
              device: torch.device, granule: int = KEY_BLOCK) -> list[RowGroup]:
    """Group a call's sequences by their row count. ``rows_of[s]``: the call's rows of sequence ``s`` (may be
    empty), ``positions_of[s]`` their positions; ``granule``: the key count ``span`` is a multiple of (the
    cache's block size times whole blocks, so that a gather needs no slicing)."""
    by_size: dict[int, list[int]] = {}
    for sequence, rows in enumerate(rows_of):
        if len(rows):
            by_size.setdefault(len(rows), []).append(sequence)
    total = sum(len(rows) for rows in rows_of)
    step = math.lcm(KEY_BLOCK, granule)
    groups = []
    for size, members in by_size.items():
        padded = size
        while padded * group_heads < MIN_ROWS or padded * group_heads % 2:  # even: exp's vectors stay whole
            padded += 1
        gather, positions, out_rows = [], [], []
        for sequence in members:
            rows, where = list(rows_of[sequence]), list(positions_of[sequence])
            out_rows += rows
            gather += rows + rows[-1:] * (padded - size)
            positions += where + where[-1:] * (padded - size)
        limits = [max(positions_of[sequence]) for sequence in members]
        span = -(-(max(limits) + 1) // step) * step
        row_pos = torch.tensor(positions, device=device).view(len(members), 1, padded, 1, 1)
        keys = torch.arange(span, device=device).view(1, span // KEY_BLOCK, 1, 1, KEY_BLOCK)
        in_order = len(by_size) == 1 and out_rows == list(range(total))
        gather_t = torch.tensor(gather, device=device).view(len(members), 1, padded)
        gather_t = gather_t.expand(len(members), span // KEY_BLOCK, padded).reshape(-1)
        groups.append(RowGroup(size, padded, members, gather_t,
                               None if in_order else torch.tensor(out_rows, device=device), limits, span,
                               keys > row_pos))
    return groups


class Workspace:
    """Scratch tensors kept from call to call for the engine's attention: a fresh tensor of a few MB is new
    pages from the system at every layer, and their first touch cost more than the arithmetic (32 decode rows
    over 60-200 keys: 2.6-4.8 ms a call with fresh tensors, 0.9-1.4 ms with these). ``out=`` ops have no
    gradient, so a trainer's backward runs the same arithmetic without one. Tensors over :attr:`LIMIT`
    elements are not kept (a long prefill's scores would hold their memory for good)."""

    LIMIT = 1 << 22

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        if numel > self.LIMIT:
            return torch.empty(shape, dtype=dtype, device=device)
        held = self._held.get(name)
        if held is None or held.numel() < numel or held.dtype != dtype or held.device != device:
            with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
                held = self._held[name] = torch.empty(numel, dtype=dtype, device=device)
        return held[:numel].view(shape)


WORKSPACE = Workspace()
"""The engine's scratch tensors (one process runs one forward at a time)."""


def _out(workspace: Workspace | None, name: str, shape: tuple[int, ...], like: torch.Tensor,
         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{"out": scratch}`` for an op writing into the workspace, ``{}`` without one."""
    return {} if workspace is None else {"out": workspace.take(name, shape, dtype, like.device)}


def attend_group(q: torch.Tensor, group: RowGroup, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 workspace: Workspace | None = None) -> torch.Tensor:
    """The group's rows of ``q`` ``[R, Hq, D]`` over its members' ``keys``/``values`` ``[Hkv, n, span, D]`` float32
    (values finite wherever a weight is zero: a zero weight times NaN is NaN). Returns ``[n, size, Hkv, G, D]``
    float32 (a view of ``workspace``'s tensors when given: copy it out before the next call), the members in
    the group's order. Without a workspace differentiable (a trainer's backward runs through it); the two give
    the same bits (the same kernels, in place or not)."""
    kv_heads, count, span, dim = keys.shape
    group_heads = q.shape[1] // kv_heads
    width, blocks = group.padded * group_heads, span // KEY_BLOCK
    batch = kv_heads * count * blocks
    q_heads = q.view(q.shape[0], kv_heads, group_heads * dim).permute(1, 0, 2)  # a KV head's query heads together
    q_rows = torch.index_select(q_heads, 1, group.gather,  # [Hkv, n * blocks * padded, G * D]: one copy
                                **_out(workspace, "q", (kv_heads, group.gather.numel(), group_heads * dim), q, q.dtype))
    q_rows = q_rows.view(batch, width, dim).to(torch.float32)
    scores = torch.bmm(q_rows, keys.view(batch, KEY_BLOCK, dim).transpose(1, 2),
                       **_out(workspace, "scores", (batch, width, KEY_BLOCK), q))
    # the softmax on the rows that count: a repeated row's scores are not read, its weights are zeros
    real = group.size * group_heads
    scores = scores.view(kv_heads, count, blocks, width, KEY_BLOCK)[:, :, :, :real]
    scores.view(kv_heads, count, blocks, group.size, group_heads, KEY_BLOCK).mul_(scale).masked_fill_(
        group.hidden[:, :, :group.size], float("-inf"))
    peak = scores.amax(-1, keepdim=True).amax(2, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    if workspace is None:
        weights = exp(scores - peak)  # [Hkv, n, blocks, real, KEY_BLOCK]
        padded = torch.nn.functional.pad(weights, (0, 0, 0, width - real))
    else:
        padded = workspace.take("weights", (kv_heads, count, blocks, width, KEY_BLOCK), torch.float32, q.device)
        weights = exp_(torch.sub(scores, peak, out=padded[:, :, :, :real]))
        padded[:, :, :, real:] = 0.0
    partial = torch.bmm(padded.view(batch, width, KEY_BLOCK), values.view(batch, KEY_BLOCK, dim),
                        **_out(workspace, "partial", (batch, width, dim), q))
    partial = partial.view(kv_heads, count, blocks, width, dim)[:, :, :, :real]
    sums = torch.sum(weights, -1, **_out(workspace, "sums", weights.shape[:-1], q))  # [Hkv, n, blocks, real]
    if workspace is None:
        acc, total = partial[:, :, 0], sums[:, :, 0]
        for block in range(1, blocks):  # one block after another from block 0
            acc = acc + partial[:, :, block]
            total = total + sums[:, :, block]
        out = acc / total.unsqueeze(-1)
    else:
        out = workspace.take("acc", (kv_heads, count, real, dim), torch.float32, q.device).copy_(partial[:, :, 0])
        total = workspace.take("total", (kv_heads, count, real), torch.float32, q.device).copy_(sums[:, :, 0])
        for block in range(1, blocks):
            out.add_(partial[:, :, block])
            total.add_(sums[:, :, block])
        out.div_(total.unsqueeze(-1))
    out = out.view(kv_heads, count, group.size, group_heads, dim)
    return out.permute(1, 2, 0, 3, 4)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query rows over their sequences' keys, keys reduced in blocks from key 0.

    ``q`` ``[R, Hq, D]``; ``keys``/``values`` ``[Hkv, S, L, D]``, heads first (``L`` at least every query's
    position plus one; entries past a sequence's last queried position may hold anything, NaN included);
    ``sequence[r]`` which of the ``S`` sequences row ``r`` reads; ``positions[r]`` its position (it sees keys
    ``0..positions[r]``). Returns ``[R, Hq, D]`` in ``q``'s dtype, computed in float32 by :func:`attend_group`,
    the same arithmetic as the engine's paged attention (:class:`PagedStep`).
    """
    rows, heads, dim = q.shape
    kv_heads, count, length = keys.shape[:3]
    rows_of: list[list[int]] = [[] for _ in range(count)]
    positions_of: list[list[int]] = [[] for _ in range(count)]
    for row, (seq, position) in enumerate(zip(sequence.tolist(), positions.tolist())):
        rows_of[seq].append(row)
        positions_of[seq].append(position)
    out = q.new_empty((rows, heads, dim), dtype=torch.float32)
    for group in plan_rows(rows_of, positions_of, heads // kv_heads, q.device):
        members = torch.tensor(group.members, device=q.device)
        read = min(length, group.span)
        limits = torch.tensor(group.limits, device=q.device)[:, None]
        seen = torch.arange(group.span, device=q.device)[None, :] <= limits
        keys_b, values_b = (_dense_block(cache, members, read, group.span) for cache in (keys, values))
        values_b = values_b.masked_fill(~seen[None, :, :, None], 0.0)  # whatever lies past a sequence's last key
        result = attend_group(q, group, keys_b, values_b, scale).reshape(-1, heads, dim)
        out = result if group.rows is None else out.index_copy(0, group.rows, result)
    return out.to(q.dtype)


def _dense_block(cache: torch.Tensor, members: torch.Tensor, read: int, span: int) -> torch.Tensor:
    """``[Hkv, n, span, D]`` float32: the members' first ``read`` keys (or values), zeros after."""
    picked = cache[:, members, :read].to(torch.float32)
    return picked if read == span else torch.nn.functional.pad(picked, (0, 0, 0, span - read))


@dataclass
class _PagedGroup:
    rows: RowGroup
    blocks: torch.Tensor  # [n * span // block_size] long: the cache blocks read, in order
    stale: torch.Tensor | None  # [m] long: (member, key) slots, flat over [n, span], whose values are zeroed


class PagedStep:
    """One engine step's attention over a paged KV cache (``[blocks, block_size, Hkv, D]``), planned once and
    run by every layer: the row groups, each member's cache blocks and the value slots to zero.

    A member reads its blocks up to its last key, then (up to the group's ``span``) a block that is fully
    written by the step's longest sequence: its values are finite, so their zero weights add exact zeros.
    The slots past a member's last key in its own last block may hold another request's old values (NaN
    included): they are zeroed after the gather, a few per member. A cache stored heads first
    (``KVCachePool(heads_first=True)``, the CPU mode's) is gathered in one copy per layer and tensor; any
    other layout in two. CPU, one thread, 32 decode rows over 60-200 keys (8/4 heads of 32, 16-key blocks):
    the whole call 0.8-0.9 ms, against 6.3-7.2 ms for the earlier form and 0.9-1.0 ms for the default mode's
    decode attention.
    """

    def __init__(self, rows_of: list[range], positions_of: list[range], tables: torch.Tensor, group_heads: int,
                 block_size: int, device: torch.device):
        self.group_heads, self.block_size = group_heads, block_size
        limits = [max(positions, default=-1) for positions in positions_of]
        longest = max(range(len(limits)), key=limits.__getitem__)
        donor = int(tables[longest, 0]) if limits[longest] + 1 >= block_size else None
        self.groups = [self._paged(group, tables, donor, device)
                       for group in plan_rows(rows_of, positions_of, group_heads, device, granule=block_size)]

    def _paged(self, group: RowGroup, tables: torch.Tensor, donor: int | None, device: torch.device) -> _PagedGroup:
        size = self.block_size
        count, width = len(group.members), group.span // size
        table = tables[torch.tensor(group.members, device=device)].long()[:, :width].clamp_min(0)
        if table.shape[1] < width:
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        limits = torch.tensor(group.limits, device=device)[:, None]
        past = torch.arange(width, device=device)[None, :] > limits // size
        blocks = torch.where(past, table[:, :1] if donor is None else donor, table)
        keys = torch.arange(group.span, device=device)[None, :]
        zeroed = keys > limits
        if donor is not None:  # past the last block: the donor's finite values
            zeroed &= keys < (limits // size + 1) * size
        stale = zeroed.view(-1).nonzero().squeeze(1)
        return _PagedGroup(group, blocks.view(-1), stale if stale.numel() else None)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor,
               k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Every row of ``q`` ``[R, Hq, D]`` into ``out`` (``q``'s shape, any float dtype); an FP8 cache is
        dequantized with its scales ``[blocks, block_size, Hkv]``."""
        for paged in self.groups:
            group = paged.rows
            count = len(group.members)
            keys = _gather(k_cache, paged.blocks, count, group.span, k_scales, "keys")
            values = _gather(v_cache, paged.blocks, count, group.span, v_scales, "values")
            if paged.stale is not None:
                values.view(values.shape[0], -1, values.shape[-1]).index_fill_(1, paged.stale, 0.0)
            result = attend_group(q, group, keys, values, scale, WORKSPACE)
            if group.rows is None:
                out.view(result.shape).copy_(result)
            else:
                out.index_copy_(0, group.rows, result.reshape(-1, *out.shape[1:]).to(out.dtype))
        return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, count: int, span: int, scales: torch.Tensor | None,
            name: str) -> torch.Tensor:
    """``[Hkv, count, span, D]`` float32 in the workspace's tensor ``name``: the cache blocks in order, heads first
    (dequantized with ``scales`` from an FP8 cache)."""
    kv_heads, dim = cache.shape[2:]
    heads_first = cache.permute(2, 0, 1, 3)
    if heads_first.is_contiguous() and cache.dtype == torch.float32 and scales is None:  # one copy: whole blocks
        out = WORKSPACE.take(name, (kv_heads, blocks.numel(), *cache.shape[1:2], dim), cache.dtype, cache.device)
        return torch.index_select(heads_first, 1, blocks, out=out).view(kv_heads, count, span, dim)
    if heads_first.is_contiguous():
        gathered = heads_first.index_select(1, blocks).view(kv_heads, count, span, dim)
    else:
        gathered = cache.index_select(0, blocks).view(count, span, kv_heads, dim).permute(2, 0, 1, 3)
    if scales is not None:
        slot_scales = scales.index_select(0, blocks).view(count, span, kv_heads).permute(2, 0, 1).unsqueeze(-1)
        return torch.mul(gathered.to(torch.float32), slot_scales,
                         out=WORKSPACE.take(name, gathered.shape, torch.float32, cache.device))
    return WORKSPACE.take(name, gathered.shape, torch.float32, cache.device).copy_(gathered)

"""Batch-invariant attention (CPU): a query row's output depends on its position and its sequence's keys only.

Per KV head and sequence, the query rows (a sequence's rows times the query heads sharing the KV head) are
the rows of small GEMMs, one per block of :data:`~megatron_kernels.invariant.KEY_BLOCK` keys from key 0:

* scores ``[r, D] x [D, KEY_BLOCK]`` (the row's query against one block of keys), scaled, unseen keys
  set to ``-inf``;
* the softmax's maximum over all blocks (exact in any order), weights ``exp(score - max)``;
* weighted values ``[r, KEY_BLOCK] x [KEY_BLOCK, D]`` and the weights' sums (``sum`` over the block's 32
  contiguous weights) per block, added block after block from block 0, then divided.

Every GEMM has fixed ``K`` and ``N`` (the head size and the key block); only the row count ``r`` and the
number of GEMMs in the batch follow the call. With the rows padded to a multiple of
:func:`~.invariant.row_tile` (a sequence's last row repeated), MKL's float32 GEMM computes a row the same
way whatever the row count, the row's place and the batch count (``benchmarks/invariance_probe.py``: head
sizes 8-256, up to 600 rows, batches 1, 3 and 21, 1 and 2 threads, no difference; other counts differ), and
``sum`` over a contiguous last dimension of 32 adds a row the same way whatever the other rows. A block past a row's position adds exact zeros, so neither the call's
longest sequence, nor the padding, nor the other rows change a bit: prefill, decode, a prefix-cache hit
and any chunking agree (``tests/invariance`` holds the engine to ``==``).

Rows as the GEMMs' rows (rather than keys as rows, the earlier form) keep the library's fast path: a
decode row of the cost benchmark's model (2 query heads per KV head) is one GEMM of 4 rows (its rows
repeated), where the keys-as-rows form had GEMMs of 2 columns, which MKL runs 4-5x slower per product.
CPU per layer, one thread, 32 decode rows over 60-200 keys (8/4 heads of 32, 16-key cache blocks):
6.2-7.3 ms in the earlier form, 0.7 ms in this one (with :class:`PagedStep`'s plan, one gather and kept
scratch tensors), 0.9-1.1 ms for the default mode's decode attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .invariant import KEY_BLOCK, exp, exp_, row_tile
from .paged_kv import PagedKV


@dataclass
class RowGroup:
    """The sequences of one call that have the same number of query rows: one set of batched GEMMs.

    A sequence's rows enter the GEMMs in their order, then its last row repeated up to ``padded`` rows (a row
    is computed on its own, so a repeat changes no other row; its output is dropped). Its keys are read in
    blocks of :data:`~megatron_kernels.invariant.KEY_BLOCK` up to its last one, no further: one GEMM per
    (member, block) pair, the pairs block-major (every member's block 0, then block 1 of the members that
    have one, ...). The members are ordered by descending block count, so the members with a block ``b``
    are the first ``counts[b]``."""

    size: int  # query rows of each member
    padded: int  # rows of each member in the GEMMs (per query head of a KV head)
    members: list[int]  # the call's sequences, most key blocks first
    limits: list[int]  # each member's last position read
    counts: list[int]  # counts[b]: the members with a key block b
    pair_member: torch.Tensor  # [P] long: each pair's member (its index in ``members``)
    pair_block: torch.Tensor  # [P] long: each pair's key block
    gather: torch.Tensor  # [P * padded] long: the call's rows that fill each pair's GEMM
    rows: torch.Tensor | None  # [n * size] long: where each output row goes; None: rows 0.. of the call in order
    hidden: torch.Tensor  # [P, size * G * KEY_BLOCK] bool: keys of the pair's block a row (of each query head) does
    # not see, the rows that count only, as the scores lie (one contiguous run per pair: masked_fill_ 2x faster)

    def past_last_key(self) -> torch.Tensor:
        """``[P, KEY_BLOCK]`` bool: the keys of each pair's block past its member's last key (their values are
        read with zero weights: they must be finite)."""
        limits = torch.tensor(self.limits, device=self.pair_member.device)[self.pair_member]
        keys = self.pair_block[:, None] * KEY_BLOCK + torch.arange(KEY_BLOCK, device=limits.device)
        return keys > limits[:, None]


def plan_rows(rows_of: list[range | list[int]], positions_of: list[range | list[int]], group_heads: int,
              device: torch.device) -> list[RowGroup]:
    """Group a call's sequences by their row count. ``rows_of[s]``: the call's rows of sequence ``s`` (may be
    empty), ``positions_of[s]`` their positions (a sequence at position -1, a padding row of a replayed graph,
    is in no group: its rows are the caller's to fill)."""
    by_size: dict[int, list[int]] = {}
    for sequence, rows in enumerate(rows_of):
        if len(rows) and max(positions_of[sequence]) >= 0:  # a padding row (no key to see) is left out
            by_size.setdefault(len(rows), []).append(sequence)
    total = sum(len(rows) for rows in rows_of)
    groups, tile = [], row_tile()
    unit = tile // math.gcd(tile, group_heads)  # sequence rows whose heads fill whole GEMM tiles
    for size, members in by_size.items():
        padded = -(-size // unit) * unit
        members = sorted(members, key=lambda sequence: -max(positions_of[sequence]))
        limits = [max(positions_of[sequence]) for sequence in members]
        counts = [sum(limit // KEY_BLOCK >= block for limit in limits) for block in range(limits[0] // KEY_BLOCK + 1)]
        pair_member = [member for count in counts for member in range(count)]
        pair_block = [block for block, count in enumerate(counts) for _ in range(count)]
        member_rows, member_positions, out_rows = [], [], []
        for sequence in members:
            rows, where = list(rows_of[sequence]), list(positions_of[sequence])
            out_rows += rows
            member_rows.append(rows + rows[-1:] * (padded - size))
            member_positions.append(where + where[-1:] * (padded - size))
        pair_member_t = torch.tensor(pair_member, device=device)
        pair_block_t = torch.tensor(pair_block, device=device)
        keys = pair_block_t[:, None, None] * KEY_BLOCK + torch.arange(KEY_BLOCK, device=device)  # [P, 1, KEY_BLOCK]
        row_positions = torch.tensor(member_positions, device=device)[pair_member_t, :size]  # [P, size]
        hidden = (keys > row_positions[:, :, None]).unsqueeze(2).expand(-1, -1, group_heads, -1)
        in_order = len(by_size) == 1 and out_rows == list(range(total))
        groups.append(RowGroup(
            size, padded, members, limits, counts, pair_member_t, pair_block_t,
            torch.tensor(member_rows, device=device)[pair_member_t].view(-1),
            None if in_order else torch.tensor(out_rows, device=device),
            hidden.reshape(len(pair_member), -1)))
    return groups


class Workspace:
    """Scratch tensors kept from call to call for the engine's attention: a fresh tensor of a few MB is new
    pages from the system at every layer, and their first touch cost more than the arithmetic (32 decode rows
    over 60-200 keys: 2.6-4.8 ms a call with fresh tensors, 0.9-1.4 ms with these). One per model (its layers
    run one after another; two engines in one process run in two threads, each with its own). ``out=`` ops
    have no gradient, so a trainer's backward runs the same arithmetic without one. Tensors over
    :attr:`LIMIT` elements are not kept (a long prefill's scores would hold their memory for good)."""

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


def _out(workspace: Workspace | None, name: str, shape: tuple[int, ...], like: torch.Tensor,
         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{"out": scratch}`` for an op writing into the workspace, ``{}`` without one."""
    return {} if workspace is None else {"out": workspace.take(name, shape, dtype, like.device)}


def attend_group(q: torch.Tensor, group: RowGroup, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 workspace: Workspace | None = None) -> torch.Tensor:
    """The group's rows of ``q`` ``[R, Hq, D]`` over its pairs' ``keys``/``values`` ``[Hkv, P, KEY_BLOCK, D]``
    float32 (values finite wherever a weight is zero: a zero weight times NaN is NaN). Returns ``[n, size, Hkv,
    G, D]`` float32 (a view of ``workspace``'s tensors when given: copy it out before the next call), the
    members in the group's order. Without a workspace differentiable (a trainer's backward runs through it);
    the two give the same bits (the same kernels, in place or not)."""
    kv_heads, pairs, _, dim = keys.shape
    group_heads, count = q.shape[1] // kv_heads, len(group.members)
    width, real = group.padded * group_heads, group.size * group_heads
    batch = kv_heads * pairs
    q_heads = q.view(q.shape[0], kv_heads, group_heads * dim).permute(1, 0, 2)  # a KV head's query heads together
    q_rows = torch.index_select(q_heads, 1, group.gather,  # [Hkv, P * padded, G * D]: one copy
                                **_out(workspace, "q", (kv_heads, group.gather.numel(), group_heads * dim), q, q.dtype))
    scores = torch.bmm(q_rows.view(batch, width, dim).to(torch.float32), keys.view(batch, KEY_BLOCK, dim).transpose(1, 2),
                       **_out(workspace, "scores", (batch, width, KEY_BLOCK), q))
    # the softmax on the rows that count: a repeated row's scores are not read, its weights are zeros
    scores = scores.view(kv_heads, pairs, width, KEY_BLOCK)[:, :, :real]
    scores.mul_(scale).view(kv_heads, pairs, real * KEY_BLOCK).masked_fill_(group.hidden, float("-inf"))
    block_peak = scores.amax(-1)  # [Hkv, P, real]; a member's maximum over its blocks, exact in any order:
    peak = torch.full((kv_heads, count, real), float("-inf"), device=q.device).scatter_reduce(
        1, group.pair_member.view(1, pairs, 1).expand(kv_heads, pairs, real), block_peak, "amax")
    peak = peak.clamp_min(torch.finfo(torch.float32).min).index_select(1, group.pair_member).unsqueeze(-1)
    if workspace is None:
        weights = exp(scores - peak)  # [Hkv, P, real, KEY_BLOCK]
        padded = torch.nn.functional.pad(weights, (0, 0, 0, width - real))
    else:
        padded = workspace.take("weights", (kv_heads, pairs, width, KEY_BLOCK), torch.float32, q.device)
        weights = exp_(torch.sub(scores, peak, out=padded[:, :, :real]))
        padded[:, :, real:] = 0.0
    partial = torch.bmm(padded.view(batch, width, KEY_BLOCK), values.view(batch, KEY_BLOCK, dim),
                        **_out(workspace, "partial", (batch, width, dim), q))
    partial = partial.view(kv_heads, pairs, width, dim)[:, :, :real]
    sums = torch.sum(weights, -1, **_out(workspace, "sums", weights.shape[:-1], q))  # [Hkv, P, real]
    if workspace is None:
        acc, total = partial[:, :count].clone(), sums[:, :count].clone()
    else:
        acc = workspace.take("acc", (kv_heads, count, real, dim), torch.float32, q.device).copy_(partial[:, :count])
        total = workspace.take("total", (kv_heads, count, real), torch.float32, q.device).copy_(sums[:, :count])
    start = count
    for members in group.counts[1:]:  # one block after another from block 0, for the members that have it
        acc[:, :members].add_(partial[:, start:start + members])
        total[:, :members].add_(sums[:, start:start + members])
        start += members
    out = acc.div_(total.unsqueeze(-1)).view(kv_heads, count, group.size, group_heads, dim)
    return out.permute(1, 2, 0, 3, 4)


DensePlan = list[tuple[RowGroup, torch.Tensor, torch.Tensor]]
"""Per row group of a dense call: the group, its (sequence, key block) pairs' blocks in the call's
``[Hkv, S * blocks, KEY_BLOCK, D]`` keys, and the keys past each member's last (:meth:`RowGroup.past_last_key`)."""


def plan_dense(sequence: torch.Tensor, positions: torch.Tensor, count: int, length: int, group_heads: int,
               device: torch.device) -> DensePlan:
    """The plan of :func:`attention` for rows of ``sequence``/``positions`` over ``count`` sequences of ``length``
    keys: the same for every layer of a forward, so a caller may make it once (a trainer's layers)."""
    rows_of: list[list[int]] = [[] for _ in range(count)]
    positions_of: list[list[int]] = [[] for _ in range(count)]
    for row, (seq, position) in enumerate(zip(sequence.tolist(), positions.tolist())):
        rows_of[seq].append(row)
        positions_of[seq].append(position)
    blocks = -(-length // KEY_BLOCK)
    plan = []
    for group in plan_rows(rows_of, positions_of, group_heads, device):
        members = torch.tensor(group.members, device=device)
        plan.append((group, members[group.pair_member] * blocks + group.pair_block, group.past_last_key()))
    return plan


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor,
              positions: torch.Tensor, scale: float, plan: DensePlan | None = None) -> torch.Tensor:
    """Causal attention of query rows over their sequences' keys, keys reduced in blocks from key 0.

    ``q`` ``[R, Hq, D]``; ``keys``/``values`` ``[Hkv, S, L, D]``, heads first (``L`` at least every query's
    position plus one; entries past a sequence's last queried position may hold anything, NaN included);
    ``sequence[r]`` which of the ``S`` sequences row ``r`` reads; ``positions[r]`` its position (it sees keys
    ``0..positions[r]``). Returns ``[R, Hq, D]`` in ``q``'s dtype, computed in float32 by :func:`attend_group`,
    the same arithmetic as the engine's paged attention (:class:`PagedStep`). ``plan``: :func:`plan_dense`'s
    for these rows and shapes (made here when not given).
    """
    rows, heads, dim = q.shape
    kv_heads, count, length = keys.shape[:3]
    if plan is None:
        plan = plan_dense(sequence, positions, count, length, heads // kv_heads, q.device)
    blocks = -(-length // KEY_BLOCK)
    # reshape, not view: a length already a whole number of blocks pads nothing, and the caller's strided
    # keys (a trainer's transposed ``[B, Hkv, L, D]``) come back as they were
    keys_b, values_b = (torch.nn.functional.pad(cache.to(torch.float32), (0, 0, 0, blocks * KEY_BLOCK - length))
                        .reshape(kv_heads, count * blocks, KEY_BLOCK, dim) for cache in (keys, values))
    out = q.new_empty((rows, heads, dim), dtype=torch.float32)
    for group, pairs, past_last_key in plan:
        pair_values = values_b.index_select(1, pairs).masked_fill(past_last_key[None, :, :, None], 0.0)
        result = attend_group(q, group, keys_b.index_select(1, pairs), pair_values, scale).reshape(-1, heads, dim)
        out = result if group.rows is None else out.index_copy(0, group.rows, result)
    return out.to(q.dtype)


class PagedStep:
    """One engine step's attention over a paged KV cache (``[blocks, block_size, Hkv, D]``), planned once and
    run by every layer: the row groups and, per (member, key block) pair, the cache slots to read.

    A pair's keys are read in units of ``gcd(block_size, KEY_BLOCK)`` slots; the slots of a member's last pair
    past its last key may hold another request's old values, NaN included, or lie in a block the member does
    not own yet: their values are zeroed after the gather (their keys are masked). A cache stored heads first
    (``KVCachePool(heads_first=True)``, the CPU mode's) is gathered in one copy per layer and tensor; any other
    layout in two. Planning a step of 32 decode rows costs 0.15-0.2 ms once (Python lists and a few small
    tensors), paid back by the first layer (see the module docstring for the per-layer cost).
    """

    def __init__(self, rows_of: list[range], positions_of: list[range], tables: torch.Tensor, group_heads: int,
                 block_size: int, device: torch.device):
        self.group_heads, self.block_size = group_heads, block_size
        self.unit = math.gcd(block_size, KEY_BLOCK)
        groups = plan_rows(rows_of, positions_of, group_heads, device)
        self.groups = [(group, *self._slots(group, tables, device)) for group in groups]
        self.complete = sum(len(group.members) * group.size for group in groups) == sum(map(len, rows_of))

    def _slots(self, group: RowGroup, tables: torch.Tensor, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the cache units each pair reads, in order; the value slots to zero, flat over ``[P, KEY_BLOCK]``)."""
        unit, size = self.unit, self.block_size
        table = tables[torch.tensor(group.members, device=device)[group.pair_member]].long()  # [P, W]
        first = group.pair_block[:, None] * KEY_BLOCK + torch.arange(0, KEY_BLOCK, unit, device=device)
        blocks = table.gather(1, (first // size).clamp_max(table.shape[1] - 1)).clamp_min(0)
        units = blocks * (size // unit) + first % size // unit
        stale = group.past_last_key().view(-1).nonzero().squeeze(1)
        return units.view(-1), stale if stale.numel() else None

    def attend(self, q: torch.Tensor, cache: PagedKV, scale: float, out: torch.Tensor, workspace: Workspace
               ) -> torch.Tensor:
        """Every row of ``q`` ``[R, Hq, D]`` into ``out`` (``q``'s shape, any float dtype; padding rows zeros); an
        FP8 cache is dequantized with its scales."""
        if not self.complete:
            out.zero_()
        for group, units, stale in self.groups:
            keys = _gather(cache.k, units, self.unit, cache.k_scales, workspace, "keys")
            values = _gather(cache.v, units, self.unit, cache.v_scales, workspace, "values")
            if stale is not None:
                values.view(values.shape[0], -1, values.shape[-1]).index_fill_(1, stale, 0.0)
            result = attend_group(q, group, keys, values, scale, workspace)
            if group.rows is None:
                out.view(result.shape).copy_(result)
            else:
                out.index_copy_(0, group.rows, result.reshape(-1, *out.shape[1:]).to(out.dtype))
        return out


def _gather(cache: torch.Tensor, units: torch.Tensor, unit: int, scales: torch.Tensor | None, workspace: Workspace,
            name: str) -> torch.Tensor:
    """``[Hkv, P, KEY_BLOCK, D]`` float32 in the workspace's tensor ``name``: the cache's ``unit``-slot pieces in
    order, heads first (dequantized with ``scales`` from an FP8 cache)."""
    blocks, size, kv_heads, dim = cache.shape
    pieces = blocks * size // unit
    shape = (kv_heads, units.numel() * unit // KEY_BLOCK, KEY_BLOCK, dim)
    heads_first = cache.permute(2, 0, 1, 3)
    if heads_first.is_contiguous():
        source = heads_first.view(kv_heads, pieces, unit, dim)
        if cache.dtype == torch.float32 and scales is None:  # one copy
            out = workspace.take(name, (kv_heads, units.numel(), unit, dim), cache.dtype, cache.device)
            return torch.index_select(source, 1, units, out=out).view(shape)
        gathered = source.index_select(1, units).view(shape)
    else:
        gathered = cache.view(pieces, unit, kv_heads, dim).index_select(0, units).view(*shape[1:3], kv_heads, dim)
        gathered = gathered.permute(2, 0, 1, 3)
    if scales is not None:
        slot_scales = scales.view(pieces, unit, kv_heads).index_select(0, units).view(*shape[1:3], kv_heads)
        return torch.mul(gathered.to(torch.float32), slot_scales.permute(2, 0, 1).unsqueeze(-1),
                         out=workspace.take(name, shape, torch.float32, cache.device))
    return workspace.take(name, shape, torch.float32, cache.device).copy_(gathered)

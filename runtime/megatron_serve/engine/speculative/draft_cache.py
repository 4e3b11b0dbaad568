"""The draft model's own paged KV cache: per request, the tokens whose keys and values it holds, and their blocks.

Same layout as the engine's pool (``[layers, 2, blocks, block_size, kv_heads, head_dim]``) so the
model's attention kernels read it unchanged, but private to the drafter and simpler: no prefix
sharing, no preemption. A request's cached tokens are trimmed to the prefix its next call still
matches (guesses the target rejected are overwritten in place), and its blocks are trimmed to what
its next guesses need. The pool doubles when it runs out (one copy of the pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ...model.attention import AttentionMetadata, ForwardContext
from ...model.llama import LlamaForCausalLM
from .proposer import DraftInput

if TYPE_CHECKING:
    from ...model.mtp import MtpLayers


@dataclass
class _Entry:
    tokens: list[int] = field(default_factory=list)  # tokens whose keys and values are in ``blocks``, in order
    blocks: list[int] = field(default_factory=list)


@dataclass
class DraftRows:
    """One forward's packed rows: requests with one new row first (decode), then the longer chunks (prefill).

    ``request_ids`` and ``request_order`` are in the caller's order: request ``i``'s next-token logits
    are row ``request_order[i]`` of the logits of ``last_rows``.
    """

    device: torch.device
    request_ids: list[str]
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]  # per request in row order, padded with block 0 (never read past ``lens``)
    lens: list[int]  # per request in row order: cached tokens after this forward
    query_start: list[int]  # prefill chunks' offsets into the prefill rows
    num_decode: int
    last_rows: list[int]  # per request in row order: its last row
    request_order: list[int]

    @property
    def num_prefill(self) -> int:
        return len(self.lens) - self.num_decode

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def context(self, layer_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ForwardContext:
        """The attention metadata of these rows over ``layer_caches`` (the drafter's pool)."""
        decode, prefill = self.num_decode, self.num_prefill
        metadata = AttentionMetadata(
            slot_mapping=self.tensor(self.slots, torch.int64),
            num_decode_tokens=decode,
            decode_block_tables=self.tensor(self.tables[:decode], torch.int32) if decode else None,
            decode_context_lens=self.tensor(self.lens[:decode], torch.int32) if decode else None,
            prefill_block_tables=self.tensor(self.tables[decode:], torch.int32) if prefill else None,
            prefill_query_start_loc=self.tensor(self.query_start, torch.int32) if prefill else None,
            prefill_context_lens=self.tensor(self.lens[decode:], torch.int32) if prefill else None,
        )
        return ForwardContext(metadata, layer_caches)


class DraftCache:
    """Blocks of the drafter's KV pool, handed to requests and taken back, and the rows of each forward."""

    def __init__(self, model: "LlamaForCausalLM | MtpLayers", block_size: int, initial_blocks: int,
                 device: torch.device, num_layers: int | None = None):
        config = model.config
        self.block_size = block_size
        self.device = device
        self._shape = (num_layers or config.num_layers, 2, initial_blocks, block_size, model.num_local_kv_heads, config.head_dim)
        self._storage = torch.zeros(self._shape, dtype=model.dtype, device=device)
        self._free = list(range(initial_blocks))
        self._entries: dict[str, _Entry] = {}

    @property
    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self._storage]

    @property
    def num_blocks(self) -> int:
        return self._storage.shape[2]

    def cached_tokens(self, request_id: str) -> list[int]:
        entry = self._entries.get(request_id)
        return [] if entry is None else list(entry.tokens)

    def cached_kv(self, request_id: str) -> torch.Tensor:
        """``[layers, 2, cached tokens, kv_heads, head_dim]``: what the request's blocks hold (for checks)."""
        entry = self._entries[request_id]
        flat = self._storage[:, :, entry.blocks].flatten(2, 3)
        return flat[:, :, : len(entry.tokens)]

    def drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._free.extend(entry.blocks)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Forget the request's cached tokens past the first ``num_tokens`` (they are recomputed when asked)."""
        del self._entries[request_id].tokens[num_tokens:]

    def drop_all(self) -> None:
        for request_id in list(self._entries):
            self.drop(request_id)

    def _grow(self, needed: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + needed)
        storage = torch.zeros((*self._shape[:2], new, *self._shape[3:]), dtype=self._storage.dtype, device=self.device)
        storage[:, :, :old] = self._storage
        self._storage = storage
        self._free.extend(range(old, new))

    def _reserve(self, entry: _Entry, num_tokens: int) -> None:
        """Exactly enough blocks for ``num_tokens`` tokens (extra ones go back to the pool)."""
        need = -(-num_tokens // self.block_size)
        if need < len(entry.blocks):
            self._free.extend(entry.blocks[need:])
            del entry.blocks[need:]
        missing = need - len(entry.blocks)
        if missing > len(self._free):
            self._grow(missing - len(self._free))
        entry.blocks.extend(self._free[:missing])
        del self._free[:missing]

    def prepare(self, requests: list[tuple[str, list[int], int]]) -> DraftRows:
        """Rows that bring each ``(request id, all its tokens, guesses wanted)`` up to date: the tokens past the
        cached prefix that still matches (at least the last one, whose logits give the first guess)."""
        new_rows = []
        for request_id, tokens, wanted in requests:
            entry = self._entries.setdefault(request_id, _Entry())
            keep = 0
            limit = min(len(entry.tokens), len(tokens) - 1)
            while keep < limit and entry.tokens[keep] == tokens[keep]:
                keep += 1
            del entry.tokens[keep:]
            self._reserve(entry, len(tokens) + wanted - 1)
            new_rows.append(tokens[keep:])
        return self._rows([request_id for request_id, _, _ in requests], new_rows)

    def extend(self, rows: DraftRows, keep: list[int], tokens: list[int]) -> DraftRows:
        """One row per request ``rows.request_ids[keep[j]]``: its guess ``tokens[j]`` (blocks reserved by ``prepare``)."""
        return self._rows([rows.request_ids[j] for j in keep], [[token] for token in tokens])

    def _rows(self, request_ids: list[str], new_tokens: list[list[int]]) -> DraftRows:
        order = sorted(range(len(request_ids)), key=lambda i: len(new_tokens[i]) != 1)  # decode rows first, stable
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, lens, last_rows, query_start = [], [], [], [0]
        num_decode = sum(len(chunk) == 1 for chunk in new_tokens)
        width = max(len(self._entries[request_id].blocks) for request_id in request_ids)
        request_order = [0] * len(request_ids)
        for row_index, i in enumerate(order):
            entry, chunk = self._entries[request_ids[i]], new_tokens[i]
            start = len(entry.tokens)
            for position in range(start, start + len(chunk)):
                positions.append(position)
                slots.append(entry.blocks[position // self.block_size] * self.block_size + position % self.block_size)
            token_ids.extend(chunk)
            entry.tokens.extend(chunk)
            tables.append(entry.blocks + [0] * (width - len(entry.blocks)))
            lens.append(len(entry.tokens))
            last_rows.append(len(token_ids) - 1)
            if row_index >= num_decode:
                query_start.append(query_start[-1] + len(chunk))
            request_order[i] = row_index
        return DraftRows(self.device, request_ids, token_ids, positions, slots, tables, lens, query_start,
                         num_decode, last_rows, request_order)


def guesses_wanted(inputs: Sequence[DraftInput], max_positions: int,
                   usable: Callable[[DraftInput], bool]) -> dict[int, int]:
    """How many guesses each input that ``usable`` accepts gets, by its index: what it asks for, as far as the
    drafter's rotary table reaches (the last guess is fed at position ``length + k - 2``)."""
    wanted: dict[int, int] = {}
    for index, item in enumerate(inputs):
        count = min(item.num_tokens, max_positions - len(item.token_ids) + 1)
        if count > 0 and usable(item):
            wanted[index] = count
    return wanted


def chain_guesses(cache: DraftCache, rows: DraftRows, wanted: dict[int, int], out: list[list[int]],
                  forward: Callable[[DraftRows, list[int] | None], list[int]]) -> None:
    """Greedy guesses fed back one forward at a time, into ``out`` (by input index): ``forward(rows, kept)`` gives
    each row's next token (``kept``: which of the previous forward's rows go on, None the first time), and a
    request stops once it has the guesses it wanted."""
    order: list[int] = list(wanted)
    kept: list[int] | None = None
    for _ in range(max(wanted.values())):
        live = []
        for position, (index, token) in enumerate(zip(order, forward(rows, kept))):
            out[index].append(token)
            if len(out[index]) < wanted[index]:
                live.append((position, index, token))
        if not live:
            return
        order, kept = [index for _, index, _ in live], [position for position, _, _ in live]
        rows = cache.extend(rows, kept, [token for _, _, token in live])

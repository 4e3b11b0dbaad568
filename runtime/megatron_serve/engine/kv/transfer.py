"""Prefill/decode disaggregation on the engine's side: the KV blocks of a prefilled request, out and in.

A prefill engine is told per request (``kv_transfer_params`` ``{"do_remote_decode": true}``, vLLM's shape) that
the request's KV goes on to a decode engine: when the request leaves this engine after its first token, its
blocks are copied to host memory before the pool frees them (:class:`~.park.ParkedKV`'s copy) and wait in
:meth:`KVTransfer.take` for the process to send them (``KV_BLOCKS`` in parts, :mod:`megatron_serve.wire.kv_blocks`).
A decode engine keeps the parts that arrive (:meth:`KVTransfer.arrive`) until their request comes
(``{"do_remote_prefill": true}``), then allocates blocks of its own, copies the contents in and starts the
request with those tokens computed: it runs the first token as its first input, and never the prompt.

Blocks it cannot use (other weights, another pool layout, no room in the pool now) are not an error: the
request computes its context itself, and its tokens are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from ...wire.engine_stats import KV_TRANSFER, KV_TRANSFER_DIRECTIONS
from ...wire.kv_blocks import MAX_PART_BYTES, KVBlocks, KVTensor
from ...wire.request import FinishReason, RequestStatus
from .cache import BlockAllocator, KVCachePool, blocks_for_tokens
from .park import ParkedKV
from ..sequence import Sequence
from ..tenancy import base_band

logger = logging.getLogger("megatron_serve.engine")

SENT, RECEIVED = KV_TRANSFER_DIRECTIONS
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.float8_e4m3fn: "float8_e4m3fn"}


@dataclass
class TransferCounts:
    """Requests' blocks sent and received, and their bytes (``/metrics``: ``kv_transfer*_total``)."""

    transfers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_TRANSFER_DIRECTIONS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_TRANSFER_DIRECTIONS, 0))

    def count(self, direction: str, num_bytes: int) -> None:
        self.transfers[direction] += 1
        self.bytes[direction] += num_bytes

    def report(self, snapshot: dict) -> None:
        """Add the counts to a heartbeat's ``metrics`` (:mod:`megatron_serve.wire.engine_stats`)."""
        snapshot[KV_TRANSFER] = {direction: {"transfers": self.transfers[direction], "bytes": self.bytes[direction]}
                                 for direction in KV_TRANSFER_DIRECTIONS}


#: A rank's block tensors as ``KV_BLOCKS`` describes them: (dtype, block shape), in the pool's order
#: (:meth:`~.cache.KVCachePool.block_layout`).
Layout = list[tuple[torch.dtype, tuple[int, ...]]]


class OtherRanks(Protocol):
    """A group's other ranks, each holding its part of every block (engine/group/kv_handoff.py)."""

    def layouts(self) -> list[Layout]:
        """Each other rank's block tensors, in rank order."""
        ...

    def park(self, blocks: list[int]) -> list[list[torch.Tensor]]:
        """Each other rank's part of ``blocks``, copied to host memory, in rank order."""
        ...

    def restore(self, blocks: list[int], parts: list[list[torch.Tensor]]) -> None:
        """Each other rank copies its part (``parts``, in rank order) into ``blocks`` of its pool."""
        ...


class NoOtherRanks:
    """A group of one rank."""

    def layouts(self) -> list[Layout]:
        return []

    def park(self, blocks: list[int]) -> list[list[torch.Tensor]]:
        return []

    def restore(self, blocks: list[int], parts: list[list[torch.Tensor]]) -> None:
        pass


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


class KVTransfer:
    """One engine's blocks sent after prefill and received for decode (see the module docstring)."""

    def __init__(self, pool: KVCachePool, allocator: BlockAllocator, block_size: int,
                 others: OtherRanks | None = None):
        self.pool = pool
        self.allocator = allocator
        self.block_size = block_size
        self.others = others if others is not None else NoOtherRanks()  # a group's other ranks hold parts too
        self.counts = TransferCounts()
        self._to_send: set[str] = set()  # requests whose blocks go on once they leave after their first token
        self._ready: list[tuple[str, int, int, list[torch.Tensor]]] = []  # (request id, epoch, tokens, host copies)
        self._arrived: dict[str, list[KVBlocks]] = {}  # parts received for a request that has not come yet

    def send_after_prefill(self, request_id: str) -> None:
        """Copy ``request_id``'s blocks out when it leaves this engine after its first token."""
        self._to_send.add(request_id)

    def on_leave(self, sequence: Sequence, epoch: int) -> None:
        """A request leaves (its blocks are freed next): keep a copy of its blocks when they go on. Only a
        request that stopped at its length limit continues elsewhere; one that stopped, failed or was aborted
        is over, and its blocks go nowhere."""
        if sequence.request_id not in self._to_send:
            return
        self._to_send.discard(sequence.request_id)
        kv_epoch = epoch if sequence.kv_epoch is None else sequence.kv_epoch
        if (sequence.status is not RequestStatus.COMPLETED or sequence.finish_reason is not FinishReason.LENGTH
                or not sequence.num_computed or kv_epoch < 0):
            return
        blocks = sequence.block_table[:blocks_for_tokens(sequence.num_computed, self.block_size)]
        host = ParkedKV.park(self.pool, blocks, kv_epoch).host
        host += [tensor for part in self.others.park(blocks) for tensor in part]  # rank 0's, then each other rank's
        self._ready.append((sequence.request_id, kv_epoch, sequence.num_computed, host))

    def take(self, engine_id: str) -> list[KVBlocks]:
        """The blocks copied out since the last call, as the ``KV_BLOCKS`` parts of registration ``engine_id``."""
        ready, self._ready = self._ready, []
        out = []
        for rid, epoch, tokens, host in ready:
            per_part = max(MAX_PART_BYTES // sum(t[0].numel() * t.element_size() for t in host), 1)
            for first in range(0, host[0].shape[0], per_part):
                pieces = [t[first:first + per_part] for t in host]
                tensors = [KVTensor(_DTYPES[p.dtype], tuple(p.shape), _as_bytes(p)) for p in pieces]
                out.append(KVBlocks(request_id=rid, engine_id=engine_id, epoch=epoch, block_size=self.block_size,
                                    num_tokens=tokens, tensors=tensors, first_block=first))
            self.counts.count(SENT, sum(t.numel() * t.element_size() for t in host))
        return out

    def arrive(self, part: KVBlocks) -> None:
        """A part of a prefilled request's blocks, ahead of the request (the coordinator sends them first)."""
        self._arrived.setdefault(part.request_id, []).append(part)

    def discard(self, request_id: str) -> None:
        """Drop the parts of a request that came without asking for them (sent before a move: not its blocks)."""
        self._arrived.pop(request_id, None)

    def clear(self) -> None:
        """Forget every part and mark (a new registration: the coordinator sends its requests again)."""
        self._arrived.clear()
        self._to_send.clear()
        self._ready.clear()

    def receive(self, sequence: Sequence, epoch: int, waiting: Iterable[Sequence]) -> bool:
        """Start a request just added (``sequence``, among the scheduler's ``waiting``, nothing computed) on the
        prefilled blocks whose parts arrived for it; whether they were used (if not, the request computes its
        context itself)."""
        kv, why = _whole(self._arrived.pop(sequence.request_id, []))
        if kv is not None:
            why = self._unusable(sequence, kv, epoch)
        if why is None and not any(s is sequence for s in waiting):
            why = "the request waits for its LoRA adapter"  # blocks are held from admission on, not before
        if why is not None:
            logger.warning("request %s: prefilled KV not used, its context is computed here: %s",
                           sequence.request_id, why)
            return False
        blocks = self.allocator.allocate(kv.num_blocks, base_band(sequence))
        host = [torch.frombuffer(bytearray(t.data), dtype=torch.uint8).view(dtype).view(t.shape)
                for t, (dtype, _) in zip(kv.tensors, self._layout())]
        mine = len(self.pool.block_tensors())
        ParkedKV(blocks, host[:mine], kv.epoch, kv.num_bytes, 0.0).restore(self.pool)
        parts, first = [], mine
        for layout in self.others.layouts():
            parts.append(host[first:first + len(layout)])
            first += len(layout)
        self.others.restore(blocks, parts)
        sequence.block_table = blocks
        sequence.num_computed = kv.num_tokens
        sequence.kv_epoch = kv.epoch
        # Found outside the device pool, as a host tier's blocks are: counted with them (vLLM counts a KV
        # connector's tokens as external prefix-cache hits), not as the device prefix cache's.
        sequence.host_tokens = kv.num_tokens
        self.counts.count(RECEIVED, kv.num_bytes)
        return True

    def _unusable(self, sequence: Sequence, kv: KVBlocks, epoch: int) -> str | None:
        if kv.epoch != epoch:
            return f"computed under weights epoch {kv.epoch}, this engine serves epoch {epoch}"
        if sequence.sampling_params.lora_name is not None:
            return "the request runs under a LoRA adapter, and the blocks carry no adapter version"
        if kv.block_size != self.block_size:
            return f"blocks of {kv.block_size} tokens, this engine's hold {self.block_size}"
        if sequence.num_computed or sequence.block_table or kv.num_tokens >= len(sequence.token_ids):
            return (f"{kv.num_tokens} tokens of KV for a request of {len(sequence.token_ids)} tokens "
                    f"({sequence.num_computed} computed here)")
        shapes = [(_DTYPES.get(dtype), (kv.num_blocks, *shape)) for dtype, shape in self._layout()]
        if [(t.dtype, tuple(t.shape)) for t in kv.tensors] != shapes:
            return "the blocks' layout differs from this engine's KV pool (another model, dtype or parallelism)"
        if kv.num_blocks > self.allocator.num_free:
            return f"{kv.num_blocks} blocks needed, {self.allocator.num_free} free"
        return None

    def _layout(self) -> Layout:
        """Every rank's block tensors, rank 0's first: what ``KV_BLOCKS`` carries for this engine."""
        return [*self.pool.block_layout(), *(entry for layout in self.others.layouts() for entry in layout)]


def _whole(parts: list[KVBlocks]) -> tuple[KVBlocks | None, str | None]:
    """A request's parts as one (each tensor's blocks in order), or why they are not a whole."""
    if not parts:
        return None, "no blocks arrived for it"
    parts = sorted(parts, key=lambda part: part.first_block)
    head = parts[0]
    expected = 0
    for part in parts:
        problem = part.problem()
        if problem is not None:
            return None, problem
        layout = [(t.dtype, t.shape[1:]) for t in part.tensors]
        if ((part.epoch, part.num_tokens, part.block_size) != (head.epoch, head.num_tokens, head.block_size)
                or layout != [(t.dtype, t.shape[1:]) for t in head.tensors] or part.first_block != expected):
            return None, f"its blocks came in parts that do not make one whole (a part at block {part.first_block})"
        expected += part.part_blocks
    if expected != head.num_blocks:
        return None, f"{expected} of its {head.num_blocks} blocks arrived"
    tensors = [KVTensor(first.dtype, (head.num_blocks, *first.shape[1:]),
                        b"".join(part.tensors[index].data for part in parts))
               for index, first in enumerate(head.tensors)]
    return msgspec.structs.replace(head, tensors=tensors, first_block=0), None

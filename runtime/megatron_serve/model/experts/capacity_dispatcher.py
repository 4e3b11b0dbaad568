"""The expert-parallel all-to-all with fixed-capacity buffers: no host synchronization and static shapes, so that a
step's MoE layers can be captured in a CUDA graph (the idea of DeepEP's low-latency mode, of vLLM's batched
all-to-all formats and of SGLang's graph-safe EP paths, over a plain ``all_to_all_single``).

The exact dispatchers (:mod:`.token_dispatcher`) size each all-to-all by the step's counts, read on the host
(``.tolist()``), which a capture forbids. Here every rank sends every other rank a buffer of ``slots`` rows, the
most its tokens can ever send there: its chunk of at most ``ceil(capacity / tp)`` tokens times ``min(top_k, E/ep)``
(a token sends at most one row per expert, and a rank holds ``E/ep`` of them). ``capacity`` is a token count every
rank of the expert-parallel group agrees on for the step (:class:`.expert_dispatch.ExpertStep`: a captured graph's
batch size, or the data-parallel group's agreed step size), at least this rank's own token count. The rows travel
with a second, small all-to-all of their metadata: each row's local expert id (-1 for an unused row: the
experts compute nothing for it, :func:`megatron_kernels.triton_moe.fused_moe`) and the token it came from. So the
real counts travel on the device, and every shape depends on ``(tokens, capacity)`` only.

Under ``ordered`` (``--batch-invariant``) a token's experts are added in its columns' order (ascending logical id), each
``(output * weight)`` rounded to the model dtype first, into zeros, by the exact dispatchers' own combine
(:func:`.token_dispatcher.weighted_sum`, the ``index_add_`` of :func:`megatron_kernels.invariant.fused_moe` on one
rank): so the layer's output is bitwise one rank's.

Unused rows cost bytes on the wire (a buffer moves whole) but no expert arithmetic; a step larger than the graphs
uses the exact dispatchers, whose traffic is the real count (:class:`.expert_dispatch.StepDispatcher`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import TensorParallel
from . import token_dispatcher
from .token_dispatcher import Dispatched, gather_chunks


def chunk_bounds(num_tokens: int, size: int) -> list[int]:
    """The token chunks of ``size`` tensor-parallel ranks: rank ``r`` combines tokens ``bounds[r] .. bounds[r + 1]``
    (the exact dispatchers' split, so the shared expert and the gather see the same chunks)."""
    return [num_tokens * r // size for r in range(size + 1)]


class CapacityDispatcher:
    """Fixed-capacity dispatch and combine over the expert-parallel group: EP over the tensor-parallel ranks
    (``tp.group``) or, with data-parallel attention, every rank of every data-parallel rank
    (``tp.data_parallel.group``). ``capacity``: a callable giving the step's agreed token count (read at each
    dispatch; a captured graph keeps the value it was captured with)."""

    def __init__(self, tp: TensorParallel, num_experts: int, top_k: int, capacity):
        self.tp = tp
        self.per_rank = num_experts // tp.expert_size
        self.rows_per_token = min(top_k, self.per_rank)
        self.group = tp.data_parallel.group if tp.data_parallel.size > 1 else tp.group
        self.capacity = capacity
        self.ordered = False
        self.local = slice(0, 0)
        self._bounds = [0, 0]
        self._index = torch.empty(0, dtype=torch.int64)  # each local pair's row in the send buffer
        self._ids = torch.empty(0, dtype=torch.int64)  # each local pair's expert id [n, k]

    def slots(self, capacity: int) -> int:
        """Rows one rank sends each other rank for a step of ``capacity`` tokens."""
        return -(-capacity // self.tp.size) * self.rows_per_token

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Dispatched:
        """Each local (token, expert) pair into its owner's part of the send buffer, at the pair's rank among the
        pairs going there (a stable sort: no count leaves the device); one all-to-all of the rows, one of their
        metadata."""
        tp, top_k = self.tp, ids.shape[1]
        num_tokens, capacity = hidden.shape[0], self.capacity()
        if capacity < num_tokens:
            raise ValueError(f"an expert-parallel step of {num_tokens} tokens over buffers for {capacity}")
        bounds = self._bounds = chunk_bounds(num_tokens, tp.size)
        self.local = slice(bounds[tp.rank], bounds[tp.rank + 1])
        ep, slots, device = tp.expert_size, self.slots(capacity), hidden.device
        self._ids = ids[self.local].to(torch.int64)
        flat = self._ids.reshape(-1)
        owner = flat // self.per_rank
        order = torch.argsort(owner, stable=True)  # by owner; within one, in pair order (ascending per token)
        counts = torch.zeros(ep, dtype=torch.int64, device=device).scatter_add_(0, owner, torch.ones_like(owner))
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=device) - starts[owner[order]]
        index = self._index = owner * slots + position
        pair_tokens = torch.arange(flat.numel(), device=device) // top_k
        send = hidden.new_zeros((ep * slots, hidden.shape[1]))
        send[index] = hidden[self.local.start + pair_tokens]
        meta = torch.full((ep * slots, 2), -1, dtype=torch.int64, device=device)  # (local expert id, token)
        meta[index] = torch.stack([flat - owner * self.per_rank, bounds[tp.rank] + pair_tokens], dim=1)
        rows = torch.empty_like(send)
        received = torch.empty_like(meta)
        dist.all_to_all_single(rows, send, group=self.group)
        dist.all_to_all_single(received, meta, group=self.group)
        tokens = received[:, 1] if tp.data_parallel.size == 1 else None  # (other data-parallel ranks' tokens)
        return Dispatched(rows, received[:, :1], tokens)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The outputs back to the ranks their rows came from (one all-to-all); each local pair's picked from its
        row, a token's in ascending expert order, weighted and summed (:func:`.token_dispatcher.weighted_sum`, the
        exact dispatchers' arithmetic)."""
        back = torch.empty_like(outputs)
        dist.all_to_all_single(back, outputs.contiguous(), group=self.group)
        count, top_k = self.local.stop - self.local.start, weights.shape[1]
        if self.ordered:  # a token's experts in column order (the block sorted them by logical id)
            pairs = torch.arange(count * top_k, device=outputs.device)
        else:
            ascending = torch.argsort(self._ids, dim=1)
            pairs = (torch.arange(count, device=outputs.device)[:, None] * top_k + ascending).reshape(-1)
        tokens = torch.arange(count * top_k, device=outputs.device) // top_k
        # through the module, as the exact dispatchers call it (a test's control replaces it for every dispatcher)
        return token_dispatcher.weighted_sum(back[self._index[pairs]], weights[self.local].reshape(-1)[pairs],
                                             tokens, count, self.ordered, top_k)

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        return gather_chunks(self.tp, chunk, self._bounds)

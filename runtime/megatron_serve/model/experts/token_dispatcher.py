"""Expert-parallel token dispatchers: how an MoE layer's (token, expert) pairs reach the ranks holding their
experts, and how the experts' outputs come back (Megatron-core's ``moe/token_dispatcher.py``, one object
per layout).

Under ``--enable-expert-parallel`` rank ``r`` of a group of ``ep`` ranks holds experts
``r * E/ep .. (r + 1) * E/ep - 1`` whole. Attention stays tensor-parallel, so every rank enters the MoE
layer with every token's hidden state, and the router is replicated: every rank knows every token's
experts, hence how many rows each rank sends each other rank, without exchanging counts.

* :class:`AllToAllDispatcher` (the default): each rank takes a contiguous chunk of the tokens, sends each
  of its (token, expert) pairs to the expert's owner (one ``all_to_all_single``), gets the expert outputs
  back (a second one), combines its tokens (the replicated shared expert adds its term to them), and the
  chunks are gathered on every rank (an all-gather).
* :class:`DataParallelDispatcher` (data-parallel attention, ``ep = dp x tp``): each data-parallel rank has tokens
  of its own, so the routing is known only within it; the send counts are exchanged first, and each row travels
  with its expert id.
* :class:`AllGatherDispatcher`: no token moves; each rank runs its experts on every token routed to them
  and the partial sums are reduced (one all-reduce), as the tensor-parallel layer does.

All hand the experts rows of one expert each (``ids [m, 1]``, local ids) and get back each row's
unweighted output; the router weights are applied in :meth:`combine` (:meth:`dispatch` takes them too, for
dispatchers whose combine cannot apply them there: DeepEP's, :mod:`.deepep_dispatcher`). ``ordered``
(``--batch-invariant``): a token's experts are added in the order of its columns, which the MoE block sorted by
logical expert id (:meth:`.moe.SparseMoeBlock.forward`: under EPLB the ids dispatched are physical, whose order is
the placement's), each ``(output * weight)`` rounded to the model dtype first, into zeros, which is
:func:`megatron_kernels.invariant.fused_moe`'s arithmetic on one rank: so the layer's output is bitwise one rank's.
Otherwise the weighted outputs are summed in float32.

``num_experts`` is the layer's physical experts (its logical ones without EPLB, :mod:`.eplb`); rank ``r`` holds
``r * P/ep ..``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..parallel import TensorParallel


@dataclass(frozen=True)
class Dispatched:
    """What a rank's experts run on: ``rows [m, H]``, their local expert ids ``[m, 1]``, and the token each row
    came from (``[m]``, index into the layer's tokens: the LoRA hook picks an adapter's rows by it)."""

    rows: torch.Tensor
    ids: torch.Tensor
    tokens: torch.Tensor | None  # None when rows come from other data-parallel ranks' tokens (no adapters then)


class TokenDispatcher(Protocol):
    """One layout's dispatch and combine; :meth:`dispatch` keeps what the same layer's :meth:`combine` and
    :meth:`gather` need. ``local``: the tokens whose output :meth:`combine` gives this rank (a replicated shared
    expert adds its term to those rows before :meth:`gather`)."""

    ordered: bool
    local: slice

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Dispatched: ...

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...

    def gather(self, local: torch.Tensor) -> torch.Tensor: ...


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int,
                 ordered: bool, top_k: int) -> torch.Tensor:
    """Each token's expert outputs times their router weights, summed into ``[num_tokens, H]``.

    ``ordered``: rows come grouped by token (``tokens`` ascending), a token's at most ``top_k`` in the order they
    are to be added; each product is rounded to the model dtype and added in that order into zeros, as the
    invariant kernel does. The rows are laid out ``[num_tokens, top_k, H]`` and added one column at a time, not
    by one ``index_add_`` of every row: that adds them one after another on a CPU but in any order on a GPU (its
    atomic adds). No host synchronization: CUDA graphs capture it.
    """
    if ordered:
        scaled = (outputs * weights[:, None]).to(outputs.dtype)
        place = torch.arange(tokens.numel(), device=tokens.device) - torch.searchsorted(tokens, tokens)
        columns = scaled.new_zeros((num_tokens, top_k, scaled.shape[1]))
        columns[tokens, place] = scaled
        total = scaled.new_zeros((num_tokens, scaled.shape[1]))
        for column in range(top_k):
            total = total + columns[:, column]
        return total
    total = torch.zeros((num_tokens, outputs.shape[1]), dtype=torch.float32, device=outputs.device)
    return total.index_add_(0, tokens, outputs.float() * weights.float()[:, None]).to(outputs.dtype)


class AllGatherDispatcher:
    """Every token stays on every rank; a rank runs its own experts and the partial sums are reduced (in rank
    order under ``ordered``: bitwise one rank's only while a token's experts sit on at most two ranks in turn)."""

    def __init__(self, tp: TensorParallel, num_experts: int):
        self.tp = tp
        self.per_rank = num_experts // tp.size
        self.ordered = False
        self.local = slice(0, 0)
        self._pairs: torch.Tensor | None = None

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Dispatched:
        flat = ids.reshape(-1)
        first = self.tp.rank * self.per_rank
        mine = ((flat >= first) & (flat < first + self.per_rank)).nonzero().squeeze(1)
        pairs = mine[torch.argsort(flat[mine], stable=True)]  # by expert: ascending per token
        self._pairs, self.local = pairs, slice(0, hidden.shape[0])
        tokens = pairs // ids.shape[1]
        return Dispatched(hidden[tokens], (flat[pairs] - first).unsqueeze(1), tokens)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        pairs = self._pairs
        if self.ordered:  # each token's rows in column order
            order = torch.argsort(pairs)
            outputs, pairs = outputs[order], pairs[order]
        out = weighted_sum(outputs, weights.reshape(-1)[pairs], pairs // weights.shape[1], self.local.stop,
                           self.ordered, weights.shape[1])
        return self.tp.ordered_sum(out) if self.ordered else self.tp.all_reduce(out)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return local


@dataclass(frozen=True)
class _Exchange:
    """One layer's all-to-all, as every rank computes it from the replicated routing."""

    bounds: list[int]  # token chunk of rank r: bounds[r] .. bounds[r + 1]
    counts: list[list[int]]  # counts[s][d]: pairs of rank s's chunk whose expert rank d holds
    sent: torch.Tensor  # this rank's pairs in the order it sends them: by expert (so by owner), ascending per token
    received: torch.Tensor  # the pairs this rank's experts get, in the order they arrive


class AllToAllDispatcher:
    """Each rank sends its chunk of the tokens to its experts' owners and combines what comes back.

    A rank's chunk may be empty (one decode token over two ranks): its all-to-alls move nothing, and it
    still joins them, so no collective waits.
    """

    def __init__(self, tp: TensorParallel, num_experts: int):
        self.tp = tp
        self.per_rank = num_experts // tp.size
        self.num_experts = num_experts
        self.ordered = False
        self.local = slice(0, 0)
        self._exchange: _Exchange | None = None

    def _plan(self, ids: torch.Tensor) -> _Exchange:
        size, device = self.tp.size, ids.device
        num_tokens, top_k = ids.shape
        bounds = [num_tokens * r // size for r in range(size + 1)]
        flat = ids.reshape(-1).to(torch.int64)
        pair_tokens = torch.arange(flat.numel(), device=device) // top_k
        source = torch.bucketize(pair_tokens, torch.tensor(bounds[1:-1], device=device), right=True)
        order = torch.argsort(source * self.num_experts + flat, stable=True)  # by source rank, then expert
        owner = flat[order] // self.per_rank
        counts = torch.bincount(source[order] * size + owner, minlength=size * size).view(size, size).tolist()
        starts = [0]
        for row in counts:
            starts.append(starts[-1] + sum(row))
        rank = self.tp.rank
        sent = order[starts[rank]:starts[rank + 1]]
        received = [order[starts[s] + sum(counts[s][:rank]):starts[s] + sum(counts[s][:rank + 1])] for s in range(size)]
        return _Exchange(bounds, counts, sent, torch.cat(received))

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Dispatched:
        exchange = self._exchange = self._plan(ids)
        rank, top_k = self.tp.rank, ids.shape[1]
        self.local = slice(exchange.bounds[rank], exchange.bounds[rank + 1])
        send = hidden[exchange.sent // top_k]
        rows = hidden.new_empty((exchange.received.numel(), hidden.shape[1]))
        dist.all_to_all_single(rows, send, [c[rank] for c in exchange.counts], exchange.counts[rank],
                               group=self.tp.group)
        local_ids = ids.reshape(-1)[exchange.received].to(torch.int64) - rank * self.per_rank
        return Dispatched(rows, local_ids.unsqueeze(1), exchange.received // top_k)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        exchange, rank = self._exchange, self.tp.rank
        back = outputs.new_empty((exchange.sent.numel(), outputs.shape[1]))
        dist.all_to_all_single(back, outputs.contiguous(), exchange.counts[rank], [c[rank] for c in exchange.counts],
                               group=self.tp.group)
        top_k, sent = weights.shape[1], exchange.sent
        if self.ordered:  # each token's rows in column order
            order = torch.argsort(sent)
            back, sent = back[order], sent[order]
        return weighted_sum(back, weights.reshape(-1)[sent], sent // top_k - self.local.start,
                            self.local.stop - self.local.start, self.ordered, top_k)

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        return gather_chunks(self.tp, chunk, self._exchange.bounds)


def gather_chunks(tp: TensorParallel, chunk: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Every tensor-parallel rank's chunk on every one of them (padded to the longest: gloo gathers equal sizes).
    With no tokens at all (an idle data-parallel rank) there is nothing to gather, on any of its ranks alike."""
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if tp.size == 1 or not longest:
        return chunk
    padded = chunk.new_zeros((longest, chunk.shape[1]))
    padded[:chunk.shape[0]] = chunk
    parts = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(parts, padded, group=tp.group)
    return torch.cat([part[:b - a] for part, a, b in zip(parts, bounds, bounds[1:])])


class DataParallelDispatcher:
    """All-to-all over every rank of every data-parallel attention rank (``tp.data_parallel.group``).

    A data-parallel rank's tensor-parallel ranks split its tokens into chunks, as :class:`AllToAllDispatcher` does;
    each rank sends its chunk's (token, expert) pairs, sorted by expert (so by owner, and ascending per token), to
    the experts' owners among all ``dp x tp`` ranks. The other data-parallel ranks' routing is unknown here, so the
    counts go first (one all-to-all of ``dp x tp`` integers) and each row's expert id with it. A data-parallel rank
    with nothing to run enters every MoE layer with no tokens: it sends nothing, runs its experts on what the
    others send, and sends their outputs back, so no collective waits for it.
    """

    def __init__(self, tp: TensorParallel, num_experts: int):
        self.tp = tp
        self.per_rank = num_experts // tp.expert_size
        self.ordered = False
        self.local = slice(0, 0)
        self._bounds: list[int] = [0, 0]
        self._sent = torch.empty(0, dtype=torch.int64)  # this chunk's pairs in the order they were sent
        self._send_counts: list[int] = []
        self._receive_counts: list[int] = []

    def _all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_counts: list[int],
                    input_counts: list[int]) -> torch.Tensor:
        dist.all_to_all_single(output, tensor.contiguous(), output_counts, input_counts,
                               group=self.tp.data_parallel.group)
        return output

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Dispatched:
        tp, top_k = self.tp, ids.shape[1]
        bounds = self._bounds = [ids.shape[0] * r // tp.size for r in range(tp.size + 1)]
        self.local = slice(bounds[tp.rank], bounds[tp.rank + 1])
        flat = ids[self.local].reshape(-1).to(torch.int64)
        self._sent = torch.argsort(flat, stable=True)
        experts = flat[self._sent]
        send_counts = torch.bincount(experts // self.per_rank, minlength=tp.expert_size)
        receive_counts = self._all_to_all(torch.empty_like(send_counts), send_counts, [1] * tp.expert_size,
                                          [1] * tp.expert_size)
        self._send_counts, self._receive_counts = send_counts.tolist(), receive_counts.tolist()
        received = sum(self._receive_counts)
        rows = self._all_to_all(hidden.new_empty((received, hidden.shape[1])),
                                hidden[self.local.start + self._sent // top_k], self._receive_counts,
                                self._send_counts)
        local_ids = self._all_to_all(experts.new_empty(received), experts, self._receive_counts, self._send_counts)
        return Dispatched(rows, (local_ids - tp.expert_rank * self.per_rank).unsqueeze(1), None)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        back = self._all_to_all(outputs.new_empty((self._sent.numel(), outputs.shape[1])), outputs,
                                self._send_counts, self._receive_counts)
        top_k, sent = weights.shape[1], self._sent
        if self.ordered:  # each token's rows in column order
            order = torch.argsort(sent)
            back, sent = back[order], sent[order]
        return weighted_sum(back, weights[self.local].reshape(-1)[sent], sent // top_k,
                            self.local.stop - self.local.start, self.ordered, top_k)

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        return gather_chunks(self.tp, chunk, self._bounds)

"""DeepEP's all-to-all kernels for expert parallelism on GPUs (``deep_ep.Buffer``, DeepEP's V1 interface, which
vLLM and SGLang use): normal mode for prefill-sized steps, low-latency mode for decode-sized ones, as SGLang's
``--deepep-mode auto`` picks.

* **Normal mode** (``Buffer.dispatch`` / ``Buffer.combine``, NVLink within a node, RDMA across): each token reaches a
  rank once, with its top-k ids made local (-1 for experts held elsewhere) and its router weights; the combine adds
  the ranks' outputs without weights. So this rank expands what it received into rows of one expert each, runs its
  experts, and sums each received token's weighted rows (float32) before the combine. Its received counts are read
  on the host: steps in normal mode run eagerly.
* **Low-latency mode** (``Buffer.low_latency_dispatch`` / ``low_latency_combine``): every rank receives a fixed
  ``[E/ep, ep x max_tokens, H]`` slab per local expert, of which the first ``count[e]`` rows are used; the combine
  weighs and adds. No host synchronization: these steps can be captured in CUDA graphs. Its buffers hold at most
  ``max_tokens`` tokens a rank, so steps up to the largest graph use it and larger ones normal mode.

Every rank of the expert-parallel group picks the same mode in each layer, from the step's size as every rank sees
it (:meth:`StepSize.group_tokens`, of the step's :class:`.dispatch.ExpertStep`). DeepEP adds a token's experts in its
own order, so ``--batch-invariant`` (one rank's bits) never runs it, nor LoRA adapters on the experts (the received
rows do not say which of this rank's adapter rows they are).

The layout conversions before and after the kernels (:func:`low_latency_rows`, :func:`normal_pairs`,
:func:`normal_sum`) are plain tensor code; ``deep_ep`` is imported only where a backend asks for it
(:mod:`megatron_serve.engine.experts.backend`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .capacity_dispatcher import chunk_bounds
from ..parallel import TensorParallel
from .token_dispatcher import Dispatched, gather_chunks

#: Hidden sizes DeepEP's low-latency kernels are compiled for (its ``SWITCH_HIDDEN``).
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)


class StepSize(Protocol):
    """What a DeepEP dispatcher reads of the step its layer runs in: the step's size as every rank of the group sees
    it. :class:`.dispatch.ExpertStep` is one; its module picks the layer's dispatcher, so it stands above this one."""

    def group_tokens(self, local: int) -> int: ...


def low_latency_rows(packed: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A low-latency dispatch's ``[E/ep, slots, H]`` slabs as the experts' rows ``[E/ep x slots, H]`` and local ids
    ``[E/ep x slots, 1]``: row ``s`` of expert ``e``'s slab is expert ``e``'s while ``s < counts[e]``, else no
    expert (-1). Static shapes, no host synchronization."""
    experts, slots, hidden = packed.shape
    slot = torch.arange(slots, device=packed.device)
    expert = torch.arange(experts, device=packed.device)[:, None].expand(experts, slots)
    ids = torch.where(slot[None, :] < counts.to(slot.dtype)[:, None], expert, -1)
    return packed.reshape(experts * slots, hidden), ids.reshape(-1, 1)


def normal_pairs(received_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (received token, top-k slot) pairs a normal-mode dispatch gave this rank's experts (ids ``>= 0``), as two
    index vectors, in received order then slot order."""
    pairs = (received_ids >= 0).nonzero()
    return pairs[:, 0], pairs[:, 1]


def normal_sum(outputs: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_received: int
               ) -> torch.Tensor:
    """Each received token's expert outputs times their router weights, summed in float32 into ``[num_received, H]``
    in the model dtype: what a normal-mode combine adds across ranks."""
    total = torch.zeros((num_received, outputs.shape[1]), dtype=torch.float32, device=outputs.device)
    return total.index_add_(0, tokens, outputs.float() * weights.float()[:, None]).to(outputs.dtype)


class DeepEPBuffers:
    """The expert-parallel group's ``deep_ep.Buffer`` objects, one per mode, made on first use: their construction
    is collective, and every rank first uses a mode in the same layer of the same step. Two buffers, so that a
    normal-mode step never leaves the low-latency buffer dirty (DeepEP's ``clean_low_latency_buffer``, which a
    replayed graph could not call)."""

    def __init__(self, deep_ep: Any, group: object, hidden_size: int, num_experts: int, low_latency_tokens: int):
        self.deep_ep, self.group = deep_ep, group
        self.hidden_size, self.num_experts = hidden_size, num_experts
        self.low_latency_tokens = low_latency_tokens  # a rank's largest low-latency dispatch
        self._normal = self._low_latency = None

    def normal(self) -> Any:
        if self._normal is None:
            buffer, ranks = self.deep_ep.Buffer, self.group.size()
            hidden_bytes = self.hidden_size * 2  # bfloat16
            configs = (buffer.get_dispatch_config(ranks), buffer.get_combine_config(ranks))
            nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, ranks) for config in configs)
            rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, ranks) for config in configs)
            self._normal = buffer(self.group, nvl, rdma)
        return self._normal

    def low_latency(self) -> Any:
        if self._low_latency is None:
            buffer, ranks = self.deep_ep.Buffer, self.group.size()
            size = buffer.get_low_latency_rdma_size_hint(self.low_latency_tokens, self.hidden_size, ranks,
                                                         self.num_experts)
            self._low_latency = buffer(self.group, 0, size, low_latency_mode=True,
                                       num_qps_per_rank=self.num_experts // ranks)
        return self._low_latency


class DeepEPDispatcher:
    """One MoE layer's dispatch and combine through DeepEP: each tensor-parallel rank sends its chunk of its tokens
    (as the other dispatchers do), in low-latency mode while the step's group size is at most ``low_latency_limit``
    tokens (0: never), else in normal mode."""

    def __init__(self, tp: TensorParallel, num_experts: int, buffers: DeepEPBuffers, step: StepSize,
                 low_latency_limit: int):
        self.tp, self.num_experts, self.buffers, self.step = tp, num_experts, buffers, step
        self.low_latency_limit = low_latency_limit
        self.ordered = False  # never True: --batch-invariant refuses DeepEP (its combine's order is its own)
        self.local = slice(0, 0)
        self._bounds = [0, 0]
        self._state: tuple = ()

    def low_latency(self, num_tokens: int) -> bool:
        """Whether this step's layers run in low-latency mode (the same answer on every rank of the group)."""
        return self.step.group_tokens(num_tokens) <= self.low_latency_limit

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        tp = self.tp
        bounds = self._bounds = chunk_bounds(hidden.shape[0], tp.size)
        self.local = slice(bounds[tp.rank], bounds[tp.rank + 1])
        x = hidden[self.local].contiguous()
        topk = ids[self.local].to(torch.int64).contiguous()
        topk_weights = weights[self.local].float().contiguous()
        if self.low_latency(hidden.shape[0]):
            buffer = self.buffers.low_latency()
            packed, counts, handle, _, _ = buffer.low_latency_dispatch(
                x, topk, self.buffers.low_latency_tokens, self.num_experts, use_fp8=False)
            rows, local_ids = low_latency_rows(packed, counts)
            self._state = ("low_latency", buffer, handle, topk, topk_weights, packed.shape)
            return Dispatched(rows, local_ids, None)
        buffer = self.buffers.normal()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, self.num_experts)
        received, received_ids, received_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=topk_weights)
        tokens, slots = normal_pairs(received_ids)
        self._state = ("normal", buffer, handle, tokens, received_weights[tokens, slots], received.shape[0])
        return Dispatched(received[tokens], received_ids[tokens, slots].unsqueeze(1), None)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mode, buffer, handle, *rest = self._state
        if mode == "low_latency":
            topk, topk_weights, shape = rest
            combined, _, _ = buffer.low_latency_combine(outputs.view(shape).contiguous(), topk, topk_weights, handle)
            return combined
        tokens, pair_weights, num_received = rest
        combined, _, _ = buffer.combine(normal_sum(outputs, pair_weights, tokens, num_received), handle)
        return combined

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        return gather_chunks(self.tp, chunk, self._bounds)

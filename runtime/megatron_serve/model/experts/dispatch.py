"""Which dispatcher an MoE layer uses in a step, under expert parallelism: the exact all-to-all (counts read on the
host), the fixed-capacity one (capturable), or DeepEP's kernels; and the per-step state the ranks agree on.

The engine picks a backend at start (``--all2all-backend``, :mod:`megatron_serve.engine.experts.backend`) and
:func:`install_dispatchers` gives every MoE layer a :class:`StepDispatcher` for it. Before each forward the runner
(or a graph's capture) sets the model's :class:`ExpertStep`; each layer's dispatch then picks:

* ``alltoall``: the fixed-capacity dispatcher (:mod:`.capacity_dispatcher`) when ``capacity`` is set (a CUDA graph's
  batch size, or a data-parallel group's step size padded to one), else the exact one;
* ``allgather_reducescatter``: :class:`.token_dispatcher.AllGatherDispatcher` always (EP over tensor-parallel ranks);
* ``deepep_high_throughput`` / ``deepep_low_latency``: :class:`.deepep_dispatcher.DeepEPDispatcher`, which picks its
  mode from the same state.

Every rank of the expert-parallel group must pick alike in each layer (their collectives pair up): over the
tensor-parallel ranks every rank runs the same plan; with data-parallel attention the ranks agree on ``tokens``
first (:func:`megatron_serve.engine.group.data_parallel.agree_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .capacity_dispatcher import CapacityDispatcher
from .moe import SparseMoeBlock
from .token_dispatcher import AllGatherDispatcher, Dispatched

if TYPE_CHECKING:  # annotations only
    from .deepep_dispatcher import DeepEPDispatcher
    from .token_dispatcher import TokenDispatcher

#: ``--all2all-backend`` values a group runs with (``auto`` resolves to one of them at start).
BACKENDS = ("alltoall", "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency")


@dataclass
class ExpertStep:
    """What every MoE layer of one forward agrees on with the other expert-parallel ranks.

    ``capacity``: the token count the fixed-capacity buffers are sized for (at least every rank's own token count);
    None: exact counts. ``tokens``: the expert-parallel group's largest token count in this step, where the ranks
    run different batches (data-parallel attention); None: this rank's own count, the same on every rank."""

    capacity: int | None = None
    tokens: int | None = None

    def group_tokens(self, local: int) -> int:
        """The step's size as every rank sees it: the padded capacity, the agreed count, or the local count."""
        if self.capacity is not None:
            return self.capacity
        return self.tokens if self.tokens is not None else local


class StepDispatcher:
    """One MoE layer's dispatchers under a backend; each :meth:`dispatch` picks one for the layer's three calls."""

    def __init__(self, exact: TokenDispatcher, step: ExpertStep, capacity: CapacityDispatcher | None = None,
                 deepep: DeepEPDispatcher | None = None):
        self.exact, self.capacity, self.deepep, self.step = exact, capacity, deepep, step
        self._chosen: TokenDispatcher | CapacityDispatcher | DeepEPDispatcher = exact

    @property
    def ordered(self) -> bool:
        return self.exact.ordered

    @ordered.setter
    def ordered(self, value: bool) -> None:
        for dispatcher in (self.exact, self.capacity, self.deepep):
            if dispatcher is not None:
                dispatcher.ordered = value

    @property
    def local(self) -> slice:
        return self._chosen.local

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        if self.deepep is not None:
            self._chosen = self.deepep
        elif self.capacity is not None and self.step.capacity is not None:
            self._chosen = self.capacity
        else:
            self._chosen = self.exact
        return self._chosen.dispatch(hidden, ids, weights)

    def combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._chosen.combine(outputs, weights)

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._chosen.gather(chunk)


def install_dispatchers(model: torch.nn.Module, backend: str,
                        deepep_factory: Callable[[SparseMoeBlock, ExpertStep], DeepEPDispatcher] | None = None
                        ) -> ExpertStep | None:
    """Give every MoE layer of ``model`` a :class:`StepDispatcher` for ``backend`` (one of :data:`BACKENDS`), sharing
    one :class:`ExpertStep`, kept as ``model.expert_step`` and returned; None where no MoE layer moves tokens
    between ranks. ``deepep_factory(block, step)``: the layer's DeepEP dispatcher (DeepEP backends)."""
    if backend not in BACKENDS:
        raise ValueError(f"all2all backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.dispatcher is not None]
    if not blocks:
        return None
    step = ExpertStep()
    for block in blocks:
        tp, experts, ordered = block.tp, block.experts.num_physical, block.dispatcher.ordered
        exact = block.dispatcher.exact if isinstance(block.dispatcher, StepDispatcher) else block.dispatcher
        if backend == "allgather_reducescatter":
            if tp.data_parallel.size > 1:
                raise ValueError("--all2all-backend allgather_reducescatter: not under data-parallel attention "
                                 "(each rank's tokens would have to be gathered first)")
            block.dispatcher = StepDispatcher(AllGatherDispatcher(tp, experts), step)
        elif backend == "alltoall":
            capacity = CapacityDispatcher(tp, experts, block.top_k, lambda step=step: step.capacity)
            block.dispatcher = StepDispatcher(exact, step, capacity=capacity)
        else:
            block.dispatcher = StepDispatcher(exact, step, deepep=deepep_factory(block, step))
        block.dispatcher.ordered = ordered
    model.expert_step = step
    return step

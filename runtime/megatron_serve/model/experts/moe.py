"""Mixture-of-experts layer: router, fused experts, optional shared expert; and its checkpoint names.

Experts are held as two stacked weights per layer, ``experts.gate_up_proj`` ``[E, 2 * I/tp, H]`` (each
expert's gate rows, then its up rows) and ``experts.down_proj`` ``[E, H, I/tp]``: these are the names and
layouts of ``transformers`` 5 modules, so a trainer's ``named_parameters()`` loads as they are, and the
per-expert names of Hub checkpoints (``experts.N.w1`` of Mixtral, ``experts.N.gate_proj`` of Qwen) are
mapped onto them by :func:`expert_weight_name`.

Tensor parallelism splits every expert's intermediate dimension across the ranks, as the dense MLP
is split: each rank runs all experts on all tokens with its slice and the partial sums (routed and
shared expert together) are reduced once. The router is replicated, so every rank routes alike.

Expert parallelism (``--enable-expert-parallel``, :attr:`.parallel.TensorParallel.expert_parallel`) gives each
rank ``E / ep`` whole experts instead, stored at ``e - first_expert`` (the stacked layout is indexed by
expert): the loader reads only those from the checkpoint, and a token dispatcher
(:mod:`.token_dispatcher`) moves each (token, expert) pair to its expert's rank and the output back. The
shared expert is replicated then, and runs on the tokens the rank combines.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from megatron_kernels import get_op, invariant
from megatron_kernels.moe_weights import ExpertWeights

from ..layers import GatedMLP, LayerBuilder, ReplicatedLinear
from .eplb import LayerPlacement
from ..parallel import SINGLE, TensorParallel
from ..tensor_source import TensorSource, check_full, copy_checked, narrow
from .token_dispatcher import AllToAllDispatcher, DataParallelDispatcher, TokenDispatcher

if TYPE_CHECKING:  # annotations only: the experts read configs, never build them
    from ..config import ModelConfig
    from ..families import MoEConfig

# Hub names of one expert's projections: (stacked parameter, part of it)
_EXPERT_PROJECTIONS = {
    "w1": ("gate_up_proj", "gate"), "gate_proj": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"), "up_proj": ("gate_up_proj", "up"),
    "w2": ("down_proj", "down"), "down_proj": ("down_proj", "down"),
}
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<tensor>weight|weight_scale|"
                         r"weight_scale_inv|input_scale)$")
# checkpoint tensor of one expert's projection -> suffix of the stacked parameter it fills (FP8 scales too)
_EXPERT_TENSORS = {"weight": "", "weight_scale": "_scale", "weight_scale_inv": "_scale", "input_scale": None}


def expert_weight_name(name: str) -> tuple[str, str | None, str | None, int | None]:
    """``(module path, parameter, part, expert)`` of an MoE checkpoint tensor in this model.

    ``part``/``expert`` are None when the tensor fills the whole parameter (the stacked layout of
    ``transformers`` 5, or a router). Mixtral's ``block_sparse_moe`` is this model's ``mlp``. An FP8
    expert's scales fill ``<parameter>_scale``; its activation scale (``input_scale``) has no parameter
    (None): experts run weight-only.
    """
    match = _PER_EXPERT.match(name)
    if match:
        param, part = _EXPERT_PROJECTIONS[match["proj"]]
        suffix = _EXPERT_TENSORS[match["tensor"]]
        return f"{match['layer']}.mlp.experts", None if suffix is None else param + suffix, part, int(match["expert"])
    module_path, _, param = name.replace(".block_sparse_moe.", ".mlp.").rpartition(".")
    return module_path, param, None, None


def routing_dtype(moe: MoEConfig) -> torch.dtype:
    """Recorded expert ids, small before the copy to host: uint8 up to 256 experts, else int32 (uint16 is no
    device type)."""
    return torch.uint8 if moe.num_experts <= 256 else torch.int32


def stack_routing(routing: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The MoE layers' expert ids of one forward as ``[tokens, layers, top_k]`` (:func:`routing_dtype`)."""
    if config.moe is None or not routing:
        raise ValueError(f"{config.architecture} has no mixture-of-experts layers to record the routing of")
    return torch.stack(routing, dim=1).to(routing_dtype(config.moe))


class FusedExperts(nn.Module):
    """One layer's experts on this rank: under tensor parallelism the same slice of every expert's intermediate
    dimension; under expert parallelism ``num_local_experts`` whole experts from ``first_expert`` on."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 device: torch.device, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        if tp.expert_parallel:
            if num_experts % tp.expert_size:
                raise ValueError(f"{num_experts} experts do not split over {tp.expert_size} expert-parallel ranks")
            self.num_local_experts, self.local, self.start = num_experts // tp.expert_size, intermediate_size, 0
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"expert intermediate size {intermediate_size} does not split over {tp.size} ranks")
            self.num_local_experts, self.local = num_experts, intermediate_size // tp.size
            self.start = tp.rank * self.local  # this rank's columns of each expert's intermediate dimension
        self.first_expert = tp.expert_rank * self.num_local_experts if tp.expert_parallel else 0
        # the logical expert each slot of this rank's stack holds (EPLB places them otherwise, :mod:`.eplb`)
        self.slots = list(range(self.first_expert, self.first_expert + self.num_local_experts))
        self.num_physical = num_experts  # slots of every expert-parallel rank together (E + redundant ones)
        self.version = 0  # bumped by every load (a refit), so that a transfer of older weights is not swapped in
        count = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * self.local, hidden_size, dtype=weight_dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, self.local, dtype=weight_dtype),
                                      requires_grad=False)
        self._fused_moe = get_op("fused_moe", device)

    def use_invariant_ops(self) -> None:
        self._fused_moe = invariant.fused_moe

    def holds(self, expert: int) -> bool:
        """Whether this rank holds (part of) ``expert``: a checkpoint tensor of another rank's expert is not read."""
        return expert in self.slots

    def weight_pieces(self, param_name: str) -> frozenset:
        """The parts a checkpoint fills separately: ``(part, expert)`` for every expert held here."""
        parts = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return frozenset((part, expert) for part in parts for expert in self.slots)

    def local_sources(self, source: TensorSource, expert: int | None) -> list[tuple[TensorSource, int | slice]]:
        """``(source, index)`` pairs to copy: one expert's tensor into each slot holding it (``index`` an int, the
        expert dimension gone), or a whole stack (``expert`` None) narrowed to this rank's experts (``index`` a slice
        of the stack: all of it, or one slot where EPLB places the experts out of order)."""
        self.version += 1
        if expert is not None:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} does not exist: this layer has {self.num_experts}")
            return [(source, slot) for slot, held in enumerate(self.slots) if held == expert]
        if self.slots == list(range(self.num_experts)):
            return [(source, slice(None))]
        check_full(source, 0, self.num_experts)
        first = self.slots[0]
        if self.slots == list(range(first, first + len(self.slots))):
            return [(narrow(source, 0, first, len(self.slots)), slice(None))]
        return [(narrow(source, 0, held, 1), slice(slot, slot + 1)) for slot, held in enumerate(self.slots)]

    def weight_loader(self, param: nn.Parameter, source: TensorSource, part: str | None = None,
                      expert: int | None = None) -> None:
        """Copy this rank's share of one expert's projection (``part``/``expert``) or of the whole stack, into every
        slot holding it."""
        for piece, index in self.local_sources(source, expert):
            self._load_piece(param, piece, part, index)

    def _load_piece(self, param: nn.Parameter, source: TensorSource, part: str | None, index: int | slice) -> None:
        start, length, size = self.start, self.local, self.intermediate_size
        stacked = isinstance(index, slice)
        target = param.data[index]
        if param is self.down_proj:
            check_full(source, target.dim() - 1, size)
            copy_checked(target, narrow(source, target.dim() - 1, start, length))
            return
        check_full(source, 1 if stacked else 0, 2 * size if stacked else size)
        parts = ("gate", "up") if part is None else (part,)
        for name in parts:
            offset = 0 if name == "gate" else length
            rows = target.narrow(-2, offset, length)
            if stacked:  # stacked [E, 2 * I, H]: gate rows first, then up rows
                piece = narrow(source, 1, start + (0 if name == "gate" else size), length)
            else:
                piece = narrow(source, 0, start, length)
            copy_checked(rows, piece)

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs (``ids`` index this rank's stack). ``tokens``:
        under expert parallelism, the token each row came from (read by the LoRA hook)."""
        return self._fused_moe(hidden, self.expert_weights(), weights, ids)

    def expert_weights(self) -> ExpertWeights:
        """This rank's stacked experts as the ``fused_moe`` ops take them."""
        return ExpertWeights(self.gate_up_proj, self.down_proj)


def expert_projection_names(family: str, layer: str, num_experts: int) -> tuple[str, tuple[str, ...]]:
    """Where a layer's experts sit in its family's checkpoints: ``(module name, every expert projection)``."""
    if family == "mixtral":
        return f"{layer}.block_sparse_moe", tuple(f"experts.{e}.{p}" for e in range(num_experts)
                                                  for p in ("w1", "w3", "w2"))
    return f"{layer}.mlp", tuple(f"experts.{e}.{p}" for e in range(num_experts)
                                 for p in ("gate_proj", "up_proj", "down_proj"))


class ExpertsBuilder(LayerBuilder, Protocol):
    """What an MoE block asks of the model's builder (:class:`.linears.Linears`, or its FP8 subclass): the dense
    layers of its shared expert, and one layer's experts. Named here, beside the experts it builds, so that the block
    takes any builder and imports none."""

    def experts(self, name: str, parts: tuple[str, ...], num_experts: int, hidden_size: int, intermediate_size: int,
                tp: TensorParallel, device: torch.device) -> FusedExperts:
        """One MoE layer's experts; ``parts`` are every expert's projections under ``name``."""


class SparseMoeBlock(nn.Module):
    """Router, top-k experts and (Qwen2-MoE) a gated shared expert, in place of a dense MLP.

    ``linears`` builds the experts and the shared expert; ``family`` and ``layer`` (``model.layers.3``)
    say what checkpoints call them.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, silu_and_mul: Callable, linears: ExpertsBuilder,
                 family: str, layer: str, tp: TensorParallel = SINGLE, device: torch.device | str = "cpu"):
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts)
        name, parts = expert_projection_names(family, layer, moe.num_experts)
        self.experts = linears.experts(name, parts, moe.num_experts, hidden_size, moe.expert_intermediate_size, tp,
                                       torch.device(device))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if moe.shared_expert_intermediate_size:  # replicated under expert parallelism: it runs on the rank's chunk
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, silu_and_mul, linears,
                                          f"{layer}.mlp.shared_expert", SINGLE if tp.expert_parallel else tp,
                                          reduce=False)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        self._sigmoid = torch.sigmoid
        self._reduce = tp.all_reduce
        self._weights_in_model_dtype = False
        self._family = family
        # swappable (:mod:`.token_dispatcher`); the engine installs its backend's (:mod:`.expert_dispatch`)
        self.dispatcher: TokenDispatcher | None = None
        self.placement: LayerPlacement | None = None  # EPLB's logical-to-physical map (:mod:`.eplb`), if any
        self._sort_columns = False  # a token's experts by logical id before dispatch (--batch-invariant)
        if tp.data_parallel.size > 1:
            self.dispatcher = DataParallelDispatcher(tp, moe.num_experts)
        elif tp.expert_parallel and tp.size > 1:
            self.dispatcher = AllToAllDispatcher(tp, moe.num_experts)

    def use_invariant_ops(self) -> None:
        """``transformers``' arithmetic: Qwen-MoE routers round the expert weights to the model dtype
        before scaling (Mixtral's stay float32); partial sums of TP ranks added in rank order; under expert
        parallelism each token's experts combined in ascending id order."""
        self._sigmoid = invariant.sigmoid
        self._reduce = self.tp.ordered_sum
        self._weights_in_model_dtype = self._family != "mixtral"
        self._sort_columns = True
        if self.dispatcher is not None:
            self.dispatcher.ordered = True

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights and expert ids ``[T, top_k]``, most probable expert first (softmax over all experts)."""
        probs = torch.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, hidden: torch.Tensor, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Mix the experts for every token; ``routing`` (when given) receives this layer's expert ids."""
        weights, ids = self.route(hidden)
        if self._weights_in_model_dtype:
            weights = weights.to(hidden.dtype)
        if routing is not None:
            routing.append(ids)
        if self.dispatcher is not None:
            return self._expert_parallel(hidden, weights, ids)
        out = self.experts(hidden, weights, ids)
        if self.shared_expert is not None:
            out = out + self._shared(hidden)
        return self._reduce(out)

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)

    def _expert_parallel(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Dispatch, this rank's experts on one expert per row (unweighted: the combine weighs them), combine,
        the shared expert on the tokens combined here, gather. Under ``--batch-invariant`` each token's columns are
        sorted by logical expert first (the ordered combine adds them in column order); under EPLB the logical ids
        become physical ones (:meth:`.eplb.LayerPlacement.physical`)."""
        dispatcher = self.dispatcher
        if self._sort_columns:
            order = torch.argsort(ids, dim=1, stable=True)
            ids, weights = ids.gather(1, order), weights.gather(1, order)
        if self.placement is not None:
            ids = self.placement.physical(ids)
        dispatched = dispatcher.dispatch(hidden, ids, weights)
        outputs = dispatched.rows
        if outputs.shape[0]:
            ones = torch.ones(dispatched.ids.shape, dtype=torch.float32, device=hidden.device)
            outputs = self.experts(dispatched.rows, ones, dispatched.ids, dispatched.tokens)
        out = dispatcher.combine(outputs, weights)
        if self.shared_expert is not None:
            out = out + self._shared(hidden[dispatcher.local])
        return dispatcher.gather(out)


@torch.inference_mode()
def empty_moe_pass(model: torch.nn.Module) -> None:
    """Every MoE layer of ``model`` on no tokens, in layer order: the collectives a forward of this rank issues,
    with nothing of its own to send (attention and dense layers need no peer, so they are skipped)."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block(torch.empty((0, block.gate.weight.shape[1]), dtype=block.gate.weight.dtype,
                              device=block.gate.weight.device))

"""EPLB on an expert-parallel group (vLLM's ``--enable-eplb``): measure each MoE layer's load, plan a placement with
redundant experts (:mod:`~megatron_serve.model.experts.eplb`), move the experts between the ranks while the steps run, and swap
them in between two steps.

Every rank of the group holds an :class:`ExpertBalancer` and calls :meth:`ExpertBalancer.step` once before each
forward (the runner does: a step or an idle data-parallel rank's empty MoE pass), so all of them count the same steps
and act on the same ones. Each step's tokens per physical expert (counted on the device by each layer's
:class:`~megatron_serve.model.experts.eplb.LayerPlacement`) go into a window of ``window_size`` steps; every ``step_interval``
steps the window's load (summed over the data-parallel attention ranks, whose tokens differ) is planned, on every
rank alike; each layer whose plan is better than its placement then moves, one layer at a time: its all-to-all starts
at one step boundary, on a group of its own, and the next boundary waits for it (the step in between ran meanwhile),
writes the new stack into the layer's parameters in place and points the map at it. A refit in between (the layer's
weights changed) drops the move, on every rank alike. A rank's loss, or a planned change of the group's ranks
(:mod:`..group.survival`), drops any plan and move under way with the old group (:meth:`ExpertBalancer.release`), and
the balancer starts again over the new one from the placement made there (:meth:`ExpertBalancer.regroup`).

Balancedness (mean over max of the tokens per rank, 1.0 even) is kept per layer as measured over the window planned
from, and as planned; ``log_balancedness`` logs the measured one every step on the group's first rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...model.experts.eplb import balancedness, identity_plan, plan_layer, rank_loads
from ...model.experts.moves import ExpertTransfer, install_placement, install_rows, plan_moves
from ...model.experts.moe import SparseMoeBlock
from ...model.experts.token_dispatcher import AllToAllDispatcher, DataParallelDispatcher
from ...wire.engine_stats import EPLB

if TYPE_CHECKING:
    from ...config import EplbConfig

logger = logging.getLogger(__name__)


@dataclass
class BalancerStats:
    """What ``/metrics`` and the log report: per MoE layer (``layers``: their decoder layers) the balancedness
    measured over the last window planned from and the one its placement plans for; rearrangements (plans that moved
    a layer), layers moved, and the seconds steps waited at the balancer's boundaries (planning, a move's end, the
    swap)."""

    layers: list[int]
    measured: list[float]
    planned: list[float]
    rearrangements: int = 0
    layers_moved: int = 0
    seconds: float = 0.0
    moved_experts: int = 0
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, mean measured, mean planned)

    def to_wire(self) -> dict[str, Any]:
        """The heartbeat's ``metrics["eplb"]`` (:data:`megatron_serve.wire.engine_stats.EPLB`): cumulative counts,
        and the balancedness once a window was measured (before the first plan there is none to report)."""
        wire: dict[str, Any] = {"layers": list(self.layers), "rearrangements": self.rearrangements,
                                "layers_moved": self.layers_moved, "seconds": self.seconds}
        if self.history:
            wire.update(measured=list(self.measured), planned=list(self.planned))
        return wire


@dataclass
class _Move:
    layer: int
    transfer: ExpertTransfer
    plan: list[int]
    version: int


class ExpertBalancer:
    """One rank's EPLB over ``blocks`` (the MoE layers whose tokens cross ranks; ``layers``: their decoder layers),
    their placements in place."""

    def __init__(self, blocks: list[SparseMoeBlock], config: EplbConfig, group: object, transfer_group: object,
                 data_parallel: bool, device: torch.device, layers: list[int]):
        self.blocks, self.config = blocks, config
        tp = blocks[0].tp
        self.ranks, self.rank, self.tp_size = tp.expert_size, tp.expert_rank, tp.size
        self.group, self.transfer_group, self.data_parallel = group, transfer_group, data_parallel
        self.device = device
        self._plans: dict[int, list[int]] = {}
        self._move: _Move | None = None
        self._count()
        self.stats = BalancerStats(list(layers), [1.0] * len(blocks), [1.0] * len(blocks))

    def _count(self) -> None:
        """Count from zero over the blocks' placements as they are (at start, and over a new group)."""
        self.num_physical = self.blocks[0].experts.num_physical
        self.load = torch.zeros((len(self.blocks), self.num_physical), dtype=torch.int64, device=self.device)
        self.rotation = torch.zeros((), dtype=torch.int64, device=self.device)
        for index, block in enumerate(self.blocks):  # every layer counts into one tensor, turns one rotation: a
            block.placement.load = self.load[index]  # step's bookkeeping is three device operations
            block.placement.rotation = self.rotation
        self.window = torch.zeros((self.config.window_size, *self.load.shape), dtype=torch.int64, device=self.device)
        self.steps = 0

    def release(self) -> None:
        """Forget the group, which broke or is being replaced (:mod:`..group.survival`), and any plan or move under way
        on it: a move's transfer holds its group, and a group kept keeps its sockets open (a survivor blocked on this
        rank would wait out the collective timeout). Each rank holds either placement of a move that some installed
        before the loss and others not: the recovery reads what each holds."""
        self._move = None
        self._plans.clear()
        self.group = self.transfer_group = None

    def regroup(self, group: object) -> None:
        """Balance over ``group`` (the ranks left after a loss, or a planned change's members), every member
        together: a transfer group of its own over the same ranks, this rank's place in it, the blocks' placements as
        the recovery left them (their physical expert count may have changed), and a window and a step count from
        zero on every member alike, so that they plan and move at the same steps again."""
        tp = self.blocks[0].tp
        self.ranks, self.rank = tp.expert_size, tp.expert_rank
        self.group = group
        self.transfer_group = dist.new_group(dist.get_process_group_ranks(group))
        self._plans.clear()
        self._move = None
        self._count()

    def reset(self) -> None:
        """Forget the load counted so far (warm-up and graph captures count tokens that served nobody)."""
        self.load.zero_()
        self.window.zero_()

    def step(self) -> None:
        """The boundary before a forward, on every rank of the group: close the last step's counts into the window;
        finish a move under way, plan every ``step_interval`` steps, and start the next layer's move."""
        self.window[self.steps % self.config.window_size].copy_(self.load)
        self.load.zero_()
        self.rotation.add_(1)
        self.steps += 1
        if self.config.log_balancedness:
            self._log_step()
        began = time.perf_counter()
        if self._move is not None:
            self._finish()
        elif self.steps % self.config.step_interval == 0:
            self._plan()
        if self._move is None and self._plans:
            self._start(min(self._plans))
        self.stats.seconds += time.perf_counter() - began

    def report(self, snapshot: dict[str, Any]) -> None:
        """Add the balancer's series to an engine's heartbeat ``metrics`` (:mod:`megatron_serve.wire.engine_stats`)."""
        snapshot[EPLB] = self.stats.to_wire()

    def _group_load(self, load: torch.Tensor) -> torch.Tensor:
        """``load`` summed over the group's tokens, on the host: each data-parallel attention rank counted its own
        (its tensor-parallel ranks the same ones), tensor-parallel ranks all of a step's."""
        if self.data_parallel:
            dist.all_reduce(load, group=self.group)
            load = load // self.tp_size
        return load.cpu()

    def _log_step(self) -> None:
        load = self._group_load(self.window[(self.steps - 1) % self.config.window_size].clone())
        if self.rank == 0:
            values = [balancedness(row.view(self.ranks, -1).sum(1).tolist()) for row in load]
            logger.info("EPLB step %d: balancedness %.3f (lowest layer %.3f)", self.steps,
                        sum(values) / len(values), min(values))

    def _plan(self) -> None:
        """Plan every layer from the window; queue those whose plan beats their placement."""
        load = self._group_load(self.window.sum(0))
        for index, block in enumerate(self.blocks):
            placement = block.placement
            physical = load[index]
            self.stats.measured[index] = balancedness(physical.view(self.ranks, -1).sum(1).tolist())
            logical = placement.logical_load(physical).tolist()
            plan = plan_layer(logical, self.num_physical, self.ranks)
            planned = balancedness(rank_loads(logical, plan, self.ranks))
            current = balancedness(rank_loads(logical, placement.physical_to_logical, self.ranks))
            if plan != placement.physical_to_logical and planned > current + 1e-6:
                self._plans[index] = plan
                self.stats.planned[index] = planned
            else:  # it stays: its placement is the plan
                self._plans.pop(index, None)
                self.stats.planned[index] = current
        if self._plans:
            self.stats.rearrangements += 1
        mean = sum(self.stats.measured) / len(self.stats.measured)
        self.stats.history.append((self.steps, mean, sum(self.stats.planned) / len(self.stats.planned)))
        if self.rank == 0:
            logger.info("EPLB at step %d: measured balancedness %.3f over the last %d steps; %d of %d MoE layers to "
                        "move (planned %.3f)", self.steps, mean, min(self.steps, self.config.window_size),
                        len(self._plans), len(self.blocks), self.stats.history[-1][2])

    def _start(self, layer: int) -> None:
        plan = self._plans.pop(layer)
        experts = self.blocks[layer].experts
        moves = plan_moves(self.blocks[layer].placement.physical_to_logical, plan, self.ranks, self.rank)
        per_rank = len(plan) // self.ranks
        new_slots = plan[self.rank * per_rank:(self.rank + 1) * per_rank]
        self._move = _Move(layer, ExpertTransfer(experts, moves, new_slots, self.transfer_group), plan,
                           experts.version)
        self.stats.moved_experts += moves.moved

    def _finish(self) -> None:
        """Swap the move in, unless a refit changed the layer's weights on any rank since it started."""
        move, self._move = self._move, None
        block = self.blocks[move.layer]
        stale = torch.tensor([int(block.experts.version != move.version)], device=self.load.device)
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=self.transfer_group)
        rows = move.transfer.rows()
        if stale.item():
            logger.info("EPLB: the weights of MoE layer %d changed during its move; it keeps its placement", move.layer)
            return
        install_rows(block.experts, move.transfer.new_slots, rows)
        block.placement.update(move.plan)
        self.window[:, move.layer].zero_()  # counted under the old map
        self.stats.layers_moved += 1
        if self.rank == 0:
            logger.info("EPLB at step %d: MoE layer %d moved over %d ranks", self.steps, move.layer, self.ranks)


def place_experts(blocks: list[SparseMoeBlock], num_redundant: int, transfer_group: object) -> None:
    """The first placement, at start (before graphs are captured): each layer's ``E + num_redundant`` physical
    experts over the group (:func:`~megatron_serve.model.experts.eplb.identity_plan`: each rank its own experts, then copies
    fetched from the others), its dispatcher over the physical experts, and its map. A rank that joins a running group
(``transfer_group`` None: it has no group yet) keeps its experts by index under that map, which it never routes by:
its join places it (:func:`~megatron_serve.engine.experts.recovery.place_for_members`)."""
    tp = blocks[0].tp
    ranks, rank = tp.expert_size, tp.expert_rank
    for block in blocks:
        experts = block.experts
        logical, physical = experts.num_experts, experts.num_experts + num_redundant
        if physical % ranks:
            raise ValueError(f"--eplb-config num_redundant_experts={num_redundant}: {logical} + {num_redundant} "
                             f"experts do not split over {ranks} expert-parallel ranks")
        plan = identity_plan(logical, physical, ranks)
        per_rank = physical // ranks
        transfer = None
        if num_redundant and transfer_group is not None:  # None: a joiner, placed when the group takes it in
            transfer = ExpertTransfer(experts, plan_moves(list(range(logical)), plan, ranks, rank),
                                      plan[rank * per_rank:(rank + 1) * per_rank], transfer_group)
        dispatcher = (DataParallelDispatcher if tp.data_parallel.size > 1 else AllToAllDispatcher)(tp, physical)
        install_placement(block, plan, dispatcher, block.dispatcher.ordered, transfer)

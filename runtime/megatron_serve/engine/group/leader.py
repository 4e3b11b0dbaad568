"""Rank 0's runner (:class:`TensorParallelRunner`): the engine's runner, which sends every step and lifecycle change
to the group's other ranks (:mod:`.channel`) before acting on it itself, and gathers what they report of a refit or
a peer pull. A collective that fails means the group broke: :class:`~megatron_serve.errors.EngineGroupLost`, unless
the data-parallel ranks left serve on (:mod:`.survival`): the runner counts the turns and passes it completed, so that
they can agree where each stopped (:mod:`.regroup`), and resumes there. A planned change (a rank joins, ranks leave:
:mod:`.membership`) is taken at a turn the leaders agree on, and that turn agreed again in the new group."""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ...errors import EngineGroupLost
from ...model.lora.checkpoint import LoraAdapter
from ...weights.sources import WeightSource
from ..precompile.graphs import StepGraphs
from ..kv.copier import Copier
from ..kv.park import ParkOrder
from ..kv.transfer import OtherRanks
from ..runner import ModelRunner, StepResult
from ..served import Turn
from ..step_plan import StepBuffers, StepPlan
from .channel import PlanChannel, broadcast_previous_tokens
from .data_parallel import agree_tokens, agree_turn
from .kv_handoff import GroupHandoff
from .kv_tier import GroupCopier
from .placement import release_groups
from .regroup import Progress, Resume
from .survival import GroupSurvival

T = TypeVar("T")


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts every step and lifecycle change before acting on it itself."""

    def __init__(self, model, block_size: int, device: torch.device, buffers: StepBuffers,
                 channel: PlanChannel, workers: list[multiprocessing.Process],
                 graphs: StepGraphs | None = None, survival: GroupSurvival | None = None):
        super().__init__(model, block_size, device, buffers, graphs)
        self.channel = channel
        self.workers = workers
        self.survival = survival  # serves on without a lost data-parallel rank (.survival); None: the group ends
        self._ran_forward = False  # since the last end_step: a data-parallel rank that did not runs an empty pass
        self._turns = self._works = 0  # turns agreed and MoE passes completed: where this rank is (.regroup)
        self._last_turn = Turn(False, False)

    def _broadcast(self, kind: str, payload: object = None, packed: np.ndarray | None = None,
                   tokens: int | None = None) -> None:
        self._check_workers()
        try:
            self.channel.send(kind, packed, payload, tokens)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke during {kind!r}: {exc}") from exc

    def _check_workers(self) -> None:
        """Fail fast when a local rank died, instead of waiting on a collective that cannot finish."""
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise EngineGroupLost(f"tensor-parallel group lost {', '.join(dead)}; this engine group must restart")

    def run_plan(self, plan: StepPlan, kv_caches, image_embeddings=None, previous_tokens=None,
                 previous_shifts=None) -> StepResult:
        # verify steps are not overlapped under tensor parallelism (the followers would need the shifts too)
        assert previous_shifts is None, "a plan corrected by a verify step in flight under tensor parallelism"
        result = self._pass(lambda: self._run_plan_once(plan, kv_caches, image_embeddings, previous_tokens))
        self._works += 1
        return result

    def _run_plan_once(self, plan: StepPlan, kv_caches, image_embeddings, previous_tokens) -> StepResult:
        """One try of a step: the group's token count, the plan to this rank's workers, the forward."""
        tokens = self._agree_tokens(plan.num_tokens)
        self._broadcast("step", packed=self.buffers.pack(plan), tokens=tokens)
        try:
            broadcast_previous_tokens(self.channel, plan, previous_tokens, 0, self.device)
            if plan.num_images:  # the tower runs on rank 0 only: its output goes with the step
                self.channel.broadcast(image_embeddings.contiguous())
            self._ran_forward = True
            return super().run_plan(plan, kv_caches, image_embeddings, previous_tokens, group_tokens=tokens)
        except Exception as exc:  # noqa: BLE001 - the forward's all-reduces fail when a peer died mid-step
            self._check_workers()
            raise EngineGroupLost(f"tensor-parallel forward failed: {exc}") from exc

    def on_suspend(self, level: int, keep: ParkOrder | None = None) -> None:
        self._broadcast("suspend", (level, keep))
        super().on_suspend(level)

    def on_resume(self, restore: bool = False) -> None:
        self._broadcast("resume", restore)

    def group_turn(self, busy: bool, holding: bool = False) -> Turn:
        if self.survival is not None and self.survival.joining:  # started for a running group: taken in first
            self.survival.join()
        if self.channel.leaders is None:
            return Turn(busy, holding)
        while True:
            change = self.survival is not None and self.survival.change_pending()
            try:
                turn = self._among_leaders(lambda leaders, flags: agree_turn(leaders, *flags), (busy, holding, change))
            except EngineGroupLost as lost:
                resume = self._rejoin(lost, "turn")
                if resume.adopt is None:
                    continue
                turn = resume.adopt  # the others agreed this turn before the loss: theirs is this rank's
            if not turn.change:
                break
            # every member at this turn; then the turn is agreed again, joiners with them (a rank that leaves
            # raises errors.LeftGroup, which ends its process)
            self.survival.change()
            self._turns = self._works = 0  # a new group: every member counts from here (.regroup compares them)
        self._turns += 1
        self._last_turn = turn
        return turn

    def scale_expert_group(self, size: int) -> dict[str, Any]:
        return super().scale_expert_group(size) if self.survival is None else self.survival.scale(size)

    def _agree_tokens(self, tokens: int) -> int | None:
        """With data-parallel attention, the largest step of the data-parallel ranks (None without)."""
        return None if self.channel.leaders is None else self._among_leaders(agree_tokens, tokens)

    def _among_leaders(self, collective: Callable[[object, T], T], value: T) -> T:
        """``collective`` over the data-parallel attention ranks' leaders."""
        try:
            return collective(self.channel.leaders, value)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"data-parallel attention ranks lost one of them: {exc}") from exc

    def end_step(self) -> None:
        ran, self._ran_forward = self._ran_forward, False
        if self.channel.leaders is None or ran:
            return
        self._empty_pass()
        self._works += 1

    def _rejoin(self, lost: EngineGroupLost, phase: str) -> Resume:
        """Serve on with the ranks left after ``lost`` (raised again where this group cannot), this rank stopped in
        ``phase``; joins the others' redo of a pass this rank completed (:class:`.regroup.Resume`)."""
        if self.survival is None:
            raise lost
        resume = self.survival.rejoin(lost, Progress(self._turns, self._works, phase, *self._last_turn))
        if resume.assist:
            self._empty_pass()
        return resume

    def _empty_pass(self) -> None:
        """An empty MoE pass (this rank ran no forward this step, or it joins the others' redo of one)."""
        self._pass(self._empty_pass_once)

    def _pass(self, attempt: Callable[[], T]) -> T:
        """One MoE pass (a step's forward or an empty one): where a rank was lost in it and the ranks left serve on,
        run again over them, from its start."""
        while True:
            try:
                return attempt()
            except EngineGroupLost as lost:
                self._rejoin(lost, "work")

    def _empty_pass_once(self) -> None:
        """One try of an empty MoE pass: the group's token count, the idle message to this rank's workers, the pass."""
        tokens = self._agree_tokens(0)
        self._broadcast("idle", tokens=tokens)
        try:
            self.empty_moe_pass(tokens)
        except Exception as exc:  # noqa: BLE001 - the all-to-alls fail when a peer died mid-step
            self._check_workers()
            raise EngineGroupLost(f"data-parallel attention: an empty MoE pass failed: {exc}") from exc

    def kv_copier(self) -> Copier:
        """The host tier's copies on every rank (:mod:`.kv_tier`): each told to the group before the step that
        depends on it."""
        return GroupCopier(super().kv_copier(), lambda copy: self._broadcast("kv_copy", copy))

    def kv_others(self) -> OtherRanks:
        """The other ranks' parts of a prefilled request's blocks (:mod:`.kv_handoff`)."""
        return GroupHandoff(self.channel, self._broadcast)

    def on_refit(self, source: WeightSource) -> None:
        if self.survival is not None:
            self.survival.checkpoint_current = False  # experts read back from the checkpoint would now be stale
        self._broadcast("refit", source)

    def broadcast_lora_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Every other rank writes its share of ``adapter`` into ``slot`` (:mod:`...model.lora_shards`) before the
        next step, as rank 0 does: adapters live in rank 0's host memory only, so pushes need no other path."""
        self._broadcast("lora", (slot, adapter))

    def refit_outcomes(self) -> list[tuple[list[str], str | None]]:
        return self.channel.gather("a refit")

    def on_share(self, payload: tuple[str, str, int, float]) -> None:
        self._broadcast("peer", payload)

    def share_outcomes(self) -> list[str | None]:
        return self.channel.gather("a peer pull")

    def shutdown(self) -> None:
        if not dist.is_initialized():
            return
        try:
            self._broadcast("stop")
        except EngineGroupLost:
            pass  # followers already gone: nothing left to stop
        finally:
            dist.destroy_process_group()
            release_groups(self.model.tp, self.channel)
            for worker in self.workers:
                worker.join(timeout=30)



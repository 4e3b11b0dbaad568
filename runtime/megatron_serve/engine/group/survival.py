"""A data-parallel attention rank that serves on when another rank of its expert-parallel group is lost
(:class:`GroupSurvival`), instead of exiting with the whole group.

Under data-parallel attention each rank is an engine of its own (its attention, KV cache and requests); only the MoE
layers' all-to-alls and the leaders' agreements span the ranks. So a rank's loss takes its engine's requests (the
coordinator resubmits them to the others, as it does for any lost engine) and its experts. The survivors' collective
with it fails; each calls :meth:`GroupSurvival.rejoin` with where it stopped, which forms the survivors' new group and
agrees with them on one step boundary (:func:`.regroup.regroup`), points the model's groups at the new group (one
:class:`~megatron_serve.model.parallel.TensorParallel`, shared by every layer) and places the experts over the ranks
left (:func:`~megatron_serve.engine.experts.recovery.recover_experts`: moved among the survivors, the lost rank's own
read back from the checkpoint). The runner then resumes as :class:`.regroup.Resume` says. The same object takes part
in a planned change (:mod:`.membership`): a rank that joins (:meth:`GroupSurvival.join`), ranks that leave
(:meth:`GroupSurvival.change`, asked for by :meth:`GroupSurvival.scale`).

Under EPLB (``--enable-eplb``) the balancer's move under way is dropped with the broken groups (its transfer runs on
a group of its own), the placement over the ranks left starts from what each survivor holds (a move may have been
swapped in on some before the loss), and the balancer starts again over the new group: its own transfer group, a
window and a step count from zero on every member alike (:meth:`~megatron_serve.engine.experts.balancer.ExpertBalancer.
regroup`).

Served where each data-parallel rank is one process on CPU (gloo, ``--tensor-parallel 1``), the group has two ranks
or more (one left alone holds every expert) (``InferenceConfig.elastic_expert_group``); elsewhere a loss still ends the group
(worker ranks' groups and NCCL communicators are not rebuilt here).
"""

from __future__ import annotations

import datetime
import gc
import logging
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...config import InferenceConfig
from ...errors import EngineGroupLost, LeftGroup
from ...model.experts.moe import SparseMoeBlock
from ..experts.recovery import place_for_members, recover_experts
from .channel import PlanChannel
from .membership import (ChangeWatch, Membership, announce, ask_to_join, await_admission, meet, plan_change,
                         read_change, want_size)
from .placement import RENDEZVOUS_TIMEOUT_S, join_data_parallel, release_groups
from .regroup import Progress, Resume, regroup

logger = logging.getLogger(__name__)

#: The longest a survivor waits for the others in the store (to register, then to say where they stopped): far
#: under the collective timeout, so a survivor that cannot agree exits long before any collective would time out.
REGROUP_WAIT_S = 30.0


class GroupSurvival:
    """One data-parallel rank's way to serve on after a loss, and to take part in a planned change: a rank that
    joins, ranks that leave (:mod:`.membership`; see the module docstring)."""

    def __init__(self, model: torch.nn.Module, channel: PlanChannel, model_dir: str | Path, config: InferenceConfig):
        self.model, self.channel, self.model_dir = model, channel, model_dir
        self.dp_rank, self.size = config.data_parallel_rank, config.data_parallel_size
        self.redundant = config.eplb_config.num_redundant_experts if config.enable_eplb else 0
        self.store = channel.rendezvous
        self.joining = not dist.is_initialized()  # started for a running group: it joins at its first turn
        self.generation, self.members = 0, list(range(self.size))
        # the MoE layers whose tokens cross ranks (each holds a dispatcher from the start under data parallelism)
        self.blocks = [(name, m) for name, m in model.named_modules()
                       if isinstance(m, SparseMoeBlock) and m.dispatcher is not None]
        self.watch: ChangeWatch | None = None
        # the weights are still the checkpoint's: experts can be read back from it (a refit ends that)
        self.checkpoint_current = True
        if not self.joining:
            self._formed()

    @property
    def rank(self) -> int:
        """This rank's place in the current generation's group."""
        return self.members.index(self.dp_rank)

    def _formed(self) -> None:
        """A generation formed with this rank in it: its leader publishes the membership and watches for changes."""
        self.watch = None
        if self.rank == 0:
            announce(self.store, Membership(self.generation, self.members, self.size))
            self.watch = ChangeWatch(self.store)

    def change_pending(self) -> bool:
        """Whether the leader sees a change asked for (one cheap store read, at most every few turns)."""
        return self.watch is not None and self.watch.pending()

    def scale(self, size: int) -> dict[str, Any]:
        """SCALE_EP on this rank: below the group's size, the leader asks for the change (taken at a turn the
        members agree on), and this rank says whether it is among the highest ranks, which leave; above it, nothing
        here (the missing ranks' engines join when started). The acknowledgement's detail."""
        if self.joining:
            return {"error": f"scale-ep {size}: data-parallel rank {self.dp_rank} has not joined its group yet"}
        if not 1 <= size <= self.size:
            return {"error": f"scale-ep {size}: an expert-parallel group started with --data-parallel-size "
                             f"{self.size} has 1 to {self.size} ranks"}
        if size < len(self.members) and self.watch is not None:
            want_size(self.store, size)
        return {"leaving": self.dp_rank in self.members[size:], "members": list(self.members)}

    def rejoin(self, cause: BaseException, progress: Progress) -> Resume:
        """Form the survivors' group, serve on in it, and say how this rank rejoins the others (it stopped at
        ``progress``); :class:`~megatron_serve.errors.EngineGroupLost` where this rank cannot (the rendezvous store's
        process was the one lost: rank 0's engine, unless the store has a process of its own; no rank left beside this
        one; a survivor that did not say where it stopped)."""
        self.generation += 1
        rank, ranks = self.rank, len(self.members)
        logger.warning("expert-parallel rank %d (rank %d of %d): a collective failed at %s (%s); regrouping with the "
                       "ranks left", self.dp_rank, rank, ranks, progress, cause)
        ordered = self._release(cause)
        try:
            new = regroup(self.store, self.generation, rank, ranks, progress, REGROUP_WAIT_S,
                          datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - alone, late, the store's process gone, or no new group formed
            raise EngineGroupLost(f"data-parallel attention ranks lost one of them and could not regroup: {exc}"
                                  ) from cause
        lost = sorted(set(range(ranks)) - set(new.members))
        self._serve_over(new.rank, len(new.members), f"the {len(new.members)} ranks left",
                         lambda: recover_experts(self.model, self.blocks, ordered, self.model_dir, ranks, lost, rank,
                                                 dist.group.WORLD, self.checkpoint_current))
        lost_ranks = [self.members[r] for r in lost]
        self.members = [self.members[r] for r in new.members]
        logger.warning("expert-parallel rank %d is rank %d of the %d left (lost: %s); it resumes with %s", self.dp_rank,
                       new.rank, len(new.members), lost_ranks, new.resume)
        self._formed()
        return new.resume

    def change(self) -> None:
        """The turn the members agreed for a planned change: the leader plans the next membership, every member
        reads it, the ones that stay (and the ranks that join) form its group; a rank that leaves raises
        :class:`~megatron_serve.errors.LeftGroup`."""
        if self.watch is not None:
            self.watch.taken()
            plan = plan_change(self.store, Membership(self.generation, self.members, self.size))
        else:
            plan = read_change(self.store, self.generation + 1, REGROUP_WAIT_S)
        if plan.members == self.members:  # only asks refused: the group stays as it is
            self.generation = plan.generation
            return
        ordered = self._release(None)
        dist.destroy_process_group()
        if self.dp_rank not in plan.members:
            logger.warning("expert-parallel rank %d leaves the group (generation %d: ranks %s)", self.dp_rank,
                           plan.generation, plan.members)
            raise LeftGroup(f"data-parallel rank {self.dp_rank} left the expert-parallel group")
        self._enter(plan, ordered)

    def join(self) -> None:
        """This engine's first turn, started for a running group: ask to join, wait (bounded) until the members take
        it in at a step boundary, and form the next generation's group with them."""
        token = ask_to_join(self.store, self.dp_rank)
        logger.warning("expert-parallel rank %d asks to join the running group", self.dp_rank)
        plan = await_admission(self.store, token, REGROUP_WAIT_S)
        if self.dp_rank not in plan.members:
            raise EngineGroupLost(f"data-parallel rank {self.dp_rank} was answered without it: {plan.members}")
        ordered = self.blocks[0][1].dispatcher.ordered
        self.joining = False
        self._enter(plan, ordered)

    def _enter(self, plan: Membership, ordered: bool) -> None:
        """Form ``plan``'s group (this rank is a member) and place the experts over it."""
        self.generation, self.members = plan.generation, plan.members
        meet(self.store, plan, self.dp_rank, REGROUP_WAIT_S)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"regroup/{plan.generation}/group/", self.store),
                                rank=self.rank, world_size=len(self.members),
                                timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        self._serve_over(self.rank, len(self.members), f"generation {plan.generation}'s ranks {plan.members}",
                         lambda: place_for_members(self.model, self.blocks, ordered, self.model_dir, self.size,
                                                   self.redundant, self.members, self.dp_rank, dist.group.WORLD,
                                                   self.checkpoint_current))
        logger.warning("expert-parallel rank %d is rank %d of %d in generation %d (ranks %s)", self.dp_rank, self.rank,
                       len(self.members), self.generation, self.members)
        self._formed()

    def _serve_over(self, rank: int, ranks: int, over: str, place: Callable[[], int]) -> None:
        """The model's groups over the new default group (this rank ``rank`` of ``ranks``), the experts placed
        (``place``, every member together) and EPLB over the group; :class:`~megatron_serve.errors.EngineGroupLost`
        naming ``over`` where any of it fails (a member lost meanwhile, the checkpoint unreadable): the others may
        hold a placement this rank does not."""
        try:
            self._join_groups(rank, ranks)
            place()
            self._rebalance()
        except Exception as exc:  # noqa: BLE001 - any failure here leaves this rank out of the others' placement
            raise EngineGroupLost(f"expert-parallel rank {self.dp_rank} could not place the experts over {over}: "
                                  f"{exc}") from exc

    def _join_groups(self, rank: int, ranks: int) -> None:
        """The data-parallel groups over the new default group, into the model (one
        :class:`~megatron_serve.model.parallel.TensorParallel` that every layer shares) and the channel."""
        tp, channel = join_data_parallel(rank, 1, ranks, "gloo", self.model.tp.gathered_rows)
        for name in ("group", "data_parallel"):  # the layers share this one object: they all see the new groups
            object.__setattr__(self.model.tp, name, getattr(tp, name))
        self.channel.group, self.channel.leader = channel.group, channel.leader
        self.channel.device_group, self.channel.leaders = channel.device_group, channel.leaders

    def _rebalance(self) -> None:
        """EPLB (``--enable-eplb``) over the new group, from the placement just made: every member together."""
        if self.model.expert_balancer is not None:
            self.model.expert_balancer.regroup(self.model.tp.data_parallel.group)

    def _release(self, cause: BaseException | None) -> bool:
        """Drop every reference this process holds to the broken groups, so that leaving them closes their sockets
        (a group still referenced keeps them open, and a survivor blocked on this rank waits out the collective
        timeout): the model's and the channel's groups, the dispatchers', EPLB's (its move under way dropped), the
        failed collective's frames. Returns
        whether the dispatchers combined in order (``--batch-invariant``), for their successors."""
        ordered = self.blocks[0][1].dispatcher.ordered
        seen: set[int] = set()
        link: BaseException | None = cause
        while link is not None and id(link) not in seen:  # the chain's frames too: a collective's locals name its group
            seen.add(id(link))
            traceback.clear_frames(link.__traceback__)
            link = link.__cause__ or link.__context__
        for _, block in self.blocks:
            block.dispatcher = None
        self.model.expert_step = None
        if self.model.expert_balancer is not None:
            self.model.expert_balancer.release()
        release_groups(self.model.tp, self.channel)
        gc.collect()
        return ordered

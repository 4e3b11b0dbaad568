"""A data-parallel attention rank that serves on when another rank of its expert-parallel group is lost
(:class:`GroupSurvival`), instead of exiting with the whole group.

Under data-parallel attention each rank is an engine of its own (its attention, KV cache and requests); only the MoE
layers' all-to-alls and the leaders' agreements span the ranks. So a rank's loss takes its engine's requests (the
coordinator resubmits them to the others, as it does for any lost engine) and its experts. The survivors' collective
with it fails; each calls :meth:`GroupSurvival.rejoin` with where it stopped, which forms the survivors' new group and
agrees with them on one step boundary (:func:`.regroup.regroup`), points the model's groups at the new group (one
:class:`~megatron_serve.model.parallel.TensorParallel`, shared by every layer) and places the experts over the ranks
left (:func:`~megatron_serve.engine.expert_recovery.recover_experts`: moved among the survivors, the lost rank's own
read back from the checkpoint). The runner then resumes as :class:`.regroup.Resume` says.

Served where each data-parallel rank is one process on CPU (gloo, ``--tensor-parallel 1``), the group has at least
three ranks (two leave one alone) and EPLB is off; elsewhere a loss still ends the group (worker ranks' groups and
NCCL communicators are not rebuilt here; under EPLB a move in flight runs on a group of its own, at a step the
agreement does not count).
"""

from __future__ import annotations

import datetime
import gc
import logging
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import InferenceConfig
from ...errors import EngineGroupLost
from ...model.experts.moe import SparseMoeBlock
from ..expert_recovery import recover_experts
from .channel import PlanChannel
from .placement import RENDEZVOUS_TIMEOUT_S, join_data_parallel, release_groups
from .regroup import Progress, Resume, regroup

logger = logging.getLogger(__name__)

#: The longest a survivor waits for the others in the store (to register, then to say where they stopped): far
#: under the collective timeout, so a survivor that cannot agree exits long before any collective would time out.
REGROUP_WAIT_S = 30.0


def survivable(config: InferenceConfig) -> bool:
    """Whether this engine's group can serve on without a lost rank (see the module docstring)."""
    return (config.data_parallel_size > 2 and config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1
            and torch.device(config.device).type == "cpu" and not config.enable_eplb)


class GroupSurvival:
    """One data-parallel rank's way to serve on after a loss (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, channel: PlanChannel, model_dir: str | Path):
        self.model, self.channel, self.model_dir = model, channel, model_dir
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.generation = 0
        # the MoE layers whose tokens cross ranks (each holds a dispatcher from the start under data parallelism)
        self.blocks = [(name, m) for name, m in model.named_modules()
                       if isinstance(m, SparseMoeBlock) and m.dispatcher is not None]

    def rejoin(self, cause: BaseException, progress: Progress) -> Resume:
        """Form the survivors' group, serve on in it, and say how this rank rejoins the others (it stopped at
        ``progress``); :class:`~megatron_serve.errors.EngineGroupLost` where this rank cannot (the rendezvous store's
        process was the one lost, no rank left beside this one, a survivor that did not say where it stopped)."""
        self.generation += 1
        logger.warning("expert-parallel rank %d of %d: a collective failed at %s (%s); regrouping with the ranks left",
                       self.rank, self.ranks, progress, cause)
        ordered = self.blocks[0][1].dispatcher.ordered
        self._release(cause)
        try:
            new = regroup(self.channel.rendezvous, self.generation, self.rank, self.ranks, progress, REGROUP_WAIT_S,
                          datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - alone, late, the store's process gone, or no new group formed
            raise EngineGroupLost(f"data-parallel attention ranks lost one of them and could not regroup: {exc}"
                                  ) from cause
        lost = sorted(set(range(self.ranks)) - set(new.members))
        tp, channel = join_data_parallel(new.rank, 1, len(new.members), "gloo", self.model.tp.gathered_rows)
        for name in ("group", "data_parallel"):  # the layers share this one object: they all see the new groups
            object.__setattr__(self.model.tp, name, getattr(tp, name))
        self.channel.group, self.channel.leader = channel.group, channel.leader
        self.channel.device_group, self.channel.leaders = channel.device_group, channel.leaders
        recover_experts(self.model, self.blocks, ordered, self.model_dir, self.ranks, lost, self.rank,
                        dist.group.WORLD)
        logger.warning("expert-parallel rank %d is rank %d of the %d left (lost: %s); it resumes with %s", self.rank,
                       new.rank, len(new.members), lost, new.resume)
        self.rank, self.ranks = new.rank, len(new.members)
        return new.resume

    def _release(self, cause: BaseException) -> None:
        """Drop every reference this process holds to the broken groups, so that leaving them closes their sockets
        (a group still referenced keeps them open, and a survivor blocked on this rank waits out the collective
        timeout): the model's and the channel's groups, the dispatchers', the failed collective's frames."""
        seen: set[int] = set()
        link: BaseException | None = cause
        while link is not None and id(link) not in seen:  # the chain's frames too: a collective's locals name its group
            seen.add(id(link))
            traceback.clear_frames(link.__traceback__)
            link = link.__cause__ or link.__context__
        for _, block in self.blocks:
            block.dispatcher = None
        self.model.expert_step = None
        release_groups(self.model.tp, self.channel)
        gc.collect()

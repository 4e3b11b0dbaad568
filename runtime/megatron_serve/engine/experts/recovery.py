"""A survivor's MoE layers after the expert-parallel group lost ranks (:func:`recover_experts`): each layer goes to
its placement over the ranks left (:mod:`megatron_serve.model.experts.eplb_recovery`), its experts moved among the
survivors over the new group and the ones only the lost ranks held read from the checkpoint, then its map and its
dispatcher are those of the new placement. Every survivor calls it once, with the same arguments but its own rank,
after :func:`..group.regroup.regroup` formed the new group. A planned change (a rank joins, ranks leave:
:mod:`..group.membership`) places them over the new members instead (:func:`place_for_members`).

The experts read back come from the model directory, so only while the weights are still the checkpoint's: after a
refit (a trainer's weights), a placement that would read any expert back fails on every member together, naming why,
and the group ends as it did before survival (its restart takes the fleet's weights again); one whose experts all
survive on some rank (EPLB's redundant copies) still serves on.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from ...model.experts.dispatch import install_dispatchers
from ...model.experts.eplb_recovery import Recovery, members_plan, recovery, relocation
from ...model.experts.moe import SparseMoeBlock, expert_weight_name
from ...model.experts.moves import ExpertTransfer, install_placement
from ...model.experts.token_dispatcher import DataParallelDispatcher
from ...model.loader import checkpoint_views, load_weights

logger = logging.getLogger(__name__)


def recover_experts(model: torch.nn.Module, blocks: list[tuple[str, SparseMoeBlock]], ordered: bool,
                    model_dir: str | Path, ranks: int, lost: Collection[int], rank: int, group: object,
                    checkpoint_current: bool = True) -> int:
    """Move ``blocks`` (``model``'s MoE layers that cross ranks, by module name; this survivor: old ``rank`` of
    ``ranks``) to their placements over the ranks not in ``lost``, over ``group`` (the survivors' new group), and
    give them dispatchers over it (``ordered``: ``--batch-invariant``'s combine); ``model.tp`` already names the new
    group. ``checkpoint_current``: no refit changed the weights since the start (else no expert may be read back).
    Returns how many experts this rank read from the checkpoint."""
    index = [r for r in range(ranks) if r not in lost].index(rank)  # this survivor's rank in the new group
    parts = [recovery(old, ranks, lost, block.experts.num_experts, rank)
             for old, (_, block) in zip(_held(blocks, ranks, lost, group), blocks)]
    read = _install(model, blocks, parts, index, ordered, model_dir, group, checkpoint_current)
    logger.warning("expert-parallel rank %d serves on without rank(s) %s: %d MoE layers placed over the %d ranks "
                   "left, %d experts read back from %s", rank, sorted(lost), len(blocks), ranks - len(lost), read,
                   model_dir)
    return read


def _held(blocks: list[tuple[str, SparseMoeBlock]], ranks: int, lost: Collection[int], group: object
          ) -> list[list[int]]:
    """Each block's physical-to-logical map over the old ``ranks`` as the survivors hold it, gathered over ``group``
    (the lost ranks' slots are gone: -1). Not a survivor's own map: under EPLB a move may have been swapped in on
    some survivors and not on others when the loss broke its last collective."""
    mine = [list(block.experts.slots) for _, block in blocks]
    everyone: list[list[list[int]] | None] = [None] * (ranks - len(lost))
    dist.all_gather_object(everyone, mine, group=group)
    survivors = iter(everyone)
    held = [next(survivors) if r not in lost else [[-1] * len(slots) for slots in mine] for r in range(ranks)]
    return [[expert for rank in held for expert in rank[layer]] for layer in range(len(blocks))]


def place_for_members(model: torch.nn.Module, blocks: list[tuple[str, SparseMoeBlock]], ordered: bool,
                      model_dir: str | Path, size: int, redundant: int, members: list[int], rank: int,
                      group: object, checkpoint_current: bool = True) -> int:
    """A planned change's placement (:func:`~megatron_serve.model.experts.eplb_recovery.members_plan` over
    ``members``, data-parallel ranks of a group started with ``size`` and ``redundant`` EPLB copies; this one:
    ``rank``): each rank keeps what it holds of its new slots and reads the rest from the checkpoint; every member of
    ``group`` calls it together. Returns how many experts this rank read."""
    index = members.index(rank)
    parts = [relocation(block.experts.slots, members_plan(size, members, block.experts.num_experts,
                                                          block.experts.num_experts + redundant), len(members), index)
             for _, block in blocks]
    read = _install(model, blocks, parts, index, ordered, model_dir, group, checkpoint_current)
    logger.warning("expert-parallel rank %d: %d MoE layers placed over the %d ranks %s, %d experts read from %s",
                   rank, len(blocks), len(members), members, read, model_dir)
    return read


def _install(model: torch.nn.Module, blocks: list[tuple[str, SparseMoeBlock]], parts: list[Recovery], index: int,
             ordered: bool, model_dir: str | Path, group: object, checkpoint_current: bool) -> int:
    """Each block to its part's placement (rank ``index``'s slots; moves over ``group``, the rest from
    ``model_dir``), with dispatchers over the group ``model.tp`` names; how many experts were read. Every member
    first agrees whether any would read an expert back that a refit made stale: then all refuse together, before
    anything moved."""
    _refuse_stale_reads(any(part.loads for part in parts) and not checkpoint_current, model_dir, group)
    wanted: dict[str, set[int]] = {}
    for (name, block), part in zip(blocks, parts):
        new_slots = part.placement[index * part.per_rank:(index + 1) * part.per_rank]
        install_placement(block, part.placement, DataParallelDispatcher(block.tp, len(part.placement)), ordered,
                          ExpertTransfer(block.experts, part.moves, new_slots, group))
        if part.loads:
            wanted[f"{name}.experts"] = {expert for _, expert in part.loads}
    install_dispatchers(model, "alltoall")
    if wanted:
        load_weights(model, ((n, t) for n, t in checkpoint_views(model_dir) if _wanted(n, wanted)), partial=True)
    return sum(len(experts) for experts in wanted.values())


def _refuse_stale_reads(stale_here: bool, model_dir: str | Path, group: object) -> None:
    """Raise on every member of ``group`` when any member would read experts back from ``model_dir`` after a refit
    (one small all-reduce: a member that refused alone would leave the others in collectives without it)."""
    stale = torch.tensor([int(stale_here)])
    dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=group)
    if stale.item():
        raise RuntimeError(f"experts would be read back from {model_dir}, but a refit changed the weights since the "
                           f"start: the group restarts, and the fleet's weights are sent to it again")


def _wanted(checkpoint_name: str, wanted: dict[str, set[int]]) -> bool:
    """Whether ``checkpoint_name`` holds an expert this rank reads back: its own tensor, or the stack of its layer
    (``transformers`` 5's layout, which fills every slot with its expert)."""
    module, _, _, expert = expert_weight_name(checkpoint_name)
    return module in wanted and (expert is None or expert in wanted[module])

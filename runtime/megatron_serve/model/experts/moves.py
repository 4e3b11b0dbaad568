"""Moving experts between expert-parallel ranks when EPLB changes a layer's placement (:mod:`.eplb`).

Every rank computes the same :func:`plan_moves` from the old and the new physical-to-logical maps: a new slot whose
expert this rank already holds is filled from its own stack; any other from a rank that held the expert (the one that
sends least so far, the lowest among equals, so the sends spread). The rows travel in one all-to-all per layer: a
row is one expert's every stacked parameter as bytes (``gate_up_proj``, ``down_proj``, an FP8 layer's scales), so
one collective moves any dtype (gloo has no FP8). :class:`ExpertTransfer` starts it without waiting (on a group of
its own, so a step's collectives can run meanwhile) and :meth:`ExpertTransfer.rows` assembles the new stack's rows
once it is done; :func:`install_rows` writes them into the experts' parameters in place, between two steps, and
:func:`install_placement` makes a new placement a block's (its rows, its map and its dispatcher).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .eplb import LayerPlacement
from .moe import FusedExperts, SparseMoeBlock
from .token_dispatcher import TokenDispatcher


@dataclass(frozen=True)
class Moves:
    """How one rank's new slots fill: ``local`` ``(old slot, new slot)`` copies of its own; ``sends[d]`` its old
    slots that rank ``d`` receives, in the order ``d`` takes them; ``receives[s]`` its new slots that rank ``s``'s
    rows fill, in order."""

    local: list[tuple[int, int]]
    sends: list[list[int]]
    receives: list[list[int]]

    @property
    def moved(self) -> int:
        """Experts this rank receives."""
        return sum(len(r) for r in self.receives)


def plan_moves(old: Sequence[int], new: Sequence[int], ranks: int, rank: int, missing: Collection[int] = ()
               ) -> Moves:
    """``rank``'s part of going from placement ``old`` to ``new`` (physical-to-logical maps; the slot counts may
    differ, as at the first placement); the same computation on every rank, so each rank's sends are another's
    receives. ``missing``: logical experts no rank holds any more (a lost rank's, :mod:`.eplb_recovery`), whose new
    slots are left for the caller to fill."""
    old_per, new_per = len(old) // ranks, len(new) // ranks
    holders: dict[int, list[tuple[int, int]]] = {}
    for physical, logical in enumerate(old):
        owner = physical // old_per
        if all(r != owner for r, _ in holders.get(logical, [])):
            holders.setdefault(logical, []).append((owner, physical % old_per))
    sent = [0] * ranks
    local: list[tuple[int, int]] = []
    sends: list[list[int]] = [[] for _ in range(ranks)]
    receives: list[list[int]] = [[] for _ in range(ranks)]
    for dest in range(ranks):
        mine = {logical: slot for slot, logical in reversed(list(enumerate(old[dest * old_per:(dest + 1) * old_per])))}
        for slot in range(new_per):
            logical = new[dest * new_per + slot]
            if logical in mine:
                if dest == rank:
                    local.append((mine[logical], slot))
                continue
            if logical in missing:
                continue
            if logical not in holders:
                raise ValueError(f"logical expert {logical} is in no slot of the old placement")
            source, source_slot = min(holders[logical], key=lambda held: (sent[held[0]], held[0]))
            sent[source] += 1
            if source == rank:
                sends[dest].append(source_slot)
            if dest == rank:
                receives[source].append(slot)
    return Moves(local, sends, receives)


def stacked_parameters(experts: FusedExperts) -> list[torch.nn.Parameter]:
    """The experts' parameters stacked by slot, in a fixed order (the weights, and an FP8 layer's scales)."""
    count = len(experts.slots)
    return [p for _, p in sorted(experts.named_parameters(recurse=False)) if p.dim() and p.shape[0] == count]


def pack_rows(experts: FusedExperts, slots: Sequence[int]) -> torch.Tensor:
    """``[len(slots), bytes]`` uint8: each slot's stacked parameters, as bytes, side by side."""
    params = stacked_parameters(experts)
    device = params[0].device
    index = torch.tensor(list(slots), dtype=torch.int64, device=device)
    return torch.cat([p.data.index_select(0, index).reshape(len(slots), -1).view(torch.uint8) for p in params],
                     dim=1)


def install_rows(experts: FusedExperts, slots: Sequence[int], rows: torch.Tensor) -> None:
    """Make ``slots`` (the logical expert of each new slot) this rank's experts, with ``rows`` (:func:`pack_rows`'s
    layout) their weights: in place when the slot count is unchanged (a captured graph keeps its pointers), else
    in new parameters (the first placement, before any graph)."""
    params = stacked_parameters(experts)
    resize = len(slots) != len(experts.slots)
    offset = 0
    for param in params:
        shape = (len(slots), *param.shape[1:])
        width = param[0].numel() * param.element_size()
        data = rows[:, offset:offset + width].contiguous().view(param.dtype).view(shape)
        offset += width
        if resize:
            name = next(n for n, p in experts.named_parameters(recurse=False) if p is param)
            setattr(experts, name, torch.nn.Parameter(data.clone(), requires_grad=False))
        else:
            param.data.copy_(data)
    experts.slots = list(slots)
    experts.num_local_experts = len(slots)


class ExpertTransfer:
    """One layer's moves under way: its all-to-all started (``async_op``) on ``group``; :meth:`rows` waits for it
    and gives the new stack's rows."""

    def __init__(self, experts: FusedExperts, moves: Moves, new_slots: Sequence[int], group: object):
        self.experts, self.moves, self.new_slots = experts, moves, list(new_slots)
        outgoing = [slot for slots in moves.sends for slot in slots]
        width = pack_rows(experts, [0]).shape[1] if experts.slots else 0
        device = stacked_parameters(experts)[0].device
        send = pack_rows(experts, outgoing) if outgoing else torch.empty((0, width), dtype=torch.uint8, device=device)
        self._received = torch.empty((moves.moved, width), dtype=torch.uint8, device=device)
        self._send = send  # kept alive until the collective is done
        self._work = dist.all_to_all_single(self._received, send, [len(r) for r in moves.receives],
                                            [len(s) for s in moves.sends], group=group, async_op=True)

    def rows(self) -> torch.Tensor:
        """Wait for the all-to-all; the new stack's rows (own experts copied from the current stack, which must not
        have changed since the start: the caller checks the weights' version)."""
        self._work.wait()
        width = self._received.shape[1]
        rows = torch.empty((len(self.new_slots), width), dtype=torch.uint8, device=self._received.device)
        if self.moves.local:
            old, new = zip(*self.moves.local)
            rows[list(new)] = pack_rows(self.experts, old)
        incoming = [slot for slots in self.moves.receives for slot in slots]
        if incoming:
            rows[incoming] = self._received
        return rows


def install_placement(block: SparseMoeBlock, placement: Sequence[int], dispatcher: TokenDispatcher, ordered: bool,
                      transfer: ExpertTransfer | None = None) -> None:
    """Make ``placement`` (every rank's physical slots in order, each its logical expert) ``block``'s: this rank's
    rows from ``transfer`` (none: the rows stay as they are), the routing map, and ``dispatcher`` over the physical
    experts (``ordered``: the block's dispatch order, kept across the change). The first placement at start and the
    placement after a member is lost or joins both go through here."""
    experts = block.experts
    if transfer is not None:
        install_rows(experts, transfer.new_slots, transfer.rows())
    experts.num_physical = len(placement)
    block.placement = LayerPlacement(list(placement), experts.num_experts, experts.gate_up_proj.device)
    dispatcher.ordered = ordered
    block.dispatcher = dispatcher

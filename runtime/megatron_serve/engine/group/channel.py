"""Rank 0's messages to the other ranks of its group (:class:`PlanChannel`), and the device tensors that go with a
step (:func:`broadcast_previous_tokens`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ...errors import EngineGroupLost
from ..step_plan import StepPlan


class PlanChannel:
    """Rank 0's messages to the other ranks, over a gloo group (host integers; NCCL carries device tensors).

    Each message is a header ``[kind, length, tokens]``; a step follows as ``length`` packed integers
    (:meth:`StepBuffers.pack`), the other kinds as one small pickled payload (a suspend level, a
    weight source): those are rare, steps are not. ``tokens``: with data-parallel attention, the largest step
    of the data-parallel ranks, which a step and an idle rank's empty MoE pass are padded for (-1: none).
    """

    KINDS = ("step", "suspend", "resume", "refit", "stop", "lora", "idle", "peer", "kv_copy", "kv_layout", "kv_park",
             "kv_restore")

    def __init__(self, group: dist.ProcessGroup, leader: int = 0, device_group: object | None = None,
                 leaders: object | None = None):
        """``leader``: the global rank that sends (rank 0, or a data-parallel rank's first); ``device_group``: where
        device tensors of a step go (None: the whole group); ``leaders``: the data-parallel ranks' leaders, which
        step together (None without data-parallel attention)."""
        self.group = group
        self.leader = leader
        self.device_group = device_group
        self.leaders = leaders
        self.rendezvous: dist.Store | None = None  # the store the group met in (data-parallel attention's groups)

    def send(self, kind: str, packed: np.ndarray | None = None, payload: object = None,
             tokens: int | None = None) -> None:
        length = 0 if packed is None else len(packed)
        header = torch.tensor([self.KINDS.index(kind), length, -1 if tokens is None else tokens], dtype=torch.int64)
        dist.broadcast(header, src=self.leader, group=self.group)
        if packed is not None:
            dist.broadcast(torch.from_numpy(packed), src=self.leader, group=self.group)
        elif kind not in ("step", "idle"):
            dist.broadcast_object_list([payload], src=self.leader, group=self.group)

    def receive(self) -> tuple[str, np.ndarray | object, int | None]:
        """``(kind, payload, tokens)`` of the leader's next message."""
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, src=self.leader, group=self.group)
        code, length, tokens = header.tolist()
        kind, tokens = self.KINDS[code], None if tokens < 0 else tokens
        if kind == "idle":
            return kind, None, tokens
        if kind == "step":
            packed = torch.empty(length, dtype=torch.int64)
            dist.broadcast(packed, src=self.leader, group=self.group)
            return kind, packed.numpy(), tokens
        message: list = [None]
        dist.broadcast_object_list(message, src=self.leader, group=self.group)
        return kind, message[0], None

    def gather(self, what: str) -> list:
        """The leader's side of what each other rank sends back once it is done with ``what``, in rank order; a
        failed collective means the group broke."""
        everyone: list = [None] * dist.get_world_size(self.group)
        try:
            dist.gather_object(None, everyone, dst=self.leader, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke during {what}: {exc}") from exc
        return everyone[1:]

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """A step's device tensor (previous tokens, image embeddings) from the leader to its ranks."""
        dist.broadcast(tensor, src=self.leader, group=self.device_group)
        return tensor



def broadcast_previous_tokens(channel: PlanChannel, plan: StepPlan, tokens: torch.Tensor | None, count: int,
                              device: torch.device) -> torch.Tensor | None:
    """The previous step's sampled tokens on every rank, when the plan gathers some (the leader passes them)."""
    if not plan.num_gather:
        return None
    if tokens is None:
        tokens = torch.empty(count, dtype=torch.int64, device=device)
    return channel.broadcast(tokens)



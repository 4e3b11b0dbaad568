"""Tensor-parallel context of this process: which slice of every sharded weight it owns.

With one rank (the default) every layer holds whole weights and no collective is issued, so the
single-GPU and CPU paths pay nothing for the tensor-parallel structure.

``expert_parallel`` (``--enable-expert-parallel``): the same ranks hold whole experts instead of a slice of
every expert (:mod:`.token_dispatcher`); attention, dense layers and shared experts stay tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None
    expert_parallel: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def ordered_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The all-reduce of ``--batch-invariant``: every rank's part gathered, then added in rank order,
        so the sum's rounding cannot depend on the collective's algorithm or the message size."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

"""Tensor-parallel context of this process: which slice of every sharded weight it owns.

With one rank (the default) every layer holds whole weights and no collective is issued, so the
single-GPU and CPU paths pay nothing for the tensor-parallel structure.

``expert_parallel`` (``--enable-expert-parallel``): the same ranks hold whole experts instead of a slice of
every expert (:mod:`.token_dispatcher`); attention, dense layers and shared experts stay tensor-parallel.

``stage`` (``--pipeline-parallel-size``): which contiguous layers this rank's stage holds. Stage ``s``'s
tensor-parallel rank ``r`` is rank ``s * tp + r`` of the group; it receives the hidden states (and the
residual) from the same tensor-parallel rank of the stage before and sends them to the one after; the last
stage's final hidden states are broadcast to every rank, which all compute the logits (each stage holds
the embedding, the final norm and the LM head), so rank 0 samples as without stages.

``data_parallel`` (``--data-parallel-size`` with ``--enable-expert-parallel``, data-parallel attention): this
rank's attention group is one of ``dp`` groups of ``tp`` ranks, each serving its own requests, and the MoE layers'
experts are sharded over all ``dp x tp`` ranks (:attr:`TensorParallel.expert_rank`); tokens cross the data-parallel
ranks in the all-to-all (:class:`.token_dispatcher.DataParallelDispatcher`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage; ``rank``: its rank in the whole group, ``group``: the whole group's;
    ``micro_batches``: how many parts a step's requests pass the stages in (``engine.micro_batches``)."""

    index: int = 0
    size: int = 1
    rank: int = 0
    tp_size: int = 1
    group: object | None = None
    micro_batches: int = 1

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def receive(self, *like: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
        """Tensors shaped as ``like`` from the stage before (the same tensor-parallel rank of it); ``tag``: the
        micro-batch they belong to (a stage may send the next before this one received the last)."""
        received = [torch.empty_like(t) for t in like]
        for index, tensor in enumerate(received):
            dist.recv(tensor, self.rank - self.tp_size, group=self.group, tag=tag * len(like) + index)
        return received

    def send(self, *tensors: torch.Tensor, tag: int = 0) -> list[tuple[torch.Tensor, object]]:
        """Start sending ``tensors`` to the next stage, without waiting for it to take them (it may be busy with
        the micro-batch before): returns each tensor sent with its pending send, to wait on before the step
        ends (the tensor must live until then)."""
        sent = []
        for index, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            sent.append((tensor, dist.isend(tensor, self.rank + self.tp_size, group=self.group,
                                            tag=tag * len(tensors) + index)))
        return sent

    def share_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's ``hidden`` on every rank (the others pass a buffer of its shape)."""
        if self.size > 1:
            dist.broadcast(hidden, (self.size - 1) * self.tp_size, group=self.group)
        return hidden


NO_PIPELINE = PipelineStage()


@dataclass(frozen=True)
class DataParallel:
    """This rank's data-parallel attention rank ``index`` of ``size``; ``group``: every rank of every data-parallel
    rank (the MoE layers' expert-parallel group)."""

    index: int = 0
    size: int = 1
    group: object | None = None


NO_DATA_PARALLEL = DataParallel()


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None
    expert_parallel: bool = False
    stage: PipelineStage = NO_PIPELINE
    data_parallel: DataParallel = NO_DATA_PARALLEL
    # row-parallel layers gather their input and split their output instead (layers.GatheredRowLinear): their bits
    # are one rank's; set where --batch-invariant promises one rank's log probs (expert parallelism)
    gathered_rows: bool = False

    @property
    def expert_rank(self) -> int:
        """This rank's place among the ranks the experts are sharded over (``dp x tp`` of them)."""
        return self.data_parallel.index * self.size + self.rank

    @property
    def expert_size(self) -> int:
        return self.data_parallel.size * self.size

    @property
    def engine_rank(self) -> int:
        """This rank's place among its engine's ranks (stage-major: stage ``s``'s rank ``r`` is ``s * size + r``).
        Under data-parallel attention an engine is one data-parallel rank's ``size`` ranks, numbered from 0."""
        return self.stage.index * self.size + self.rank

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

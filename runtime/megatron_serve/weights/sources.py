"""Where a refit's weights come from: a model directory, tensors in this process, or a trainer.

``DynamicInferenceEngine.refit`` runs one path for all three: ``check`` (names and shapes against
the served model, and every tensor it holds free of NaN and infinities, :mod:`..model.finite`; what ``REFIT_VERIFY``
runs on every engine before any weight changes: a directory's tensors are read for it, a trainer's are checked
by the sender before its REFIT and again by each engine as each bucket lands, before it is applied), then ``tensors`` streamed into the live parameters by the loader, on every
tensor-parallel rank (each copies its slice, fused QKV and gate-up parts included). A source is
picklable: rank 0 hands it to its tensor-parallel followers as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist

from ..wire.rendezvous import LoraPush, Rendezvous, TensorSpec
from ..model.llama import LlamaForCausalLM
from ..model.loader import checkpoint_files, checkpoint_views, iterate_checkpoint, verify_checkpoint, verify_shapes
from . import group as transfer
from .drafter import is_drafter
from ..model.finite import refuse_nonfinite
from .manifest import plan_buckets, spec_of, unpack
from .digests import forget_digests


class WeightSource(Protocol):
    label: str  # where the weights came from, as STATUS and the acknowledgement show it
    partial: bool  # may cover a subset of the weights

    def check(self, model: LlamaForCausalLM) -> None:
        """``ValueError`` naming the first tensor that does not fit ``model``; touches nothing."""

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every ``(name, shape)`` pair the source carries (the drafter's and the adapters' included), reading no
        tensor data: what the refit's targets other than the policy check (:mod:`..engine.verbs.refit_targets`)."""

    def adapters(self) -> tuple[LoraPush, ...]:
        """The LoRA adapter versions the source carries beside the policy (a sharded refit's only)."""

    def tensors(self, model: LlamaForCausalLM) -> Iterable[tuple[str, object]]:
        """``(checkpoint name, full tensor or safetensors slice)`` pairs, on every rank."""


@dataclass(frozen=True)
class DirectorySource:
    """A Hugging Face model directory of the served model's shapes (every weight)."""

    path: str
    partial: bool = False

    @property
    def label(self) -> str:
        return self.path

    def check(self, model: LlamaForCausalLM) -> None:
        verify_checkpoint(model, self.path)
        refuse_nonfinite(checkpoint_views(self.path), f"the checkpoint at {self.path}")  # reads every tensor

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape from the safetensors headers (after :meth:`check`: no GGUF file)."""
        named = []
        for path in checkpoint_files(self.path):
            with open(path, "rb") as file:
                header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
            named += [(name, tuple(entry["shape"])) for name, entry in header.items() if name != "__metadata__"]
        return named

    def adapters(self) -> tuple[LoraPush, ...]:
        return ()

    def tensors(self, model: LlamaForCausalLM) -> Iterator[tuple[str, object]]:
        forget_digests(model)  # what a later delta compares against is no longer what this rank holds
        return iterate_checkpoint(self.path)


@dataclass(frozen=True)
class TensorSource:
    """Tensors handed over in this process (trainer and engine colocated): any subset of the weights."""

    named: tuple[tuple[str, torch.Tensor], ...]
    label: str = "tensors"
    partial: bool = True

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "TensorSource":
        named = []
        for item in named_tensors:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
            spec_of(*item)  # names and dtypes that can be loaded
            named.append((item[0], item[1].detach()))
        if not named:
            raise ValueError("no weights given: pass (name, tensor) pairs, e.g. model.named_parameters()")
        return cls(tuple(named))

    def check(self, model: LlamaForCausalLM) -> None:
        verify_shapes(model, ((name, tuple(t.shape)) for name, t in self.named if not is_drafter(name)), partial=True)
        refuse_nonfinite(self.named, "the refit's tensors")

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every ``(name, shape)`` pair, the drafter's (:mod:`.drafter`) included."""
        return [(name, tuple(t.shape)) for name, t in self.named]

    def adapters(self) -> tuple[LoraPush, ...]:
        return ()

    def tensors(self, model: LlamaForCausalLM) -> Iterable[tuple[str, object]]:
        forget_digests(model)
        return self.named

    def __reduce__(self):  # to tensor-parallel followers: host copies (a CUDA tensor pickles to its device)
        return (TensorSource, (tuple((n, t.cpu()) for n, t in self.named), self.label, self.partial))


def check_backend(rv: Rendezvous, model: LlamaForCausalLM) -> None:
    """A trainer's transfer over NCCL reaches only an engine whose weights are on a CUDA device."""
    if rv.backend == "nccl" and not (dist.is_nccl_available() and next(model.parameters()).is_cuda):
        raise ValueError("the sender chose backend nccl, but this engine's weights are not on a CUDA device "
                         "(send with backend='gloo')")


@dataclass(frozen=True)
class TrainerSource:
    """What a trainer's refit is, broadcast (:class:`RendezvousSource`) or sent in pieces
    (:class:`~megatron_serve.weights.sharded.ShardedSource`): the rendezvous its manifest and transfer group come
    from, which each engine rank joins as its own rank."""

    rendezvous: Rendezvous
    label: str
    partial: bool = True

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every ``(name, shape)`` pair of the manifest, the drafter's (:mod:`.drafter`) included."""
        return [(spec.name, tuple(spec.shape)) for spec in self.rendezvous.manifest]

    def transfer_place(self, model: LlamaForCausalLM) -> tuple[int, torch.device]:
        """This engine rank's rank in the transfer group, and where it receives: on the weights' device over NCCL,
        else in host memory."""
        rv = self.rendezvous
        if rv.world_size is None or rv.rank_offset is None:
            raise ValueError("the load step of a rendezvous refit needs world_size and rank_offset")
        rank = rv.rank_offset + model.tp.engine_rank  # its rank in the engine (pipeline stages included)
        device = next(model.parameters()).device if rv.backend == "nccl" else torch.device("cpu")
        return rank, device


@dataclass(frozen=True)
class RendezvousSource(TrainerSource):
    """Weights a trainer broadcasts in buckets (:class:`~megatron_serve.wire.rendezvous.Rendezvous`)."""

    def check(self, model: LlamaForCausalLM) -> None:
        rv = self.rendezvous
        check_backend(rv, model)
        verify_shapes(model, ((spec.name, spec.shape) for spec in rv.manifest if not is_drafter(spec.name)),
                      partial=True)

    def adapters(self) -> tuple[LoraPush, ...]:
        """None: a broadcast carries one adapter version alone (``lora``), never beside the policy (a rendezvous
        lists ``adapters`` only with ``pieces``)."""
        return ()

    def tensors(self, model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        """Join the transfer group as this rank and yield every tensor as its bucket arrives."""
        rv = self.rendezvous
        rank, device = self.transfer_place(model)
        if rv.lora is None:
            forget_digests(model)  # base weights broadcast whole: a later delta must compare against nothing
        try:
            store = transfer.announce(rv.address, rv.prefix, rank, rv.world_size, rv.timeout_s)
            host = transfer.local_address_towards(rv.address.rpartition(":")[0])
            pg = transfer.process_group(store, rank, rv.world_size, rv.backend, rv.timeout_s, host)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {rank} could not join the transfer group of {self.label}: {_reason(exc)}") from exc
        manifest: list[TensorSpec] = list(rv.manifest)
        buckets = plan_buckets(manifest, rv.bucket_bytes)

        def receive(index: int) -> tuple[torch.Tensor, dist.Work]:
            buffer = torch.empty(buckets[index].nbytes, dtype=torch.uint8, device=device)
            return buffer, transfer.broadcast(pg, buffer)

        try:
            pending = receive(0)
            for index, bucket in enumerate(buckets):
                buffer, work = pending
                try:
                    work.wait()
                    if index + 1 < len(buckets):  # the next bucket arrives while this one is loaded
                        pending = receive(index + 1)
                except RuntimeError as exc:
                    raise RuntimeError(f"the transfer from {self.label} broke at bucket {index + 1} of {len(buckets)}: "
                                       f"{_reason(exc)}") from exc
                tensors = unpack(bucket, manifest, buffer)
                # the sender checked them before the REFIT (WeightSender); a sender that did not is refused here,
                # before this bucket's tensors reach a weight
                refuse_nonfinite(tensors, f"the transfer from {self.label}")
                yield from tensors
        finally:
            # In gloo's broadcast tree a rank hears of a dead sender only from its parent rank, and
            # a parent's connections close only once its group and pending work are released: kept
            # alive here, a tensor-parallel follower waited out the whole timeout (120 s) after
            # the trainer died, while its leader had failed within milliseconds.
            pending = work = None
            transfer.close(pg)
            pg = None  # the receiving closure's reference too


def _reason(exc: Exception) -> str:
    """A collective's error without its source location and boilerplate (gloo adds both)."""
    return re.sub(r"^\[[^\]]*\]\s*", "", str(exc).split(". This is typically")[0]).strip()


def weight_source(source: "str | Path | WeightSource") -> WeightSource:
    """A directory path becomes a :class:`DirectorySource`; sources pass through."""
    if isinstance(source, (str, Path)):
        return DirectorySource(str(source))
    return source

"""A sharded refit, the engine rank's side: receive exactly this rank's regions, stage them, commit, then load.

Each engine rank finds what it serves of every tensor (:func:`.layout.engine_layout`), publishes it in the
transfer's store with the digests of what it holds (a delta compares them), and receives from every trainer
rank, point to point and in parallel, the chunks :func:`.shards.link_chunks` names, into one staging tensor per
region (never a full tensor it does not serve). Nothing live changes while bytes move: once every byte of its
regions is here, the rank joins the commit (every rank of the transfer, trainer ranks included); only when all
got there does it hand the regions to the loader (:class:`.layout.RegionSlice`). Staging is in host memory
(pinned for an engine on a GPU): the device holds only the buckets in flight. A rank that dies or a
transfer that breaks fails the commit everywhere, within the transfer's timeout, and every engine keeps its
weights and its epoch (a rollback that costs one staged copy of the rank's slice of what was sent). Once loaded,
each rank publishes its figures for the acknowledgement: bytes received, seconds, bytes/s, the bytes it serves, and
how far its resident memory rose over receive, staging and load (:mod:`.peak`).

Under a delta the trainer ranks digest their chunks (:func:`.shards.digest`) and publish the digests; each engine
rank keeps those of its regions once the load completed (:mod:`.digests`), and the next delta compares against
them. A full refit keeps none (nobody digests anything): the first delta after it sends everything once.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..model.llama import LlamaForCausalLM
from ..model.loader import verify_shapes
from ..wire.rendezvous import TRANSFER_DTYPES, LoraPush, Rendezvous
from . import group as transfer
from .digests import forget_digests, held_digests, keep_digests
from .adapters import adapter_shapes, adapters_first, is_adapter
from .drafter import is_drafter
from ..model.finite import refuse_nonfinite
from .layout import RegionSlice, engine_layout
from .manifest import torch_dtype
from .peak import peak_since, start_peak
from .shards import (IN_FLIGHT, Box, buckets_of, changed_key, cover_problem, layout_key, link_chunks,
                     local_view, received_key, volume)
from .sources import RendezvousSource, TrainerSource, check_backend

logger = logging.getLogger("megatron_serve.weights")


def sent_names(rendezvous: Rendezvous, store: dist.Store, rank: int, regions: dict[str, Box], deadline: float
               ) -> tuple[set[str], dict[str, dict[str, str]]]:
    """The tensors engine rank ``rank`` receives (all it serves, or under a delta those some trainer rank changed),
    and under a delta the trainer ranks' digests of every chunk of its regions (what it holds afterwards)."""
    if not rendezvous.delta:
        return set(regions), {}
    names: set[str] = set()
    digests: dict[str, dict[str, str]] = {}
    for sender in range(rendezvous.senders):
        changed, theirs = pickle.loads(transfer.wait_for_key(store, changed_key(sender), deadline))
        names.update(changed.get(rank, ()))
        for name, chunks in theirs.get(rank, {}).items():
            digests.setdefault(name, {}).update(chunks)
    return names & set(regions), digests


@dataclass(frozen=True)
class ShardedSource(TrainerSource):
    """Weights that ``rendezvous.senders`` trainer ranks hold in pieces
    (:class:`~megatron_serve.wire.rendezvous.Rendezvous` with ``pieces``); a refit source as :mod:`.sources` describes
    them."""

    def check(self, model: LlamaForCausalLM) -> None:
        rv = self.rendezvous
        check_backend(rv, model)
        problem = cover_problem(rv.manifest, rv.pieces or [])
        if problem is not None:
            raise ValueError(problem)
        listed = {push.name for push in rv.adapters or ()}
        unlisted = sorted(set(adapter_shapes(self.shapes())) - listed)
        if unlisted:
            raise ValueError(f"the refit carries tensors of LoRA adapter {unlisted[0]!r} that its rendezvous does not "
                             "list (a coordinator or engine too old for adapters in a refit?)")
        verify_shapes(model, ((spec.name, spec.shape) for spec in rv.manifest
                              if not is_drafter(spec.name) and not is_adapter(spec.name)), partial=True)

    def adapters(self) -> tuple[LoraPush, ...]:
        return tuple(self.rendezvous.adapters or ())

    def tensors(self, model: LlamaForCausalLM) -> Iterator[tuple[str, RegionSlice]]:
        """Receive this rank's regions, commit with every rank, then yield them; digests kept once all loaded."""
        rv = self.rendezvous
        rank, device = self.transfer_place(model)
        regions = engine_layout(model, rv.manifest, holds_extra=model.tp.engine_rank == 0)
        # what receiving, staging and loading cost this process, in its acknowledgement (after the plan: a rank's
        # first shape-only model imports torch's meta kernels once, which is no tensor)
        peak = start_peak()
        held = held_digests(model)
        published = {name: (box, held.get(name, {})) for name, box in regions.items()}
        deadline = time.monotonic() + rv.timeout_s
        try:
            store = transfer.announce(rv.address, rv.prefix, rank, rv.world_size, rv.timeout_s,
                                      {layout_key(rank): pickle.dumps(published)})
            host = transfer.local_address_towards(rv.address.rpartition(":")[0])
            pg = transfer.process_group(store, rank, rv.world_size, rv.backend, rv.timeout_s, host)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {rank} could not join the transfer group of {self.label}: {exc}") from exc
        try:
            names, digests = sent_names(rv, store, rank, regions, deadline)
            pinned = next(model.parameters()).device.type == "cuda"  # staging a GPU will read
            staged, facts = _receive(rv, pg, regions, names, device, pinned)
            # Checks of the received values belong here, before the commit: one that raises fails the commit on
            # every rank, and no engine changes.
            refuse_nonfinite(staged.items(), f"REFIT from {self.label}")
            transfer.commit(pg, device)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"the transfer from {self.label} broke before any weight changed (rank {rank}): "
                               f"{exc}") from transfer.drop_frames(exc)  # the other ranks hear at once
        finally:
            transfer.close(pg)
            del pg
        shapes = {spec.name: spec.shape for spec in rv.manifest}
        committed = time.perf_counter()
        done = False
        try:
            for name, data in adapters_first(staged.items()):  # the engine builds the adapters before the policy
                yield name, RegionSlice(shapes[name], regions[name][0], data)
            done = True
        finally:
            if done and rv.delta:
                keep_digests(model, digests)
            else:  # a full refit leaves none: the next delta sends everything once, with its digests
                forget_digests(model)
        facts.update(load_s=round(time.perf_counter() - committed, 6), peak_rss_bytes=peak_since(peak))
        del staged
        _publish(store, rank, facts)


def _publish(store: dist.Store, rank: int, facts: dict[str, Any]) -> None:
    """This rank's figures for the acknowledgement (trainer rank 0 reads them once the REFIT is answered, which is
    after every engine rank loaded): a trainer gone by now costs them, not the refit."""
    try:
        store.set(received_key(rank), pickle.dumps(facts))
    except (RuntimeError, ValueError) as exc:
        logger.warning("could not hand this rank's refit figures to the trainer: %s", exc)


def _receive(rv: Rendezvous, pg: dist.ProcessGroup, regions: dict[str, Box], names: set[str],
             device: torch.device, pinned: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every chunk of ``names`` from every trainer rank, copied into one staging tensor per region, in host memory
    (``pinned`` where a GPU will read it; never in an engine on CPU, where pinning would start a CUDA context on a
    GPU machine): a refit needs no device memory beyond the buckets in flight."""
    started = time.perf_counter()
    manifest, pieces = rv.manifest, rv.pieces or []
    wanted = {name: box for name, box in regions.items() if name in names}
    staged = {spec.name: torch.empty(wanted[spec.name][1], dtype=torch_dtype(spec.dtype), pin_memory=pinned)
              for spec in manifest if spec.name in wanted}
    links = {sender: deque(buckets_of(link_chunks(manifest, pieces, sender, wanted, rv.bucket_bytes),
                                      rv.bucket_bytes)) for sender in range(rv.senders)}
    posted: dict[int, deque] = {sender: deque() for sender in links}
    received = 0

    def post(sender: int) -> None:
        while links[sender] and len(posted[sender]) < IN_FLIGHT:
            bucket = links[sender].popleft()
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            posted[sender].append((bucket, buffer, pg.recv([buffer], sender, 0)))

    for sender in links:
        post(sender)
    while any(posted.values()):
        for sender in links:
            if not posted[sender]:
                continue
            bucket, buffer, work = posted[sender].popleft()
            work.wait()
            post(sender)
            for chunk, offset in zip(bucket.chunks, bucket.offsets):
                spec = manifest[chunk.tensor]
                raw = buffer[offset:offset + chunk.nbytes]
                region = wanted[spec.name]
                target = local_view(staged[spec.name], region[0], chunk.box)
                target.copy_(raw.view(torch_dtype(spec.dtype)).view(chunk.box[1]))
                received += chunk.nbytes
    seconds = time.perf_counter() - started
    itemsize = {spec.name: TRANSFER_DTYPES[spec.dtype] for spec in manifest}
    facts = {"bytes": received, "seconds": round(seconds, 6),
             "bytes_per_s": round(received / seconds) if seconds > 0 else None, "tensors": len(staged),
             "serves_bytes": sum(volume(box[1]) * itemsize[name] for name, box in regions.items()),
             "largest_tensor_bytes": max((t.numel() * t.element_size() for t in staged.values()), default=0)}
    return staged, facts


def rendezvous_source(rendezvous: Rendezvous, label: str) -> "RendezvousSource | ShardedSource":
    """A trainer's refit: pieces sent point to point (this module), or whole tensors broadcast (adapters)."""
    if rendezvous.pieces is not None:
        return ShardedSource(rendezvous, label)
    return RendezvousSource(rendezvous, label)

"""A sharded refit, a trainer rank's side: send each engine rank the chunks of its regions that this rank holds.

Runs on a thread of every trainer rank (``WeightSender``, :mod:`megatron_serve.client.weight_sender`): wait for
the engine ranks to publish their regions (:mod:`.sharded`), build the transfer group, work out the chunks of
every link from this rank (:func:`.shards.link_chunks`), and send them point to point, every link at once,
with at most :data:`.shards.IN_FLIGHT` buckets per link in flight; then join the commit. Under a delta each
trainer rank first says which tensors changed for which engine rank (a chunk whose digest differs from the one
the engine rank published), and every rank sends a tensor to an engine rank when any trainer rank changed it:
the engine rank loads whole regions, so all of a region's chunks travel or none. The digests are the trainer
ranks' (each digests its own chunks, in parallel); engine ranks keep them for the next delta and digest nothing.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..wire.rendezvous import PieceSpec, Rendezvous
from . import group as transfer
from .adapters import is_adapter
from .shards import (IN_FLIGHT, Chunk, LinkBucket, buckets_of, changed_key, digest, layout_key, link_chunks,
                     local_view, received_key)

logger = logging.getLogger("megatron_serve.weights")

#: ``on_bucket(index, count, nbytes)``: a bucket left (index over all of this rank's links).
BucketCallback = Callable[[int, int, int], None]


def _chunk_bytes(chunk: Chunk, pieces: Sequence[PieceSpec], local: dict[int, torch.Tensor]) -> torch.Tensor:
    """The chunk's bytes, contiguous, as they travel."""
    view = local_view(local[chunk.piece], pieces[chunk.piece].offset, chunk.box)
    return view.contiguous().reshape(-1).view(torch.uint8)


def _pack(bucket: LinkBucket, pieces: Sequence[PieceSpec], local: dict[int, torch.Tensor],
          device: torch.device) -> torch.Tensor:
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for chunk, offset in zip(bucket.chunks, bucket.offsets):
        buffer[offset:offset + chunk.nbytes].copy_(_chunk_bytes(chunk, pieces, local))
    return buffer


def _delta(store: dist.Store, rv: Rendezvous, rank: int, links: dict[int, list[Chunk]], layouts: dict[int, dict],
           local: dict[int, torch.Tensor], deadline: float) -> dict[int, list[Chunk]]:
    """The chunks left to send after every trainer rank said which tensors changed for which engine rank."""
    pieces = rv.pieces or []
    changed: dict[int, set[str]] = {}
    digests: dict[int, dict[str, dict[str, str]]] = {}  # what each engine rank holds after this refit
    for engine, chunks in links.items():
        for chunk in chunks:
            name = rv.manifest[chunk.tensor].name
            value = digest(_chunk_bytes(chunk, pieces, local))
            digests.setdefault(engine, {}).setdefault(name, {})[chunk.key] = value
            # an adapter travels whole every time: the engine builds its new version from all of its tensors
            if is_adapter(name) or layouts[engine].get(name, (None, {}))[1].get(chunk.key) != value:
                changed.setdefault(engine, set()).add(name)
    store.set(changed_key(rank), pickle.dumps((changed, digests)))
    for sender in range(rv.senders):
        if sender != rank:
            theirs, _ = pickle.loads(transfer.wait_for_key(store, changed_key(sender), deadline))
            for engine, names in theirs.items():
                changed.setdefault(engine, set()).update(names)
    return {engine: [c for c in chunks if rv.manifest[c.tensor].name in changed.get(engine, ())]
            for engine, chunks in links.items()}


def send_pieces(store: dist.Store, rv: Rendezvous, rank: int, local: dict[int, torch.Tensor], host: str,
                cancelled: Callable[[], bool], on_bucket: BucketCallback | None = None) -> dict[str, Any]:
    """Trainer rank ``rank``'s part of the transfer; ``local``: its tensors by index into ``rv.pieces``.
    Returns its figures."""
    started = time.perf_counter()
    deadline = time.monotonic() + rv.timeout_s
    world_size = transfer.wait_for_ranks(store, deadline, cancelled, first=rv.senders)
    layouts = {engine: pickle.loads(store.get(layout_key(engine))) for engine in range(rv.senders, world_size)}
    group = transfer.process_group(store, rank, world_size, rv.backend, rv.timeout_s, host)
    joined = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if rv.backend == "nccl" else torch.device("cpu")
    try:
        links = {engine: link_chunks(rv.manifest, rv.pieces or [], rank, {n: box for n, (box, _) in layout.items()},
                                     rv.bucket_bytes) for engine, layout in layouts.items()}
        total = sum(c.nbytes for chunks in links.values() for c in chunks)
        if rv.delta:
            links = _delta(store, rv, rank, links, layouts, local, deadline)
        planned = time.perf_counter()
        queues = {engine: deque(buckets_of(chunks, rv.bucket_bytes)) for engine, chunks in links.items()}
        count = sum(len(q) for q in queues.values())
        per_link = {engine: sum(c.nbytes for c in chunks) for engine, chunks in links.items() if chunks}
        _send(group, queues, rv.pieces or [], local, device, count, on_bucket)
        transfer.commit(group, device)
    except BaseException as exc:
        transfer.drop_frames(exc)  # the engine ranks waiting on this rank hear at once (see drop_frames)
        raise
    finally:
        transfer.close(group)
        del group
    finished = time.perf_counter()
    sent = sum(per_link.values())
    seconds = finished - planned
    figures: dict[str, Any] = {
        "rank": rank, "bytes": sent, "skipped_bytes": total - sent, "buckets": count,
        "chunks": sum(len(c) for c in links.values()), "links": per_link, "world_size": world_size,
        "backend": rv.backend, "rendezvous_s": round(joined - started, 6), "plan_s": round(planned - joined, 6),
        "transfer_s": round(seconds, 6), "bytes_per_s": round(sent / seconds) if seconds > 0 else None}
    return figures


def _send(group: dist.ProcessGroup, queues: dict[int, deque], pieces: Sequence[PieceSpec],
          local: dict[int, torch.Tensor], device: torch.device, count: int, on_bucket: BucketCallback | None) -> None:
    """Every link's buckets, links side by side, at most ``IN_FLIGHT`` per link posted at a time."""
    flying: dict[int, deque] = {engine: deque() for engine in queues}
    done = 0

    def land(engine: int) -> None:
        nonlocal done
        buffer, work = flying[engine].popleft()
        work.wait()
        if on_bucket is not None:
            on_bucket(done, count, buffer.numel())
        done += 1

    while any(queues.values()):
        for engine, queue in queues.items():
            if not queue:
                continue
            if len(flying[engine]) >= IN_FLIGHT:
                land(engine)
            buffer = _pack(queue.popleft(), pieces, local, device)
            flying[engine].append((buffer, group.send([buffer], engine, 0)))
    for engine in flying:
        while flying[engine]:
            land(engine)


#: How long rank 0 waits for an engine rank's figures once the REFIT is answered. Each rank publishes them as it
#: finishes loading, before the answer, so they are there or about to be; a rank that died meanwhile never
#: publishes, and waiting the transfer's whole time-out for it held the trainer's ``send`` that long.
FIGURES_AFTER_ANSWER_S = 30.0


def receivers(store: dist.Store, first: int, world_size: int, timeout: float = FIGURES_AFTER_ANSWER_S
              ) -> dict[int, dict[str, Any]]:
    """Every engine rank's figures (bytes received, seconds, bytes/s, the bytes it serves, its peak memory), which
    each publishes once it loaded: read on rank 0 once the REFIT is answered (a rank whose figures do not come
    within ``timeout`` is left out, logged)."""
    deadline = time.monotonic() + timeout
    out: dict[int, dict[str, Any]] = {}
    for engine in range(first, world_size):
        try:
            out[engine] = pickle.loads(transfer.wait_for_key(store, received_key(engine), deadline))
        except (TimeoutError, RuntimeError) as exc:
            logger.warning("engine rank %d's refit figures did not come: %s", engine, exc)
    return out

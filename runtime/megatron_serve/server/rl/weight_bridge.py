"""The server as a receiving rank of a trainer's own process group: the weights a trainer broadcasts, in host memory.

RL frameworks push weights into vLLM and SGLang servers by making a process group of their own (the trainer and
every engine rank) and broadcasting the tensors over it. Here the server process joins that group in the engines'
place, receives the broadcast into host tensors, and hands them to the fleet through the REFIT transaction
(:mod:`.weight_updates`), so that every engine verifies names and shapes before any loads.

The group is built as the framework builds its side (:class:`~megatron_serve.weights.framework_groups.Layout`),
with no global default group (as :mod:`megatron_serve.weights.group` does): a ``TCPStore`` (the trainer's, or this
server's where the protocol has a server rank serve it), the framework's key prefixes in front of it, and a
``ProcessGroupGloo`` (``gloo``: CPU tensors) or ``ProcessGroupNCCL`` (``nccl``: the server process needs a GPU;
each tensor lands on it, then is copied to host memory) made from them directly. Imported only when a trainer's
group is joined: the HTTP server does not import torch otherwise.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...weights.framework_groups import PACKED_BUFFER_BYTES, Layout, TensorMeta, packed_chunks
from ...weights.group import backend_group, local_address_towards
from ...weights.manifest import torch_dtype


class TrainerGroup:
    """This server's ranks in one trainer's group, joined (:meth:`join`, blocking) until :meth:`close`.

    Every rank this server takes receives every broadcast (one thread each, as each were an engine); the tensors
    are read from the first. One rank is the usual case: more exist only where a trainer counted more receivers.
    """

    def __init__(self, layout: Layout, stores: list[dist.Store], groups: list[dist.ProcessGroup]) -> None:
        self.layout = layout
        self._stores = stores  # held: a store this server serves goes with it
        self._groups = groups
        self.moved: Callable[[], None] = lambda: None  # called after each broadcast received: progress

    @classmethod
    def join(cls, layout: Layout, timeout: float) -> "TrainerGroup":
        """Reach (or serve) the store and build this server's side of the group; returns once the trainer joined,
        ``RuntimeError`` (torch's) when it does not within ``timeout``."""
        span = datetime.timedelta(seconds=timeout)
        stores = [_store(layout, span, first=index == 0) for index in range(len(layout.ranks))]
        host = _towards(layout.host)
        groups = _each([lambda rank=rank, store=store: backend_group(_prefixed(store, layout), rank, layout.world_size,
                                                                     layout.backend, span, host)
                        for rank, store in zip(layout.ranks, stores)])
        return cls(layout, stores, groups)

    def receive(self, metas: list[TensorMeta], packed: bool, buffer_bytes: int = PACKED_BUFFER_BYTES
                ) -> list[tuple[str, torch.Tensor]]:
        """The announced tensors, in host memory, as the trainer broadcasts them (packed or one by one)."""
        return _each([lambda group=group: _receive(lambda numel, dtype: self._read(group, numel, dtype), metas, packed,
                                                   buffer_bytes)
                      for group in self._groups])[0]

    def receive_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One broadcast of ``numel`` elements of ``dtype``, in host memory (a protocol that frames its own stream,
        prime-rl's)."""
        return _each([lambda group=group: self._read(group, numel, dtype) for group in self._groups])[0]

    def _read(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = _broadcast(group, self.layout, numel, dtype)
        self.moved()
        return tensor

    def barrier(self) -> None:
        """Every rank of the group (TRL's client waits on one after each tensor)."""
        _each([lambda group=group: group.barrier().wait() for group in self._groups])

    def close(self) -> None:
        """Release the connections (NCCL communicators need an explicit shutdown)."""
        if self.layout.backend == "nccl":
            for group in self._groups:
                group.shutdown()
        self._groups = []


def _store(layout: Layout, span: datetime.timedelta, first: bool) -> dist.TCPStore:
    """A connection to the group's store for one rank (a rank's collectives wait on their own connection, so two
    ranks of this process never share one). The first serves it where the layout says this side does; a store's
    clients count themselves in (torch's rendezvous waits for world_size of them), one this server serves waits for
    nobody (TRL's client does not count itself)."""
    if first:
        return dist.TCPStore(layout.host, layout.port, layout.world_size, is_master=layout.hosts_store, timeout=span,
                             wait_for_workers=not layout.hosts_store)
    host = "127.0.0.1" if layout.hosts_store and layout.host == "0.0.0.0" else layout.host
    return dist.TCPStore(host, layout.port, layout.world_size, is_master=False, timeout=span)


def _prefixed(store: dist.Store, layout: Layout) -> dist.Store:
    for prefix in layout.prefixes:
        store = dist.PrefixStore(prefix, store)
    return store


def _towards(host: str) -> str:
    """The address the trainer reaches this process at (gloo's connections listen there): on the route to the
    store's host, or this machine's name where this server serves the store on every interface."""
    return socket.gethostbyname(socket.gethostname()) if host == "0.0.0.0" else local_address_towards(host)


def _receive(read: Callable[[int, torch.dtype], torch.Tensor], metas: list[TensorMeta], packed: bool,
             buffer_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """The announced tensors, each broadcast read by ``read(numel, dtype)``."""
    received: list[tuple[str, torch.Tensor]] = []
    if not packed:  # each tensor as the trainer holds it
        return [(meta.name, read(math.prod(meta.shape), torch_dtype(meta.dtype)).view(meta.shape)) for meta in metas]
    for chunk in packed_chunks(metas, buffer_bytes):  # bytes, as vLLM's sender packs them
        host = read(sum(meta.nbytes for meta in chunk), torch.uint8)
        offset = 0
        for meta in chunk:  # a copy each: packed bytes start anywhere, and a view needs its dtype's alignment
            piece = host[offset:offset + meta.nbytes].clone()
            received.append((meta.name, piece.view(torch_dtype(meta.dtype)).view(meta.shape)))
            offset += meta.nbytes
    return received


def _broadcast(group: dist.ProcessGroup, layout: Layout, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The sender's next broadcast, of ``numel`` elements of ``dtype``: the type it sent (NCCL pairs a broadcast's
    count and type on every rank; gloo's bytes would pass for any)."""
    device = torch.device("cuda", torch.cuda.current_device()) if layout.backend == "nccl" else torch.device("cpu")
    buffer = torch.empty(numel, dtype=dtype, device=device)
    options = dist.BroadcastOptions()
    options.rootRank = layout.src
    group.broadcast([buffer], options).wait()
    return buffer.cpu()


def _each(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call on a thread of its own when there are several (each rank's collective blocks until every rank
    called it); their results, or the first failure."""
    if len(calls) == 1:
        return [calls[0]()]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]

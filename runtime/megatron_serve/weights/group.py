"""The transfer group: the sender and every engine rank in one ``torch.distributed`` process group.

It is built beside, not inside, the default process group that tensor-parallel ranks already
belong to: a TCP store served by the sender (rank 0) and a process-group object made from it
directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), as vLLM's stateless groups and SGLang's
weight-update groups do, so joining it touches nothing else in any process.

Joining is two-phase, so that the sender can give up cleanly: each engine rank writes the world
size and ``joined/<rank>`` into the store, and the sender polls for those keys (watching for a
refused verb in between) before it builds its side of the group; once everybody is in the store,
building the group is quick. The store and the group answer within ``timeout``: a rank that never
comes, or a peer that dies mid-transfer, fails the collective (gloo notices a dead peer's closed
connection within milliseconds) instead of hanging.

Who may join: the engines learn the store's address and the transfer's random ``prefix`` only from
the REFIT, which reaches them over the coordinator's encrypted plane from a client that proved the
fleet secret. Every key of the transfer (world size, each rank's arrival, the addresses its ranks
publish to find each other) lives under that prefix, so a process that reaches the store without it
can neither be counted as a rank nor read or replace those addresses. The store listens on the one
address engines reach the sender at (loopback for a fleet on this machine), not on every interface
as a plain ``TCPStore`` does. The collective's own connections (gloo, NCCL) carry no credentials:
they belong on a network only the fleet reaches (``docs/security.md``).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

_WORLD_SIZE = "world_size"
_POLL_S = 0.01
T = TypeVar("T")


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what peers there can reach us at)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def serve_store(host: str, timeout: float) -> dist.TCPStore:
    """The sender's store, on a free port (``store.port``) of ``host`` only."""
    listener = socket.create_server((host, 0), backlog=128)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns it now
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                             timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        os.close(fd)
        raise


def transfer_store(store: dist.Store, prefix: str) -> dist.PrefixStore:
    """The view of ``store`` that holds one transfer's keys (both sides use it for everything)."""
    return dist.PrefixStore(prefix, store)


class Cancelled(Exception):
    """The sender stopped waiting for the engines (the verb was refused or timed out)."""


def wait_for_ranks(store: dist.Store, deadline: float, cancelled: Callable[[], bool], first: int = 1) -> int:
    """Sender side: wait until every engine rank (``first`` .. world size - 1) announced itself; returns the world size.

    ``cancelled``: polled in between; when it says so the wait ends with :class:`Cancelled`.
    """
    world_size = None
    missing: list[str] = [_WORLD_SIZE]
    while missing:
        if cancelled():
            raise Cancelled()
        if time.monotonic() > deadline:
            joined = world_size - first - len(missing) if world_size else 0
            raise TimeoutError(f"only {joined} engine rank(s) joined the transfer group in time"
                               + (f" (of {world_size - first}; missing ranks {', '.join(k.split('/')[1] for k in missing)})"
                                  if world_size else " (no engine reached the sender's store)"))
        missing = [key for key in missing if not store.check([key])]
        if world_size is None and not missing:
            world_size = int(store.get(_WORLD_SIZE))
            missing = [f"joined/{rank}" for rank in range(first, world_size)]
            continue
        time.sleep(_POLL_S)
    return int(world_size)


def wait_for_key(store: dist.Store, key: str, deadline: float, cancelled: Callable[[], bool] = lambda: False) -> bytes:
    """The value of ``key`` once some rank set it; ``TimeoutError`` past ``deadline``, :class:`Cancelled` when told."""
    while not store.check([key]):
        if cancelled():
            raise Cancelled()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rank set {key!r} in the transfer store in time")
        time.sleep(_POLL_S)
    return store.get(key)


def connect(address: str, prefix: str, timeout: float) -> dist.PrefixStore:
    """Reach the store at ``address`` as a client, under one transfer's ``prefix``."""
    host, _, port = address.rpartition(":")
    return transfer_store(dist.TCPStore(host, int(port), is_master=False,
                                        timeout=datetime.timedelta(seconds=timeout)), prefix)


def announce(address: str, prefix: str, rank: int, world_size: int, timeout: float,
             facts: dict[str, bytes] | None = None) -> dist.Store:
    """Engine side: reach the sender's store and say that ``rank`` of ``world_size`` is here (under ``prefix``),
    after publishing ``facts`` (key: value; e.g. the regions this rank serves) for the senders to read."""
    store = connect(address, prefix, timeout)
    store.set(_WORLD_SIZE, str(world_size))
    for key, value in (facts or {}).items():
        store.set(key, value)
    store.set(f"joined/{rank}", "1")
    return store
def process_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: float,
                  host: str) -> dist.ProcessGroup:
    """Build this process's side of the group (every rank calls it; it returns once all have)."""
    return backend_group(dist.PrefixStore("transfer", store), rank, world_size, backend,
                         datetime.timedelta(seconds=timeout), host)


def backend_group(store: dist.Store, rank: int, world_size: int, backend: str, span: datetime.timedelta,
                  host: str) -> dist.ProcessGroup:
    """A ``nccl`` or ``gloo`` group over ``store`` whose collectives give up after ``span``, built without
    ``init_process_group`` (a refit's, a trainer's and the weight routes' groups live beside the engine's own);
    gloo listens at ``host``, the address the peers reach this process at. The group holds the store as long as
    it lives."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = span
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> dist.Work:
    """Start sending rank 0's ``buffer`` into everybody's; ``wait()`` on the answer before touching it.

    Asynchronous so that both sides overlap a bucket on the wire with their copy of the next (the
    sender packing it) or of the previous one (a receiver loading it into its weights).
    """
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def commit(group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of the transfer says it holds all it must (the commit point of a sharded refit): returns on
    every rank once all called it; raises on every rank when any rank died or gave up instead (after the
    group's timeout at the latest), so that nobody applies a transfer another rank did not finish."""
    flag = torch.ones(1, device=device)
    group.allreduce([flag]).wait()


def drop_frames(exc: BaseException) -> BaseException:
    """``exc`` (and what it was raised from) without the frames it went through: a transfer that broke raises
    through frames that hold its group and the work posted on it, and a gloo group closes its connections only
    once the last reference to it goes. Kept, the peers waiting on this rank would wait out the whole timeout (the
    trainer ranks and every other engine rank, at the commit); dropped, they hear at once."""
    seen, link = set(), exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


def commit_after(group: dist.ProcessGroup, device: torch.device, moves: Callable[[dist.ProcessGroup], T]) -> T:
    """``moves(group)``, then :func:`commit`; what ``moves`` returned. The group is closed whatever happens, and a
    failure leaves without its frames (:func:`drop_frames`): the caller hands the group straight in, so that this
    frame holds the last reference to it and the peers hear of the failure at once."""
    try:
        moved = moves(group)
        commit(group, device)
        return moved
    except BaseException as exc:
        drop_frames(exc)
        raise
    finally:
        close(group)
        del group


def close(group: dist.ProcessGroup | None) -> None:
    """Release the group's connections (NCCL communicators need an explicit shutdown)."""
    if group is not None and isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
        group.shutdown()

"""The trainer's side of a weight-transfer group: what vLLM's ``NCCLWeightTransferEngine.trainer_init`` and
``trainer_send_weights`` do, for the server's weight routes, over ``gloo`` (a CPU trainer, the tests) or ``nccl`` (a
trainer on a GPU of its own, the server on another: ``benchmarks/gpu_session.sh rl``).

A CPU trainer (and the tests) drives a server's vLLM or SGLang weight routes with these: :func:`trainer_init` serves
the group's store at ``master_address:master_port`` as rank 0 and returns once every receiving rank joined (the
server joins when it is told to by ``/init_weight_transfer_engine`` or ``/init_weights_update_group``, called at the
same time); :func:`trainer_send_weights` broadcasts tensors in the order the update names them, one by one or packed
as vLLM packs them. ``prefixes``: the key prefixes the framework's layout puts in front of the store
(:mod:`megatron_serve.weights.framework_groups`: SGLang's ``sglang_prefixes``, TRL's ``TRL_PREFIX``), none for
vLLM's.
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch
import torch.distributed as dist

from ..weights.framework_groups import PACKED_BUFFER_BYTES
from ..weights.group import backend_group, local_address_towards


def trainer_init(master_address: str, master_port: int, world_size: int, *, rank: int = 0,
                 prefixes: tuple[str, ...] = (), serves_store: bool = True, timeout: float = 300.0,
                 backend: str = "gloo") -> dist.ProcessGroup:
    """Build the trainer's side of the group as ``rank`` of ``world_size``, serving the store (vLLM's and SGLang's
    trainer, rank 0) or reaching the server's (TRL's client, the last rank: ``serves_store=False``); returns once
    every rank joined. ``backend``: the server's ``--weight-transfer-config`` backend (``nccl``: this process's
    current CUDA device is its rank's)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    span = datetime.timedelta(seconds=timeout)
    store: dist.Store = dist.TCPStore(master_address, master_port, world_size, is_master=serves_store, timeout=span,
                                      wait_for_workers=not serves_store)
    for prefix in prefixes:
        store = dist.PrefixStore(prefix, store)
    return backend_group(store, rank, world_size, backend, span, local_address_towards(master_address))


def trainer_send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup, *,
                         packed: bool = False, buffer_bytes: int = PACKED_BUFFER_BYTES, src: int = 0) -> None:
    """Broadcast the tensors from rank ``src``: each alone, or packed (bytes back to back, a buffer sent once it
    holds more than ``buffer_bytes``)."""
    pending: list[torch.Tensor] = []
    size = 0
    for _, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if not packed:
            _broadcast(group, flat.clone(), src)
            continue
        pending.append(flat)
        size += flat.numel()
        if size > buffer_bytes:
            _broadcast(group, torch.cat(pending), src)
            pending, size = [], 0
    if pending:
        _broadcast(group, torch.cat(pending), src)


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor, src: int) -> None:
    if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):  # NCCL moves device memory only
        buffer = buffer.to(torch.device("cuda", torch.cuda.current_device()))
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([buffer], options).wait()

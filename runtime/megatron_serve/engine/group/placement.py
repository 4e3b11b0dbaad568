"""Where a group's ranks sit and how they meet: the placement, one GPU per local rank, the rendezvous and the process
groups it forms (:func:`join_group`), and their release.

A group of ``WORLD_SIZE`` ranks may span pods. Each pod starts its local ranks ``RANK .. RANK + NPROC_PER_NODE - 1``
(the operator sets these, with ``MASTER_ADDR`` naming pod 0 through the headless Service); without those variables
every rank runs on this machine. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ...config import InferenceConfig
from ...model.parallel import DataParallel, PipelineStage, TensorParallel
from .channel import PlanChannel

RENDEZVOUS_TIMEOUT_S = float(os.environ.get("MEGATRON_SERVE_RENDEZVOUS_TIMEOUT", "300"))


@dataclass(frozen=True)
class Placement:
    """Where this process's ranks sit in their group."""

    world_size: int
    first_local_rank: int  # global rank of this machine's first process
    local_count: int  # ranks started on this machine
    master_addr: str
    master_port: int

    @property
    def hosts_rank_zero(self) -> bool:
        return self.first_local_rank == 0


def placement_for(world_size: int) -> Placement:
    """From the operator's rendezvous environment when it is set, else every rank on this machine."""
    env = os.environ
    if "MASTER_ADDR" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != world_size:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} does not match the group's {world_size} ranks "
                             "(--tensor-parallel x --pipeline-parallel-size)")
        local = int(env.get("NPROC_PER_NODE", world_size))
        return Placement(world_size, int(env.get("RANK", "0")), local, env["MASTER_ADDR"],
                         int(env.get("MASTER_PORT", "29500")))
    return Placement(world_size, 0, world_size, "127.0.0.1", 0)  # port 0: rank 0 takes one from the kernel


def data_parallel_placement(config: InferenceConfig) -> Placement:
    """A data-parallel attention rank's engine starts its own tensor-parallel ranks (``RANK`` is its first:
    ``data_parallel_rank x tensor_parallel_size``) and meets the other data-parallel ranks' engines at
    ``MASTER_ADDR:MASTER_PORT``, as the operator's gang sets them."""
    env, size = os.environ, config.tensor_parallel_size
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size}: each data-parallel rank is an engine of "
                         f"its own, and they meet at MASTER_ADDR:MASTER_PORT ({', '.join(missing)} not set)")
    if int(env.get("WORLD_SIZE", config.world_size)) != config.world_size:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} does not match the group's {config.world_size} ranks "
                         "(--data-parallel-size x --tensor-parallel)")
    if int(env.get("NPROC_PER_NODE", size)) != size:
        raise ValueError(f"NPROC_PER_NODE={env['NPROC_PER_NODE']}, but an engine of data-parallel attention starts "
                         f"its own {size} tensor-parallel ranks: run one engine per data-parallel rank (a pod of "
                         f"{size} GPUs each)")
    return Placement(config.world_size, config.data_parallel_rank * size, size, env["MASTER_ADDR"],
                     int(env["MASTER_PORT"]))


def rank_device(local_index: int, config: InferenceConfig) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", local_index)
    return device


def check_local_devices(placement: Placement, device_type: str) -> None:
    """One GPU per local rank, refused before any rank starts.

    NCCL rejects two ranks on one GPU only at the first collective ("Duplicate GPU detected"),
    after every rank loaded its weights; seen on a one-GPU H100 with ``tensor_parallel_size=2``.
    """
    visible = torch.cuda.device_count()
    if device_type == "cuda" and placement.local_count > visible:
        raise ValueError(
            f"tensor_parallel_size {placement.world_size} puts {placement.local_count} ranks on this machine, but "
            f"{visible} CUDA device(s) are visible: each rank needs a GPU of its own (lower --tensor-parallel, "
            f"make more GPUs visible, or serve on --device cpu)")



def reserve_rendezvous(placement: Placement) -> tuple[socket.socket, Placement]:
    """Rank 0's rendezvous port, bound and listening now on a port the kernel picks, and the placement that names it:
    a port picked free and bound later could be taken in between (a test's rank 0 met EADDRINUSE so). A socket, not
    yet the store: the store's server thread would be running when the ranks are forked (:func:`host_store`)."""
    listener = socket.create_server((placement.master_addr, 0), backlog=max(128, placement.world_size))
    return listener, replace(placement, master_port=listener.getsockname()[1])


def host_store(listener: socket.socket, placement: Placement) -> dist.TCPStore:
    """Rank 0's rendezvous store, serving on the socket :func:`reserve_rendezvous` bound (the store owns it now)."""
    return dist.TCPStore(placement.master_addr, placement.master_port, placement.world_size, is_master=True,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                         master_listen_fd=listener.detach())


def join_group(placement: Placement, rank: int, device: torch.device, config: InferenceConfig,
               store: dist.Store | None = None) -> tuple[TensorParallel, PlanChannel]:
    """Rendezvous with the other ranks (through ``store`` when rank 0 hosts one already); waits for late peers up to
    the timeout, then says what is missing. A port that cannot be bound fails at once, saying so.

    The group is ``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks (stage ``s``'s rank ``r`` is
    rank ``s * tp + r``): each stage's ranks get a group of their own for the layers' collectives, the whole
    group carries the steps and the hidden states between stages.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    began, timeout = time.monotonic(), datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    try:
        if store is None:  # rank 0 binds the port (at once or not at all), the others connect until the time-out;
            # torchrun's convention: an agent that hosts the store already says so, and rank 0 connects to it too
            store = client_store(placement, master=rank == 0 and not store_hosted_elsewhere())
        dist.init_process_group(backend, store=store, rank=rank, world_size=placement.world_size, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to fix
        waited = time.monotonic() - began
        late = f" (are all {placement.world_size} ranks started?)" if waited >= RENDEZVOUS_TIMEOUT_S else ""
        raise RuntimeError(f"tensor-parallel rank {rank}/{placement.world_size} could not join the group at "
                           f"{placement.master_addr}:{placement.master_port} after {waited:.0f}s{late}: {exc}"
                           ) from exc
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.data_parallel_size > 1:
        tp, channel = join_data_parallel(rank, size, config.data_parallel_size, backend, config.gathers_rows)
        channel.rendezvous = store  # where the ranks left after a loss meet again (.regroup)
        return tp, channel
    plans = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    tp_group = dist.group.WORLD
    if stages > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(stages)]
        tp_group = groups[rank // size]
    stage = PipelineStage(rank // size, stages, rank, size, dist.group.WORLD, config.micro_batches)
    return (TensorParallel(rank=rank % size, size=size, group=tp_group, expert_parallel=config.enable_expert_parallel,
                           stage=stage, gathered_rows=config.gathers_rows), PlanChannel(plans))


def store_hosted_elsewhere() -> bool:
    """Whether the group's store is hosted by a process other than rank 0's (torchrun's agent, or ``megatron-serve
    rendezvous-store``), as torchrun says so (``TORCHELASTIC_USE_AGENT_STORE``): rank 0 connects to it too, and an
    elastic group's rank 0 is then a rank like any other, whose restart joins the running group."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def client_store(placement: Placement, master: bool = False) -> dist.TCPStore:
    """The group's rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (hosted here with ``master``), connected to
    within the rendezvous timeout."""
    return dist.TCPStore(placement.master_addr, placement.master_port, placement.world_size, is_master=master,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


def joiner_groups(config: InferenceConfig, store: dist.Store) -> tuple[TensorParallel, PlanChannel]:
    """A data-parallel rank that joins a running group, before it is taken in: its place in the group as started, to
    load its experts by (placement by index; the join places them over the membership it enters, which at full
    size is the same), and no process group yet (its engine's start runs no collective; the groups come with the
    join)."""
    tp = TensorParallel(expert_parallel=True, gathered_rows=config.gathers_rows,
                        data_parallel=DataParallel(config.data_parallel_rank, config.data_parallel_size, None))
    channel = PlanChannel(None)
    channel.rendezvous = store
    return tp, channel


def join_data_parallel(rank: int, size: int, dp: int, backend: str, gathered_rows: bool = False
                       ) -> tuple[TensorParallel, PlanChannel]:
    """The groups of data-parallel attention: data-parallel rank ``d``'s attention ranks ``d * size ..`` (its
    layers' group, and a gloo one for its leader's plans), the leaders' (gloo: they agree on each step), and the
    whole group for the MoE layers' all-to-alls. Every rank creates every group, in the same order."""
    ranks = [list(range(d * size, (d + 1) * size)) for d in range(dp)]
    attention = [dist.new_group(r) for r in ranks]
    plans = attention if backend == "gloo" else [dist.new_group(r, backend="gloo") for r in ranks]
    leaders = dist.new_group([d * size for d in range(dp)], backend="gloo")
    index = rank // size
    tp = TensorParallel(rank=rank % size, size=size, group=attention[index], expert_parallel=True,
                        data_parallel=DataParallel(index, dp, dist.group.WORLD), gathered_rows=gathered_rows)
    return tp, PlanChannel(plans[index], index * size, attention[index], leaders if rank % size == 0 else None)



def release_groups(tp: TensorParallel, channel: PlanChannel) -> None:
    """Drop this process's last references to its destroyed groups, so that their C++ objects are freed now.

    ``dist.destroy_process_group`` forgets every group but frees none that Python still holds, and a gloo group
    keeps its worker threads and its peers' sockets until it is freed. The model's ``TensorParallel`` (one object,
    shared by every layer) and the plan channel held them, and the engine sits in reference cycles, so they went at
    some later collection or in the interpreter's teardown, after the other ranks' processes had gone: a gloo group
    freed there can end the process with "terminate called without an active exception" (PyTorch issue 65231).
    The engine is unusable after its shutdown, so its layers may lose their groups."""
    for holder in (tp, tp.stage, tp.data_parallel):
        if holder.group is not None:  # frozen, and shared by every layer: one assignment reaches them all
            object.__setattr__(holder, "group", None)
    channel.group = channel.device_group = channel.leaders = None



"""Tensor-parallel engine groups: one process per GPU, ranks in lockstep.

Rank 0 of a group owns the scheduler and talks to the coordinator. Each step it writes the batch
into its step buffers and broadcasts their used part as one packed integer array (``PlanChannel``:
a three-integer header, then the plan, over a gloo group; no pickled object per step); every rank
runs the forward pass on its weight slice and its share of the KV heads; rank 0 samples from the
gathered logits. With overlapped scheduling a step's gathered rows take the previous step's
sampled tokens, which rank 0 broadcasts on the device group first. Suspend, resume, refit and stop
go through the same channel, so a verb always acts on the whole group (a suspend that keeps the KV parks the same
blocks on every rank, each its own part of them, and rank 0's resume says whether to copy them back). With pipeline
stages (``--pipeline-parallel-size``) the group is ``stages x tensor_parallel_size`` ranks; the steps, the previous
tokens and the refit outcomes go over the whole group, each stage's layers use its own tensor-parallel group
(:func:`join_group`). With data-parallel attention (``--data-parallel-size``, :mod:`.data_parallel`) the group is
``dp`` such groups, each led by an engine of its own (rank ``d * tp``), which broadcasts to its own ranks only; the
MoE layers' collectives span them all.

Placement: a group of ``WORLD_SIZE`` ranks may span pods. Each pod starts its local ranks
``RANK .. RANK + NPROC_PER_NODE - 1`` (the operator sets these, with ``MASTER_ADDR`` naming pod 0
through the headless Service); without those variables every rank runs on this machine. NCCL on
GPUs, gloo on CPU. If any rank dies, the next collective fails on the others, and they exit:
the coordinator then sees the group gone and re-queues its requests.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..config import InferenceConfig
from .graphs import StepGraphs, graphs_for, largest_graph
from ..errors import EngineGroupLost
from ..model.loader import load_model, load_weights
from ..model.lora import LoraAdapter
from ..model.lora_slots import LoraSlots
from ..model.parallel import DataParallel, PipelineStage, TensorParallel
from .data_parallel import agree_tokens, agree_turn
from .turns import Turn
from .expert_backend import install_expert_backend
from .kv.cache import KVCachePool
from .kv.park import ParkedKV, ParkOrder
from .sizing import build_kv_pool, default_dtype, engine_buffers, max_sequence_length_for
from .runner import ModelRunner, StepResult
from .step_plan import StepBuffers, StepPlan
from ..weights.drafter import policy_only
from ..weights.peer_pull import follow_share
from ..weights.sources import WeightSource

logger = logging.getLogger(__name__)
T = TypeVar("T")

RENDEZVOUS_TIMEOUT_S = float(os.environ.get("MEGATRON_SERVE_RENDEZVOUS_TIMEOUT", "300"))
#: The exit code of a rank's process that found itself re-running its parent's script (see reimported_main).
REIMPORTED_MAIN_EXIT = 3
GUARD_HINT = ("a script that builds a tensor-parallel engine (LLM(..., tensor_parallel_size=N) and the like) must "
              "do so under `if __name__ == \"__main__\":`: each other rank's process is started with "
              "multiprocessing's spawn, which imports the script again, so that code at its top level runs again "
              "there")


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


class PlanChannel:
    """Rank 0's messages to the other ranks, over a gloo group (host integers; NCCL carries device tensors).

    Each message is a header ``[kind, length, tokens]``; a step follows as ``length`` packed integers
    (:meth:`StepBuffers.pack`), the other kinds as one small pickled payload (a suspend level, a
    weight source): those are rare, steps are not. ``tokens``: with data-parallel attention, the largest step
    of the data-parallel ranks, which a step and an idle rank's empty MoE pass are padded for (-1: none).
    """

    KINDS = ("step", "suspend", "resume", "refit", "stop", "lora", "idle", "peer")

    def __init__(self, group: dist.ProcessGroup, leader: int = 0, device_group: object | None = None,
                 leaders: object | None = None):
        """``leader``: the global rank that sends (rank 0, or a data-parallel rank's first); ``device_group``: where
        device tensors of a step go (None: the whole group); ``leaders``: the data-parallel ranks' leaders, which
        step together (None without data-parallel attention)."""
        self.group = group
        self.leader = leader
        self.device_group = device_group
        self.leaders = leaders

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

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """A step's device tensor (previous tokens, image embeddings) from the leader to its ranks."""
        dist.broadcast(tensor, src=self.leader, group=self.device_group)
        return tensor


def host_store(placement: Placement) -> tuple[dist.TCPStore, Placement]:
    """Rank 0's rendezvous store on a port the kernel picks, and the placement that names it: a port picked free and
    bound later could be taken in between (a test's rank 0 met EADDRINUSE so)."""
    store = dist.TCPStore(placement.master_addr, 0, placement.world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    return store, replace(placement, master_port=store.port)


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
            hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(placement.master_addr, placement.master_port, placement.world_size,
                                  is_master=rank == 0 and not hosted, wait_for_workers=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=placement.world_size, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to fix
        waited = time.monotonic() - began
        late = f" (are all {placement.world_size} ranks started?)" if waited >= RENDEZVOUS_TIMEOUT_S else ""
        raise RuntimeError(f"tensor-parallel rank {rank}/{placement.world_size} could not join the group at "
                           f"{placement.master_addr}:{placement.master_port} after {waited:.0f}s{late}: {exc}"
                           ) from exc
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.data_parallel_size > 1:
        return join_data_parallel(rank, size, config.data_parallel_size, backend, config.gathers_rows)
    plans = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    tp_group = dist.group.WORLD
    if stages > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(stages)]
        tp_group = groups[rank // size]
    stage = PipelineStage(rank // size, stages, rank, size, dist.group.WORLD, config.micro_batches)
    return (TensorParallel(rank=rank % size, size=size, group=tp_group, expert_parallel=config.enable_expert_parallel,
                           stage=stage, gathered_rows=config.gathers_rows), PlanChannel(plans))


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


def broadcast_previous_tokens(channel: PlanChannel, plan: StepPlan, tokens: torch.Tensor | None, count: int,
                              device: torch.device) -> torch.Tensor | None:
    """The previous step's sampled tokens on every rank, when the plan gathers some (the leader passes them)."""
    if not plan.num_gather:
        return None
    if tokens is None:
        tokens = torch.empty(count, dtype=torch.int64, device=device)
    return channel.broadcast(tokens)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts every step and lifecycle change before acting on it itself."""

    def __init__(self, model, block_size: int, device: torch.device, buffers: StepBuffers,
                 channel: PlanChannel, workers: list[multiprocessing.Process],
                 graphs: StepGraphs | None = None):
        super().__init__(model, block_size, device, buffers, graphs)
        self.channel = channel
        self.workers = workers
        self._ran_forward = False  # since the last end_step: a data-parallel rank that did not runs an empty pass

    def _broadcast(self, kind: str, payload: object = None, packed: np.ndarray | None = None,
                   tokens: int | None = None) -> None:
        self._check_workers()
        try:
            self.channel.send(kind, packed, payload, tokens)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke during {kind!r}: {exc}") from exc

    def _check_workers(self) -> None:
        """Fail fast when a local rank died, instead of waiting on a collective that cannot finish."""
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise EngineGroupLost(f"tensor-parallel group lost {', '.join(dead)}; this engine group must restart")

    def run_plan(self, plan: StepPlan, kv_caches, image_embeddings=None, previous_tokens=None,
                 previous_shifts=None) -> StepResult:
        # verify steps are not overlapped under tensor parallelism (the followers would need the shifts too)
        assert previous_shifts is None, "a plan corrected by a verify step in flight under tensor parallelism"
        tokens = self._agree_tokens(plan.num_tokens)
        self._broadcast("step", packed=self.buffers.pack(plan), tokens=tokens)
        try:
            broadcast_previous_tokens(self.channel, plan, previous_tokens, 0, self.device)
            if plan.num_images:  # the tower runs on rank 0 only: its output goes with the step
                self.channel.broadcast(image_embeddings.contiguous())
            self._ran_forward = True
            return super().run_plan(plan, kv_caches, image_embeddings, previous_tokens, group_tokens=tokens)
        except Exception as exc:  # noqa: BLE001 - the forward's all-reduces fail when a peer died mid-step
            self._check_workers()
            raise EngineGroupLost(f"tensor-parallel forward failed: {exc}") from exc

    def on_suspend(self, level: int, keep: ParkOrder | None = None) -> None:
        self._broadcast("suspend", (level, keep))
        super().on_suspend(level)

    def on_resume(self, restore: bool = False) -> None:
        self._broadcast("resume", restore)

    def group_turn(self, busy: bool, holding: bool = False) -> Turn:
        if self.channel.leaders is None:
            return Turn(busy, holding)
        return self._among_leaders(lambda leaders, flags: agree_turn(leaders, *flags), (busy, holding))

    def _agree_tokens(self, tokens: int) -> int | None:
        """With data-parallel attention, the largest step of the data-parallel ranks (None without)."""
        return None if self.channel.leaders is None else self._among_leaders(agree_tokens, tokens)

    def _among_leaders(self, collective: Callable[[object, T], T], value: T) -> T:
        """``collective`` over the data-parallel attention ranks' leaders."""
        try:
            return collective(self.channel.leaders, value)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"data-parallel attention ranks lost one of them: {exc}") from exc

    def end_step(self) -> None:
        ran, self._ran_forward = self._ran_forward, False
        if self.channel.leaders is None or ran:
            return
        tokens = self._agree_tokens(0)
        self._broadcast("idle", tokens=tokens)
        try:
            self.empty_moe_pass(tokens)
        except Exception as exc:  # noqa: BLE001 - the all-to-alls fail when a peer died mid-step
            self._check_workers()
            raise EngineGroupLost(f"data-parallel attention: an empty MoE pass failed: {exc}") from exc

    def on_refit(self, source: WeightSource) -> None:
        self._broadcast("refit", source)

    def broadcast_lora_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Every other rank writes its share of ``adapter`` into ``slot`` (:mod:`..model.lora_shards`) before the
        next step, as rank 0 does: adapters live in rank 0's host memory only, so pushes need no other path."""
        self._broadcast("lora", (slot, adapter))

    def refit_outcomes(self) -> list[tuple[list[str], str | None]]:
        return self._outcomes("a refit")

    def on_share(self, payload: tuple[str, str, int, float]) -> None:
        self._broadcast("peer", payload)

    def share_outcomes(self) -> list[str | None]:
        return self._outcomes("a peer pull")

    def _outcomes(self, what: str) -> list:
        """What each other rank reported of ``what``, in rank order (they send it once they are done)."""
        outcomes: list = [None] * dist.get_world_size(self.channel.group)
        try:
            dist.gather_object(None, outcomes, dst=self.channel.leader, group=self.channel.group)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke during {what}: {exc}") from exc
        return outcomes[1:]

    def shutdown(self) -> None:
        if not dist.is_initialized():
            return
        try:
            self._broadcast("stop")
        except EngineGroupLost:
            pass  # followers already gone: nothing left to stop
        finally:
            dist.destroy_process_group()
            release_groups(self.model.tp, self.channel)
            for worker in self.workers:
                worker.join(timeout=30)


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


def abandon_group(workers: list[multiprocessing.Process]) -> None:
    """Rank 0 failed after the group formed: leave it and stop this machine's other ranks.

    Without this a failed start left the process's default group behind, and every later engine
    in the process failed with "trying to initialize the default process group twice".
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    for worker in workers:
        worker.terminate()
        worker.join(timeout=30)


def reimported_main() -> bool:
    """Whether this process is a spawned one still importing its parent's ``__main__`` (multiprocessing's
    ``_inheriting``, what its own "bootstrapping phase" error checks): a script without a main guard."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))  # set by spawn's _main only


def refuse_reimported_main() -> None:
    """Exit at once, saying why, when a rank's process re-runs its parent's script: without this the script's
    engine started ranks of its own there, multiprocessing refused, and rank 0 waited for the missing rank until
    the rendezvous timed out (300 s), then said "could not join the group"."""
    if reimported_main():
        print(f"megatron-serve: tensor-parallel rank process {os.getpid()} is running its parent's script again: "
              f"{GUARD_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(REIMPORTED_MAIN_EXIT)


def spawn_local_workers(model_dir: str, config: InferenceConfig, placement: Placement) -> list[multiprocessing.Process]:
    """Start this machine's ranks other than rank 0 as child processes; returns once each has started (reached
    :func:`run_worker`), and raises at once when one exits before it did."""
    context = multiprocessing.get_context("spawn")
    workers, started = [], []
    for index in range(placement.local_count):
        rank = placement.first_local_rank + index
        if index == 0 and (rank == 0 or config.data_parallel_size > 1):  # this process: a leader
            continue
        event = context.Event()
        process = context.Process(target=run_worker, args=(model_dir, config.to_dict(), placement, rank, index, event),
                                  name=f"megatron-tp-rank-{rank}", daemon=True)
        process.start()
        workers.append(process)
        started.append(event)
    try:
        wait_started(workers, started)
    except BaseException:
        for worker in workers:
            worker.terminate()
            worker.join(timeout=30)
        raise
    return workers


def wait_started(workers: list[multiprocessing.Process], started: list[multiprocessing.synchronize.Event]) -> None:
    """Wait until every worker set its ``started`` event, up to the rendezvous timeout; a worker that exits first
    fails the start at once, with why when it says (:data:`REIMPORTED_MAIN_EXIT`)."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while not all(event.is_set() for event in started):
        for worker, event in zip(workers, started):
            if not event.is_set() and worker.exitcode is not None:
                why = GUARD_HINT if worker.exitcode == REIMPORTED_MAIN_EXIT else "its output above says why"
                raise RuntimeError(f"{worker.name}'s process exited (code {worker.exitcode}) before it started: {why}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks not started within {RENDEZVOUS_TIMEOUT_S:.0f}s")
        multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.05)


def run_worker(model_dir: str, config_dict: dict, placement: Placement, rank: int, local_index: int,
               started: multiprocessing.synchronize.Event) -> None:
    """A rank other than 0: load its slice, mirror rank 0's KV pool, and follow its broadcasts until stop."""
    from ..fleet.lifeline import parent_death_signal  # noqa: PLC0415
    from ..model.config import ModelConfig  # noqa: PLC0415

    parent_death_signal()  # dies with rank 0's process (spawned from its main thread), whatever kills it
    started.set()

    config = InferenceConfig(**config_dict)
    device = rank_device(local_index, config)
    tp, channel = join_group(placement, rank, device, config)
    model_config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, default_dtype(config, model_config), device, tp, quantization=config.quantization)
    install_expert_backend(model, config)
    if config.batch_invariant:
        model.use_batch_invariant_ops()
    max_sequence_length = max_sequence_length_for(model_config, config)
    pool = build_kv_pool(model, config, max_sequence_length, device, largest_graph(config, device))
    buffers = engine_buffers(config, max_sequence_length, device)
    # Same graphs, captured in the same order as rank 0's: their collectives must pair up.
    runner = ModelRunner(model, config.block_size_tokens, device, buffers, graphs_for(model, config, buffers))
    runner.compile_kernels(pool.layer_caches)
    runner.capture_graphs(pool.layer_caches)
    slots = None
    if config.enable_lora:  # after capture, as on rank 0: graphs hold the base model only
        slots = LoraSlots(model, config.max_loras, config.max_lora_rank, config.batch_invariant)
        runner.lora_rows = slots.rows
    sampled = 0  # rows the last step sampled: the length of the tokens a gathering step receives
    memory = FollowerMemory(model, pool, runner, device)
    while True:
        kind, payload, tokens = channel.receive()
        if kind == "step":
            plan = buffers.unpack(payload)
            previous = broadcast_previous_tokens(channel, plan, None, sampled, device)
            embeddings = None
            if plan.num_images:
                embeddings = channel.broadcast(torch.empty(plan.num_images, model.config.hidden_size, device=device,
                                                           dtype=model.dtype))
            runner.run_plan(plan, pool.layer_caches, embeddings, previous, group_tokens=tokens)
            sampled = plan.num_sample
        elif kind == "suspend":
            memory.suspend(*payload)
        elif kind == "resume":
            memory.resume(payload)
        elif kind == "idle":
            runner.empty_moe_pass(tokens)
        elif kind == "refit":
            dist.gather_object(_follow_refit(model, payload), None, dst=channel.leader, group=channel.group)
        elif kind == "lora":
            slots.write(*payload)
        elif kind == "peer":  # a joiner pulls our weights: this rank sends its own to the joiner's same rank
            dist.gather_object(follow_share(model, payload), None, dst=channel.leader, group=channel.group)
        elif kind == "stop":
            break
    dist.destroy_process_group()
    release_groups(tp, channel)  # a spawned process ends through the interpreter's teardown too


@dataclass
class FollowerMemory:
    """A follower's side of suspend and resume: its KV pool (its part of the live requests' blocks parked in host
    memory first when rank 0 keeps the KV) and, at level 2 on a GPU, its weights."""

    model: torch.nn.Module
    pool: KVCachePool
    runner: ModelRunner
    device: torch.device
    parked: ParkedKV | None = None

    def suspend(self, level: int, keep: ParkOrder | None) -> None:
        self.runner.on_suspend(level)
        if keep is not None:
            self.parked = ParkedKV.park(self.pool, keep.blocks, keep.epoch)
        self.pool.release()
        if level == 2 and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume(self, restore: bool) -> None:
        """``restore``: copy the parked blocks back (rank 0 does too); else drop them (a refit made them stale)."""
        self.model.to(self.device)
        self.pool.allocate()
        parked, self.parked = self.parked, None
        if parked is not None and restore:
            parked.restore(self.pool)
        self.runner.capture_graphs(self.pool.layer_caches)


def _follow_refit(model, source: WeightSource) -> tuple[list[str], str | None]:
    """A follower's part of a refit that rank 0 verified: load its slices; report, never raise (the
    group must stay in lockstep, and rank 0 decides what a failure means)."""
    loaded: list[str] = []
    try:
        load_weights(model, policy_only(source.tensors(model)), progress=loaded.append, partial=source.partial)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0
        logger.error("refit on this tensor-parallel rank failed: %s", exc)
        return loaded, str(exc) or type(exc).__name__
    return loaded, None


def start_rank_zero(model_dir: str, config: InferenceConfig
                    ) -> tuple[TensorParallel, PlanChannel, torch.device, list[multiprocessing.Process]]:
    """Start this machine's other ranks and join the group as rank 0 (when this machine holds it)."""
    refuse_reimported_main()
    dp = config.data_parallel_size > 1
    placement = data_parallel_placement(config) if dp else placement_for(config.world_size)
    check_local_devices(placement, torch.device(config.device).type)
    store, placement = host_store(placement) if placement.master_port == 0 else (None, placement)
    workers = spawn_local_workers(model_dir, config, placement)
    if not placement.hosts_rank_zero and not dp:
        # This machine holds only followers: serve them until they exit; rank 0 lives in another pod.
        for worker in workers:
            worker.join()
        raise SystemExit(max((w.exitcode or 0) for w in workers) if workers else 0)
    device = rank_device(0, config)
    tp, channel = join_group(placement, placement.first_local_rank, device, config, store)
    return tp, channel, device, workers

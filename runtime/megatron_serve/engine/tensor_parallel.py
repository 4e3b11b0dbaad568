"""Tensor-parallel engine groups: one process per GPU, ranks in lockstep.

Rank 0 of a group owns the scheduler and talks to the coordinator. Each step it writes the batch
into its step buffers and broadcasts their used part as one packed integer array (``PlanChannel``:
a two-integer header, then the plan, over a gloo group; no pickled object per step); every rank
runs the forward pass on its weight slice and its share of the KV heads; rank 0 samples from the
gathered logits. With overlapped scheduling a step's gathered rows take the previous step's
sampled tokens, which rank 0 broadcasts on the device group first. Suspend, resume, refit and stop
go through the same channel, so a verb always acts on the whole group.

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
import os
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..config import InferenceConfig
from .graphs import StepGraphs, graphs_for, largest_graph
from ..errors import EngineGroupLost
from ..model.loader import load_model, load_weights
from ..model.lora import LoraAdapter
from ..model.lora_slots import LoraSlots
from ..model.parallel import TensorParallel
from .sizing import build_kv_pool, default_dtype, engine_buffers, max_sequence_length_for
from .runner import ModelRunner, StepResult
from .step_plan import StepBuffers, StepPlan
from ..weights.drafter import policy_only
from ..weights.sources import WeightSource

logger = logging.getLogger(__name__)

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def placement_for(world_size: int) -> Placement:
    """From the operator's rendezvous environment when it is set, else every rank on this machine."""
    env = os.environ
    if "MASTER_ADDR" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != world_size:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} does not match --tensor-parallel {world_size}")
        local = int(env.get("NPROC_PER_NODE", world_size))
        return Placement(world_size, int(env.get("RANK", "0")), local, env["MASTER_ADDR"],
                         int(env.get("MASTER_PORT", "29500")))
    return Placement(world_size, 0, world_size, "127.0.0.1", free_port())


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

    Each message is a header ``[kind, length]``; a step follows as ``length`` packed integers
    (:meth:`StepBuffers.pack`), the other kinds as one small pickled payload (a suspend level, a
    weight source): those are rare, steps are not.
    """

    KINDS = ("step", "suspend", "resume", "refit", "stop", "lora")

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, kind: str, packed: np.ndarray | None = None, payload: object = None) -> None:
        length = 0 if packed is None else len(packed)
        dist.broadcast(torch.tensor([self.KINDS.index(kind), length], dtype=torch.int64), src=0, group=self.group)
        if packed is not None:
            dist.broadcast(torch.from_numpy(packed), src=0, group=self.group)
        elif kind != "step":
            dist.broadcast_object_list([payload], src=0, group=self.group)

    def receive(self) -> tuple[str, np.ndarray | object]:
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        code, length = header.tolist()
        kind = self.KINDS[code]
        if kind == "step":
            packed = torch.empty(length, dtype=torch.int64)
            dist.broadcast(packed, src=0, group=self.group)
            return kind, packed.numpy()
        message: list = [None]
        dist.broadcast_object_list(message, src=0, group=self.group)
        return kind, message[0]


def join_group(placement: Placement, rank: int, device: torch.device) -> tuple[TensorParallel, PlanChannel]:
    """Rendezvous with the other ranks; waits for late peers up to the timeout, then says what is missing."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{placement.master_addr}:{placement.master_port}", rank=rank,
            world_size=placement.world_size, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with what to fix
        raise RuntimeError(
            f"tensor-parallel rank {rank}/{placement.world_size} could not join the group at "
            f"{placement.master_addr}:{placement.master_port} within {RENDEZVOUS_TIMEOUT_S:.0f}s "
            f"(are all {placement.world_size} ranks started?): {exc}"
        ) from exc
    plans = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return TensorParallel(rank=rank, size=placement.world_size, group=dist.group.WORLD), PlanChannel(plans)


def broadcast_previous_tokens(plan: StepPlan, tokens: torch.Tensor | None, count: int, tp: TensorParallel,
                              device: torch.device) -> torch.Tensor | None:
    """The previous step's sampled tokens on every rank, when the plan gathers some (rank 0 passes them)."""
    if not plan.num_gather:
        return None
    if tokens is None:
        tokens = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(tokens, src=0, group=tp.group)
    return tokens


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts every step and lifecycle change before acting on it itself."""

    def __init__(self, model, block_size: int, device: torch.device, buffers: StepBuffers, tp: TensorParallel,
                 channel: PlanChannel, workers: list[multiprocessing.Process],
                 graphs: StepGraphs | None = None):
        super().__init__(model, block_size, device, buffers, graphs)
        self.tp = tp
        self.channel = channel
        self.workers = workers

    def _broadcast(self, kind: str, payload: object = None, packed: np.ndarray | None = None) -> None:
        self._check_workers()
        try:
            self.channel.send(kind, packed, payload)
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
        self._broadcast("step", packed=self.buffers.pack(plan))
        try:
            broadcast_previous_tokens(plan, previous_tokens, 0, self.tp, self.device)
            if plan.num_images:  # the tower runs on rank 0 only: its output goes with the step
                dist.broadcast(image_embeddings.contiguous(), src=0, group=self.tp.group)
            return super().run_plan(plan, kv_caches, image_embeddings, previous_tokens)
        except Exception as exc:  # noqa: BLE001 - the forward's all-reduces fail when a peer died mid-step
            self._check_workers()
            raise EngineGroupLost(f"tensor-parallel forward failed: {exc}") from exc

    def on_suspend(self, level: int) -> None:
        self._broadcast("suspend", level)
        super().on_suspend(level)

    def on_resume(self) -> None:
        self._broadcast("resume")

    def on_refit(self, source: WeightSource) -> None:
        self._broadcast("refit", source)

    def broadcast_lora_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Every other rank writes its share of ``adapter`` into ``slot`` (:mod:`..model.lora_shards`) before the
        next step, as rank 0 does: adapters live in rank 0's host memory only, so pushes need no other path."""
        self._broadcast("lora", (slot, adapter))

    def refit_outcomes(self) -> list[tuple[list[str], str | None]]:
        outcomes: list = [None] * self.tp.size
        try:
            dist.gather_object(None, outcomes, dst=0, group=self.tp.group)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke during a refit: {exc}") from exc
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
            for worker in self.workers:
                worker.join(timeout=30)


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


def spawn_local_workers(model_dir: str, config: InferenceConfig, placement: Placement) -> list[multiprocessing.Process]:
    """Start this machine's ranks other than rank 0 as child processes."""
    context = multiprocessing.get_context("spawn")
    workers = []
    for index in range(placement.local_count):
        rank = placement.first_local_rank + index
        if rank == 0:
            continue
        process = context.Process(target=run_worker, args=(model_dir, config.to_dict(), placement, rank, index),
                                  name=f"megatron-tp-rank-{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers


def run_worker(model_dir: str, config_dict: dict, placement: Placement, rank: int, local_index: int) -> None:
    """A rank other than 0: load its slice, mirror rank 0's KV pool, and follow its broadcasts until stop."""
    from ..fleet.lifeline import parent_death_signal  # noqa: PLC0415
    from ..model.config import ModelConfig  # noqa: PLC0415

    parent_death_signal()  # dies with rank 0's process (spawned from its main thread), whatever kills it

    config = InferenceConfig(**config_dict)
    device = rank_device(local_index, config)
    tp, channel = join_group(placement, rank, device)
    model_config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, default_dtype(config, model_config), device, tp, quantization=config.quantization)
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
    while True:
        kind, payload = channel.receive()
        if kind == "step":
            plan = buffers.unpack(payload)
            previous = broadcast_previous_tokens(plan, None, sampled, tp, device)
            embeddings = None
            if plan.num_images:
                embeddings = torch.empty(plan.num_images, model.config.hidden_size, device=device, dtype=model.dtype)
                dist.broadcast(embeddings, src=0, group=tp.group)
            runner.run_plan(plan, pool.layer_caches, embeddings, previous)
            sampled = plan.num_sample
        elif kind == "suspend":
            runner.on_suspend(payload)
            pool.release()
            if payload == 2 and device.type == "cuda":
                model.to("cpu")
                torch.cuda.empty_cache()
        elif kind == "resume":
            model.to(device)
            pool.allocate()
            runner.capture_graphs(pool.layer_caches)
        elif kind == "refit":
            dist.gather_object(_follow_refit(model, payload), None, dst=0, group=tp.group)
        elif kind == "lora":
            slots.write(*payload)
        elif kind == "stop":
            break
    dist.destroy_process_group()


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
    placement = placement_for(config.tensor_parallel_size)
    check_local_devices(placement, torch.device(config.device).type)
    workers = spawn_local_workers(model_dir, config, placement)
    if not placement.hosts_rank_zero:
        # This machine holds only followers: serve them until they exit; rank 0 lives in another pod.
        for worker in workers:
            worker.join()
        raise SystemExit(max((w.exitcode or 0) for w in workers) if workers else 0)
    device = rank_device(0, config)
    tp, channel = join_group(placement, 0, device)
    return tp, channel, device, workers

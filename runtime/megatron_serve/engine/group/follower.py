"""A rank other than 0 (:func:`run_worker`, the target of its process): load its slice, mirror rank 0's KV pool, and
follow rank 0's broadcasts until stop, with its own part of suspend and resume (:class:`FollowerMemory`), of a
refit (:func:`_follow_refit`) and of the host KV tier's copies (:class:`.kv_tier.FollowerTier`)."""

from __future__ import annotations

import logging
import multiprocessing.synchronize
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...config import InferenceConfig
from ...heap import freeze_startup_heap
from ...model.loader import load_model, load_weights
from ...model.lora.slots import LoraSlots
from ...processes.lifeline import parent_death_signal
from ...weights.drafter import policy_only
from ...weights.peer_pull import follow_share
from ...weights.sources import WeightSource
from ..experts.backend import install_expert_backend
from ..precompile.graphs import graphs_for, largest_graph
from ..kv.cache import KVCachePool
from ..kv.park import ParkedKV, ParkOrder
from ..runner import ModelRunner
from ..sizing import build_kv_pool, default_dtype, engine_buffers, max_sequence_length_for
from .channel import broadcast_previous_tokens
from .kv_handoff import follow as follow_handoff
from .kv_tier import FollowerTier
from .placement import Placement, join_group, rank_device, release_groups

logger = logging.getLogger(__name__)


def run_worker(model_dir: str, config_dict: dict, placement: Placement, rank: int, local_index: int,
               started: multiprocessing.synchronize.Event) -> None:
    """A rank other than 0: load its slice, mirror rank 0's KV pool, and follow its broadcasts until stop."""
    from ...model.config import ModelConfig  # noqa: PLC0415

    parent_death_signal()  # dies with its fork server, which ends with rank 0's process whatever kills it
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
    tier = FollowerTier(pool, device)
    freeze_startup_heap()  # as rank 0's process does once loaded; a rank forked from it collects again from here
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
        elif kind == "kv_copy":
            tier.apply(payload)
        elif kind in ("kv_layout", "kv_park", "kv_restore"):  # a prefilled request's blocks (prefill/decode)
            follow_handoff(kind, payload, pool, channel)
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



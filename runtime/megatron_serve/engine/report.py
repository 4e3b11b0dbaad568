"""What an engine tells the coordinator about itself, read off its parts: its load and its metrics (every
heartbeat) and its facts (its HELLO). An object of its own so that the engine class is its step loop; the engine
answers :class:`~.served.ServedEngine`'s ``load``, ``metrics_snapshot`` and ``facts`` through it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..weights.peer_pull import layout_digest
from .lora.adapters import lora_report
from .served import EngineFacts, EngineLoad
from .sizing import parameter_bytes

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..model.llama import LlamaForCausalLM
    from ..wire.engine_stats import EngineStats
    from .kv.tiers import KVTiers
    from .lora.adapters import EngineLoras
    from .scheduler import Scheduler
    from .worker import ModelWorker


class EngineReport:
    """One engine's load, metrics and facts, from the parts it was built of (never the engine itself)."""

    def __init__(self, model: LlamaForCausalLM, config: InferenceConfig, max_sequence_length: int, kv: KVTiers,
                 scheduler: Scheduler, worker: ModelWorker, stats: EngineStats, loras: EngineLoras | None) -> None:
        self.model, self.config, self.max_sequence_length = model, config, max_sequence_length
        self.kv, self.scheduler, self.worker, self.stats, self.loras = kv, scheduler, worker, stats, loras

    def load(self) -> EngineLoad:
        """What the engine holds and has done, for the heartbeat."""
        scheduler, allocator = self.scheduler, self.kv.allocator
        return EngineLoad(running=len(scheduler.running), waiting=len(scheduler.waiting) + len(scheduler.lora_queue),
                          kv_blocks_free=allocator.num_free, kv_blocks_total=allocator.num_blocks,
                          cached_tokens=scheduler.cached_tokens + scheduler.host_cached_tokens,
                          computed_tokens=self.worker.computed_tokens)

    def metrics(self) -> dict[str, Any]:
        """The cumulative engine metrics, as the heartbeat's ``metrics`` field carries them (``lora``: the adapters
        of the running and waiting requests, with ``enable_lora``)."""
        scheduler = self.scheduler
        snapshot = self.stats.to_wire(scheduler.queried_tokens, scheduler.cached_tokens)
        self.kv.report(snapshot, scheduler)
        if self.model.expert_balancer is not None:  # --enable-eplb
            self.model.expert_balancer.report(snapshot)
        lora = lora_report(self.loras, scheduler.running, [*scheduler.waiting, *scheduler.lora_queue.sequences()])
        if lora is not None:
            snapshot["lora"] = lora
        return snapshot

    def facts(self) -> EngineFacts:
        """What the engine process's HELLO says about this engine."""
        config, model = self.config, self.model
        return EngineFacts(capacity=config.max_requests, kv_blocks_total=self.kv.allocator.num_blocks,
                           tensor_parallel_size=config.tensor_parallel_size, kv_cache_bytes=self.kv.pool.num_bytes,
                           max_sequence_length=self.max_sequence_length, block_size=config.block_size_tokens,
                           prefix_caching=config.enable_prefix_caching,
                           expert_parallel=config.enable_expert_parallel and config.world_size > 1,
                           pipeline_parallel_size=config.pipeline_parallel_size,
                           parameter_bytes=parameter_bytes(model), kv_offload_blocks=self.kv.offload_blocks,
                           weights_layout=layout_digest(model), dtype=str(model.dtype).removeprefix("torch."),
                           max_loras=config.max_loras if config.enable_lora else None,
                           max_lora_rank=config.max_lora_rank if config.enable_lora else None,
                           logprobs_mode=config.logprobs_mode, vocab_size=model.config.vocab_size)

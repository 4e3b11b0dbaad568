"""One engine's KV cache as one object: the device pool and its allocator, the host tier behind it (and the node's
disk tier behind that), the KV events every tier tells, and prefill/decode disaggregation's blocks.

The engine holds a :class:`KVTiers` and hands its parts to the scheduler and the worker; what the tiers do between
steps (tell their events, wait for a disk read, report, close) is asked of this object, so that the engine's step
loop names no tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...config import InferenceConfig
from .cache import BlockAllocator, KVCachePool
from .copier import Copier
from .events import KVEventLog, ZmqPublisher
from .offload import HostKVTier
from .transfer import KVTransfer, OtherRanks

if TYPE_CHECKING:
    from ..scheduler import Scheduler

DISK_WAIT_S = 0.05  # a step with nothing to run but requests waiting for disk reads waits this long for one at most


class KVTiers:
    """The pool (``pool``), its ``allocator``, the ``host_tier`` (None without ``--kv-offloading-size``), the KV
    ``events`` (and their socket, ``publisher``, with ``--kv-events-config``) and the P/D ``transfer``."""

    def __init__(self, pool: KVCachePool, config: InferenceConfig, copier: Copier, others: OtherRanks) -> None:
        """``copier``: how the host tier copies blocks to and from the pool; ``others``: a group's other ranks, which
        hold parts of every block."""
        self.pool, self.config = pool, config
        block_size = config.block_size_tokens
        # what the tiers hold, told as vLLM's KV events to the coordinator and, with --kv-events-config, a socket
        self.events = KVEventLog(block_size, config.data_parallel_rank)
        self.publisher = (ZmqPublisher(config.kv_events_config, config.data_parallel_rank)
                          if config.kv_events_config is not None and config.kv_events_config.publishes else None)
        if self.publisher is not None:
            self.events.attach(self.publisher)  # its first batch: AllBlocksCleared (a start knows nothing)
        self.host_tier = HostKVTier.sized(pool, config, self.events, copier)
        self.allocator = BlockAllocator(pool.shape[2], config.enable_prefix_caching, self.host_tier, self.events)
        self.transfer = KVTransfer(pool, self.allocator, block_size, others)

    def serve(self, scheduler: Scheduler, model_dir: str | Path | None, layout: Callable[[], str]) -> None:
        """Hook the tiers to ``scheduler``: a request that leaves hands its blocks on (P/D), one forgotten lets go of
        the host slots held for its disk reads; the disk tier (``--kv-offloading-backend disk``) keys what it keeps by
        the model's directory, its weights' ``layout()`` and the scheduler's epoch. The hooks close over the parts,
        never the engine."""
        transfer, host_tier = self.transfer, self.host_tier
        scheduler.leaving.append(lambda sequence: transfer.on_leave(sequence, scheduler.epoch))
        if host_tier is None:
            return
        if self.config.kv_offloading_backend == "disk":
            identity = f"{Path(model_dir).resolve() if model_dir is not None else ''}|{layout()}"
            host_tier.attach_disk(self.config.kv_disk_dir, int(self.config.kv_disk_size * 2**30), identity,
                                  lambda: scheduler.epoch)
        scheduler.forgets.append(host_tier.release)

    @property
    def offload_blocks(self) -> int:
        """Blocks the host tier holds (0: none), which the coordinator's prefix routing counts."""
        return self.host_tier.num_slots if self.host_tier is not None else 0

    def wait_for_disk(self) -> None:
        """A step found nothing to run: when only disk reads are awaited, wait for one (briefly), not spin."""
        if self.host_tier is not None and self.host_tier.reading():
            self.host_tier.await_disk(DISK_WAIT_S)

    def release(self, request_ids: list[str]) -> None:
        """Requests handed back: the host slots held for their disk reads are free again."""
        if self.host_tier is not None:
            for request_id in request_ids:
                self.host_tier.release(request_id)

    def idle(self) -> None:
        """A loop turn without a step: the disk tier's writes that landed meanwhile reach the events now."""
        if self.host_tier is not None:
            self.host_tier.announce()
        self.events.flush()

    def report(self, snapshot: dict[str, Any], scheduler: Scheduler) -> None:
        """The host tier's and the transfers' series in a heartbeat's ``metrics``."""
        if self.host_tier is not None:
            self.host_tier.report(snapshot, scheduler.host_queried_tokens, scheduler.host_cached_tokens)
        self.transfer.counts.report(snapshot)

    def close(self) -> None:
        """The disk tier's queued writes land, then the events' last batch goes out and their socket closes."""
        if self.host_tier is not None:
            self.host_tier.close()
        if self.publisher is not None:
            self.events.flush()
            self.publisher.close()

"""Copies of KV blocks between the device pool and the host tier's slots (:mod:`.offload`): on a GPU a side stream
with pinned host memory (the host never waits; the device's next step waits for the copies that it depends on), on
a CPU a plain copy on the calling thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .cache import KVCachePool


class Transfer(Protocol):
    """One copy the tier started: done once its data has landed."""

    def done(self) -> bool: ...

    def seconds(self) -> float:
        """How long the copy took (called once it is done)."""
        ...


@dataclass
class _Finished:
    elapsed: float

    def done(self) -> bool:
        return True

    def seconds(self) -> float:
        return self.elapsed


@dataclass
class _CudaTransfer:
    start: torch.cuda.Event
    end: torch.cuda.Event

    def done(self) -> bool:
        return self.end.query()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1000.0


def _raw(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as bytes where they are float8 (index_select and index_copy_ take no e4m3): a copy is a copy."""
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in tensors]


class Copier:
    """Copies blocks between the device pool and host slots (``pool.block_tensors()`` order, block dim 2).

    This one copies on the calling thread: on a CPU the "device" pool is host memory, and a copy is a memcpy.
    """

    pin_memory = False

    def to_host(self, pool: KVCachePool, blocks: list[int], host: list[torch.Tensor], slots: list[int]) -> Transfer:
        started = time.perf_counter()
        index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
        where = torch.tensor(slots, dtype=torch.long)
        for source, target in zip(_raw(pool.block_tensors()), _raw(host)):
            target.index_copy_(0, where, source.index_select(2, index).movedim(2, 0))
        return _Finished(time.perf_counter() - started)

    def to_device(self, host: list[torch.Tensor], slots: list[int], pool: KVCachePool, blocks: list[int]) -> Transfer:
        started = time.perf_counter()
        index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
        where = torch.tensor(slots, dtype=torch.long)
        for source, target in zip(_raw(host), _raw(pool.block_tensors())):
            target.index_copy_(2, index, source.index_select(0, where).movedim(0, 2))
        return _Finished(time.perf_counter() - started)


class CudaCopier(Copier):
    """Copies on a side stream between the pool and pinned host slots; the host never waits for them.

    Both streams wait for each other on the device, never on the host. The side stream first waits for the work
    queued so far on the compute stream: a copy to the host reads blocks that a step still in flight may be
    writing, and a copy to the device writes blocks that such a step may still read or write (a block freed and
    handed out again while its last step runs). The compute stream then waits for the copy's end: the step
    launched next may overwrite what a copy to the host reads, and reads what a copy to the device writes. The
    pool's tensors are marked as used by the side stream (``record_stream``), so that memory released while a
    copy is queued (the pool freed by a suspend) is not handed out before the copy is done.
    """

    pin_memory = True

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def _copy(self, pool: KVCachePool, run: Callable[[], None]) -> Transfer:
        compute = torch.cuda.current_stream(self.stream.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(compute)  # ordered after every step launched so far
        with torch.cuda.stream(self.stream):
            start.record()
            run()
            end.record()
        for tensor in pool.block_tensors():
            tensor.record_stream(self.stream)
        compute.wait_event(end)  # the next step is ordered after the copy
        return _CudaTransfer(start, end)

    def to_host(self, pool: KVCachePool, blocks: list[int], host: list[torch.Tensor], slots: list[int]) -> Transfer:
        def run() -> None:
            index = torch.tensor(blocks, dtype=torch.long).to(pool.device, non_blocking=True)
            for source, target in zip(_raw(pool.block_tensors()), _raw(host)):
                staged = source.index_select(2, index).movedim(2, 0).contiguous()  # side-stream memory
                for row, slot in enumerate(slots):
                    target[slot].copy_(staged[row], non_blocking=True)
        return self._copy(pool, run)

    def to_device(self, host: list[torch.Tensor], slots: list[int], pool: KVCachePool, blocks: list[int]) -> Transfer:
        def run() -> None:
            index = torch.tensor(blocks, dtype=torch.long).to(pool.device, non_blocking=True)
            for source, target in zip(_raw(host), _raw(pool.block_tensors())):
                staged = torch.empty((len(slots), *source.shape[1:]), dtype=source.dtype, device=pool.device)
                for row, slot in enumerate(slots):
                    staged[row].copy_(source[slot], non_blocking=True)
                target.index_copy_(2, index, staged.movedim(0, 2))
        return self._copy(pool, run)


def copier_for(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else Copier()

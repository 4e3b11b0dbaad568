"""``checkpoint_engine.backend: megatron_serve``: verl's ``CheckpointEngine`` that moves the trainer's weights to the
rollout workers through a file, for trainers and replicas that share a filesystem (one machine, or a shared volume).

verl's engines move weights from the trainer's rank 0 to every rollout worker over NCCL, NIXL or Mooncake, all of
which need accelerators. This one needs none: rank 0 of the trainer writes the update as one safetensors file (the
checkpoint's names and dtypes; written aside and renamed, so a reader never sees half of it), each rollout worker
reads it when it appears, and the trainer's rank 0 removes it once verl finalizes the update. The other trainer
ranks still walk their weights (a sharded trainer gathers each tensor collectively) and write nothing. What the
workers read goes to :class:`~.adapter.ServerAdapter`, which pushes it into the server as one REFIT.

``engine_kwargs.megatron_serve``: ``directory`` (where the file is written; the system's temporary directory by
default, which a trainer and replicas on several machines do not share) and ``timeout`` (seconds a worker waits
for the file).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from safetensors import safe_open
from safetensors.torch import save_file
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

#: How often a rollout worker looks for the update's file.
POLL_S = 0.05


@CheckpointEngineRegistry.register("megatron_serve")
class FileCheckpointEngine(CheckpointEngine):
    """The trainer's rank 0 writes one safetensors file per update; the rollout workers read it."""

    def __init__(self, bucket_size: int, is_master: bool = False, directory: Optional[str] = None,
                 timeout: float = 600.0) -> None:
        self.bucket_size = bucket_size  # verl sizes every engine's buckets; a file needs none
        self.is_master = is_master
        self.directory = Path(directory or tempfile.gettempdir())
        self.timeout = timeout
        self.rank: Optional[int] = None
        self.path: Optional[Path] = None

    def prepare(self) -> Optional[dict[str, str]]:
        """The trainer's rank 0 names this update's file."""
        if not self.is_master:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        return {"path": str(self.directory / f"megatron-serve-verl-{uuid.uuid4().hex}.safetensors")}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The trainer's rank 0 writes (rank 0), its other ranks only walk their weights (-1), every rollout worker
        reads (1 on); all learn the file's path."""
        path = metadata[0]["path"]
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "path": [path] * actor_wg_world_size}
        rollout = {"rank": list(range(1, rollout_world_size + 1)), "path": [path] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, path: str) -> None:
        self.rank, self.path = rank, Path(path)

    def finalize(self) -> None:
        """The trainer's rank 0 removes the file: every worker read it (verl finalizes after both sides)."""
        if self.rank == 0 and self.path is not None:
            self.path.unlink(missing_ok=True)
        self.rank = self.path = None

    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> dict:
        """Walk the weights; rank 0 writes them (copied to host memory: tied tensors are written apart)."""
        tensors = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.rank == 0:
                tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if self.rank == 0:
            staging = self.path.with_suffix(".partial")
            await asyncio.to_thread(save_file, tensors, str(staging))
            os.replace(staging, self.path)
        return {}

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, Any]]:
        """Wait for the file (written while this runs: verl starts both sides at once), then yield its tensors."""
        deadline = time.monotonic() + self.timeout
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no weights at {self.path} after {self.timeout} s: does the trainer's rank 0 "
                                   "write to a directory this worker reads (engine_kwargs.megatron_serve.directory)?")
            await asyncio.sleep(POLL_S)
        with safe_open(str(self.path), framework="pt") as stored:
            for name in stored.keys():  # noqa: SIM118 - safe_open's handle is not a mapping
                yield name, stored.get_tensor(name)

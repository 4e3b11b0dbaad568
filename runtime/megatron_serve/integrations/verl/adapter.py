"""verl's ``ServerAdapter`` for a megatron-serve replica: what a replica's ``CheckpointEngineWorker`` hands the
trainer's weights to, once its checkpoint engine received them.

The adapter is the trainer side of the server's own weight routes (vLLM's: ``/init_weight_transfer_engine`` once,
then ``/start_weight_update``, ``/update_weights`` with the tensors broadcast over gloo, ``/finish_weight_update``),
so an update is one REFIT transaction of the fleet: every engine verifies names and shapes before a byte moves, all
load or none does, and every token after it carries the next epoch. Only the replica's leader worker (rank 0 of
its ranks, on the server's node) pushes; the others drain what their checkpoint engine gives them.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Iterator, Optional

import httpx
import ray
import torch.distributed as dist
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.utils import ensure_async_iterator

from ...client.trainer_group import trainer_init, trainer_send_weights
from ...fleet.local_fleet import free_port
from .admin_http import admin_client, post
from .replica import SERVER_NAME

#: The address the server joins the adapter's group at: the leader worker runs on the server's node.
LOCAL = "127.0.0.1"


class ServerAdapter(BaseRollout):
    """Pushes the trainer's weights into one replica's megatron-serve server through its weight routes."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size \
            * self.config.pipeline_model_parallel_size
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self.group: Optional[dist.ProcessGroup] = None
        self.http: Optional[httpx.AsyncClient] = None

    async def _connect(self) -> None:
        """The server's admin client, and the weight-transfer group the server joins (once: every update reuses
        it)."""
        server = ray.get_actor(SERVER_NAME.format(self.replica_rank))
        url, admin_key = await server.get_admin.remote()
        self.http = admin_client(url, admin_key)
        port = free_port(LOCAL)
        init = {"master_address": LOCAL, "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True}
        joined = asyncio.create_task(self._post("/init_weight_transfer_engine", {"init_info": init}))
        self.group = await asyncio.to_thread(trainer_init, LOCAL, port, 2)
        await joined

    async def _post(self, path: str, body: dict) -> dict:
        return await post(self.http, path, json=body)

    async def update_weights(self, weights: Iterator | AsyncIterator, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        """One REFIT of every ``(name, tensor)`` the checkpoint engine yields (the checkpoint's names), under the
        fleet's next epoch. Delta flushes are refused: a REFIT takes whole tensors."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format {wire_format!r}: the megatron-serve rollout takes whole tensors "
                                      "(named_tensors)")
        named = [(name, tensor.detach().cpu()) async for name, tensor in ensure_async_iterator(weights)]
        if not self.is_leader_rank:
            return
        if self.group is None:
            await self._connect()
        await self._post("/start_weight_update", {"is_checkpoint_format": True})
        info = {"names": [name for name, _ in named], "shapes": [list(t.shape) for _, t in named],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named], "packed": True}
        sent = asyncio.create_task(self._post("/update_weights", {"update_info": info}))
        await asyncio.to_thread(trainer_send_weights, named, self.group, packed=True)
        await sent
        await self._post("/finish_weight_update", {})

    async def resume(self, tags: list[str]) -> None:
        """verl's hybrid engine resumes memory through the replica (``wake_up``): nothing here."""

    async def release(self) -> None:
        """See :meth:`resume`."""


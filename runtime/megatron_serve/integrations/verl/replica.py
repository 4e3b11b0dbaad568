"""``rollout.name: megatron_serve``: verl's ``RolloutReplica`` for a megatron-serve server.

verl makes one replica per ``tensor x data x pipeline`` ranks of the rollout; each launches its servers and gives
verl the handle its agent loop calls (``server_handle``) and the address of the OpenAI routes (``server_address``).
Here a replica is one server (one ``megatron-serve run``: its engines are the replica's ranks), driven by one
:class:`~.server.MegatronServeServer` actor. The replica's workers are verl's own ``CheckpointEngineWorker`` actors,
which receive the trainer's weights and hand them to :class:`~.adapter.ServerAdapter`; they need no accelerator
(the weights reach the engines through the server), so a standalone replica's pool holds CPUs only.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .server import MegatronServeServer

#: The Ray actor name of replica ``rank``'s server (``{rank}{suffix}``), which the adapter looks up.
SERVER_NAME = "megatron_serve_server_{}"


class MegatronServeReplica(RolloutReplica):
    """One megatron-serve server as a verl rollout replica."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    def _name(self, kind: str) -> str:
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        return f"megatron_serve_{kind}_{role}{self.replica_rank}{self.name_suffix}"

    async def init_standalone(self) -> None:
        """A pool of CPUs for the replica's checkpoint workers (verl's own asks for a GPU a rank), then the server."""
        self.rollout_mode = RolloutMode.STANDALONE
        self.resource_pool = RayResourcePool([self.world_size], use_gpu=False, name_prefix=self._name("pool"),
                                             max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=self.resource_pool, ray_cls_with_init=self.get_ray_class_with_init_args(),
                               bin_pack=False, name_prefix=self._name("workers"), use_gpu=False, device_name="cpu")
        self.workers = group.workers
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """The server actor (on the node of the replica's first worker), its server started and ready."""
        # No CPU of Ray's: the actor only forwards calls; the server's processes do the work, outside Ray.
        options = {"name": SERVER_NAME.format(f"{self.replica_rank}{self.name_suffix}"),
                   "max_concurrency": self.max_concurrency, "num_cpus": 0}
        if self.workers:
            node = await self.workers[0].__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        server = ray.remote(MegatronServeServer).options(**options).remote(
            config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank)
        await server.launch_server.remote()
        host, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{host}:{port}"

    async def abort_request(self, request_id: str) -> dict:
        """Abort one request (verl's vLLM replica has the same call)."""
        return await self.servers[0].abort_request.remote(request_id)

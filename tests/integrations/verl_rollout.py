"""verl's own classes driving a megatron-serve replica, run with the verl venv's Python (``make verl-env``) by
``test_verl.py``: ``python verl_rollout.py MODEL_A MODEL_B PROMPTS_JSON WORK_DIR``; prints one JSON line.

Nothing here imports megatron-serve's backend: verl loads it in every process through megatron-serve's
``verl.plugins`` entry point. A local Ray, then, as verl's trainer does it: the replica class verl's registry names
``megatron_serve`` (initialised colocated with a CPU pool, so that ``sleep`` and ``wake_up`` act), greedy
generations through its server handle (the call verl's agent loop makes), a trainer worker group of verl's
``Worker`` holding model B's weights, verl's ``CheckpointEngineManager`` updating the replica with the
``megatron_serve`` checkpoint engine, generations again; a second replica, standalone, attached to that server
by its URL and admin key, generates the same; then ``sleep``, ``wake_up`` and generations once more. Ray counts
three CPUs: one for each replica's checkpoint worker and one for the trainer's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import ray
from safetensors.torch import load_file

from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import get_rollout_replica_class

#: No metrics: every Ray process would collect them and export them to the metrics agent each report period, for
#: nobody (the run has no dashboard and nothing scrapes them).
RAY_CONFIG = {"enable_metrics_collection": False}

GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
          "max_tokens": 8, "ignore_eos": True}


class Trainer(Worker):
    """The trainer side as verl's actor workers hold it: a checkpoint engine, and ``update_weights`` that sends
    the model's tensors through it (here a checkpoint's, read from disk)."""

    def __init__(self, model_dir: str, directory: str) -> None:
        super().__init__()
        self.weights = load_file(str(Path(model_dir) / "model.safetensors"))
        self.checkpoint_engine = CheckpointEngineRegistry.new("megatron_serve", is_master=self.rank == 0,
                                                              bucket_size=1 << 20, directory=directory)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(iter(self.weights.items()), global_steps=global_steps)


async def generations(replica, prompts: list[list[int]], tag: str) -> list[dict]:
    outputs = []
    for index, prompt in enumerate(prompts):  # one at a time, as the reference server answers them
        out = await replica.server_handle.generate.remote(prompt_ids=prompt, sampling_params=dict(GREEDY),
                                                          request_id=f"{tag}-{index}")
        outputs.append({"token_ids": out.token_ids, "log_probs": out.log_probs, "stop_reason": out.stop_reason,
                        "weight_version": out.extra_fields["weight_version"]})
    return outputs


async def main(model_a: str, model_b: str, prompts: list[list[int]], work: Path) -> dict:
    engine = CheckpointEngineConfig(backend="megatron_serve",
                                    engine_kwargs={"megatron_serve": {"directory": str(work / "updates")}})
    config = RolloutConfig(name="megatron_serve", tensor_model_parallel_size=1, data_parallel_size=1,
                           prompt_length=64, response_length=8, checkpoint_engine=engine,
                           engine_kwargs={"megatron_serve": {"args": ["--num-kv-blocks", "256"]}})
    replica = get_rollout_replica_class("megatron_serve")(replica_rank=0, config=config,
                                                          model_config=HFModelConfig(path=model_a), gpus_per_node=1)
    await replica.init_colocated(RayResourcePool([1], use_gpu=False, name_prefix="rollout", max_colocate_count=1))
    before = await generations(replica, prompts, "before")

    trainer = RayWorkerGroup(
        resource_pool=RayResourcePool([1], use_gpu=False, name_prefix="trainer", max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer), model_dir=model_b,
                                               directory=str(work / "updates")),
        use_gpu=False, device_name="cpu")
    manager = CheckpointEngineManager(config=engine, actor_wg=trainer, replicas=[replica])
    await manager.update_weights(global_steps=1)
    after = await generations(replica, prompts, "after")
    url, admin_key = await replica.servers[0].get_admin.remote()
    attached_config = RolloutConfig(name="megatron_serve", tensor_model_parallel_size=1, data_parallel_size=1,
                                    prompt_length=64, response_length=8, checkpoint_engine=engine,
                                    engine_kwargs={"megatron_serve": {"url": url, "admin_key": admin_key}})
    attached = get_rollout_replica_class("megatron_serve")(replica_rank=1, config=attached_config,
                                                           model_config=HFModelConfig(path=model_a), gpus_per_node=1)
    await attached.init_standalone()
    through_attached = await generations(attached, prompts, "attached")
    await replica.sleep()
    await replica.wake_up()
    woken = await generations(replica, prompts, "woken")
    # Every actor ends here, killed: left to ray.shutdown, an async actor (the servers) or one that outlives the
    # raylet exits through Python's whole finalization (seconds, a CPU-s or so each with torch and verl loaded)
    # where a killed one exits at once. A server's megatron-serve run ends with its actor either way (the actor
    # holds its lifeline).
    for actor in [*attached.servers, *replica.servers, *attached.workers, *replica.workers, *trainer.workers]:
        ray.kill(actor)
    return {"address": replica.server_address, "before": before, "after": after, "woken": woken,
            "attached": {"address": attached.server_address, "outputs": through_attached},
            "updates_left": sorted(p.name for p in (work / "updates").iterdir())}


if __name__ == "__main__":
    model_a, model_b, prompts_json, work_dir = sys.argv[1:5]
    # Ray's processes keep their session under the run's work directory: the test finds any left behind by it
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _temp_dir=str(Path(work_dir) / "ray"),
             _system_config=RAY_CONFIG)
    try:
        result = asyncio.run(main(model_a, model_b, json.loads(prompts_json), Path(work_dir)))
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)
    # Ray is down and the answer written: Python's finalization of a process holding torch, verl and Ray would
    # still spend a CPU-s or more tearing down modules, for a process that is about to end anyway.
    os._exit(0)

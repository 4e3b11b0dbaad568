"""SkyRL 0.4.0's own client code against a server: generation, then one weight sync, then generation again.

``python skyrl_client.py URL ADMIN_URL MODEL_NAME MODEL_DIR PROMPTS_JSON GROUP_PORT`` with ``.anchors`` on
``PYTHONPATH`` (``skyrl==0.4.0`` and ``vllm==0.33.0`` installed there ``--no-deps``, ``make setup``). ``URL`` is
the data plane (SkyRL's ``proxy_url``), ``ADMIN_URL`` the control plane (its ``server_urls``): the same server
with the admin key as the password of the URL's userinfo, which both of SkyRL's HTTP clients (aiohttp and
requests) send as HTTP Basic, as the server takes it. ``MODEL_NAME`` is the served model (SkyRL's ``model_name``),
``MODEL_DIR`` the checkpoint its trainer pushes. Prints one JSON line: ``{"before", "after", "world_size",
"weight_version"}``, each completion as SkyRL's ``InferenceEngineOutput`` holds it.

What runs is SkyRL's: ``RemoteInferenceClient`` (``inference_servers/remote_inference_client.py``: ``generate``
through ``/inference/v1/generate`` and ``/detokenize``, ``get_world_size``, ``pause_generation``,
``sleep_for_weight_sync``, ``wake_for_weight_sync``, ``reset_prefix_cache``, ``resume_generation``,
``finish_session``), its ``SkyrlWeightSyncClient`` (``weight_sync/control_plane.py``, with ``nccl_init_payloads``)
and its NCCL trainer engine (``weight_sync/weight_senders.py``: ``get_skyrl_nccl_trainer``, vLLM 0.33's
``NCCLTrainerWeightTransferEngine`` underneath, whose ``send_weights`` drives start, update and finish), in the order
of ``workers/worker_dispatch.py``'s fully-async sync with the KV cache offloaded. Two things are not SkyRL's:

* the collective: vLLM's trainer endpoint and packed broadcast are NCCL on a GPU; here the engine's
  ``_open_trainer_endpoint`` and ``_broadcast`` are gloo's (:mod:`megatron_serve.client.trainer_group`), the
  iteration checked by vLLM's own ``_checked_iter``;
* ``skyrl/backends/__init__.py`` is not run: it imports the Tinker backend's interface (``backends/backend.py``,
  then ``skyrl/tinker/types.py``), whose pydantic model ``RenderedModelInput`` holds a ``typing.TypedDict``
  (``MultiModalKwargs``, line 132), which pydantic refuses below Python 3.12 (skyrl 0.4.0 requires 3.12; this
  project runs 3.11, and every module below compiles on it). ``skyrl.backends`` is registered as the bare package
  path; the client modules never use what that ``__init__`` exports.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

from checkpoint_module import Checkpoint  # beside this script (its folder: sys.path[0])
from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights


def _skyrl_backends_without_tinker() -> None:
    """Register ``skyrl.backends`` as its package path, its ``__init__`` not run (see the module docstring)."""
    import skyrl  # noqa: PLC0415 - the package itself imports nothing

    package = types.ModuleType("skyrl.backends")
    package.__path__ = [str(Path(skyrl.__file__).parent / "backends")]
    sys.modules["skyrl.backends"] = package


_skyrl_backends_without_tinker()

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)
from skyrl.backends.skyrl_train.weight_sync.control_plane import (  # noqa: E402
    SkyrlWeightSyncClient,
    nccl_init_payloads,
)
from skyrl.backends.skyrl_train.weight_sync.weight_senders import get_skyrl_nccl_trainer  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402

TOKENS = 8


def gloo_engine() -> tuple[type, type]:
    """SkyRL's NCCL trainer engine and init info, the collective gloo's (see the module docstring)."""
    init_info_cls, engine_cls = get_skyrl_nccl_trainer()

    class GlooEngine(engine_cls):
        def _open_trainer_endpoint(self, init_info) -> None:  # noqa: ANN001 - vLLM's signature
            self.model_update_group = trainer_init(init_info.master_address, init_info.master_port,
                                                   init_info.world_size, timeout=120)

        def _broadcast(self, source, meta) -> None:  # noqa: ANN001 - vLLM's signature
            trainer_send_weights(self._checked_iter(source, meta), self.model_update_group, packed=self.packed,
                                 buffer_bytes=self.packed_buffer_size_bytes)

        def shutdown(self) -> None:  # a group made directly, not registered with torch.distributed: dropped
            self.model_update_group = None

    return init_info_cls, GlooEngine


async def generate(client: RemoteInferenceClient, prompts: list[list[int]]) -> dict:
    output = await client.generate({"prompt_token_ids": prompts, "session_ids": [f"s{i}" for i in range(len(prompts))],
                                    "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
                                                        "logprobs": 0}})
    for i in range(len(prompts)):
        await client.finish_session(f"s{i}")
    return {"responses": output["responses"], "response_ids": output["response_ids"],
            "stop_reasons": output["stop_reasons"], "logprobs": output["response_logprobs"]}


async def main(url: str, admin_url: str, model: str, model_dir: str, prompts: list[list[int]], port: int) -> dict:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[admin_url], data_parallel_size=1, model_name=model)
    async with client:
        before = await generate(client, prompts)
        world_size, _ = await client.get_world_size()
        init_info_cls, engine_cls = gloo_engine()
        # weight_senders._build_sender_init_info's NCCL branch: every inference worker plus the trainer, packed
        init_info = init_info_cls(master_address="127.0.0.1", master_port=port, world_size=world_size + 1,
                                  packed=True, rank=0)
        sync_client = SkyrlWeightSyncClient([admin_url], 1, init_payload_fn=nccl_init_payloads)
        engine = await asyncio.to_thread(engine_cls.trainer_init, init_info, client=sync_client,
                                         source=ModuleSource(Checkpoint(model_dir)))
        try:
            await client.pause_generation()
            try:
                await client.sleep_for_weight_sync(offload_kv=True)
                await client.wake_for_weight_sync(tags=["weights"])
                await asyncio.to_thread(engine.send_weights)
                await client.reset_prefix_cache(reset_running_requests=True)
                await client.wake_for_weight_sync(tags=["kv_cache"])
            finally:
                await client.resume_generation()
            client.increment_weight_version()
        finally:
            engine.shutdown()
            sync_client.close()
        after = await generate(client, prompts)
    return {"before": before, "after": after, "world_size": world_size, "weight_version": client.weight_version}


if __name__ == "__main__":
    url, admin_url, model, model_dir, prompts_json, port = sys.argv[1:7]
    print(json.dumps(asyncio.run(main(url, admin_url, model, model_dir, json.loads(prompts_json), int(port)))),
          flush=True)

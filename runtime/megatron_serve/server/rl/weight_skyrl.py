"""SkyRL's ``POST /collective_rpc`` (vLLM's route for calling a method on every worker), for SkyRL's worker methods.

SkyRL's ``RemoteInferenceClient`` (``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``)
drives weight syncs through methods of its own vLLM worker extension (``new_inference_worker_wrap.py``), as SkyRL
HEAD (a956457) sends them:

* ``skyrl_start_weight_update {is_checkpoint_format}``, then ``update_weights_nccl {update_info: {names,
  dtype_names, shapes, packed, ...}}`` while the trainer broadcasts, then ``skyrl_finish_weight_update``: here
  vLLM's update (:mod:`.weight_vllm`): start stages, ``update_weights_nccl`` receives what vLLM's
  ``/update_weights`` receives, finish is the one REFIT of what was staged;
* ``skyrl_sleep_for_weight_sync {offload_kv}`` and ``skyrl_wake_for_weight_sync {tags}`` around the broadcast
  (fully-async training, the fleet paused in ``keep`` mode by SkyRL's ``/pause``): SkyRL frees the GPU memory its
  vLLM worker needs to receive a broadcast. This server receives the broadcast in host memory and the engines load
  it in place, so there is nothing to free: both are taken (their arguments checked) and change nothing; the
  requests SkyRL paused stay paused until its ``/resume``.

``update_weights_ipc`` (CUDA IPC handles of the trainer's own GPU), ``init_weight_transfer_engine_rdt`` and
``update_weights_rdt`` (Ray Direct Transport, out of Ray's object store) need the trainer on the engines' machines
or in their Ray cluster: refused by name, as is any other method. The answer is vLLM's, one result per worker.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from ..errors import bad_request
from .responses import WEIGHT_RESPONSES
from .weight_updates import Body, WeightUpdates, read
from .weight_vllm import UpdateInfo, receive_update

SKYRL_WEIGHT_PATHS = frozenset({"/collective_rpc"})
START, FINISH, NCCL = "skyrl_start_weight_update", "skyrl_finish_weight_update", "update_weights_nccl"
SLEEP, WAKE = "skyrl_sleep_for_weight_sync", "skyrl_wake_for_weight_sync"
ELSEWHERE = {"update_weights_ipc": "carries CUDA IPC handles, which only a trainer on the engines' own GPUs makes",
             "init_weight_transfer_engine_rdt": "pulls the weights out of Ray's object store, which only a worker "
                                                "inside the trainer's Ray cluster reaches",
             "update_weights_rdt": "pulls the weights out of Ray's object store, which only a worker inside the "
                                   "trainer's Ray cluster reaches"}
WAKE_TAGS = frozenset({"weights", "kv_cache"})


class RpcRequest(Body):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


class StartKwargs(Body):
    is_checkpoint_format: bool = True


class NcclKwargs(Body):
    update_info: UpdateInfo


class SleepKwargs(Body):
    offload_kv: bool = True


class WakeKwargs(Body):
    tags: list[str]


def _kwargs(model: type[Body], body: RpcRequest) -> Any:
    """The method's keyword arguments as ``model`` (positional ones are refused: SkyRL sends none)."""
    if body.args:
        raise bad_request(f"method {body.method!r} takes keyword arguments only (kwargs), got args", param="args")
    try:
        return model.model_validate(body.kwargs)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(f"method {body.method!r}: kwargs.{where}: {first['msg']}", param=f"kwargs.{where}") from None


def add_skyrl_weight_routes(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """``/collective_rpc`` on ``app`` (the admin key's ``guard``); see the module docstring."""

    @app.post("/collective_rpc", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["skyrl"])
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await read(request, RpcRequest)
        if body.method == START:
            if not _kwargs(StartKwargs, body).is_checkpoint_format:
                raise bad_request("is_checkpoint_format false: this server takes the checkpoint's names and shapes "
                                  "only", param="kwargs.is_checkpoint_format")
            await updates.start()
        elif body.method == NCCL:
            await receive_update(updates, _kwargs(NcclKwargs, body).update_info)
        elif body.method == FINISH:
            _kwargs(Body, body)
            await updates.finish(None)
        elif body.method == SLEEP:
            _kwargs(SleepKwargs, body)
        elif body.method == WAKE:
            unknown = set(_kwargs(WakeKwargs, body).tags) - WAKE_TAGS
            if unknown:
                raise bad_request(f"method {WAKE!r}: tags {sorted(unknown)} are not SkyRL's "
                                  f"({', '.join(sorted(WAKE_TAGS))})", param="kwargs.tags")
        elif body.method in ELSEWHERE:
            raise bad_request(f"method {body.method!r} is refused: it {ELSEWHERE[body.method]}; use the broadcast "
                              f"weight sync ({START}, {NCCL}, {FINISH}, or vLLM's routes)", param="method")
        else:
            raise bad_request(f"method {body.method!r} is not a worker method here: /collective_rpc takes SkyRL's "
                              f"{START}, {NCCL}, {FINISH}, {SLEEP} and {WAKE}", param="method")
        return {"results": [None]}

"""SkyRL's ``POST /collective_rpc`` (vLLM's route for calling a method on every worker), for SkyRL's four method names.

SkyRL's ``RemoteInferenceClient`` brackets a weight sync with worker methods of its own vLLM worker extension
(``skyrl/backends/skyrl_train/inference_servers/rdt_control_protocol.py``): ``skyrl_start_weight_update`` and
``skyrl_finish_weight_update`` around the tensors (vLLM's ``/update_weights``), ``init_weight_transfer_engine_rdt``
and ``update_weights_rdt`` for its Ray Direct Transport path. Here the bracket is vLLM's update (:mod:`.weight_vllm`):
start stages, finish is the one REFIT of what was staged. The RDT pair pulls tensors out of Ray's object store over
NIXL, which only a worker inside the trainer's Ray cluster can: both are refused by name, as is any other method (a
worker method of another extension means nothing here).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ..errors import bad_request
from .weight_updates import Body, WeightUpdates, read
from .responses import WEIGHT_RESPONSES

SKYRL_WEIGHT_PATHS = frozenset({"/collective_rpc"})
START, FINISH = "skyrl_start_weight_update", "skyrl_finish_weight_update"
RAY_DIRECT = ("init_weight_transfer_engine_rdt", "update_weights_rdt")


class RpcRequest(Body):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def add_skyrl_weight_routes(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """``/collective_rpc`` on ``app`` (the admin key's ``guard``); see the module docstring."""

    @app.post("/collective_rpc", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["skyrl"])
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await read(request, RpcRequest)
        if body.method == START:
            await updates.start()
        elif body.method == FINISH:
            await updates.finish(None)
        elif body.method in RAY_DIRECT:
            raise bad_request(f"method {body.method!r} is refused: SkyRL's Ray Direct Transport pulls the weights out "
                              "of Ray's object store, which only a worker inside the trainer's Ray cluster reaches; "
                              "use the broadcast weight sync (vLLM's /init_weight_transfer_engine and "
                              "/update_weights between skyrl_start_weight_update and skyrl_finish_weight_update)",
                              param="method")
        else:
            raise bad_request(f"method {body.method!r} is not a worker method here: /collective_rpc takes SkyRL's "
                              f"{START} and {FINISH} ({', '.join(RAY_DIRECT)} are refused)", param="method")
        return {"results": [None]}

"""AReaL's own weight routes on its vLLM server (``areal/engine/vllm_ext/areal_vllm_server.py``), as REFITs.

AReaL's vLLM backend (``areal/engine/vllm_remote.py``, AReaL HEAD 4aef98d) updates weights through these:

* ``POST /areal_update_weights {model_path, load_format?, abort_all_requests?}``: the REFIT of that directory (as
  the engines see it), the fleet paused in ``abort`` mode around it as AReaL's server pauses its engine;
* ``POST /areal_init_weights_update_group {master_address, master_port, rank_offset, world_size, backend,
  group_name}``: this server joins the trainer's group as AReaL's ``init_custom_process_group`` builds it (the
  trainer is rank 0 and serves the store, keys under ``group_name``: SGLang's layout);
* ``POST /areal_set_update_weight_meta {names, dtypes, shapes, group_name}``: what the next broadcast holds;
* ``POST /areal_update_weights_xccl``: the trainer broadcasts those tensors one by one, in that order; received
  into host memory, they are one REFIT (AReaL's commit point is this call), the fleet paused in ``abort`` mode
  around it.

Answers are AReaL's: ``{"success": true, "message": "TP rank: 0 success\\n"}`` (its ``build_response`` over one
rank). The LoRA variants (``/areal_update_weights_lora``, ``..._lora_xccl``, ``/areal_set_update_weight_meta_lora``)
register an adapter by name as they load it: refused by name (this server loads adapters through
``/v1/load_lora_adapter``, which AReaL's disk path for LoRA uses). AReaL's pause and continue routes are control
routes (:mod:`.areal_control`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ...weights.framework_groups import Layout, TensorMeta, announced, sglang_prefixes
from ...wire.lifecycle import PauseMode
from ..errors import APIError, bad_request
from .responses import WEIGHT_RESPONSES
from .weight_updates import Body, WeightUpdates, read

AREAL_LORA_PATHS = frozenset({"/areal_update_weights_lora", "/areal_update_weights_lora_xccl",
                              "/areal_set_update_weight_meta_lora"})
AREAL_WEIGHT_PATHS = frozenset({"/areal_update_weights", "/areal_init_weights_update_group",
                                "/areal_set_update_weight_meta", "/areal_update_weights_xccl"}) | AREAL_LORA_PATHS

#: AReaL's answer of a one-rank success (``build_response``).
SUCCESS = {"success": True, "message": "TP rank: 0 success\n"}


class DiskRequest(Body):
    model_path: str
    load_format: str | None = "auto"
    abort_all_requests: bool = False


class GroupRequest(Body):
    master_address: str
    master_port: str | int  # AReaL sends it as a string
    rank_offset: int
    world_size: int
    backend: str
    group_name: str


class MetaRequest(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str


def add_areal_weight_routes(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """AReaL's weight routes on ``app`` (the admin key's ``guard``); see the module docstring."""
    announced_next: dict[str, Any] = {}  # "group": the group joined; "metas": what the next broadcast holds

    @app.post("/areal_update_weights", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["areal"])
    async def areal_update_weights(request: Request) -> dict[str, Any]:
        body = await read(request, DiskRequest)
        if body.load_format not in (None, "auto", "safetensors"):
            raise bad_request(f"load_format {body.load_format!r}: the engines read the directory's safetensors",
                              param="load_format")
        async with updates.hold(f"reading the directory {body.model_path}"):
            await updates.refit_directory(body.model_path, None, pause=PauseMode.ABORT)
        return SUCCESS

    @app.post("/areal_init_weights_update_group", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["areal"])
    async def areal_init_weights_update_group(request: Request) -> dict[str, Any]:
        body = await read(request, GroupRequest)
        backend = updates.backend_for(body.backend)
        if not str(body.master_port).isdigit():
            raise bad_request(f"master_port {body.master_port!r} is not a port number", param="master_port")
        try:
            layout = Layout.trainer_first(body.master_address, int(body.master_port), body.rank_offset,
                                          body.world_size, backend, sglang_prefixes(body.group_name, backend))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await updates.open(layout)
        announced_next.clear()
        announced_next["group"] = body.group_name
        return SUCCESS

    @app.post("/areal_set_update_weight_meta", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["areal"])
    async def areal_set_update_weight_meta(request: Request) -> dict[str, Any]:
        body = await read(request, MetaRequest)
        _known(announced_next, body.group_name)
        try:
            announced_next["metas"] = announced(body.names, body.dtypes, body.shapes)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return SUCCESS

    @app.post("/areal_update_weights_xccl", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["areal"])
    async def areal_update_weights_xccl(request: Request) -> dict[str, Any]:
        await read(request, Body)
        metas: list[TensorMeta] | None = announced_next.pop("metas", None)
        if metas is None:
            raise APIError(409, "no weights announced: POST /areal_set_update_weight_meta first",
                           code="no_weight_update", type="invalid_request_error")
        async with updates.hold(f"receiving {len(metas)} tensors"):
            tensors = await updates.receive(metas, packed=False)
            await updates.refit_tensors(tensors, None, pause=PauseMode.ABORT)
        return SUCCESS

    for path in sorted(AREAL_LORA_PATHS):
        _refuse_lora(app, path, guard)


def _refuse_lora(app: FastAPI, path: str, guard: list[Any]) -> None:
    @app.post(path, dependencies=guard, responses=WEIGHT_RESPONSES, tags=["areal"])
    async def refused() -> None:
        raise bad_request(f"{path} is refused: AReaL's LoRA weights by broadcast register an adapter as they load it; "
                          "here an adapter loads from a directory through /v1/load_lora_adapter (AReaL's disk "
                          "update for LoRA)", code="unsupported")


def _known(announced_next: dict[str, Any], name: str) -> None:
    if announced_next.get("group") != name:
        raise APIError(409, f"no weight update group {name!r}: /areal_init_weights_update_group first",
                       code="no_weight_transfer", type="invalid_request_error")

"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, fleet-wide.

The bodies are vLLM's (``{"lora_name", "lora_path"}`` and ``{"lora_name"}``), and so is the success
answer (200, ``text/plain``: ``Success: LoRA adapter 'NAME' added successfully.``). Each is the
coordinator's LOAD_LORA or UNLOAD_LORA verb: answered once every engine acknowledged, so the next
request naming the adapter finds it on every engine, and ``/v1/models`` lists it (or no longer does)
as soon as the answer comes. A bad adapter (no such directory, rank above ``--max-lora-rank``, a
module the model lacks, mismatched shapes, NaN or infinite weights, a path outside ``--lora-allowed-dirs``,
files over their size limits), a name already served, a name outside the pattern of :mod:`..wire.lora_names` or
the served model's own name is a 400 naming the problem, and no engine serves it; unloading a name no engine serves is a 404.

Unloading while requests of the adapter run does not refuse (vLLM does not either): those requests
finish under the adapter; requests that name it afterwards get 404 like any unknown model.

Access, as vLLM gates these routes: they answer only when the server's environment sets
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` to ``1`` or ``true`` (else a 404 saying so). Unlike vLLM they also
need the admin key (``Authorization: Bearer KEY``, see :mod:`.admin`): loading an adapter changes what
every client of the fleet is served.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from ..wire.lora_names import name_problem, path_problem, shown
from .admin import _AdminBody, _parse, admin_guard, run_verb
from .backend import Backend
from .errors import APIError, bad_request
from .fleet import FleetMonitor
from .intake import request_body_doc
from .models import ErrorResponse

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def runtime_lora_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` opens the routes (``1`` or ``true``, any case, as vLLM reads it)."""
    return environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(_AdminBody):
    lora_name: str = Field(min_length=1, description="the name requests give as their `model`")
    lora_path: str = Field(min_length=1, description="the PEFT adapter's directory, as the engines see it")
    load_inplace: bool = Field(False, description="vLLM's: replace an adapter of the same name; not supported "
                                                  "(unload it first)")


class UnloadLoRAAdapterRequest(_AdminBody):
    lora_name: str = Field(min_length=1, description="the adapter to stop serving")
    lora_int_id: int | None = Field(None, description="vLLM's; adapters are told apart by name here (ignored)")


LORA_BODIES = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)


def check_load(body: LoadLoRAAdapterRequest, served_model: str) -> None:
    """A 400 for a name outside the pattern (:mod:`..wire.lora_names`), one that would shadow the served model
    (its requests could no longer reach the base model's name, or the adapter), or a path that cannot be one."""
    problem = name_problem(body.lora_name)
    if problem is not None:
        raise bad_request(problem, param="lora_name")
    if body.lora_name == served_model:
        raise bad_request(f"lora_name {shown(body.lora_name)} is the served model's name: an adapter cannot shadow "
                          "it; choose another name", param="lora_name")
    problem = path_problem(body.lora_name, body.lora_path)
    if problem is not None:
        raise bad_request(problem, param="lora_path")


def add_lora_routes(app: FastAPI, backend: Backend, monitor: FleetMonitor, admin_key: str | None,
                    allowed: bool, served_model: str) -> None:
    """The two routes on ``app`` (see the module docstring); ``allowed``: :func:`runtime_lora_allowed`;
    ``served_model``: the base model's name, which no adapter may take."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "vLLM's success line"},
        400: {"model": ErrorResponse, "description": "a bad body, or an adapter an engine refused (the message "
                                                     "names the engine and the problem); no engine serves it"},
        401: {"model": ErrorResponse, "description": "no admin key presented"},
        403: {"model": ErrorResponse, "description": "a wrong admin key (the API key included), or no admin key "
                                                     "configured"},
        404: {"model": ErrorResponse, "description": f"${RUNTIME_LORA_ENV} is not set, or (unload) no engine serves "
                                                     "that adapter"},
        409: {"model": ErrorResponse, "description": "the fleet is stopped"},
        503: {"model": ErrorResponse, "description": "the coordinator is unreachable or did not acknowledge"},
    }
    guard = admin_guard(admin_key)

    def check_allowed(route: str) -> None:
        if not allowed:
            raise APIError(404, f"{route} is off: runtime LoRA updating needs {RUNTIME_LORA_ENV}=True in the "
                                "server's environment (as vLLM)", code="runtime_lora_updating_disabled")

    @app.post(LORA_PATHS[0], dependencies=guard, tags=["admin"], response_class=PlainTextResponse,
              responses=responses, openapi_extra=request_body_doc(LoadLoRAAdapterRequest, required=True),
              summary="Load a LoRA adapter", description="Every engine serves the adapter (vLLM's route).")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(LORA_PATHS[0])
        body: LoadLoRAAdapterRequest = _parse(LoadLoRAAdapterRequest, await request.body())
        if body.load_inplace:
            raise bad_request("load_inplace is not supported: unload the adapter, then load it again",
                              param="load_inplace")
        check_load(body, served_model)
        await run_verb(monitor, "load_lora_adapter",
                       lambda: backend.load_lora_adapter(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")  # a checked name

    @app.post(LORA_PATHS[1], dependencies=guard, tags=["admin"], response_class=PlainTextResponse,
              responses=responses, openapi_extra=request_body_doc(UnloadLoRAAdapterRequest, required=True),
              summary="Unload a LoRA adapter", description="No engine serves the adapter to new requests "
                                                           "(vLLM's route); running ones finish under it.")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(LORA_PATHS[1])
        body: UnloadLoRAAdapterRequest = _parse(UnloadLoRAAdapterRequest, await request.body())
        problem = name_problem(body.lora_name)
        if problem is not None:
            raise bad_request(problem, param="lora_name")
        await run_verb(monitor, "unload_lora_adapter", lambda: backend.unload_lora_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

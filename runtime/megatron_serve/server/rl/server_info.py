"""``GET /server_info`` (vLLM's and SGLang's path) and ``GET /get_server_info`` (SGLang's): one answer for both.

vLLM's answer is ``{vllm_config, vllm_env, system_env}``, ``vllm_config`` a text line or, with
``?config_format=json``, the config as JSON, of which the frameworks read ``model_config`` (``dtype``,
``max_model_len``, ``logprobs_mode``: TRL 1.16's ``GRPOTrainer`` in server mode refuses to start unless it is
``processed_logprobs``), ``parallel_config`` (sizes), ``lora_config`` (null without LoRA) and
``weight_transfer_config`` (the backend a trainer's group uses). SGLang's answer is its flat ``ServerArgs`` plus
scheduler facts, of which slime, miles and AReaL read ``tp_size``, ``pp_size``, ``dp_size``, ``ep_size``,
``disaggregation_mode`` and the model path. A framework reads keys and ignores the others, so one answer holds
both: vLLM's three keys and SGLang's flat ones side by side, whichever path was asked. Every value comes from what
the engines reported (their HELLO facts, through the fleet's status), so the answer says what is served now.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...package import __version__
from ...wire.sampling_fields import MAX_TOP_N_LOGPROBS
from ..context import ServerContext
from ..openapi_doc import error_responses
from .control import Control, Query, one_of, query_doc

SERVER_INFO_PATHS = frozenset({"/server_info", "/get_server_info"})


def _engine_info(ctx: ServerContext) -> dict[str, Any]:
    engines = ctx.monitor.engines
    return dict(engines[0].get("info") or {}) if engines else {}


def vllm_config(ctx: ServerContext, control: Control) -> dict[str, Any]:
    """The fields of vLLM's ``VllmConfig`` that the frameworks read, as this fleet has them."""
    info, shape = _engine_info(ctx), control.shape()
    lora = ({"max_loras": info["max_loras"], "max_lora_rank": info["max_lora_rank"]}
            if info.get("max_loras") is not None else None)
    backend = ctx.options.weight_transfer_backend
    return {
        "model_config": {"model": ctx.model_name, "tokenizer": ctx.model_name, "served_model_name": ctx.model_name,
                         "dtype": info.get("dtype"), "max_model_len": ctx.max_model_len(),
                         "logprobs_mode": info.get("logprobs_mode", "raw_logprobs"), "max_logprobs": MAX_TOP_N_LOGPROBS,
                         "skip_tokenizer_init": False},
        "parallel_config": {"tensor_parallel_size": shape.tensor, "pipeline_parallel_size": shape.pipeline,
                            "data_parallel_size": shape.data, "enable_expert_parallel": shape.expert,
                            "world_size": shape.world_size, "world_size_across_dp": shape.world_size_across_dp},
        "cache_config": {"block_size": info.get("block_size"), "enable_prefix_caching": info.get("prefix_caching")},
        "lora_config": lora,
        "weight_transfer_config": {"backend": backend} if backend is not None else None,
    }


def _vllm_text(config: dict[str, Any]) -> str:
    """``vllm_config`` as vLLM's text form: ``key=value`` pairs of the sections, on one line."""
    return ", ".join(f"{key}={value}" for section in config.values() if section
                     for key, value in section.items())


def sglang_fields(ctx: ServerContext, control: Control) -> dict[str, Any]:
    """SGLang's ``ServerArgs`` fields and scheduler facts that the frameworks read."""
    shape = control.shape()
    status = ctx.monitor.status or {}
    limit = ctx.max_model_len()
    return {"model_path": ctx.model_name, "served_model_name": ctx.model_name, "tp_size": shape.tensor,
            "pp_size": shape.pipeline, "dp_size": shape.data, "ep_size": shape.expert_size,
            "num_gpus": shape.world_size, "disaggregation_mode": "null", "context_length": limit,
            "max_req_input_len": limit, "weight_version": str(status.get("epoch") or 0), "version": __version__}


def add_server_info_routes(app: FastAPI, ctx: ServerContext, control: Control, api_guard: Any) -> None:
    """``/server_info`` and ``/get_server_info`` on ``app`` (the API key's routes: they describe the served
    model, as ``/v1/models`` does, and change nothing)."""
    responses = error_responses([400, 401] if api_guard.on else [400])

    @app.get("/server_info", tags=["RL frameworks"], dependencies=api_guard.dependencies, responses=responses,
             summary="vLLM's and SGLang's server facts",
             description="vLLM's `{vllm_config, vllm_env, system_env}` (`?config_format=json`: `vllm_config` as "
                         "JSON, else text) beside SGLang's flat fields (`tp_size`, `pp_size`, `dp_size`, `ep_size`, "
                         "`disaggregation_mode`, ...).",
             openapi_extra=query_doc(("config_format", one_of("text", "json"), "`vllm_config` as text (default) "
                                                                                 "or JSON")))
    async def server_info(request: Request) -> JSONResponse:
        query = Query(request)
        text = query.choice("config_format", ("text", "json"), "text") == "text"
        query.done()
        return JSONResponse(_answer(ctx, control, text))

    @app.get("/get_server_info", tags=["RL frameworks"], dependencies=api_guard.dependencies, responses=responses,
             summary="SGLang's server facts", description="The answer of `GET /server_info?config_format=json`.")
    async def get_server_info(request: Request) -> JSONResponse:
        Query(request).done()
        return JSONResponse(_answer(ctx, control, text=False))


def _answer(ctx: ServerContext, control: Control, text: bool) -> dict[str, Any]:
    config = vllm_config(ctx, control)
    return {"vllm_config": _vllm_text(config) if text else config, "vllm_env": {}, "system_env": {},
            **sglang_fields(ctx, control)}

"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served model and the LoRA adapters served beside it.

An adapter is listed as a model of its own whose ``parent`` is the base model, as vLLM lists them; the
adapters are the engines' once they reported theirs, else the ones the server was started with.
"""

from __future__ import annotations

from fastapi import FastAPI

from .api_key import APIKeyGuard
from .context import ServerContext
from .errors import APIError
from .openapi_doc import error_responses
from .service_models import ModelCard, ModelList


def _model_card(ctx: ServerContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len(),
                     input_modalities=["text", "image"] if ctx.accepts_images else ["text"])


def _adapter_card(ctx: ServerContext, name: str, adapters: dict[str, str]) -> ModelCard:
    return _model_card(ctx).model_copy(update={"id": name, "root": adapters[name], "parent": ctx.model_name})


def add_model_routes(app: FastAPI, ctx: ServerContext, guard: APIKeyGuard) -> None:
    """``/v1/models`` and ``/v1/models/{model}`` on ``app``."""

    @app.get("/v1/models", response_model=ModelList, dependencies=guard.dependencies, tags=["OpenAI"],
             responses=error_responses([401] if guard.on else []))
    async def list_models() -> ModelList:
        served = ctx.adapters
        return ModelList(data=[_model_card(ctx), *(_adapter_card(ctx, name, served) for name in served)])

    @app.get("/v1/models/{model}", response_model=ModelCard, dependencies=guard.dependencies, tags=["OpenAI"],
             responses=error_responses([401, 404] if guard.on else [404]))
    async def retrieve_model(model: str) -> ModelCard:
        if model not in ctx.served_names:
            raise APIError(404, f"the model '{model}' does not exist here", param="model", code="model_not_found")
        return _model_card(ctx) if model == ctx.model_name else _adapter_card(ctx, model, ctx.adapters)

"""The app's OpenAPI document: the error answers each route lists, and the document FastAPI builds, corrected.

The generation, admin and LoRA routes read their bodies themselves (so that keys and limits are checked
first), so FastAPI never sees those bodies: their schemas are added here, and the 422 answers FastAPI
assumes are dropped (a validation error is a 400 here, an OpenAI error object).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .models import ErrorResponse

_MEANINGS = {
    400: "invalid request (bad parameter, unknown parameter, prompt longer than the context, over a request limit "
         "or budget)",
    401: "missing or wrong API key", 404: "no such model", 429: "the server's queue is full",
    413: "the request body is larger than the server accepts (--max-request-bytes)",
    415: "the request body is not declared 'Content-Type: application/json'",
    500: "the engine failed",
    503: "the fleet is stopped, the coordinator is unreachable or lost, or the server is shutting down (Retry-After "
         "says when to retry)",
}


def error_responses(codes: list[int]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entries of these error statuses, each an OpenAI error object."""
    return {code: {"model": ErrorResponse, "description": _MEANINGS[code]} for code in codes}


def openapi_builder(app: FastAPI, bodies: tuple[type[BaseModel], ...]) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: FastAPI's document, minus the 422 answers it assumes, plus the request ``bodies`` that
    the routes parse themselves; built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                                 description="OpenAI-compatible API. Every error is an OpenAI error object.")
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _, request_schemas = models_json_schema([(model, "validation") for model in bodies],
                                                    ref_template="#/components/schemas/{model}")
            components.update(request_schemas.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi

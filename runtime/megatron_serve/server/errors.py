"""Every failure answered in the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``.

OpenAI clients branch on the status code and show ``error.message`` to people, so each error here
names the offending parameter and says what would be accepted. FastAPI's own answers (422 for a
body that fails validation, 404/405 from routing) are converted too: bad input is a 400, as in
the OpenAI API, and no answer of this server has another shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .extensions import unknown_field_message

logger = logging.getLogger("megatron_serve.server")

INVALID_REQUEST = "invalid_request_error"

#: Status -> (error type, default code) for errors raised without an explicit type.
_DEFAULTS: dict[int, tuple[str, str | None]] = {
    400: (INVALID_REQUEST, "invalid_value"),
    401: (INVALID_REQUEST, "invalid_api_key"),
    404: (INVALID_REQUEST, "not_found"),
    405: (INVALID_REQUEST, "method_not_allowed"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable", "fleet_unavailable"),
}


class APIError(Exception):
    """An answer other than success; raise it anywhere below a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _DEFAULTS.get(status, ("server_error" if status >= 500 else INVALID_REQUEST,
                                                             None))
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code
        self.type = type or default_type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shutting_down() -> APIError:
    """What a request held or running when the server stops is answered (and new ones meanwhile)."""
    return APIError(503, "the server is shutting down; retry on another replica", code="server_shutting_down",
                    headers={"Retry-After": "5"})


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by this server", param=param,
                    code="unsupported_parameter")


def _param_path(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; the OpenAI way of naming a field."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    # Drop union-branch labels pydantic inserts ("str", "list[int]", "function-after[...]").
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and _is_union_label(part):
            continue
        else:
            path += ("." if path else "") + str(part)
    return path or None


_UNION_HINTS = {
    "prompt": "must be a non-empty string, a list of strings, a list of token ids, or a list of token id lists",
    "stop": "must be a non-empty string or a list of non-empty strings",
}


def _is_union_label(part: str) -> bool:
    """Field names are lower-case identifiers; pydantic's union-branch labels are not."""
    return not part.isidentifier() or part[0].isupper() or part in ("str", "int", "float", "bool", "list", "dict")


def validation_error(errors: Sequence[Any]) -> APIError:
    """The problem of a body that failed validation (pydantic's ``errors()``), as a 400 naming the field.

    Unknown fields come first (all of them are named): a client that sends a field this server
    does not know must learn that before anything else, since its answer would not do what it asked.
    """
    if not errors:
        return bad_request("invalid request body")
    unknown = [_param_path(e.get("loc", ())) or "?" for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        message, code = unknown_field_message(unknown[0])
        if len(unknown) > 1:
            message += f"; also unrecognized: {', '.join(unknown[1:])}"
        return bad_request(message, param=unknown[0], code=code)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request("the request body is not valid JSON (UTF-8 text without lone surrogates, nested at most "
                           f"a few hundred levels){': ' + str(detail) if detail else ''}", code="invalid_json")
    param = _param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return bad_request(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    if first.get("type") in ("model_type", "model_attributes_type", "dict_type") and param is None:
        return bad_request("the request body must be a JSON object", code="invalid_json")
    top = (param or "").split(".")[0].split("[")[0]
    if top in _UNION_HINTS and param != top or first.get("type") == "union_tag_invalid":
        # a value of a union field (prompt, stop) that fits none of its forms: say which are accepted
        return bad_request(f"{top}: {_UNION_HINTS.get(top, 'has an unexpected form')} ({param}: {message})", param=top)
    shown = first.get("input")
    try:
        shown_text = json.dumps(shown)[:80]
    except (TypeError, ValueError):
        shown_text = repr(shown)[:80]
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"{param or 'body'}: {message}, got {shown_text}{more}", param=param)


def http_error(exc: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own errors (404, 405 from routing) in this server's shape."""
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return APIError(exc.status_code, message, headers=dict(exc.headers or {}))


def unexpected_error(request: Request, exc: Exception) -> APIError:
    """A failure nothing below the route expected: logged with its traceback, answered as a 500."""
    logger.exception("unexpected error answering %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}"[:500])


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through :class:`APIError` so that all of them share one shape."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error(request, exc).response()

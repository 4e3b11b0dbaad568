"""The admin API: the fleet's lifecycle over HTTP, for RL frameworks that only speak HTTP.

``POST /v1/admin/{pause,unpause,suspend,resume,refit}`` run the coordinator's verbs and answer
once every engine acknowledged (the ``CONTROL_ACK``'s ``state`` and ``detail``, as JSON);
``GET /v1/admin/status`` is the coordinator's ``STATUS_REPLY``. They are the ``control`` command's
verbs with its rules: a verb the lifecycle table refuses in the current state is a 409 whose message
is the table's reason.

Access: every admin route answers 403 unless the server was given an admin key (``--admin-key``,
``--admin-key-file`` or ``$MEGATRON_SERVE_ADMIN_KEY``), 401 to a request that presents no key and 403 to
one that presents another (the API key included), as HTTP has it: 401 asks for credentials, 403 refuses
those given. The key goes as ``Authorization: Bearer KEY``. The admin key is not the API key, and the
server refuses to start with both equal: a key that lets a client generate must not let it pause the fleet, nor the other way
round. The key is checked before the body is read; bodies are strict like the rest of the front door
(an unknown field is a 400 naming it) and may be empty (every field has a default, except refit's
``source``).
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable, Literal, Protocol

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from ..client.coordinator_client import ControlError
from ..wire.connection import CoordinatorError
from ..errors import NoFleet
from ..wire.messages import StatusReply
from .errors import APIError, bad_request
from .fleet import FleetMonitor
from .intake import parse_body, request_body_doc
from .models import ErrorResponse

ADMIN_KEY_ENV = "MEGATRON_SERVE_ADMIN_KEY"


class LifecycleBackend(Protocol):
    """What the admin routes need of the backend (an ``InferenceClient``, or ``MegatronAsyncLLM.client``)."""

    async def pause(self, mode: str = ..., *, drain_timeout: float | None = ...) -> dict[str, Any]: ...

    async def unpause(self) -> dict[str, Any]: ...

    async def suspend(self, level: int = ..., *, keep_kv: bool = ...) -> dict[str, Any]: ...

    async def resume(self) -> dict[str, Any]: ...

    async def refit(self, source: str, epoch: int | None = ...) -> dict[str, Any]: ...

    async def status(self, timeout: float | None = ...) -> dict[str, Any]: ...


class _AdminBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PauseRequest(_AdminBody):
    mode: Literal["keep", "wait", "abort"] = Field(
        "keep", description="keep: requests pause in place; wait: running requests finish first (queued ones "
                            "wait); abort: unfinished requests end now with finish_reason abort and their tokens")
    drain_timeout: float | None = Field(None, ge=0, description="mode wait: seconds running requests may take "
                                                                "before the fleet pauses anyway (default 30)")


class SuspendRequest(_AdminBody):
    level: Literal[1, 2] = Field(1, description="1: release the KV cache; 2: also move the weights to host memory")
    keep_kv: bool = Field(False, description="copy the KV of the requests in flight to host memory first; RESUME "
                                             "copies it back and they continue without recomputing it")


class RefitRequest(_AdminBody):
    source: str = Field(min_length=1, description="model directory, as the engines see it, with weights of the "
                                                  "served model's shapes")
    epoch: int | None = Field(None, ge=0, description="generation recorded for the new weights (default: current + 1)")


class NoBody(_AdminBody):
    """UNPAUSE and RESUME take no arguments (an empty body or ``{}``)."""


class LifecycleAck(BaseModel):
    state: str = Field(description="the fleet's state once every engine acknowledged")
    detail: dict[str, Any] = Field(description="per-engine facts (engines), previous_state, noop, and what the "
                                               "verb did (mode, aborted, waited_s, released_bytes, epoch, ...)")


def _status_schema() -> dict[str, Any]:
    """The OpenAPI schema of ``STATUS_REPLY``, from its wire struct (one definition of its fields)."""
    _, components = msgspec.json.schema_components([StatusReply])
    return components["StatusReply"]


#: ControlError code -> (HTTP status, what the caller should know).
_REFUSALS: dict[str, int] = {"illegal_transition": 409, "refit_failed": 409, "invalid_request": 400,
                             "unsupported": 501, "lora_refused": 400, "lora_not_found": 404}


def _refusal(verb: str, exc: Exception) -> APIError:
    """The answer for a verb that did not complete."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ControlError):
        status = _REFUSALS.get(exc.code, 503)
        return APIError(status, f"{verb} refused: {exc}", code=exc.code, type="invalid_request_error"
                        if status < 500 else None)
    if isinstance(exc, NoFleet):
        return APIError(409, f"{verb} refused: {exc}", code="no_fleet", type="invalid_request_error")
    if isinstance(exc, ValueError):
        return bad_request(f"{verb}: {exc}")
    if isinstance(exc, CoordinatorError):
        return APIError(503, f"{verb}: the coordinator answered {exc.code}: {exc}", code=exc.code)
    if isinstance(exc, (ConnectionError, TimeoutError, RuntimeError)):
        return APIError(503, f"{verb}: no acknowledgement: {exc or type(exc).__name__}", code="coordinator_unreachable")
    raise exc


def _parse(model: type[_AdminBody], body: bytes) -> Any:
    return model() if not body.strip() else parse_body(model, body)


#: The admin request bodies, for ``/openapi.json`` (the routes read their bodies themselves).
ADMIN_BODIES = (PauseRequest, SuspendRequest, RefitRequest, NoBody)


def _pause(backend: LifecycleBackend, body: PauseRequest) -> Awaitable[dict[str, Any]]:
    if body.drain_timeout is not None and body.mode != "wait":
        raise bad_request(f"drain_timeout applies to mode wait only, not {body.mode}", param="drain_timeout")
    return backend.pause(body.mode, drain_timeout=body.drain_timeout)


_Call = Callable[[LifecycleBackend, Any], Awaitable[dict[str, Any]]]

#: The verbs: route, body, description, and the backend call.
_VERBS: list[tuple[str, type[_AdminBody], str, _Call]] = [
    ("pause", PauseRequest, "PAUSE the fleet; answered once every engine acknowledged. `mode` says what happens to "
                            "the requests it holds (keep, wait, abort).", _pause),
    ("unpause", NoBody, "UNPAUSE: the fleet runs again (also restarts a stopped fleet once its engines joined again).",
     lambda backend, _: backend.unpause()),
    ("suspend", SuspendRequest, "SUSPEND: release the KV cache (level 2: also the weights); pauses first when "
                                "running.", lambda backend, body: backend.suspend(body.level, keep_kv=body.keep_kv)),
    ("resume", NoBody, "RESUME: device memory is restored; the fleet is then PAUSED (unpause to run).",
     lambda backend, _: backend.resume()),
    ("refit", RefitRequest, "REFIT from a model directory (the fleet must be PAUSED or SUSPENDED): every engine "
                            "verifies the weights before any loads them.",
     lambda backend, body: backend.refit(body.source, body.epoch)),
]


def admin_guard(admin_key: str | None) -> list[Any]:
    """The dependency every admin route has: the admin key, as ``Authorization: Bearer KEY`` (401 when none is
    presented, 403 when another is or the admin API is off)."""
    bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                        description="the server's admin key (not the API key), as `Authorization: Bearer KEY`")
    expected = admin_key.encode() if admin_key else None

    async def require_admin_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if expected is None:
            raise APIError(403, "the admin API is off: start the server with --admin-key-file (or $"
                                f"{ADMIN_KEY_ENV}) to use it", code="admin_disabled", type="permission_error")
        offered = credentials.credentials.encode() if credentials is not None else b""
        if not offered:
            raise APIError(401, "the admin API needs the admin key as 'Authorization: Bearer KEY' (the API key "
                                "does not open it)", code="admin_key_required", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(offered, expected):
            raise APIError(403, "wrong admin key (the API key does not open the admin API)",
                           code="invalid_admin_key", type="permission_error")

    return [Depends(require_admin_key)]


async def run_verb(monitor: FleetMonitor, verb: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run one verb for an admin route: 503 at once when the coordinator is unreachable, the refusal's answer
    (:func:`_refusal`) when it does not complete; the monitor is refreshed after (``/ready``, ``/metrics`` and
    ``/v1/models`` show what it did at once)."""
    if not monitor.reachable:
        await monitor.refresh()
    if not monitor.reachable:  # at once, instead of a verb queued until the coordinator is back
        raise APIError(503, f"{verb}: {monitor.refusal_reason()}", code="coordinator_unreachable",
                       headers={"Retry-After": "5"})
    try:
        ack = await call()
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP answer
        raise _refusal(verb, exc) from None
    await monitor.refresh()
    return ack


def add_admin_routes(app: FastAPI, backend: LifecycleBackend, monitor: FleetMonitor, admin_key: str | None) -> None:
    """``/v1/admin/*`` on ``app`` (see the module docstring)."""
    guard = admin_guard(admin_key)
    responses: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse, "description": "a bad or unknown field in the body"},
        401: {"model": ErrorResponse, "description": "no admin key presented"},
        403: {"model": ErrorResponse, "description": "a wrong admin key (the API key included), or no admin key "
                                                     "configured"},
        409: {"model": ErrorResponse, "description": "the lifecycle refuses this verb in the fleet's state (the "
                                                     "message says why and what to do), or the engines refused "
                                                     "the new weights"},
        503: {"model": ErrorResponse, "description": "the coordinator is unreachable or did not acknowledge"},
    }
    pause_responses = {**responses, 501: {"model": ErrorResponse, "description": "the coordinator is older than "
                                                                                 "pause modes (protocol 2)"}}

    async def run(verb: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> LifecycleAck:
        ack = await run_verb(monitor, verb, call)
        return LifecycleAck(state=str(ack.get("state")), detail=dict(ack.get("detail") or {}))

    def add_verb(verb: str, model: type[_AdminBody], description: str, call: _Call) -> None:
        async def answer(request: Request) -> LifecycleAck:
            body = _parse(model, await request.body())
            return await run(verb, lambda: call(backend, body))

        app.post(f"/v1/admin/{verb}", response_model=LifecycleAck, dependencies=guard, tags=["admin"],
                 responses=pause_responses if verb == "pause" else responses,
                 openapi_extra=request_body_doc(model, required=model is RefitRequest),
                 summary=verb.capitalize(), name=f"admin_{verb}", description=description)(answer)

    for verb, model, description, call in _VERBS:
        add_verb(verb, model, description, call)

    @app.get("/v1/admin/status", dependencies=guard, tags=["admin"], response_class=JSONResponse,
             responses={200: {"description": "the coordinator's STATUS_REPLY",
                              "content": {"application/json": {"schema": _status_schema()}}},
                        401: responses[401], 403: responses[403], 503: responses[503]},
             description="The coordinator's STATUS_REPLY: state, engines, queued, in_flight, completed, failed, "
                         "aborted, epoch, ...")
    async def status() -> JSONResponse:
        try:
            return JSONResponse(await backend.status())
        except Exception as exc:  # noqa: BLE001
            raise _refusal("status", exc) from None

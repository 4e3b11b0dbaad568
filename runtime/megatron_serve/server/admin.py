"""The admin API: the fleet's lifecycle over HTTP, for RL frameworks that only speak HTTP.

``POST /v1/admin/{verb}`` (the verbs the verb table, :mod:`megatron_serve.wire.verb_calls`, offers over HTTP:
pause, unpause, suspend, resume, refit; their bodies are its arguments) run the coordinator's verbs and answer
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
from typing import Any, Awaitable, Callable, Literal

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, create_model

from ..wire.connection import ControlError, CoordinatorError
from ..errors import NoFleet
from ..wire.status import StatusReply
from ..wire.verb_calls import HTTP, VERB_CALLS, Arg, ArgumentError, VerbCall
from .api_key import presented_key
from .errors import APIError, bad_request
from .backend import Backend
from .fleet import FleetMonitor
from .intake import parse_body, request_body_doc
from .models import ErrorResponse

ADMIN_KEY_ENV = "MEGATRON_SERVE_ADMIN_KEY"


class _AdminBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class NoBody(_AdminBody):
    """UNPAUSE and RESUME take no arguments (an empty body or ``{}``)."""


def _field(arg: Arg) -> tuple[Any, Any]:
    """One body field of a verb's argument: its type (a ``Literal`` of its choices), default and checks."""
    kind: Any = Literal[arg.choices] if arg.choices is not None else arg.kind  # type: ignore[valid-type]
    if arg.required:
        return kind, Field(description=arg.help, min_length=1 if arg.kind is str else None)
    return kind if arg.default is not None else kind | None, Field(arg.default, description=arg.help, ge=arg.minimum)


def _body(call: VerbCall) -> type[_AdminBody]:
    """The request body of ``POST /v1/admin/{verb}``, made from the verb table's arguments (``PauseRequest``, ...)."""
    args = call.on(HTTP)
    if not args:
        return NoBody
    fields = {arg.name: _field(arg) for arg in args}
    model: type[_AdminBody] = create_model(f"{call.verb.name.title()}Request", __base__=_AdminBody,
                                           **fields)  # type: ignore[call-overload]
    return model


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
    if isinstance(exc, ArgumentError):  # the verb table refused an argument: the message names it
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, ValueError):
        return bad_request(f"{verb}: {exc}")
    if isinstance(exc, CoordinatorError):
        return APIError(503, f"{verb}: the coordinator answered {exc.code}: {exc}", code=exc.code)
    if isinstance(exc, (ConnectionError, TimeoutError, RuntimeError)):
        return APIError(503, f"{verb}: no acknowledgement: {exc or type(exc).__name__}", code="coordinator_unreachable")
    raise exc


def _parse(model: type[_AdminBody], body: bytes) -> Any:
    return model() if not body.strip() else parse_body(model, body)


#: The verbs with a route, from the verb table, each with its body.
_VERBS: list[tuple[VerbCall, type[_AdminBody]]] = [(call, _body(call)) for call in VERB_CALLS.values() if call.http]

#: The admin request bodies, for ``/openapi.json`` (the routes read their bodies themselves).
ADMIN_BODIES = tuple(dict.fromkeys(body for _, body in _VERBS))


def admin_guard(admin_key: str | None) -> list[Any]:
    """The dependency every admin route has: the admin key, as ``Authorization: Bearer KEY`` (401 when none is
    presented, 403 when another is or the admin API is off)."""
    bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                        description="the server's admin key (not the API key), as `Authorization: Bearer KEY`")
    expected = admin_key.encode() if admin_key else None

    async def require_admin_key(request: Request,
                                credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if expected is None:
            raise APIError(403, "the admin API is off: start the server with --admin-key-file (or $"
                                f"{ADMIN_KEY_ENV}) to use it", code="admin_disabled", type="permission_error")
        offered = presented_key(request, credentials)  # Bearer, or Basic with the key as password (~/.netrc)
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


def _with_older_coordinator(responses: dict[int | str, dict[str, Any]], call: VerbCall
                             ) -> dict[int | str, dict[str, Any]]:
    older = "; ".join(f"{arg.since[1]} (protocol {arg.since[0] - 1})" for arg in call.args if arg.since is not None)
    return {**responses, 501: {"model": ErrorResponse, "description": f"the coordinator is older than {older}"}}


def add_admin_routes(app: FastAPI, backend: Backend, monitor: FleetMonitor, admin_key: str | None) -> None:
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

    async def run(verb: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> LifecycleAck:
        ack = await run_verb(monitor, verb, call)
        return LifecycleAck(state=str(ack.get("state")), detail=dict(ack.get("detail") or {}))

    def add_verb(call: VerbCall, model: type[_AdminBody]) -> None:
        verb = call.verb.value

        async def answer(request: Request) -> LifecycleAck:
            body = _parse(model, await request.body())
            return await run(verb, lambda: backend.control(call.verb, **body.model_dump()))

        newer = any(arg.since is not None for arg in call.args)  # an older coordinator refuses such a value: 501
        app.post(f"/v1/admin/{verb}", response_model=LifecycleAck, dependencies=guard, tags=["admin"],
                 responses=_with_older_coordinator(responses, call) if newer else responses,
                 openapi_extra=request_body_doc(model, required=any(arg.required for arg in call.on(HTTP))),
                 summary=verb.capitalize(), name=f"admin_{verb}", description=call.summary + ".")(answer)

    for call, model in _VERBS:
        add_verb(call, model)

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

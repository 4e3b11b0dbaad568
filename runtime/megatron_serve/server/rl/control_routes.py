"""Every framework's control routes on one server, over one :class:`~.control.Control`.

Which key each asks for: the routes that change what every client is served (pause, sleep, abort, caches, memory)
need the admin key, as ``/v1/admin/*``; the ones that only describe the served model and fleet
(``/server_info``, ``/get_world_size``, ``/is_paused``, ...) the API key, as ``/v1/models``; the frameworks' probes
(``/health/``, ``/liveness``, ``/health_generate``) none, as ``/health``: a prober carries no credentials.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ..admin import admin_guard
from ..context import ServerContext
from .areal_control import AREAL_CONTROL_PATHS, add_areal_control_routes
from .control import Control
from .liveness import add_liveness_route
from .server_info import add_server_info_routes
from .session_routes import add_session_routes
from .sglang_loads import add_loads_route
from .sglang_control import SGLANG_CONTROL_BODIES, SGLANG_CONTROL_PATHS, add_sglang_control_routes
from .trl_control import TRL_CONTROL_PATHS, add_trl_control_routes
from .vllm_control import VLLM_CONTROL_PATHS, VllmAbortRequests, VllmResetPrefixCache, add_vllm_control_routes

#: The control routes that need the admin key.
CONTROL_ADMIN_PATHS: frozenset[str] = (VLLM_CONTROL_PATHS | SGLANG_CONTROL_PATHS | TRL_CONTROL_PATHS
                                         | AREAL_CONTROL_PATHS)

#: The bodies the control routes read themselves, for the OpenAPI document.
CONTROL_BODIES = (VllmAbortRequests, VllmResetPrefixCache, *SGLANG_CONTROL_BODIES)


def add_control_routes(app: FastAPI, ctx: ServerContext, admin_key: str | None, api_guard: Any) -> None:
    """The control routes on ``app`` (``api_guard``: the API key's guard)."""
    control = Control(ctx)
    admin = admin_guard(admin_key)
    add_vllm_control_routes(app, control, admin, api_guard)
    add_sglang_control_routes(app, control, admin)
    add_trl_control_routes(app, control, admin, api_guard)
    add_server_info_routes(app, ctx, control, api_guard)
    add_liveness_route(app, ctx)
    add_areal_control_routes(app, control, admin)
    add_session_routes(app, api_guard)
    add_loads_route(app, ctx, control, api_guard)

"""The RL frameworks' own HTTP APIs, so that TRL, SkyRL, prime-rl, AReaL, slime and miles drive a fleet unchanged.

Each framework calls the routes of the server it was written for: vLLM's RL and control routes (TRL >= 1.11,
SkyRL, prime-rl, AReaL), SGLang's native API (slime, miles, AReaL), TRL's own ``trl vllm-serve`` protocol
(TRL <= 1.10). Every route here is a translation onto what the fleet already does (the lifecycle verbs, the
REFIT transaction, the generation path): one module per concern, each with its own paths.

Access: the control and weight routes change what every client of the fleet is served, so they need the admin
key (vLLM mounts them only in its dev mode, unguarded); the generation routes need the API key like ``/v1/*``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ..context import ServerContext
from .control_routes import CONTROL_ADMIN_PATHS, add_control_routes
from .weight_routes import WEIGHT_ADMIN_PATHS, add_weight_routes

#: Routes of this package that need the admin key (each module adds its own).
RL_ADMIN_PATHS: frozenset[str] = CONTROL_ADMIN_PATHS | WEIGHT_ADMIN_PATHS


def add_rl_routes(app: FastAPI, ctx: ServerContext, admin_key: str | None, api_guard: Any) -> None:
    """Every RL framework's routes on ``app``; ``api_guard``: the API key's guard (see :func:`..api_key.api_key_guard`)."""
    add_control_routes(app, ctx, admin_key, api_guard)
    add_weight_routes(app, ctx, admin_key)

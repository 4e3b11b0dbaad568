"""Every framework's weight-update routes on one server, over one :class:`~.weight_updates.WeightUpdates`.

One state for all of them: a trainer's group, staged tensors and the checksums of what went through belong to the
server, whichever API a framework speaks, and one lock keeps two updates from interleaving.
"""

from __future__ import annotations

from fastapi import FastAPI

from ..context import ServerContext
from .weight_primerl import PRIMERL_WEIGHT_PATHS, PrimeRL, add_primerl_weight_routes
from .weight_skyrl import SKYRL_WEIGHT_PATHS, add_skyrl_weight_routes
from .weight_sglang import SGLANG_WEIGHT_PATHS, add_sglang_weight_routes
from .weight_trl import TRL_WEIGHT_PATHS, add_trl_weight_routes
from .weight_updates import WeightUpdates
from .weight_vllm import VLLM_WEIGHT_PATHS, add_vllm_weight_routes

#: The weight routes: all of them need the admin key.
WEIGHT_ADMIN_PATHS: frozenset[str] = (VLLM_WEIGHT_PATHS | PRIMERL_WEIGHT_PATHS | SGLANG_WEIGHT_PATHS
                                        | TRL_WEIGHT_PATHS | SKYRL_WEIGHT_PATHS)


def add_weight_routes(app: FastAPI, ctx: ServerContext, admin_key: str | None) -> None:
    """The weight routes on ``app``, guarded by the admin key, their verbs run as the admin API runs its own."""
    from ..admin import admin_guard, run_verb  # noqa: PLC0415 - the coordinator client's import chain, once

    updates = WeightUpdates(ctx.backend, ctx.options.weight_transfer_backend,
                            lambda verb, call: run_verb(ctx.monitor, verb, call))
    guard = admin_guard(admin_key)
    primerl = PrimeRL(updates)
    add_vllm_weight_routes(app, updates, primerl, guard)
    add_primerl_weight_routes(app, primerl, guard)
    add_sglang_weight_routes(app, updates, guard)
    add_trl_weight_routes(app, updates, guard)
    add_skyrl_weight_routes(app, updates, guard)

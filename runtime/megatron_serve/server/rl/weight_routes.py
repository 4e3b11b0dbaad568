"""Every framework's weight-update routes on one server, over one :class:`~.weight_updates.WeightUpdates`.

One state for all of them: a trainer's group, staged tensors and the checksums of what went through belong to the
server, whichever API a framework speaks, and one operation at a time keeps two updates from interleaving (a
second is answered 409 at once: :mod:`.weight_slot`). ``POST /abort_weight_update`` (this project's) ends the
operation or started update under way, whichever framework's it is: its route answers 503, the group is left,
nothing staged is loaded; a REFIT already loading is not ended (409: the fleet's transaction finishes it).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from ..context import ServerContext
from .responses import WEIGHT_RESPONSES
from .weight_areal import AREAL_WEIGHT_PATHS, add_areal_weight_routes
from .weight_primerl import PRIMERL_WEIGHT_PATHS, PrimeRL, add_primerl_weight_routes
from .weight_skyrl import SKYRL_WEIGHT_PATHS, add_skyrl_weight_routes
from .weight_sglang import SGLANG_WEIGHT_PATHS, add_sglang_weight_routes
from .weight_trl import TRL_WEIGHT_PATHS, add_trl_weight_routes
from .weight_updates import WeightUpdates
from .weight_vllm import VLLM_WEIGHT_PATHS, add_vllm_weight_routes

logger = logging.getLogger("megatron_serve.server")

#: The weight routes: all of them need the admin key.
WEIGHT_ADMIN_PATHS: frozenset[str] = (VLLM_WEIGHT_PATHS | PRIMERL_WEIGHT_PATHS | SGLANG_WEIGHT_PATHS
                                        | TRL_WEIGHT_PATHS | SKYRL_WEIGHT_PATHS | AREAL_WEIGHT_PATHS
                                        | {"/abort_weight_update"})


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
    add_areal_weight_routes(app, updates, guard)

    @app.post("/abort_weight_update", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["RL frameworks"],
              summary="End the weight update under way",
              description="Ends the weight operation or started update under way (a stalled trainer's): its call "
                          "answers 503, the trainer's group is left, nothing it staged is loaded. `aborted`: whether "
                          "there was one. A REFIT already loading into the fleet is not ended (409).")
    async def abort_weight_update() -> dict[str, bool]:
        op = updates.slot.current
        if op is not None and not op.preemptible:
            raise updates.slot.busy()
        aborted = updates.end("aborted by POST /abort_weight_update")
        if aborted:
            logger.warning("weight update aborted (POST /abort_weight_update)")
        return {"aborted": aborted}

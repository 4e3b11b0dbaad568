"""prime-rl's weight routes (its ``inference`` server, ``src/prime_rl/inference/vllm/server.py``).

prime-rl's orchestrator posts ``POST /update_weights {"weight_dir": DIR}`` once the trainer wrote a checkpoint
there: here that is the REFIT of the directory (every engine verifies it before any loads; the next epoch). The
path is vLLM's ``/update_weights`` too, whose route (:mod:`.weight_vllm`) hands a body with only ``weight_dir``
here. ``POST /init_broadcaster`` sets up prime-rl's own NCCL broadcast, whose wire format (its sender's metadata
and chunking) is prime-rl's: it is refused by name, so that a run uses the checkpoint directory.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ..errors import APIError
from .weight_updates import Body, WeightUpdates
from .responses import WEIGHT_RESPONSES

PRIMERL_WEIGHT_PATHS = frozenset({"/init_broadcaster"})


class WeightDirRequest(Body):
    weight_dir: str


async def update_from_directory(updates: WeightUpdates, body: WeightDirRequest) -> dict[str, Any]:
    """prime-rl's ``/update_weights``: the REFIT of ``weight_dir`` (as the engines see it), the next epoch."""
    async with updates.lock:
        await updates.refit_directory(body.weight_dir, None)
    return {"status": "ok"}


def add_primerl_weight_routes(app: FastAPI, guard: list[Any]) -> None:
    """prime-rl's ``/init_broadcaster`` (refused by name); its ``/update_weights`` is served by vLLM's route."""

    @app.post("/init_broadcaster", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["prime-rl"])
    async def init_broadcaster() -> None:
        raise APIError(501, "prime-rl's NCCL broadcaster is not served here: its wire format is prime-rl's own. "
                            "Let the trainer write checkpoints and post /update_weights {\"weight_dir\": DIR} "
                            "(prime-rl's filesystem weight broadcast), or use vLLM's weight-transfer routes",
                       code="unsupported")

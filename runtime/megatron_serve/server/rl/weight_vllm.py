"""vLLM's weight-transfer routes (``vllm/entrypoints/serve/dev/rlhf/api_router.py``), as the REFIT transaction.

A trainer (TRL >= 1.11, SkyRL, prime-rl, AReaL through vLLM's API) calls, in order:

* ``POST /init_weight_transfer_engine {init_info: {master_address, master_port, rank_offset, world_size, packed?}}``:
  this server joins the trainer's group (the trainer is rank 0 and serves the store; this server takes the ranks
  from ``rank_offset``), answering once the trainer joined too;
* ``POST /start_weight_update {is_checkpoint_format?}``: an update begins (nothing staged);
* ``POST /update_weights {update_info: {names, dtype_names, shapes, packed?}}``: the trainer broadcasts those
  tensors now (packed or one by one, in the order of ``names``); they are received into host memory and staged;
* ``POST /finish_weight_update {weight_version?}``: the commit point, one REFIT of every staged tensor (all or
  nothing, verified by every engine first), under epoch ``weight_version`` (default: the next one).

``update_weights`` without ``start_weight_update`` (vLLM before 0.19) is its own commit point; ``finish_weight_update``
with no update started changes nothing and answers 200, as vLLM's (TRL's async trainer sends one after a failed
transfer). A weight version must be above the one served (:mod:`.weight_updates`). ``GET /weight_info``
says the version served (the fleet's epoch); ``POST /update_weight_version {new_version}`` only confirms it,
since a version here is the epoch stamped on tokens, which changes with the weights only; ``POST /weight_checker``
(``checksum``, ``compare``) reads the checksums of what the fleet loaded through this server. The same
``/update_weights`` path also takes prime-rl's ``{weight_dir}`` (:mod:`.weight_primerl`), told apart by its keys.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...weights.framework_groups import PACKED_BUFFER_BYTES, Layout, announced
from ..errors import APIError, bad_request
from ..intake import parse_body
from .weight_primerl import PrimeRL, WeightDirRequest
from .weight_updates import Body, WeightUpdates, body_keys, epoch_of, read
from .responses import WEIGHT_RESPONSES

VLLM_WEIGHT_PATHS = frozenset({"/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                               "/finish_weight_update", "/update_weight_version", "/weight_info", "/weight_checker"})


class InitInfo(Body):
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    packed: bool = False  # vLLM >= 0.28 says it here, earlier ones in each update_info
    packed_buffer_size_bytes: int = PACKED_BUFFER_BYTES
    packed_num_buffers: int = 2  # how many the trainer keeps in flight: nothing for the receiver to do


class InitRequest(Body):
    init_info: InitInfo


class StartRequest(Body):
    is_checkpoint_format: bool = True
    include_draft: bool = False


class UpdateInfo(Body):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int = 2


class UpdateRequest(Body):
    update_info: UpdateInfo


class FinishRequest(Body):
    weight_version: str | int | None = None


class VersionRequest(Body):
    new_version: str | int


class CheckerRequest(Body):
    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None


def add_vllm_weight_routes(app: FastAPI, updates: WeightUpdates, primerl: PrimeRL, guard: list[Any]) -> None:
    """vLLM's weight routes on ``app`` (the admin key's ``guard``), prime-rl's ``{weight_dir}`` bodies to ``primerl``;
    see the module docstring."""
    @app.post("/init_weight_transfer_engine", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def init_weight_transfer_engine(request: Request) -> dict[str, str]:
        info = (await read(request, InitRequest)).init_info
        backend = updates.backend_for(None)
        try:
            layout = Layout.trainer_first(info.master_address, info.master_port, info.rank_offset, info.world_size,
                                          backend)
        except ValueError as exc:
            raise bad_request(str(exc), param="init_info") from None
        await updates.open(layout)
        updates.packing = (info.packed, info.packed_buffer_size_bytes)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def start_weight_update(request: Request) -> dict[str, str]:
        body = await read(request, StartRequest)
        if not body.is_checkpoint_format:
            raise bad_request("is_checkpoint_format false: this server takes the checkpoint's (Hugging Face) names "
                              "and shapes only, which the fleet's REFIT maps onto each engine's layout",
                              param="is_checkpoint_format")
        if body.include_draft:
            raise bad_request("include_draft: send the drafter's tensors with 'drafter.' in front of their names, in "
                              "the same update", param="include_draft")
        await updates.start()
        return {"message": "Weight update started"}

    @app.post("/update_weights", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm", "prime-rl"])
    async def update_weights(request: Request) -> dict[str, Any]:
        raw = await request.body()
        keys = body_keys(raw)
        if keys == {"weight_dir"}:
            return await primerl.update_weights(parse_body(WeightDirRequest, raw))
        if "update_info" not in keys:
            raise bad_request("POST /update_weights takes vLLM's {\"update_info\": {\"names\", \"dtype_names\", "
                              "\"shapes\", \"packed\"}} or prime-rl's {\"weight_dir\": DIR}; got keys "
                              f"{sorted(keys)}", code="invalid_request")
        await receive_update(updates, (await read(request, UpdateRequest)).update_info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        epoch = epoch_of((await read(request, FinishRequest)).weight_version)
        served = await updates.finish(epoch)
        return {"message": "Weight update finished", "weight_version": str(served)}

    @app.post("/update_weight_version", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def update_weight_version(request: Request) -> dict[str, Any]:
        wanted = epoch_of((await read(request, VersionRequest)).new_version)
        served = await updates.epoch()
        if wanted != served:
            raise APIError(409, f"the fleet serves epoch {served}: a weight version here is the epoch stamped on every "
                                "token, which changes only with the weights; send it as finish_weight_update's "
                                "weight_version", code="weight_version_is_epoch", type="invalid_request_error")
        return {"success": True, "new_version": str(served)}

    @app.get("/weight_info", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def weight_info() -> dict[str, str]:
        return {"weight_version": str(await updates.epoch())}

    _add_checker(app, updates, guard)


async def receive_update(updates: WeightUpdates, info: UpdateInfo) -> None:
    """One ``update_info``'s broadcast, received: staged in a started update, else committed (vLLM before 0.19). A
    refusal ends the started update (what it staged is dropped): the trainer's next init is not held behind it."""
    try:
        try:
            metas = announced(info.names, info.dtype_names, info.shapes)
        except ValueError as exc:
            raise bad_request(str(exc), param="update_info") from None
        packed = updates.packing[0] if info.packed is None else info.packed
        buffer = info.packed_buffer_size_bytes or updates.packing[1]
        async with updates.hold(f"receiving {len(metas)} tensors"):
            tensors = await updates.receive(metas, bool(packed), int(buffer))
            if updates.staged is None:  # no start_weight_update: this call is the commit point
                await updates.refit_tensors(tensors, None)
            else:
                updates.stage(tensors)
    except APIError as exc:
        if exc.code not in ("weight_update_in_progress", "weight_transfer_ended"):  # (those end nothing of this update)
            updates.refused(exc)
        raise


def _add_checker(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """vLLM's ``/weight_checker``: ``checksum`` and ``compare`` over what the fleet loaded through this server."""

    @app.post("/weight_checker", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["vllm"])
    async def weight_checker(request: Request) -> JSONResponse:
        body = await read(request, CheckerRequest)
        if body.action == "reset":
            raise bad_request("action 'reset' is refused: it would have the fleet serve zeroed weights outside the "
                              "REFIT transaction; every update here is verified by every engine and loaded all or "
                              "nothing, and 'checksum' after it says what was loaded", param="action")
        if body.action == "compare" and body.baseline is None:
            raise bad_request("action 'compare' needs a 'baseline' object", param="baseline")
        checksums = await updates.checksums()
        if body.action == "checksum":
            return JSONResponse({"checksums": checksums})
        baseline = body.baseline or {}
        mismatches = sorted(key for key in checksums.keys() | baseline.keys() if checksums.get(key) != baseline.get(key))
        return JSONResponse({"match": not mismatches, "mismatches": mismatches})

"""SGLang's weight routes (``python/sglang/srt/entrypoints/http_server.py``), as the REFIT transaction.

slime, miles and AReaL drive pre-launched SGLang servers through these:

* ``POST /update_weights_from_disk {model_path, weight_version?, abort_all_requests?, keep_pause?, ...}``: the REFIT
  of that directory (as the engines see it);
* ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}``:
  this server joins the trainer's group as SGLang's ``init_custom_process_group`` builds it (the trainer is rank 0
  and serves the store; the group's keys under ``group_name``);
* ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version?, ...}``: the trainer
  broadcasts those tensors one by one, in that order; received into host memory, they are one REFIT (SGLang's
  commit point is this call);
* ``POST /destroy_weights_update_group {group_name}``: the group is left;
* ``POST /weights_checker {action}``: ``snapshot`` keeps the checksums of what the fleet loaded through this
  server, ``compare`` says whether it still serves them;
* ``POST /update_weights_from_tensor``: CUDA IPC handles, which only a trainer on the engines' own GPUs can make;
  refused by name.

Answers are SGLang's (``success``, ``message``; ``num_paused_requests`` from disk). ``abort_all_requests`` pauses
the fleet in ``abort`` mode for the update (else ``keep``); ``keep_pause`` leaves it paused. A weight version is
the epoch (an integer). ``flush_cache``, ``is_async``, ``torch_empty_cache``, ``recapture_cuda_graph``,
``token_step`` and ``manifest`` are taken and change nothing: the REFIT decides what cached KV stays, and answers
once every engine loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request

from ...weights.framework_groups import Layout, announced, sglang_prefixes
from ...wire.lifecycle import PauseMode
from ..errors import APIError, bad_request
from .weight_updates import Body, WeightUpdates, epoch_of, read
from .responses import WEIGHT_RESPONSES

SGLANG_WEIGHT_PATHS = frozenset({"/update_weights_from_disk", "/init_weights_update_group",
                                 "/update_weights_from_distributed", "/destroy_weights_update_group",
                                 "/update_weights_from_tensor", "/weights_checker"})
DEFAULT_GROUP = "weight_update_group"


class _Update(Body):
    """The fields every SGLang weight update carries."""

    weight_version: str | int | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False
    load_format: str | None = None

    def pause(self) -> PauseMode:
        return PauseMode.ABORT if self.abort_all_requests else PauseMode.KEEP


class DiskRequest(_Update):
    model_path: str
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None


class GroupRequest(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DistributedRequest(_Update):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP


class DestroyRequest(Body):
    group_name: str = DEFAULT_GROUP


class CheckRequest(Body):
    action: Literal["snapshot", "compare", "reset_tensors", "checksum"] = "checksum"
    allow_quant_error: bool = False


def add_sglang_weight_routes(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """SGLang's weight routes on ``app`` (the admin key's ``guard``); see the module docstring."""
    groups: set[str] = set()  # the name of the group this server joined

    @app.post("/update_weights_from_disk", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        body = await read(request, DiskRequest)
        if body.load_format not in (None, "auto", "safetensors"):
            raise bad_request(f"load_format {body.load_format!r}: the engines read the directory's safetensors "
                              "(load_format unset, auto or safetensors)", param="load_format")
        epoch = epoch_of(body.weight_version)
        async with updates.hold(f"reading the directory {body.model_path}"):
            ack = await updates.refit_directory(body.model_path, epoch, pause=body.pause(), keep_paused=body.keep_pause)
        return {"success": True, "message": f"Succeeded to update model weights (epoch {ack['detail']['epoch']}).",
                "num_paused_requests": 0}

    @app.post("/init_weights_update_group", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def init_weights_update_group(request: Request) -> dict[str, Any]:
        body = await read(request, GroupRequest)
        backend = updates.backend_for(body.backend)
        try:
            layout = Layout.trainer_first(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                          backend, sglang_prefixes(body.group_name, backend))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await updates.open(layout)
        groups.clear()
        groups.add(body.group_name)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
        body = await read(request, DistributedRequest)
        if body.load_format is not None:
            raise bad_request(f"load_format {body.load_format!r}: this server takes the tensors one by one in the "
                              "order of names (load_format unset)", param="load_format")
        _known(groups, body.group_name)
        epoch = epoch_of(body.weight_version)
        try:
            metas = announced(body.names, body.dtypes, body.shapes)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        async with updates.hold(f"receiving {len(metas)} tensors"):
            tensors = await updates.receive(metas, packed=False)
            ack = await updates.refit_tensors(tensors, epoch, pause=body.pause())
        return {"success": True, "message": f"Succeeded to update parameter online (epoch {ack['detail']['epoch']})."}

    @app.post("/destroy_weights_update_group", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
        body = await read(request, DestroyRequest)
        _known(groups, body.group_name)
        async with updates.hold("leaving the trainer's group"):
            await updates.close()
            groups.clear()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/update_weights_from_tensor", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def update_weights_from_tensor() -> None:
        raise bad_request("update_weights_from_tensor is refused: it carries CUDA IPC handles, which only a trainer "
                          "on the engines' own GPUs can make, and the trainer is not on this fleet's machines; "
                          "use /init_weights_update_group and /update_weights_from_distributed",
                          code="unsupported")

    _add_checker(app, updates, guard)


def _add_checker(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """SGLang's ``/weights_checker``: ``snapshot`` then ``compare`` over what the fleet loaded through this server."""
    snapshot: dict[str, dict[str, str]] = {}  # under "weights"

    @app.post("/weights_checker", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["sglang"])
    async def weights_checker(request: Request) -> dict[str, Any]:
        body = await read(request, CheckRequest)
        if body.action == "reset_tensors":
            raise bad_request("action 'reset_tensors' is refused: it would have the fleet serve random weights "
                              "outside the REFIT transaction; 'snapshot' then 'compare' after an update says whether "
                              "the fleet loaded those weights", param="action")
        checksums = await updates.checksums()
        if body.action in ("snapshot", "checksum"):
            snapshot["weights"] = checksums
            return {"success": True, "message": f"Snapshot of {len(checksums)} tensors taken."}
        if "weights" not in snapshot:
            raise APIError(409, "no snapshot: post {\"action\": \"snapshot\"} first", code="no_snapshot",
                           type="invalid_request_error")
        differ = sorted(name for name in checksums.keys() | snapshot["weights"].keys()
                        if checksums.get(name) != snapshot["weights"].get(name))
        if differ:
            raise bad_request(f"{len(differ)} tensor(s) differ from the snapshot: {', '.join(differ[:20])}",
                              code="weights_differ")
        return {"success": True, "message": f"All {len(checksums)} tensors equal the snapshot."}


def _known(groups: set[str], name: str) -> None:
    if name not in groups:
        raise APIError(409, f"no weight update group {name!r}: /init_weights_update_group first",
                       code="no_weight_transfer", type="invalid_request_error")

"""TRL's own weight protocol (``trl vllm-serve``, TRL <= 1.10: ``trl/scripts/vllm_serve.py``), as REFITs.

TRL's ``VLLMClient`` (``trl/generation/vllm_client.py``) calls:

* ``POST /init_communicator/ {host, port, world_size, client_device_uuid}``: the server's ranks make a group with the
  client, server rank 0 serving the store at ``host:port``, the client the last rank (``world_size - 1``). TRL's
  server answers at once and joins in the background, since the client joins only after the answer; so does this
  one (it takes ranks 0 to ``world_size - 2``, the store's keys under ``client2server`` as TRL's XPU path has them);
* ``POST /update_named_param/ {name, dtype, shape}`` for each parameter, answered at once, after which the client
  broadcasts that one tensor and waits on a barrier of the group;
* ``POST /close_communicator/``: the group is left.

TRL's protocol has no commit point: its server loads each parameter the moment it arrives. Here each parameter is a
REFIT of its own, in the background after the answer: one tensor, verified by every engine and loaded all or
nothing, under the next epoch (so a model of N parameters advances the epoch by N; the last is the version its
tokens carry). A parameter the engines refuse (a name the model lacks, a wrong shape) leaves them on their weights;
the refusal is the answer to the client's next call (the next ``/update_named_param/`` or ``/close_communicator/``,
409), since TRL never waits for one. A dtype that cannot travel is refused at once (400), before the broadcast.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from ...weights.framework_groups import Layout, announced
from ..errors import APIError, bad_request
from .weight_updates import Body, WeightUpdates, read
from .responses import WEIGHT_RESPONSES

TRL_WEIGHT_PATHS = frozenset({"/init_communicator/", "/update_named_param/", "/close_communicator/"})


class CommunicatorRequest(Body):
    host: str
    port: int
    world_size: int
    client_device_uuid: str | None = None


class NamedParamRequest(Body):
    name: str
    dtype: str
    shape: list[int]


class Background:
    """The weight work TRL does not wait for, one at a time; its failure is the answer to the client's next call."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None

    async def settle(self) -> None:
        """Wait for the work started last; its failure as a 409 (once)."""
        task, self.task = self.task, None
        if task is None:
            return
        try:
            await task
        except APIError as exc:
            raise APIError(409, f"the previous weight call failed: {exc.message}", code=exc.code or "refit_failed",
                           type="invalid_request_error") from None

    def start(self, work: Any) -> None:
        self.task = asyncio.ensure_future(work)


def add_trl_weight_routes(app: FastAPI, updates: WeightUpdates, guard: list[Any]) -> None:
    """TRL's weight routes on ``app`` (the admin key's ``guard``); see the module docstring."""
    background = Background()

    @app.post("/init_communicator/", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["trl"])
    async def init_communicator(request: Request) -> dict[str, str]:
        body = await read(request, CommunicatorRequest)
        backend = updates.backend_for(None)
        try:
            layout = Layout.trainer_last(body.host, body.port, body.world_size, backend)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await background.settle()

        async def join() -> None:
            await updates.open(layout)

        background.start(join())
        return {"message": "Request received, initializing communicator"}

    @app.post("/update_named_param/", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["trl"])
    async def update_named_param(request: Request) -> dict[str, str]:
        body = await read(request, NamedParamRequest)
        try:
            metas = announced([body.name], [body.dtype], [body.shape])
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await background.settle()
        updates.joined()

        async def load() -> None:
            async with updates.hold(f"receiving {body.name}"):
                tensors = await updates.receive(metas, packed=False, barrier=True)
                await updates.refit_tensors(tensors, None)

        background.start(load())
        return {"message": "Request received, updating named parameter"}

    @app.post("/close_communicator/", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["trl"])
    async def close_communicator() -> dict[str, str]:
        try:
            await background.settle()
        finally:
            async with updates.hold("leaving the trainer's group"):
                await updates.close()
        return {"message": "Request received, closing communicator"}

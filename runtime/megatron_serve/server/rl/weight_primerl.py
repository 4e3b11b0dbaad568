"""prime-rl's weight routes (its ``inference`` server, ``src/prime_rl/inference/vllm/server.py``), as REFITs.

prime-rl moves weights one of two ways, both served here:

* the filesystem broadcast: once the trainer wrote a checkpoint, the orchestrator posts ``POST /update_weights
  {"weight_dir": DIR}``: the REFIT of the directory (as the engines see it), the next epoch;
* the NCCL broadcast: the orchestrator posts ``POST /init_broadcaster`` once; this server joins the trainer's group
  (the trainer is rank 0 of the inference world plus one and serves the store; this server takes its ranks from
  ``rank_offset + 1``) with the server's ``--weight-transfer-config`` backend. Each step the orchestrator then
  touches ``DIR/NCCL_READY`` (the trainer waits on that file before it broadcasts) and posts ``/update_weights
  {"weight_dir": DIR}``, which now means "receive the broadcast" (DIR holds no checkpoint, as prime-rl's worker
  ignores it): the state dicts are read as prime-rl frames them (:mod:`.primerl_wire`) into host memory and
  committed as one REFIT, verified by every engine first, all or nothing, the next epoch.

The path ``/update_weights`` is vLLM's too; its route (:mod:`.weight_vllm`) hands a body with only ``weight_dir``
to :meth:`PrimeRL.update_weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from ...weights.framework_groups import Layout
from ..errors import bad_request
from ..intake import parse_body
from .responses import WEIGHT_RESPONSES
from .weight_updates import TRANSFER_TIMEOUT_S, Body, WeightUpdates, body_keys

if TYPE_CHECKING:  # torch, once a trainer's group is joined
    import torch

    from .weight_bridge import TrainerGroup

PRIMERL_WEIGHT_PATHS = frozenset({"/init_broadcaster"})


class WeightDirRequest(Body):
    weight_dir: str


class Broadcaster(Body):
    """Where the trainer serves its group's store, and the group's timeout (seconds), in both bodies."""

    host: str
    port: int
    timeout: float = TRANSFER_TIMEOUT_S


class BroadcasterRequest(Broadcaster):
    """prime-rl's orchestrator today (``init_nccl_broadcast``): this server's first rank in the inference world
    (the trainer not counted) and that world's size; ``engine_world_size``, where sent: how many ranks this
    server takes (one otherwise, as the orchestrator counts one GPU per server by default)."""

    rank_offset: int
    inference_world_size: int
    quantize_in_weight_transfer: bool = False
    engine_world_size: int = 1

    def layout(self, backend: str) -> Layout:
        if self.quantize_in_weight_transfer:
            raise bad_request("quantize_in_weight_transfer: the trainer would send each engine's kernel layout; a "
                              "REFIT takes the checkpoint's names and shapes, which every engine maps onto its own",
                              param="quantize_in_weight_transfer")
        first = self.rank_offset + 1
        return _layout(self.host, self.port, self.inference_world_size + 1,
                       tuple(range(first, first + self.engine_world_size)), backend)


class LegacyBroadcasterRequest(Broadcaster):
    """prime-rl's earlier orchestrators: ``server_rank`` of ``num_inference_server``, one rank per server."""

    server_rank: int
    num_inference_server: int

    def layout(self, backend: str) -> Layout:
        return _layout(self.host, self.port, self.num_inference_server + 1, (self.server_rank + 1,), backend)


def _layout(host: str, port: int, world_size: int, ranks: tuple[int, ...], backend: str) -> Layout:
    try:
        return Layout(host, port, world_size, ranks, 0, backend)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


class PrimeRL:
    """prime-rl's weight updates on one server: the broadcaster's group once joined, and so what ``/update_weights
    {"weight_dir"}`` means. A group another framework's route joined since (vLLM's) is not the broadcaster's: the
    directory is refit then."""

    def __init__(self, updates: WeightUpdates) -> None:
        self.updates = updates
        self.broadcaster: TrainerGroup | None = None

    async def init_broadcaster(self, body: BroadcasterRequest | LegacyBroadcasterRequest) -> None:
        layout = body.layout(self.updates.backend_for(None))
        self.broadcaster = None  # a join that fails leaves no broadcaster
        self.broadcaster = await self.updates.open(layout, body.timeout)

    async def update_weights(self, body: WeightDirRequest) -> dict[str, Any]:
        """The broadcast the trainer sends now, or (no broadcaster) the directory: one REFIT, the next epoch."""
        broadcast = self.broadcaster is not None and self.updates.group is self.broadcaster
        async with self.updates.hold("receiving prime-rl's broadcast" if broadcast
                                     else f"reading the directory {body.weight_dir}"):
            if broadcast:
                await self.updates.refit_tensors(await self._broadcast(), None)
            else:
                await self.updates.refit_directory(body.weight_dir, None)
        return {"status": "ok"}

    async def _broadcast(self) -> list[tuple[str, torch.Tensor]]:
        from .primerl_wire import receive_state_dicts  # noqa: PLC0415 - torch, as the bridge

        try:
            return await self.updates.read_group(receive_state_dicts)
        except ValueError as exc:  # the whole broadcast was read: the group stays for the next one
            raise bad_request(f"the trainer's broadcast was refused, the fleet keeps its weights: {exc}") from None


def add_primerl_weight_routes(app: FastAPI, primerl: PrimeRL, guard: list[Any]) -> None:
    """prime-rl's ``/init_broadcaster``; its ``/update_weights`` is served by vLLM's route."""

    @app.post("/init_broadcaster", dependencies=guard, responses=WEIGHT_RESPONSES, tags=["prime-rl"])
    async def init_broadcaster(request: Request) -> dict[str, str]:
        raw = await request.body()
        legacy = body_keys(raw) & {"server_rank", "num_inference_server"}
        await primerl.init_broadcaster(parse_body(LegacyBroadcasterRequest if legacy else BroadcasterRequest, raw))
        return {"status": "ok"}

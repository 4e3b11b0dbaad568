"""One server's weight updates, whatever framework sends them: a trainer's group, staged tensors, the REFIT.

Every framework's weight routes (:mod:`.weight_vllm`, :mod:`.weight_sglang`, :mod:`.weight_trl`) come here, so that
all of them run as the fleet's REFIT transaction: the tensors a trainer broadcast are pushed into the fleet by a
:class:`~megatron_serve.client.weight_sender.WeightSender` of this process (one sender, world size 1), whose REFIT
has every engine verify names and shapes before any byte moves and loads all or nothing; the weight version a
framework names becomes the epoch stamped on every token generated with the new weights. A directory update is the
REFIT of that directory.

A REFIT needs a paused fleet. The frameworks push into a running server (vLLM's and SGLang's engines load between
two steps), so a commit on a RUNNING fleet pauses it in ``keep`` mode around the REFIT (requests in flight stop
where they are and go on under the new weights, their tokens' epochs saying which weights made them) and unpauses
it after, refused or not; a fleet the trainer paused (or suspended) stays as it was.

What went through here is remembered as a checksum per tensor (:meth:`WeightUpdates.checksums`): the weights every
engine acknowledged loading, at that epoch. Routes run what they do with the state as one operation of
:attr:`WeightUpdates.slot` (:meth:`WeightUpdates.hold`: a second caller is answered 409 at once, see
:mod:`.weight_slot`), except :meth:`~WeightUpdates.open`, :meth:`~WeightUpdates.start` and
:meth:`~WeightUpdates.finish`, which hold it themselves.

A weight version strictly increases: a commit that names one not above the version served is refused (409, the
served one named) before anything moves, so that the epoch on a token always says which weights made it and a
stream whose weights change shows a new span. Every wait is bounded: a trainer's join and each receive by the
group's timeout (:data:`TRANSFER_TIMEOUT_S`, or the framework's where it names one), the REFIT by the fleet's
transaction (the same bound), and a stalled one is ended sooner by a new trainer or ``/abort_weight_update``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ...weights.framework_groups import PACKED_BUFFER_BYTES, Layout, TensorMeta
from ...wire.lifecycle import FleetState, PauseMode
from ..errors import APIError, bad_request
from ..backend import Backend
from ..intake import parse_body
from .weight_slot import STALL_S, Operation, Slot

if TYPE_CHECKING:  # torch only once a trainer's group is joined: the HTTP server runs without it otherwise
    import torch

    from ...client.coordinator_client import InferenceClient
    from .weight_bridge import TrainerGroup

#: How a route runs a verb: ``run(verb, call)`` answers ``call()``'s acknowledgement, or raises the refusal's HTTP
#: answer (the admin API's :func:`~megatron_serve.server.admin.run_verb`, bound to the server's fleet monitor).
VerbRunner = Callable[[str, Callable[[], Awaitable[dict[str, Any]]]], Awaitable[dict[str, Any]]]

#: Seconds for a trainer to join, and for each transfer (a trainer's and the one into the fleet).
TRANSFER_TIMEOUT_S = 300.0

Received = TypeVar("Received")

logger = logging.getLogger("megatron_serve.server")


class Body(BaseModel):
    """A framework's request body: its own field names; one it does not send is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


async def read(request: Request, model: type[Body]) -> Any:
    """The body as ``model``; an empty one takes its defaults (frameworks post ``{}`` or nothing)."""
    raw = await request.body()
    return model() if not raw.strip() else parse_body(model, raw)


def body_keys(raw: bytes) -> set[str]:
    """The top-level keys of a JSON object body (an empty set for anything else, which the parsers then refuse): how
    a path two frameworks share tells their bodies apart."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise bad_request("the request body is not JSON", code="invalid_json") from None
    return set(value) if isinstance(value, dict) else set()


def epoch_of(version: Any) -> int | None:
    """A framework's weight version as the fleet's epoch: an integer (``3`` or ``"3"``), or None for the next one."""
    if version is None:
        return None
    text = str(version)
    if isinstance(version, bool) or not text.isdigit():
        raise APIError(400, f"weight version {version!r} is not an epoch: here a weight version is the integer epoch "
                            "stamped on every token generated with those weights (send 1, 2, ... or none for the "
                            "next)", code="invalid_weight_version", type="invalid_request_error")
    return int(text)


class WeightUpdates:
    """The weight-update state of one server: the trainer group it joined, the tensors staged for the next commit,
    and the checksums of what the fleet loaded through it. One operation at a time (:attr:`slot`)."""

    def __init__(self, backend: Backend, transfer_backend: str | None, run: VerbRunner,
                 timeout: float = TRANSFER_TIMEOUT_S, stall_s: float = STALL_S) -> None:
        self.backend = backend
        self.transfer_backend = transfer_backend  # --weight-transfer-config's backend; None: no trainer groups
        self.run = run
        self.timeout = timeout
        self.slot = Slot(stall_s)
        self.group: TrainerGroup | None = None
        self.staged: dict[str, torch.Tensor] | None = None  # None: no update started
        self.packing = (False, PACKED_BUFFER_BYTES)  # (packed, buffer bytes) as vLLM's init_info says
        self._checksums: tuple[int, dict[str, str]] | None = None  # (epoch, name -> sha256) of the last commit

    def client(self) -> InferenceClient:
        """The coordinator client that sends the REFIT (a fleet's; a server over one in-process engine has none)."""
        from ...client.coordinator_client import InferenceClient  # noqa: PLC0415 - the backend's own module

        if not isinstance(self.backend, InferenceClient):
            raise APIError(501, "weight updates need a fleet with a coordinator (megatron-serve run, server or serve "
                                "with --use-coordinator); this server runs its engine in process", code="unsupported")
        return self.backend

    def backend_for(self, requested: str | None) -> str:
        """The transfer backend of a new trainer group: the configured one (``--weight-transfer-config``); a
        framework that names another is refused."""
        if self.transfer_backend is None:
            raise APIError(400, "this server has no weight transfer: start it with --weight-transfer-config "
                                "'{\"backend\": \"nccl\"}' (or \"gloo\" for CPU trainers)",
                           code="weight_transfer_off", type="invalid_request_error")
        if requested is not None and requested != self.transfer_backend:
            raise APIError(400, f"backend {requested!r}: this server's weight transfer is {self.transfer_backend!r} "
                                "(--weight-transfer-config)", code="invalid_request", type="invalid_request_error",
                           param="backend")
        return self.transfer_backend

    def owner(self) -> str:
        """Who the state belongs to now, as answers and the log name it."""
        return (f"the trainer group at {self.group.layout.host}:{self.group.layout.port}" if self.group is not None
                else "a caller with no trainer group")

    @contextlib.asynccontextmanager
    async def hold(self, what: str, owner: str | None = None) -> AsyncIterator[Operation]:
        """Run ``what`` as the one weight operation (409 at once if another is under way, see :class:`Slot`)."""
        async with self.slot.hold(what, owner or self.owner()) as op:
            yield op

    async def open(self, layout: Layout, timeout: float | None = None) -> TrainerGroup:
        """Join a trainer's group (any group joined before is left first, and an update of a trainer that stalled
        is ended: :meth:`Slot.take_over`); returns it once the trainer joined. ``timeout``: the group's, where the
        framework names one (this server's otherwise)."""
        from .weight_bridge import TrainerGroup  # noqa: PLC0415 - torch, once a trainer's group is joined

        self.client()
        newcomer = f"the trainer group at {layout.host}:{layout.port}"
        reason = self.slot.in_the_way(newcomer)
        if reason is not None:
            self.end(reason)
        async with self.hold(f"joining {newcomer}", newcomer):
            await self.close()
            try:
                self.group = await self.blocking(TrainerGroup.join, layout, timeout or self.timeout, joins=True)
            except (RuntimeError, OSError, ValueError) as exc:
                logger.warning("weight transfer refused: %s was not joined: %s", newcomer, exc)
                raise APIError(503, f"the trainer's group at {layout.host}:{layout.port} was not joined: {exc}",
                               code="weight_transfer_failed") from None
            self.group.moved = self.slot.touch
        logger.info("weight transfer: joined %s (%s, world size %d)", newcomer, layout.backend, layout.world_size)
        return self.group

    async def close(self) -> None:
        """Leave the trainer's group (and drop what it staged)."""
        group, self.group = self.group, None
        self.staged, self.slot.started_by = None, None
        if group is not None:
            logger.info("weight transfer: left the trainer group at %s:%d", group.layout.host, group.layout.port)
            await asyncio.to_thread(group.close)

    def joined(self) -> TrainerGroup:
        if self.group is None:
            raise APIError(409, "no trainer group: initialize the weight transfer first", code="no_weight_transfer",
                           type="invalid_request_error")
        return self.group

    async def blocking(self, call: Callable[..., Received], *args: Any, joins: bool = False) -> Received:
        """``call(*args)`` on a thread of its own, as part of the operation held now; 503 once that operation is
        ended from outside (:meth:`end`: the thread goes on until its collective ends; ``joins``: what it returns is
        a group joined, left then)."""
        op = self.slot.current
        assert op is not None, "a blocking weight call outside an operation"
        task = op.thread = asyncio.ensure_future(asyncio.to_thread(call, *args))
        await asyncio.wait({task, op.ended}, return_when=asyncio.FIRST_COMPLETED)
        if not op.ended.done():
            return task.result()
        task.add_done_callback(_leave_joined if joins else _drop)
        raise APIError(503, f"{op.what} was ended ({op.ended.result()}); the fleet keeps its weights",
                       code="weight_transfer_ended")

    def end(self, reason: str) -> bool:
        """End the operation (or started update) under way, for ``reason``: its route answers 503, what it staged
        is dropped and its group left (once the thread still reading from it ends). False: nothing was."""
        thread = self.slot.current.thread if self.slot.current is not None else None
        if not self.slot.end(reason):
            return False
        group, self.group, self.staged = self.group, None, None
        if group is not None:
            group.moved = _still  # what its thread still reads is no progress of whoever holds the slot next
            logger.info("weight transfer: leaving the trainer group at %s:%d (%s)", group.layout.host,
                        group.layout.port, reason)
            if thread is not None and not thread.done():
                thread.add_done_callback(lambda _: group.close())
            else:
                group.close()
        return True

    async def receive(self, metas: list[TensorMeta], packed: bool, buffer_bytes: int = PACKED_BUFFER_BYTES,
                      barrier: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The tensors the trainer broadcasts now (``barrier``: then a barrier of the whole group, TRL's)."""

        def run(group: TrainerGroup) -> list[tuple[str, torch.Tensor]]:
            tensors = group.receive(metas, packed, buffer_bytes)
            if barrier:
                group.barrier()
            return tensors

        return await self.read_group(run)

    async def read_group(self, read: Callable[[TrainerGroup], Received]) -> Received:
        """``read(group)`` on a thread of its own: what the trainer broadcasts now, as the protocol frames it."""
        group = self.joined()
        try:
            return await self.blocking(read, group)
        except RuntimeError as exc:  # the trainer died or gave up mid-broadcast: nothing is staged
            logger.warning("weight transfer: the trainer group at %s:%d was lost mid-broadcast (%s); the fleet keeps "
                           "its weights", group.layout.host, group.layout.port, exc)
            await self.close()
            raise APIError(503, f"receiving the weights from the trainer failed ({exc}); the trainer's group is left, "
                                "the fleet keeps its weights", code="weight_transfer_failed") from None

    async def start(self) -> None:
        """An update begins: what the trainer broadcasts from now on is staged until :meth:`finish`."""
        if self.slot.current is None and self.slot.started_by is not None:
            raise self.slot.busy()  # (the started update, which no operation of its own describes)
        async with self.hold("starting an update"):
            self.joined()
            self.staged, self.slot.started_by = {}, self.owner()

    def refused(self, exc: APIError) -> None:
        """A call of the started update was refused (``exc``): the update ends, what it staged is dropped."""
        logger.warning("weight transfer refused (for %s): %s", self.owner(), exc.message)
        if self.staged is not None:
            self.staged, self.slot.started_by = None, None

    def stage(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        staged = self.staged if self.staged is not None else {}
        staged.update(tensors)
        self.staged = staged

    async def finish(self, epoch: int | None) -> int:
        """The commit point of a started update: one REFIT of every staged tensor; the epoch served after it. With
        no update started (vLLM answers that with 200 too: TRL's async trainer finishes after a failed transfer,
        which ended it here) nothing changes and the epoch served is the answer."""
        async with self.hold("committing an update"):
            staged, self.staged, self.slot.started_by = self.staged, None, None
            if not staged:  # none started, or started and finished with nothing sent: the weights stay
                return await self.epoch()
            ack = await self.refit_tensors(list(staged.items()), epoch)
        return int(ack["detail"]["epoch"])

    async def refit_tensors(self, tensors: list[tuple[str, torch.Tensor]], epoch: int | None, *,
                            pause: PauseMode = PauseMode.KEEP, keep_paused: bool = False) -> dict[str, Any]:
        """REFIT the fleet with ``tensors`` (all or nothing, every engine verifying first); the acknowledgement.
        ``pause``, ``keep_paused``: see :meth:`_paused`."""
        from ...client.weight_sender import WeightSender  # noqa: PLC0415 - torch, as the bridge

        client = self.client()
        await self.above_served(epoch)

        async def refit() -> dict[str, Any]:
            return await WeightSender(client, backend="gloo", timeout=self.timeout).send(tensors, epoch=epoch)

        ack = await self._refit(f"{len(tensors)} tensors", lambda: self._paused(client, refit, pause, keep_paused))
        self._checksums = (int(ack["detail"]["epoch"]), {name: checksum(t) for name, t in tensors})
        return ack

    async def refit_directory(self, path: str, epoch: int | None, *, pause: PauseMode = PauseMode.KEEP,
                              keep_paused: bool = False) -> dict[str, Any]:
        """REFIT the fleet from a model directory (as the engines see it)."""
        client = self.client()
        await self.above_served(epoch)
        ack = await self._refit(f"the directory {path}", lambda: self._paused(client, lambda: client.refit(path, epoch),
                                                                             pause, keep_paused))
        self._checksums = None  # the engines read the directory: this server never saw those bytes
        return ack

    async def _refit(self, what: str, refit: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run the REFIT verb (not ended from outside: the fleet's transaction bounds it); its outcome logged."""
        op = self.slot.current
        if op is not None:
            op.what, op.preemptible = f"loading {what} into the fleet (REFIT)", False
        try:
            ack = await self.run("refit", refit)
        except APIError as exc:
            logger.warning("weight update refused by the fleet (%s, for %s): %s", what, self.owner(), exc.message)
            raise
        logger.info("weight update committed: %s, for %s; the fleet serves epoch %s", what, self.owner(),
                    ack["detail"]["epoch"])
        return ack

    async def above_served(self, epoch: int | None) -> None:
        """A named weight version must be above the one served (None: the next one, always)."""
        if epoch is None:
            return
        served = await self.epoch()
        if epoch <= served:
            logger.warning("weight update refused: weight version %d is not above the version served, %d", epoch,
                           served)
            raise APIError(409, f"weight version {epoch} is not above the version served, {served}: a weight version "
                                f"increases with every committed update (send {served + 1} or more, or none for the "
                                "next)", code="weight_version_not_increasing", type="invalid_request_error")

    @staticmethod
    async def _paused(client: InferenceClient, refit: Callable[[], Awaitable[dict[str, Any]]], pause: PauseMode,
                      keep_paused: bool) -> dict[str, Any]:
        """``refit()`` on a paused fleet: a running one is paused in ``pause`` mode around it and unpaused after
        (unless ``keep_paused``, SGLang's ``keep_pause``); ``abort`` also ends what a paused fleet holds (SGLang's
        ``abort_all_requests``)."""
        running = (await client.status())["state"] == FleetState.RUNNING.value
        if running or pause is PauseMode.ABORT:
            await client.pause(pause)
        try:
            return await refit()
        finally:
            if running and not keep_paused:
                await client.unpause()

    async def epoch(self) -> int:
        return int((await self.client().status())["epoch"])

    async def checksums(self) -> dict[str, str]:
        """sha256 of each tensor the fleet loaded through this server, at the epoch it serves; 409 when the weights
        it serves did not come through here (the server's own model, a directory), which it cannot see."""
        served = await self.epoch()
        if self._checksums is None or self._checksums[0] != served:
            raise APIError(409, f"the weights of epoch {served} did not come through this server's weight routes "
                                "(the model the fleet started with, or a directory): it has no checksums of them",
                           code="no_checksums", type="invalid_request_error")
        return dict(self._checksums[1])


def _still() -> None:
    """The progress hook of a group that was left."""


def _leave_joined(done: asyncio.Future[TrainerGroup]) -> None:
    """An ended join finished after all: leave the group it joined."""
    if not done.cancelled() and done.exception() is None:
        done.result().close()


def _drop(done: asyncio.Future[Any]) -> None:
    """An ended receive finished: what it read, or the error its collective ended with, is not used."""
    if not done.cancelled():
        done.exception()


def checksum(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as the fleet received them."""
    import torch  # noqa: PLC0415 - the tensors came with it

    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

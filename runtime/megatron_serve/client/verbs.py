"""The lifecycle verbs of a coordinator client, apart from its connection and requests
(:class:`~megatron_serve.client.coordinator_client.InferenceClient` has them).

Every verb goes through :meth:`FleetVerbs.control`, which checks its arguments against the verb table
(:mod:`megatron_serve.wire.verb_calls`) and sends them as the verb's message; the named methods
(``pause``, ``refit``, ...) are the Python API's spelling of the same calls, with their documentation.
"""

from __future__ import annotations

from typing import Any

from ..wire.connection import Connection, ControlError
from ..wire.lifecycle import PauseMode, Verb
from ..wire.rendezvous import Rendezvous
from ..wire.protocol import VERB_HEADERS, ErrorCode, Header
from ..wire.verb_calls import verb_call


class FleetVerbs:
    """Each verb is one control message and its acknowledgement (``_control``, the client's)."""

    _connection: Connection

    async def _control(self, header: Header, timeout: float | None, **extra: Any) -> dict[str, Any]:
        raise NotImplementedError

    async def control(self, verb: Verb | str, timeout: float | None = None, **arguments: Any) -> dict[str, Any]:
        """Run ``verb`` (a :class:`~megatron_serve.wire.lifecycle.Verb` or its name) with its ``arguments`` (the verb
        table's: ``mode`` and ``drain_timeout`` for pause, ``level`` and ``keep_kv`` for suspend, ...); resolves to
        the ``CONTROL_ACK`` (``state``, ``detail``) once every engine acknowledged. An argument the verb does not
        take, or a value it refuses, raises ``ValueError`` naming it before anything is sent; a refusal by the
        coordinator raises :class:`ControlError`. ``timeout``: how long to wait for the acknowledgement."""
        call = verb_call(verb)
        fields = call.bind(arguments)
        ack = self._connection.ack
        problem = call.too_new(fields, ack.protocol) if ack is not None else None
        if problem is not None:
            raise ControlError(ErrorCode.UNSUPPORTED.value, problem)
        return await self._control(VERB_HEADERS[call.verb], timeout, **fields)

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP, *, drain_timeout: float | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        """PAUSE: engines stop stepping at a step boundary and keep their memory; requests wait for UNPAUSE.

        ``mode`` (:class:`~megatron_serve.wire.lifecycle.PauseMode`) says what happens to the requests the
        fleet holds: ``"keep"`` (default) pauses them in place; ``"wait"`` lets the running ones
        finish first (at most ``drain_timeout`` seconds, default 30; what still runs then is kept)
        while queued ones wait; ``"abort"`` ends all of them at once with ``finish_reason`` ``"abort"``
        and the tokens generated so far. The acknowledgement's ``detail`` says what the mode did
        (``mode``, ``aborted``; ``waited_s``, ``unfinished``, ``timed_out``).
        """
        return await self.control(Verb.PAUSE, timeout, mode=mode, drain_timeout=drain_timeout)

    async def unpause(self, timeout: float | None = None) -> dict[str, Any]:
        """UNPAUSE: back to RUNNING (also restarts a STOPPED fleet once engines joined again)."""
        return await self.control(Verb.UNPAUSE, timeout)

    async def suspend(self, level: int = 1, timeout: float | None = None, keep_kv: bool = False) -> dict[str, Any]:
        """SUSPEND: release the KV cache (level 2: also weights to host); pauses first if RUNNING. ``keep_kv``: the
        requests in flight keep their KV in host memory and continue after RESUME without recomputing it."""
        return await self.control(Verb.SUSPEND, timeout, level=level, keep_kv=keep_kv)

    async def resume(self, timeout: float | None = None) -> dict[str, Any]:
        """RESUME: restore device memory; the fleet is then PAUSED (UNPAUSE to run)."""
        return await self.control(Verb.RESUME, timeout)

    async def stop(self, timeout: float | None = None, drain_timeout: float | None = None) -> dict[str, Any]:
        """The STOP verb: every engine drains and exits. (To close this client, use :meth:`close`.)"""
        return await self.control(Verb.STOP, timeout, drain_timeout=drain_timeout)

    async def refit(self, source: str, epoch: int | None = None, timeout: float | None = None, *,
                    rendezvous: Rendezvous | None = None) -> dict[str, Any]:
        """REFIT (fleet PAUSED or SUSPENDED): every engine loads the weights in model directory ``source``.

        ``source`` is a path as the engines see it; its shapes must equal the served model's.
        ``epoch`` (default: the current one + 1) is the generation recorded for the new weights and
        reported with every token generated under them. The coordinator verifies the source on every
        engine before any engine loads it: a mismatch raises :class:`ControlError` (code
        ``refit_failed``) naming the engine and the problem, and the fleet keeps its old weights.
        The acknowledgement's ``detail`` holds ``epoch``, ``source`` and per-engine timings
        (``verify_s``, ``load_s``, ``total_s``).

        ``rendezvous``: the weights come from a trainer instead (``source`` is then its label); this
        is what :class:`megatron_serve.WeightSender` sends, and what it should be used through.
        """
        return await self.control(Verb.REFIT, timeout, source=source, epoch=epoch, rendezvous=rendezvous)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None) -> dict[str, Any]:
        """LOAD_LORA: every engine serves the PEFT adapter in directory ``lora_path`` (as the engines see it) as
        ``lora_name``, from its next request on; any state but STOPPED, requests keep running meanwhile.

        Every engine reads and checks the adapter before any serves it: a bad adapter (no such directory,
        rank above ``max_lora_rank``, modules the model lacks, mismatched shapes) or a name already served
        raises :class:`ControlError` (code ``lora_refused``) naming the engine and the problem, and no
        engine serves it. The acknowledgement's ``detail`` holds per-engine ``read_s``/``load_s`` and ``loras``.
        """
        return await self.control(Verb.LOAD_LORA, timeout, lora_name=lora_name, lora_path=lora_path)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> dict[str, Any]:
        """UNLOAD_LORA: no engine serves ``lora_name`` to new requests; requests already admitted under it finish
        under it. :class:`ControlError` (code ``lora_not_found``) when no engine serves that name."""
        return await self.control(Verb.UNLOAD_LORA, timeout, lora_name=lora_name)

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 timeout: float | None = None) -> dict[str, Any]:
        """RESET_PREFIX_CACHE: every engine forgets every cached prefix block (device pool and host tier), between
        two steps, in any state but STOPPED. An engine whose running requests hold blocks does not reset unless
        ``reset_running_requests`` (they are then recomputed from their tokens): the acknowledgement's ``detail``
        says ``reset`` (every engine did) and each engine's ``reset``."""
        return await self.control(Verb.RESET_PREFIX_CACHE, timeout, reset_running_requests=reset_running_requests)

    async def scale_ep(self, size: int, timeout: float | None = None) -> dict[str, Any]:
        """SCALE_EP: the expert-parallel group of data-parallel attention ranks to ``size`` ranks, in any state but
        STOPPED. Below its size, the ranks from ``size`` on hand their requests back (resubmitted to the others)
        and leave; the others regroup without them at their next turn. Above it, the size is recorded
        (``detail["wanted"]``): the missing ranks' engines join the group when they are started."""
        return await self.control(Verb.SCALE_EP, timeout, size=size)

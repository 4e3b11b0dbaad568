"""The lifecycle verbs of a coordinator client (PAUSE, UNPAUSE, SUSPEND, RESUME, STOP, REFIT, LOAD_LORA,
UNLOAD_LORA), apart from its
connection and requests (:class:`~megatron_serve.client.coordinator_client.InferenceClient` has them)."""

from __future__ import annotations

from typing import Any

from ..wire.connection import Connection, ControlError
from ..wire.lifecycle import PauseMode, drain_timeout_problem, parse_pause_mode
from ..wire.messages import Rendezvous
from ..wire.protocol import ErrorCode, Header


class FleetVerbs:
    """Each verb is one control message and its acknowledgement (``_control``, the client's)."""

    _connection: Connection

    async def _control(self, header: Header, timeout: float | None, **extra: Any) -> dict[str, Any]:
        raise NotImplementedError

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
        chosen = parse_pause_mode(mode)
        problem = drain_timeout_problem(chosen, drain_timeout)
        if problem is not None:
            raise ValueError(problem)
        ack = self._connection.ack
        if chosen is not PauseMode.KEEP and ack is not None and ack.protocol < 3:
            raise ControlError(ErrorCode.UNSUPPORTED.value,
                               f"the coordinator speaks protocol {ack.protocol}, which has no pause modes (it would "
                               f"keep the requests instead of mode {chosen.value!r}): upgrade the coordinator")
        return await self._control(Header.PAUSE, timeout, mode=None if chosen is PauseMode.KEEP else chosen.value,
                                   drain_timeout=drain_timeout)

    async def unpause(self, timeout: float | None = None) -> dict[str, Any]:
        """UNPAUSE: back to RUNNING (also restarts a STOPPED fleet once engines joined again)."""
        return await self._control(Header.UNPAUSE, timeout)

    async def suspend(self, level: int = 1, timeout: float | None = None, keep_kv: bool = False) -> dict[str, Any]:
        """SUSPEND: release the KV cache (level 2: also weights to host); pauses first if RUNNING. ``keep_kv``: the
        requests in flight keep their KV in host memory and continue after RESUME without recomputing it."""
        return await self._control(Header.SUSPEND, timeout, level=level, keep_kv=keep_kv or None)

    async def resume(self, timeout: float | None = None) -> dict[str, Any]:
        """RESUME: restore device memory; the fleet is then PAUSED (UNPAUSE to run)."""
        return await self._control(Header.RESUME, timeout)

    async def stop(self, timeout: float | None = None, drain_timeout: float | None = None) -> dict[str, Any]:
        """The STOP verb: every engine drains and exits. (To close this client, use :meth:`close`.)"""
        return await self._control(Header.STOP, timeout, drain_timeout=drain_timeout)

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
        if not isinstance(source, str) or not source:
            raise ValueError("source must be a non-empty model directory path")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        return await self._control(Header.REFIT, timeout, source=source, epoch=epoch, rendezvous=rendezvous)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None) -> dict[str, Any]:
        """LOAD_LORA: every engine serves the PEFT adapter in directory ``lora_path`` (as the engines see it) as
        ``lora_name``, from its next request on; any state but STOPPED, requests keep running meanwhile.

        Every engine reads and checks the adapter before any serves it: a bad adapter (no such directory,
        rank above ``max_lora_rank``, modules the model lacks, mismatched shapes) or a name already served
        raises :class:`ControlError` (code ``lora_refused``) naming the engine and the problem, and no
        engine serves it. The acknowledgement's ``detail`` holds per-engine ``read_s``/``load_s`` and ``loras``.
        """
        for field, value in (("lora_name", lora_name), ("lora_path", lora_path)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{field} must be a non-empty string, got {value!r}")
        return await self._control(Header.LOAD_LORA, timeout, lora_name=lora_name, lora_path=lora_path)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> dict[str, Any]:
        """UNLOAD_LORA: no engine serves ``lora_name`` to new requests; requests already admitted under it finish
        under it. :class:`ControlError` (code ``lora_not_found``) when no engine serves that name."""
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        return await self._control(Header.UNLOAD_LORA, timeout, lora_name=lora_name)

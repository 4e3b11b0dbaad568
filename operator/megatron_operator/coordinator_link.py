"""The operator's only contact with a coordinator: a small link over the project's client.

The real link wraps ``megatron_serve.InferenceClient`` (docs/wire-protocol.md), imported lazily so the
operator imports fine without it. Tests swap the whole link with :func:`set_link_factory`
(an in-process fake coordinator) or point the real one at 127.0.0.1 with the environment
variable ``MEGATRON_OPERATOR_COORDINATOR_ADDRESS`` (see :mod:`megatron_operator.config`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from megatron_serve.wire.lifecycle import Verb
from megatron_serve.wire.verb_calls import verb_call


class CoordinatorUnavailable(RuntimeError):
    """The coordinator could not be reached or did not answer in time."""


class CoordinatorRejected(RuntimeError):
    """The coordinator answered a verb with an error (e.g. an illegal transition)."""


class RefitFailed(CoordinatorRejected):
    """An engine refused the new weights (e.g. another architecture); the fleet kept the old ones."""


class CoordinatorLink(Protocol):
    address: str

    async def status(self, timeout: float) -> dict[str, Any]:
        """The coordinator's STATUS_REPLY: state, engines, queued, in_flight, completed, failed."""

    async def command(self, verb: str, timeout: float, drain_timeout: float | None = None,
                      pause_mode: str | None = None, keep_kv: bool = False) -> dict[str, Any]:
        """Send pause|unpause|suspend|resume|stop; resolves to the CONTROL_ACK {state, detail}.

        ``drain_timeout`` bounds how long engines may drain on STOP, and how long running requests
        may take on PAUSE in ``wait`` mode; ``pause_mode`` is PAUSE's mode (keep, wait, abort);
        ``keep_kv``: SUSPEND keeps the requests in flight's KV in host memory.
        """

    async def refit(self, source: str, epoch: int | None, timeout: float) -> dict[str, Any]:
        """REFIT (fleet PAUSED or SUSPENDED): resolves to the CONTROL_ACK; raises :class:`RefitFailed`
        when an engine refused the weights, :class:`CoordinatorRejected` for other refusals."""

    async def close(self) -> None:
        """Release the connection."""


LinkFactory = Callable[[str, "str | None", float], Awaitable[CoordinatorLink]]


class ClientLink:
    """A link over ``megatron_serve.InferenceClient``."""

    def __init__(self, client: Any, address: str):
        self.client = client
        self.address = address

    @classmethod
    async def open(cls, address: str, token: str | None, timeout: float) -> "ClientLink":
        try:
            from megatron_serve import InferenceClient
        except ImportError as exc:  # the runtime is not installed next to the operator
            raise CoordinatorUnavailable(f"megatron_serve.InferenceClient is not available: {exc}") from exc
        try:  # the control role: lifecycle verbs and STATUS only, no requests
            client = InferenceClient(address, token=token, role="control")
        except (TypeError, ValueError):
            client = InferenceClient(address, token=token)
        try:
            # No asyncio.wait_for around coroutines here: it runs them as tasks of their own, and
            # kopf treats (and re-raises from) every task still running when the operator stops.
            await client.start(timeout=timeout)
        except BaseException as exc:
            await _close_quietly(client)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise CoordinatorUnavailable(f"cannot reach the coordinator at {address}: {_text(exc)}") from exc
        return cls(client, address)

    async def status(self, timeout: float) -> dict[str, Any]:
        try:
            reply = await self.client.status(timeout=timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            raise CoordinatorUnavailable(f"no STATUS reply from {self.address}: {_text(exc)}") from exc
        return _as_dict(reply)

    async def command(self, verb: str, timeout: float, drain_timeout: float | None = None,
                      pause_mode: str | None = None, keep_kv: bool = False) -> dict[str, Any]:
        spec = verb_call(verb)
        if spec.verb is Verb.REFIT:
            raise ValueError("REFIT takes a source: use refit()")
        keeps = spec.verb is Verb.PAUSE and pause_mode != "wait"  # the drain time is STOP's, and PAUSE's in mode wait
        offered = {"mode": pause_mode, "keep_kv": keep_kv or None, "drain_timeout": None if keeps else drain_timeout}
        arguments = {arg.name: offered[arg.name] for arg in spec.args if offered.get(arg.name) is not None}
        try:
            ack = await self.client.control(spec.verb, timeout, **arguments)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            raise CoordinatorUnavailable(f"no acknowledgement of {verb.upper()} from {self.address}: "
                                         f"{_text(exc)}") from exc
        except (RuntimeError, ValueError) as exc:
            raise CoordinatorRejected(f"{verb.upper()} rejected: {_text(exc)}") from exc
        return _as_dict(ack)

    async def refit(self, source: str, epoch: int | None, timeout: float) -> dict[str, Any]:
        try:
            ack = await self.client.refit(source, epoch, timeout=timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            raise CoordinatorUnavailable(f"no acknowledgement of REFIT from {self.address}: {_text(exc)}") from exc
        except (RuntimeError, ValueError) as exc:
            kind = RefitFailed if getattr(exc, "code", None) == "refit_failed" else CoordinatorRejected
            raise kind(f"REFIT rejected: {_text(exc)}") from exc
        return _as_dict(ack)

    async def close(self) -> None:
        await _close_quietly(self.client)


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if hasattr(value, "_asdict"):
        return dict(value._asdict())
    if hasattr(value, "__dict__"):
        return dict(vars(value))
    return {"state": str(value)}


async def _close_quietly(client: Any) -> None:
    close = getattr(client, "close", None)
    try:
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result
    except Exception:  # closing is best effort
        pass


_factory: LinkFactory = ClientLink.open


def set_link_factory(factory: LinkFactory | None) -> None:
    """Replace how links are opened (tests); ``None`` restores the real client."""
    global _factory
    _factory = factory or ClientLink.open


async def open_link(address: str, token: str | None, timeout: float) -> CoordinatorLink:
    """Open a link to the coordinator at ``address``; raises :class:`CoordinatorUnavailable`."""
    try:
        return await _factory(address, token, timeout)
    except (CoordinatorUnavailable, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise CoordinatorUnavailable(f"cannot reach the coordinator at {address}: {_text(exc)}") from exc


class LinkCache:
    """One resource's open link, reused by the passes while its address and token stay the same."""

    def __init__(self) -> None:
        self._link: CoordinatorLink | None = None
        self._key: tuple[str, str | None] | None = None

    async def get(self, address: str, token: str | None, timeout: float) -> CoordinatorLink:
        """The open link to ``address`` (opened now if there is none or it was for another address or
        token); raises :class:`CoordinatorUnavailable`."""
        if self._link is not None and self._key == (address, token):
            return self._link
        await self.drop()
        self._link = await open_link(address, token, timeout)
        self._key = (address, token)
        return self._link

    async def drop(self) -> None:
        """Close the link (it failed, or the resource is gone): the next :meth:`get` opens a new one."""
        link, self._link, self._key = self._link, None, None
        if link is not None:
            try:
                await link.close()
            except Exception:  # best effort
                pass

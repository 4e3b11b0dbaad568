"""``InferenceClient``: the asyncio client of the coordinator protocol (DESIGN section 5).

One DEALER socket, one receive task and one heartbeat task, all on the event loop that called
:meth:`InferenceClient.start`. The client keeps every request it submitted until its final
``RESULT`` arrives, so that a lost or restarted coordinator costs nothing but time: the client
reconnects with backoff, says HELLO again with the same ``client_id`` (so the coordinator routes
undelivered results to the new connection) and resubmits what is still pending — a streaming
request continues from the tokens already received, so no token is delivered twice. Results are
acknowledged (``RESULT_ACK``) so that the coordinator can forget them.

Naming: ``stop()`` is the lifecycle verb STOP (the fleet drains and its engines exit);
``close()`` / ``aclose()`` close this client's connection. The design document lists both under
``stop()``; here they are distinct so neither shadows the other.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from .multimodal import PromptImage
from .protocol import FROM_COORDINATOR, ErrorCode, Header, ProtocolError, Role, decode, encode
from .request import DynamicInferenceRequest, top_logprobs_from_wire
from .streams import iterate_stream
from .sampling_params import SamplingParams

logger = logging.getLogger("megatron_serve.client")


class CoordinatorError(RuntimeError):
    """The coordinator answered ERROR; ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Unauthorized(CoordinatorError, PermissionError):
    """The coordinator refused our token."""


class ControlError(CoordinatorError):
    """A lifecycle verb was refused (e.g. an illegal transition)."""


@dataclass
class StreamPartial:
    """One streamed piece of a request: the tokens (and text) an engine step added."""

    request_id: str
    new_tokens: list[int]
    new_text: str
    new_log_probs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per new token, when asked for
    finished: bool = False  # partials never finish; the final item is the DynamicInferenceRequest


@dataclass
class _Pending:
    request_id: str
    prompt: str | list[int]
    sampling_params: dict[str, Any]
    stream: bool
    future: asyncio.Future
    queue: asyncio.Queue | None = None
    received: list[int] = field(default_factory=list)
    aborted: bool = False
    images: list[dict[str, Any]] = field(default_factory=list)  # wire form (PromptImage.to_wire)


def _backoff(initial: float = 0.1, maximum: float = 2.0):
    delay = initial
    while True:
        yield delay
        delay = min(delay * 2, maximum)


#: Messages the receive loop takes at once before it lets the event loop run. ``await sock.recv()``
#: does not yield while messages are waiting, so a backlog (many streams, a busy host) was handled in
#: one go: measured 7.4 s during which the HTTP server in the same loop answered nothing, /health
#: included. The rest of a batch is read without a future per message: 1.4 us instead of 22.6 us.
_BATCH = 32


class InferenceClient:
    """Asyncio client of a coordinator at ``address`` (``tcp://host:port``).

    ``token``: the shared token when the coordinator requires one. ``role``: ``"client"`` (submit
    and control) or ``"control"`` (control and status only). ``coordinator_timeout``: with no
    message from the coordinator for that long (it answers every heartbeat), reconnect.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        role: str = Role.CLIENT.value,
        client_id: str | None = None,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 5.0,
    ) -> None:
        self.address = address
        self.token = token
        self.role = Role(role)
        self.client_id = client_id or uuid.uuid4().hex
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.coordinator_id: str | None = None
        self.state: str | None = None  # last fleet state the coordinator told us
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, _Pending] = {}
        self._controls: dict[str, tuple[Header, dict[str, Any], asyncio.Future]] = {}
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._status_ids = itertools.count(1)
        self._acks: list[Any] = []
        self._ack_scheduled = False
        self._hello_waiter: asyncio.Future | None = None
        self._registered = False
        self._reconnecting: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_rx = 0.0
        self._closed = False
        self._started = False

    # ------------------------------------------------------------------ connection

    async def start(self, timeout: float = 30.0) -> "InferenceClient":
        """Connect and complete the handshake; raises ``TimeoutError`` or ``Unauthorized``."""
        if self._started:
            return self
        self._loop = asyncio.get_running_loop()
        self._open_socket()
        self._started = True
        try:
            await self._handshake(time.monotonic() + timeout)
        except BaseException:
            self.close()
            raise
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="inference-client-heartbeat"))
        return self

    async def __aenter__(self) -> "InferenceClient":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def _open_socket(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.connect(self.address)
        self._sock = sock
        self._last_rx = time.monotonic()
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._recv_loop(sock), name="inference-client-recv"))

    async def _handshake(self, deadline: float | None) -> None:
        hello = {"role": self.role.value, "token": self.token, "client_id": self.client_id, "acks": True}
        delays = _backoff()
        while True:
            if self._closed:
                raise ConnectionError("client closed")
            waiter = self._loop.create_future()
            self._hello_waiter = waiter
            self._send(Header.HELLO, hello)
            wait = next(delays)
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no answer from a coordinator at {self.address}")
                wait = min(wait, remaining)
            try:
                body = await asyncio.wait_for(asyncio.shield(waiter), max(wait, 0.05))
            except asyncio.TimeoutError:
                continue
            if isinstance(body, Exception):
                raise body
            break
        self._registered = True
        previous = self.coordinator_id
        self.coordinator_id = body["coordinator_id"]
        self.state = body["state"]
        if previous is not None:
            logger.info("reconnected to coordinator %s (was %s): resubmitting %d request(s)", self.coordinator_id,
                        previous, len(self._pending))
        self._resubmit()

    def _resubmit(self) -> None:
        for pending in list(self._pending.values()):
            self._send_submit(pending)
            if pending.aborted:
                self._send(Header.ABORT, {"client_request_id": pending.request_id})
        for header, body, _future in list(self._controls.values()):
            self._send(header, body)

    def _reconnect(self, replace_socket: bool) -> None:
        if self._reconnecting is not None and not self._reconnecting.done():
            return
        self._reconnecting = asyncio.create_task(self._do_reconnect(replace_socket))

    async def _do_reconnect(self, replace_socket: bool) -> None:
        self._registered = False
        if replace_socket:
            old = self._sock
            self._open_socket()
            if old is not None:
                old.close(linger=0)
        try:
            await self._handshake(None)
        except Unauthorized as exc:
            self._fail_all(exc)
        except ConnectionError:
            pass

    def close(self) -> None:
        """Close the connection (not the fleet: that is :meth:`stop`); pending futures fail."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._fail_all(ConnectionError("InferenceClient closed"))

    async def aclose(self) -> None:
        self.close()
        await asyncio.sleep(0)

    def _fail_all(self, exc: BaseException) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(exc)
            if pending.queue is not None:
                pending.queue.put_nowait(exc)
        self._pending.clear()
        for _h, _b, future in self._controls.values():
            if not future.done():
                future.set_exception(exc)
        self._controls.clear()
        for future in self._status_waiters.values():
            if not future.done():
                future.set_exception(exc)
        self._status_waiters.clear()

    def _send(self, header: Header, body: dict[str, Any]) -> bool:
        if self._sock is None:
            return False
        frame = encode(header, body)
        try:
            result = self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if isinstance(result, asyncio.Future) and result.done() and result.exception() is not None:
            return False  # not connected right now: resent after the next handshake
        return True

    # ------------------------------------------------------------------ receiving

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        waiting = zmq.Socket.shadow(sock.underlying)  # the same socket, read without a future per message
        while not self._closed and sock is self._sock:
            try:
                frames = [await sock.recv()]
                while len(frames) < _BATCH:  # what else is waiting, up to a batch
                    frames.append(waiting.recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
            except asyncio.CancelledError:
                return
            except zmq.ZMQError:
                return
            self._last_rx = time.monotonic()
            for frame in frames:
                try:
                    header, body = decode(frame, FROM_COORDINATOR)
                except ProtocolError as exc:
                    logger.warning("dropped frame from the coordinator: %s", exc)
                    continue
                try:
                    self._on_message(header, body)
                except Exception:  # a handler bug must not kill the receive loop
                    logger.exception("error handling %s", header.name)
            if len(frames) == _BATCH:
                await asyncio.sleep(0)  # more may be waiting: let the event loop run first (see _BATCH)

    def _on_message(self, header: Header, body: dict[str, Any]) -> None:
        if header is Header.HELLO_ACK:
            if self._hello_waiter is not None and not self._hello_waiter.done():
                self._hello_waiter.set_result(body)
        elif header is Header.HEARTBEAT:
            if body.get("state"):
                self.state = body["state"]
        elif header is Header.TOKENS:
            pending = self._pending.get(str(body["client_request_id"]))
            if pending is not None and pending.queue is not None:
                tokens = list(body["new_tokens"])
                pending.received.extend(tokens)
                pending.queue.put_nowait(StreamPartial(pending.request_id, tokens, body.get("new_text") or "",
                                                       list(body.get("logprobs") or []),
                                                       new_top_logprobs=top_logprobs_from_wire(
                                                           body.get("top_logprobs") or [])))
        elif header is Header.RESULT:
            crid = body["client_request_id"]
            self._acks.append(crid)
            if not self._ack_scheduled:
                self._ack_scheduled = True
                self._loop.call_soon(self._flush_acks)
            pending = self._pending.pop(str(crid), None)
            if pending is None:
                return  # a duplicate after a reconnect: already delivered
            request = DynamicInferenceRequest.from_dict(body["request"])
            request.request_id = pending.request_id
            if not pending.future.done():
                pending.future.set_result(request)
            if pending.queue is not None:
                pending.queue.put_nowait(request)
        elif header is Header.CONTROL_ACK:
            entry = self._controls.pop(str(body["control_id"]), None)
            self.state = body["state"]
            if entry is not None and not entry[2].done():
                entry[2].set_result({"state": body["state"], "detail": body.get("detail") or {}})
        elif header is Header.STATUS_REPLY:
            future = self._status_waiters.pop(body.get("status_id"), None)
            self.state = body["state"]
            if future is not None and not future.done():
                future.set_result(body)
        elif header is Header.ERROR:
            self._on_error(body)

    def _on_error(self, body: dict[str, Any]) -> None:
        code, message = body["code"], body["message"]
        if code == ErrorCode.UNAUTHORIZED.value:
            exc = Unauthorized(code, message)
            if self._hello_waiter is not None and not self._hello_waiter.done():
                self._hello_waiter.set_result(exc)
            else:
                self._fail_all(exc)
            return
        if code == ErrorCode.HELLO_REQUIRED.value:
            if self._registered:
                logger.warning("coordinator does not know this client (restarted?): connecting again")
                self._reconnect(replace_socket=False)
            return
        if body.get("control_id") is not None:
            entry = self._controls.pop(str(body["control_id"]), None)
            if entry is not None and not entry[2].done():
                entry[2].set_exception(ControlError(code, message))
            return
        if body.get("client_request_id") is not None:
            pending = self._pending.pop(str(body["client_request_id"]), None)
            if pending is not None:
                exc = ValueError(message) if code == ErrorCode.INVALID_REQUEST.value else CoordinatorError(code, message)
                if not pending.future.done():
                    pending.future.set_exception(exc)
                if pending.queue is not None:
                    pending.queue.put_nowait(exc)
            return
        logger.warning("coordinator error %s: %s", code, message)

    def _flush_acks(self) -> None:
        self._ack_scheduled = False
        if self._acks:
            acks, self._acks = self._acks, []
            self._send(Header.RESULT_ACK, {"client_request_ids": acks})

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.heartbeat_interval)
            if not self._registered:
                continue
            self._send(Header.HEARTBEAT, {})
            silent = time.monotonic() - self._last_rx
            if silent > self.coordinator_timeout:
                logger.warning("coordinator silent for %.1fs: reconnecting", silent)
                self._reconnect(replace_socket=True)

    # ------------------------------------------------------------------ requests

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("InferenceClient is not started (await client.start()) or was closed")

    def _new_pending(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None,
                     request_id: str | None, stream: bool, images: list[bytes | PromptImage] | None) -> _Pending:
        self._require_started()
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params.to_dict()
        else:
            params = SamplingParams.from_dict(sampling_params).to_dict()  # validates: ValueError naming the field
        if not isinstance(prompt, str):
            prompt = [int(t) for t in prompt]
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already pending")
        pending = _Pending(request_id, prompt, params, stream, self._loop.create_future(),
                           asyncio.Queue() if stream else None)
        if images:
            pending.images = [(image if isinstance(image, PromptImage) else PromptImage(bytes(image))).to_wire()
                              for image in images]
            encode(Header.SUBMIT, self._submit_body(pending))  # too large a frame: ValueError here, nothing sent
        self._pending[request_id] = pending
        self._send_submit(pending)
        return pending

    @staticmethod
    def _submit_body(pending: _Pending) -> dict[str, Any]:
        body: dict[str, Any] = {"client_request_id": pending.request_id, "prompt": pending.prompt,
                                "sampling_params": pending.sampling_params, "stream": pending.stream}
        if pending.received:
            body["generated_tokens"] = pending.received
        if pending.images:
            body["images"] = pending.images
        return body

    def _send_submit(self, pending: _Pending) -> None:
        self._send(Header.SUBMIT, self._submit_body(pending))

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None, *,
                    request_id: str | None = None, images: list[bytes | PromptImage] | None = None
                    ) -> "asyncio.Future[DynamicInferenceRequest]":
        """Submit one prompt; the future resolves to the finished ``DynamicInferenceRequest``.

        Failed requests (too long, aborted) resolve normally with ``status`` FAILED; a request the
        coordinator cannot accept at all (bad sampling values, empty prompt) raises ``ValueError``.
        ``images`` (vision-language models): image files, one per image placeholder of the prompt
        (the coordinator expands them), or ``PromptImage``s already placed in token-id prompts.
        """
        return self._new_pending(prompt, sampling_params, request_id, False, images).future

    async def add_request_streaming(self, prompt: str | list[int],
                                    sampling_params: SamplingParams | dict | None = None, *,
                                    request_id: str | None = None, images: list[bytes | PromptImage] | None = None
                                    ) -> AsyncIterator[StreamPartial | DynamicInferenceRequest]:
        """Yield a :class:`StreamPartial` per engine step, then the final request.

        Leaving the loop early (``break``, cancellation) aborts the request. ``images``: as :meth:`add_request`.
        """
        pending = self._new_pending(prompt, sampling_params, request_id, True, images)

        def abandon() -> None:
            if not self._closed:
                self.abort(pending.request_id)

        async for item in iterate_stream(pending.queue, abandon):
            yield item

    def abort(self, request_id: str) -> None:
        """Abort a pending request; its future resolves with ``finish_reason`` ``abort``."""
        pending = self._pending.get(str(request_id))
        if pending is None:
            return
        pending.aborted = True
        self._send(Header.ABORT, {"client_request_id": pending.request_id})

    @property
    def connected(self) -> bool:
        """Registered with a coordinator that answered within ``coordinator_timeout`` (for readiness probes)."""
        return (self._registered and not self._closed
                and time.monotonic() - self._last_rx < self.coordinator_timeout)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ lifecycle and status

    async def _control(self, header: Header, timeout: float | None, **extra: Any) -> dict[str, Any]:
        self._require_started()
        control_id = uuid.uuid4().hex
        body = {"control_id": control_id, **{k: v for k, v in extra.items() if v is not None}}
        future = self._loop.create_future()
        self._controls[control_id] = (header, body, future)
        self._send(header, body)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(control_id, None)

    async def pause(self, timeout: float | None = None) -> dict[str, Any]:
        """PAUSE: engines stop stepping at a step boundary and keep their memory."""
        return await self._control(Header.PAUSE, timeout)

    async def unpause(self, timeout: float | None = None) -> dict[str, Any]:
        """UNPAUSE: back to RUNNING (also restarts a STOPPED fleet once engines joined again)."""
        return await self._control(Header.UNPAUSE, timeout)

    async def suspend(self, level: int = 1, timeout: float | None = None) -> dict[str, Any]:
        """SUSPEND: release the KV cache (level 2: also weights to host); pauses first if RUNNING."""
        return await self._control(Header.SUSPEND, timeout, level=level)

    async def resume(self, timeout: float | None = None) -> dict[str, Any]:
        """RESUME: restore device memory; the fleet is then PAUSED (UNPAUSE to run)."""
        return await self._control(Header.RESUME, timeout)

    async def stop(self, timeout: float | None = None, drain_timeout: float | None = None) -> dict[str, Any]:
        """The STOP verb: every engine drains and exits. (To close this client, use :meth:`close`.)"""
        return await self._control(Header.STOP, timeout, drain_timeout=drain_timeout)

    async def refit(self, source: str, epoch: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """REFIT (fleet PAUSED or SUSPENDED): every engine loads the weights in model directory ``source``.

        ``source`` is a path as the engines see it; its shapes must equal the served model's.
        ``epoch`` (default: the current one + 1) is the generation recorded for the new weights and
        reported with every token generated under them. The coordinator verifies the source on every
        engine before any engine loads it: a mismatch raises :class:`ControlError` (code
        ``refit_failed``) naming the engine and the problem, and the fleet keeps its old weights.
        The acknowledgement's ``detail`` holds ``epoch``, ``source`` and per-engine timings
        (``verify_s``, ``load_s``, ``total_s``).
        """
        if not isinstance(source, str) or not source:
            raise ValueError("source must be a non-empty model directory path")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        return await self._control(Header.REFIT, timeout, source=source, epoch=epoch)

    async def status(self, timeout: float | None = 10.0) -> dict[str, Any]:
        """The ``STATUS_REPLY`` fields: state, engines, queued, in_flight, completed, failed, ..."""
        self._require_started()
        status_id = next(self._status_ids)
        future = self._loop.create_future()
        self._status_waiters[status_id] = future
        self._send(Header.STATUS, {"status_id": status_id})
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._status_waiters.pop(status_id, None)

    async def wait_for_engines(self, count: int, timeout: float = 120.0, poll: float = 0.1) -> dict[str, Any]:
        """Poll ``status()`` until at least ``count`` engines are registered; returns the last status."""
        deadline = time.monotonic() + timeout
        while True:
            status = await self.status()
            if len(status["engines"]) >= count:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(status['engines'])} of {count} engine(s) registered after {timeout:.0f}s")
            await asyncio.sleep(poll)

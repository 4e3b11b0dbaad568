"""``InferenceClient``: the asyncio client of the coordinator protocol (docs/wire-protocol.md).

Its socket and the tasks that read, send and reconnect are its :class:`~.link.ClientLink`, on the event loop
that called :meth:`InferenceClient.start`. The client keeps every request it submitted until its final
``RESULT`` arrives, so that a lost or restarted coordinator costs nothing but time: the client
reconnects with backoff, says HELLO again with the same ``client_id`` (so the coordinator routes
undelivered results to the new connection) and resubmits what is still pending — a streaming
request continues from the tokens already received, so no token is delivered twice. Results are
acknowledged (``RESULT_ACK``) so that the coordinator can forget them.

The client makes the text (:mod:`megatron_serve.client.output_processor`) from the ids the coordinator
sends, and stop strings end a request here (it then aborts it in the fleet). Its tokenizer: ``tokenizer=``
(a ``Tokenizer`` or a directory of tokenizer files), else the coordinator's tokenizer directory (in
``HELLO_ACK``) when this machine can read it; with neither, texts stay empty, and text prompts and stop
strings are refused (``ValueError``). Prompts are tokenized and their images placed here
(:func:`~.prompts.prompt_for_fleet`): the coordinator loads no tokenizer.

Naming: ``stop()`` is the lifecycle verb STOP (the fleet drains and its engines exit);
``close()`` / ``aclose()`` close this client's connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from ..errors import ClientNotStarted
from ..wire.connection import Connection, ControlError, CoordinatorError, CoordinatorLost, Unauthorized
from .link import ClientLink
from ..limits import DEFAULT_COORDINATOR_GRACE, KeptIdsMeter
from ..wire.handshake import PROTOCOL_VERSION, SUBMIT_PROTOCOL, Error, HelloAck
from ..wire.placement import PLACEMENT_PROTOCOL, Placement, PlacementError
from ..multimodal import PromptImage
from .output_processor import OutputCollector, check_params, load_tokenizer
from .prompts import ImagePrompt, Prompt, prompt_for_fleet
from ..wire.protocol import ErrorCode, Header, Role, encode
from ..wire.security import FleetSecret, PeerKeys, TokenFrom, fleet_secret, hello_credentials, refused_message
from .outputs import StreamPartial
from .pending_requests import PendingRequest, PendingRequests
from ..wire.request import DynamicInferenceRequest
from .streams import Sink, iterate_stream
from .verbs import FleetVerbs
from ..wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.client")

__all__ = ["InferenceClient", "CoordinatorError", "CoordinatorLost", "ControlError", "Unauthorized", "StreamPartial"]


class InferenceClient(FleetVerbs):
    """Asyncio client of a coordinator at ``address`` (``tcp://host:port``).

    ``token``: the fleet secret (``None``: an ``--insecure`` coordinator; not given: ``$MEGATRON_SERVE_TOKEN``).
    ``role``: ``"client"`` (submit and control) or ``"control"`` (control and status only). ``coordinator_timeout``:
    with no message from the coordinator for that long (it answers every heartbeat), reconnect.
    ``coordinator_grace``: a lost coordinator (or its replacement) back within that many seconds gets
    every pending request again; past it, each pending request and verb (and any new one until a
    coordinator answers) fails with :class:`CoordinatorLost` (41 of 43 streams hung 90 s before).
    ``tokenizer``: what makes the text of results (see the module docstring).
    """

    def __init__(
        self,
        address: str,
        token: str | FleetSecret | None | TokenFrom = TokenFrom.ENVIRONMENT,
        *,
        role: str = Role.CLIENT.value,
        client_id: str | None = None,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 5.0,
        coordinator_grace: float = DEFAULT_COORDINATOR_GRACE,
        tokenizer: "Tokenizer | str | os.PathLike | None" = None,
    ) -> None:
        self.address = address
        self.tokenizer: Tokenizer | None = None if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        self._tokenizer_dir = os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None
        self.secret = fleet_secret(token)  # WeakSecret (a ValueError) for a guessable one
        self.role = Role(role)
        self.client_id = client_id or uuid.uuid4().hex
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.coordinator_id: str | None = None
        self.state: str | None = None  # last fleet state the coordinator told us
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = PendingRequests()
        self._controls: dict[str, tuple[Header, dict[str, Any], asyncio.Future]] = {}
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._status_ids = itertools.count(1)
        # Request ids the caller did not choose: a random prefix per client and a counter (uuid4 per
        # request cost 6.5% of the client's time at 64 requests in flight: a urandom call each).
        self._auto_ids = f"{uuid.uuid4().hex[:12]}-"
        self._request_numbers = itertools.count()
        keys = PeerKeys()  # this client's identity, kept across its reconnects
        self._connection = Connection({"role": self.role.value, "client_id": self.client_id, "acks": True,
                                       **hello_credentials(self.secret, keys)},
                                      heartbeat_interval=heartbeat_interval, coordinator_timeout=coordinator_timeout,
                                      grace=coordinator_grace,
                                      refusal=refused_message(address, self.secret is not None))
        self._link = ClientLink(self.secret, keys, self._connection, on_message=self._on_message,
                                on_refused=self._refused, on_lost=self._on_lost)
        self._registration: asyncio.Future | None = None  # start() waits on it: HELLO_ACK, or Unauthorized
        self._started = False

    # ------------------------------------------------------------------ connection

    async def start(self, timeout: float = 30.0) -> "InferenceClient":
        """Connect and complete the handshake; raises ``TimeoutError`` or ``Unauthorized``."""
        if self._started:
            return self
        self._loop = asyncio.get_running_loop()
        self._registration = self._loop.create_future()
        self._started = True
        self._link.start(self.address)
        try:
            await asyncio.wait_for(asyncio.shield(self._registration), timeout)
            if self.tokenizer is None and self.role is Role.CLIENT:
                self.tokenizer = await asyncio.to_thread(load_tokenizer, self._tokenizer_dir, self._offered_tokenizer())
        except asyncio.TimeoutError:
            self.close()
            raise TimeoutError(f"no answer from a coordinator at {self.address}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _offered_tokenizer(self) -> str | None:
        ack = self._connection.ack
        return None if ack is None else ack.tokenizer

    async def __aenter__(self) -> "InferenceClient":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def _refused(self, exc: Unauthorized) -> None:
        """The coordinator refused this client (its handshake, or its identity): retrying cannot help."""
        if self._registration is not None and not self._registration.done():
            self._registration.set_exception(exc)  # start() raises it
        else:
            self._fail_all(exc)
            self.close()

    def _on_lost(self, lost: CoordinatorLost) -> None:
        """The coordinator has been gone past the grace period: what waits on it ends."""
        if self._pending or self._controls:
            logger.error("%s: %d request(s) and %d verb(s) end", lost, len(self._pending), len(self._controls))
            self._fail_all(lost)

    def _on_registered(self, ack: HelloAck) -> None:
        """A new session: remember who answered, resubmit everything still pending."""
        previous = self.coordinator_id
        self.coordinator_id = ack.coordinator_id
        self.state = ack.state
        if previous is not None:
            logger.info("reconnected to coordinator %s (was %s): resubmitting %d request(s)", self.coordinator_id,
                        previous, len(self._pending))
        if ack.protocol < SUBMIT_PROTOCOL and self.role is Role.CLIENT:
            self._pending.fail_all(CoordinatorError(ErrorCode.UNSUPPORTED.value, self._old_coordinator(ack)))
        for pending in self._pending:
            self._send_submit(pending)
            if pending.aborted:
                self._send(Header.ABORT, {"client_request_id": pending.request_id})
        for header, body, _future in list(self._controls.values()):
            self._send(header, body)
        for status_id in self._status_waiters:  # asked while no coordinator listened
            self._send(Header.STATUS, {"status_id": status_id})
        if self._registration is not None and not self._registration.done():
            self._registration.set_result(None)

    @staticmethod
    def _old_coordinator(ack: HelloAck) -> str:
        return (f"coordinator {ack.coordinator_id} speaks protocol {ack.protocol}; this client speaks "
                f"{PROTOCOL_VERSION} and submits to coordinators of {SUBMIT_PROTOCOL} or later (tokens travel only "
                f"as STEP_TOKENS, and the client makes the text): upgrade the coordinator")

    def close(self) -> None:
        """Close the connection (not the fleet: that is :meth:`stop`); pending futures fail."""
        if self._link.closed:
            return
        self._link.close()
        self._fail_all(ConnectionError("InferenceClient closed"))

    async def aclose(self) -> None:
        """:meth:`close`, then wait until the connection's tasks have ended."""
        self.close()
        await self._link.wait_closed()

    def _fail_all(self, exc: BaseException) -> None:
        self._pending.fail_all(exc)
        for _h, _b, future in self._controls.values():
            if not future.done():
                future.set_exception(exc)
        self._controls.clear()
        for future in self._status_waiters.values():
            if not future.done():
                future.set_exception(exc)
        self._status_waiters.clear()

    def _send(self, header: Header, body: dict[str, Any]) -> None:
        self._link.send(header, body)

    # ------------------------------------------------------------------ receiving

    def _on_message(self, header: Header, body: Any) -> None:
        if header is Header.STEP_TOKENS:  # a step's deltas of this client's requests (or catch-ups: starts)
            on_delta = self._pending.on_delta
            if body.starts is None:
                for client_request_id, delta in zip(body.client_request_ids, body.deltas):
                    stopped = on_delta(client_request_id, delta)
                    if stopped is not None:  # a stop string ended it here: its engine drops it
                        self._send(Header.ABORT, {"client_request_id": stopped.request_id})
                return
            for client_request_id, delta, start in zip(body.client_request_ids, body.deltas, body.starts):
                stopped = on_delta(client_request_id, delta, start)
                if stopped is not None:
                    self._send(Header.ABORT, {"client_request_id": stopped.request_id})
        elif header is Header.HELLO_ACK:
            self._on_registered(body)
        elif header is Header.HEARTBEAT:
            if body.state:
                self.state = body.state
        elif header is Header.RESULT:
            self._link.acknowledge(body.client_request_id)
            self._pending.on_final(body.client_request_id, body.request)
        elif header is Header.CONTROL_ACK:
            entry = self._controls.pop(str(body.control_id), None)
            self.state = body.state
            if entry is not None and not entry[2].done():
                entry[2].set_result({"state": body.state, "detail": body.detail or {}})
        elif header is Header.STATUS_REPLY:
            future = self._status_waiters.pop(body.status_id, None)
            self.state = body.state
            if future is not None and not future.done():
                future.set_result(msgspec.structs.asdict(body))
        elif header is Header.ERROR:
            self._on_error(body)

    def _on_error(self, body: Error) -> None:
        code, message = body.code, body.message
        if body.control_id is not None:
            entry = self._controls.pop(str(body.control_id), None)
            if entry is not None and not entry[2].done():
                entry[2].set_exception(ControlError(code, message, body.detail))
            return
        if body.client_request_id is not None:
            exc = (ValueError(message) if code == ErrorCode.INVALID_REQUEST.value else PlacementError(message)
                   if code == ErrorCode.INVALID_PLACEMENT.value else CoordinatorError(code, message))
            self._pending.fail(body.client_request_id, exc)
            return
        logger.warning("coordinator error %s: %s", code, message)

    # ------------------------------------------------------------------ requests

    def _require_started(self) -> None:
        if not self._started or self._link.closed:
            raise ClientNotStarted("InferenceClient is not started (await client.start()) or was closed")

    def _require_coordinator(self) -> None:
        """Refuse new work while the coordinator has been lost for longer than the grace period."""
        lost = self._connection.lost(time.monotonic(), self.address)
        if lost is not None:
            raise lost

    def _new_pending(self, prompt: Prompt, sampling_params: SamplingParams | dict | None,
                     request_id: str | None, stream: bool, images: list[bytes | PromptImage] | None,
                     sink: Sink | None = None, placement: Placement | None = None,
                     meter: KeptIdsMeter | None = None) -> PendingRequest:
        self._require_started()
        self._require_coordinator()
        if isinstance(prompt, ImagePrompt):  # what MegatronAsyncLLM hands on for a prompt dict with images
            prompt, images = prompt.prompt, [*prompt.images, *(images or ())]
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params
        else:
            params = SamplingParams.from_dict(sampling_params)  # validates: ValueError naming the field
        check_params(params, self.tokenizer)
        ack = self._connection.ack
        if ack is not None and ack.protocol < SUBMIT_PROTOCOL:
            raise CoordinatorError(ErrorCode.UNSUPPORTED.value, self._old_coordinator(ack))
        placement = self._placement_for(ack, placement)
        tokens, placed = prompt_for_fleet(prompt, list(images or ()), self.tokenizer)
        request_id = str(request_id) if request_id is not None else f"{self._auto_ids}{next(self._request_numbers)}"
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already pending")
        collector = OutputCollector(request_id, prompt if isinstance(prompt, str) else tokens, params, self.tokenizer,
                                    prompt_tokens=tokens)
        pending = PendingRequest(request_id, tokens, params, stream, self._loop.create_future(), collector,
                                 sink if sink is not None else asyncio.Queue() if stream else None, placement=placement,
                                 meter=meter)
        if placed:
            pending.images = [image.to_wire() for image in placed]
            encode(Header.SUBMIT, pending.submit_body())  # too large a frame: ValueError here, nothing sent
        self._pending.add(pending)
        self._send_submit(pending)
        return pending

    @staticmethod
    def _placement_for(ack: HelloAck | None, placement: Placement | None) -> Placement | None:
        """What of ``placement`` the coordinator reads: all of it from protocol 7 on; before, a session is left out (a
        hint) and a rank refused (an older coordinator would run the request anywhere)."""
        if placement is None or ack is None or ack.protocol >= PLACEMENT_PROTOCOL:
            return placement
        if placement.data_parallel_rank is not None:
            raise CoordinatorError(ErrorCode.UNSUPPORTED.value, (
                f"coordinator {ack.coordinator_id} speaks protocol {ack.protocol}; a data-parallel rank needs "
                f"{PLACEMENT_PROTOCOL} or later (this client speaks {PROTOCOL_VERSION}): upgrade the coordinator"))
        return None

    def _send_submit(self, pending: PendingRequest) -> None:
        self._send(Header.SUBMIT, pending.submit_body())

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | dict | None = None, *,
                    request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                    placement: Placement | None = None, meter: KeptIdsMeter | None = None
                    ) -> "asyncio.Future[DynamicInferenceRequest]":
        """Submit one prompt; the future resolves to the finished ``DynamicInferenceRequest``.

        Failed requests (too long, aborted) resolve normally with ``status`` FAILED; a request the
        coordinator cannot accept at all (bad sampling values, empty prompt) raises ``ValueError``.
        ``images`` (vision-language models): image files, one per image placeholder of the prompt
        (placed here, by the model's processor), or ``PromptImage``s already placed in token-id prompts.
        ``placement``: its session (kept on one engine) and data-parallel rank (pinned to one): docs/kv-routing.md; a
        rank no engine holds raises :class:`~megatron_serve.wire.placement.PlacementError` (a ``ValueError``).
        ``meter``: its request's kept ids' budget, counted here as they arrive (perhaps shared with the request's other
        choices): past it the request ends FAILED, reason ``length``, and its engine drops it.
        """
        return self._new_pending(prompt, sampling_params, request_id, False, images, placement=placement,
                                 meter=meter).future

    async def add_request_streaming(self, prompt: Prompt,
                                    sampling_params: SamplingParams | dict | None = None, *,
                                    request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                                    placement: Placement | None = None
                                    ) -> AsyncIterator[StreamPartial | DynamicInferenceRequest]:
        """Yield a :class:`StreamPartial` per engine step, then the final request.

        Leaving the loop early (``break``, cancellation) aborts the request. ``images``, ``placement``: as
        :meth:`add_request`.
        """
        pending = self._new_pending(prompt, sampling_params, request_id, True, images, placement=placement)

        def abandon() -> None:
            if not self._link.closed:
                self.abort(pending.request_id)

        async for item in iterate_stream(pending.queue, abandon):
            yield item

    def add_request_streaming_to(self, prompt: Prompt, sampling_params: SamplingParams | dict | None, sink: Sink, *,
                                 request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                                 placement: Placement | None = None, meter: KeptIdsMeter | None = None) -> str:
        """Submit one prompt whose :class:`StreamPartial` items, final request or error the receive loop puts straight
        into ``sink`` (no task per stream, as :meth:`add_request_streaming` needs: a wake-up less per chunk for
        the HTTP server); returns its id. The caller aborts it (:meth:`abort`) when it stops listening. ``meter``: as
        :meth:`add_request`."""
        return self._new_pending(prompt, sampling_params, request_id, True, images, sink, placement, meter).request_id

    def abort(self, request_id: str) -> None:
        """Abort a pending request; its future resolves with ``finish_reason`` ``abort``."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        pending.aborted = True
        self._send(Header.ABORT, {"client_request_id": pending.request_id})

    @property
    def connected(self) -> bool:
        """Registered with a coordinator that answered within ``coordinator_timeout`` (for readiness probes)."""
        return (self._connection.registered and not self._link.closed
                and self._connection.silent_for(time.monotonic()) < self.coordinator_timeout)

    def silent_for(self) -> float | None:
        """Seconds since the coordinator last sent this client anything (it answers every heartbeat), None while the
        client is not registered with one: what a supervisor's liveness check reads (:mod:`~..fleet.coordinator_watch`)."""
        if not self._connection.registered or self._link.closed:
            return None
        return self._connection.silent_for(time.monotonic())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ lifecycle and status

    async def _control(self, header: Header, timeout: float | None, **extra: Any) -> dict[str, Any]:
        self._require_started()
        self._require_coordinator()
        control_id = uuid.uuid4().hex
        body = {"control_id": control_id, **{k: v for k, v in extra.items() if v is not None}}
        future = self._loop.create_future()
        self._controls[control_id] = (header, body, future)
        self._send(header, body)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(control_id, None)

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

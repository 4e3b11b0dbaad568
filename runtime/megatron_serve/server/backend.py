"""What the server calls on the client it serves from: one protocol, the union of every route's calls.

Two clients implement it: :class:`~megatron_serve.client.coordinator_client.InferenceClient` (a fleet behind a
coordinator; ``FleetClient`` too) and :class:`~megatron_serve.client.local_engine.LocalEngineClient` (an engine in
this process: ``MegatronAsyncLLM.client`` in direct mode, whose fleet verbs raise ``NoFleet``). The routes, the fleet
monitor, the submissions and the RL routes all read this one list, so a backend either has a call or is not a
backend: nothing is probed for at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the server's modules that hold a backend import nothing more through this one
    import asyncio

    from ..client.streams import Sink
    from ..limits import KeptIdsMeter
    from ..multimodal import PromptImage
    from ..wire.lifecycle import Verb
    from ..wire.placement import Placement
    from ..wire.request import DynamicInferenceRequest
    from ..wire.sampling_params import SamplingParams


class Backend(Protocol):
    """The client behind the server (see the module docstring)."""

    async def start(self, timeout: float = ...) -> Any:
        """Be ready for requests (connect, start engines); the fleet monitor starts it in the background."""

    @property
    def connected(self) -> bool:
        """Whether whatever it serves from spoke lately (a coordinator's frames; an engine in this process always
        does): a status that comes late then means busy, not unreachable (:mod:`.fleet`)."""

    def add_request(self, prompt: list[int], sampling_params: SamplingParams, *, request_id: str | None = None,
                    images: list[PromptImage] | None = None, placement: Placement | None = None,
                    meter: KeptIdsMeter | None = None) -> "asyncio.Future[DynamicInferenceRequest]":
        """Submit one prompt; the future resolves to the finished request. ``meter``: its HTTP request's kept ids'
        budget, counted as the ids arrive and shared by the request's engine requests (past it each ends FAILED,
        reason ``length``)."""

    def add_request_streaming_to(self, prompt: list[int], sampling_params: SamplingParams, sink: Sink, *,
                                 request_id: str | None = None, images: list[PromptImage] | None = None,
                                 placement: Placement | None = None, meter: KeptIdsMeter | None = None) -> str:
        """Submit one prompt whose pieces, final request or error go straight into ``sink`` as they arrive (no task
        per stream); its id. The caller aborts it when it stops listening. ``meter``: as :meth:`add_request`."""

    def abort(self, request_id: str) -> None:
        """Abort a pending request: it finishes with ``finish_reason`` ``abort``."""

    async def status(self, timeout: float | None = ...) -> dict[str, Any]:
        """The ``STATUS_REPLY`` fields: state, engines, queued, in_flight, completed, failed, ..."""

    async def control(self, verb: Verb | str, timeout: float | None = ..., **arguments: Any) -> dict[str, Any]:
        """Run a lifecycle verb with its arguments (:mod:`megatron_serve.wire.verb_calls`)."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Serve the PEFT adapter in ``lora_path`` as ``lora_name``."""

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Stop serving ``lora_name`` to new requests."""

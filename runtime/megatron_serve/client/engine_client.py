"""The engine-client interface: what ``MegatronAsyncLLM`` needs from where requests run (the HTTP server reads the
same clients through :class:`megatron_serve.server.backend.Backend`).

Two implementations, chosen once when a ``MegatronAsyncLLM`` is built:

* :class:`~megatron_serve.client.local_engine.LocalEngineClient`: an engine in this process, stepped on a
  thread of its own (direct mode). It has no fleet: the fleet's lifecycle verbs raise ``NoFleet``.
* :class:`~megatron_serve.api.fleet_client.FleetClient`: the coordinator client
  (:class:`~megatron_serve.client.coordinator_client.InferenceClient`) of a fleet at an address, or of a local fleet
  it starts itself (coordinator mode).

Everything above them (``generate``, streaming, the lifecycle, ``refit``, ``serve()``) is written
once against this interface. Streams yield :mod:`megatron_serve.client.outputs` items.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Protocol

from ..wire.lifecycle import Verb
from ..multimodal import PromptImage
from .outputs import StreamItem
from .prompts import Prompt
from ..wire.placement import Placement
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class EngineClient(Protocol):
    """See the module docstring; every method may be called once :meth:`start` returned."""

    async def start(self, timeout: float = ...) -> Any:
        """Be ready for requests (connect, start engines); idempotent."""

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, *, request_id: str | None = None,
                    images: list[bytes | PromptImage] | None = None, placement: Placement | None = None
                    ) -> "asyncio.Future[DynamicInferenceRequest]":
        """Submit one prompt; the future resolves to the finished request (``status`` FAILED when it failed).

        ``images`` (vision-language models): image files, one per image placeholder of the prompt, or
        ``PromptImage``s already placed in token ids (what the HTTP server sends); or pass an
        ``ImagePrompt`` as ``prompt``. ``placement``: its session and data-parallel rank (``wire.placement``).
        """

    def add_request_streaming(self, prompt: Prompt, sampling_params: SamplingParams, *,
                              request_id: str | None = None, images: list[bytes | PromptImage] | None = None,
                              placement: Placement | None = None) -> AsyncIterator[StreamItem]:
        """Partials as tokens are generated, then the finished request; leaving early aborts it."""

    def abort(self, request_id: str) -> None:
        """Abort a pending request: it finishes with ``finish_reason`` ``abort``."""

    async def status(self, timeout: float | None = ...) -> dict[str, Any]:
        """The ``STATUS_REPLY`` fields: state, engines, queued, in_flight, completed, failed, ..."""

    async def control(self, verb: Verb | str, timeout: float | None = ..., **arguments: Any) -> dict[str, Any]:
        """Run a lifecycle verb with its arguments (:mod:`megatron_serve.wire.verb_calls` lists both); answered like
        ``CONTROL_ACK``. Without a fleet only the table's direct verbs run (refit, the LoRA adapters)."""

    async def refit_tensors(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]],
                            epoch: int | None = ...) -> dict[str, Any]:
        """New values for these weights (Hugging Face names, full shapes, any subset); answered like ``refit``."""

    async def shutdown(self) -> None:
        """The Python API's ``shutdown()`` (docs/python-api.md): stop a fleet this client started, or disconnect from one it did not."""

    async def aclose(self) -> None:
        """Release everything this client holds (what ``close``/``async with`` do)."""

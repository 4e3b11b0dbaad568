"""The public request record, and the two typed shapes a request crosses processes in.

:class:`DynamicInferenceRequest` is the public result: built once where the caller reads it, by the client's
output collector from the deltas and the final record (``client.output_processor``), or, for Megatron's expert
API that drives an engine directly, by the engine's one adapter (``engine.expert_api``). What travels is typed
(msgspec, checked where it is decoded): :class:`EngineRequest` to an engine (``ENGINE_SUBMIT``: what was asked,
and the tokens a continuation starts from; an engine builds its own state from it), and :class:`FinalRecord`
back (how the request went: neither what travelled step by step in the deltas, ``wire.deltas.RequestDelta``, nor
the prompt its receiver sent).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Protocol

import msgspec

from .expert_routing import routing_from_wire, routing_to_wire
from .prompt_image import PromptImage
from .sampling_params import SamplingParams
from .submission import WireImage

if TYPE_CHECKING:  # numpy: where routing rows are read (wire.expert_routing)
    import numpy as np


class RequestStatus(str, enum.Enum):
    WAITING_IN_QUEUE = "WAITING_IN_QUEUE"
    ACTIVE = "ACTIVE"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class FinishReason(str, enum.Enum):
    """Why a request ended: a ``str`` whose value is vLLM's and OpenAI's word, so ``reason == "stop"``,
    ``json.dumps`` and msgpack give the plain string, as vLLM's ``finish_reason`` is one.

    ``str()``, ``format()`` and f-strings give the value too: Python 3.11 changed a ``str`` enum's
    ``format()`` to the member's name (``FinishReason.STOP``), so both are fixed here, the same on
    every supported version (``enum.StrEnum`` would need 3.11).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class EventType(str, enum.Enum):
    ADD = "ADD"
    PREFILL = "PREFILL"
    FIRST_TOKEN = "FIRST_TOKEN"
    PREEMPT = "PREEMPT"
    EVICT = "EVICT"
    FINISH = "FINISH"
    FAIL = "FAIL"


class RequestEvent(msgspec.Struct):
    """Something that happened to a request, when (``time.time()``), and a word on why."""

    type: EventType
    timestamp: float
    detail: str | None = None


class RoutingArray(msgspec.Struct):
    """Expert-routing rows as they travel (``expert_routing``: ``shape`` [rows, MoE layers, top_k])."""

    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    dtype: str
    data: bytes

    @classmethod
    def of(cls, rows: np.ndarray) -> "RoutingArray":
        return cls(**routing_to_wire(rows))

    def array(self) -> np.ndarray:
        """The rows; ``ValueError`` naming what is wrong with them."""
        return routing_from_wire(msgspec.structs.asdict(self))


TokenIds = list[Annotated[int, msgspec.Meta(ge=0)]]


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request as the coordinator hands it to an engine (``ENGINE_SUBMIT``), built from its mirror.

    A request moved to another engine carries the tokens, events and expert rows it has so far: the
    engine continues from them. Image files go with every dispatch, placed in ``prompt_tokens``.
    """

    request_id: str
    prompt_tokens: TokenIds  # tokenized (and images placed) in the caller's process
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    generated_tokens: TokenIds = msgspec.field(default_factory=list)
    events: list[RequestEvent] = msgspec.field(default_factory=list)
    arrival_time: float
    images: list[WireImage] = msgspec.field(default_factory=list)
    routing_indices: RoutingArray | None = None


class EngineRequestOut(EngineRequest, frozen=True, kw_only=True, omit_defaults=True):
    """:class:`EngineRequest` as the coordinator writes it: the client's sampling-parameter bytes, spliced in
    unparsed (they were checked once, on arrival)."""

    sampling_params: msgspec.Raw


class FinalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """How a finished request went, and nothing its receiver has: not what travelled step by step with the
    tokens (the generated tokens, their log probs, epochs and expert rows, the prompt scores), which the receiver
    accumulated, nor the prompt, which it sent. The receiver builds the public result once, from its own and this
    (:meth:`megatron_serve.client.output_processor.OutputCollector.finish`); a coordinator forwards it as it came."""

    request_id: str
    cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING_IN_QUEUE
    finish_reason: FinishReason | None = None
    error: str | None = None
    events: list[RequestEvent] = msgspec.field(default_factory=list)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def failed(self, message: str) -> "FinalRecord":
        """This record as a failure now (every request an engine held fails with a failed step)."""
        now = time.time()
        return msgspec.structs.replace(self, status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR,
                                       error=message, events=[*self.events, RequestEvent(EventType.FAIL, now, message)],
                                       finish_time=now)


class Timeline(Protocol):
    """What a request's events stamp: the engine's ``Sequence`` and the public record keep the same times and
    end the same way."""

    events: list[RequestEvent]
    first_token_time: float | None
    finish_time: float | None
    status: RequestStatus
    finish_reason: FinishReason | None
    error: str | None


def stamp_event(timeline: Timeline, event_type: EventType, detail: str | None = None) -> None:
    """Append one event at the current time, and note the first token's and the finish's times."""
    now = time.time()
    timeline.events.append(RequestEvent(event_type, now, detail))
    if event_type is EventType.FIRST_TOKEN and timeline.first_token_time is None:
        timeline.first_token_time = now
    elif event_type in (EventType.FINISH, EventType.FAIL):
        timeline.finish_time = now


def fail_timeline(timeline: Timeline, message: str, reason: FinishReason) -> None:
    """The request failed: its status, reason and message, and the FAIL event that says so."""
    timeline.status = RequestStatus.FAILED
    timeline.finish_reason = reason
    timeline.error = message
    stamp_event(timeline, EventType.FAIL, message)


@dataclass
class DynamicInferenceRequest:
    """Public result object: what was asked, what came out, and how it went."""

    request_id: str
    prompt: str | None
    prompt_tokens: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    generated_tokens: list[int] = field(default_factory=list)
    generated_text: str | None = None
    generated_log_probs: list[float] = field(default_factory=list)
    generated_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With return_top_p_token_ids: the ids the filters kept at each generated token (none without a filter)
    generated_top_p_token_ids: list[list[int]] = field(default_factory=list)
    # With return_log_probs: what each generated token adds to generated_text (made with it, once, by the
    # client's output processor; they concatenate to it)
    generated_token_texts: list[str] = field(default_factory=list)
    # With ``return_prompt_log_probs``: log probs of prompt tokens 1.. (the first has no context), and
    # with ``top_n_logprobs`` the n most likely tokens at each of those positions.
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # each prompt token's rank (1 = most likely), 1..
    policy_epochs: list[int] = field(default_factory=list)  # weights generation that produced each token
    kv_epochs: list[int] = field(default_factory=list)  # oldest generation of the KV cache each token attended to
    lora_epochs: list[int] = field(default_factory=list)  # adapter version that produced each token (-1: none)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    # Asked with return_routing_indices: [processed tokens, MoE layers, top_k] expert ids (see expert_routing)
    routing_indices: np.ndarray | None = field(default=None, compare=False)
    status: RequestStatus = RequestStatus.WAITING_IN_QUEUE
    finish_reason: FinishReason | None = None
    error: str | None = None
    events: list[RequestEvent] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    images: list[PromptImage] = field(default_factory=list)  # placed in prompt_tokens (vision-language models)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the final token (or failure)."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def prompt_scores_missing(self) -> int:
        """Prompt positions still to score for ``return_prompt_log_probs`` (0 when not asked for or done)."""
        if not self.sampling_params.return_prompt_log_probs:
            return 0
        return max(len(self.prompt_tokens) - 1 - len(self.prompt_log_probs), 0)

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.COMPLETED, RequestStatus.FAILED)

    def add_event(self, event_type: EventType, detail: str | None = None) -> None:
        stamp_event(self, event_type, detail)

    def fail(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        fail_timeline(self, message, reason)

    def final_record(self) -> FinalRecord:
        """How it went, as an engine's final record says it (a stand-in engine that keeps public records sends this)."""
        return FinalRecord(
            request_id=self.request_id, cached_tokens=self.cached_tokens, status=self.status,
            finish_reason=self.finish_reason, error=self.error, events=list(self.events),
            arrival_time=self.arrival_time, first_token_time=self.first_token_time, finish_time=self.finish_time)

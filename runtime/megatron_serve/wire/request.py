"""The request record that travels from the API through coordinator and engines and back.

One record per request for its whole life: preemption and moves between engines append events
and tokens to it instead of creating a new one.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import numpy as np

from .expert_routing import routing_from_wire, routing_to_wire
from ..multimodal import PromptImage
from .sampling_params import SamplingParams


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


_STATUSES: dict[str, RequestStatus] = {status.value: status for status in RequestStatus}
_FINISH_REASONS: dict[str, FinishReason] = {reason.value: reason for reason in FinishReason}
_E = TypeVar("_E")


def _member(members: dict[str, _E], value: Any, field: str) -> _E:
    """A dict lookup instead of the enum's own call, which costs 0.75 us in Python (a client reads two
    per result: from_dict went from 7.0 to 3.0 us with these and fewer needless conversions)."""
    try:
        return members[value]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: {value!r} is not one of {', '.join(members)}") from None


def top_logprobs_to_wire(top: list[dict[int, float]]) -> list[list[list]]:
    """Per-token ``{token id: log prob}`` as lists of ``[id, log prob]`` pairs (msgpack maps need str keys)."""
    return [[[token, log_prob] for token, log_prob in entry.items()] for entry in top]


def top_logprobs_from_wire(pairs: list[list[list]]) -> list[dict[int, float]]:
    return [{int(token): float(log_prob) for token, log_prob in entry} for entry in pairs]


@dataclass
class RequestEvent:
    type: EventType
    timestamp: float
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type.value, "timestamp": self.timestamp, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestEvent":
        return cls(EventType(data["type"]), data["timestamp"], data.get("detail"))


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
    # With ``return_prompt_log_probs``: log probs of prompt tokens 1.. (the first has no context), and
    # with ``top_n_logprobs`` the n most likely tokens at each of those positions.
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    policy_epochs: list[int] = field(default_factory=list)  # weights generation that produced each token
    kv_epochs: list[int] = field(default_factory=list)  # oldest generation of the KV cache each token attended to
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
        now = time.time()
        self.events.append(RequestEvent(event_type, now, detail))
        if event_type is EventType.FIRST_TOKEN and self.first_token_time is None:
            self.first_token_time = now
        if event_type in (EventType.FINISH, EventType.FAIL):
            self.finish_time = now

    def fail(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        self.status = RequestStatus.FAILED
        self.finish_reason = reason
        self.error = message
        self.add_event(EventType.FAIL, message)

    def to_dict(self, include_images: bool = False) -> dict[str, Any]:
        """Plain values for msgpack. Images (the files themselves) only with ``include_images``: an engine
        needs them, a result does not carry them back."""
        data = self.to_final_dict()
        data.update({
            "sampling_params": self.sampling_params.to_dict(),
            "generated_tokens": list(self.generated_tokens),
            "generated_text": self.generated_text,
            "generated_log_probs": list(self.generated_log_probs),
            "generated_top_n_logprobs": top_logprobs_to_wire(self.generated_top_n_logprobs),
            "prompt_log_probs": list(self.prompt_log_probs),
            "prompt_top_n_logprobs": top_logprobs_to_wire(self.prompt_top_n_logprobs),
            "policy_epochs": list(self.policy_epochs),
            "kv_epochs": list(self.kv_epochs),
        })
        if include_images and self.images:
            data["images"] = [image.to_wire() for image in self.images]
        if self.routing_indices is not None:  # absent unless asked for: older peers never see it
            data["routing_indices"] = routing_to_wire(self.routing_indices)
        return data

    def to_final_dict(self) -> dict[str, Any]:
        """The finished record without what travelled step by step with the tokens (the generated
        tokens, their log probs, epochs and expert rows, the prompt scores): a receiver that
        accumulated the steps (:mod:`megatron_serve.client.output_processor`) completes it."""
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_tokens": list(self.prompt_tokens),
            "cached_tokens": self.cached_tokens,
            "status": self.status.value,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "error": self.error,
            "events": [e.to_dict() for e in self.events],
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time,
            "finish_time": self.finish_time,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], sampling_params: SamplingParams | None = None
                  ) -> "DynamicInferenceRequest":
        """``sampling_params``: the caller's own copy (a client reading the result of what it submitted),
        used instead of parsing and validating the record's again."""
        get = data.get
        status, finish_reason, events, images = get("status"), get("finish_reason"), get("events"), get("images")
        top, prompt_top, routing = get("generated_top_n_logprobs"), get("prompt_top_n_logprobs"), get("routing_indices")
        arrival_time = get("arrival_time")
        return cls(
            request_id=data["request_id"],
            prompt=get("prompt"),
            prompt_tokens=list(data["prompt_tokens"]),
            sampling_params=sampling_params if sampling_params is not None else SamplingParams.from_dict(
                get("sampling_params")),
            generated_tokens=list(get("generated_tokens") or ()),
            generated_text=get("generated_text"),
            generated_log_probs=list(get("generated_log_probs") or ()),
            generated_top_n_logprobs=top_logprobs_from_wire(top) if top else [],
            prompt_log_probs=list(get("prompt_log_probs") or ()),
            prompt_top_n_logprobs=top_logprobs_from_wire(prompt_top) if prompt_top else [],
            policy_epochs=list(get("policy_epochs") or ()),
            kv_epochs=list(get("kv_epochs") or ()),
            cached_tokens=int(get("cached_tokens") or 0),
            routing_indices=None if routing is None else routing_from_wire(routing),
            status=RequestStatus.WAITING_IN_QUEUE if status is None else _member(_STATUSES, status, "status"),
            finish_reason=None if finish_reason is None else _member(_FINISH_REASONS, finish_reason, "finish_reason"),
            error=get("error"),
            events=[RequestEvent.from_dict(e) for e in events] if events else [],
            arrival_time=time.time() if arrival_time is None else arrival_time,
            first_token_time=get("first_token_time"),
            finish_time=get("finish_time"),
            images=[PromptImage.from_wire(image, f"images[{i}]") for i, image in enumerate(images)] if images else [],
        )

    def serialize(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def deserialize(cls, payload: bytes) -> "DynamicInferenceRequest":
        return cls.from_dict(msgpack.unpackb(payload, raw=False, strict_map_key=False))

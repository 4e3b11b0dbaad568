"""A deterministic stand-in for ``DynamicInferenceEngine`` (the ``ServedEngine`` interface, no model).

Token ``i+1`` is a fixed function of the last tokens, so a request continued on another engine
from its generated tokens produces exactly the tokens it would have produced in one place: tests
can check exactly-once delivery and continuation without a model.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from megatron_serve.engine.kv.events import KVEventLog
from megatron_serve.engine.served import EngineFacts, EngineLoad, Serving, Turn
from megatron_serve.engine.verbs.actions import call
from megatron_serve.multimodal import PromptImage
from megatron_serve.wire.kv_blocks import wants_remote_prefill
from megatron_serve.wire.request import (DynamicInferenceRequest, EngineRequest, EventType, FinalRecord, FinishReason,
                                         RequestStatus)

BLOCK_BYTES = 4096


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + 7) % 1000


def expected_tokens(prompt_tokens: list[int], n: int) -> list[int]:
    tokens = list(prompt_tokens)
    out = []
    for _ in range(n):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
    return out


@dataclass
class FakeStepOutput:
    """What a step did for one request (the ``EngineStepResult`` protocol): one token, no log probs."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    cached_tokens: int | None = None  # with the first token
    final: FinalRecord | None = None
    new_log_probs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    top_p_token_ids: list[list[int]] | None = None  # a fake keeps no filter's ids
    new_routing: tuple[int, object] | None = None  # fake engines route no experts
    epochs: tuple[int, int, int] = (-1, -1, -1)  # a fake reports no epochs
    prompt_scores: None = None
    stop_token: bool = False  # a fake ends by length (or as told), never at a stop id


class _Memory:
    """A fake engine's device-memory verbs (``engine.memory``): the fake's own methods, which a test's fake
    overrides."""

    def __init__(self, fake: "FakeEngine") -> None:
        self.fake = fake

    @property
    def kept_kv_bytes(self) -> int:
        return self.fake.kept_kv_bytes

    def suspend(self, level: int = 1, keep_kv: bool = False) -> int:
        return self.fake.suspend(level, keep_kv)

    def resume(self) -> None:
        self.fake.resume()

    def verify_refit(self, source: str) -> float:
        return self.fake.verify_refit(source)

    def refit(self, source: str, epoch: int | None = None) -> dict[str, float]:
        return self.fake.refit(source, epoch)

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict[str, object]:
        return self.fake.reset_prefix_cache(reset_running_requests)

    def scale_expert_group(self, size: int) -> dict[str, object]:
        """A fake is no rank of an expert-parallel group: SCALE_EP is refused, as a real engine's outside one."""
        return {"error": f"scale-ep {size}: a fake engine is no rank of an expert-parallel group"}

    @property
    def peers(self) -> None:
        """A fake never reports a layout digest, so the coordinator never pairs it for a peer pull."""
        return None


class _Adapters:
    """A fake engine's LoRA verbs (``engine.adapters``): the fake's own methods, which a test's fake overrides."""

    def __init__(self, fake: "FakeEngine") -> None:
        self.fake = fake

    def names(self) -> dict[str, str] | None:
        return self.fake.lora_adapters()

    def verify(self, name: str, path: str) -> float:
        return self.fake.verify_lora_adapter(name, path)

    def load(self, name: str, path: str) -> float:
        return self.fake.load_lora_adapter(name, path)

    def unload(self, name: str) -> None:
        self.fake.unload_lora_adapter(name)


class FakeEngine:
    def __init__(self, max_requests: int = 8, step_delay: float = 0.0, kv_blocks: int = 32,
                 block_size: int | None = None) -> None:
        self.max_requests = max_requests
        self.block_size = block_size  # a block size makes it report prefix caching (prefix_affinity routing)
        self.epoch = 0
        self.computed_tokens = 0
        self.cached_tokens = 0
        self.step_delay = step_delay
        self._kv_blocks = kv_blocks
        self.requests: dict[str, DynamicInferenceRequest] = {}
        self.suspended = False
        self.steps = 0
        self.prefix_resets = 0
        self.kv_events = KVEventLog(block_size or 16)  # a fake caches nothing: its events say so
        self.memory = _Memory(self)
        self.adapters = _Adapters(self)
        self.serving = Serving()  # the verbs are the real engine's table (engine.verbs.actions), over this fake
        self._gate = threading.Event()
        self._gate.set()

    def freeze(self) -> None:
        """The next step blocks until ``thaw()``: a hung engine (no steps, and no loop to answer anything)."""
        self._gate.clear()

    def thaw(self) -> None:
        self._gate.set()

    @property
    def num_running(self) -> int:
        return min(len(self.requests), self.max_requests)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self.requests) - self.max_requests)

    @property
    def kv_blocks_total(self) -> int:
        return self._kv_blocks

    @property
    def kv_blocks_free(self) -> int:
        return 0 if self.suspended else self._kv_blocks - self.num_running

    def load(self) -> EngineLoad:
        return EngineLoad(running=self.num_running, waiting=self.num_waiting, kv_blocks_free=self.kv_blocks_free,
                          kv_blocks_total=self.kv_blocks_total, cached_tokens=self.cached_tokens,
                          computed_tokens=self.computed_tokens)

    def facts(self) -> EngineFacts:
        return EngineFacts(capacity=self.max_requests, kv_blocks_total=self._kv_blocks, block_size=self.block_size,
                           prefix_caching=self.block_size is not None)

    def metrics_snapshot(self) -> None:
        return None  # keeps no metrics

    def verify_refit(self, source: str) -> float:
        raise NotImplementedError("this engine cannot refit its weights")

    def refit(self, source: str, epoch: int | None = None) -> dict[str, float]:
        raise NotImplementedError("this engine cannot refit its weights")

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict[str, object]:
        """A fake caches nothing; it refuses while it runs requests unless they go back to be recomputed (vLLM's
        rule, the real engine's), and counts its resets."""
        if self.num_running and not reset_running_requests:
            return {"reset": False, "held_blocks": self.num_running}
        self.prefix_resets += 1
        return {"reset": True, "forgotten_blocks": 0, "recomputed": self.num_running}

    def lora_adapters(self) -> dict[str, str] | None:
        return None  # started without enable_lora

    def verify_lora_adapter(self, name: str, path: str) -> float:
        raise ValueError("LoRA adapters need an engine started with enable_lora")

    load_lora_adapter = verify_lora_adapter

    def unload_lora_adapter(self, name: str) -> None:
        raise ValueError("LoRA adapters need an engine started with enable_lora")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def group_turn(self, busy: bool, holding: bool = False) -> Turn:
        return Turn(busy, holding)  # one engine: no data-parallel ranks to step with

    def idle(self) -> None:
        pass  # no KV tiers: nothing lands between steps

    def call(self, step, body) -> dict:
        return call(self, step, body)

    def add_request(self, request: EngineRequest, kv_transfer_params: dict | None = None) -> None:
        record = DynamicInferenceRequest(
            request.request_id, None, list(request.prompt_tokens), request.sampling_params,
            generated_tokens=list(request.generated_tokens), events=list(request.events),
            arrival_time=request.arrival_time,
            images=[PromptImage(image.data, image.offset, image.length) for image in request.images])
        record.add_event(EventType.ADD)
        self.requests[request.request_id] = record
        if wants_remote_prefill(kv_transfer_params):
            raise NotImplementedError("a fake engine receives no KV blocks")  # it never prefills for another

    def kv_in(self, part) -> None:
        raise NotImplementedError("a fake engine receives no KV blocks")

    def kv_out(self, engine_id: str) -> list:
        return []  # it never prefills for another engine

    def step(self) -> list[FakeStepOutput]:
        if self.suspended:
            return []
        self._gate.wait()
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        outputs = []
        for request in list(self.requests.values())[: self.max_requests]:
            token = next_token(request.prompt_tokens + request.generated_tokens)
            request.generated_tokens.append(token)
            request.status = RequestStatus.ACTIVE
            done = len(request.generated_tokens) >= request.sampling_params.num_tokens_to_generate
            if done:
                request.status = RequestStatus.COMPLETED
                request.finish_reason = FinishReason.LENGTH
                request.add_event(EventType.FINISH, "length")
                del self.requests[request.request_id]
            outputs.append(FakeStepOutput(request.request_id, [token], done,
                                          cached_tokens=0 if len(request.generated_tokens) == 1 else None,
                                          final=request.final_record() if done else None))
        return outputs

    def sync(self) -> list[FakeStepOutput]:
        return []  # nothing in flight: every step finishes when it returns

    def abort_request(self, request_id: str) -> FinalRecord | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.fail("aborted", FinishReason.ABORT)
        return request.final_record()

    def take_unfinished_requests(self, forget_transfers: bool = False) -> list[FinalRecord]:
        taken = list(self.requests.values())
        self.requests.clear()
        for request in taken:
            request.status = RequestStatus.WAITING_IN_QUEUE
        return [request.final_record() for request in taken]

    kept_kv_bytes = 0  # a fake keeps no KV

    def suspend(self, level: int = 1, keep_kv: bool = False) -> int:
        if self.suspended:
            return 0
        self.suspended = True
        return self._kv_blocks * BLOCK_BYTES

    def resume(self) -> None:
        self.suspended = False

"""A request waiting for an adapter slot gets one in bounded time: one slot drains (its adapter's new requests queue
behind the waiting ones, its running requests finish), nothing running is preempted, and every request gets the
tokens it gets alone. vLLM lets new requests of the adapters in the slots pass the waiting one without end."""

from __future__ import annotations

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.lora.queue import LoraQueue
from megatron_serve.model.tiny import make_tiny_model

from ..lora_adapters import make_peft_adapter
from ..prompts import PROMPTS, run_requests


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora-drain"), seed=5)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_peft_adapter(base, root / name, rank=8, seed=seed))
            for seed, name in enumerate(("a", "b", "c"), start=1)}


def _engine(base, adapters, max_loras: int) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_model_dir(base, InferenceConfig(
        dtype="float32", block_size_tokens=16, enable_lora=True, max_loras=max_loras, max_lora_rank=8,
        lora_modules=adapters))


def _params(name: str, tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=tokens, ignore_eos=True, lora_name=name)


class _Run:
    """Requests added to one engine over time; records the step at which each produced its first token."""

    def __init__(self, engine: DynamicInferenceEngine):
        self.engine, self.steps, self.started = engine, 0, {}
        self.requests: dict[str, DynamicInferenceRequest] = {}

    def add(self, request_id: str, prompt: str, name: str, tokens: int) -> None:
        request = DynamicInferenceRequest(request_id, prompt, self.engine.tokenizer.encode(prompt),
                                          _params(name, tokens))
        self.requests[request_id] = request
        self.engine.add_request(request)

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            self.engine.step()
            self.steps += 1
            for request_id, request in self.requests.items():
                if request.generated_tokens and request_id not in self.started:
                    self.started[request_id] = self.steps

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def _alone(base, adapters, jobs: dict[str, tuple[str, str, int]]) -> dict[str, list[int]]:
    engine = _engine(base, adapters, max_loras=3)
    return {request_id: run_requests(engine, [(prompt, _params(name, tokens))])[0].generated_tokens
            for request_id, (prompt, name, tokens) in jobs.items()}


ONE_SLOT_JOBS = {"a1": (PROMPTS[1], "a", 10), "b": (PROMPTS[2], "b", 6), "a2": (PROMPTS[3], "a", 6)}


def _one_slot_run(base, adapters) -> _Run:
    """One slot: a1 (adapter a) running, then b (adapter b) arrives and waits."""
    run = _Run(_engine(base, adapters, max_loras=1))
    run.add("a1", *ONE_SLOT_JOBS["a1"])
    run.step(2)
    run.add("b", *ONE_SLOT_JOBS["b"])
    return run


def test_one_slot_drains_for_a_waiting_adapter_and_later_requests_queue_behind_it(base, adapters):
    """One slot, adapter a running: b waits, and a request of a arriving after b queues behind it instead of sharing
    the slot (vLLM would let it in, and every later one, before b); b starts once a's first request finished."""
    run = _one_slot_run(base, adapters)
    assert run.engine.scheduler.lora_queue.draining == 0 and run.engine.load().waiting == 1
    run.add("a2", *ONE_SLOT_JOBS["a2"])
    assert run.engine.load().waiting == 2, "a's slot drains: a2 waits behind b"
    run.finish()
    finished_a1 = run.started["a1"] + len(run.requests["a1"].generated_tokens) - 1
    assert finished_a1 < run.started["b"] < run.started["a2"]
    assert {i: r.generated_tokens for i, r in run.requests.items()} == _alone(base, adapters, ONE_SLOT_JOBS)
    assert all(r.error is None for r in run.requests.values())
    assert run.engine.scheduler.lora_queue.draining is None


def test_control_without_a_draining_slot_later_requests_pass_the_waiting_one(base, adapters, monkeypatch):
    """The control, vLLM's rule (no slot drains): a2 shares a's slot at once and b waits for both a1 and a2."""
    monkeypatch.setattr(LoraQueue, "draining", property(lambda self: None))
    run = _one_slot_run(base, adapters)
    run.add("a2", *ONE_SLOT_JOBS["a2"])
    run.finish()
    assert run.started["a2"] < run.started["b"]


def test_only_the_least_busy_slot_drains(base, adapters):
    """Two slots, a (two requests) and c (one): b waits on c's slot, the one with fewer requests to finish; a new
    request of a still shares a's slot at once, a new one of c waits; b starts in c's slot once c's request ends."""
    jobs = {"a1": (PROMPTS[1], "a", 14), "a2": (PROMPTS[4], "a", 14), "c1": (PROMPTS[5], "c", 5),
            "b": (PROMPTS[2], "b", 6), "a3": (PROMPTS[3], "a", 4), "c2": (PROMPTS[7], "c", 4)}
    run = _Run(_engine(base, adapters, max_loras=2))
    for request_id in ("a1", "a2", "c1"):
        run.add(request_id, *jobs[request_id])
    run.step(2)
    c_slot = run.engine.scheduler.requests["c1"].lora_slot
    run.add("b", *jobs["b"])
    assert run.engine.scheduler.lora_queue.draining == c_slot
    run.add("a3", *jobs["a3"])
    run.add("c2", *jobs["c2"])
    assert {s.request_id for s in run.engine.scheduler.lora_queue.sequences()} == {"b", "c2"}  # a3 is in the scheduler's queue
    run.finish()
    assert run.started["a3"] < run.started["b"] < run.started["c2"], "a3 shared a's slot at once; c2 waited"
    assert run.started["b"] < run.started["a1"] + len(run.requests["a1"].generated_tokens) - 1, "b took c's slot"
    assert {i: r.generated_tokens for i, r in run.requests.items()} == _alone(base, adapters, jobs)
